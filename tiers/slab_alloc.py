"""Space management of a preallocated slab: slot classes for small objects, extents for the rest.

Both allocators here are plain bookkeeping over byte offsets of a region of
``size`` bytes; neither touches memory nor is thread-safe (the tier locks).

``ExtentAllocator``
    A free-space map of (offset, length) extents, best fit, coalescing on free.

``SlabAllocator``
    What a slab tier uses.  Every request is a *footprint*: ``align_up(nbytes)``,
    a multiple of ``ALIGN``.

    * A footprint of at most ``slot_max`` bytes is a *slot class*: each class keeps
      a stack of free slot offsets (an ``array('q')``, 8 bytes a free slot).  An
      empty stack is refilled by carving one run of slots out of the extents.  A
      freed object goes back on its class's stack, so the common case (the chunks
      of one model come in one or two sizes) is a pop and a push.
    * A larger footprint takes one best-fit extent; freeing it coalesces.
    * When neither fits, the slow path takes a free slot of a larger class (its
      tail goes back to the extents), and failing that *gathers* the object from
      several pieces: free extents, largest first, then free slots of any class
      (a partly used slot gives its tail back as an extent).

    A location is an ``int`` offset (the object is the contiguous range
    ``[offset, offset + footprint)``) or a tuple of ``(offset, length)`` pieces in
    address order whose lengths sum to the footprint.

Invariants (tested in ``tests/test_slab_alloc.py``):
    * **Exact accounting.**  ``free_bytes`` is the extents' free bytes plus the
      bytes of every free slot, and ``free_bytes + Σ footprints of live objects ==
      size`` at all times.
    * **No fragmentation failure.**  ``allocate(f)`` returns a location whenever
      ``f <= free_bytes``: every free byte is reachable by the gathering path.
    * Live objects never overlap.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Optional, Union, cast

from sortedcontainers import SortedDict, SortedList

#: granule of footprints and offsets (a power of two): 8 bytes keeps every dtype's view aligned and
#: halves the rounding slack of small objects against 16 (3.5 B instead of 7.5 B per object on average)
ALIGN = 8
#: largest footprint served by a slot class
SLOT_MAX = 64 << 10
#: bytes carved for a class at a time (less in a small slab: see ``SlabAllocator``)
RUN_BYTES = 1 << 20
#: and at most this many slots: a carved run's offsets wait on its class's stack (8 bytes each, an
#: allocation that does not shrink as they are taken), so 16 KiB a class rather than 128 KiB for 64 B slots
RUN_SLOTS = 2048

Location = Union[int, tuple[tuple[int, int], ...]]


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


class ExtentAllocator:
    """Free-space map of a ``size``-byte region; not thread-safe (callers lock)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._by_off: SortedDict = SortedDict({0: size} if size else {})  # offset -> length
        self._by_len: SortedList = SortedList([(size, 0)] if size else [])  # (length, offset)
        self.free_bytes = size

    def largest(self) -> int:
        """Length of the largest free extent (0 when none)."""
        return self._by_len[-1][0] if self._by_len else 0

    def allocate_one(self, n: int) -> Optional[int]:
        """Offset of a single best-fit extent of ``n`` (> 0) bytes, or None if no free extent is that long."""
        i = self._by_len.bisect_left((n, -1))
        if i == len(self._by_len):
            return None
        length, off = self._by_len[i]
        self._take(off, length, n)
        return off

    def allocate(self, n: int) -> Optional[list[tuple[int, int]]]:
        """Extents totalling ``n`` (already aligned) bytes, or None if less is free."""
        if n > self.free_bytes:
            return None
        if n == 0:
            return []
        off = self.allocate_one(n)
        if off is not None:
            return [(off, n)]
        out = self.take_largest(n)
        out.sort()
        return out

    def take_largest(self, n: int) -> list[tuple[int, int]]:
        """Up to ``n`` bytes from the largest extents, as (offset, length) pieces."""
        out = []
        while n and self._by_len:
            length, off = self._by_len[-1]
            take = min(length, n)
            self._take(off, length, take)
            out.append((off, take))
            n -= take
        return out

    def _take(self, off: int, length: int, n: int) -> None:
        self._by_len.remove((length, off))
        del self._by_off[off]
        if n < length:
            self._by_off[off + n] = length - n
            self._by_len.add((length - n, off + n))
        self.free_bytes -= n

    def free(self, extents: Sequence[tuple[int, int]]) -> None:
        for off, n in extents:
            if n == 0:
                continue
            self.free_bytes += n
            # merge with the free extent before and after
            i = self._by_off.bisect_left(off)
            if i > 0:
                poff = self._by_off.keys()[i - 1]
                plen = self._by_off[poff]
                if poff + plen == off:
                    self._by_len.remove((plen, poff))
                    del self._by_off[poff]
                    off, n = poff, n + plen
            nxt = off + n
            nlen = self._by_off.get(nxt)
            if nlen is not None:
                self._by_len.remove((nlen, nxt))
                del self._by_off[nxt]
                n += nlen
            self._by_off[off] = n
            self._by_len.add((n, off))

    def __len__(self) -> int:
        return len(self._by_off)


