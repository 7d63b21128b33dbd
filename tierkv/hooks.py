"""The checked side of policies: what the store calls instead of a user's policy object directly.

Every call the store and its levels make into a policy goes through one of three small
wrappers, a non-virtual interface over the hooks users override (whose names stay
``on_insert``, ``on_access``, ``on_remove``, ``victims``, ``admit``, ``should_promote``...):

* ``CheckedEviction`` (one per managed level): batch hooks where the policy's batch hook may
  stand for its single one (``batch_hook``), the answer of ``victims`` turned into a list or
  refused;
* ``CheckedAdmission`` (one per level): the policy's own checked ``decide`` (``ADMIT``, ``REJECT``
  or ``THROTTLED``), ``on_access`` told only when the policy observes demand; ``admits_all`` when
  it admits everything, and is then never asked;
* ``CheckedPromotion`` (one per store): the policy's checked ``decide`` (a bool), ``on_remove``.

A hook that raises surfaces as one ``PolicyError`` naming the policy class, the hook and the
tier, whatever the policy raised; a ``PolicyError`` a hook raises itself passes unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence
from typing import Any, Optional

from tierkv.errors import PolicyError, call_policy_hook
from tierkv.outcome import Admission
from tierkv.policies import AdmissionPolicy, EvictionPolicy, PromotionPolicy


def batch_hook(policy: Any, single: str, many: str) -> bool:
    """Whether ``policy.many`` may stand for a loop over ``policy.single``.

    Only when the class that defines the batch hook is the one that defines the single
    hook, or derives from it: a subclass that overrides ``on_insert`` of a built-in
    policy, but not its ``on_insert_many``, must still have its override called.
    """
    if policy is None:
        return False

    def owner(name: str) -> Optional[type]:
        for k in type(policy).__mro__:
            if name in k.__dict__:
                return k
        return None

    o_many, o_single = owner(many), owner(single)
    return o_many is not None and o_single is not None and issubclass(o_many, o_single)


class Checked:
    """What the three wrappers share: the policy, the tier it serves, and the one place a hook is called."""

    __slots__ = ("pname", "policy", "tier")

    def __init__(self, policy: Any, tier: str) -> None:
        self.policy = policy
        self.tier = tier
        self.pname = type(policy).__name__

    def _call(self, hook: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, a hook of the policy; any exception becomes a ``PolicyError`` naming it
        (``tierkv.errors.call_policy_hook``, the one place a user's hook is called)."""
        return call_policy_hook(self.policy, hook, self.tier, fn, *args)

    def _each(self, batched: bool, many: str, one: str, keys: list[str], *cols: Sequence[Any]) -> None:
        """The hook ``many(keys, *cols)`` when the policy has its batch form (``batch_hook``), else ``one`` key by
        key, with each key's item of every column."""
        p = self.policy
        if batched:
            self._call(many, getattr(p, many), keys, *cols)
        else:
            fn = getattr(p, one)
            for row in zip(keys, *cols):
                self._call(one, fn, *row)


