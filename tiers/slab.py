"""A preallocated byte slab: the body of the HBM and DRAM tiers.

The slab is allocated once; the hot path allocates no tensors and keeps no
per-object views.  Space is managed by ``SlabAllocator`` (``slab_alloc.py``):
slot classes for small objects, extents for large ones, and a gathering path, so
any set of objects whose ``footprint`` sum fits in ``capacity_bytes`` can be
stored (no fragmentation failure).  ``footprint(n)`` is ``align_up(n, ALIGN)``.

Bookkeeping per object is one dict entry, key -> location, where the location is
packed into one ``int`` for the common case (one contiguous range, fewer than
``2**24`` bytes): ``(offset // ALIGN) << 24 | nbytes``; any other object is a tuple
``(nbytes, allocator location)``.  Host copies are ``memmove`` calls on raw
addresses (``memmove_many``: two threads for a large batch); a device slab, or a
caller's device buffer, goes through ``copy_many`` on views cut for that call.

An object is readable only once all its bytes are in place (written outside the
lock, committed under it).  The slab tensor is held by a local reference for the
whole of a copy, so ``close`` cannot free memory a copy is using.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Union, cast

import torch

from tierkv.buffers import PARALLEL_COPY_MIN, _memmove, copy_many, memmove_many
from tierkv.errors import ConfigError

from .base import Parts, Tier
from .slab_alloc import ALIGN, ExtentAllocator, SlabAllocator, align_up

__all__ = ["ALIGN", "ExtentAllocator", "SlabAllocator", "SlabTier", "align_up"]

_SHIFT = 24
_NB_MASK = (1 << _SHIFT) - 1
_ALIGN_BITS = ALIGN.bit_length() - 1
_ALIGN_MASK = -ALIGN

Packed = Union[int, tuple]


def _unpack(v: Packed) -> tuple[int, Any]:
    """(nbytes, allocator location) of a packed entry."""
    if type(v) is int:
        return v & _NB_MASK, (v >> _SHIFT) << _ALIGN_BITS
    return cast("tuple[int, Any]", v)


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


def _on_host(parts: Parts) -> bool:
    return all(p.is_cpu and p.is_contiguous() for p in parts)


class SlabTier(Tier):
    """Objects in one preallocated tensor on ``device``; copies only, no allocation per chunk."""

    def __init__(self, name: str, capacity_bytes: int, device: str = "cpu", pin_memory: bool = False,
                 prefault: bool = True) -> None:
        super().__init__(name, capacity_bytes)
        self.device = torch.device(device)
        try:
            slab = torch.empty(capacity_bytes, dtype=torch.uint8, device=self.device)
        except RuntimeError as e:
            raise ConfigError(f"tier {name!r}: cannot allocate {capacity_bytes} bytes on {device}: {e}") from e
        if pin_memory and self.device.type == "cpu":
            try:
                slab = slab.pin_memory()
            except RuntimeError:  # no accelerator runtime: pinning is impossible and unneeded
                pass
        if prefault and self.device.type == "cpu":
            # commit the pages now: a first-touch page fault on the hot path costs far more than a copy
            slab.zero_()
        self.slab = slab
        self._host = self.device.type == "cpu"
        self._alloc = SlabAllocator(capacity_bytes)
        self._objects: dict[str, Packed] = {}  # key -> packed location (see the module docstring)
        self._used = 0

    def footprint(self, nbytes: int) -> int:
        return (nbytes + ALIGN - 1) & _ALIGN_MASK

    def _release(self, v: Packed) -> int:
        """Free an entry's space (lock held); returns its nbytes."""
        nbytes, loc = _unpack(v)
        self._alloc.free((nbytes + ALIGN - 1) & _ALIGN_MASK, loc)
        self._used -= nbytes
        return nbytes

    def _write(self, keys: Sequence[str], srcs: Sequence[Parts]) -> list[bool]:
        self._check_open()
        n = len(keys)
        out = [False] * n
        # a key given twice keeps its last value
        last = {key: i for i, key in enumerate(keys)} if n > 1 and len(set(keys)) < n else None
        objects, alloc = self._objects, self._alloc
        allocate, stacks, slot_max = alloc.allocate, alloc._stacks, alloc.slot_max
        slab = self.slab  # held for the whole call (see the module docstring)
        base, host = slab.data_ptr(), self._host
        # what was placed, as parallel lists: index into keys, nbytes, packed location
        at: list[int] = []
        sizes: list[int] = []
        locs: list[Packed] = []
        moves: list[tuple[int, int, int]] = []  # the common case, planned here: one part, one range, host
        other: list[tuple[int, int, Packed]] = []  # the rest, copied by ``_copy``
        total = 0
        v: Packed
        with self._lock:
            fresh = objects.keys().isdisjoint(keys)  # (one C pass: then no old value to release)
            slot_taken = 0
            try:
                for i, key in enumerate(keys):
                    if last is not None and last[key] != i:
                        out[i] = True  # superseded by a later value in this same call
                        continue
                    parts = srcs[i]
                    one = len(parts) == 1
                    nbytes = parts[0].numel() if one else sum(p.numel() for p in parts)
                    if not fresh:
                        old = objects.pop(key, None)
                        if old is not None:
                            self._release(old)
                    f = (nbytes + ALIGN - 1) & _ALIGN_MASK
                    st = stacks.get(f) if f <= slot_max else None
                    if st:  # the common case inline: a free slot of its class
                        slot_taken += f
                        loc = st.pop()
                    else:
                        loc = allocate(f)
                        if loc is None:
                            continue
                    if type(loc) is int and nbytes <= _NB_MASK:
                        v = (loc >> _ALIGN_BITS) << _SHIFT | nbytes
                        if one and host:
                            p = parts[0]
                            if p.is_cpu and p.is_contiguous():
                                at.append(i)
                                sizes.append(nbytes)
                                locs.append(v)
                                if nbytes:
                                    moves.append((base + loc, p.data_ptr(), nbytes))
                                    total += nbytes
                                continue
                    else:
                        v = (nbytes, loc)
                    at.append(i)
                    sizes.append(nbytes)
                    locs.append(v)
                    other.append((i, nbytes, v))
            finally:
                alloc._slot_free -= slot_taken
        try:
            _run_moves(moves, total)
            if other:
                self._copy(slab, other, srcs, True)
        except BaseException:
            with self._lock:
                for nbytes, v in zip(sizes, locs):
                    self._alloc.free((nbytes + ALIGN - 1) & _ALIGN_MASK, _unpack(v)[1])
            raise
        with self._lock:  # visible only once every byte is in place
            objects.update(zip(keys if len(at) == n else [keys[i] for i in at], locs))
            self._used += sum(sizes)
        if len(at) == n:
            return [True] * n
        for i in at:
            out[i] = True
        return out

    def _copy(self, slab: torch.Tensor, placed: list[tuple[int, int, Packed]], bufs: Sequence[Parts],
              into_slab: bool) -> None:
        """Move bytes between ``bufs[i]`` and each placed object's slab range (any parts, any devices)."""
        moves: list[tuple[int, int, int]] = []
        jobs = []
        base = slab.data_ptr()
        for i, nbytes, v in placed:
            parts = bufs[i]
            _, loc = _unpack(v)
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

    def _read(self, keys: Sequence[str], dsts: Sequence[Parts]) -> list[bool]:
        self._check_open()
        out = [False] * len(keys)
        objects = self._objects
        slab = self.slab
        base, host = slab.data_ptr(), self._host
        moves: list[tuple[int, int, int]] = []
        other = []
        total = 0
        for i, key in enumerate(keys):
            v = objects.get(key)
            if v is None:
                continue
            parts = dsts[i]
            one = len(parts) == 1
            nbytes = parts[0].numel() if one else sum(p.numel() for p in parts)
            if type(v) is int:
                if nbytes != v & _NB_MASK:
                    continue
                out[i] = True
                if one and host:
                    p = parts[0]
                    if p.is_cpu and p.is_contiguous():
                        if nbytes:
                            moves.append((p.data_ptr(), base + ((v >> _SHIFT) << _ALIGN_BITS), nbytes))
                            total += nbytes
                        continue
            elif nbytes != cast("tuple[int, Any]", v)[0]:
                continue
            out[i] = True
            other.append((i, nbytes, v))
        _run_moves(moves, total)
        if other:
            self._copy(slab, other, dsts, False)
        return out

    def _delete(self, keys: Sequence[str]) -> None:
        with self._lock:
            pop = self._objects.pop
            for key in keys:
                v = pop(key, None)
                if v is not None:
                    self._release(v)

    def _contains(self, keys: Sequence[str]) -> list[bool]:
        objects = self._objects
        return [k in objects for k in keys]

    @property
    def used_bytes(self) -> int:
        return self._used

    def extra_stats(self) -> dict[str, Any]:
        return {"device": str(self.device), "objects": len(self._objects), **self._alloc.stats()}

    def close(self) -> None:
        super().close()
        with self._lock:
            self._objects.clear()
            self.slab = torch.empty(0, dtype=torch.uint8)
