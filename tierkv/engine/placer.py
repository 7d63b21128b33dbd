"""``Placer``: where a chunk goes, and what leaves to make room: reservation, eviction, demotion.

Every method that reserves takes a ``held`` dict (``Held``) and records each
reservation in it, so the caller can abort what is left on any path out
(``Chain.release`` in a ``finally``).  Admission is asked through
``Chain.admits`` only.  Demotion stages the victims' bytes in an arena lent by the
store's ``StagingPool``, the same mechanism the copier's write-behind and
promotion use; a demotion that makes room below by demoting further simply
holds another arena.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional

from tierkv.buffers import Parts
from tierkv.engine.chain import FAILED, NO_ROOM, TOO_LARGE, UNAVAILABLE, Chain, Held
from tierkv.engine.departures import Departures
from tierkv.engine.durable import Durability
from tierkv.engine.leases import LeaseBook
from tierkv.engine.observers import RemovalListeners
from tierkv.engine.tierio import TierIO
from tierkv.hostmem import StagingPool
from tierkv.outcome import MissReason, PutOutcome

log = logging.getLogger("tierkv")

#: how often a reservation retries after its victims were taken by a racing writer
_RESERVE_ATTEMPTS = 8
#: most bytes one eviction stages at once to demote its victims
_DEMOTE_BATCH_BYTES = 64 << 20


def refusal(flags: int) -> PutOutcome:
    """The outcome of a chunk no level took, from the flags its placement gathered."""
    if flags & (FAILED | UNAVAILABLE):
        return PutOutcome.ERROR
    return PutOutcome.NO_ROOM if flags & NO_ROOM else PutOutcome.REJECTED


class Placer:
    """Placement, eviction and demotion over a chain (see the module docstring)."""

    def __init__(self, chain: Chain, io: TierIO, stager: StagingPool, leases: LeaseBook, departures: Departures,
                 durability: Optional[Durability] = None, removals: Optional[RemovalListeners] = None) -> None:
        self.chain = chain
        #: the live leases (the store's): an eviction leaves what they hold, and expires those past due
        self.leases = leases
        #: the miss memory (the store's): what an eviction took from the last tier holding it, and why
        self.departures = departures
        #: the chunks acknowledged but not durable (shared with the ``Copier``; built here when not given)
        self.durability = durability if durability is not None else Durability(chain)
        #: told of the keys an eviction took from every tier (the store's; built here when not given)
        self.removals = removals if removals is not None else RemovalListeners()
        self.levels = chain.levels
        self._lock = chain.lock
        self.io = io
        self.stager = stager

    # ------------------------------------------------------------------ placing one chunk
    def place_fast(self, key: str, nbytes: int, start: int, held: Held,
                   tenant: Optional[str] = None) -> tuple[Optional[int], int]:
        """``place`` for the common case, under the caller's lock: no eviction needed.

        Returns (level reserved or unmanaged level chosen, flags); (None, flags) when
        the first level that admits would have to evict (the slow path decides), and
        (-1, flags) when no level admits at all.
        """
        flags = 0
        admits = self.chain.admits
        for j in range(start, len(self.levels)):
            lvl = self.levels[j]
            if not lvl.tier.available:
                flags |= UNAVAILABLE
                continue
            if not admits(lvl, key, nbytes):
                continue
            if not lvl.managed:
                return j, flags
            if not lvl.reserve(key, nbytes, tenant):
                return None, flags
            held[(j, key)] = None
            return j, flags
        return -1, flags

    def place(self, key: str, nbytes: int, start: int, stop: int, held: Held,
              admitted: bool = False, tenant: Optional[str] = None) -> tuple[Optional[int], int]:
        """The first level in [start, stop) that admits the chunk and has (or made) room; reserved there.

        ``admitted``: the caller asked admission already (a write-behind copy): it is not asked again.
        ``tenant``: as for ``reserve``."""
        flags = 0
        for j in range(start, stop):
            lvl = self.levels[j]
            if not lvl.tier.available:
                flags |= UNAVAILABLE
                continue
            if not admitted:
                with self._lock:
                    if not self.chain.admits(lvl, key, nbytes):
                        continue
            if not lvl.managed:
                return j, flags
            if self.reserve(j, key, nbytes, held, tenant):
                return j, flags
            # (a chunk larger than the tier is a refusal there, not a lack of room)
            flags |= NO_ROOM if lvl.footprint(nbytes) <= lvl.capacity else TOO_LARGE
        return None, flags

    def reserve(self, j: int, key: str, nbytes: int, held: Held, tenant: Optional[str] = None) -> bool:
        """Reserve room for ``key`` in managed level ``j``, evicting (demoting) as needed.

        ``tenant``: the label of the put this reservation serves, charged and held to its quota where the
        level has quotas (``Writer.put`` passes it); None for a copy the store makes on its own, charged to
        the tenant a level holding the key charged it to (``Chain.label_of``)."""
        lvl = self.levels[j]
        fp = lvl.tier.footprint(nbytes)
        if fp > lvl.capacity:
            self._too_large(lvl, nbytes, fp)
            return False
        ledger = lvl.ledger
        if ledger is None:
            tenant = None  # (no quotas here: no tenant is asked)
        else:
            if tenant is None:
                with self._lock:
                    tenant = self.chain.label_of(key)
            if ledger.exceeds_cap(tenant, fp):  # (larger than its tenant's whole cap here: a refusal)
                with self._lock:
                    lvl.counters.rejected += 1
                return False
        for _ in range(_RESERVE_ATTEMPTS):
            with self._lock:
                if lvl.knows(key):
                    return False  # already there, or a doomed copy still being read
                if lvl.reserve(key, nbytes, tenant):
                    held[(j, key)] = None
                    return True
                leases = self.leases
                if leases.due():  # a lease past its deadline holds nothing back any more
                    leases.expire()
                own = ledger.over_cap(tenant, fp) if ledger is not None and tenant is not None else 0
                victims = lvl.victims(fp - (lvl.capacity - lvl.used), tenant, own)
                if victims is None:
                    lvl.counters.rejected += 1
                    return False
                for v in victims:
                    lvl.pin(v)
            self.evict(j, victims)
        with self._lock:
            lvl.counters.rejected += 1
        return False

    def _too_large(self, lvl: Any, nbytes: int, fp: int) -> None:
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

    # ------------------------------------------------------------------ room for a batch
    def make_room(self, j: int, need: int) -> None:
        """Evict (demoting) from managed level ``j`` what ``need`` more footprint bytes lack, in one
        ``victims`` call, before a batch is placed there key by key.  Called without the lock; a
        policy that cannot name enough victims leaves the keys to the per-key path."""
        lvl = self.levels[j]
        if lvl.ledger is not None:  # (under quotas, room is made key by key, for each key's tenant)
            return
        with self._lock:
            short = min(need - (lvl.capacity - lvl.used), lvl.used)
            if short <= 0:
                return
            leases = self.leases
            if leases.due():
                leases.expire()
            victims = lvl.victims(short)
            if not victims:
                return
            lvl.pin_many(victims)
        self.evict(j, victims)

    def make_room_for(self, keys: list[str], sizes: list[int], start: list[int]) -> None:
        """``make_room`` in each level the keys will be placed in first (a managed level that admits
        everything; a level with an admission policy is left to the per-key path)."""
        need: dict[int, int] = {}
        with self._lock:
            top = self.levels[0]
            if max(start) == 0 and top.tier.available and top.managed and top.admits_all and top.knows_none(keys):
                # the common case: every key new to the top level, which takes them all: one sum
                need[0] = top.footprints(sizes)
            else:
                for key, nbytes, first in zip(keys, sizes, start):
                    for j in range(first, len(self.levels)):
                        lvl = self.levels[j]
                        if not lvl.tier.available:
                            continue
                        if lvl.managed and lvl.admits_all and not lvl.knows(key):
                            need[j] = need.get(j, 0) + lvl.footprint(nbytes)
                        break
        for j, n in need.items():
            self.make_room(j, n)

    # ------------------------------------------------------------------ eviction and demotion
    def evict(self, j: int, victims: list[str]) -> None:
        """Demote then drop pinned victims of level ``j`` (called without the lock); unpins every one.

        Victims are demoted in batches of at most ``_DEMOTE_BATCH_BYTES`` (one read from
        ``j`` and one write into each lower level per batch), then dropped.
        """
        lvl = self.levels[j]
        chain = self.chain
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
                below = self.demote(j, victims[at:end], sizes[at:end]) if not last else set()
                with self._lock:
                    batch = victims[at:end]
                    leases = self.leases
                    if leases.due():
                        leases.expire()
                    kept = leases.leased(lvl, batch)
                    at = end  # the pins of the batch are released below (evict_many: raising or not)
                    if kept:  # leased while their demotion was in flight: the lease holds them here
                        for key in kept:
                            lvl.unpin(key)  # (the eviction's pin; the lease's stays)
                        batch = [key for key in batch if key not in kept]
                    # (a victim removed meanwhile left then, and was heard then)
                    gone = [key for key in batch if key not in below and lvl.holds(key)]
                    if gone and chain.behind and chain.behind[-1] > j:
                        self.durability.note_evicted(j, gone)
                    lvl.counters.evictions += len(batch)
                    lvl.counters.demotions += len(below)
                    lvl.evict_many(batch)
                    for i in chain.managed:  # (what a level above still holds has not left the store)
                        if i >= j or not gone:
                            break
                        gone = self.levels[i].lacking(gone)
                    if gone:
                        # a chunk a lookup reported, whose lease ran out before its load: the miss names that
                        late, gone = leases.split_expired(gone)
                        if late:
                            self.departures.record(late, MissReason.LEASE_EXPIRED, lvl.name, lvl.policy_name)
                            self.removals.tell(late)
                    if gone:
                        self.departures.record(gone, MissReason.EVICTED, lvl.name, lvl.policy_name)
                        self.removals.tell(gone)
        finally:
            if at < len(victims):
                with self._lock:
                    for key in victims[at:]:
                        lvl.unpin(key)

    def demote(self, j: int, keys: list[str], sizes: list[int]) -> set[str]:
        """Copy pinned ``keys`` of level ``j`` into the next lower level that takes each; the keys now below.

        Walks down from ``j + 1``: a level that already holds a key ends its walk
        (levels are inclusive; a shared pool is asked, in one call per batch); otherwise
        the first level that admits it and has (or makes) room receives a copy.  The
        sources are read once, into one staging arena, when a level first takes them;
        a key whose source read fails is not demoted (and counted).
        """
        with self.stager.carve(sizes) as staged:
            return self._demote_staged(j, keys, sizes, staged)

    def _demote_staged(self, j: int, keys: list[str], sizes: list[int], staged: list[Any]) -> set[str]:
        nbytes = dict(zip(keys, sizes))
        buf_of = dict(zip(keys, staged))
        sum_of: dict[str, Optional[int]] = {}  # the checksum each source copy carried (copied, not recomputed)
        src = self.levels[j]
        below: set[str] = set()
        read: set[str] = set()
        unreadable: set[str] = set()
        todo = list(keys)
        for k in range(j + 1, len(self.levels)):
            if not todo:
                break
            lvl = self.levels[k]
            held: Held = {}
            try:
                with self._lock:
                    fresh = [key for key in todo if not lvl.holds(key)]
                if fresh and not lvl.managed and lvl.tier.available:
                    # a shared pool keeps no index here: asked once whether it has them already (another
                    # instance's put, a write-through, the source of a promotion); a medium that cannot say
                    # gets every copy, as if it had none
                    there = self.io.contains(lvl, fresh)
                    if there is not None and any(there):
                        fresh = [key for key, has in zip(fresh, there) if not has]
                kept = set(fresh)
                below.update(key for key in todo if key not in kept)
                if len(fresh) > 1 and lvl.tier.available:
                    self.make_room_for(fresh, [nbytes[key] for key in fresh], [k] * len(fresh))
                go: list[str] = []
                rest: list[str] = []
                for key in fresh:
                    (go if self.place(key, nbytes[key], k, k + 1, held)[0] is not None else rest).append(key)
                need = [key for key in go if key not in read]
                if need:
                    got: list[Optional[int]] = [None] * len(need)
                    oks = self.io.read(src, need, [[buf_of[key]] for key in need], sums_out=got)
                    sum_of.update(zip(need, got))
                    for key, ok in zip(need, oks):
                        (read if ok else unreadable).add(key)
                    if False in oks:
                        with self._lock:
                            src.counters.errors += oks.count(False)
                go = [key for key in go if key in read]  # (the unreadable stay in held: released below)
                if go:
                    wrote = self.io.write(lvl, go, [[buf_of[key]] for key in go], sums=[sum_of[key] for key in go],
                                          source=src)
                    with self._lock:
                        for key, ok in zip(go, wrote):
                            held.pop((k, key), None)
                            if self.chain.finish_write(lvl, key, nbytes[key], ok, source=src):
                                below.add(key)
                            else:
                                rest.append(key)
                todo = [key for key in rest if key not in unreadable]
            finally:
                self.chain.release(held)
        return below

    # ------------------------------------------------------------------ write-through
    def write_through(self, j: int, key: str, prepared: tuple[Parts, int], held: Held,
                      chunk_sum: Optional[int] = None, tenant: Optional[str] = None) -> None:
        """Copy a chunk just written into level ``j`` into every ``write_through`` level below, at once (with
        its checksum, ``chunk_sum``, as the put computed it; ``tenant``: the put's, as for ``reserve``)."""
        parts, nbytes = prepared
        chain = self.chain
        for k in range(j + 1, len(self.levels)):
            lvl = self.levels[k]
            if not lvl.write_through:
                continue
            with self._lock:
                if lvl.managed and lvl.holds(key):
                    continue
            placed, flags = self.place(key, nbytes, k, k + 1, held, tenant=tenant)
            if placed is None:
                if flags and lvl.tier.persistent:  # (no flags: its admission said no, which is no loss)
                    self.durability.refused_below(lvl, key, nbytes, flags)
                continue
            ok = self.io.write(lvl, [key], [parts], sums=[chunk_sum])[0]
            with self._lock:
                held.pop((k, key), None)
                chain.finish_write(lvl, key, nbytes, ok)
                if not ok and lvl.tier.persistent:  # acknowledged above, not durable here: ``flush`` says so
                    self.durability.drops.record([key], self.durability.drop_reason(k))
