"""``Level``: one tier in the chain as the store sees it — the medium, its policies, its index.

A level owns the bookkeeping of a *managed* tier: the index of entries
(RESERVED, READY, or doomed-but-pinned), the bytes they account for, and the
pins of readers.  The store decides *what* happens (placement, eviction,
demotion); the level makes each step keep its invariants:

* ``used`` is always the sum of ``footprint`` over the entries in ``index``
  and never exceeds ``capacity`` (``reserve`` refuses what does not fit);
* a READY entry is known to the eviction policy (told with its footprint, the
  one unit of size everywhere) and marked in the store's ``where`` map; a
  RESERVED one is neither;
* a pinned entry is never freed: ``drop`` makes it unreadable at once, and the
  last ``unpin`` frees its space and deletes its bytes.

Every method expects the caller to hold the store's lock.  A policy hook that
raises is reported as ``PolicyError`` *after* the level's own state is
consistent again, so the caller only has to release what it holds.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Union

from tierkv.errors import ConfigError, PolicyError
from tierkv.options import check_bool, check_choice
from tierkv.policies import AdmissionPolicy, AdmitAll, EvictionPolicy, build_admission, build_eviction
from tierkv.stats import TierCounters
from tierkv.tiers.base import Tier

log = logging.getLogger("tierkv")

#: how a level receives chunks stored above it
PERSIST_MODES = ("write_behind", "write_through", "on_evict")


class Entry:
    """One object of a managed level: RESERVED (``ready`` False) or READY; ``doomed`` once dropped."""

    __slots__ = ("doomed", "footprint", "nbytes", "pins", "ready")

    def __init__(self, nbytes: int, footprint: int, ready: bool = False) -> None:
        self.nbytes = nbytes
        self.footprint = footprint
        self.ready = ready
        self.pins = 0
        self.doomed = False


def call_policy(policy: Any, hook: str, tier: str, *args: Any) -> Any:
    """Call a policy hook; any exception it raises becomes a ``PolicyError`` naming policy, hook and tier."""
    try:
        return getattr(policy, hook)(*args)
    except PolicyError:
        raise
    except Exception as e:
        raise PolicyError(f"{type(policy).__name__}.{hook} raised for tier {tier!r}: "
                          f"{type(e).__name__}: {str(e)[:200]}") from e


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


def resolve_persist(tier: Tier, persist: Optional[str], write_through: Optional[bool]) -> str:
    """The level's persistence mode from the two options (``write_through`` is the older spelling)."""
    what = f"tier {tier.name!r}"
    if write_through is not None:
        write_through = check_bool(write_through, f"{what} option 'write_through'")
    if persist is not None:
        persist = check_choice(persist, f"{what} option 'persist'", PERSIST_MODES)
        if write_through is not None and write_through != (persist == "write_through"):
            raise ConfigError(f"{what}: 'write_through': {str(write_through).lower()} contradicts "
                              f"'persist': {persist!r} (give only 'persist')")
        return persist
    if write_through:
        return "write_through"
    return "write_behind" if (tier.persistent and tier.managed) else "on_evict"