class SlabAllocator:
    """Slot classes over an extent allocator; see the module docstring.  Not thread-safe."""

    def __init__(self, size: int, slot_max: int = SLOT_MAX, run_bytes: int = RUN_BYTES) -> None:
        self.size = size
        self.slot_max = slot_max
        # a small slab carves small runs, so one class does not take the whole of it at once
        self.run_bytes = max(ALIGN, min(run_bytes, align_up(size // 64)))
        self._ext = ExtentAllocator(size)
        # footprint -> offsets of free slots; the slab tier pops a slot inline on its hot path and then
        # takes its bytes off ``_slot_free`` itself
        self._stacks: dict[int, array] = {}
        self._slot_free = 0  # bytes in all free slots

    @property
    def free_bytes(self) -> int:
        return self._ext.free_bytes + self._slot_free

    def allocate(self, f: int) -> Optional[Location]:
        """A location for a footprint of ``f`` bytes (a multiple of ``ALIGN``), or None when less is free."""
        if f <= self.slot_max:
            st = self._stacks.get(f)
            if st:
                self._slot_free -= f
                return st.pop()
            if f == 0:
                return 0
            if f > self.free_bytes:
                return None
            off = self._carve(f)
        else:
            if f > self.free_bytes:
                return None
            off = self._ext.allocate_one(f)
        if off is not None:
            return off
        return self._slow(f)

    def free(self, f: int, loc: Location) -> None:
        """Give back what ``allocate(f)`` returned."""
        if f == 0:
            return
        if type(loc) is int:
            if f <= self.slot_max:
                st = self._stacks.get(f)
                if st is None:
                    st = self._stacks[f] = array("q")
                st.append(loc)
                self._slot_free += f
            else:
                self._ext.free(((loc, f),))
        else:
            self._ext.free(cast("tuple[tuple[int, int], ...]", loc))

    @staticmethod
    def pieces(f: int, loc: Location) -> Sequence[tuple[int, int]]:
        """The (offset, length) pieces of a location, in address order."""
        return ((loc, f),) if type(loc) is int else cast("tuple[tuple[int, int], ...]", loc)

    def _carve(self, f: int) -> Optional[int]:
        """Cut a run of class-``f`` slots from the extents; the first slot is returned, the rest stacked."""
        largest = self._ext.largest()
        if largest < f:
            return None
        take = min(max(f, min(self.run_bytes // f, RUN_SLOTS) * f), largest // f * f)
        off = cast(int, self._ext.allocate_one(take))  # (take <= largest: it fits)
        if take > f:
            st = self._stacks.get(f)
            if st is None:
                st = self._stacks[f] = array("q")
            st.extend(range(off + take - f, off, -f))  # popped in address order
            self._slot_free += take - f
        return off

    def _slow(self, f: int) -> Location:
        """``f <= free_bytes`` but neither the class nor one extent holds it."""
        # one free slot of a larger class: still a single copy
        bigger = [s for s, st in self._stacks.items() if s > f and st]
        if bigger:
            s = min(bigger)
            off = self._stacks[s].pop()
            self._slot_free -= s
            self._ext.free(((off + f, s - f),))
            return off
        # gather: extents first (largest first), then free slots of any class
        got = self._ext.take_largest(f)
        need = f - sum(n for _, n in got)
        for s in sorted(self._stacks, reverse=True):
            st = self._stacks[s]
            while need and st:
                off = st.pop()
                self._slot_free -= s
                take = min(s, need)
                if take < s:
                    self._ext.free(((off + take, s - take),))
                got.append((off, take))
                need -= take
            if not need:
                break
        if need:  # cannot happen while the accounting is exact
            raise RuntimeError(f"slab allocator lost track of {need} bytes")
        got.sort()
        merged: list[tuple[int, int]] = []
        for off, n in got:  # neighbouring pieces (slots of one run) become one
            if merged and merged[-1][0] + merged[-1][1] == off:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((off, n))
        if len(merged) == 1:
            return merged[0][0]
        return tuple(merged)

    def stats(self) -> dict[str, int]:
        return {"free_extents": len(self._ext), "slot_classes": len(self._stacks),
                "free_slots": sum(len(st) for st in self._stacks.values())}
