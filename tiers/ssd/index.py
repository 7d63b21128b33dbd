"""The compact in-memory index: key digest -> (region, offset, record length, raw length).

An open-addressing hash table over five numpy arrays (24 bytes a slot), linear probing,
grown to keep the load at most 0.7, so at a million objects it holds about 48 MiB
(under 64 bytes an object).  Key strings are not kept: records carry the full key and a
read compares it, so two keys of one digest cannot serve each other's bytes (the later
one replaces the earlier in the table; the earlier one becomes a miss).

Not thread safe: the tier guards it with its lock.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from .format import EMPTY, TOMB

_MAX_LOAD = 0.7
_WINDOW = np.arange(16)  # slots probed at once per digest by the batch operations


class DigestIndex:
    def __init__(self, slots: int = 1 << 12) -> None:
        self._alloc(max(16, 1 << (int(slots) - 1).bit_length()))

    def _alloc(self, n: int) -> None:
        self.digest = np.zeros(n, dtype=np.uint64)
        self.region = np.zeros(n, dtype=np.uint32)
        self.offset = np.zeros(n, dtype=np.uint32)
        self.rec_len = np.zeros(n, dtype=np.uint32)
        self.raw_len = np.zeros(n, dtype=np.uint32)
        self.mask = n - 1
        self.count = 0
        self.used = 0  # live + deleted slots (what the load factor counts)
        # memoryviews of the same arrays: one element read or written through them costs less than
        # through numpy (``lookup``, ``put_many``)
        self._views = tuple(memoryview(a) for a in  # type: ignore[arg-type]  # ndarray exports a buffer
                            (self.digest, self.region, self.offset, self.rec_len, self.raw_len))

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.digest, self.region, self.offset, self.rec_len, self.raw_len))

    def __len__(self) -> int:
        return self.count

    def find(self, d: int) -> int:
        """The slot holding digest ``d``, or -1."""
        dig = self.digest
        i = d & self.mask
        while True:
            v = dig.item(i)
            if v == d:
                return i
            if v == EMPTY:
                return -1
            i = (i + 1) & self.mask

    def get(self, d: int) -> Optional[tuple[int, int, int, int]]:
        i = self.find(d)
        if i < 0:
            return None
        return self.region.item(i), self.offset.item(i), self.rec_len.item(i), self.raw_len.item(i)

    def put(self, d: int, region: int, offset: int, rec_len: int, raw_len: int) -> Optional[tuple[int, int, int]]:
        """Insert or replace; returns the replaced entry's (region, offset, rec_len), if any."""
        i = self.find(d)
        old = None
        if i >= 0:
            old = (self.region.item(i), self.offset.item(i), self.rec_len.item(i))
        else:
            if (self.used + 1) > _MAX_LOAD * (self.mask + 1):
                self._resize(max(16, 2 * (self.mask + 1) if self.count + 1 > _MAX_LOAD * (self.mask + 1) / 2
                                 else self.mask + 1))
            dig = self.digest
            i = d & self.mask
            while True:
                v = dig.item(i)
                if v in (EMPTY, TOMB):
                    break
                i = (i + 1) & self.mask
            if dig.item(i) == EMPTY:
                self.used += 1
            dig[i] = d
            self.count += 1
        self.region[i] = region
        self.offset[i] = offset
        self.rec_len[i] = rec_len
        self.raw_len[i] = raw_len
        return old

    def lookup(self, digests: list[int]) -> list[tuple[int, int, int, int, int]]:
        """(i, region, offset, rec_len, raw_len) of each digest ``digests[i]`` present, in order of ``i``:
        the probes of a batch in one loop, each slot read through a memoryview."""
        dig, reg, off, rec, raw = self._views
        mask = self.mask
        found: list[tuple[int, int, int, int, int]] = []
        add = found.append
        for i, d in enumerate(digests):
            j = d & mask
            v = dig[j]
            while v != d:
                if v == EMPTY:
                    break
                j = (j + 1) & mask
                v = dig[j]
            else:
                add((i, reg[j], off[j], rec[j], raw[j]))
        return found

    def find_many(self, d: np.ndarray) -> np.ndarray:
        """The slot of each digest of ``d`` (uint64), -1 where absent: a window of slots per digest at once."""
        n = len(d)
        slots = np.full(n, -1, dtype=np.int64)
        todo = np.arange(n)
        start = (d & np.uint64(self.mask)).astype(np.int64)
        want = d[:, None]
        while todo.size:
            at = (start[:, None] + _WINDOW) & self.mask
            win = self.digest[at]
            stop = (win == want) | (win == EMPTY)
            done = stop.any(axis=1)
            rows = np.flatnonzero(done)
            first = stop.argmax(axis=1)[rows]
            hit = win[rows, first] == want[rows, 0]
            slots[todo[rows[hit]]] = at[rows[hit], first[hit]]
            go = ~done
            todo, start, want = todo[go], start[go] + len(_WINDOW), want[go]
        return slots

    def get_many(self, d: np.ndarray):
        """(slots, region, offset, rec_len, raw_len) of each digest; slots -1 and rec_len 0 where absent."""
        slots = self.find_many(d)
        at = np.maximum(slots, 0)
        absent = slots < 0
        rec_len = self.rec_len[at]
        rec_len[absent] = 0
        return slots, self.region[at], self.offset[at], rec_len, self.raw_len[at]

    def put_many(self, d: list[int], region: int, offset: list[int], rec_len: list[int],
                 raw_len: list[int]) -> list[tuple[int, int, int]]:
        """``put`` of each entry (one batch's, in order, all in ``region``): of a digest given twice the
        later replaces the earlier.  Returns the replaced entries' (region, offset, rec_len).

        One loop over the batch, each slot read and written through a memoryview (a batch that would
        take the table past its load is put entry by entry, growing it as ``put`` does)."""
        if self.used + len(d) > _MAX_LOAD * (self.mask + 1):
            olds = []
            for x, o, rl, wl in zip(d, offset, rec_len, raw_len):
                old = self.put(x, region, o, rl, wl)
                if old is not None:
                    olds.append(old)
            return olds
        dig, reg, off, rec, raw = self._views
        mask = self.mask
        olds = []
        added = fresh = 0
        for x, o, rl, wl in zip(d, offset, rec_len, raw_len):
            j = x & mask
            free = -1
            v = dig[j]
            while v != x:
                if v == EMPTY:
                    break
                if v == TOMB and free < 0:
                    free = j
                j = (j + 1) & mask
                v = dig[j]
            else:  # present: replaced in place
                olds.append((reg[j], off[j], rec[j]))
                reg[j], off[j], rec[j], raw[j] = region, o, rl, wl
                continue
            if free >= 0:  # (the first deleted slot on the probe: reused)
                j = free
            else:
                fresh += 1
            dig[j] = x
            reg[j], off[j], rec[j], raw[j] = region, o, rl, wl
            added += 1
        self.count += added
        self.used += fresh
        return olds

    def move(self, slot: int, region: int, offset: int) -> None:
        self.region[slot] = region
        self.offset[slot] = offset

    def remove(self, d: int) -> Optional[tuple[int, int, int]]:
        """Delete; returns the entry's (region, offset, rec_len), if it was there."""
        i = self.find(d)
        if i < 0:
            return None
        self.digest[i] = TOMB
        self.count -= 1
        return self.region.item(i), self.offset.item(i), self.rec_len.item(i)

    def drop_slots(self, slots) -> tuple[np.ndarray, np.ndarray]:
        """Delete the live entries at ``slots`` (an index array or a slice); returns copies of their
        (digests, raw lengths), as taken before."""
        gone = self.digest[slots].copy(), self.raw_len[slots].copy()
        self.digest[slots] = TOMB
        self.count -= len(gone[0])
        return gone

    def live(self) -> np.ndarray:
        """Slots of live entries."""
        return np.flatnonzero(self.digest > TOMB)

    def in_region(self, region: int) -> np.ndarray:
        return np.flatnonzero((self.region == region) & (self.digest > TOMB))

    def _resize(self, n: int) -> None:
        live = self.live()
        arrays = (self.digest[live], self.region[live], self.offset[live], self.rec_len[live], self.raw_len[live])
        self._alloc(n)
        self._bulk(*arrays)

    def table(self) -> tuple:
        """(count, used, digest, region, offset, rec_len, raw_len): the slots as they are (copies)."""
        return (self.count, self.used, self.digest.copy(), self.region.copy(), self.offset.copy(),
                self.rec_len.copy(), self.raw_len.copy())

    def load_table(self, table: tuple) -> None:
        """Replace the contents with slots ``table()`` gave (copied: the arrays may be read-only)."""
        count, used, digest, region, offset, rec_len, raw_len = table
        self.digest = np.array(digest, dtype=np.uint64)
        self.region = np.array(region, dtype=np.uint32)
        self.offset = np.array(offset, dtype=np.uint32)
        self.rec_len = np.array(rec_len, dtype=np.uint32)
        self.raw_len = np.array(raw_len, dtype=np.uint32)
        self.mask = len(self.digest) - 1
        self.count, self.used = int(count), int(used)
        self._views = tuple(memoryview(a) for a in  # type: ignore[arg-type]  # ndarray exports a buffer
                            (self.digest, self.region, self.offset, self.rec_len, self.raw_len))

    def bulk_load(self, digest, region, offset, rec_len, raw_len) -> None:
        """Replace the contents with these entries (digests unique), vectorised."""
        n = len(digest)
        size = 16
        while n > _MAX_LOAD * size:
            size *= 2
        self._alloc(size)
        digest = np.asarray(digest, dtype=np.uint64)
        if not n:
            return
        # into an empty table, linear probing in order of home slot is a running maximum: each entry
        # takes its home or the slot after the previous one, whichever is later (among entries of one
        # home any order will do)
        # (sorted as one uint64 each, home slot above entry number: a plain sort of integers, about
        # twice as fast as an argsort of the homes)
        step = np.arange(n, dtype=np.int64)
        if self.mask < 1 << 32:
            packed = (digest & np.uint64(self.mask)) << np.uint64(32) | step.astype(np.uint64)
            packed.sort()
            order = (packed & np.uint64(0xFFFFFFFF)).astype(np.int64)
            home = (packed >> np.uint64(32)).astype(np.int64)
            del packed
        else:  # (a table of more than 2**32 slots)
            home = (digest & np.uint64(self.mask)).astype(np.int64)
            order = np.argsort(home)
            home = home[order]
        pos = np.maximum.accumulate(home - step) + step
        del home, step
        fit = pos <= self.mask
        whole = bool(fit[-1])  # (positions only grow: all fit when the last does)
        at, sel = (pos, order) if whole else (pos[fit], order[fit])
        self.digest[at] = digest[sel]
        self.region[at] = region[sel]
        self.offset[at] = offset[sel]
        self.rec_len[at] = rec_len[sel]
        self.raw_len[at] = raw_len[sel]
        self.count = self.used = len(at)
        rest = order[~fit] if not whole else order[:0]  # past the table's end: they wrap round to its start
        if len(rest):
            self._bulk(digest[rest], np.asarray(region)[rest], np.asarray(offset)[rest], np.asarray(rec_len)[rest],
                       np.asarray(raw_len)[rest])

    def _bulk(self, digest, region, offset, rec_len, raw_len) -> None:
        """Insert unique digests absent from the table, probing for all of them at once."""
        if len(digest) <= (self.mask + 1) >> 6:
            self._place(digest, region, offset, rec_len, raw_len)
            return
        todo = np.arange(len(digest))
        pos = (digest & np.uint64(self.mask)).astype(np.int64)
        owner = np.full(self.mask + 1, -1, dtype=np.int64)
        while todo.size:
            free = self.digest[pos] <= TOMB
            cand, cpos = todo[free], pos[free]
            # one winner per free slot (the last to claim it); losers and those on taken slots probe on
            owner[cpos] = cand
            won = owner[cpos] == cand
            first = np.flatnonzero(won)
            slots, win = cpos[won], cand[won]
            self._fill(slots, win, digest, region, offset, rec_len, raw_len)
            placed = np.zeros(len(todo), dtype=bool)
            placed[np.flatnonzero(free)[first]] = True
            todo, pos = todo[~placed], pos[~placed]
            pos = np.where(self.digest[pos] > TOMB, (pos + 1) & self.mask, pos)

    def _fill(self, slots, win, digest, region, offset, rec_len, raw_len) -> None:
        """Entries ``win`` of the columns into the free ``slots`` (one each)."""
        self.used += int(np.count_nonzero(self.digest[slots] == EMPTY))
        self.digest[slots] = digest[win]
        self.region[slots] = region[win]
        self.offset[slots] = offset[win]
        self.rec_len[slots] = rec_len[win]
        self.raw_len[slots] = raw_len[win]
        self.count += len(win)

    def _place(self, digest, region, offset, rec_len, raw_len) -> None:
        """``_bulk`` for a few entries: each takes the first free slot of its window (the first of
        several claiming one slot wins it, the others look again)."""
        todo = np.arange(len(digest))
        start = (digest & np.uint64(self.mask)).astype(np.int64)
        while todo.size:
            at = (start[:, None] + _WINDOW) & self.mask
            free = self.digest[at] <= TOMB
            some = free.any(axis=1)
            rows = np.flatnonzero(some)
            cand = at[rows, free.argmax(axis=1)[rows]]
            slots, first = np.unique(cand, return_index=True)
            win = todo[rows[first]]
            self._fill(slots, win, digest, region, offset, rec_len, raw_len)
            left = np.ones(len(todo), dtype=bool)
            left[rows[first]] = False
            start = np.where(some, start, start + len(_WINDOW))[left]
            todo = todo[left]
