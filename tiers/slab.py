"""A preallocated byte slab: the body of the HBM and DRAM tiers.

The slab is allocated once; the hot path allocates no tensors and keeps no
per-object views.  Space is managed by ``SlabAllocator`` (``slab_alloc.py``):
slot classes for small objects, extents for large ones, and a gathering path, so
any set of objects whose ``footprint`` sum fits in ``capacity_bytes`` can be
stored (no fragmentation failure).  ``footprint(n)`` is ``align_up(n, ALIGN)``.

A slab is a *located* tier (``tiers/base.py``): each object is one location
*code*, an ``int``.  For the common case (one contiguous range, fewer than
``NB_FIELD`` bytes) the code is ``(offset // ALIGN) << CODE_SHIFT | nbytes << 1 |
1``; any other object's code names an entry of a small side table (``_odd``:
handle -> (nbytes, allocator location)).  Under a level, the level's index holds
the codes and the slab keeps nothing per object; used alone, the slab keeps its
own key -> code dict.  Host copies are ``memmove`` calls on raw addresses
(``memmove_many``: two threads for a large batch); a device slab, or a caller's
device buffer, goes through ``copy_many`` on views cut for that call.

Every located call checks its codes (positive, odd, naming a place inside the slab or a live entry of
``_odd``; ``ValueError`` otherwise), so no bad code copies outside the slab; the one exception is the
vouched path (``write_at`` / ``read_at`` with ``ptrs``), whose caller vouches for its codes as for its
buffers.  A freed slot-class code cannot be told from a live one (nothing is kept per object).

An object is readable only once all its bytes are in place (written outside the
lock, committed under it, by the level or by ``_write``).  The slab tensor is
held by a local reference for the whole of a copy, so ``close`` cannot free
memory a copy is using.
"""

from __future__ import annotations

import operator
from array import array
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch

from tierkv.buffers import PARALLEL_COPY_MIN, _memmove, copy_many, memmove_many
from tierkv.checksum import ReadSums
from tierkv.errors import ConfigError
from tierkv.hostmem import advise_huge, unregister
from tierkv.location_code import CODE_SHIFT, NB_FIELD
from tierkv.xxh3 import copy_and_sum

from .base import Parts, Tier
from .slab_alloc import ALIGN, ExtentAllocator, Location, SlabAllocator, align_up

__all__ = ["ALIGN", "ExtentAllocator", "SlabAllocator", "SlabTier", "align_up"]

_ALIGN_BITS = ALIGN.bit_length() - 1
_ALIGN_MASK = -ALIGN
_ODD = NB_FIELD << 1 | 1  # the low bits of an odd object's code
_INT = {int}


def _run_moves(moves: list[tuple[int, int, int]], total: int) -> None:
    """The memmoves of a batch: on this thread when small, else shared with the copy helper."""
    if total < PARALLEL_COPY_MIN:
        for move in moves:
            _memmove(*move)
    else:
        memmove_many(moves)


def _host_moves(moves: list, base: int, pieces: Sequence[tuple[int, int]], parts: Parts, into_slab: bool) -> None:
    """Append the (dst, src, n) memmoves between ``parts`` and slab ``pieces`` (which may hold slack at the end)."""
    pi = poff = 0
    for p in parts:
        ptr, left = p.data_ptr(), p.numel()
        while left:
            off, n = pieces[pi]
            take = min(n - poff, left)
            a = base + off + poff
            moves.append((a, ptr, take) if into_slab else (ptr, a, take))
            ptr += take
            left -= take
            poff += take
            if poff == n:
                pi, poff = pi + 1, 0


def _views(slab: torch.Tensor, pieces: Sequence[tuple[int, int]], nbytes: int) -> list[torch.Tensor]:
    out, left = [], nbytes
    for off, n in pieces:
        take = min(n, left)
        if take:
            out.append(slab[off:off + take])
        left -= take
    return out


def _check_sizes(name: str, sizes: Sequence[int]) -> Sequence[int]:
    """``sizes`` as ``allocate`` takes them (ints >= 0); TypeError / ValueError naming the first bad one."""
    if isinstance(sizes, (str, bytes, torch.Tensor)) or not isinstance(sizes, Sequence):
        raise TypeError(f"tier {name!r}: sizes must be a sequence of ints (a list), got {type(sizes).__name__}")
    if not sizes:
        return sizes
    if set(map(type, sizes)) != _INT:  # (one C pass for the common case)
        for n in sizes:  # any integer type (numpy's too), but not a bool
            if isinstance(n, bool) or not hasattr(type(n), "__index__"):
                raise TypeError(f"tier {name!r}: sizes must be ints, got {n!r} ({type(n).__name__})")
        sizes = [operator.index(n) for n in sizes]
    if min(sizes) < 0:
        raise ValueError(f"tier {name!r}: sizes must be >= 0, got {min(sizes)}")
    return sizes


