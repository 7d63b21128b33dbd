"""``Writer``: how a batch is put, phase by phase.

``put`` runs these phases, each a method named for what it does:

1. ``_count_call``: the call's counters; admission policies that observe demand hear of the keys.
2. ``_reserve_all_on_top`` (one managed level on top that takes everything: the batch reserved
   there at once) or ``_sort_present`` (each key: a repeat inside the batch, present somewhere,
   or to place).  Keys found present are pinned (``_hold_present``) until the call ends, so the
   room the same call makes never takes a key it answered present for.
3. ``_place_rest``: the first level that admits each key and has room without evicting; room made
   for the rest at once (one ``victims`` call, batched demotions, ``Placer``); then key by key.
4. ``_write_groups``: each level's chunks written in one call (``TierIO``) and committed together;
   a failed chunk is placed again further down; write-through levels copied at once.
5. ``_end_call``: whatever an exception left reserved or pinned released (``finally``), stored
   chunks queued for write-behind (``Copier``), keys another call was writing settled
   (``_settle``), the refusals counted.

Every reservation the call takes is held in ``held`` (or in the batch reservation of the top
level) until its write is committed or aborted.  A key another call is still writing is
answered only once that write is settled.
"""

from __future__ import annotations

import time
from typing import Optional

from tierkv.buffers import Parts, check_size
from tierkv.checksum import chunk_sum
from tierkv.engine.chain import FAILED, UNAVAILABLE, Chain, Held
from tierkv.engine.copier import Copier
from tierkv.engine.departures import Departures
from tierkv.engine.level import Level
from tierkv.engine.placer import Placer, refusal
from tierkv.engine.tierio import TierIO
from tierkv.outcome import MissReason, PutOutcome
from tierkv.stats import PutCounters
from tierkv.tenants import Tenants

#: how long a put waits for another call's write of a key it found being written
_SETTLE_S = 30.0

Prepared = list[tuple[Parts, int]]


class _Put:
    """The state of one put call, handed from phase to phase."""

    __slots__ = ("batch0", "behind", "first", "groups", "held", "holding", "inflight", "keys", "label", "n", "out",
                 "prepared", "ptrs", "slow", "start", "sums", "todo", "unique", "why")

    def __init__(self, keys: list[str], prepared: Prepared, ptrs: Optional[list[int]],
                 label: Optional[str] = None) -> None:
        n = len(keys)
        self.keys, self.prepared, self.ptrs, self.n = keys, prepared, ptrs, n
        #: the tenant label every reservation of the call is charged to (None: no tenants configured)
        self.label = label
        self.out: list[Optional[PutOutcome]] = [None] * n
        self.first: dict[str, int] = {}  # key -> its first position (repeats take its result)
        self.todo: list[int] = []  # positions still to place
        self.unique = len(set(keys)) == n
        # reservations this call took and has not finished: (level, key) taken one by one, and the
        # keys the batch reservation took in the top level (all finished in one lock hold)
        self.held: Held = {}
        self.batch0: dict[str, None] = {}
        self.groups: dict[int, list[int]] = {}  # level -> positions reserved (or chosen) there
        self.slow: list[int] = []  # positions whose first level must evict first
        self.holding: list[tuple[Level, list[str]]] = []  # keys found READY, pinned until the call ends
        self.inflight: list[int] = []  # positions of keys another call is writing (answered present for now)
        self.start = [0] * n  # the first level each key may still go to
        self.why = [0] * n  # refusal flags per key
        self.sums: list[Optional[int]] = [None] * n  # each chunk's checksum, computed once before its first write
        self.behind: list[tuple[int, str]] = []  # (level, key) stored: for write-behind


