"""Copies ``TieredStore`` makes on its own: write-behind into persistent tiers, and promotion.

Part of ``TieredStore`` (a mixin it inherits), split out so each module holds one
concern.  A copy reads bytes the store itself verified (a tier read into a
staging buffer, or a caller's buffer that shares memory with no other key's) and
places them through ``Placement``, so every invariant of ``tierkv/store.py``
holds for copies as for puts.  A write-behind batch from a host slab is handed
below as views of the pinned chunks' own bytes (``Tier.views_at``); from any other
source it is staged in the store's ``StagingArena`` (huge pages, kept from batch
to batch, each chunk on a 4 KiB boundary).  Either way a persistent tier may
write it to its device without another copy.
A write-behind source stays pinned until its copy has landed below (so it is never
in no tier meanwhile); one copy pins at most an eighth of its source level, so
eviction always has the rest to choose from.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Optional

from tierkv.buffers import Parts
from tierkv.durability import DropLedger, DropReason, fault_counts, reason_of_failed_write
from tierkv.hooks import call_policy
from tierkv.hostmem import StagingArena
from tierkv.level import Level
from tierkv.placement import UNAVAILABLE

log = logging.getLogger("tierkv")

#: most bytes one background copy stages at once
_COPY_BATCH_BYTES = 64 << 20
#: most of a source level's capacity one background copy keeps pinned (as a divisor)
_COPY_PIN_SHARE = 8


def _overlapping(prepared: list[tuple[Parts, int]]) -> set[int]:
    """Indices whose buffers share memory with another index's (or overlap within themselves)."""
    spans = []
    for i, (parts, _) in enumerate(prepared):
        for p in parts:
            n = p.numel()
            if n:
                ptr = p.data_ptr()
                spans.append((str(p.device), ptr, ptr + n, i))
    spans.sort()
    bad: set[int] = set()
    dev, end, members = None, -1, []
    for d, lo, hi, i in [*spans, (None, 0, 0, -1)]:
        if d == dev and lo < end:
            members.append(i)
            end = max(end, hi)
            continue
        if len(members) > 1:
            bad.update(members)
        dev, end, members = d, hi, [i]
    return bad



