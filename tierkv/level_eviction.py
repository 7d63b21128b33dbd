"""How a ``Level`` gives chunks up: checking the eviction policy's victims, and freeing a batch of them.

Part of ``Level`` (a mixin it inherits), split out so each module holds one concern;
``level.py`` holds the index, reservations and pins these methods keep consistent.
Every method expects the caller to hold the store's lock.

* ``victims`` asks the policy and refuses an answer that names a key the level does
  not hold READY, a pinned key, or one key twice (``PolicyError``); a policy that
  frees too little is asked once more for the rest.
* ``evict_many`` drops each victim and releases the one pin the eviction holds on it;
  a key another reader still holds stays readable to that reader (doomed) until its
  last ``unpin``.  Every pin the call was given is released, raising or not.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Optional

from tierkv.errors import PolicyError
from tierkv.hooks import call_policy
from tierkv.tiers.base import NB_FIELD

log = logging.getLogger("tierkv")

_NB_MASK = NB_FIELD
_INT = {int}
_ONE = {1}
_STR = {str}


class Eviction:
    """The eviction half of ``Level`` (see the module docstring)."""

    if TYPE_CHECKING:  # defined by ``Level``
        name: str
        index: dict[str, Any]
        pinned: dict[str, int]
        eviction: Any
        tier: Any
        counters: Any
        located: bool
        used: int
        ready_count: int
        ready_bytes: int
        _fp_only: dict[int, int]
        _remove_many: bool

        def value_footprint(self, v: int) -> int: ...
        def unpack(self, v: int) -> tuple[int, int]: ...
        def unpin(self, key: str, _e: Any = None) -> None: ...
        def _discard(self, key: str) -> None: ...
        def _give_back(self, codes: list[int]) -> None: ...

    def evict_many(self, keys: list[str]) -> None:
        """``drop`` each key, then release the one pin the caller (an eviction) holds on it: a key no other
        reader holds is freed now, in one ``free_at`` / ``delete`` call for the batch."""
        index, pinned = self.index, self.pinned
        codes: list[int] = []
        gone: list[str] = []  # READY keys that left: the policy is told once, after the index is consistent
        done = 0
        vals: list[Any] = list(map(index.get, keys))
        if (vals and set(map(type, vals)) == _INT and min(vals) > 0 and set(map(pinned.get, keys)) == _ONE
                and len(set(keys)) == len(keys)):
            # the common case: distinct READY keys, each held by this eviction alone: all leave at once
            fields = [v >> 1 & _NB_MASK for v in vals]
            # (a field at the marker is a large chunk's: its size lives elsewhere)
            fps: list[Any] = list(map(self._fp_only.get, fields)) if _NB_MASK not in fields else [None]
            if None in fps:
                fps = [self.value_footprint(v) for v in vals]
            for key in keys:
                del pinned[key]
                del index[key]
            freed = sum(fps)
            self.ready_count -= len(keys)
            self.ready_bytes -= freed
            self.used -= freed
            codes, gone, done = vals, list(keys), len(keys)
            keys = []  # (nothing left for the loop below)
        try:
            for key in keys:
                done += 1
                v = index.get(key)
                if type(v) is not int or v < 0 or pinned.get(key) != 1:  # doomed, or read by others too
                    if type(v) is int and v > 0:
                        gone.append(key)
                        self._discard(key)
                    self.unpin(key)
                    continue
                del pinned[key]
                del index[key]
                self.ready_count -= 1
                fp = self.value_footprint(v)
                self.ready_bytes -= fp
                self.used -= fp
                codes.append(v)
                gone.append(key)
        finally:
            for key in keys[done:]:  # a fault part way: the caller's pins on the rest are still released
                if key in pinned:
                    self.unpin(key)
            if codes:
                if self.located:
                    self._give_back(codes)
                else:
                    dead = [k for k in gone if k not in index]
                    try:
                        self.tier.delete(dead)
                    except Exception as exc:  # noqa: BLE001 - a plug-in or medium fault is contained here by design
                        log.warning("tierkv: tier %s delete failed: %s", self.name, exc)
                        self.counters.errors += 1  # (the bytes stay on the medium: counted, not only logged)
            if gone:
                if self._remove_many:
                    call_policy(self.eviction, "on_remove_many", self.name, gone)
                else:
                    for key in gone:
                        call_policy(self.eviction, "on_remove", self.name, key)

    def _fast_victims(self, victims: list) -> Optional[int]:
        """The footprint bytes of ``victims`` when they pass every check at once (distinct READY keys of
        this level, none pinned, sizes remembered); None to check them one by one."""
        if not victims or set(map(type, victims)) != _STR or len(set(victims)) != len(victims):
            return None
        vals: list[Any] = list(map(self.index.get, victims))
        if set(map(type, vals)) != _INT or min(vals) < 0 or not self.pinned.keys().isdisjoint(victims):
            return None
        fields = [v >> 1 & _NB_MASK for v in vals]
        if _NB_MASK in fields:  # a large chunk's size lives elsewhere: the per-key path
            return None
        fps: list[Any] = list(map(self._fp_only.get, fields))
        return None if None in fps else sum(fps)

    def _listed(self, raw: Any, pname: str) -> list:
        """A policy's answer as a list; an answer that is no sequence, or an iterator that raises, is the
        policy's fault (``PolicyError``)."""
        try:  # (a copy: the policy may keep the list it answered and change it later)
            return list(raw)
        except TypeError as e:
            if not hasattr(raw, "__iter__"):
                raise PolicyError(f"eviction policy {pname} of tier {self.name!r} returned "
                                  f"{type(raw).__name__}, not a list of keys") from None
            raise PolicyError(f"eviction policy {pname} of tier {self.name!r}: its victims raised "
                              f"TypeError: {str(e)[:200]}") from e
        except Exception as e:
            raise PolicyError(f"eviction policy {pname} of tier {self.name!r}: its victims raised "
                              f"{type(e).__name__}: {str(e)[:200]}") from e

    def victims(self, need: int) -> Optional[list[str]]:
        """Ask the policy for victims freeing ``need`` footprint bytes, then check its answer."""
        policy = self.eviction
        pname = type(policy).__name__
        pinned = self.pinned
        # the pins as a read-only view: a policy cannot unpin a chunk being read by changing its argument
        raw = call_policy(policy, "victims", self.name, need, pinned.keys())
        if raw is None:
            return None
        victims = self._listed(raw, pname)
        freed, seen = 0, set()
        index = self.index
        fast = self._fast_victims(victims)
        if fast is not None:
            freed, seen = fast, set(victims)
            victims_to_check: list = []
        else:
            victims_to_check = victims
        for v in victims_to_check:
            e = index.get(v) if isinstance(v, str) else None
            if type(e) is not int or e < 0:  # type: ignore[operator]
                raise PolicyError(f"eviction policy {pname} of tier {self.name!r} named {str(v)[:80]!r}, "
                                  "which the tier does not hold (did on_remove forget it?)")
            if v in pinned:
                raise PolicyError(f"eviction policy {pname} named the protected key {v[:80]!r}")
            if v in seen:
                raise PolicyError(f"eviction policy {pname} named {v[:80]!r} twice")
            seen.add(v)
            freed += self.value_footprint(e)
        if freed < need:
            # a policy that counts other sizes than the footprints it was given: ask for the rest
            more = call_policy(policy, "victims", self.name, need - freed, frozenset(pinned.keys() | seen))
            if more is None:
                return None
            for v in self._listed(more, pname):
                e = index.get(v) if isinstance(v, str) else None
                if v in seen or type(e) is not int or e < 0 or v in pinned:  # type: ignore[operator]
                    continue
                victims.append(v)
                seen.add(v)
                freed += self.unpack(e)[1]  # type: ignore[arg-type]
                if freed >= need:
                    break
            if freed < need:
                return None
        return victims
