"""``Reader``: how a batch is read, and what ``lookup`` / ``locate`` answer.

``get`` runs these phases, each a method named for what it does:

1. ``_find_and_pin``: the fastest managed level holding each key READY, its size checked
   against the caller's buffer (``BufferSizeError`` before anything is pinned), every hit
   pinned under the lock.  One managed level: one batched probe (``Level.probe_sized``).
2. ``_read_pinned``: each level's hits read in one call (``TierIO``), outside the lock; a
   failed or corrupt copy is dropped and the key goes back for ``_pin_next``, which pins
   it in the next level holding it.  Every pin is released in a ``finally``.
3. ``_read_shared``: the shared (unmanaged) pools, in chain order, for the keys no managed
   level had (``_first_shared``: the one fan-out ``get``, ``lookup``, ``locate`` and
   ``contains`` use).
4. ``_count_misses``; then the hits served below the top managed level are handed to the
   ``Copier``, which promotes them on its background thread: a ``get`` never writes to a
   tier, nor makes room by demoting, on the caller's thread.
"""

from __future__ import annotations

from typing import Optional

from tierkv.buffers import Parts, check_size
from tierkv.engine.chain import Chain
from tierkv.engine.copier import Copier
from tierkv.engine.indexqueries import leading_in_any
from tierkv.engine.leases import LeaseBook
from tierkv.engine.tierio import TierIO
from tierkv.errors import StoreClosedError
from tierkv.keys import check_key, check_keys
from tierkv.stats import GetCounters

Prepared = list[tuple[Parts, int]]


class _Get:
    """The state of one get call, handed from phase to phase."""

    __slots__ = ("codes", "groups", "keys", "n", "no_local", "pending", "prepared", "ptrs", "results",
                 "served", "tried", "whole")

    def __init__(self, keys: list[str], prepared: Prepared, ptrs: Optional[list[int]]) -> None:
        n = len(keys)
        self.keys, self.prepared, self.ptrs, self.n = keys, prepared, ptrs, n
        self.results = [False] * n
        self.served: list[Optional[int]] = [None] * n  # the level that served each key
        self.tried = [0] * n  # bitmask of levels already tried for key i
        self.no_local: list[int] = []  # positions no managed level holds
        self.pending: list[int] = []  # positions whose read failed: the next level holding them is tried
        self.groups: dict[int, list[int]] = {}  # level -> positions pinned there
        self.codes: Optional[list[int]] = None  # the one managed level's codes of its hits, as probed
        self.whole = False  # every key READY in the one managed level, sizes matching: no per-key work


