"""``Copier``: the copies a store makes on its own, on one background queue: write-behind and promotion.

* **Write-behind**: a chunk a put stored above a ``write_behind`` level is queued by key;
  the background thread copies it from the fastest level holding it into each
  write-behind level below that lacks and admits it.
* **Promotion**: a hit a ``get`` served below the top managed level is queued with the
  level that served it; the background thread asks the promotion policy and copies the
  chunk up from that level.  A ``get`` therefore never writes to a tier, nor makes room
  by demoting (a cascade that may reach the SSD tier), on the caller's thread: the
  promotion lands shortly after, or is dropped and counted (``promotions_dropped``) when
  the queue is full.  ``drain_write_behind`` and ``flush`` wait for both kinds.

A copy reads bytes the store itself verified, from a level where the chunk is pinned
for the copy: a host slab hands over views of the pinned chunks' own bytes
(``Tier.views_at``); any other source is read into an arena lent by the store's
``StagingPool`` (huge pages, reused, each chunk on a 4 KiB boundary), the same
mechanism demotion uses.  It is placed through the ``Placer``, so every invariant of
``tierkv/store.py`` holds for copies as for puts.  A write-behind source stays pinned
until its copy has landed below (so it is never in no tier meanwhile); one copy pins at
most an eighth of its source level, so eviction always has the rest to choose from.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Union

from tierkv.buffers import Parts
from tierkv.durability import DropReason
from tierkv.engine.background import BackgroundQueue
from tierkv.engine.chain import Chain, Held
from tierkv.engine.level import Level
from tierkv.engine.placer import Placer
from tierkv.engine.tierio import TierIO
from tierkv.hooks import CheckedPromotion
from tierkv.hostmem import StagingPool
from tierkv.policies import NeverPromote, PromotionPolicy
from tierkv.stats import CopyCounters

log = logging.getLogger("tierkv")

#: most bytes one background copy stages at once
_COPY_BATCH_BYTES = 64 << 20
#: most of a source level's capacity one background copy keeps pinned (as a divisor)
_COPY_PIN_SHARE = 8

#: one promotion queued: (key, level that served it, nbytes)
Promotion = tuple[str, int, int]
#: what the background queue holds: a key to write behind, or a promotion
Job = Union[str, Promotion]


class Copier:
    """Write-behind and promotion on one background queue (see the module docstring)."""

    def __init__(self, chain: Chain, io: TierIO, placer: Placer, stager: StagingPool,
                 promotion: PromotionPolicy, max_queued: int = 65536) -> None:
        self.chain = chain
        self.levels = chain.levels
        self._lock = chain.lock
        self.io = io
        self.placer = placer
        #: the chunks acknowledged but not durable (the placer's)
        self.durability = placer.durability
        self.stager = stager
        self.promotion = CheckedPromotion(promotion)
        #: the background copies' counters (``stats()["total"]``), this part's alone
        self.counters = CopyCounters()
        #: positions of the write-behind levels
        self.behind_levels = chain.behind
        #: promotion is possible: a policy that may say yes, and a managed level above another level
        self.promotes = (type(promotion) is not NeverPromote and bool(chain.managed)
                         and chain.managed[0] < len(chain.levels) - 1)
        self.queue: Optional[BackgroundQueue] = (
            BackgroundQueue(self._run, max_queued=max_queued, on_drop=self._dropped)
            if self.behind_levels or self.promotes else None)

    # ------------------------------------------------------------------ the queue
    def queue_behind(self, stored: list[tuple[int, str]]) -> None:
        """Queue a write-behind copy of the chunks a put just stored, (level, key) each."""
        keys = [key for j, key in stored if any(k > j for k in self.behind_levels)]
        if not keys or self.queue is None:
            return
        dropped = self.queue.submit(keys)  # (drops reach ``_dropped``)
        with self._lock:
            self.counters.write_behind_queued += len(keys) - dropped

    def retry_behind(self, keys: list[str]) -> None:
        """Queue again the write-behind copies given up for chunks still held only above (``flush``); one
        given up again is noted once (``DropLedger.record``)."""
        if not keys or self.queue is None:
            return
        dropped = self.queue.submit(keys)
        with self._lock:
            self.counters.write_behind_queued += len(keys) - dropped

    def promote_later(self, keys: list[str], prepared: list[tuple[Parts, int]], served: list[Optional[int]]) -> None:
        """Queue a promotion of each hit served below the top managed level (never on the caller's thread)."""
        if not self.promotes or self.queue is None:
            return
        top = self.chain.managed[0]
        jobs: list[Job] = [(key, j, p[1]) for key, p, j in zip(keys, prepared, served) if j is not None and j > top]
        if jobs:
            self.queue.submit(jobs)

    def _dropped(self, jobs: list[Job], why: DropReason) -> None:
        """The queue gave up ``jobs``: note the write-behind keys a write-behind level still lacks and admits;
        count the promotions."""
        keys = [job for job in jobs if type(job) is str]
        with self._lock:
            if len(keys) < len(jobs):
                self.counters.promotions_dropped += len(jobs) - len(keys)
            if keys:
                self.durability.drops.record([key for key in keys if self.durability.still_wanted(key)], why)

    def _run(self, jobs: list[Job]) -> None:
        """Background: one batch of jobs, write-behind first."""
        keys = [job for job in jobs if type(job) is str]
        if keys:
            self._copy_behind(keys)  # type: ignore[arg-type]
        if len(keys) < len(jobs):
            self._promote([job for job in jobs if type(job) is not str])  # type: ignore[misc]

    def pending(self) -> int:
        return self.queue.pending() if self.queue is not None else 0

    def drain(self, timeout: Optional[float] = None) -> bool:
        return self.queue.drain(timeout) if self.queue is not None else True

    def close(self, timeout: Optional[float] = None) -> None:
        if self.queue is not None:
            self.queue.close(timeout)

    # ------------------------------------------------------------------ write-behind
    def _copy_behind(self, keys: list[str]) -> None:
        """Copy each key from the fastest level holding it into the write-behind levels below that lack and
        admit it.

        A source stays pinned until its copy below is written (or failed): evicting it
        earlier would leave it in no tier while the write is in flight, and lose it if
        the write fails.  A batch pins at most ``1 / _COPY_PIN_SHARE`` of the source
        level's capacity (at least one chunk), and is pinned only when its turn comes,
        so puts above always find victims; a chunk evicted before its turn is demoted
        as any other.
        """
        todo: dict[int, list[tuple[str, int, int]]] = {}
        down: list[str] = []
        chain = self.chain
        with self._lock:
            for key in dict.fromkeys(keys):
                mask = chain.mask(key)
                if not mask:
                    continue  # removed, or evicted and dropped meanwhile (the eviction noted that)
                j = (mask & -mask).bit_length() - 1
                nbytes = self.levels[j].ready_nbytes(key)
                if nbytes < 0:
                    continue
                wanted = self.durability.wanted_below(j, mask, key, nbytes, down)  # (admission asked once, here)
                if wanted:
                    todo.setdefault(j, []).append((key, nbytes, wanted))
            if down:
                self.durability.drops.record(down, DropReason.UNAVAILABLE)
        for j, items in todo.items():
            limit = min(_COPY_BATCH_BYTES, self.levels[j].capacity // _COPY_PIN_SHARE)
            at = 0
            while at < len(items):
                batch: list[tuple[str, int, int]] = []
                size = 0
                while at < len(items) and (not batch or size + items[at][1] <= limit):
                    batch.append(items[at])
                    size += items[at][1]
                    at += 1
                self._copy_batch(j, batch)

    def _copy_batch(self, j: int, batch: list[tuple[str, int, int]]) -> None:
        """Pin the chunks of ``batch`` still READY in level ``j``, write them below, unpin."""
        src = self.levels[j]
        with self._lock:
            batch = [item for item in batch if src.ready_nbytes(item[0]) == item[1]]
            keys = [item[0] for item in batch]
            src.pin_many(keys)
        try:
            with self._source_bytes(src, keys, [item[1] for item in batch]) as (bufs, oks, sums):
                if False in oks:
                    with self._lock:
                        self.durability.drops.record([key for key, ok in zip(keys, oks) if not ok],
                                                DropReason.READ_FAILED)
                for k in self.behind_levels:
                    if k > j:
                        self._write_below(j, k, batch, bufs, oks, sums)
        finally:
            with self._lock:
                src.unpin_many(keys)

    def _source_bytes(self, src: Level, keys: list[str], sizes: list[int]) -> _SourceBytes:
        """The bytes of pinned ``keys`` of ``src``: a host slab's own views, or a read into a staging arena."""
        return _SourceBytes(self, src, keys, sizes)

    def _write_below(self, j: int, k: int, batch: list[tuple[str, int, int]], bufs: list[Parts],
                     oks: list[bool], sums: list[Optional[int]]) -> None:
        """Write the chunks of ``batch`` (read from level ``j``, where they are pinned) held in ``bufs`` into
        write-behind level ``k`` where it admitted them and still lacks them."""
        lvl = self.levels[k]
        chain = self.chain
        held: Held = {}
        try:
            go = []
            for i, (key, nbytes, wanted) in enumerate(batch):
                if not oks[i] or not wanted & lvl.bit:
                    continue
                with self._lock:
                    if lvl.holds(key):
                        continue
                placed, flags = self.placer.place(key, nbytes, k, k + 1, held, admitted=True)
                if placed is not None:
                    go.append(i)
                elif flags:
                    self.durability.refused_below(lvl, key, nbytes, flags)
            if not go:
                return
            wrote = self.io.write(lvl, [batch[i][0] for i in go], [bufs[i] for i in go],
                                  sums=[sums[i] for i in go], source=self.levels[j])
            with self._lock:
                failed = []
                for i, ok in zip(go, wrote):
                    key, nbytes, _ = batch[i]
                    held.pop((k, key), None)
                    if chain.finish_write(lvl, key, nbytes, ok, source=self.levels[j]):
                        lvl.counters.persisted += 1
                    elif not ok:
                        failed.append(key)
                if failed:
                    self.durability.drops.record(failed, self.durability.drop_reason(k))
        finally:
            chain.release(held)

    # ------------------------------------------------------------------ promotion
    def _promote(self, jobs: list[Promotion]) -> None:
        """Copy hits served below the top managed level up, as the promotion policy says.

        One batch promotes at most half of a level's capacity into it: a batch larger than
        the level would otherwise evict its own earlier chunks (thrashing).  The bytes are
        read again from the level that served them, pinned there meanwhile, staged at most
        ``_COPY_BATCH_BYTES`` at a time (so the staging arena stays that small however many
        hits a batch promotes).
        """
        by_source: dict[int, dict[str, int]] = {}
        for key, j, nbytes in jobs:
            by_source.setdefault(j, {})[key] = nbytes
        budget = {k: self.levels[k].capacity // 2 for k in self.chain.managed}
        for j, items in by_source.items():
            self._promote_from(j, items, budget)

    def _promote_from(self, j: int, items: dict[str, int], budget: dict[int, int]) -> None:
        """Promote chunks served by level ``j`` (pinned there meanwhile when it is managed; a shared pool is
        read again as it is, and a chunk it lost meanwhile is a failed read)."""
        src = self.levels[j]
        with self._lock:
            if src.managed:
                items = {key: nb for key, nb in items.items() if src.ready_nbytes(key) == nb}
            plan = self._promotion_targets(j, items, budget)
            keys = list(plan)
            if src.managed:
                src.pin_many(keys)
        if not keys:
            return
        try:
            for part in _by_bytes(keys, items, _COPY_BATCH_BYTES):  # (a staging arena of at most one batch)
                sizes = [items[key] for key in part]
                with self._source_bytes(src, part, sizes) as (bufs, oks, sums):
                    for i, key in enumerate(part):
                        if oks[i]:
                            self._promote_one(j, plan[key], key, sizes[i], bufs[i], sums[i])
        finally:
            if src.managed:
                with self._lock:
                    src.unpin_many(keys)

    def _promotion_targets(self, j: int, items: dict[str, int], budget: dict[int, int]) -> dict[str, int]:
        """key -> the faster managed level it is copied into: the first above ``j`` that is available,
        lacks it, admits it, has budget left and that the promotion policy names.  Lock held."""
        plan: dict[str, int] = {}
        src = self.levels[j]
        for key, nbytes in items.items():
            for k in self.chain.managed:
                if k >= j:
                    break
                lvl = self.levels[k]
                if not lvl.tier.available:
                    continue
                if lvl.knows(key):
                    break
                if budget[k] < nbytes or not self.chain.admits(lvl, key, nbytes):
                    continue
                budget[k] -= nbytes
                if self.promotion.should_promote(key, src.name, lvl.name):
                    plan[key] = k
                break
        return plan

    def _promote_one(self, j: int, k: int, key: str, nbytes: int, parts: Parts, chunk_sum: Optional[int]) -> None:
        lvl = self.levels[k]
        held: Held = {}
        try:
            if self.placer.reserve(k, key, nbytes, held):
                ok = self.io.write(lvl, [key], [parts], sums=[chunk_sum], source=self.levels[j])[0]
                with self._lock:
                    held.pop((k, key), None)
                    if self.chain.finish_write(lvl, key, nbytes, ok, source=self.levels[j]):
                        self.levels[j].counters.promotions += 1
        finally:
            self.chain.release(held)


def _by_bytes(keys: list[str], sizes: dict[str, int], limit: int) -> list[list[str]]:
    """``keys`` in consecutive batches of at most ``limit`` bytes each (a larger chunk alone)."""
    out: list[list[str]] = []
    batch: list[str] = []
    size = 0
    for key in keys:
        n = sizes[key]
        if batch and size + n > limit:
            out.append(batch)
            batch, size = [], 0
        batch.append(key)
        size += n
    if batch:
        out.append(batch)
    return out


class _SourceBytes:
    """``with copier._source_bytes(src, keys, sizes) as (bufs, oks, sums)``: the pinned chunks' bytes, each
    with whether it could be read and the checksum it carried (None where the source kept none); a staging
    arena, when one was needed, is given back at the end."""

    def __init__(self, copier: Copier, src: Level, keys: list[str], sizes: list[int]) -> None:
        self._copier, self._src, self._keys, self._sizes = copier, src, keys, sizes
        self._lease: Any = None

    def __enter__(self) -> tuple[list[Parts], list[bool], list[Optional[int]]]:
        src, keys, io = self._src, self._keys, self._copier.io
        sums: list[Optional[int]] = [None] * len(keys)
        if src.located:
            with self._copier._lock:
                codes = src.codes(keys)
                if src.keeps_sums:
                    sums = list(map(src.sums.get, keys))
            views = _views(src, codes)
            if views is not None:
                if src.checks_reads:  # (the views are the chunks' own bytes: checked as a read would be)
                    oks = io.check(src, keys, views, sums)
                    return views, oks, sums
                return views, [True] * len(keys), sums
        self._lease = self._copier.stager.carve(self._sizes)
        bufs: list[Parts] = [[b] for b in self._lease.__enter__()]
        if src.managed:
            return bufs, io.read(src, keys, bufs, sums_out=sums), sums
        got = io.read_unmanaged(src, keys, bufs, sums_out=sums)  # (a shared pool: one lost meanwhile is a failed read)
        return bufs, got if got is not None else [False] * len(keys), sums

    def __exit__(self, *exc: object) -> None:
        if self._lease is not None:
            self._lease.__exit__(*exc)


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