class Writer:
    """The batch put path (see the module docstring)."""

    def __init__(self, chain: Chain, io: TierIO, placer: Placer, copier: Copier, departures: Departures,
                 tenants: Optional[Tenants] = None) -> None:
        self.chain = chain
        #: the miss memory (the store's): the chunks no tier took, and why
        self.departures = departures
        # (the chain's levels and lock bound as this part's own names, as the ``Reader`` does: alike in shape)
        self.levels = chain.levels
        self._lock = chain.lock
        self.io = io
        self.placer = placer
        self.copier = copier
        #: the configured tenants, whose labels a put is charged to (None: no quotas, no label asked)
        self.tenants = tenants
        #: the put path's counters (``stats()["total"]``), this part's alone
        self.counters = PutCounters()

    def put(self, keys: list[str], prepared: Prepared, ptrs: Optional[list[int]] = None,
            tenant: Optional[str] = None) -> list[PutOutcome]:
        """Store ``prepared`` under ``keys`` (``ptrs``: their host addresses, see ``to_parts_ptrs``) for
        ``tenant`` (counted and held to its quotas when the store has tenants configured)."""
        tenants = self.tenants
        call = _Put(keys, prepared, ptrs, tenants.label(tenant) if tenants is not None else None)
        try:
            with self._lock:
                self._count_call(call)
                if call.unique and self._all_on_top_possible():
                    self._reserve_all_on_top(call)
                else:
                    self._sort_present(call)
            first_pass = True
            while call.todo or first_pass:
                if not first_pass:
                    call.groups, call.slow = {}, []
                first_pass = False  # (the first pass takes groups and slow as the batch reservation left them)
                self._place_rest(call)
                call.todo = []
                self._write_groups(call)
        finally:
            self._release(call)
        return self._end_call(call, tenant)

    # ------------------------------------------------------------------ phases
    def _count_call(self, call: _Put) -> None:
        c = self.counters
        c.put_calls += 1
        c.chunks_put += call.n
        if self.chain.observing:
            self.chain.accessed(call.keys)

    def _all_on_top_possible(self) -> bool:
        """Whether a put may reserve a whole batch in the top level at once: the one managed level, on top,
        available, with no admission policy."""
        top = self.levels[0]
        return self.chain.managed == [0] and top.admits_all and top.tier.available

    def _reserve_all_on_top(self, call: _Put) -> None:
        """Reserve the whole batch in the top level at once (lock held); keys present there are pinned."""
        keys, prepared = call.keys, call.prepared
        top = self.levels[0]
        if not top.knows_none(keys):
            # (before reserving: a policy ordering the level sees the access, then the new keys)
            at = [i for i, k in enumerate(keys) if top.knows(k)]
            writing = self._hold_present([keys[i] for i in at], [prepared[i][1] for i in at], call.holding)
            if writing:
                pos = {k: i for i, k in enumerate(keys)}
                call.inflight = [pos[k] for k in writing]
        codes = top.reserve_many(keys, [p[1] for p in prepared], call.label)
        got0: list[int] = []
        present = 0
        for i, code in enumerate(codes):
            if code == 0:
                got0.append(i)
            elif code == 1:
                call.out[i] = PutOutcome.PRESENT
                present += 1
            else:
                call.slow.append(i)  # no room without evicting (or a doomed copy still read)
        self.counters.chunks_deduped += present
        if got0:
            call.groups[0] = got0
            call.batch0 = dict.fromkeys([keys[i] for i in got0])

    def _sort_present(self, call: _Put) -> None:
        """Each key: a repeat inside the batch, present (READY or being written) somewhere, or to place
        (lock held)."""
        c = self.counters
        busy = self.chain.busy
        found: list[str] = []
        found_sizes: list[int] = []
        first = call.first
        for i, key in enumerate(call.keys):
            if key in first:  # a repeat inside the batch: takes the first one's result
                c.chunks_deduped += 1
                continue
            first[key] = i
            if busy(key):
                call.out[i] = PutOutcome.PRESENT
                c.chunks_deduped += 1
                found.append(key)
                found_sizes.append(call.prepared[i][1])
            else:
                call.todo.append(i)
        if found:
            writing = self._hold_present(found, found_sizes, call.holding)
            if writing:
                call.inflight = [first[k] for k in writing]

    def _place_rest(self, call: _Put) -> None:
        """Choose a level for each key still to place (``todo`` and ``slow``), reserving there."""
        keys, prepared, start, why, held = call.keys, call.prepared, call.start, call.why, call.held
        placer = self.placer
        with self._lock:  # fast path: the first level that admits has room without evicting
            for i in call.todo:
                j, flags = placer.place_fast(keys[i], prepared[i][1], start[i], held, call.label)
                why[i] |= flags
                if j is None:
                    call.slow.append(i)
                elif j >= 0:
                    call.groups.setdefault(j, []).append(i)
                else:
                    call.out[i] = refusal(why[i])
        slow = call.slow
        if len(slow) > 1:  # room for the whole rest at once: one victims call, batched demotions
            placer.make_room_for([keys[i] for i in slow], [prepared[i][1] for i in slow], [start[i] for i in slow])
            top = self.levels[0]
            if top.managed and top.admits_all:  # (a top level that takes everything without asking)
                slow = self._reserve_rest_on_top(call, slow)
        for i in slow:
            j, flags = placer.place(keys[i], prepared[i][1], start[i], len(self.levels), held, tenant=call.label)
            why[i] |= flags
            if j is None:
                call.out[i] = refusal(why[i])
                continue
            call.groups.setdefault(j, []).append(i)

    def _reserve_rest_on_top(self, call: _Put, slow: list[int]) -> list[int]:
        """After room was made: reserve the keys at ``slow`` that start at the top level in one batch (added
        to ``groups[0]`` and ``held``); returns those left to the per-key path."""
        top = self.levels[0]
        at = [i for i in slow if call.start[i] == 0]
        if not at or not top.tier.available:
            return slow
        keys, prepared = call.keys, call.prepared
        with self._lock:
            codes = top.reserve_many([keys[i] for i in at], [prepared[i][1] for i in at], call.label)
            got = [i for i, c in zip(at, codes) if c == 0]
            for i in got:
                call.held[(0, keys[i])] = None
        if got:
            call.groups.setdefault(0, []).extend(got)
            taken = set(got)
            return [i for i in slow if i not in taken]
        return slow

    def _write_groups(self, call: _Put) -> None:
        """Write each level's chunks in one call and commit them; a failed one goes back to ``todo``, to be
        placed further down."""
        keys, prepared, ptrs, n = call.keys, call.prepared, call.ptrs, call.n
        chain = self.chain
        for j, idx in sorted(call.groups.items()):
            lvl = self.levels[j]
            # (a reservation's code was taken for its prepared size: the addresses may stand for the parts)
            whole = len(idx) == n and idx == list(range(n))  # every position, in order
            sums = call.sums
            if not chain.needs_sums:
                pass  # (no level keeps a sum nor carries one: none is computed)
            elif whole and sums[0] is None:  # (where the bytes enter the store: the one time they are summed)
                sums[:] = [chunk_sum(p[0]) for p in prepared]
            else:
                for i in idx:
                    if sums[i] is None:
                        sums[i] = chunk_sum(prepared[i][0])
            oks = self.io.write(lvl, keys if whole else [keys[i] for i in idx],
                                [p[0] for p in prepared] if whole else [prepared[i][0] for i in idx],
                                None if ptrs is None or not lvl.located else
                                ptrs if whole else [ptrs[i] for i in idx],
                                None if not chain.needs_sums else sums if whole else [sums[i] for i in idx])
            with self._lock:
                done = self._settle_writes(call, j, idx, oks)
                if j == 0 and call.batch0:
                    # the failed ones are aborted now; commit_many either commits the rest or,
                    # raising, drops them: none of the batch is left reserved after it
                    call.batch0.clear()
                if done:
                    self._commit(call, lvl, j, done, whole)
            if chain.any_write_through:
                for i, ok in zip(idx, oks):
                    if ok:
                        self.placer.write_through(j, keys[i], prepared[i], call.held, call.sums[i], call.label)

    def _settle_writes(self, call: _Put, j: int, idx: list[int], oks: list[bool]) -> list[int]:
        """The positions whose write into level ``j`` went through; the failed ones aborted and sent on to
        the next level (lock held)."""
        held = call.held
        if not held and False not in oks:
            return idx  # the common case: all written, nothing held key by key
        lvl = self.levels[j]
        done = []
        for i, ok in zip(idx, oks):
            key = call.keys[i]
            held.pop((j, key), None)
            if ok:
                done.append(i)
            else:
                self.chain.finish_write(lvl, key, call.prepared[i][1], False)
                call.why[i] |= FAILED
                call.start[i] = j + 1
                call.todo.append(i)
        return done

    def _commit(self, call: _Put, lvl: Level, j: int, done: list[int], whole: bool) -> None:
        """Make the chunks at ``done`` READY in level ``j`` and count them (lock held)."""
        keys, n = call.keys, call.n
        if lvl.managed:
            lvl.commit_many(keys if whole and len(done) == n else [keys[i] for i in done])
        nb = sum([call.prepared[i][1] for i in done])
        lvl.counters.puts += len(done)
        lvl.counters.bytes_written += nb
        c = self.counters
        c.chunks_stored += len(done)
        c.bytes_put += nb
        stored = PutOutcome.STORED
        if len(done) == n:
            call.out[:] = [stored] * n
        else:
            for i in done:
                call.out[i] = stored
        if self.copier.behind_levels:
            call.behind.extend((j, keys[i]) for i in done)

    def _release(self, call: _Put) -> None:
        """Abort what the call still holds reserved, unpin what it found present (every path out)."""
        if call.batch0:
            with self._lock:
                top = self.levels[0]
                for key in call.batch0:
                    top.abort(key)
            call.batch0.clear()
        self.chain.release(call.held)
        if call.holding:
            with self._lock:
                for lvl, ks in call.holding:
                    lvl.unpin_many(ks)

    def _end_call(self, call: _Put, tenant: Optional[str]) -> list[PutOutcome]:
        """Queue the write-behind copies, settle keys another call was writing, fill and count the answer."""
        if call.behind:
            self.copier.queue_behind(call.behind)
        if call.inflight:
            self._settle(call, tenant)
        out, keys = call.out, call.keys
        if None in out:
            for i in range(call.n):
                if out[i] is None:
                    o = out[call.first[keys[i]]] if not call.unique else None
                    out[i] = o if o is not None else PutOutcome.ERROR
        refused = call.n - out.count(PutOutcome.STORED) - out.count(PutOutcome.PRESENT)
        if refused:
            with self._lock:
                self.counters.chunks_rejected += refused
            self._note_refused(call)
        return out  # type: ignore[return-value]

    def _note_refused(self, call: _Put) -> None:
        """Remember the chunks no tier took (``rejected``; ``unavailable`` where a tier that might have taken
        them was down), so a later miss of them is explained."""
        out, keys, why = call.out, call.keys, call.why
        refused = [keys[i] for i in range(call.n) if out[i] is PutOutcome.REJECTED or out[i] is PutOutcome.NO_ROOM]
        down = [keys[i] for i in range(call.n) if out[i] is PutOutcome.ERROR and why[i] & UNAVAILABLE]
        if refused:
            self.departures.record(refused, MissReason.REJECTED)
        if down:
            self.departures.record(down, MissReason.UNAVAILABLE)

    # ------------------------------------------------------------------ keys found present
    def _hold_present(self, keys: list[str], sizes: list[int], holding: list[tuple[Level, list[str]]]) -> list[str]:
        """Keys a put found present count as used: pin each where it is READY (appended to ``holding``, which
        the caller unpins when its call ends), so the room the same call makes never takes them, and tell
        the eviction policy of the fastest level holding each of an access.  Lock held.

        A key stored with another size than the put gives it is not the caller's chunk: ``BufferSizeError``
        (as for a ``get``), before anything is pinned in that level.  Returns the keys READY nowhere (another
        call is writing them: ``_settle`` waits for that write)."""
        told: set[str] = set()
        everywhere = False  # every key READY in some one level
        pinned: list[list[str]] = []
        several = len(self.chain.managed) > 1
        for j in self.chain.managed:
            lvl = self.levels[j]
            have = lvl.ready_sizes(keys)
            if have == sizes:
                everywhere = True
                ready = keys  # the common case: every one READY here, with the size given
            else:
                at = [i for i, nb in enumerate(have) if nb >= 0]
                for i in at:
                    check_size(keys[i], sizes[i], have[i])
                ready = [keys[i] for i in at]
            if not ready:
                continue
            lvl.pin_many(ready)
            holding.append((lvl, ready))
            pinned.append(ready)
            fresh = ready if not told else [k for k in ready if k not in told]
            if several:
                told.update(fresh)
            lvl.accessed(fresh)
        if everywhere:
            return []
        seen = {k for ks in pinned for k in ks}
        return [k for k in keys if k not in seen and self.chain.writing_elsewhere(k)]

    def _settle(self, call: _Put, tenant: Optional[str]) -> None:
        """The keys at ``call.inflight`` were answered present because another call was writing them: wait
        for that write; a key it did not store is put now, and one still being written after ``_SETTLE_S``
        seconds is an ``ERROR`` (unverified), so a ``PRESENT`` is never a chunk that is not there."""
        keys, at, chain = call.keys, call.inflight, self.chain
        deadline = time.monotonic() + _SETTLE_S
        with self._lock:
            writing = chain.writing_elsewhere
            chain.wait_for_writes(lambda: any(writing(keys[i]) for i in at), deadline)
            left = [i for i in at if writing(keys[i])]
            gone = [i for i in at if i not in left and not chain.mask(keys[i])]
            c = self.counters
            c.chunks_deduped -= len(gone) + len(left)
            if gone:  # (the put below counts them as part of this call)
                c.put_calls -= 1
                c.chunks_put -= len(gone)
        for i in left:
            call.out[i] = PutOutcome.ERROR
        if gone:
            for i, o in zip(gone, self.put([keys[i] for i in gone], [call.prepared[i] for i in gone],
                                            tenant=tenant)):
                call.out[i] = o