class Reader:
    """The read path, ``lookup`` and ``locate`` (see the module docstring)."""

    def __init__(self, chain: Chain, io: TierIO, copier: Copier, leases: LeaseBook) -> None:
        self.chain = chain
        #: the live leases (the store's): a copy dropped as unreadable is let go by the lease holding it
        self.leases = leases
        # (every part binds the chain's levels and lock as names of its own, read on its hot path without a
        # hop: the ``Writer``'s first lines are alike in shape, and there is nothing more to share)
        self.levels = chain.levels
        self._lock = chain.lock
        self.io = io
        self.copier = copier
        #: the read path's counters (``stats()["total"]``), this part's alone
        self.counters = GetCounters()

    # ------------------------------------------------------------------ get
    def get(self, keys: list[str], prepared: Prepared, ptrs: Optional[list[int]] = None) -> list[bool]:
        """Read ``keys`` into ``prepared`` (``ptrs``: their host addresses, see ``to_parts_ptrs``)."""
        call = _Get(keys, prepared, ptrs)
        with self._lock:
            self.counters.get_calls += 1
            self._find_and_pin(call)
            if self.chain.observing:
                self.chain.accessed(keys)
            for j, items in call.groups.items():
                self.levels[j].pin_many(keys if call.whole else [keys[i] for i in items])
        self._read_pinned(call, first=True)
        while call.pending:
            with self._lock:
                self._pin_next(call)
            self._read_pinned(call, first=False)
        if call.no_local and self.chain.shared:
            self._read_shared(call)
        self._count_misses(call.served, prepared)
        if call.served.count(None) + call.served.count(self.chain.managed[0] if self.chain.managed else 0) \
                < call.n:  # something was served below the top managed level
            self.copier.promote_later(keys, prepared, call.served)
        return call.results

    def _find_and_pin(self, call: _Get) -> None:
        """Group the keys by the fastest managed level holding each READY, sizes checked (lock held; the
        caller pins the groups)."""
        keys, prepared, n = call.keys, call.prepared, call.n
        managed = self.chain.managed
        if len(managed) == 1:  # one managed level: one batched probe
            j = managed[0]
            lvl = self.levels[j]
            sizes = [p[1] for p in prepared]
            codes = lvl.probe_sized(keys, sizes)
            if codes is not None:
                call.whole, call.codes, call.groups[j] = True, codes, list(range(n))
                call.tried = [1 << j] * n
                return
            have = lvl.ready_sizes(keys)
            hits = []
            for i, nb in enumerate(have):
                if nb >= 0:
                    if nb != sizes[i]:
                        check_size(keys[i], sizes[i], nb)
                    hits.append(i)
                else:
                    check_key(keys[i])
                    call.no_local.append(i)
            if hits:
                call.groups[j] = hits
                call.codes = lvl.codes([keys[i] for i in hits]) if lvl.located else None
                call.tried = [1 << j] * n  # (only hits are ever retried)
            return
        for i, key in enumerate(keys):  # none, or several managed levels
            for j in managed:
                nb = self.levels[j].ready_nbytes(key)
                if nb >= 0:
                    if nb != prepared[i][1]:
                        check_size(key, prepared[i][1], nb)
                    call.tried[i] = 1 << j
                    call.groups.setdefault(j, []).append(i)
                    break
            else:
                check_key(key)
                call.no_local.append(i)

    def _pin_next(self, call: _Get) -> None:
        """For each key whose read failed: the next managed level holding it with its size, pinned (lock
        held); none: it joins ``no_local``."""
        call.groups = {}
        keys, prepared = call.keys, call.prepared
        for i in call.pending:
            key, want, found = keys[i], prepared[i][1], -1
            for j in self.chain.managed:
                if call.tried[i] >> j & 1:
                    continue
                nb = self.levels[j].ready_nbytes(key)
                if nb < 0:
                    continue
                call.tried[i] |= 1 << j
                if nb == want:
                    found = j
                    break
            if found < 0:
                call.no_local.append(i)
                continue
            self.levels[found].pin(key)
            call.groups.setdefault(found, []).append(i)
        call.pending = []

    def _read_pinned(self, call: _Get, first: bool) -> None:
        """Read each level's pinned group in one call; verify; unpin every one (``finally``)."""
        keys, prepared, ptrs, n = call.keys, call.prepared, call.ptrs, call.n
        whole = first and call.whole
        try:
            for j, items in call.groups.items():
                lvl = self.levels[j]
                names = keys if whole else [keys[i] for i in items]
                # (sizes matched above; a pinned chunk keeps its code, so the probe's codes still hold)
                oks = self.io.read(lvl, names,
                                   [p[0] for p in prepared] if whole else [prepared[i][0] for i in items],
                                   None if ptrs is None or not lvl.located else
                                   ptrs if whole else [ptrs[i] for i in items],
                                   call.codes if first and lvl.located and len(self.chain.managed) == 1 else None)
                with self._lock:
                    if False not in oks and lvl.none_dropped(names):
                        # all read, none dropped meanwhile (the common case)
                        if whole:
                            call.results[:] = [True] * n
                            call.served[:] = [j] * n
                        else:
                            for i in items:
                                call.results[i] = True
                                call.served[i] = j
                        lvl.counters.bytes_read += sum([prepared[i][1] for i in items])
                        lvl.counters.hits += len(items)
                        if lvl.ledger is not None:
                            lvl.ledger.count_hits(names)
                        lvl.accessed(names)
                        continue
                    hit = []
                    got = 0
                    for i, ok in zip(items, oks):
                        key = keys[i]
                        if ok and lvl.not_dropped(key):
                            call.results[i] = True
                            call.served[i] = j
                            hit.append(key)
                            got += prepared[i][1]
                        else:  # lost, torn or corrupt: drop this copy, try the next level
                            if not ok:
                                lvl.counters.errors += 1
                                self.leases.let_go(lvl, [key])  # (a lease cannot hold it any more)
                                lvl.drop(key)
                            call.pending.append(i)
                    lvl.counters.bytes_read += got
                    lvl.counters.hits += len(hit)
                    if lvl.ledger is not None:
                        lvl.ledger.count_hits(hit)
                    lvl.accessed(hit)
        finally:
            with self._lock:
                for j, items in call.groups.items():
                    self.levels[j].unpin_many(keys if whole else [keys[i] for i in items])

    def _read_shared(self, call: _Get) -> None:
        """Read the keys no managed level had from the shared pools (the first holding each)."""
        idx = [i for i in call.no_local if not call.results[i]]
        found = self._first_shared(call.keys, idx, [p for p, _ in call.prepared])
        with self._lock:
            for i, j in found.items():
                call.results[i] = True
                call.served[i] = j
                self.levels[j].counters.hits += 1
                self.levels[j].counters.bytes_read += call.prepared[i][1]

    def _count_misses(self, served: list[Optional[int]], prepared: Prepared) -> None:
        """Misses per level consulted: every available level above the one that served."""
        nlev = len(self.levels)
        available = [lvl.tier.available for lvl in self.levels]
        missed_above = [served.count(k) for k in range(nlev)] + [served.count(None)]
        got = 0
        if missed_above[nlev] == 0:
            got = sum([p[1] for p in prepared])
        elif missed_above[nlev] < len(served):
            got = sum([p[1] for p, j in zip(prepared, served) if j is not None])
        with self._lock:
            below = 0  # keys served at or below level k (or not at all)
            for k in range(nlev, -1, -1):
                if k < nlev and available[k]:
                    self.levels[k].counters.misses += below
                below += missed_above[k]
            c = self.counters
            c.misses += missed_above[nlev]
            c.hits += len(served) - missed_above[nlev]
            c.bytes_got += got

    # ------------------------------------------------------------------ shared pools
    def _first_shared(self, keys: list[str], idx: list[int],
                      parts: Optional[list[Parts]] = None) -> dict[int, int]:
        """Ask the shared (unmanaged) levels in chain order, each for the keys no earlier one had.

        Returns {index into keys: level that answered True}: a read into ``parts`` when given, else
        a presence question.  A level that fails or is down is skipped.
        """
        found: dict[int, int] = {}
        left = list(idx)
        for j in self.chain.shared:
            if not left:
                break
            lvl = self.levels[j]
            if not lvl.tier.available:
                continue
            names = [keys[i] for i in left]
            res = (self.io.contains(lvl, names) if parts is None else
                   self.io.read_unmanaged(lvl, names, [parts[i] for i in left]))
            if res is None:
                continue
            for i, hit in zip(left, res):
                if hit:
                    found[i] = j
            left = [i for i in left if i not in found]
        return found

    # ------------------------------------------------------------------ lookup, locate
    def lookup(self, keys: list[str]) -> int:
        """How many leading keys are present in some tier (READY in a managed level, or in a shared pool)."""
        chain = self.chain
        with self._lock:  # (one lock hold in the common case: no call in flight to account for)
            if chain.closed:
                raise StoreClosedError("the store is closed")
            self.counters.lookup_calls += 1
            try:
                n = self._leading_ready(keys)
            except TypeError:
                check_keys(keys)  # an unhashable key: raise the error that names it
                raise
            if n < len(keys):  # the keys found were stored, so they are valid; the rest are checked here
                check_keys(keys[n:])
            if n == len(keys) or not chain.shared:
                return n
            ask = [i for i in range(n, len(keys)) if not chain.mask(keys[i])]
            chain.enter_held()  # (the shared levels are asked outside the lock: ``close`` waits)
        try:
            found = self._first_shared(keys, ask)
            with self._lock:
                for i in range(n, len(keys)):
                    if not chain.mask(keys[i]) and i not in found:
                        break
                    n += 1
            return n
        finally:
            chain.leave()

    def _leading_ready(self, keys: list[str]) -> int:
        """How many leading keys are READY in some managed level.  Lock held."""
        managed = self.chain.managed
        if not managed:
            return 0
        top = self.levels[managed[0]]
        n = top.leading_ready(keys)  # (every key READY in the first managed level: probed in C)
        if n == len(keys) or len(managed) == 1:
            return n
        # from the first key the top one lacks, every managed level asked (the top one too)
        return n + leading_in_any([self.levels[j].index for j in managed], keys[n:])

    def locate(self, keys: list[str]) -> list[Optional[str]]:
        """Name of the fastest tier holding each key (None where none does)."""
        n = len(keys)
        out: list[Optional[str]] = [None] * n
        with self._lock:
            try:
                left = list(range(n))  # positions no managed level asked so far holds READY
                for j in self.chain.managed:  # fastest first: one batched question per level
                    if not left:
                        break
                    lvl = self.levels[j]
                    have = lvl.ready_sizes(keys if len(left) == n else [keys[i] for i in left])
                    if min(have) >= 0:  # every one READY here (the common case)
                        if len(left) == n:
                            out = [lvl.name] * n
                        else:
                            for i in left:
                                out[i] = lvl.name
                        left = []
                        break
                    rest = []
                    for i, nb in zip(left, have):
                        if nb >= 0:
                            out[i] = lvl.name
                        else:
                            rest.append(i)
                    left = rest
            except TypeError:
                check_keys(keys)  # an unhashable key: raise the error that names it
                raise
        missing = [i for i, o in enumerate(out) if o is None]
        for i in missing:
            check_key(keys[i])
        if missing and self.chain.shared:
            for i, j in self._first_shared(keys, missing).items():
                out[i] = self.levels[j].name
        return out
