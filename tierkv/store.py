"""``TieredStore``: the one place that knows the order of tiers.

The chain is a list of *levels*, fastest first.  Each level wraps one ``Tier``
(the medium) with the policies that steer it (eviction, admission) and, for
*managed* media, the store's own index of what the level holds.

Life of a chunk in a managed level::

    absent --reserve--> RESERVED --write ok--> READY --evict/remove--> absent
                           |                     |
                           +--write failed--> absent   (pinned while read: freed at last unpin)

Invariants (tested in ``tests/test_store_model.py`` and ``tests/test_concurrency.py``):

1. **Capacity.**  For every managed level, ``used_bytes`` — the sum of
   ``tier.footprint(nbytes)`` over its RESERVED and READY entries and of doomed
   entries still pinned by a reader — never exceeds ``capacity_bytes``.  Space is
   reserved before any byte is written and released only after the bytes are no
   longer read.
2. **Pinning.**  A chunk being read (a ``get``, or the source of a demotion) is
   pinned and is never named as an eviction victim; a chunk being written is
   RESERVED, unknown to the eviction policy, and so never evicted either.
   Two-phase write: a RESERVED chunk is neither found by ``lookup`` nor read.
3. **Exact bytes or a miss.**  ``get`` reports True only for bytes the medium
   verified as the ones written; a failed or corrupt read drops that copy,
   counts an error and falls through to the next level holding the key.
4. **Demotion never loses a chunk a lower level could accept.**  A victim is
   copied to the next level that admits it (or is already there: levels are
   inclusive) before it leaves; only when no lower level takes it is it dropped.
5. **Thread safety.**  One lock guards all metadata; bytes move outside it, with
   pins and reservations making that safe.  Policies are only called under the
   lock, so they need none of their own.

Normal outcomes (miss, no room, backend down) are values and counters; misuse
raises an error that names the problem.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional, Union

import torch

from tierkv.buffers import Parts, Value, check_size, staging, to_parts
from tierkv.errors import ConfigError, PolicyError, StoreClosedError
from tierkv.keys import check_key
from tierkv.observe import Observable
from tierkv.policies import (
    AdmissionPolicy,
    EvictionPolicy,
    PromotionPolicy,
    build_admission,
    build_eviction,
    build_promotion,
)
from tierkv.stats import StoreCounters, TierCounters
from tierkv.tiers.base import Tier

log = logging.getLogger("tierkv")

#: how often a reservation retries after its victims were taken by a racing writer
_RESERVE_ATTEMPTS = 8


class _Entry:
    __slots__ = ("nbytes", "footprint", "ready", "pins", "doomed")

    def __init__(self, nbytes: int, footprint: int, ready: bool = False) -> None:
        self.nbytes = nbytes
        self.footprint = footprint
        self.ready = ready
        self.pins = 0
        self.doomed = False


class Level:
    """One tier in the chain, as the store sees it (its policies and its index)."""

    def __init__(
        self,
        tier: Tier,
        eviction: Union[str, EvictionPolicy, dict, None] = None,
        admission: Union[str, AdmissionPolicy, dict, None] = None,
        write_through: bool = False,
    ) -> None:
        if not isinstance(tier, Tier):
            raise TypeError(f"a level needs a Tier, got {type(tier).__name__}")
        self.tier = tier
        self.name = tier.name
        self.managed = tier.managed
        if not self.managed and eviction is not None:
            raise ConfigError(f"tier {tier.name!r} ({tier.medium}) manages its own space: it takes no 'eviction'")
        self.eviction = build_eviction(eviction) if self.managed else None
        if self.eviction is not None:
            self.eviction.capacity_bytes = tier.capacity_bytes
        self.admission = build_admission(admission)
        self.write_through = bool(write_through)
        self.index: dict[str, _Entry] = {}
        self.pinned: set[str] = set()
        self.used = 0
        self.counters = TierCounters()
        self.bit = 0

    @property
    def capacity(self) -> int:
        return self.tier.capacity_bytes


StoreConfig = Union[dict, str, "os.PathLike[str]"]


class TieredStore(Observable):
    """A chain of tiers, fastest first, behind one batch-first API.

    ``put`` writes into the highest level whose admission policy accepts the
    chunk (and into lower ``write_through`` levels too); a full level's eviction
    policy names victims, which are demoted down the chain.  ``get`` reads from
    the fastest level holding the key and promotes per the promotion policy.
    See the module docstring for the invariants.
    """

    def __init__(
        self,
        tiers: Sequence[Union[Tier, Level]],
        promotion: Union[str, PromotionPolicy, dict, None] = None,
        io_workers: int = 4,
    ) -> None:
        if not tiers:
            raise ConfigError("a store needs at least one tier")
        self.levels: list[Level] = [t if isinstance(t, Level) else Level(t) for t in tiers]
        names = [lvl.name for lvl in self.levels]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ConfigError(f"tier names must be unique; repeated: {sorted(dup)}")
        for i, lvl in enumerate(self.levels):
            lvl.bit = 1 << i
        self.promotion = build_promotion(promotion)
        self._lock = threading.RLock()
        self._idle = threading.Condition(self._lock)
        self._in_flight = 0
        self._closed = False
        self._where: dict[str, int] = {}  # key -> bitmask of managed levels holding it READY
        self._counters = StoreCounters()
        # only admission policies that observe demand are told about accesses
        self._admissions = [a for a in {id(lvl.admission): lvl.admission for lvl in self.levels}.values()
                            if type(a).on_access is not AdmissionPolicy.on_access]
        self._managed_levels = [i for i, lvl in enumerate(self.levels) if lvl.managed]
        self._shared_levels = [i for i, lvl in enumerate(self.levels) if not lvl.managed]
        self._any_write_through = any(lvl.write_through for lvl in self.levels)
        self._executor = ThreadPoolExecutor(max_workers=max(1, io_workers), thread_name_prefix="tierkv-store")
        self._observers: list[Any] = []  # see Observable (tierkv.observe)
        self._recover()

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_config(cls, config: StoreConfig) -> "TieredStore":
        """Build a store from a dict or a JSON / YAML / TOML file (see ``tierkv.config``)."""
        from tierkv.config import build_levels, load_config

        cfg = load_config(config)
        levels = build_levels(cfg["tiers"])
        try:
            store = cls(levels, promotion=cfg.get("promotion"), io_workers=cfg.get("io_workers", 4))
        except Exception:
            for lvl in levels:
                lvl.tier.close()
            raise
        store._attach_from_config(cfg)
        return store

    def _recover(self) -> None:
        """Index what persistent media kept from an earlier process, oldest first."""
        for lvl in self.levels:
            if not (lvl.managed and lvl.tier.persistent):
                continue
            for key, nbytes in lvl.tier.recover():
                fp = lvl.tier.footprint(nbytes)
                if key in lvl.index or lvl.used + fp > lvl.capacity:
                    lvl.tier.delete([key])  # the configured capacity shrank: keep the newest that fit
                    continue
                lvl.index[key] = _Entry(nbytes, fp, ready=True)
                lvl.used += fp
                self._where[key] = self._where.get(key, 0) | lvl.bit
                lvl.eviction.on_insert(key, nbytes)
            if lvl.index:
                log.info("tierkv: tier %s recovered %d chunks (%d bytes)", lvl.name, len(lvl.index), lvl.used)

    # ------------------------------------------------------------------ lifecycle
    def _enter(self) -> None:
        with self._lock:
            if self._closed:
                raise StoreClosedError("the store is closed")
            self._in_flight += 1

    def _leave(self) -> None:
        with self._lock:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.notify_all()

    def close(self) -> None:
        """Wait for calls in flight, make persistent tiers durable, release every tier.  Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._idle.wait_for(lambda: self._in_flight == 0, timeout=60)
        self._executor.shutdown(wait=True)
        self._close_observers()
        for lvl in self.levels:
            try:
                lvl.tier.flush()
            finally:
                lvl.tier.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "TieredStore":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def flush(self) -> None:
        """Make everything stored so far survive a crash of this process (persistent tiers)."""
        self._enter()
        try:
            for lvl in self.levels:
                lvl.tier.flush()
        finally:
            self._leave()

    # ------------------------------------------------------------------ put
    def put(self, keys: Sequence[str], values: Sequence[Value]) -> list[bool]:
        """Store chunks; one bool per key: True if stored now or already present (dedup).

        ``values[i]`` is a contiguous tensor (any dtype, shape, device) or a list of
        them, whose bytes are the chunk.  False means no tier took it (admission,
        no room, media errors); it is counted, never raised.
        """
        keys, values = self._pairs(keys, values, "values")
        prepared = [to_parts(v, f"values[{i}]") for i, v in enumerate(values)]
        self._enter()
        t0 = time.perf_counter()
        try:
            res = self._put(keys, prepared)
        finally:
            self._leave()
        if self._observers:
            self._observe("put", keys, res, t0, prepared)
        return res

    def _put(self, keys: list[str], prepared: list[tuple[Parts, int]]) -> list[bool]:
        n = len(keys)
        results = [False] * n
        first: dict[str, int] = {}
        todo: list[int] = []
        with self._lock:
            c = self._counters
            c.put_calls += 1
            c.chunks_put += n
            for i, key in enumerate(keys):
                for adm in self._admissions:
                    adm.on_access(key)
                if key in first:  # a repeat inside the batch: takes the first one's result
                    c.chunks_deduped += 1
                    continue
                first[key] = i
                if key in self._where or self._busy(key):
                    results[i] = True
                    c.chunks_deduped += 1
                else:
                    todo.append(i)
        # place, write (batched per level), commit; failures fall through to lower levels
        start = {i: 0 for i in todo}
        while todo:
            groups: dict[int, list[int]] = {}
            slow = []
            with self._lock:  # fast path: the first level that admits has room without evicting
                for i in todo:
                    j = self._place_fast(keys[i], prepared[i][1], start[i])
                    if j is None:
                        slow.append(i)
                    else:
                        groups.setdefault(j, []).append(i)
            for i in slow:
                j = self._place(keys[i], prepared[i][1], start[i])
                if j is None:
                    with self._lock:
                        self._counters.chunks_rejected += 1
                    continue
                groups.setdefault(j, []).append(i)
            todo = []
            for j, idx in sorted(groups.items()):
                lvl = self.levels[j]
                oks = self._tier_write(lvl, [keys[i] for i in idx], [prepared[i][0] for i in idx])
                with self._lock:
                    for i, ok in zip(idx, oks):
                        if self._finish_write(lvl, keys[i], prepared[i][1], ok):
                            results[i] = True
                            self._counters.chunks_stored += 1
                            self._counters.bytes_put += prepared[i][1]
                        else:
                            start[i] = j + 1
                            todo.append(i)
                if self._any_write_through:
                    for i, ok in zip(idx, oks):
                        if ok:
                            self._write_through(j, keys[i], prepared[i])
        for i, key in enumerate(keys):
            fi = first[key]
            if fi != i:
                results[i] = results[fi]
        return results

    def _busy(self, key: str) -> bool:
        """Reserved (being written) in some managed level.  Caller holds the lock."""
        for j in self._managed_levels:
            e = self.levels[j].index.get(key)
            if e is not None and not e.doomed:
                return True
        return False

    def _tier_write(self, lvl: Level, keys: list[str], parts: list[Parts]) -> list[bool]:
        return self._tier_io(lvl, "write", keys, parts)

    def _tier_read(self, lvl: Level, keys: list[str], parts: list[Parts]) -> list[bool]:
        return self._tier_io(lvl, "read", keys, parts)

    @staticmethod
    def _tier_io(lvl: Level, op: str, keys: list[str], parts: list[Parts]) -> list[bool]:
        """A tier's ``read`` or ``write``: a medium fault costs misses, never the caller's request."""
        try:
            oks = getattr(lvl.tier, op)(keys, parts)
        except StoreClosedError:
            raise
        except Exception as e:
            log.warning("tierkv: tier %s %s failed: %s", lvl.name, op, e)
            oks = [False] * len(keys)
        if len(oks) != len(keys):
            raise PolicyError(f"tier {lvl.name!r} answered {len(oks)} results for {len(keys)} keys")
        return oks

    def _place_fast(self, key: str, nbytes: int, start: int) -> Optional[int]:
        """``_place`` for the common case, under the caller's lock: no eviction needed.

        Returns the level reserved (or the unmanaged level chosen), or None when the
        first level that admits the chunk would have to evict: the slow path decides.
        """
        for j in range(start, len(self.levels)):
            lvl = self.levels[j]
            if not lvl.tier.available:
                continue
            if not lvl.admission.admit(key, nbytes, lvl.name):
                lvl.counters.rejected += 1
                continue
            if not lvl.managed:
                return j
            fp = lvl.tier.footprint(nbytes)
            if key in lvl.index or lvl.used + fp > lvl.capacity:
                return None
            lvl.index[key] = _Entry(nbytes, fp)
            lvl.used += fp
            return j
        return None

    def _place(self, key: str, nbytes: int, start: int, stop: Optional[int] = None) -> Optional[int]:
        """The first level in [start, stop) that admits the chunk and has (or made) room; reserved there."""
        stop = len(self.levels) if stop is None else stop
        for j in range(start, stop):
            lvl = self.levels[j]
            if not lvl.tier.available:
                continue
            with self._lock:
                admitted = lvl.admission.admit(key, nbytes, lvl.name)
                if not admitted:
                    lvl.counters.rejected += 1
            if not admitted:
                continue
            if not lvl.managed or self._reserve(j, key, nbytes):
                return j
        return None

    def _reserve(self, j: int, key: str, nbytes: int) -> bool:
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
                free = lvl.capacity - lvl.used
                if fp <= free:
                    lvl.index[key] = _Entry(nbytes, fp)
                    lvl.used += fp
                    return True
                victims = self._victims(lvl, fp - free)
                if victims is None:
                    lvl.counters.rejected += 1
                    return False
                for v in victims:
                    self._pin(lvl, v)
            self._evict(j, victims)
        with self._lock:
            lvl.counters.rejected += 1
        return False

    def _victims(self, lvl: Level, need: int) -> Optional[list[str]]:
        """Ask the policy, then check its answer (a subclass cannot break the invariants)."""
        victims = lvl.eviction.victims(need, lvl.pinned)
        if victims is None:
            return None
        victims = list(victims)
        freed, seen = 0, set()
        for v in victims:
            e = lvl.index.get(v)
            if e is None or not e.ready or e.doomed:
                raise PolicyError(f"eviction policy {type(lvl.eviction).__name__} of tier {lvl.name!r} named {v!r}, "
                                  "which the tier does not hold (did on_remove forget it?)")
            if v in lvl.pinned:
                raise PolicyError(f"eviction policy {type(lvl.eviction).__name__} named the protected key {v!r}")
            if v in seen:
                raise PolicyError(f"eviction policy {type(lvl.eviction).__name__} named {v!r} twice")
            seen.add(v)
            freed += e.footprint
        if freed < need:
            # sizes in the policy differ from footprints (alignment): ask again for the rest
            more = lvl.eviction.victims(need, lvl.pinned | seen)
            if more is None:
                return None
            for v in more:
                e = lvl.index.get(v)
                if v in seen or e is None or not e.ready or e.doomed or v in lvl.pinned:
                    continue
                victims.append(v)
                seen.add(v)
                freed += e.footprint
                if freed >= need:
                    break
            if freed < need:
                return None
        return victims

    def _evict(self, j: int, victims: list[str]) -> None:
        """Demote then drop pinned victims of level ``j`` (called without the lock)."""
        lvl = self.levels[j]
        for key in victims:
            e = lvl.index[key]
            demoted = self._demote(j, key, e.nbytes)
            with self._lock:
                lvl.counters.evictions += 1
                if demoted:
                    lvl.counters.demotions += 1
                self._drop(lvl, key, e)
                self._unpin(lvl, key, e)

    def _demote(self, j: int, key: str, nbytes: int) -> bool:
        """Copy ``key`` from level ``j`` into the next lower level that takes it.  True if it now lives below."""
        with self._lock:
            if self._where.get(key, 0) >> (j + 1):
                return True  # a lower level already holds it
        if j + 1 >= len(self.levels):
            return False
        buf: Optional[torch.Tensor] = None
        start = j + 1
        while start < len(self.levels):
            k = self._place(key, nbytes, start)
            if k is None:
                return False
            if buf is None:
                buf = staging(nbytes)
                if not self._tier_read(self.levels[j], [key], [[buf]])[0]:
                    with self._lock:
                        self.levels[j].counters.errors += 1
                    self._finish_write(self.levels[k], key, nbytes, False, count_error=False)
                    return False
            ok = self._tier_write(self.levels[k], [key], [[buf]])[0]
            if self._finish_write(self.levels[k], key, nbytes, ok):
                return True
            start = k + 1
        return False

    def _finish_write(self, lvl: Level, key: str, nbytes: int, ok: bool, count_error: bool = True) -> bool:
        """Commit (ok) or abort a write into ``lvl``.  Returns ``ok``."""
        with self._lock:
            if lvl.managed:
                e = lvl.index.get(key)
                if e is None or e.ready:  # cannot happen: a reservation is only ours
                    raise PolicyError(f"tier {lvl.name!r}: no reservation for {key!r}")
                if ok:
                    e.ready = True
                    self._where[key] = self._where.get(key, 0) | lvl.bit
                    lvl.eviction.on_insert(key, nbytes)
                else:
                    del lvl.index[key]
                    lvl.used -= e.footprint
            if ok:
                lvl.counters.puts += 1
                lvl.counters.bytes_written += nbytes
            elif count_error:
                lvl.counters.errors += 1
        return ok

    def _write_through(self, j: int, key: str, prepared: tuple[Parts, int]) -> None:
        parts, nbytes = prepared
        for k in range(j + 1, len(self.levels)):
            lvl = self.levels[k]
            if not lvl.write_through:
                continue
            with self._lock:
                if self._where.get(key, 0) & lvl.bit:
                    continue
            if self._place(key, nbytes, k, k + 1) is None:
                continue
            ok = self._tier_write(lvl, [key], [parts])[0]
            self._finish_write(lvl, key, nbytes, ok)

    # ------------------------------------------------------------------ pins and drops (lock held)
    def _pin(self, lvl: Level, key: str) -> _Entry:
        e = lvl.index[key]
        e.pins += 1
        lvl.pinned.add(key)
        return e

    def _unpin(self, lvl: Level, key: str, e: _Entry) -> None:
        e.pins -= 1
        if e.pins == 0:
            lvl.pinned.discard(key)
            if e.doomed:
                self._free(lvl, key, e)

    def _drop(self, lvl: Level, key: str, e: _Entry) -> None:
        """Make a READY entry unreadable now; its space is freed when no reader holds it."""
        if e.doomed:
            return
        if e.ready:
            e.ready = False
            lvl.eviction.on_remove(key)
            mask = self._where.get(key, 0) & ~lvl.bit
            if mask:
                self._where[key] = mask
            else:
                self._where.pop(key, None)
        e.doomed = True
        if e.pins == 0:
            self._free(lvl, key, e)

    def _free(self, lvl: Level, key: str, e: _Entry) -> None:
        if lvl.index.get(key) is e:
            del lvl.index[key]
            lvl.used -= e.footprint
            try:
                lvl.tier.delete([key])
            except Exception as exc:  # the bytes are unreachable through the index either way
                log.warning("tierkv: tier %s delete failed: %s", lvl.name, exc)

    # ------------------------------------------------------------------ get
    def get(self, keys: Sequence[str], outs: Sequence[Value]) -> list[bool]:
        """Copy each stored chunk into ``outs[i]``; one bool per key, True where found exact.

        ``outs[i]`` must hold exactly the chunk's bytes (its shape and dtype may be
        any view of them).  A False leaves ``outs[i]`` unspecified.
        """
        keys, outs = self._pairs(keys, outs, "outs")
        prepared = [to_parts(o, f"outs[{i}]") for i, o in enumerate(outs)]
        self._enter()
        t0 = time.perf_counter()
        try:
            res = self._get(keys, prepared)
        finally:
            self._leave()
        if self._observers:
            self._observe("get", keys, res, t0, prepared)
        return res

    def _get(self, keys: list[str], prepared: list[tuple[Parts, int]]) -> list[bool]:
        n = len(keys)
        results = [False] * n
        served: list[Optional[int]] = [None] * n
        # plan: each key's fastest managed level holding it; sizes checked before anything is pinned
        with self._lock:
            self._counters.get_calls += 1
            for i, key in enumerate(keys):
                mask = self._where.get(key, 0)
                if mask:
                    j = (mask & -mask).bit_length() - 1
                    check_size(key, prepared[i][1], self.levels[j].index[key].nbytes)
            for i, key in enumerate(keys):
                for adm in self._admissions:
                    adm.on_access(key)
        pending = list(range(n))
        tried: list[int] = [0] * n  # bitmask of levels already tried for key i
        no_local: list[int] = []
        while pending:
            groups: dict[int, list[int]] = {}
            with self._lock:
                for i in pending:
                    e = None
                    mask = self._where.get(keys[i], 0) & ~tried[i]
                    while mask:
                        j = (mask & -mask).bit_length() - 1
                        tried[i] |= 1 << j
                        mask &= mask - 1
                        e = self.levels[j].index[keys[i]]
                        if e.nbytes == prepared[i][1]:
                            break
                        e = None
                    if e is None:
                        no_local.append(i)
                        continue
                    self._pin(self.levels[j], keys[i])
                    groups.setdefault(j, []).append(i)
            pending = []
            for j, idx in groups.items():
                lvl = self.levels[j]
                oks = self._tier_read(lvl, [keys[i] for i in idx], [prepared[i][0] for i in idx])
                with self._lock:
                    for i, ok in zip(idx, oks):
                        e = lvl.index[keys[i]]
                        if ok and not e.doomed:
                            results[i] = True
                            served[i] = j
                            lvl.counters.hits += 1
                            lvl.counters.bytes_read += prepared[i][1]
                            lvl.eviction.on_access(keys[i])
                        else:  # lost, torn or corrupt: drop this copy, try the next level
                            if not ok:
                                lvl.counters.errors += 1
                                self._drop(lvl, keys[i], e)
                            pending.append(i)
                        self._unpin(lvl, keys[i], e)
        if no_local and self._shared_levels:
            self._read_shared(keys, prepared, no_local, results, served)
        # misses, per level consulted: every available level above the one that served
        available = [lvl.tier.available for lvl in self.levels]
        missed_above = [0] * (len(self.levels) + 1)
        got = 0
        for i in range(n):
            j = served[i]
            missed_above[len(self.levels) if j is None else j] += 1
            if j is not None:
                got += prepared[i][1]
        with self._lock:
            below = 0  # keys served at or below level k (or not at all)
            for k in range(len(self.levels), -1, -1):
                if k < len(self.levels) and available[k]:
                    self.levels[k].counters.misses += below
                below += missed_above[k]
            self._counters.misses += missed_above[len(self.levels)]
            self._counters.hits += n - missed_above[len(self.levels)]
            self._counters.bytes_got += got
        if any(j for j in served):  # something was served below the top level
            self._promote(keys, prepared, served)
        return results

    def _read_shared(self, keys, prepared, idx: list[int], results: list[bool], served: list[Optional[int]]) -> None:
        """Try the unmanaged (shared) levels in chain order for keys no managed level served."""
        left = [i for i in idx if not results[i]]
        for j in self._shared_levels:
            if not left:
                return
            lvl = self.levels[j]
            if not lvl.tier.available:
                continue
            oks = self._tier_read(lvl, [keys[i] for i in left], [prepared[i][0] for i in left])
            nxt = []
            with self._lock:
                for i, ok in zip(left, oks):
                    if ok:
                        results[i] = True
                        served[i] = j
                        lvl.counters.hits += 1
                        lvl.counters.bytes_read += prepared[i][1]
                    else:
                        nxt.append(i)
            left = nxt

    def _promote(self, keys: list[str], prepared: list[tuple[Parts, int]], served: list[Optional[int]]) -> None:
        """Copy hits served below the top managed level up, as the promotion policy says.

        One call promotes at most half of a level's capacity into it: a batch larger
        than the level would otherwise evict its own earlier chunks (thrashing).
        """
        budget = {k: self.levels[k].capacity // 2 for k in self._managed_levels}
        for i, j in enumerate(served):
            if j is None:
                continue
            key, (parts, nbytes) = keys[i], prepared[i]
            for k in self._managed_levels:
                if k >= j:
                    break
                lvl = self.levels[k]
                if not lvl.tier.available:
                    continue
                with self._lock:
                    if self._where.get(key, 0) & lvl.bit or key in lvl.index:
                        break
                    if budget[k] < nbytes or not lvl.admission.admit(key, nbytes, lvl.name):
                        continue
                    budget[k] -= nbytes
                    go = self.promotion.should_promote(key, self.levels[j].name, lvl.name)
                if go and self._reserve(k, key, nbytes):
                    ok = self._tier_write(lvl, [key], [parts])[0]
                    if self._finish_write(lvl, key, nbytes, ok) and ok:
                        with self._lock:
                            self.levels[j].counters.promotions += 1
                break

    # ------------------------------------------------------------------ lookup, locate, remove
    def lookup(self, keys: Sequence[str]) -> int:
        """How many leading keys are present in some tier.  No side effects."""
        keys = list(keys)
        t0 = time.perf_counter()
        n = self._lookup(keys)
        if self._observers:
            self._observe("lookup", keys, n, t0, None)
        return n

    def _lookup(self, keys: list[str]) -> int:
        self._enter()
        try:
            n = 0
            with self._lock:
                self._counters.lookup_calls += 1
                where = self._where
                for k in keys:
                    if k not in where:
                        break
                    n += 1
            if n == len(keys) or not self._shared_levels:
                return n
            rest = keys[n:]
            with self._lock:
                local = [k in self._where for k in rest]
            ask = [i for i, hit in enumerate(local) if not hit]
            for i, hit in zip(ask, self._shared_contains([rest[i] for i in ask])):
                local[i] = hit
            for hit in local:
                if not hit:
                    break
                n += 1
            return n
        finally:
            self._leave()

    def _shared_contains(self, keys: list[str]) -> list[bool]:
        found = [False] * len(keys)
        for j in self._shared_levels:
            lvl = self.levels[j]
            if not lvl.tier.available:
                continue
            ask = [i for i, f in enumerate(found) if not f]
            if not ask:
                break
            try:
                res = lvl.tier.contains([keys[i] for i in ask])
            except Exception as e:
                log.warning("tierkv: tier %s contains failed: %s", lvl.name, e)
                continue
            for i, hit in zip(ask, res):
                if hit:
                    found[i] = True
        return found

    def contains(self, keys: Sequence[str]) -> list[bool]:
        """Presence of each key in some tier (not only the leading ones).  No side effects."""
        return [name is not None for name in self.locate(keys)]

    def locate(self, keys: Sequence[str]) -> list[Optional[str]]:
        """Name of the fastest tier holding each key (None where none does).  No side effects."""
        keys = list(keys)
        self._enter()
        try:
            out: list[Optional[str]] = [None] * len(keys)
            with self._lock:
                for i, k in enumerate(keys):
                    mask = self._where.get(k, 0)
                    if mask:
                        out[i] = self.levels[(mask & -mask).bit_length() - 1].name
            missing = [i for i, o in enumerate(out) if o is None]
            for j in self._shared_levels:
                lvl = self.levels[j]
                if not missing or not lvl.tier.available:
                    continue
                try:
                    res = lvl.tier.contains([keys[i] for i in missing])
                except Exception:
                    continue
                for i, hit in zip(list(missing), res):
                    if hit:
                        out[i] = lvl.name
                missing = [i for i in missing if out[i] is None]
            return out
        finally:
            self._leave()

    def remove(self, keys: Sequence[str]) -> None:
        """Forget the chunks in every tier (absent keys are ignored)."""
        keys = list(keys)
        self._enter()
        try:
            with self._lock:
                for key in keys:
                    for j in self._managed_levels:
                        lvl = self.levels[j]
                        e = lvl.index.get(key)
                        if e is not None and e.ready:
                            self._drop(lvl, key, e)
                    self.promotion.on_remove(key)
            for j in self._shared_levels:
                lvl = self.levels[j]
                if lvl.tier.available:
                    try:
                        lvl.tier.delete(keys)
                    except Exception as e:
                        log.warning("tierkv: tier %s delete failed: %s", lvl.name, e)
        finally:
            self._leave()

    # ------------------------------------------------------------------ async twins
    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(fn, *args))

    async def aput(self, keys: Sequence[str], values: Sequence[Value]) -> list[bool]:
        """``put`` on the store's I/O threads, awaitable."""
        return await self._run(self.put, keys, values)

    async def aget(self, keys: Sequence[str], outs: Sequence[Value]) -> list[bool]:
        """``get`` on the store's I/O threads, awaitable."""
        return await self._run(self.get, keys, outs)

    async def alookup(self, keys: Sequence[str]) -> int:
        """``lookup`` on the store's I/O threads, awaitable (shared tiers may answer over the network)."""
        return await self._run(self.lookup, keys)

    async def aremove(self, keys: Sequence[str]) -> None:
        """``remove`` on the store's I/O threads, awaitable."""
        return await self._run(self.remove, keys)

    # the same coroutines under the longer names some engines expect
    put_async = aput
    get_async = aget
    lookup_async = alookup
    remove_async = aremove

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict[str, Any]:
        """Counters per tier (under ``"tiers"`` and at the top level, by name) and store totals (``"total"``)."""
        tiers: dict[str, dict[str, Any]] = {}
        with self._lock:
            for lvl in self.levels:
                d: dict[str, Any] = {
                    "medium": lvl.tier.medium,
                    "capacity_bytes": lvl.capacity,
                    "used_bytes": lvl.used if lvl.managed else lvl.tier.used_bytes,
                    "stored_bytes": lvl.tier.used_bytes,
                    "entries": sum(1 for e in lvl.index.values() if e.ready) if lvl.managed else None,
                    "available": bool(lvl.tier.available),
                    **lvl.counters.as_dict(),
                }
                if lvl.eviction is not None:
                    d["eviction"] = getattr(lvl.eviction, "name", type(lvl.eviction).__name__)
                try:
                    extra = lvl.tier.extra_stats()
                except Exception as e:
                    extra = {"extra_stats_error": str(e)}
                for k, v in extra.items():
                    d.setdefault(k, v)
                tiers[lvl.name] = d
            total: dict[str, Any] = self._counters.as_dict()
            for field in ("capacity_bytes", "used_bytes", "evictions", "promotions", "demotions", "errors",
                          "rejected", "bytes_read", "bytes_written"):
                total[field] = sum(t[field] for t in tiers.values())
            total["in_flight"] = self._in_flight
        self._observer_stats(tiers)
        out: dict[str, Any] = {"tiers": tiers, "total": total}
        for name, d in tiers.items():
            out.setdefault(name, d)
        return out

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _pairs(keys: Sequence[str], values: Sequence[Any], what: str) -> tuple[list[str], list[Any]]:
        if isinstance(keys, str):
            raise TypeError("keys must be a sequence of keys, not a single string (wrap it in a list)")
        keys = list(keys)
        if isinstance(values, torch.Tensor):
            raise TypeError(f"{what} must be a sequence with one tensor per key, not a single tensor")
        values = list(values)
        if len(keys) != len(values):
            raise ValueError(f"got {len(keys)} keys but {len(values)} {what}")
        for k in keys:
            check_key(k)
        return keys, values

    def tier_names(self) -> list[str]:
        """The tiers' names, fastest first."""
        return [lvl.name for lvl in self.levels]

    def tier_info(self) -> list[dict[str, Any]]:
        """What an adapter may know of each tier, fastest first, without reading store internals.

        Each entry: ``name``, ``medium``, ``locality`` (``"device"``, ``"host"``,
        ``"remote"`` or ``"disk"``), ``persistent`` (objects survive the process),
        ``shared`` (the tier is a pool other processes see: presence is asked of it),
        ``capacity_bytes`` and ``available``.
        """
        return [{
            "name": lvl.name,
            "medium": lvl.tier.medium,
            "locality": getattr(lvl.tier, "locality", "host"),
            "persistent": bool(lvl.tier.persistent),
            "shared": not lvl.managed,
            "capacity_bytes": lvl.capacity,
            "available": bool(lvl.tier.available),
        } for lvl in self.levels]

    def __repr__(self) -> str:
        chain = " -> ".join(f"{lvl.name}({lvl.tier.medium})" for lvl in self.levels)
        return f"TieredStore({chain})"
