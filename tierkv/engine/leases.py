"""Leases: chunks held against eviction from a lookup to the load that follows it.

A :class:`Lease` pins each chunk it holds in the fastest managed level holding
it READY, as a reader's pin does (``Level.pin_many``): a leased chunk is never
named as a victim, and a level whose chunks are all pinned refuses new chunks
rather than exceed its capacity.  A chunk already chosen as a victim, whose
demotion is in flight when the lease is granted, is held too: the eviction, finding
it leased when it would drop it, leaves it where it is (``leased``) and the put that
needed the room looks for other victims, or is refused for lack of room.  So a
lease either holds a chunk — READY and readable until the lease ends — or lists it
in ``unheld``, never both.  It holds until :meth:`Lease.release` (every path
out of the caller's work: done, failed, abandoned), until its ``ttl_s`` runs out,
or until the store closes, whichever comes first, exactly once.

A chunk removed from the level a lease holds it in (``TieredStore.remove``, a copy
dropped as corrupt) is let go at once (``let_go``): it leaves the lease's pins for
its ``unheld``, and its space is free for the next put of the key; a lease left
holding nothing is released by that.

A lease past its deadline is released by the store the next time it needs room
(a reservation that would evict, a batch's ``make_room``), when a lease is taken
and when ``stats()`` is read: it is counted (``lease_expired``) and the eviction
it held back then proceeds.  Its keys are remembered (the last
``EXPIRED_MEMORY``): a chunk of them evicted from the last tier holding it departs
as ``MissReason.LEASE_EXPIRED``, not ``EVICTED``, so the miss that follows names
the lease that ran out (``TieredStore.why_missing``).  A chunk only a shared pool holds (``dram_pool``,
``remote_npu``) is not held: the pool evicts by its own rules, and a lease says
so (``unheld``).

:class:`LeaseBook` keeps the live leases of one store, ordered by deadline.  The store
builds it and hands it to the parts that evict or drop chunks (``Placer``, ``Reader``);
it is given the store's lock and its managed levels, fastest first, and knows nothing
else of the chain.  Every method but ``release`` and ``forget_late`` (which take the
lock themselves) runs with that lock held.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

from tierkv.engine.level import Level
from tierkv.stats import LeaseCounters

#: keys of expired leases remembered for their eviction's departure record (the oldest go first)
EXPIRED_MEMORY = 1 << 16


class Lease:
    """Chunks pinned for a caller until :meth:`release`, the deadline, or the store's close.

    ``held``: how many keys are pinned; ``unheld``: the keys that are not (in no
    managed level: absent, being written, or in a shared pool only; or removed since,
    see ``LeaseBook.let_go``).  ``expired``: the deadline released it (the chunks could
    then be evicted); ``released``: it holds nothing any more, by whatever path.
    """

    __slots__ = ("_book", "_late", "_pins", "deadline", "expired", "held", "released", "ttl_s", "unheld")

    def __init__(self, book: LeaseBook | None, pins: list[tuple[Level, list[str]]], unheld: list[str],
                 ttl_s: float, deadline: float) -> None:
        self._book = book
        self._pins = pins
        self.held = sum(len(keys) for _, keys in pins)
        self.unheld = unheld
        self.ttl_s = ttl_s
        self.deadline = deadline
        self.expired = False
        self.released = not pins
        self._late: list[str] = []  # (its keys, once it expired, until its holder lets go)

    def release(self) -> bool:
        """Unpin every chunk still held; True when this call released them, False when the lease held
        nothing any more (released before, expired, its chunks removed, or the store closed).  Idempotent,
        thread-safe."""
        book = self._book
        if book is None:
            return False
        if self.released:
            if self._late:
                book.forget_late(self)
            return False
        return book.release(self)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "expired" if self.expired else "released" if self.released else "held"
        return f"Lease({self.held} held, {len(self.unheld)} unheld, ttl {self.ttl_s:g} s, {state})"


class LeaseBook:
    """The live leases of one store, by deadline, and the count of pins each holds (see the module docstring).

    Invariants, each kept by this book alone (``tests/test_store_leases.py``):

    * **A leased chunk is never evicted while held.**  Each key a lease holds is pinned in its level (a pin
      no policy may name as a victim) and counted in ``_held``; an eviction already in flight asks
      ``leased`` before it drops, and leaves those keys where they are.
    * **Every lease is released exactly once**: by its holder (``release``), its deadline (``expire``),
      the removal of all it holds (``let_go``) or the store's close (``close``), whichever comes first;
      each unpins what the lease still holds and marks it ``released``, which every later path checks.
    * **Nothing reserved outlives its call.**  ``grant`` takes pins only (never a reservation) and hands
      them to the ``Lease`` it returns in the same lock hold; a lease's pins outlive the call that took
      them by design, and end by the paths above.

    ``lock``: the store's lock (``Chain.lock``), held by the callers of every method but ``release`` and
    ``forget_late``; ``levels``: the managed levels, fastest first, a lease pins in.
    """

    def __init__(self, lock: AbstractContextManager[Any], levels: Sequence[Level]) -> None:
        if any(not lvl.managed for lvl in levels):
            raise ValueError("a lease pins chunks in managed levels only")
        self._lock = lock
        self._levels: tuple[Level, ...] = tuple(levels)
        self._heap: list[tuple[float, int, Lease]] = []
        #: level -> key -> how many live leases pin it there (the pins an eviction leaves alone)
        self._held: dict[Level, dict[str, int]] = {}
        self._seq = itertools.count()
        #: leases holding chunks now
        self.active = 0
        #: keys of leases that expired, not yet evicted (insertion order: the oldest first)
        self.expired_keys: dict[str, None] = {}
        #: the leases' counters (``stats()["total"]``), this book's alone
        self.counters = LeaseCounters()

    def grant(self, keys: list[str], ttl_s: float) -> Lease:
        """Pin each key in the fastest managed level holding it READY.  Lock held."""
        now = time.monotonic()
        self.expire(now)
        pins: list[tuple[Level, list[str]]] = []
        rest = keys
        for lvl in self._levels:
            if not rest:
                break
            if lvl.all_ready(rest):  # (the common case, in C passes: every key READY in this level)
                here, rest = rest, []
            else:
                codes = lvl.ready_codes(rest)
                here = [k for k, c in zip(rest, codes) if c is not None]
                rest = [k for k, c in zip(rest, codes) if c is None]
            if here:
                lvl.pin_many(here)
                self._count(lvl, here)
                pins.append((lvl, here))
        lease = Lease(self, pins, list(rest), ttl_s, now + ttl_s)
        if self.expired_keys and pins:  # (held again: an earlier lease's expiry no longer explains them)
            for _, keys in pins:
                for k in keys:
                    self.expired_keys.pop(k, None)
        c = self.counters
        c.leases += 1
        c.leased_chunks += lease.held
        if pins:
            self.active += 1
            heapq.heappush(self._heap, (lease.deadline, next(self._seq), lease))
        return lease

    def release(self, lease: Lease) -> bool:
        with self._lock:
            if lease.released:
                return False
            self._unpin(lease)
            self.counters.leases_released += 1
            return True

    def _unpin(self, lease: Lease) -> None:
        pins, lease._pins = lease._pins, []
        lease.released = True
        self.active -= 1
        for lvl, keys in pins:
            lvl.unpin_many(keys)
            self._uncount(lvl, keys)

    def _count(self, lvl: Level, keys: list[str]) -> None:
        held = self._held.get(lvl)
        if held is None:
            held = self._held[lvl] = {}
        if not held and len(set(keys)) == len(keys):  # (the common case, in C passes)
            held.update(dict.fromkeys(keys, 1))
            return
        get = held.get
        for k in keys:
            held[k] = get(k, 0) + 1

    def _uncount(self, lvl: Level, keys: list[str]) -> None:
        held = self._held[lvl]
        if len(held) == len(keys) and set(map(held.get, keys)) == {1}:
            held.clear()  # exactly these keys, each leased once
            return
        for k in keys:
            n = held[k] - 1
            if n:
                held[k] = n
            else:
                del held[k]

    def leased(self, lvl: Level, keys: list[str]) -> set[str]:
        """The keys of ``keys`` some live lease holds in ``lvl`` (an eviction leaves them there).  Lock held."""
        held = self._held.get(lvl)
        return held.keys() & keys if held else set()

    def let_go(self, lvl: Level, keys: list[str]) -> None:
        """``keys`` leave ``lvl`` (removed, or dropped as corrupt): every lease holding one of them there
        unpins it and lists it in ``unheld``; a lease left holding nothing is released.  Lock held; cheap
        while none of them is leased there."""
        held = self._held.get(lvl)
        if not held:
            return
        going = held.keys() & keys
        if not going:
            return
        for _, _, lease in self._heap:
            if lease.released:
                continue
            lost: list[str] = []
            pins: list[tuple[Level, list[str]]] = []
            for where, ks in lease._pins:
                if where is lvl and not going.isdisjoint(ks):
                    lost += [k for k in ks if k in going]
                    ks = [k for k in ks if k not in going]
                if ks:
                    pins.append((where, ks))
            if not lost:
                continue
            lvl.unpin_many(lost)
            self._uncount(lvl, lost)
            lease._pins = pins
            lease.held -= len(lost)
            lease.unheld.extend(lost)
            if not pins:
                lease.released = True
                self.active -= 1

    def due(self) -> bool:
        """Whether some lease is past its deadline (cheap when none is live).  Lock held."""
        heap = self._heap
        return bool(heap) and heap[0][0] <= time.monotonic()

    def expire(self, now: float | None = None) -> int:
        """Release the leases past their deadline, each counted in ``lease_expired``.  Lock held."""
        heap = self._heap
        if not heap:
            return 0
        now = time.monotonic() if now is None else now
        n = 0
        while heap and heap[0][0] <= now:
            lease = heapq.heappop(heap)[2]
            if lease.released:
                continue
            lease.expired = True
            for _, keys in lease._pins:
                self.expired_keys.update(dict.fromkeys(keys))
                lease._late += keys
            self._unpin(lease)
            n += 1
        self.counters.lease_expired += n
        over = len(self.expired_keys) - EXPIRED_MEMORY
        if over > 0:
            for key in list(itertools.islice(self.expired_keys, over)):
                del self.expired_keys[key]
        if len(heap) > 64 and len(heap) > 4 * self.active:  # (released leases linger until their deadline)
            self._heap = [e for e in heap if not e[2].released]
            heapq.heapify(self._heap)
        return n

    def split_expired(self, gone: list[str]) -> tuple[list[str], list[str]]:
        """``gone`` (chunks leaving the store) as (those whose lease expired, the others); each key is
        forgotten here once it left.  Lock held.  Cheap while no lease has expired."""
        exp = self.expired_keys
        if not exp or exp.keys().isdisjoint(gone):
            return [], gone
        mine = [k for k in gone if k in exp]
        for k in mine:
            exp.pop(k, None)
        late = set(mine)
        return mine, [k for k in gone if k not in late]

    def forget_late(self, lease: Lease) -> None:
        """The holder of an expired lease let go (its load is over): an eviction of its chunks from now on is
        an ordinary one."""
        with self._lock:
            keys, lease._late = lease._late, []
            exp = self.expired_keys
            for k in keys:
                exp.pop(k, None)

    def close(self) -> None:
        """Release every live lease (the store is closing).  Lock held."""
        heap, self._heap = self._heap, []
        for _, _, lease in heap:
            if not lease.released:
                self._unpin(lease)
        self._held.clear()
