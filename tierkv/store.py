"""``TieredStore``: the one place that knows the order of tiers.

The chain is a list of *levels* (``tierkv.Level``), fastest first.  Each
level wraps one ``Tier`` (the medium) with the policies that steer it (eviction,
admission) and, for *managed* media, the index of what the level holds.

``TieredStore`` is a thin facade over the store engine (``tierkv/engine/``), whose
parts it builds and holds, each from a ``Chain`` (the levels, the lock, the call gate):
``Writer`` (``put``, in named phases), ``Reader`` (``get``, ``lookup``, ``locate``),
``Placer`` (placement, eviction, demotion), ``Copier`` (write-behind and promotion on
one background queue), ``TierIO`` (the one choke point for tier I/O) and a
``StagingPool`` (the one staging mechanism for copies between tiers).  It also builds
the owners of the state those parts share and hands each to the parts that use it:
the leases (``LeaseBook``), the miss memory (``Departures``), the ledger of chunks
not durable (``Durability``) and the removal listeners (``RemovalListeners``).  Policies are
called through ``tierkv.hooks`` (checked wrappers).  docs/architecture.md draws who
calls whom.

Life of a chunk in a managed level::

    absent --reserve--> RESERVED --write ok--> READY --evict/remove--> absent
                           |                     |
                           +--write failed--> absent   (pinned while read: freed at last unpin)

Invariants (tested in ``tests/test_store_model.py``, ``tests/test_store_faults.py``,
``tests/test_concurrency.py`` and ``tests/test_store_engine.py``):

1. **Capacity.**  For every managed level, ``used`` — the sum of
   ``tier.footprint(nbytes)`` over its RESERVED and READY entries and of doomed
   entries still pinned by a reader — never exceeds ``capacity``.  Space is
   reserved before any byte is written and released only after the bytes are no
   longer read.  Footprint is the one unit of size: eviction policies are told
   footprints and asked for footprints.
2. **Pinning.**  A chunk being read (a ``get``, the source of a demotion, of a
   promotion or of a write-behind copy), or found present by a ``put`` (for the rest of that call), is
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
   promotion copies up bytes read again, for that key alone, from the level that
   served it (never a caller's buffer).
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
8. **A read never writes on the caller's thread.**  ``get`` answers from what it
   read; the hits it served below the top managed level are promoted by the
   ``Copier``'s background thread (which may evict and demote to make room), or
   dropped and counted (``promotions_dropped``) when its queue is full.
   ``drain_write_behind()`` and ``flush()`` wait for them.
9. **A lease holds until its holder is done, or its deadline.**  ``lease(keys,
   ttl_s)`` pins each key in the fastest managed level holding it READY (as a
   reader's pin: never a victim, see 2); the pins are released exactly once, by
   ``Lease.release()``, by the deadline (counted in ``lease_expired``; the
   eviction it held back then proceeds, and a chunk of it evicted before its
   holder let go departs as ``MissReason.LEASE_EXPIRED``) or by ``close()``.  A level whose chunks
   are all pinned refuses a new chunk (``rejected``, the put's ``NO_ROOM``)
   rather than exceed its capacity (1).  A lease holds a chunk (READY, readable
   until the lease ends) or lists it in ``Lease.unheld``, never both: a victim
   whose demotion is in flight when it is leased stays (the put takes other room,
   or answers ``NO_ROOM``).  A chunk only a shared pool holds is not held
   (``Lease.unheld``): the pool evicts by its own rules.  ``remove`` ends a
   lease's hold on the chunks it removes (then in ``unheld``; their room is free).
10. **Every miss has a reason.**  The store remembers the last ``miss_memory`` departures
   (``tierkv.engine.departures``; default ``DEFAULT_MISS_MEMORY``): chunks evicted from the last
   tier holding them (with that tier, its eviction policy and the time), puts no tier took
   (``rejected``, or ``unavailable`` when a tier that might have taken them was down), and what
   was dropped for a named reason.  ``why_missing(keys)`` answers a ``MissReason`` per key from
   that memory alone (no tier is asked): a key it does not hold is ``unavailable`` while some tier
   is marked unavailable, else ``never_stored`` ("never stored, or not among the last N
   departures").  Each answer is counted in ``stats()["total"]["misses_by_reason"]``.

   Recording a departure, the two ways: from outside the engine, ``remove(keys, reason=...)``
   (e.g. ``MissReason.AUDIT_FAILED``, ``LEASE_EXPIRED``) removes the chunks and records why; a
   plain ``remove(keys)`` is a deliberate forgetting, not a miss reason: the memory forgets the
   keys too (a later miss is ``never_stored``).  Inside the engine, ``Departures.record(keys,
   reason, tier)`` records without removing (``TierIO``'s corrupt drops).
11. **A store left open is closed at exit.**  At a normal exit (the script's end, ``sys.exit``,
   an uncaught exception) every store still open is closed as ``close()`` would, then every
   backend client (``tierkv.shutdown``), before Python stops its thread pools: every
   write-behind copy lands, the persistent tiers are flushed, and no thread of the store's
   is left running while the interpreter finalizes.

Normal outcomes (miss, no room, backend down) are values and counters; misuse
raises an error that names the problem.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Optional, Union

import torch

from tierkv import shutdown
from tierkv.buffers import HostViews, Value, to_parts_ptrs
from tierkv.config import build_levels, load_config
from tierkv.config_observers import attach_from_config
from tierkv.durability import DropReason, FlushResult, TierFlushError, lost_count
from tierkv.engine.chain import Chain
from tierkv.engine.copier import Copier
from tierkv.engine.departures import DEFAULT_MISS_MEMORY, Departure, Departures
from tierkv.engine.durable import Durability
from tierkv.engine.leases import Lease, LeaseBook
from tierkv.engine.level import Level
from tierkv.engine.losses import Losses
from tierkv.engine.observers import Observers, RemovalListeners
from tierkv.engine.placer import Placer
from tierkv.engine.reader import Reader
from tierkv.engine.recovery import recover
from tierkv.engine.report import collect_stats
from tierkv.engine.tierio import TierIO
from tierkv.engine.writer import Writer
from tierkv.errors import ConfigError, PolicyError, StoreClosedError
from tierkv.hostmem import StagingPool
from tierkv.keys import check_keys
from tierkv.options import check_int
from tierkv.outcome import MissReason, PutOutcome
from tierkv.policies import PromotionPolicy, build_promotion
from tierkv.tenants import Tenants, parse_tenants
from tierkv.tiers.base import Tier

if TYPE_CHECKING:
    import os

log = logging.getLogger("tierkv")

_open_stores: weakref.WeakSet[TieredStore] = weakref.WeakSet()


def _close_open_stores() -> None:
    """At exit: close every store its owner left open (see ``tierkv.shutdown``)."""
    for store in list(_open_stores):
        if store._pid != os.getpid():
            continue  # (a forked child's copy: its parent owns the store, its tiers and their files)
        try:
            store.close()
        except Exception as e:  # noqa: BLE001 - one store failing to close must not keep the rest open
            log.warning("tierkv: closing a store at exit failed: %r", e)


shutdown.at_exit(shutdown.STORES, _close_open_stores)

StoreConfig = Union[dict, str, "os.PathLike[str]"]  # (a name for type checkers only)


class TieredStore:
    """A chain of tiers, fastest first, behind one batch-first API.

    ``put`` writes into the highest level whose admission policy accepts the
    chunk (and into lower ``write_through`` levels at once, and ``write_behind``
    levels in the background); a full level's eviction policy names victims,
    which are demoted down the chain.  ``get`` reads from the fastest level
    holding the key; the hits served below the top are promoted, as the
    promotion policy says, on the background queue.  A thin facade: the work is
    done by the collaborators it holds (see the module docstring).
    """

    def __init__(
        self,
        tiers: Sequence[Union[Tier, Level]],
        promotion: Union[str, PromotionPolicy, dict, None] = None,
        io_workers: int = 4,
        write_behind_queue: int = 65536,
        miss_memory: int = DEFAULT_MISS_MEMORY,
        tenants: Union[dict, Tenants, None] = None,
    ) -> None:
        if isinstance(tiers, (str, bytes)) or not isinstance(tiers, Sequence) or not tiers:
            raise ConfigError("a store needs a non-empty list of tiers (Tier or Level objects), fastest first")
        io_workers = check_int(io_workers, "io_workers", min_value=1, max_value=256)
        write_behind_queue = check_int(write_behind_queue, "write_behind_queue", min_value=0)
        miss_memory = check_int(miss_memory, "miss_memory", min_value=0)
        self._chain = chain = Chain([t if isinstance(t, Level) else Level(t) for t in tiers])
        quotas: Optional[Tenants] = None
        if tenants is not None:  # (quotas per tenant per tier: ``tierkv.tenants``)
            quotas = tenants if isinstance(tenants, Tenants) else parse_tenants(
                tenants, [lvl.name for lvl in chain.levels], [lvl.name for lvl in chain.levels if lvl.managed])
            chain.set_tenants(quotas)
        #: the levels, fastest first (each: a tier, its policies, its index)
        self.levels: list[Level] = chain.levels
        self.promotion = build_promotion(promotion)
        # (a copy that makes room demotes, which may make room further down: one arena per level at most
        # is lent at once, and each stays mapped for the next cascade instead of being mapped again)
        self._stager = StagingPool(keep=max(2, len(chain.levels)))
        #: the last ``miss_memory`` chunks that left the store, and why (``why_missing``), told by the parts
        #: that drop or refuse them (``TierIO``, ``Placer``, ``Writer``) and by ``remove``
        self._departures = departures = Departures(miss_memory)
        #: chunks held from a lookup to its load (``lease``): pinned in the chain's managed levels under its lock,
        #: let go by the parts that drop them (``Reader``, ``remove``), left in place by the ``Placer``'s evictions
        self._leases = leases = LeaseBook(chain.lock, [chain.levels[j] for j in chain.managed])
        self._io = TierIO(chain, departures)
        #: the chunks acknowledged but not durable (``flush``), shared by the placer and the copier
        self._durability = durability = Durability(chain)
        #: told of the keys that left every tier (``add_removal_listener``), by the parts that remove them
        self._removals = removals = RemovalListeners()
        self._placer = Placer(chain, self._io, self._stager, leases=leases, departures=departures,
                              durability=durability, removals=removals)
        self._copier = Copier(chain, self._io, self._placer, self._stager, self.promotion,
                              max_queued=write_behind_queue)
        self._writer = Writer(chain, self._io, self._placer, self._copier, departures, quotas)
        self._reader = Reader(chain, self._io, self._copier, leases)
        self._observers = Observers()
        self._lost_seen: dict[int, int] = {}  # persistent level -> its medium's lost objects so far (``_count_lost``)
        self._executor = ThreadPoolExecutor(max_workers=io_workers, thread_name_prefix="tierkv-store")
        trimmed = recover(self.levels)
        # (after recovery: the index holds what the media hold)
        self._losses = Losses(chain, self._io, self._removals, self._leases)
        self._pid = os.getpid()
        _open_stores.add(self)  # closed at exit if its owner does not (``tierkv.shutdown``)
        for k, lvl in enumerate(self.levels):  # (after recovery: what opening counted is no write's fault)
            if lvl.tier.persistent:
                # what the medium lost before this open (found lost, damaged or trimmed there, or trimmed by the
                # recovery) is reported by the first flush: nothing of it seen yet
                self._lost_seen[k] = 0
                if trimmed.get(k):
                    self._durability.drops.record_count(trimmed[k], DropReason.LOST)
                self._durability.baseline_faults(k)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_config(cls, config: StoreConfig) -> TieredStore:
        """Build a store from a dict or a JSON / YAML / TOML file (see ``tierkv.config``)."""
        cfg = load_config(config)
        levels = build_levels(cfg["tiers"], cfg.get("verify"))
        try:
            store = cls(levels, promotion=cfg.get("promotion"), io_workers=cfg.get("io_workers", 4),
                        write_behind_queue=cfg.get("write_behind_queue", 65536),
                        miss_memory=cfg.get("miss_memory", DEFAULT_MISS_MEMORY), tenants=cfg.get("tenants"))
        except Exception:
            for lvl in levels:
                lvl.tier.close()
            raise
        attach_from_config(store, cfg)
        return store

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Wait for calls in flight, drain the write-behind queue, make persistent tiers durable, release
        every tier.  Idempotent."""
        chain = self._chain
        with chain.lock:
            if not chain.shut(timeout=60):
                return
        try:
            self._copier.close(timeout=120)
        finally:
            with chain.lock:
                self._leases.close()  # (every lease still held: its holder's release is then a no-op)
            self._stager.release()  # (an arena lent to a copy still running is let go when given back)
            self._executor.shutdown(wait=True)
            self._observers.close()
            for lvl in self.levels:
                try:
                    lvl.tier.flush()
                except Exception as e:  # noqa: BLE001 - one tier failing to flush must not keep the rest open
                    log.warning("tierkv: tier %s flush failed: %s", lvl.name, e)
                finally:
                    lvl.tier.close()

    @property
    def closed(self) -> bool:
        return self._chain.closed

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def flush(self, timeout: Optional[float] = None) -> FlushResult:
        """Copy everything queued for write-behind tiers, then make persistent tiers durable.

        The durability contract: after it returns, every chunk acknowledged before the
        call is durable in every persistent ``write_behind`` tier that admits it, **or
        the answer says which are not**.  The ``FlushResult`` is true only when all of
        it is durable; otherwise it counts the chunks not durable now (``not_durable``,
        per reason in ``reasons``, and their ``keys``: a chunk whose copy was given up
        but that reached a persistent tier since, by a demotion, a later copy or a put
        again, is durable; a removed one is not counted), the copies still queued when
        ``timeout`` seconds ran out (``pending``) and the tiers whose own flush failed
        (``tier_errors``).  The copies given up for chunks still held above are queued
        again first.  ``stats()`` says how many are not durable now
        (``write_behind_not_durable``; health follows it) and counts every copy given
        up over the store's life (``write_behind_dropped``, by reason); both are logged.
        """
        chain = self._chain
        chain.enter()
        try:
            with chain.lock:
                retry = self._durability.undurable()
            self._copier.retry_behind(retry)  # (a fault that has passed, a queue that has room again)
            drained = self._copier.drain(timeout)
            errors: dict[str, str] = {}
            for lvl in self.levels:
                try:
                    lvl.tier.flush()
                except Exception as e:  # noqa: BLE001 - a tier that cannot sync is reported, not raised
                    errors[lvl.name] = str(e)[:300] or type(e).__name__
                    log.warning("tierkv: tier %s flush failed: %s", lvl.name, errors[lvl.name])
                    if isinstance(e, TierFlushError) and e.not_durable > 0:  # (chunks it cannot call durable)
                        with chain.lock:
                            self._durability.drops.record_count(e.not_durable, DropReason.WRITE_FAILED)
            self._losses.notice()
            self._count_lost()
            with chain.lock:
                n, reasons, keys = self._durability.take_undurable()
            pending = self._copier.pending() if not drained else 0
            result = FlushResult(n, reasons, keys, pending, errors)
            if not result:
                log.warning("tierkv: %s", result)
            return result
        finally:
            chain.leave()

    def _count_lost(self) -> None:
        """Acknowledged chunks a persistent medium lost on its own since the last look (its ``objects_lost``):
        counted under ``lost`` and reported by this ``flush`` (the medium names no keys, so the count only)."""
        for k, seen in self._lost_seen.items():
            try:
                now = lost_count(self.levels[k].tier.extra_stats())
            except Exception:  # noqa: BLE001 - a medium's stats never cost a flush
                continue
            if now > seen:
                with self._chain.lock:
                    self._lost_seen[k] = now
                    self._durability.drops.record_count(now - seen, DropReason.LOST)

    def drain_write_behind(self, timeout: Optional[float] = None) -> bool:
        """Wait until every background copy queued so far (write-behind and promotion) is done (without
        fsync); False on timeout."""
        return self._copier.drain(timeout)

    # ------------------------------------------------------------------ put
    def put(self, keys: Sequence[str], values: Sequence[Value], tenant: Optional[str] = None) -> list[bool]:
        """Store chunks; one bool per key: True if stored now or already present (dedup).

        ``tenant``: whose chunks they are, when the store has tenants configured (one not configured
        counts as ``"other"``; ``tierkv.tenants``); ignored otherwise.

        ``values[i]`` is a contiguous tensor (any dtype, shape, device) or a list of
        them, whose bytes are the chunk.  False means no tier took it (admission,
        no room, media errors); it is counted, never raised.  ``put_detailed`` says why.
        """
        stored, present = PutOutcome.STORED, PutOutcome.PRESENT
        return [o is stored or o is present for o in self.put_detailed(keys, values, tenant)]

    def put_detailed(self, keys: Sequence[str], values: Sequence[Value],
                     tenant: Optional[str] = None) -> list[PutOutcome]:
        """``put``, answering a ``PutOutcome`` per key: stored, present, rejected, no room or error."""
        if tenant is not None and not isinstance(tenant, str):
            raise TypeError(f"tenant must be a str or None, got {type(tenant).__name__}")
        keys, values = self._pairs(keys, values, "values")
        prepared, ptrs = to_parts_ptrs(values, "values")
        self._chain.enter()
        t0 = time.perf_counter()
        try:
            res = self._writer.put(keys, prepared, ptrs, tenant)
            self._losses.notice()
        finally:
            self._chain.leave()
        if self._observers.attached:
            self._observers.observe("put", keys, res, t0, prepared)
        return res

    # ------------------------------------------------------------------ get
    def get(self, keys: Sequence[str], outs: Sequence[Value]) -> list[bool]:
        """Copy each stored chunk into ``outs[i]``; one bool per key, True where found exact.

        ``outs[i]`` must hold exactly the chunk's bytes (its shape and dtype may be
        any view of them).  A False leaves ``outs[i]`` unspecified.
        """
        keys, outs = self._pairs(keys, outs, "outs", each=False)
        prepared, ptrs = to_parts_ptrs(outs, "outs")
        self._chain.enter()
        t0 = time.perf_counter()
        try:
            res = self._reader.get(keys, prepared, ptrs)
        except TypeError:
            check_keys(keys)  # an unhashable key: raise the error that names it
            raise
        finally:
            self._chain.leave()
        if False in res:  # (each miss explained and counted by reason: ``why_missing``)
            self._explain([k for k, ok in zip(keys, res) if not ok], True)
        if self._observers.attached:
            self._observers.observe("get", keys, res, t0, prepared)
        return res

    # ------------------------------------------------------------------ lookup, locate, remove
    def lookup(self, keys: Sequence[str]) -> int:
        """How many leading keys are present in some tier.  No side effects.

        Every key is checked: a malformed one anywhere in ``keys`` raises a ``ValueError`` naming it (the
        keys of the present prefix were stored, so only the rest need a check).
        """
        keys = check_keys(keys, each=False)
        t0 = time.perf_counter()
        n = self._reader.lookup(keys)
        if self._observers.attached:
            self._observers.observe("lookup", keys, n, t0, None)
        return n

    def contains(self, keys: Sequence[str]) -> list[bool]:
        """Presence of each key in some tier (not only the leading ones).  No side effects."""
        return [name is not None for name in self.locate(keys)]

    def locate(self, keys: Sequence[str]) -> list[Optional[str]]:
        """Name of the fastest tier holding each key (None where none does).  No side effects."""
        keys = check_keys(keys, each=False)
        self._chain.enter()
        try:
            return self._reader.locate(keys)
        finally:
            self._chain.leave()

    def lease(self, keys: Sequence[str], ttl_s: float) -> Lease:
        """Hold the chunks of ``keys`` against eviction for up to ``ttl_s`` seconds (a lookup's finding, until
        the load that follows it): each is pinned in the fastest managed tier holding it.  ``release()`` the
        answer on every path out; a lease not released by its deadline is released then and counted
        (``stats()["total"]["lease_expired"]``).  Keys in no managed tier (absent, being written, or only in a
        shared pool) are not held: ``Lease.unheld`` lists them.  A chunk whose eviction is in flight is held: the
        eviction leaves it where it is.  ``remove`` of a leased key (by anyone) ends the hold on it: the lease
        lists it in ``unheld`` from then on, and a new put of the key finds its room free.  A closed store
        raises ``StoreClosedError``.
        """
        keys = check_keys(keys)
        if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not ttl_s > 0 or ttl_s == float("inf"):
            raise ValueError(f"lease ttl_s must be a finite number of seconds > 0, got {ttl_s!r}")
        chain = self._chain
        chain.enter()
        try:
            with chain.lock:
                return self._leases.grant(keys, float(ttl_s))
        finally:
            chain.leave()

    def remove(self, keys: Sequence[str], reason: Optional[MissReason] = None) -> None:
        """Forget the chunks in every tier (absent keys are ignored).

        ``reason`` (a ``MissReason``): why they go, remembered so a later miss of them says so
        (``why_missing``; the departure names no tier: they left every tier).  None: a deliberate
        removal, which is no miss reason: what the store remembered of the keys is forgotten too.
        """
        keys = check_keys(keys)
        if reason is not None:
            try:
                reason = MissReason(reason)
            except ValueError:
                raise ValueError(f"remove: reason must be a MissReason ({', '.join(MissReason)}), "
                                 f"got {reason!r}") from None
        chain = self._chain
        chain.enter()
        try:
            if reason is None:
                self._departures.forget(keys)
            else:
                self._departures.record(keys, reason)
            left: dict[str, None] = {}  # the keys some tier held: they leave now (the listeners hear them)
            with chain.lock:
                for j in chain.managed:
                    lvl = self.levels[j]
                    here = [key for key in keys if lvl.holds(key)]
                    if here:
                        self._leases.let_go(lvl, here)  # (a lease holding them says it no longer does)
                        for key in here:
                            lvl.drop(key)
                        left.update(dict.fromkeys(here))
                self._copier.promotion.removed(keys)
                self._durability.drops.forget(keys)  # (gone on purpose: no flush calls them not durable)
            for j in chain.shared:
                pool = self.levels[j]
                if pool.tier.available:
                    rest = [key for key in dict.fromkeys(keys) if key not in left]
                    found = self._io.contains(pool, rest) if rest else None
                    if self._io.delete(pool, keys) and found:
                        left.update(dict.fromkeys(k for k, f in zip(rest, found) if f))
            if left:
                self._removals.tell([key for key in dict.fromkeys(keys) if key in left])
        finally:
            chain.leave()

    def why_missing(self, keys: Sequence[str], count: bool = True) -> list[MissReason]:
        """Why each key is (or would be) a miss: a ``MissReason`` per key, from the store's memory of
        recent departures alone (no tier is asked, and a present key is not checked: ask only about
        keys a lookup or get missed).

        A key not remembered is ``UNAVAILABLE`` while some tier is marked unavailable, else
        ``NEVER_STORED``: never stored, or not among the last ``miss_memory`` departures.  With
        ``count`` (the default) each answer is counted in ``stats()["total"]["misses_by_reason"]``.
        """
        return self._explain(check_keys(keys, each=False), count)

    def _explain(self, keys: list[str], count: bool) -> list[MissReason]:
        down = any(not lvl.tier.available for lvl in self.levels)
        fallback = MissReason.UNAVAILABLE if down else MissReason.NEVER_STORED
        return self._departures.explain(keys, fallback, count)

    def departures(self, keys: Sequence[str]) -> list[Optional[Departure]]:
        """The last remembered departure of each key (reason, tier, policy, monotonic time; ``age()``), or
        None.  Not counted."""
        keys = check_keys(keys, each=False)
        return self._departures.recall(keys)

    def count_misses(self, reason: MissReason, n: int = 1) -> None:
        """Count ``n`` misses an adapter explained itself (e.g. ``OTHER_NAMESPACE``) in ``misses_by_reason``."""
        self._departures.count(reason, check_int(n, "n", min_value=0))

    # ------------------------------------------------------------------ async twins
    async def _run(self, fn, *args):
        if self._chain.closed:
            raise StoreClosedError("the store is closed")
        try:
            fut = self._executor.submit(functools.partial(fn, *args))
        except RuntimeError:  # the executor shut down between the check and the submit
            raise StoreClosedError("the store is closed") from None
        return await asyncio.wrap_future(fut)

    async def aput(self, keys: Sequence[str], values: Sequence[Value], tenant: Optional[str] = None) -> list[bool]:
        """``put`` on the store's I/O threads, awaitable."""
        return await self._run(self.put, keys, values, tenant)

    async def aget(self, keys: Sequence[str], outs: Sequence[Value]) -> list[bool]:
        """``get`` on the store's I/O threads, awaitable."""
        return await self._run(self.get, keys, outs)

    async def alookup(self, keys: Sequence[str]) -> int:
        """``lookup`` on the store's I/O threads, awaitable (shared tiers may answer over the network)."""
        return await self._run(self.lookup, keys)

    async def aremove(self, keys: Sequence[str], reason: Optional[MissReason] = None) -> None:
        """``remove`` on the store's I/O threads, awaitable."""
        return await self._run(self.remove, keys, reason)

    # ------------------------------------------------------------------ observers
    def add_observer(self, observer: Any) -> None:
        """Call ``observer`` after every batch (``tierkv.engine.observers``)."""
        self._observers.add(observer)

    def observers(self) -> tuple[Any, ...]:
        """The observers attached, in order."""
        return tuple(self._observers.attached)

    def remove_observer(self, observer: Any) -> None:
        self._observers.remove(observer)

    def add_removal_listener(self, listener: Callable[[list[str]], None]) -> None:
        """Call ``listener(keys)`` with chunks that left the store, each once per departure: the last copy
        in a managed tier evicted (or its lease expired) with no copy taken below, or ``remove``d while some
        tier held it (a shared pool is asked).  A key never stored, or removed again, is not heard.  It may
        run under the store's lock, on any thread: keep it short, and never call the store from it.  A
        listener that raises is logged, never reaches the caller."""
        self._removals.add(listener)

    def remove_removal_listener(self, listener: Callable[[list[str]], None]) -> None:
        self._removals.remove(listener)

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict[str, Any]:
        """Counters per tier (under ``"tiers"`` and at the top level, by name), store totals (``"total"``) and,
        with tenants configured, each tenant's usage and hits (``"tenants"``: ``tierkv.tenants``); gathered by
        ``tierkv.engine.report``."""
        tiers, total, tenants = collect_stats(self._chain, self._durability, self._leases, self._departures,
                                              self._copier.pending,
                                              (self._writer.counters, self._reader.counters, self._copier.counters),
                                              self._writer.tenants is not None)
        self._observers.merge_stats(tiers)
        out: dict[str, Any] = {"tiers": tiers, "total": total}
        if tenants is not None:
            out["tenants"] = tenants
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


__all__ = ["Departure", "Lease", "Level", "MissReason", "PolicyError", "PutOutcome", "TieredStore", "check_keys"]
