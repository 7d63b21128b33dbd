"""How ``TieredStore`` places chunks: admission, reservation, eviction, demotion, commit.

Part of ``TieredStore`` (a mixin it inherits), split out so each module holds one
concern; it uses the store's lock, levels and their indexes and keeps the
invariants stated in ``tierkv/store.py``.  Every method that reserves takes a
``held`` dict and records each reservation in it, so the caller can abort what
is left on any path out (``_release`` in a ``finally``).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from tierkv.buffers import Parts, staging
from tierkv.errors import StoreClosedError
from tierkv.level import Level, call_policy
from tierkv.outcome import PutOutcome

log = logging.getLogger("tierkv")

#: how often a reservation retries after its victims were taken by a racing writer
_RESERVE_ATTEMPTS = 8

# why a chunk was not placed (bit flags gathered while scanning the chain)
NO_ROOM, UNAVAILABLE, FAILED = 1, 2, 4


class Placement:
    """Placement, eviction and demotion of ``TieredStore`` (see the module docstring)."""

    levels: list[Level]
    _lock: Any
    _managed_levels: list[int]

    @staticmethod
    def _refusal(flags: int) -> PutOutcome:
        if flags & (FAILED | UNAVAILABLE):
            return PutOutcome.ERROR
        return PutOutcome.NO_ROOM if flags & NO_ROOM else PutOutcome.REJECTED

    def _release(self, held: dict[tuple[int, str], None]) -> None:
        """Abort the reservations a call still holds (a path out through an exception)."""
        if held:
            with self._lock:
                for j, key in held:
                    self.levels[j].abort(key)
            held.clear()

    def _busy(self, key: str) -> bool:
        """READY or reserved (being written) in some managed level.  Caller holds the lock."""
        for j in self._managed_levels:
            e = self.levels[j].index.get(key)
            if type(e) is int:  # READY (> 0) or reserved (< 0); a doomed one is an Entry
                return True
        return False

    def _mask(self, key: str) -> int:
        """Bitmask of the managed levels holding ``key`` READY (``level.bit``).  Caller holds the lock."""
        m = 0
        for j in self._managed_levels:
            lvl = self.levels[j]
            e = lvl.index.get(key)
            if type(e) is int and e > 0:
                m |= lvl.bit
        return m

    def _tier_io(self, lvl: Level, op: str, keys: list[str], parts: list[Parts]) -> list[bool]:
        """A tier's ``write`` or ``read``: a medium fault costs misses (all False), never the caller's request."""
        res = self._tier_ask(lvl, op, keys, parts)
        return [False] * len(keys) if res is None else res

    def _tier_ask(self, lvl: Level, op: str, keys: list[str], parts: Optional[list[Parts]] = None) -> Optional[list]:
        """Any tier call (``write`` / ``read`` / ``contains`` / ``delete``); None if the medium failed.

        The one choke point where a medium's exception (or a wrong number of answers)
        becomes a logged miss; only ``StoreClosedError`` passes through.  A located
        level's reads and writes go by the codes of its index (``write_at`` /
        ``read_at``): the caller holds those entries (pinned, or reserved by it).
        """
        try:
            if lvl.located and parts is not None:
                with self._lock:
                    codes = lvl.codes(keys)
                if op == "write":
                    lvl.tier.write_at(codes, parts)
                    return [True] * len(keys)
                res = lvl.tier.read_at(codes, parts)
            else:
                fn = getattr(lvl.tier, op)
                res = fn(keys, parts) if parts is not None else fn(keys)
            if res is not None and len(res) != len(keys):
                raise RuntimeError(f"answered {len(res)} results for {len(keys)} keys")
            return res if res is not None else []
        except StoreClosedError:
            raise
        except Exception as e:  # noqa: BLE001 - the choke point: a medium fault is a miss
            log.warning("tierkv: tier %s %s failed: %s", lvl.name, op, str(e)[:300])
            return None

    def _admit(self, lvl: Level, key: str, nbytes: int) -> bool:
        if lvl.admits_all:
            return True
        if call_policy(lvl.admission, "admit", lvl.name, key, nbytes, lvl.name):
            return True
        lvl.counters.rejected += 1
        return False

    def _place_fast(self, key: str, nbytes: int, start: int, held: dict) -> tuple[Optional[int], int]:
        """``_place`` for the common case, under the caller's lock: no eviction needed.

        Returns (level reserved or unmanaged level chosen, flags); (None, flags) when
        the first level that admits would have to evict (the slow path decides), and
        (-1, flags) when no level admits at all.
        """
        flags = 0
        for j in range(start, len(self.levels)):
            lvl = self.levels[j]
            if not lvl.tier.available:
                flags |= UNAVAILABLE
                continue
            if not self._admit(lvl, key, nbytes):
                continue
            if not lvl.managed:
                return j, flags
            if not lvl.reserve(key, nbytes):
                return None, flags
            held[(j, key)] = None
            return j, flags
        return -1, flags

    def _place(self, key: str, nbytes: int, start: int, stop: int, held: dict) -> tuple[Optional[int], int]:
        """The first level in [start, stop) that admits the chunk and has (or made) room; reserved there."""
        flags = 0
        for j in range(start, stop):
            lvl = self.levels[j]
            if not lvl.tier.available:
                flags |= UNAVAILABLE
                continue
            with self._lock:
                admitted = self._admit(lvl, key, nbytes)
            if not admitted:
                continue
            if not lvl.managed:
                return j, flags
            if self._reserve(j, key, nbytes, held):
                return j, flags
            flags |= NO_ROOM
        return None, flags

    def _reserve(self, j: int, key: str, nbytes: int, held: dict) -> bool:
        """Reserve room for ``key`` in managed level ``j``, evicting (demoting) as needed."""
        lvl = self.levels[j]
        fp = lvl.tier.footprint(nbytes)
        if fp > lvl.capacity:
            with self._lock:
                lvl.counters.rejected += 1
            return False
        for _ in range(_RESERVE_ATTEMPTS):
            with self._lock:
                if key in lvl.index:
                    return False  # already there, or a doomed copy still being read
                if lvl.reserve(key, nbytes):
                    held[(j, key)] = None
                    return True
                victims = lvl.victims(fp - (lvl.capacity - lvl.used))
                if victims is None:
                    lvl.counters.rejected += 1
                    return False
                for v in victims:
                    lvl.pin(v)
            self._evict(j, victims)
        with self._lock:
            lvl.counters.rejected += 1
        return False

    def _evict(self, j: int, victims: list[str]) -> None:
        """Demote then drop pinned victims of level ``j`` (called without the lock); unpins every one."""
        lvl = self.levels[j]
        left = list(victims)
        try:
            while left:
                key = left[0]
                demoted = self._demote(j, key, lvl.nbytes_of(key))
                with self._lock:
                    left.pop(0)
                    try:
                        lvl.counters.evictions += 1
                        if demoted:
                            lvl.counters.demotions += 1
                        lvl.drop(key)
                    finally:
                        lvl.unpin(key)
        finally:
            if left:
                with self._lock:
                    for key in left:
                        lvl.unpin(key)

    def _demote(self, j: int, key: str, nbytes: int) -> bool:
        """Copy ``key`` from level ``j`` into the next lower level that takes it.  True if it now lives below.

        Walks down from ``j + 1``: a level that already holds the key ends the walk
        (levels are inclusive); otherwise the first level that admits it and has
        (or makes) room receives a copy.
        """
        buf: Optional[torch.Tensor] = None
        held: dict[tuple[int, str], None] = {}
        try:
            for k in range(j + 1, len(self.levels)):
                with self._lock:
                    if self.levels[k].holds(key):
                        return True
                if self._place(key, nbytes, k, k + 1, held)[0] is None:
                    continue
                if buf is None:
                    buf = staging(nbytes)
                    if not self._tier_io(self.levels[j], "read", [key], [[buf]])[0]:
                        with self._lock:
                            self.levels[j].counters.errors += 1
                        return False
                ok = self._tier_io(self.levels[k], "write", [key], [[buf]])[0]
                with self._lock:
                    held.pop((k, key), None)
                    if self._finish_write(self.levels[k], key, nbytes, ok):
                        return True
            return False
        finally:
            self._release(held)

    def _finish_write(self, lvl: Level, key: str, nbytes: int, ok: bool, count_error: bool = True) -> bool:
        """Commit (ok) or abort a write into ``lvl``; caller holds the lock.  Returns ``ok``."""
        if lvl.managed:
            if ok:
                lvl.commit(key)
            else:
                lvl.abort(key)
        if ok:
            lvl.counters.puts += 1
            lvl.counters.bytes_written += nbytes
        elif count_error:
            lvl.counters.errors += 1
        return ok

    def _write_through(self, j: int, key: str, prepared: tuple[Parts, int], held: dict) -> None:
        parts, nbytes = prepared
        for k in range(j + 1, len(self.levels)):
            lvl = self.levels[k]
            if not lvl.write_through:
                continue
            with self._lock:
                if lvl.managed and lvl.holds(key):
                    continue
            if self._place(key, nbytes, k, k + 1, held)[0] is None:
                continue
            ok = self._tier_io(lvl, "write", [key], [parts])[0]
            with self._lock:
                held.pop((k, key), None)
                self._finish_write(lvl, key, nbytes, ok)