class Copying:
    """Write-behind and promotion of ``TieredStore`` (see the module docstring)."""

    levels: list[Level]
    _lock: Any
    _managed_levels: list[int]
    _behind_levels: list[int]
    _behind: Any
    _arena: StagingArena
    _arena_lock: Any
    _counters: Any
    _drops: DropLedger
    _faults_seen: dict[int, dict[str, int]]
    promotion: Any

    if TYPE_CHECKING:  # defined by ``Placement``
        def _tier_io(self, lvl: Level, op: str, keys: list[str], parts: list[Parts],
                     ptrs: Optional[list[int]] = None, codes: Optional[list[int]] = None) -> list[bool]: ...
        def _release(self, held: dict[tuple[int, str], None]) -> None: ...
        def _admit(self, lvl: Level, key: str, nbytes: int) -> bool: ...
        def _mask(self, key: str) -> int: ...
        def _place(self, key: str, nbytes: int, start: int, stop: int, held: dict) -> tuple[Optional[int], int]: ...
        def _reserve(self, j: int, key: str, nbytes: int, held: dict) -> bool: ...
        def _finish_write(self, lvl: Level, key: str, nbytes: int, ok: bool, count_error: bool = True,
                          source: Optional[Level] = None) -> bool: ...

    # ------------------------------------------------------------------ write-behind
    def _queue_behind(self, stored: list[tuple[int, str]]) -> None:
        keys = [key for j, key in stored if any(k > j for k in self._behind_levels)]
        if not keys:
            return
        dropped = self._behind.submit(keys)  # type: ignore[union-attr]  # (drops reach _behind_dropped)
        with self._lock:
            self._counters.write_behind_queued += len(keys) - dropped

    # ------------------------------------------------------------------ undurable chunks
    def _behind_dropped(self, keys: list[str], why: DropReason) -> None:
        """The write-behind queue gave up ``keys``: note those a write-behind level still lacks and admits."""
        with self._lock:
            self._drops.record([key for key in keys if self._still_wanted(key)], why)

    def _still_wanted(self, key: str) -> bool:
        """Whether ``key`` is READY above some write-behind level that lacks and admits it (lock held)."""
        mask = self._mask(key)
        if not mask:
            return False  # removed (or gone) meanwhile: nothing to make durable
        j = (mask & -mask).bit_length() - 1
        nbytes = self.levels[j].ready_nbytes(key)
        down: list[str] = []
        return nbytes >= 0 and (self._wanted_below(j, mask, key, nbytes, down) or bool(down))

    def _note_evicted(self, j: int, keys: list[str]) -> None:
        """Victims of level ``j`` about to leave it without a demotion (lock held): note as undurable those a
        write-behind level below lacks and admits, and no level above holds."""
        lvl = self.levels[j]
        lost = []
        for key in keys:
            nbytes = lvl.ready_nbytes(key)
            if nbytes < 0:
                continue  # removed meanwhile
            mask = self._mask(key)
            if mask & (lvl.bit - 1):
                continue  # still held above
            down: list[str] = []
            if self._wanted_below(j, mask, key, nbytes, down) or down:
                lost.append(key)
        if lost:
            self._drops.record(lost, DropReason.EVICTED)

    def _drop_reason(self, k: int) -> DropReason:
        """Why level ``k`` failed a write just now, from its medium's fault counters (lock held)."""
        try:
            now = fault_counts(self.levels[k].tier.extra_stats())
        except Exception:  # noqa: BLE001 - a medium's stats never cost the bookkeeping
            now = {}
        seen = self._faults_seen.get(k)
        self._faults_seen[k] = now
        return reason_of_failed_write(seen if seen is not None else fault_counts(None), now)

    def _copy_behind(self, keys: list[str]) -> None:
        """Background: copy each key from the fastest level holding it into the write-behind levels below.

        A source stays pinned until its copy below is written (or failed): evicting it
        earlier would leave it in no tier while the write is in flight, and lose it if
        the write fails.  A batch pins at most ``1 / _COPY_PIN_SHARE`` of the source
        level's capacity (at least one chunk), and is pinned only when its turn comes,
        so puts above always find victims; a chunk evicted before its turn is demoted
        as any other.
        """
        todo: dict[int, list[tuple[str, int]]] = {}
        down: list[str] = []
        with self._lock:
            for key in dict.fromkeys(keys):
                mask = self._mask(key)
                if not mask:
                    continue  # removed, or evicted and dropped meanwhile (``_evict`` noted that)
                j = (mask & -mask).bit_length() - 1
                nbytes = self.levels[j].ready_nbytes(key)
                if nbytes >= 0 and self._wanted_below(j, mask, key, nbytes, down):
                    todo.setdefault(j, []).append((key, nbytes))
            if down:
                self._drops.record(down, DropReason.UNAVAILABLE)
        for j, items in todo.items():
            limit = min(_COPY_BATCH_BYTES, self.levels[j].capacity // _COPY_PIN_SHARE)
            at = 0
            while at < len(items):
                batch: list[tuple[str, int]] = []
                size = 0
                while at < len(items) and (not batch or size + items[at][1] <= limit):
                    batch.append(items[at])
                    size += items[at][1]
                    at += 1
                self._copy_batch(j, batch)

    def _wanted_below(self, j: int, mask: int, key: str, nbytes: int, down: list[str]) -> bool:
        """Whether an available write-behind level below ``j`` lacks ``key`` and would admit it (lock held).

        ``key`` is appended to ``down`` (once) when such a level would admit it but is unavailable.
        """
        wanted = False
        for k in self._behind_levels:
            lvl = self.levels[k]
            if k > j and not mask & lvl.bit and call_policy(lvl.admission, "admit", lvl.name, key, nbytes,
                                                               lvl.name):
                if lvl.tier.available:
                    wanted = True
                elif not down or down[-1] != key:
                    down.append(key)
        return wanted

    def _copy_batch(self, j: int, batch: list[tuple[str, int]]) -> None:
        """Pin the chunks of ``batch`` still READY in level ``j``, write them below, unpin.

        A host slab above hands over views of the pinned chunks' own bytes (``Tier.views_at``), written
        below from where they are; any other source is read into the staging arena first."""
        src = self.levels[j]
        with self._lock:
            batch = [(key, nb) for key, nb in batch if src.ready_nbytes(key) == nb]
            keys = [key for key, _ in batch]
            src.pin_many(keys)
            codes = src.codes(keys) if src.located else None
        try:
            views = self._views(src, codes) if codes is not None else None
            if views is not None:
                self._write_all_below(j, batch, views, [True] * len(batch))
                return
            with self._arena_lock:  # (one batch at a time: its views are the arena's until the next carve)
                bufs = [[b] for b in self._arena.carve([nb for _, nb in batch])]
                oks = self._tier_io(src, "read", keys, bufs)
                if False in oks:
                    with self._lock:
                        self._drops.record([key for key, ok in zip(keys, oks) if not ok], DropReason.READ_FAILED)
                self._write_all_below(j, batch, bufs, oks)
        finally:
            with self._lock:
                src.unpin_many(keys)

    @staticmethod
    def _views(src: Level, codes: list[int]) -> Optional[list[Parts]]:
        """The source tier's views of pinned chunks, or None (it has none, or it failed: then a copy)."""
        try:
            views = src.tier.views_at(codes)
        except Exception as e:  # noqa: BLE001 - a medium fault costs the zero-copy path, never the copy
            log.warning("tierkv: tier %s views failed: %s", src.name, str(e)[:300])
            return None
        if views is None or len(views) != len(codes):
            return None
        return views

    def _write_all_below(self, j: int, batch: list[tuple[str, int]], bufs: list[Parts], oks: list[bool]) -> None:
        for k in self._behind_levels:
            if k > j:
                self._write_below(j, k, batch, bufs, oks)

    def _write_below(self, j: int, k: int, batch: list[tuple[str, int]], bufs: list[Parts],
                     oks: list[bool]) -> None:
        """Write the chunks of ``batch`` (read from level ``j``, where they are pinned) held in ``bufs`` into
        write-behind level ``k`` where it lacks them."""
        lvl = self.levels[k]
        held: dict[tuple[int, str], None] = {}
        try:
            go = []
            for i, (key, nbytes) in enumerate(batch):
                with self._lock:
                    if not oks[i] or lvl.holds(key):
                        continue
                placed, flags = self._place(key, nbytes, k, k + 1, held)
                if placed is not None:
                    go.append(i)
                elif flags:  # (no flags: its admission said no, which is no loss)
                    self._refused_below(lvl, key, nbytes, flags)
            if not go:
                return
            wrote = self._tier_io(lvl, "write", [batch[i][0] for i in go], [bufs[i] for i in go])
            with self._lock:
                failed = []
                for i, ok in zip(go, wrote):
                    key, nbytes = batch[i]
                    held.pop((k, key), None)
                    if self._finish_write(lvl, key, nbytes, ok, source=self.levels[j]):
                        lvl.counters.persisted += 1
                    elif not ok:
                        failed.append(key)
                if failed:
                    self._drops.record(failed, self._drop_reason(k))
        finally:
            self._release(held)

    def _refused_below(self, lvl: Level, key: str, nbytes: int, flags: int) -> None:
        """Note why write-behind level ``lvl`` took no copy of ``key`` (``_place``'s flags)."""
        with self._lock:
            if key in lvl.index:
                return  # another writer holds it there (a demotion in flight): not lost
            if lvl.footprint(nbytes) > lvl.capacity:
                why = DropReason.TOO_LARGE
            elif flags & UNAVAILABLE:
                why = DropReason.UNAVAILABLE
            else:
                why = DropReason.NO_ROOM
            self._drops.record([key], why)

    def _promote(self, keys: list[str], prepared: list[tuple[Parts, int]], served: list[Optional[int]]) -> None:
        """Copy hits served below the top managed level up, as the promotion policy says.

        One call promotes at most half of a level's capacity into it: a batch larger
        than the level would otherwise evict its own earlier chunks (thrashing).  A
        buffer that shares memory with another key's (or its own parts) is never
        promoted: it may no longer hold the bytes verified for its key.
        """
        # buffers that alias matter only where a promotion would really copy bytes
        aliased = _overlapping(prepared) if any(self.levels[k].tier.keeps_bytes for k in self._managed_levels) \
            else set()
        budget = {k: self.levels[k].capacity // 2 for k in self._managed_levels}
        held: dict[tuple[int, str], None] = {}
        try:
            for i, j in enumerate(served):
                if not j or i in aliased:
                    continue
                key, (parts, nbytes) = keys[i], prepared[i]
                for k in self._managed_levels:
                    if k >= j:
                        break
                    lvl = self.levels[k]
                    if not lvl.tier.available:
                        continue
                    with self._lock:
                        if key in lvl.index:
                            break
                        if budget[k] < nbytes or not self._admit(lvl, key, nbytes):
                            continue
                        budget[k] -= nbytes
                        go = call_policy(self.promotion, "should_promote", lvl.name, key, self.levels[j].name,
                                         lvl.name)
                    if go and self._reserve(k, key, nbytes, held):
                        ok = self._tier_io(lvl, "write", [key], [parts])[0]
                        with self._lock:
                            held.pop((k, key), None)
                            if self._finish_write(lvl, key, nbytes, ok, source=self.levels[j]):
                                self.levels[j].counters.promotions += 1
                    break
        finally:
            self._release(held)