class Level:
    """One tier in the chain: the medium, its eviction and admission policies, and its index."""

    def __init__(
        self,
        tier: Tier,
        eviction: Union[str, EvictionPolicy, dict, None] = None,
        admission: Union[str, AdmissionPolicy, dict, None] = None,
        write_through: Optional[bool] = None,
        persist: Optional[str] = None,
    ) -> None:
        if not isinstance(tier, Tier):
            raise TypeError(f"a level needs a Tier, got {type(tier).__name__}")
        self.tier = tier
        self.name = tier.name
        self.managed = tier.managed
        if not self.managed and eviction is not None:
            raise ConfigError(f"tier {tier.name!r} ({tier.medium}) manages its own space: it takes no 'eviction'")
        self.eviction: Optional[EvictionPolicy] = build_eviction(eviction) if self.managed else None
        if self.eviction is not None:
            self.eviction.capacity_bytes = tier.capacity_bytes
        self._insert_many = batch_hook(self.eviction, "on_insert", "on_insert_many")
        self._access_many = batch_hook(self.eviction, "on_access", "on_access_many")
        self.admission: AdmissionPolicy = build_admission(admission)
        #: the default admission: the store skips asking it
        self.admits_all = type(self.admission) is AdmitAll
        self.persist = resolve_persist(tier, persist, write_through)
        if self.persist == "write_behind" and not self.managed:
            raise ConfigError(f"tier {tier.name!r} ({tier.medium}) is a shared pool: 'persist' may be "
                              "'write_through' or 'on_evict', not 'write_behind'")
        self.index: dict[str, Entry] = {}
        self.pinned: set[str] = set()
        self.used = 0
        self.ready_count = 0
        self.counters = TierCounters()
        self.bit = 0
        self._where: dict[str, int] = {}

    @property
    def write_through(self) -> bool:
        return self.persist == "write_through"

    @property
    def write_behind(self) -> bool:
        return self.persist == "write_behind"

    @property
    def capacity(self) -> int:
        return self.tier.capacity_bytes

    def bind(self, bit: int, where: dict[str, int]) -> None:
        """Join a store: ``bit`` marks this level in the store's ``where`` map (key -> bitmask of READY levels)."""
        self.bit = bit
        self._where = where

    def entries(self) -> int:
        """How many READY objects the level holds."""
        return self.ready_count

    # -- two-phase writes ------------------------------------------------------
    def reserve(self, key: str, nbytes: int) -> bool:
        """Reserve room for ``key`` without evicting; False if it is there already or does not fit."""
        fp = self.tier.footprint(nbytes)
        if key in self.index or self.used + fp > self.capacity:
            return False
        self.index[key] = Entry(nbytes, fp)
        self.used += fp
        return True

    def commit(self, key: str) -> None:
        """Make a reservation READY: readable, known to the eviction policy."""
        self.commit_many([key])

    def commit_many(self, keys: list[str]) -> None:
        """``commit`` for a batch, with one policy call (``on_insert_many`` when the policy has it).

        If the policy raises, none of the batch stays: an entry the policy does not
        know could never be evicted.
        """
        index, where, bit = self.index, self._where, self.bit
        entries = []
        for key in keys:
            e = index.get(key)
            if e is None or e.ready or e.doomed:
                raise PolicyError(f"tier {self.name!r}: no reservation for {key[:80]!r}")
            entries.append(e)
        for key, e in zip(keys, entries):
            e.ready = True
            where[key] = where.get(key, 0) | bit
        self.ready_count += len(keys)
        try:
            if self._insert_many:
                call_policy(self.eviction, "on_insert_many", self.name, keys, [e.footprint for e in entries])
            else:
                for key, e in zip(keys, entries):
                    call_policy(self.eviction, "on_insert", self.name, key, e.footprint)
        except BaseException:
            for key, e in zip(keys, entries):  # none of them may stay unknown to the policy
                self._unmark(key, e)
                e.doomed = True
                if e.pins == 0:
                    self._free(key, e)
                try:
                    self.eviction.on_remove(key)  # type: ignore[union-attr]
                except Exception:  # noqa: BLE001 - a plug-in or medium fault is contained here by design
                    pass
            raise

    def accessed(self, keys: list[str]) -> None:
        """Tell the eviction policy these READY keys were read (one call when it has ``on_access_many``)."""
        if not keys:
            return
        if self._access_many:
            call_policy(self.eviction, "on_access_many", self.name, keys)
        else:
            for key in keys:
                call_policy(self.eviction, "on_access", self.name, key)

    def abort(self, key: str) -> None:
        """Release a reservation whose write failed (or never ran)."""
        e = self.index.get(key)
        if e is not None and not e.ready and not e.doomed:
            del self.index[key]
            self.used -= e.footprint

    # -- readers -----------------------------------------------------------------
    def pin(self, key: str) -> Entry:
        e = self.index[key]
        e.pins += 1
        self.pinned.add(key)
        return e

    def unpin(self, key: str, e: Entry) -> None:
        e.pins -= 1
        if e.pins == 0:
            self.pinned.discard(key)
            if e.doomed:
                self._free(key, e)

    # -- leaving -------------------------------------------------------------------
    def drop(self, key: str, e: Entry) -> None:
        """Make a READY entry unreadable now; its space is freed when no reader holds it."""
        if e.doomed:
            return
        was_ready = e.ready
        self._unmark(key, e)
        e.doomed = True
        if e.pins == 0:
            self._free(key, e)
        if was_ready:
            call_policy(self.eviction, "on_remove", self.name, key)

    def _unmark(self, key: str, e: Entry) -> None:
        if e.ready:
            e.ready = False
            self.ready_count -= 1
            mask = self._where.get(key, 0) & ~self.bit
            if mask:
                self._where[key] = mask
            else:
                self._where.pop(key, None)

    def _free(self, key: str, e: Entry) -> None:
        if self.index.get(key) is e:
            del self.index[key]
            self.used -= e.footprint
            try:
                self.tier.delete([key])
            except Exception as exc:  # the bytes are unreachable through the index either way  # noqa: BLE001 - a plug-in or medium fault is contained here by design
                log.warning("tierkv: tier %s delete failed: %s", self.name, exc)

    # -- eviction ------------------------------------------------------------------
    def victims(self, need: int) -> Optional[list[str]]:
        """Ask the policy for victims freeing ``need`` footprint bytes, then check its answer."""
        policy = self.eviction
        pname = type(policy).__name__
        raw = call_policy(policy, "victims", self.name, need, self.pinned)
        if raw is None:
            return None
        try:
            victims = list(raw)
        except TypeError:
            raise PolicyError(f"eviction policy {pname} of tier {self.name!r} returned "
                              f"{type(raw).__name__}, not a list of keys") from None
        freed, seen = 0, set()
        for v in victims:
            e = self.index.get(v) if isinstance(v, str) else None
            if e is None or not e.ready or e.doomed:
                raise PolicyError(f"eviction policy {pname} of tier {self.name!r} named {str(v)[:80]!r}, "
                                  "which the tier does not hold (did on_remove forget it?)")
            if v in self.pinned:
                raise PolicyError(f"eviction policy {pname} named the protected key {v[:80]!r}")
            if v in seen:
                raise PolicyError(f"eviction policy {pname} named {v[:80]!r} twice")
            seen.add(v)
            freed += e.footprint
        if freed < need:
            # a policy that counts other sizes than the footprints it was given: ask for the rest
            more = call_policy(policy, "victims", self.name, need - freed, self.pinned | seen)
            if more is None:
                return None
            for v in more:
                e = self.index.get(v) if isinstance(v, str) else None
                if v in seen or e is None or not e.ready or e.doomed or v in self.pinned:
                    continue
                victims.append(v)
                seen.add(v)
                freed += e.footprint
                if freed >= need:
                    break
            if freed < need:
                return None
        return victims
