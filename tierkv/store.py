"""``TieredStore``: the one place that knows the order of tiers.

The chain is a list of *levels* (``tierkv.level.Level``), fastest first.  Each
level wraps one ``Tier`` (the medium) with the policies that steer it (eviction,
admission) and, for *managed* media, the index of what the level holds.

Life of a chunk in a managed level::

    absent --reserve--> RESERVED --write ok--> READY --evict/remove--> absent
                           |                     |
                           +--write failed--> absent   (pinned while read: freed at last unpin)

Invariants (tested in ``tests/test_store_model.py``, ``tests/test_store_faults.py``
and ``tests/test_concurrency.py``):

1. **Capacity.**  For every managed level, ``used`` — the sum of
   ``tier.footprint(nbytes)`` over its RESERVED and READY entries and of doomed
   entries still pinned by a reader — never exceeds ``capacity``.  Space is
   reserved before any byte is written and released only after the bytes are no
   longer read.  Footprint is the one unit of size: eviction policies are told
   footprints and asked for footprints.
2. **Pinning.**  A chunk being read (a ``get``, the source of a demotion or of a
   background copy), or found present by a ``put`` (for the rest of that call), is
   pinned and is never named as an eviction victim (a policy sees the pins as a
   read-only view, and its answer is checked against them); a chunk
   being written is RESERVED, unknown to the eviction policy, and so never
   evicted either.  Two-phase write: a RESERVED chunk is neither found by
   ``lookup`` nor read.
3. **Nothing outlives its call.**  Every reservation and pin a call takes is
   released on every path out of it (``try``/``finally``), including a policy or
   medium that raises; a policy's exception surfaces as ``PolicyError`` and the
   store stays usable.
4. **Exact bytes or a miss.**  ``get`` reports True only for bytes the medium
   verified as the ones written; a failed or corrupt read drops that copy,
   counts an error and falls through to the next level holding the key.  A
   promotion copies up only bytes that were read for that key alone (buffers a
   caller passed twice, or that overlap, are never promoted).
5. **Demotion never loses a chunk a lower level could accept.**  A victim is
   copied to the next level that admits it (or is already there: levels are
   inclusive) before it leaves; only when no lower level takes it is it dropped.
6. **Persistence.**  A ``write_behind`` level (the default for persistent media)
   receives a copy of every chunk stored above it that its admission policy
   accepts, from a bounded background queue that never blocks the caller (a full
   queue drops and counts); ``flush()`` and ``close()`` drain it first.  A copy
   given up (queue full, too large, no room, disk full, a failed read or write)
   is counted by reason and named by the next ``flush()``, whose answer is then
   false (``tierkv.durability``).  What ``remove`` removed stays removed: a copy
   in flight when it ran is withdrawn, bytes and all.
7. **Thread safety.**  One lock guards all metadata; bytes move outside it, with
   pins and reservations making that safe.  Policies are only called under the
   lock, so they need none of their own.

Normal outcomes (miss, no room, backend down) are values and counters; misuse
raises an error that names the problem.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Optional, Union

import torch

from tierkv.buffers import HostViews, Value, to_parts_ptrs
from tierkv.config import build_levels, load_config
from tierkv.copying import Copying
from tierkv.durability import DropLedger, DropReason, FlushResult, fault_counts, lost_count
from tierkv.errors import ConfigError, PolicyError, StoreClosedError
from tierkv.hooks import call_policy
from tierkv.hostmem import StagingArena
from tierkv.keys import check_key, check_keys
from tierkv.level import Level
from tierkv.observe import Observable
from tierkv.options import check_int
from tierkv.outcome import PutOutcome
from tierkv.placement import Placement
from tierkv.policies import AdmissionPolicy, PromotionPolicy, build_promotion
from tierkv.readpath import ReadPath
from tierkv.recovery import plan_recovery
from tierkv.stats import StoreCounters
from tierkv.tiers.base import Tier
from tierkv.writebehind import WriteBehind
from tierkv.writepath import WritePath

if TYPE_CHECKING:
    import os

log = logging.getLogger("tierkv")

StoreConfig = Union[dict, str, "os.PathLike[str]"]  # (a name for type checkers only)


class TieredStore(WritePath, Placement, ReadPath, Copying, Observable):
    """A chain of tiers, fastest first, behind one batch-first API.

    ``put`` writes into the highest level whose admission policy accepts the
    chunk (and into lower ``write_through`` levels at once, and ``write_behind``
    levels in the background); a full level's eviction policy names victims,
    which are demoted down the chain.  ``get`` reads from the fastest level
    holding the key and promotes per the promotion policy.  See the module
    docstring for the invariants.
    """

    def __init__(
        self,
        tiers: Sequence[Union[Tier, Level]],
        promotion: Union[str, PromotionPolicy, dict, None] = None,
        io_workers: int = 4,
        write_behind_queue: int = 65536,
    ) -> None:
        if isinstance(tiers, (str, bytes)) or not isinstance(tiers, Sequence) or not tiers:
            raise ConfigError("a store needs a non-empty list of tiers (Tier or Level objects), fastest first")
        io_workers = check_int(io_workers, "io_workers", min_value=1, max_value=256)
        write_behind_queue = check_int(write_behind_queue, "write_behind_queue", min_value=0)
        self.levels: list[Level] = [t if isinstance(t, Level) else Level(t) for t in tiers]
        names = [lvl.name for lvl in self.levels]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ConfigError(f"tier names must be unique; repeated: {sorted(dup)}")
        tiers_seen = [id(lvl.tier) for lvl in self.levels]
        if len(set(tiers_seen)) != len(tiers_seen):
            raise ConfigError("the same Tier object appears twice in the chain")
        owner: dict[int, str] = {}
        for lvl in self.levels:  # a policy keeps one tier's metadata: two tiers would each evict the other's keys
            if lvl.eviction is None:
                continue
            other = owner.setdefault(id(lvl.eviction), lvl.name)
            if other != lvl.name:
                raise ConfigError(f"tiers {other!r} and {lvl.name!r} share one eviction policy object "
                                  f"({type(lvl.eviction).__name__}); give each tier its own instance")
        for i, lvl in enumerate(self.levels):
            lvl.bind(1 << i)
        self.promotion = build_promotion(promotion)
        self._lock = threading.RLock()
        self._idle = threading.Condition(self._lock)
        self._settled = threading.Condition(self._lock)  # a put waiting for another call's write (WritePath)
        self._settle_waiters = 0
        self._in_flight = 0
        self._closed = False
        self._counters = StoreCounters()
        # only admission policies that observe demand are told about accesses
        self._admissions = [a for a in {id(lvl.admission): lvl.admission for lvl in self.levels}.values()
                            if type(a).on_access is not AdmissionPolicy.on_access]
        self._managed_levels = [i for i, lvl in enumerate(self.levels) if lvl.managed]
        self._shared_levels = [i for i, lvl in enumerate(self.levels) if not lvl.managed]
        self._any_write_through = any(lvl.write_through for lvl in self.levels)
        self._behind_levels = [i for i, lvl in enumerate(self.levels) if lvl.write_behind]
        #: acknowledged chunks whose write-behind copy was given up (``flush`` reports them)
        self._drops = DropLedger()
        self._faults_seen: dict[int, dict[str, int]] = {}  # level -> its medium's fault counters (``_drop_reason``)
        self._lost_seen: dict[int, int] = {}  # persistent level -> its medium's lost objects so far (``_count_lost``)
        self._behind = WriteBehind(self._copy_behind, max_queued=write_behind_queue,
                                   on_drop=self._behind_dropped) if self._behind_levels else None
        self._arena = StagingArena()  # (write-behind batches are staged here: see ``Copying._copy_batch``)
        self._arena_lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=io_workers, thread_name_prefix="tierkv-store")
        self._observers: list[Any] = []  # see Observable (tierkv.observe)
        self._recover()
        for k, lvl in enumerate(self.levels):  # (after recovery: what opening counted is no write's fault)
            if lvl.tier.persistent:
                try:
                    extra = lvl.tier.extra_stats()
                    self._faults_seen[k] = fault_counts(extra)
                    self._lost_seen[k] = lost_count(extra)
                except Exception:  # noqa: BLE001 - a medium's stats never cost the construction
                    pass

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_config(cls, config: StoreConfig) -> TieredStore:
        """Build a store from a dict or a JSON / YAML / TOML file (see ``tierkv.config``)."""
        cfg = load_config(config)
        levels = build_levels(cfg["tiers"])
        try:
            store = cls(levels, promotion=cfg.get("promotion"), io_workers=cfg.get("io_workers", 4),
                        write_behind_queue=cfg.get("write_behind_queue", 65536))
        except Exception:
            for lvl in levels:
                lvl.tier.close()
            raise
        store._attach_from_config(cfg)
        return store

    def _recover(self) -> None:
        """Index what persistent media kept from an earlier process: the newest that fit.

        Bulk from end to end (nothing here runs per object in Python): the tier hands its objects over as
        columns (``recover_columns``), ``plan_recovery`` picks the newest version of each key and the
        newest keys whose footprints fit, and ``Level.adopt`` loads them, READY, into the index and the
        eviction policy.  Keys that do not fit are deleted from the medium.
        """
        for lvl in self.levels:
            if not (lvl.managed and lvl.tier.persistent):
                continue
            keys, sizes = lvl.tier.recover_columns()  # oldest first
            if not len(keys):
                continue
            room = lvl.capacity - lvl.used
            keep, sizes_kept, trimmed = plan_recovery(keys, sizes, lvl.footprint, room)
            if trimmed:
                lvl.tier.delete(trimmed)  # the configured capacity shrank: the oldest go
            if not lvl.adopt(keep, sizes_kept):  # some key listed twice: its newest entry counts
                keep, sizes_kept, trimmed = plan_recovery(keys, sizes, lvl.footprint, room, distinct=True)
                if trimmed:
                    lvl.tier.delete(trimmed)
                lvl.adopt(keep, sizes_kept)
            log.info("tierkv: tier %s recovered %d chunks (%d bytes); dropped %d", lvl.name, len(keep), lvl.used,
                     len(keys) - len(keep))

    # ------------------------------------------------------------------ lifecycle
    def _enter(self) -> None:
        with self._lock:
            if self._closed:
                raise StoreClosedError("the store is closed")
            self._in_flight += 1

    def _leave(self) -> None:
        with self._lock:
            if self._settle_waiters:
                self._settled.notify_all()
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.notify_all()

    def close(self) -> None:
        """Wait for calls in flight, drain the write-behind queue, make persistent tiers durable, release
        every tier.  Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._idle.wait_for(lambda: self._in_flight == 0, timeout=60)
        try:
            if self._behind is not None:
                self._behind.close(timeout=120)
        finally:
            if self._arena_lock.acquire(timeout=1):  # (a copy still running after the timeout keeps its views)
                try:
                    self._arena.release()
                finally:
                    self._arena_lock.release()
            self._executor.shutdown(wait=True)
            self._close_observers()
            for lvl in self.levels:
                try:
                    lvl.tier.flush()
                except Exception as e:  # noqa: BLE001 - one tier failing to flush must not keep the rest open
                    log.warning("tierkv: tier %s flush failed: %s", lvl.name, e)
                finally:
                    lvl.tier.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def flush(self, timeout: Optional[float] = None) -> FlushResult:
        """Copy everything queued for write-behind tiers, then make persistent tiers durable.

        The durability contract: after it returns, every chunk acknowledged before the
        call is durable in every persistent ``write_behind`` tier that admits it, **or
        the answer says which are not**.  The ``FlushResult`` is true only when all of
        it is durable; otherwise it counts the chunks given up since the last ``flush``
        (``not_durable``, per reason in ``reasons``, and their ``keys``), the copies
        still queued when ``timeout`` seconds ran out (``pending``) and the tiers whose
        own flush failed (``tier_errors``).  The same events are counted in ``stats()``
        (``write_behind_dropped``, ``write_behind_dropped_by_reason``) and logged.
        """
        self._enter()
        try:
            drained = self._behind.drain(timeout) if self._behind is not None else True
            errors: dict[str, str] = {}
            for lvl in self.levels:
                try:
                    lvl.tier.flush()
                except Exception as e:  # noqa: BLE001 - a tier that cannot sync is reported, not raised
                    errors[lvl.name] = str(e)[:300] or type(e).__name__
                    log.warning("tierkv: tier %s flush failed: %s", lvl.name, errors[lvl.name])
            self._count_lost()
            with self._lock:
                n, reasons, keys = self._drops.take()
            pending = self._behind.pending() if not drained and self._behind is not None else 0
            result = FlushResult(n, reasons, keys, pending, errors)
            if not result:
                log.warning("tierkv: %s", result)
            return result
        finally:
            self._leave()

    def _count_lost(self) -> None:
        """Acknowledged chunks a persistent medium lost on its own since the last look (its ``objects_lost``):
        counted under ``lost`` and reported by this ``flush`` (the medium names no keys, so the count only)."""
        for k, seen in self._lost_seen.items():
            try:
                now = lost_count(self.levels[k].tier.extra_stats())
            except Exception:  # noqa: BLE001 - a medium's stats never cost a flush
                continue
            if now > seen:
                with self._lock:
                    self._lost_seen[k] = now
                    self._drops.record_count(now - seen, DropReason.LOST)

    def drain_write_behind(self, timeout: Optional[float] = None) -> bool:
        """Wait until every background copy queued so far is done (without fsync); False on timeout."""
        return self._behind.drain(timeout) if self._behind is not None else True

    # ------------------------------------------------------------------ put
    def put(self, keys: Sequence[str], values: Sequence[Value]) -> list[bool]:
        """Store chunks; one bool per key: True if stored now or already present (dedup).

        ``values[i]`` is a contiguous tensor (any dtype, shape, device) or a list of
        them, whose bytes are the chunk.  False means no tier took it (admission,
        no room, media errors); it is counted, never raised.  ``put_detailed`` says why.
        """
        stored, present = PutOutcome.STORED, PutOutcome.PRESENT
        return [o is stored or o is present for o in self.put_detailed(keys, values)]

    def put_detailed(self, keys: Sequence[str], values: Sequence[Value]) -> list[PutOutcome]:
        """``put``, answering a ``PutOutcome`` per key: stored, present, rejected, no room or error."""
        keys, values = self._pairs(keys, values, "values")
        prepared, ptrs = to_parts_ptrs(values, "values")
        self._enter()
        t0 = time.perf_counter()
        try:
            res = self._put(keys, prepared, ptrs)
        finally:
            self._leave()
        if self._observers:
            self._observe("put", keys, res, t0, prepared)
        return res

    # ------------------------------------------------------------------ get
    def get(self, keys: Sequence[str], outs: Sequence[Value]) -> list[bool]:
        """Copy each stored chunk into ``outs[i]``; one bool per key, True where found exact.

        ``outs[i]`` must hold exactly the chunk's bytes (its shape and dtype may be
        any view of them).  A False leaves ``outs[i]`` unspecified.
        """
        keys, outs = self._pairs(keys, outs, "outs", each=False)
        prepared, ptrs = to_parts_ptrs(outs, "outs")
        self._enter()
        t0 = time.perf_counter()
        try:
            res = self._get(keys, prepared, ptrs)
        except TypeError:
            check_keys(keys)  # an unhashable key: raise the error that names it
            raise
        finally:
            self._leave()
        if self._observers:
            self._observe("get", keys, res, t0, prepared)
        return res

    # ------------------------------------------------------------------ lookup, locate, remove
    def lookup(self, keys: Sequence[str]) -> int:
        """How many leading keys are present in some tier.  No side effects.

        Every key is checked: a malformed one anywhere in ``keys`` raises a ``ValueError`` naming it (the
        keys of the present prefix were stored, so only the rest need a check).
        """
        keys = check_keys(keys, each=False)
        t0 = time.perf_counter()
        n = self._lookup(keys)
        if self._observers:
            self._observe("lookup", keys, n, t0, None)
        return n

    def _leading_ready(self, keys: list[str]) -> int:
        """How many leading keys are READY in some managed level.  Caller holds the lock."""
        levels = self._managed_levels
        if not levels:
            return 0
        # every key READY in the first managed level (a positive int): probed and compared in C.  A miss
        # (None), a doomed chunk (an Entry) or a reservation (a negative int) makes ``min`` raise or
        # answer <= 0; then the keys are looked at one by one from there, in the other levels too
        vals: list[Any] = list(map(self.levels[levels[0]].index.get, keys))
        try:
            if vals and min(vals) > 0:
                return len(vals)
        except TypeError:
            pass
        others = [self.levels[j].index for j in levels[1:]]
        n = 0
        for k, e in zip(keys, vals):
            if type(e) is not int or e < 0:
                for index in others:
                    e = index.get(k)
                    if type(e) is int and e > 0:
                        break
                else:
                    break
            n += 1
        return n

    def _lookup(self, keys: list[str]) -> int:
        with self._lock:  # (one lock hold in the common case: no call in flight to account for)
            if self._closed:
                raise StoreClosedError("the store is closed")
            self._counters.lookup_calls += 1
            try:
                n = self._leading_ready(keys)
            except TypeError:
                check_keys(keys)  # an unhashable key: raise the error that names it
                raise
            if n < len(keys):  # the keys found were stored, so they are valid; the rest are checked here
                check_keys(keys[n:])
            if n == len(keys) or not self._shared_levels:
                return n
            ask = [i for i in range(n, len(keys)) if not self._mask(keys[i])]
            self._in_flight += 1  # (the shared levels are asked outside the lock: ``close`` waits)
        try:
            found = self._first_shared("contains", keys, ask)
            with self._lock:
                for i in range(n, len(keys)):
                    if not self._mask(keys[i]) and i not in found:
                        break
                    n += 1
            return n
        finally:
            self._leave()

    def contains(self, keys: Sequence[str]) -> list[bool]:
        """Presence of each key in some tier (not only the leading ones).  No side effects."""
        return [name is not None for name in self.locate(keys)]

    def locate(self, keys: Sequence[str]) -> list[Optional[str]]:
        """Name of the fastest tier holding each key (None where none does).  No side effects."""
        keys = check_keys(keys, each=False)
        self._enter()
        try:
            out: list[Optional[str]] = [None] * len(keys)
            with self._lock:
                try:
                    for i, k in enumerate(keys):
                        mask = self._mask(k)
                        if mask:
                            out[i] = self.levels[(mask & -mask).bit_length() - 1].name
                except TypeError:
                    check_keys(keys)  # an unhashable key: raise the error that names it
                    raise
            missing = [i for i, o in enumerate(out) if o is None]
            for i in missing:
                check_key(keys[i])
            if missing and self._shared_levels:
                for i, j in self._first_shared("contains", keys, missing).items():
                    out[i] = self.levels[j].name
            return out
        finally:
            self._leave()

    def remove(self, keys: Sequence[str]) -> None:
        """Forget the chunks in every tier (absent keys are ignored)."""
        keys = check_keys(keys)
        self._enter()
        try:
            with self._lock:
                for key in keys:
                    for j in self._managed_levels:
                        lvl = self.levels[j]
                        if lvl.holds(key):
                            lvl.drop(key)
                    call_policy(self.promotion, "on_remove", "*", key)
            for j in self._shared_levels:
                if self.levels[j].tier.available:
                    self._tier_ask(self.levels[j], "delete", keys)
        finally:
            self._leave()

    # ------------------------------------------------------------------ async twins
    async def _run(self, fn, *args):
        if self._closed:
            raise StoreClosedError("the store is closed")
        try:
            fut = self._executor.submit(functools.partial(fn, *args))
        except RuntimeError:  # the executor shut down between the check and the submit
            raise StoreClosedError("the store is closed") from None
        return await asyncio.wrap_future(fut)

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

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict[str, Any]:
        """Counters per tier (under ``"tiers"`` and at the top level, by name) and store totals (``"total"``)."""
        tiers: dict[str, dict[str, Any]] = {}
        with self._lock:
            for lvl in self.levels:
                d: dict[str, Any] = {
                    "medium": lvl.tier.medium,
                    "locality": getattr(lvl.tier, "locality", "host"),
                    "persist": lvl.persist,
                    "capacity_bytes": lvl.capacity,
                    "used_bytes": lvl.used if lvl.managed else lvl.tier.used_bytes,
                    "stored_bytes": lvl.tier.used_bytes,
                    "entries": lvl.entries() if lvl.managed else None,
                    "available": bool(lvl.tier.available),
                    **lvl.counters.as_dict(),
                }
                if lvl.eviction is not None:
                    d["eviction"] = getattr(lvl.eviction, "name", type(lvl.eviction).__name__)
                try:
                    extra = lvl.tier.extra_stats()
                except Exception as e:  # noqa: BLE001 - a medium's stats never break stats()
                    extra = {"extra_stats_error": str(e)}
                for k, v in extra.items():
                    d.setdefault(k, v)
                mine = extra.get("too_large")  # (refused by the store as larger than the tier, or by the medium)
                d["too_large"] = lvl.too_large + (mine if isinstance(mine, int) else 0)
                tiers[lvl.name] = d
            total: dict[str, Any] = self._counters.as_dict()
            for field in ("capacity_bytes", "used_bytes", "evictions", "promotions", "demotions", "errors",
                          "rejected", "bytes_read", "bytes_written", "persisted"):
                total[field] = sum(t[field] for t in tiers.values())
            total["in_flight"] = self._in_flight
            total["write_behind_pending"] = self._behind.pending() if self._behind is not None else 0
            total["write_behind_dropped"] = self._drops.total
            total["write_behind_dropped_by_reason"] = self._drops.by_reason()
        self._observer_stats(tiers)
        out: dict[str, Any] = {"tiers": tiers, "total": total}
        for name, d in tiers.items():
            out.setdefault(name, d)
        return out

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _pairs(keys: Sequence[str], values: Sequence[Any], what: str, each: bool = True) -> tuple[list[str], list[Any]]:
        keys = check_keys(keys, each=each)
        if isinstance(values, torch.Tensor):
            raise TypeError(f"{what} must be a sequence with one tensor per key, not a single tensor")
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
            raise TypeError(f"{what} must be an ordered sequence (list or tuple), got {type(values).__name__}")
        if type(values) is not HostViews:  # (views listed with their addresses stay as they are: see buffers)
            values = list(values)
        if len(keys) != len(values):
            raise ValueError(f"got {len(keys)} keys but {len(values)} {what}")
        return keys, values

    def tier_names(self) -> list[str]:
        """The tiers' names, fastest first."""
        return [lvl.name for lvl in self.levels]

    def tier_info(self) -> list[dict[str, Any]]:
        """What an adapter may know of each tier, fastest first, without reading store internals.

        Each entry: ``name``, ``medium``, ``locality`` (``"device"``, ``"host"``,
        ``"remote"`` or ``"disk"``), ``persistent`` (objects survive the process),
        ``shared`` (the tier is a pool other processes see: presence is asked of it),
        ``persist`` (how it receives chunks stored above it), ``capacity_bytes`` and
        ``available``.
        """
        return [{
            "name": lvl.name,
            "medium": lvl.tier.medium,
            "locality": getattr(lvl.tier, "locality", "host"),
            "persistent": bool(lvl.tier.persistent),
            "shared": not lvl.managed,
            "persist": lvl.persist,
            "capacity_bytes": lvl.capacity,
            "available": bool(lvl.tier.available),
        } for lvl in self.levels]

    def __repr__(self) -> str:
        chain = " -> ".join(f"{lvl.name}({lvl.tier.medium})" for lvl in self.levels)
        return f"TieredStore({chain})"


__all__ = ["Level", "PolicyError", "PutOutcome", "TieredStore", "check_keys"]
