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

    def bulk_load(self, digest, region, offset, rec_len, raw_len) -> None:
        """Replace the contents with these entries (digests unique), vectorised."""
        n = len(digest)
        size = 16
        while n > _MAX_LOAD * size:
            size *= 2
        self._alloc(size)
        self._bulk(np.asarray(digest, dtype=np.uint64), region, offset, rec_len, raw_len)

    def _bulk(self, digest, region, offset, rec_len, raw_len) -> None:
        """Insert unique digests absent from the table, probing for all of them at once."""
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
            self.used += int(np.count_nonzero(self.digest[slots] == EMPTY))
            self.digest[slots] = digest[win]
            self.region[slots] = region[win]
            self.offset[slots] = offset[win]
            self.rec_len[slots] = rec_len[win]
            self.raw_len[slots] = raw_len[win]
            self.count += len(win)
            placed = np.zeros(len(todo), dtype=bool)
            placed[np.flatnonzero(free)[first]] = True
            todo, pos = todo[~placed], pos[~placed]
            pos = np.where(self.digest[pos] > TOMB, (pos + 1) & self.mask, pos)
