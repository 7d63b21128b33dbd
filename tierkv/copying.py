"""Copies ``TieredStore`` makes on its own: write-behind into persistent tiers, and promotion.

Part of ``TieredStore`` (a mixin it inherits), split out so each module holds one
concern.  A copy reads bytes the store itself verified (a tier read into a
staging buffer, or a caller's buffer that shares memory with no other key's) and
places them through ``Placement``, so every invariant of ``tierkv/store.py``
holds for copies as for puts; the sources are pinned only while they are read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch

from tierkv.buffers import Parts, staging
from tierkv.level import Level, call_policy

#: most bytes one background copy stages at once
_COPY_BATCH_BYTES = 64 << 20


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
    _counters: Any
    promotion: Any

    if TYPE_CHECKING:  # defined by ``Placement``
        @staticmethod
        def _tier_io(lvl: Level, op: str, keys: list[str], parts: list[Parts]) -> list[bool]: ...
        def _release(self, held: dict[tuple[int, str], None]) -> None: ...
        def _admit(self, lvl: Level, key: str, nbytes: int) -> bool: ...
        def _mask(self, key: str) -> int: ...
        def _place(self, key: str, nbytes: int, start: int, stop: int, held: dict) -> tuple[Optional[int], int]: ...
        def _reserve(self, j: int, key: str, nbytes: int, held: dict) -> bool: ...
        def _finish_write(self, lvl: Level, key: str, nbytes: int, ok: bool, count_error: bool = True) -> bool: ...

    # ------------------------------------------------------------------ write-behind
    def _queue_behind(self, stored: list[tuple[int, str]]) -> None:
        keys = [key for j, key in stored if any(k > j for k in self._behind_levels)]
        if not keys:
            return
        dropped = self._behind.submit(keys)  # type: ignore[union-attr]
        with self._lock:
            self._counters.write_behind_queued += len(keys) - dropped
            self._counters.write_behind_dropped += dropped

    def _copy_behind(self, keys: list[str]) -> None:
        """Background: copy each key from the fastest level holding it into the write-behind levels below.

        The source is pinned only while its bytes are read into staging buffers, so a
        background copy delays no eviction for longer than a read.
        """
        todo: dict[int, list[tuple[str, Any, int]]] = {}
        with self._lock:
            for key in dict.fromkeys(keys):
                mask = self._mask(key)
                if not mask:
                    continue  # removed or dropped meanwhile
                j = (mask & -mask).bit_length() - 1
                lvl = self.levels[j]
                nbytes = lvl.ready_nbytes(key)
                if not any(k > j and not mask & self.levels[k].bit and self.levels[k].tier.available
                           and call_policy(self.levels[k].admission, "admit", self.levels[k].name, key,
                                           nbytes, self.levels[k].name)
                           for k in self._behind_levels):
                    continue  # already everywhere it should be, or nowhere wants it
                e = lvl.pin(key)
                todo.setdefault(j, []).append((key, e, nbytes))
        try:
            for j, items in todo.items():
                while items:
                    batch: list[tuple[str, Any, int]] = []
                    size = 0
                    while items and (not batch or size + items[0][2] <= _COPY_BATCH_BYTES):
                        batch.append(items.pop(0))
                        size += batch[-1][2]
                    self._copy_batch(j, batch)
        finally:
            with self._lock:  # whatever an exception left pinned
                for j, items in todo.items():
                    for key, e, _ in items:
                        self.levels[j].unpin(key, e)

    def _copy_batch(self, j: int, batch: list[tuple[str, Any, int]]) -> None:
        """Read a batch of pinned chunks of level ``j`` (unpinning them), then write them below."""
        keys = [key for key, _, _ in batch]
        bufs: list[torch.Tensor] = []
        try:
            bufs = [staging(nb) for _, _, nb in batch]
            oks = self._tier_io(self.levels[j], "read", keys, [[b] for b in bufs])
        finally:
            with self._lock:
                for key, e, _ in batch:
                    self.levels[j].unpin(key, e)
        for k in self._behind_levels:
            if k <= j:
                continue
            lvl = self.levels[k]
            held: dict[tuple[int, str], None] = {}
            try:
                go = []
                for i, (key, _, nbytes) in enumerate(batch):
                    with self._lock:
                        if not oks[i] or lvl.holds(key):
                            continue
                    if self._place(key, nbytes, k, k + 1, held)[0] is not None:
                        go.append(i)
                if not go:
                    continue
                wrote = self._tier_io(lvl, "write", [keys[i] for i in go], [[bufs[i]] for i in go])
                with self._lock:
                    for i, ok in zip(go, wrote):
                        held.pop((k, keys[i]), None)
                        if self._finish_write(lvl, keys[i], batch[i][2], ok):
                            lvl.counters.persisted += 1
            finally:
                self._release(held)

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
                            if self._finish_write(lvl, key, nbytes, ok):
                                self.levels[j].counters.promotions += 1
                    break
        finally:
            self._release(held)

