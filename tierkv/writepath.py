"""How ``TieredStore`` writes a batch: one reservation of the batch in the top level when it can, room made
for the rest at once, each level's chunks written in one call and committed together.

Part of ``TieredStore`` (a mixin it inherits), split out so each module holds one
concern; placement itself (admission, reservation, eviction, demotion) is
``Placement``'s.  Every reservation the call takes is held in ``held`` (or in the
batch reservation of the top level) until its write is committed or aborted, and
a ``finally`` releases whatever an exception left.

A key the call finds present counts as used: its tier's policy hears of an access and
the key stays pinned until the call ends, so the room it makes never takes a key it
answered present for.  A key another call is still writing is answered only once that
write is settled (``_settle``).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Optional

from tierkv.buffers import Parts, check_size
from tierkv.hooks import call_policy
from tierkv.level import _NB_MASK, Level
from tierkv.outcome import PutOutcome
from tierkv.placement import FAILED

_INT = {int}
#: how long a put waits for another call's write of a key it found being written
_SETTLE_S = 30.0


class WritePath:
    """The batch put path of ``TieredStore`` (see the module docstring)."""

    levels: list[Level]
    _lock: Any
    _counters: Any
    _admissions: list[Any]
    _managed_levels: list[int]
    _behind: Any
    _any_write_through: bool
    _settled: Any  # a Condition on ``_lock``, notified as calls end while ``_settle_waiters``
    _settle_waiters: int

    if TYPE_CHECKING:  # defined by ``Placement`` and ``Copying``
        def _tier_io(self, lvl: Level, op: str, keys: list[str], parts: list[Parts],
                     ptrs: Optional[list[int]] = None, codes: Optional[list[int]] = None) -> list[bool]: ...
        def _busy(self, key: str) -> bool: ...
        def _mask(self, key: str) -> int: ...
        def _place_fast(self, key: str, nbytes: int, start: int, held: dict) -> tuple[Optional[int], int]: ...
        def _place(self, key: str, nbytes: int, start: int, stop: int, held: dict) -> tuple[Optional[int], int]: ...
        def _make_room_for(self, idx: list[int], keys: list[str], prepared: list, start: list[int]) -> None: ...
        def _refusal(self, flags: int) -> PutOutcome: ...
        def _finish_write(self, lvl: Level, key: str, nbytes: int, ok: bool, count_error: bool = True,
                          source: Optional[Level] = None) -> bool: ...
        def _write_through(self, j: int, key: str, prepared: tuple[Parts, int], held: dict) -> None: ...
        def _release(self, held: dict[tuple[int, str], None]) -> None: ...
        def _queue_behind(self, stored: list[tuple[int, str]]) -> None: ...

    def _put(self, keys: list[str], prepared: list[tuple[Parts, int]],
             ptrs: Optional[list[int]] = None) -> list[PutOutcome]:
        """Store ``prepared`` under ``keys`` (``ptrs``: their host addresses, see ``to_parts_ptrs``)."""
        n = len(keys)
        out: list[Optional[PutOutcome]] = [None] * n
        first: dict[str, int] = {}
        todo: list[int] = []
        unique = len(set(keys)) == n
        # reservations this call took and has not finished: (level, key) taken one by one, and the
        # keys the first pass reserved in the top level as one batch (all finished in one lock hold)
        held: dict[tuple[int, str], None] = {}
        batch0: dict[str, None] = {}
        groups: dict[int, list[int]] = {}
        slow: list[int] = []
        # keys found READY: pinned (never a victim of this call's room making) until the call ends
        holding: list[tuple[Level, list[str]]] = []
        inflight: list[int] = []  # positions of keys another call is writing (answered present for now)
        start = [0] * n  # the first level each key may still go to
        why = [0] * n  # refusal flags per key
        behind: list[tuple[int, str]] = []
        queue_behind = self._behind is not None
        first_pass = True
        try:
            with self._lock:
                c = self._counters
                c.put_calls += 1
                c.chunks_put += n
                if self._admissions:
                    for key in keys:
                        for adm in self._admissions:
                            call_policy(adm, "on_access", "*", key)
                if unique and self._managed_levels == [0] and self._fast_top() and self.levels[0].tier.available:
                    # one managed level on top that takes everything without asking: reserve the batch at once
                    present, got0 = [], []
                    index0 = self.levels[0].index
                    if not index0.keys().isdisjoint(keys):
                        # (before reserving: a policy ordering the index sees the access, then the new keys)
                        at = [i for i, k in enumerate(keys) if k in index0]
                        writing = self._hold_present([keys[i] for i in at], [prepared[i][1] for i in at], holding)
                        if writing:
                            pos = {k: i for i, k in enumerate(keys)}
                            inflight = [pos[k] for k in writing]
                    codes = self.levels[0].reserve_many(keys, [p[1] for p in prepared])
                    for i, code in enumerate(codes):
                        if code == 0:
                            got0.append(i)
                        elif code == 1:
                            present.append(i)
                        else:
                            slow.append(i)  # no room without evicting (or a doomed copy still read)
                    for i in present:
                        out[i] = PutOutcome.PRESENT
                    c.chunks_deduped += len(present)
                    if got0:
                        groups[0] = got0
                        batch0 = dict.fromkeys([keys[i] for i in got0])
                else:
                    busy = self._busy
                    found: list[str] = []
                    found_sizes: list[int] = []
                    for i, key in enumerate(keys):
                        if key in first:  # a repeat inside the batch: takes the first one's result
                            c.chunks_deduped += 1
                            continue
                        first[key] = i
                        if busy(key):  # READY or being written somewhere
                            out[i] = PutOutcome.PRESENT
                            c.chunks_deduped += 1
                            found.append(key)
                            found_sizes.append(prepared[i][1])
                        else:
                            todo.append(i)
                    if found:
                        writing = self._hold_present(found, found_sizes, holding)
                        if writing:
                            inflight = [first[k] for k in writing]
            while todo or first_pass:
                if first_pass:
                    first_pass = False  # groups and slow as the batch reservation left them
                else:
                    groups, slow = {}, []
                with self._lock:  # fast path: the first level that admits has room without evicting
                    for i in todo:
                        j, flags = self._place_fast(keys[i], prepared[i][1], start[i], held)
                        why[i] |= flags
                        if j is None:
                            slow.append(i)
                        elif j >= 0:
                            groups.setdefault(j, []).append(i)
                        else:
                            out[i] = self._refusal(why[i])
                if len(slow) > 1:  # room for the whole rest at once: one victims call, batched demotions
                    self._make_room_for(slow, keys, prepared, start)
                    if self._fast_top():  # (a top level that takes everything without asking)
                        slow = self._reserve_top(slow, keys, prepared, start, groups, held)
                for i in slow:
                    j, flags = self._place(keys[i], prepared[i][1], start[i], len(self.levels), held)
                    why[i] |= flags
                    if j is None:
                        out[i] = self._refusal(why[i])
                        continue
                    groups.setdefault(j, []).append(i)
                todo = []
                for j, idx in sorted(groups.items()):
                    lvl = self.levels[j]
                    # (a reservation's code was taken for its prepared size: the addresses may stand for the parts)
                    whole = len(idx) == n and idx == list(range(n))  # every position, in order
                    oks = self._tier_io(lvl, "write", keys if whole else [keys[i] for i in idx],
                                        [p[0] for p in prepared] if whole else [prepared[i][0] for i in idx],
                                        None if ptrs is None or not lvl.located else
                                        ptrs if whole else [ptrs[i] for i in idx])
                    with self._lock:
                        pop = held.pop if held else None
                        if pop is None and False not in oks:
                            done = idx  # the common case: all written, nothing held key by key
                        else:
                            done = []
                            for i, ok in zip(idx, oks):
                                if pop is not None:
                                    pop((j, keys[i]), None)
                                if ok:
                                    done.append(i)
                                else:
                                    self._finish_write(lvl, keys[i], prepared[i][1], False)
                                    why[i] |= FAILED
                                    start[i] = j + 1
                                    todo.append(i)
                        if j == 0 and batch0:
                            # the failed ones are aborted now; commit_many either commits the rest or,
                            # raising, drops them: none of the batch is left reserved after it
                            batch0.clear()
                        if done:
                            if lvl.managed:
                                lvl.commit_many(keys if whole and len(done) == n else [keys[i] for i in done])
                            nb = sum([prepared[i][1] for i in done])
                            lvl.counters.puts += len(done)
                            lvl.counters.bytes_written += nb
                            self._counters.chunks_stored += len(done)
                            self._counters.bytes_put += nb
                            stored = PutOutcome.STORED
                            if len(done) == n:
                                out[:] = [stored] * n
                            else:
                                for i in done:
                                    out[i] = stored
                            if queue_behind:
                                behind.extend((j, keys[i]) for i in done)
                    if self._any_write_through:
                        for i, ok in zip(idx, oks):
                            if ok:
                                self._write_through(j, keys[i], prepared[i], held)
        finally:
            if batch0:
                with self._lock:
                    for key in batch0:
                        self.levels[0].abort(key)
                batch0.clear()
            self._release(held)
            if holding:
                with self._lock:
                    for lvl, ks in holding:
                        lvl.unpin_many(ks)
        if behind and self._behind is not None:
            self._queue_behind(behind)
        if inflight:
            self._settle(keys, prepared, inflight, out)
        if None in out:
            for i in range(n):
                if out[i] is None:
                    o = out[first[keys[i]]] if not unique else None
                    out[i] = o if o is not None else PutOutcome.ERROR
        refused = n - out.count(PutOutcome.STORED) - out.count(PutOutcome.PRESENT)
        if refused:
            with self._lock:
                self._counters.chunks_rejected += refused
        return out  # type: ignore[return-value]

    def _hold_present(self, keys: list[str], sizes: list[int],
                      holding: list[tuple[Level, list[str]]]) -> list[str]:
        """Keys a put found present count as used: pin each where it is READY (appended to ``holding``, which
        the caller unpins when its call ends), so the room the same call makes never takes them, and tell
        the eviction policy of the fastest level holding each of an access.  Caller holds the lock.

        A key stored with another size than the put gives it is not the caller's chunk: ``BufferSizeError``
        (as for a ``get``), before anything is pinned in that level.  Returns the keys READY nowhere (another
        call is writing them: ``_settle`` waits for that write)."""
        told: set[str] = set()
        everywhere = False  # every key READY in some one level
        pinned: list[list[str]] = []
        for j in self._managed_levels:
            lvl = self.levels[j]
            index = lvl.index
            vals: list[Any] = list(map(index.get, keys))
            if vals and set(map(type, vals)) == _INT and min(vals) > 0:
                everywhere = True
                ready, ready_vals, ready_sizes = keys, vals, sizes  # the common case: every one READY here
            else:
                at = [i for i, v in enumerate(vals) if type(v) is int and v > 0]
                ready, ready_vals, ready_sizes = [keys[i] for i in at], [vals[i] for i in at], [sizes[i] for i in at]
            if not ready:
                continue
            fields = [v >> 1 & _NB_MASK for v in ready_vals]
            if fields != ready_sizes or _NB_MASK in fields:  # (at the marker: a large chunk, sized elsewhere)
                for key, v, nb in zip(ready, ready_vals, ready_sizes):
                    check_size(key, nb, lvl.value_nbytes(v))
            lvl.pin_many(ready)
            holding.append((lvl, ready))
            pinned.append(ready)
            fresh = ready if not told else [k for k in ready if k not in told]
            if len(self._managed_levels) > 1:
                told.update(fresh)
            lvl.accessed(fresh)
        if everywhere:
            return []
        seen = {k for ks in pinned for k in ks}
        return [k for k in keys if k not in seen and self._writing_elsewhere(k)]  # another call is writing them

    def _writing_elsewhere(self, key: str) -> bool:
        """Whether ``key`` is reserved (being written) in some managed level and READY in none.  Lock held."""
        writing = False
        for j in self._managed_levels:
            v = self.levels[j].index.get(key)
            if type(v) is int:
                if v > 0:
                    return False
                writing = True
        return writing

    def _settle(self, keys: list[str], prepared: list[tuple[Parts, int]], at: list[int],
                out: list[Optional[PutOutcome]]) -> None:
        """The keys at ``at`` were answered present because another call was writing them: wait for that
        write; a key it did not store is put now, and one still being written after ``_SETTLE_S`` seconds
        is an ``ERROR`` (unverified), so a ``PRESENT`` is never a chunk that is not there."""
        deadline = time.monotonic() + _SETTLE_S
        with self._lock:
            self._settle_waiters += 1
            try:
                while True:
                    left = [i for i in at if self._writing_elsewhere(keys[i])]
                    wait = deadline - time.monotonic()
                    if not left or wait <= 0:
                        break
                    self._settled.wait(min(wait, 0.05))
            finally:
                self._settle_waiters -= 1
            gone = [i for i in at if i not in left and not self._mask(keys[i])]
            c = self._counters
            c.chunks_deduped -= len(gone) + len(left)
            if gone:  # (the put below counts them as part of this call)
                c.put_calls -= 1
                c.chunks_put -= len(gone)
        for i in left:
            out[i] = PutOutcome.ERROR
        if gone:
            for i, o in zip(gone, self._put([keys[i] for i in gone], [prepared[i] for i in gone])):
                out[i] = o

    def _reserve_top(self, slow: list[int], keys: list[str], prepared: list[tuple[Parts, int]],
                     start: list[int], groups: dict[int, list[int]], held: dict) -> list[int]:
        """After ``_make_room``: reserve the keys at ``slow`` that start at the top level in one batch
        (added to ``groups[0]`` and ``held``); returns those left to the per-key path."""
        top = self.levels[0]
        at = [i for i in slow if start[i] == 0]
        if not at or not top.tier.available:
            return slow
        with self._lock:
            codes = top.reserve_many([keys[i] for i in at], [prepared[i][1] for i in at])
            got = [i for i, c in zip(at, codes) if c == 0]
            for i in got:
                held[(0, keys[i])] = None
        if got:
            groups.setdefault(0, []).extend(got)
            taken = set(got)
            return [i for i in slow if i not in taken]
        return slow

    def _fast_top(self) -> bool:
        """Whether a put may reserve a whole batch in the top level at once: managed, no admission policy."""
        top = self.levels[0]
        return top.managed and top.admits_all
