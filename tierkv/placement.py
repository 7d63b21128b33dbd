"""How ``TieredStore`` places chunks: admission, reservation, eviction, demotion, commit.

Part of ``TieredStore`` (a mixin it inherits), split out so each module holds one
concern; it uses the store's lock, levels and their indexes and keeps the
invariants stated in ``tierkv/store.py``.  Every method that reserves takes a
``held`` dict and records each reservation in it, so the caller can abort what
is left on any path out (``_release`` in a ``finally``).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Optional

import torch

from tierkv.buffers import Parts, staging
from tierkv.errors import StoreClosedError
from tierkv.hooks import call_policy
from tierkv.level import Level
from tierkv.outcome import PutOutcome

log = logging.getLogger("tierkv")

#: how often a reservation retries after its victims were taken by a racing writer
_RESERVE_ATTEMPTS = 8
#: most bytes one eviction stages at once to demote its victims
_DEMOTE_BATCH_BYTES = 64 << 20

# why a chunk was not placed (bit flags gathered while scanning the chain)
NO_ROOM, UNAVAILABLE, FAILED, TOO_LARGE = 1, 2, 4, 8


class Placement:
    """Placement, eviction and demotion of ``TieredStore`` (see the module docstring)."""

    levels: list[Level]
    _lock: Any
    _managed_levels: list[int]
    _behind_levels: list[int]

    if TYPE_CHECKING:  # defined by ``Copying`` and the store
        _drops: Any

        def _note_evicted(self, j: int, keys: list[str]) -> None: ...
        def _refused_below(self, lvl: Level, key: str, nbytes: int, flags: int) -> None: ...
        def _drop_reason(self, k: int) -> Any: ...

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

    def _tier_io(self, lvl: Level, op: str, keys: list[str], parts: list[Parts],
                 ptrs: Optional[list[int]] = None, codes: Optional[list[int]] = None) -> list[bool]:
        """A tier's ``write`` or ``read``: a medium fault costs misses (all False), never the caller's request."""
        res = self._tier_ask(lvl, op, keys, parts, ptrs, codes)
        return [False] * len(keys) if res is None else res

    def _tier_ask(self, lvl: Level, op: str, keys: list[str], parts: Optional[list[Parts]] = None,
                  ptrs: Optional[list[int]] = None, codes: Optional[list[int]] = None) -> Optional[list]:
        """Any tier call (``write`` / ``read`` / ``contains`` / ``delete``); None if the medium failed.

        The one choke point where a medium's exception (or a wrong number of answers)
        becomes a logged miss; only ``StoreClosedError`` passes through.  A located
        level's reads and writes go by the codes of its index (``write_at`` /
        ``read_at``): the caller holds those entries (pinned, or reserved by it), and
        may hand over their ``codes`` it already read under the lock, and ``ptrs``: the
        host addresses of buffers it checked are one flat part of exactly each
        chunk's size (``to_parts_ptrs``, and sizes matched against the index).
        """
        try:
            if lvl.located and parts is not None:
                if codes is None:
                    with self._lock:
                        codes = lvl.codes(keys)
                if op == "write":
                    lvl.tier.write_at(codes, parts, ptrs)
                    return [True] * len(keys)
                res = lvl.tier.read_at(codes, parts, ptrs)
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
            if len(keys) > 1 and parts is not None and lvl.managed and lvl.tier.available:
                # one chunk's fault never costs the others: a local medium is asked again key by key
                return self._one_by_one(lvl, op, keys, parts, ptrs, codes)
            return None

    def _one_by_one(self, lvl: Level, op: str, keys: list[str], parts: list[Parts],
                    ptrs: Optional[list[int]], codes: Optional[list[int]]) -> list:
        """``_tier_ask`` of each key alone, after the batch failed: a key whose own call fails is a miss."""
        out: list = []
        failed = 0
        for i, key in enumerate(keys):
            try:
                if lvl.located:
                    if codes is None:
                        with self._lock:
                            code = lvl.codes([key])
                    else:
                        code = [codes[i]]
                    if op == "write":
                        lvl.tier.write_at(code, [parts[i]], None if ptrs is None else [ptrs[i]])
                        out.append(True)
                        continue
                    res = lvl.tier.read_at(code, [parts[i]], None if ptrs is None else [ptrs[i]])
                else:
                    res = getattr(lvl.tier, op)([key], [parts[i]])
                if res is None or len(res) != 1:
                    raise RuntimeError(f"answered {0 if res is None else len(res)} results for 1 key")
                out.append(bool(res[0]))
            except StoreClosedError:
                raise
            except Exception:  # noqa: BLE001 - the choke point: a medium fault is a miss
                failed += 1
                out.append(False)
        if failed:
            log.warning("tierkv: tier %s %s: %d of %d chunks failed alone; the rest went through",
                        lvl.name, op, failed, len(keys))
        return out

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
            # (a chunk larger than the tier is a refusal there, not a lack of room)
            flags |= NO_ROOM if lvl.footprint(nbytes) <= lvl.capacity else TOO_LARGE
        return None, flags

    def _reserve(self, j: int, key: str, nbytes: int, held: dict) -> bool:
        """Reserve room for ``key`` in managed level ``j``, evicting (demoting) as needed."""
        lvl = self.levels[j]
        fp = lvl.tier.footprint(nbytes)
        if fp > lvl.capacity:
            self._too_large(lvl, nbytes, fp)
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

    def _too_large(self, lvl: Level, nbytes: int, fp: int) -> None:
        """A chunk that takes more than the whole of ``lvl``: refused (``rejected``, ``too_large``), and said
        in the log at most once a minute per tier."""
        with self._lock:
            lvl.counters.rejected += 1
            lvl.too_large += 1
            now = time.monotonic()
            if now < lvl.too_large_quiet:
                return
            lvl.too_large_quiet = now + 60.0
            n = lvl.too_large
        log.warning("tierkv: tier %s refused a chunk of %d bytes: it takes %d bytes there, more than the tier's "
                    "capacity of %d (too_large: %d so far)", lvl.name, nbytes, fp, lvl.capacity, n)

    def _make_room(self, j: int, need: int) -> None:
        """Evict (demoting) from managed level ``j`` what ``need`` more footprint bytes lack, in one
        ``victims`` call, before a batch is placed there key by key.  Called without the lock; a
        policy that cannot name enough victims leaves the keys to the per-key path."""
        lvl = self.levels[j]
        with self._lock:
            short = min(need - (lvl.capacity - lvl.used), lvl.used)
            if short <= 0:
                return
            victims = lvl.victims(short)
            if not victims:
                return
            lvl.pin_many(victims)
        self._evict(j, victims)

    def _make_room_for(self, idx: list[int], keys: list[str], prepared: list, start: list[int]) -> None:
        """``_make_room`` in each level the keys at ``idx`` will be placed in first (a managed level
        that admits everything; a level with an admission policy is left to the per-key path)."""
        need: dict[int, int] = {}
        with self._lock:
            top = self.levels[0]
            if (max(start[i] for i in idx) == 0 and top.tier.available and top.managed and top.admits_all
                    and top.index.keys().isdisjoint([keys[i] for i in idx])):
                # the common case: every key new to the top level, which takes them all: one sum
                fps: list[Any] = list(map(top._fp_only.get, [prepared[i][1] for i in idx]))
                need[0] = sum(fps) if None not in fps else sum([top.footprint(prepared[i][1]) for i in idx])
                idx = []
            for i in idx:
                for j in range(start[i], len(self.levels)):
                    lvl = self.levels[j]
                    if not lvl.tier.available:
                        continue
                    if lvl.managed and lvl.admits_all and keys[i] not in lvl.index:
                        need[j] = need.get(j, 0) + lvl.footprint(prepared[i][1])
                    break
        for j, n in need.items():
            self._make_room(j, n)

    def _evict(self, j: int, victims: list[str]) -> None:
        """Demote then drop pinned victims of level ``j`` (called without the lock); unpins every one.

        Victims are demoted in batches of at most ``_DEMOTE_BATCH_BYTES`` (one read from
        ``j`` and one write into each lower level per batch), then dropped.
        """
        lvl = self.levels[j]
        at = 0
        try:
            last = j + 1 == len(self.levels)  # nothing below: no demotion, one batch
            if not last:
                with self._lock:
                    sizes = [lvl.nbytes_of(key) for key in victims]
            while at < len(victims):
                end, total = at, 0
                if last:
                    end = len(victims)
                while end < len(victims) and (end == at or total + sizes[end] <= _DEMOTE_BATCH_BYTES):
                    total += sizes[end]
                    end += 1
                below = self._demote_many(j, victims[at:end], sizes[at:end]) if j + 1 < len(self.levels) \
                    else set()
                with self._lock:
                    batch = victims[at:end]
                    if len(below) < len(batch) and self._behind_levels and self._behind_levels[-1] > j:
                        self._note_evicted(j, [key for key in batch if key not in below])
                    at = end  # evict_many releases every pin of the batch, raising or not
                    lvl.counters.evictions += len(batch)
                    lvl.counters.demotions += len(below)
                    lvl.evict_many(batch)
        finally:
            if at < len(victims):
                with self._lock:
                    for key in victims[at:]:
                        lvl.unpin(key)

    def _demote_many(self, j: int, keys: list[str], sizes: list[int]) -> set[str]:
        """Copy pinned ``keys`` of level ``j`` into the next lower level that takes each; the keys now below.

        Walks down from ``j + 1``: a level that already holds a key ends its walk
        (levels are inclusive); otherwise the first level that admits it and has (or
        makes) room receives a copy.  The sources are read once, when a level first
        takes them; a key whose source read fails is not demoted (and counted).
        """
        nbytes = dict(zip(keys, sizes))
        below: set[str] = set()
        bufs: dict[str, torch.Tensor] = {}
        unreadable: set[str] = set()
        todo = list(keys)
        for k in range(j + 1, len(self.levels)):
            if not todo:
                break
            lvl = self.levels[k]
            held: dict[tuple[int, str], None] = {}
            try:
                with self._lock:
                    fresh = [key for key in todo if not lvl.holds(key)]
                below.update(key for key in todo if key not in fresh)
                if len(fresh) > 1 and lvl.tier.available:
                    self._make_room_for(list(range(len(fresh))), fresh, [(None, nbytes[key]) for key in fresh],
                                        [k] * len(fresh))
                go: list[str] = []
                rest: list[str] = []
                for key in fresh:
                    (go if self._place(key, nbytes[key], k, k + 1, held)[0] is not None else rest).append(key)
                need = [key for key in go if key not in bufs]
                if need:
                    staged = [staging(nbytes[key]) for key in need]
                    oks = self._tier_io(self.levels[j], "read", need, [[b] for b in staged])
                    for key, b, ok in zip(need, staged, oks):
                        if ok:
                            bufs[key] = b
                        else:
                            unreadable.add(key)
                    if False in oks:
                        with self._lock:
                            self.levels[j].counters.errors += oks.count(False)
                go = [key for key in go if key in bufs]  # (the unreadable stay in held: released below)
                if go:
                    wrote = self._tier_io(lvl, "write", go, [[bufs[key]] for key in go])
                    with self._lock:
                        for key, ok in zip(go, wrote):
                            held.pop((k, key), None)
                            if self._finish_write(lvl, key, nbytes[key], ok, source=self.levels[j]):
                                below.add(key)
                            else:
                                rest.append(key)
                todo = [key for key in rest if key not in unreadable]
            finally:
                self._release(held)
        return below

    def _finish_write(self, lvl: Level, key: str, nbytes: int, ok: bool, count_error: bool = True,
                      source: Optional[Level] = None) -> bool:
        """Commit (ok) or abort a write into ``lvl``; caller holds the lock.  Returns whether it stays.

        ``source``: the level a copy the store makes on its own (write-behind, demotion,
        promotion) read the chunk from.  If the chunk is no longer READY there, a ``remove``
        ran while the copy was in flight: the copy is withdrawn, bytes and all, so what
        ``remove`` removed stays removed.
        """
        if ok and source is not None and source.managed and lvl.managed and not source.holds(key):
            lvl.withdraw(key)
            return False
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
            placed, flags = self._place(key, nbytes, k, k + 1, held)
            if placed is None:
                if flags and lvl.tier.persistent:  # (no flags: its admission said no, which is no loss)
                    self._refused_below(lvl, key, nbytes, flags)
                continue
            ok = self._tier_io(lvl, "write", [key], [parts])[0]
            with self._lock:
                held.pop((k, key), None)
                self._finish_write(lvl, key, nbytes, ok)
                if not ok and lvl.tier.persistent:  # acknowledged above, not durable here: ``flush`` says so
                    self._drops.record([key], self._drop_reason(k))