class CheckedEviction(Checked):
    """A level's eviction policy as the level calls it (see the module docstring)."""

    __slots__ = ("_access_many", "_insert_many", "_remove_many")

    def __init__(self, policy: EvictionPolicy, tier: str) -> None:
        super().__init__(policy, tier)
        self._insert_many = batch_hook(policy, "on_insert", "on_insert_many")
        self._access_many = batch_hook(policy, "on_access", "on_access_many")
        self._remove_many = batch_hook(policy, "on_remove", "on_remove_many")

    def inserted(self, keys: list[str], sizes: Sequence[int]) -> None:
        """These keys became READY, with these footprints."""
        self._each(self._insert_many, "on_insert_many", "on_insert", keys, sizes)

    def adopted(self, keys: list[str], sizes: Sequence[int]) -> None:
        """These keys, recovered by a persistent medium, became READY (oldest first)."""
        p = self.policy
        if hasattr(p, "on_adopt"):
            self._call("on_adopt", p.on_adopt, keys, sizes)
        else:  # (a policy that is no ``EvictionPolicy`` subclass)
            self._call("on_insert_many", p.on_insert_many, keys, sizes)

    def accessed(self, keys: list[str]) -> None:
        """These READY keys were read."""
        self._each(self._access_many, "on_access_many", "on_access", keys)

    def removed(self, keys: list[str]) -> None:
        """These keys left the tier."""
        self._each(self._remove_many, "on_remove_many", "on_remove", keys)

    def report(self) -> dict[str, Any]:
        """The policy's ``memory_bytes()`` and ``counters()`` (a policy that is no ``EvictionPolicy`` subclass and
        has neither reports nothing); an answer that is not an int, or not a dict of ints, is a ``PolicyError``."""
        p = self.policy
        mem = self._call("memory_bytes", p.memory_bytes) if hasattr(p, "memory_bytes") else 0
        counters = self._call("counters", p.counters) if hasattr(p, "counters") else {}
        if type(mem) is not int or not isinstance(counters, dict) or \
                not all(isinstance(k, str) and type(v) is int for k, v in counters.items()):
            raise PolicyError(f"eviction policy {self.pname} of tier {self.tier!r}: memory_bytes() must answer an "
                              "int and counters() a dict of str -> int")
        return {"memory_bytes": mem, "counters": dict(counters)}

    def forget_quietly(self, keys: list[str]) -> None:
        """``removed``, on a path already raising: the policy's own fault here is dropped."""
        for key in keys:
            try:
                self.policy.on_remove(key)
            except Exception:  # noqa: BLE001 - the first fault is the one reported
                pass

    def victims(self, need: int, protected: Container[str]) -> Optional[list]:
        """The policy's victims as a fresh list (None: it cannot free ``need``); an answer that is no
        sequence, or an iterator that raises, is the policy's fault (``PolicyError``)."""
        raw = self._call("victims", self.policy.victims, need, protected)
        if raw is None:
            return None
        try:  # (a copy: the policy may keep the list it answered and change it later)
            return list(raw)
        except TypeError as e:
            if not hasattr(raw, "__iter__"):
                raise PolicyError(f"eviction policy {self.pname} of tier {self.tier!r} returned "
                                  f"{type(raw).__name__}, not a list of keys") from None
            raise PolicyError(f"eviction policy {self.pname} of tier {self.tier!r}: its victims raised "
                              f"TypeError: {str(e)[:200]}") from e
        except Exception as e:
            raise PolicyError(f"eviction policy {self.pname} of tier {self.tier!r}: its victims raised "
                              f"{type(e).__name__}: {str(e)[:200]}") from e


class CheckedAdmission(Checked):
    """A level's admission policy as the store asks it (see the module docstring)."""

    __slots__ = ("admits_all", "observes")

    def __init__(self, policy: AdmissionPolicy, tier: str) -> None:
        super().__init__(policy, tier)
        #: the policy admits every chunk: never asked
        self.admits_all = bool(policy.admits_everything)
        #: the policy observes demand (``on_access`` does something)
        self.observes = bool(policy.observes_demand)

    def decide(self, key: str, nbytes: int) -> Admission:
        """The policy's answer for a chunk of ``nbytes`` in its tier (``AdmissionPolicy.decide``, checked)."""
        if self.admits_all:
            return Admission.ADMIT
        return self._call("admit", self.policy.decide, key, nbytes, self.tier)

    def accessed(self, keys: list[str]) -> None:
        """These keys were asked for (a put or a get)."""
        fn = self.policy.on_access
        for key in keys:
            self._call("on_access", fn, key)


class CheckedPromotion(Checked):
    """The store's promotion policy as its copier asks it (see the module docstring)."""

    __slots__ = ()

    def __init__(self, policy: PromotionPolicy) -> None:
        super().__init__(policy, "*")

    def should_promote(self, key: str, src: str, dst: str) -> bool:
        """Whether a chunk read from tier ``src`` is copied up into tier ``dst`` (``PromotionPolicy.decide``)."""
        return self._call("should_promote", self.policy.decide, key, src, dst)

    def removed(self, keys: list[str]) -> None:
        """These keys left the store entirely."""
        fn = self.policy.on_remove
        for key in keys:
            self._call("on_remove", fn, key)