def _on_host(parts: Parts) -> bool:
    return all(p.is_cpu and p.is_contiguous() for p in parts)


class SlabTier(Tier):
    """Objects in one preallocated tensor on ``device``; copies only, no allocation per chunk."""

    located = True

    def __init__(self, name: str, capacity_bytes: int, device: str = "cpu", pin_memory: bool = False,
                 prefault: bool = True) -> None:
        super().__init__(name, capacity_bytes)
        self.device = torch.device(device)
        if self.device.type == "meta":
            raise ConfigError(f"tier {name!r}: device 'meta' holds no bytes; give a device with memory "
                              "('cpu', 'cuda', 'npu')")
        try:
            slab = torch.empty(capacity_bytes, dtype=torch.uint8, device=self.device)
        except RuntimeError as e:
            raise ConfigError(f"tier {name!r}: cannot allocate {capacity_bytes} bytes on {device}: {e}") from e
        pinned = False
        if pin_memory and self.device.type == "cpu":
            try:
                slab = slab.pin_memory()
                pinned = True
            except RuntimeError:  # no accelerator runtime: pinning is impossible and unneeded
                pass
        # a host slab's whole 2 MiB pages as huge pages, before their first touch: a persistent tier below
        # writes chunks to its device from there, without a staging copy (``tierkv.hostmem``)
        self._huge = advise_huge(slab.data_ptr(), capacity_bytes) \
            if self.device.type == "cpu" and not pinned and capacity_bytes else None
        if prefault and self.device.type == "cpu":
            # commit the pages now: a first-touch page fault on the hot path costs far more than a copy
            slab.zero_()
        self.slab = slab
        self._host = self.device.type == "cpu"
        self._alloc = SlabAllocator(capacity_bytes)
        self._objects: dict[str, int] = {}  # key -> code, while no level is attached
        self._odd: dict[int, tuple[int, Location]] = {}  # handle -> (nbytes, location) of the other objects
        self._next_odd = 0
        self._resolve: Optional[Callable[[list[str]], list[Optional[int]]]] = None
        self._used = 0
        self._count = 0

    def footprint(self, nbytes: int) -> int:
        return (nbytes + ALIGN - 1) & _ALIGN_MASK

    # -- codes -----------------------------------------------------------------
    def _odd_code(self, nbytes: int, loc: Location) -> int:
        h = self._next_odd
        self._next_odd += 1
        self._odd[h] = (nbytes, loc)
        return h << CODE_SHIFT | _ODD

    def _where(self, code: int) -> tuple[int, Location]:
        """(nbytes, allocator location) of a code; ValueError for one this slab cannot have given out."""
        if type(code) is not int or code <= 0 or not code & 1:
            raise self._not_a_code(code)
        f = code >> 1 & NB_FIELD
        if f != NB_FIELD:
            off = (code >> CODE_SHIFT) << _ALIGN_BITS
            if off + f > self.capacity_bytes:
                raise self._not_a_code(code)
            return f, off
        got = self._odd.get(code >> CODE_SHIFT)
        if got is None:
            raise self._not_a_code(code)
        return got

    def _not_a_code(self, code: object) -> ValueError:
        return ValueError(f"tier {self.name!r}: {code!r} is not a live code of this tier (codes come from allocate, "
                          "and a freed one is gone)")

    def code_nbytes(self, code: int) -> int:
        return self._where(code)[0]

    # -- located API (tiers/base.py) ------------------------------------------------
    def attach(self, resolve: Callable[[list[str]], list[Optional[int]]]) -> None:
        with self._lock:
            if self._objects:
                raise RuntimeError(f"tier {self.name!r} already holds objects of its own: attach it empty")
            self._resolve = resolve

    def allocate(self, sizes: Sequence[int]) -> list[Optional[int]]:
        self._check_open()
        sizes = _check_sizes(self.name, sizes)
        out: list[Optional[int]] = []
        append = out.append
        alloc = self._alloc
        allocate, stacks, slot_max = alloc.allocate, alloc._stacks, alloc.slot_max
        with self._lock:
            if len(sizes) > 8:
                fast = self._allocate_slots(sizes)
                if fast is not None:
                    return fast
            used = count = 0
            try:
                for nbytes in sizes:
                    f = (nbytes + ALIGN - 1) & _ALIGN_MASK
                    st = stacks.get(f) if f <= slot_max else None
                    if st:  # the common case inline: a free slot of its class
                        # (taken off the free bytes now: a later size of this batch that goes to the allocator
                        # must not count this slot as free)
                        alloc._slot_free -= f
                        loc: Optional[Location] = st.pop()
                    else:
                        loc = allocate(f)
                        if loc is None:
                            append(None)
                            continue
                    if type(loc) is int and nbytes < NB_FIELD:
                        append((loc >> _ALIGN_BITS) << CODE_SHIFT | nbytes << 1 | 1)
                    else:
                        append(self._odd_code(nbytes, loc))  # type: ignore[arg-type]
                    used += nbytes
                    count += 1
            finally:
                self._used += used
                self._count += count
        return out

    def _allocate_slots(self, sizes: Sequence[int]) -> Optional[list[Optional[int]]]:
        """``allocate`` when every size has a free slot of its class waiting (the common case), in C
        loops; None (nothing taken) otherwise.  The caller holds the lock."""
        alloc = self._alloc
        stacks = alloc._stacks
        fs = [(nbytes + ALIGN - 1) & _ALIGN_MASK for nbytes in sizes]
        if max(fs) > alloc.slot_max or max(sizes) >= NB_FIELD:
            return None
        for f, k in Counter(fs).items():
            st = stacks.get(f)
            if st is None or len(st) < k:
                return None
        locs = [stacks[f].pop() for f in fs]
        taken = sum(fs)
        alloc._slot_free -= taken
        self._used += sum(sizes)
        self._count += len(fs)
        return [(loc >> _ALIGN_BITS) << CODE_SHIFT | nbytes << 1 | 1 for loc, nbytes in zip(locs, sizes)]

    def free_at(self, codes: Sequence[int]) -> None:
        alloc, odd = self._alloc, self._odd
        with self._lock:
            if self._closed:  # its space went with the slab
                return
            stacks, slot_max = alloc._stacks, alloc.slot_max
            nbs = [code >> 1 & NB_FIELD for code in codes]
            if nbs and max(nbs) < NB_FIELD and min(nbs) > 0 and min(codes) > 0 \
                    and (max(codes) >> CODE_SHIFT) << _ALIGN_BITS < self.capacity_bytes:
                # the common case: slot-class objects back onto their stacks, inline
                fs = [(nb + ALIGN - 1) & _ALIGN_MASK for nb in nbs]
                if max(fs) <= slot_max:
                    for code, f in zip(codes, fs):
                        st = stacks.get(f)
                        if st is None:
                            st = stacks[f] = array("q")
                        st.append((code >> CODE_SHIFT) << _ALIGN_BITS)
                    alloc._slot_free += sum(fs)
                    self._used -= sum(nbs)
                    self._count -= len(nbs)
                    return
            where = [self._where(code) for code in codes]  # (all checked before any is freed)
            for code, (nbytes, loc) in zip(codes, where):
                if code >> 1 & NB_FIELD == NB_FIELD:
                    del odd[code >> CODE_SHIFT]
                alloc.free((nbytes + ALIGN - 1) & _ALIGN_MASK, loc)
                self._used -= nbytes
                self._count -= 1

    def write_at(self, codes: Sequence[int], srcs: Sequence[Parts], ptrs: Optional[Sequence[int]] = None) -> None:
        self._check_open()
        if ptrs is not None and self._host:
            self._move_ptrs(codes, srcs, ptrs, True)
        else:
            self._move(codes, srcs, True)

    def read_at(self, codes: Sequence[int], dsts: Sequence[Parts], ptrs: Optional[Sequence[int]] = None,
                sums: Optional[ReadSums] = None) -> list[bool]:
        self._check_open()
        if ptrs is not None and self._host:
            if sums is not None and self.sums_copies:
                return self._read_summed_ptrs(codes, dsts, ptrs, sums)
            return self._move_ptrs(codes, dsts, ptrs, False)
        return self._move(codes, dsts, False)

    def _read_summed_ptrs(self, codes: Sequence[int], dsts: Sequence[Parts], ptrs: Sequence[int],
                          sums: ReadSums) -> list[bool]:
        """``read_at``'s vouched path with each object summed as it is copied (``copy_and_sum``), when every
        object's size is in its code (the common case); otherwise a plain copy, the sums left unanswered."""
        n = len(codes)
        sizes = [code >> 1 & NB_FIELD for code in codes]
        if NB_FIELD in sizes or len(dsts) != n or len(ptrs) != n or len(sums.nbytes) != n:
            return self._move_ptrs(codes, dsts, ptrs, False)
        slab = self.slab  # held for the whole call (see the module docstring)
        base = slab.data_ptr()
        jobs = [[(ptr, base + ((code >> CODE_SHIFT) << _ALIGN_BITS), nb)] for code, ptr, nb in zip(codes, ptrs, sizes)]
        sums.sums[:] = copy_and_sum(jobs, sums.nbytes)
        return [True] * n

    def _read_summed(self, keys: Sequence[str], dsts: Sequence[Parts], sums: ReadSums) -> list[bool]:
        return self._read(keys, dsts)  # (by key: a plain copy, the sums left unanswered)

    def _move_ptrs(self, codes: Sequence[int], bufs: Sequence[Parts], ptrs: Sequence[int],
                   into_slab: bool) -> list[bool]:
        """``_move`` for buffers the caller vouched for (``write_at``): host addresses, exact sizes, live codes."""
        n = len(codes)
        if len(bufs) != n or len(ptrs) != n:
            raise ValueError(f"tier {self.name!r}: {n} codes but {len(bufs)} buffer lists and {len(ptrs)} addresses")
        slab = self.slab  # held for the whole call (see the module docstring)
        base = slab.data_ptr()
        sizes = [code >> 1 & NB_FIELD for code in codes]
        if n and NB_FIELD not in sizes:
            # the common case in C loops: every object in the code itself
            addrs = [base + ((code >> CODE_SHIFT) << _ALIGN_BITS) for code in codes]
            total = sum(sizes)
            if total < PARALLEL_COPY_MIN:
                if into_slab:
                    list(map(_memmove, addrs, ptrs, sizes))
                else:
                    list(map(_memmove, ptrs, addrs, sizes))
            else:
                memmove_many(list(zip(addrs, ptrs, sizes)) if into_slab else list(zip(ptrs, addrs, sizes)))
            return [True] * n
        moves: list[tuple[int, int, int]] = []
        append = moves.append
        other: list[int] = []  # codes of the side table (large or gathered objects): the general path
        total = 0
        for i, code in enumerate(codes):
            f = code >> 1 & NB_FIELD
            if f == NB_FIELD:
                other.append(i)
            elif f:
                a = base + ((code >> CODE_SHIFT) << _ALIGN_BITS)
                append((a, ptrs[i], f) if into_slab else (ptrs[i], a, f))
                total += f
        _run_moves(moves, total)
        if other:
            res = self._move([codes[i] for i in other], [bufs[i] for i in other], into_slab)
            if False in res:
                out = [True] * n
                for i, ok in zip(other, res):
                    out[i] = ok
                return out
        return [True] * n

    def _move(self, codes: Sequence[int], bufs: Sequence[Parts], into_slab: bool) -> list[bool]:
        """Copy between each object's slab range and ``bufs[i]``; False where the sizes differ (a read),
        ``ValueError`` for a write."""
        if len(codes) != len(bufs):
            raise ValueError(f"tier {self.name!r}: {len(codes)} codes but {len(bufs)} buffer lists")
        slab = self.slab  # held for the whole call (see the module docstring)
        base, host = slab.data_ptr(), self._host
        out = [True] * len(codes)
        moves: list[tuple[int, int, int]] = []  # the common case, planned here: one part, one range, host
        other: list[tuple[int, int, Location]] = []  # the rest, copied by ``_copy``
        total = 0
        append = moves.append
        cap = self.capacity_bytes
        for i, code in enumerate(codes):
            parts = bufs[i]
            if host and len(parts) == 1:  # the common case first: one host part, a contiguous object
                p = parts[0]
                nbytes = p.numel()
                if nbytes < NB_FIELD and (code >> 1 & NB_FIELD) == nbytes and p.is_cpu and p.is_contiguous():
                    off = (code >> CODE_SHIFT) << _ALIGN_BITS
                    if code <= 0 or not code & 1 or off + nbytes > cap:  # never a copy outside the slab
                        raise self._not_a_code(code)
                    if nbytes:
                        a = base + off
                        append((a, p.data_ptr(), nbytes) if into_slab else (p.data_ptr(), a, nbytes))
                        total += nbytes
                    continue
            one = len(parts) == 1
            nbytes = parts[0].numel() if one else sum(p.numel() for p in parts)
            want, loc = self._where(code)
            if nbytes != want:
                if into_slab:
                    raise ValueError(f"tier {self.name!r}: {nbytes} bytes given for an object of {want}")
                out[i] = False
                continue
            if one and host and type(loc) is int:
                p = parts[0]
                if p.is_cpu and p.is_contiguous():
                    if nbytes:
                        a = base + loc  # type: ignore[operator]
                        append((a, p.data_ptr(), nbytes) if into_slab else (p.data_ptr(), a, nbytes))
                        total += nbytes
                    continue
            other.append((i, nbytes, loc))
        _run_moves(moves, total)
        if other:
            self._copy(slab, other, bufs, into_slab)
        return out

    def _copy(self, slab: torch.Tensor, placed: list[tuple[int, int, Location]], bufs: Sequence[Parts],
              into_slab: bool) -> None:
        """Move bytes between ``bufs[i]`` and each placed object's slab range (any parts, any devices)."""
        moves: list[tuple[int, int, int]] = []
        jobs = []
        base = slab.data_ptr()
        for i, nbytes, loc in placed:
            parts = bufs[i]
            pieces = SlabAllocator.pieces((nbytes + ALIGN - 1) & _ALIGN_MASK, loc)
            if self._host and _on_host(parts):
                _host_moves(moves, base, pieces, parts, into_slab)
            else:
                views = _views(slab, pieces, nbytes)
                jobs.append((views, parts) if into_slab else (parts, views))
        if moves:
            memmove_many(moves)
        if jobs:
            copy_many(jobs)

    # -- by key (the slab's own index, while no level is attached) --------------------
    def _refuse_by_key(self, op: str) -> None:
        if self._resolve is not None:
            raise RuntimeError(f"tier {self.name!r} is placed by its level: {op} by key is not allowed")

    def _write(self, keys: Sequence[str], srcs: Sequence[Parts]) -> list[bool]:
        self._check_open()
        self._refuse_by_key("write")
        n = len(keys)
        # a key given twice keeps its last value
        last = {key: i for i, key in enumerate(keys)} if n > 1 and len(set(keys)) < n else None
        at = [i for i in range(n) if last is None or last[keys[i]] == i]
        sizes = [sum(p.numel() for p in srcs[i]) for i in at]
        codes = self.allocate(sizes)
        placed = [(i, c) for i, c in zip(at, codes) if c is not None]
        try:
            self._move([c for _, c in placed], [srcs[i] for i, _ in placed], True)
        except BaseException:
            self.free_at([c for _, c in placed])
            raise
        with self._lock:  # visible only once every byte is in place
            objects, old = self._objects, []
            for i, c in placed:
                v = objects.get(keys[i])
                if v is not None:
                    old.append(v)
                objects[keys[i]] = c
        if old:
            self.free_at(old)
        out = [False] * n
        for i, _ in placed:
            out[i] = True
        if last is not None:
            for i, key in enumerate(keys):
                if last[key] != i:
                    out[i] = out[last[key]]  # superseded by a later value in this same call
        return out

    def _codes(self, keys: list[str]) -> list[Optional[int]]:
        if self._resolve is not None:
            return self._resolve(keys)
        get = self._objects.get
        return [get(k) for k in keys]

    def _read(self, keys: Sequence[str], dsts: Sequence[Parts]) -> list[bool]:
        self._check_open()
        codes = self._codes(list(keys))
        have = [i for i, c in enumerate(codes) if c is not None]
        out = [False] * len(keys)
        got = self._move([codes[i] for i in have], [dsts[i] for i in have], False)  # type: ignore[misc]
        for i, ok in zip(have, got):
            out[i] = ok
        return out

    def _delete(self, keys: Sequence[str]) -> None:
        self._refuse_by_key("delete")
        with self._lock:
            pop = self._objects.pop
            gone = [c for c in (pop(key, None) for key in keys) if c is not None]
        if gone:
            self.free_at(gone)

    def _contains(self, keys: Sequence[str]) -> list[bool]:
        return [c is not None for c in self._codes(list(keys))]

    @property
    def used_bytes(self) -> int:
        return self._used

    def extra_stats(self) -> dict[str, Any]:
        return {"device": str(self.device), "objects": self._count, **self._alloc.stats()}

    def views_at(self, codes: Sequence[int]) -> Optional[list[Parts]]:
        """Views of each object's bytes in a host slab (its pieces, in order); None for a device slab."""
        if not self._host:
            return None
        slab = self.slab
        out = []
        for code in codes:
            nbytes, loc = self._where(code)
            out.append(_views(slab, SlabAllocator.pieces((nbytes + ALIGN - 1) & _ALIGN_MASK, loc), nbytes))
        return out

    def close(self) -> None:
        super().close()
        with self._lock:
            self._objects.clear()
            self._odd.clear()
            if self._huge is not None:  # (views still held keep the old slab's memory, no longer registered)
                unregister(self._huge[0])
                self._huge = None
            self.slab = torch.empty(0, dtype=torch.uint8)
