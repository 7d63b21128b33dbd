"""A preallocated byte slab with an extent allocator: the body of the HBM and DRAM tiers.

The slab is allocated once; the hot path never allocates tensors.  An object
occupies one or more *extents* (offset, length) of the slab, aligned to
``ALIGN`` bytes.  Allocation prefers a single best-fit extent (one copy per
object) and falls back to gathering several free extents, so it never fails for
fragmentation: any set of objects whose ``footprint`` sum fits in
``capacity_bytes`` can be stored.  Freed extents coalesce with their neighbours.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch
from sortedcontainers import SortedDict, SortedList

from tierkv.buffers import copy_many
from tierkv.errors import ConfigError

from .base import Parts, Tier

ALIGN = 256


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


class ExtentAllocator:
    """Free-space map of a ``size``-byte region; not thread-safe (callers lock)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._by_off: SortedDict = SortedDict({0: size})  # offset -> length
        self._by_len: SortedList = SortedList([(size, 0)])  # (length, offset)
        self.free_bytes = size

    def allocate(self, n: int) -> Optional[list[tuple[int, int]]]:
        """Extents totalling ``n`` (already aligned) bytes, or None if less is free."""
        if n > self.free_bytes:
            return None
        if n == 0:
            return []
        i = self._by_len.bisect_left((n, -1))
        if i < len(self._by_len):  # best fit: smallest extent that holds it all
            length, off = self._by_len[i]
            self._take(off, length, n)
            return [(off, n)]
        out, need = [], n  # no single extent is big enough: gather the largest ones
        while need:
            length, off = self._by_len[-1]
            take = min(length, need)
            self._take(off, length, take)
            out.append((off, take))
            need -= take
        out.sort()
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
        self._alloc = ExtentAllocator(capacity_bytes)
        # key -> (nbytes, extents, views of the slab over those extents: sliced once, reused by reads)
        self._objects: dict[str, tuple[int, list[tuple[int, int]], list[torch.Tensor]]] = {}
        self._used = 0

    def footprint(self, nbytes: int) -> int:
        return align_up(nbytes)

    def _views(self, nbytes: int, extents: list[tuple[int, int]]) -> list[torch.Tensor]:
        views, left = [], nbytes
        for off, n in extents:
            take = min(n, left)
            if take:
                views.append(self.slab[off:off + take])
            left -= take
        return views

    def _write(self, keys: Sequence[str], srcs: Sequence[Parts]) -> list[bool]:
        self._check_open()
        out = [False] * len(keys)
        last = {key: i for i, key in enumerate(keys)}  # a key given twice keeps its last value
        placed: list[tuple[int, int, list[tuple[int, int]], list[torch.Tensor]]] = []
        for i, (key, parts) in enumerate(zip(keys, srcs)):
            if last[key] != i:
                out[i] = True  # superseded by a later value in this same call
                continue
            nbytes = sum(p.numel() for p in parts)
            with self._lock:
                old = self._objects.pop(key, None)
                if old is not None:
                    self._alloc.free(old[1])
                    self._used -= old[0]
                extents = self._alloc.allocate(align_up(nbytes))
            if extents is not None:
                placed.append((i, nbytes, extents, self._views(nbytes, extents)))
        try:
            copy_many([(views, srcs[i]) for i, _, _, views in placed])
        except BaseException:
            with self._lock:
                for _, _, extents, _ in placed:
                    self._alloc.free(extents)
            raise
        with self._lock:  # visible only once every byte is in place
            for i, nbytes, extents, views in placed:
                self._objects[keys[i]] = (nbytes, extents, views)
                self._used += nbytes
                out[i] = True
        return out

    def _read(self, keys: Sequence[str], dsts: Sequence[Parts]) -> list[bool]:
        self._check_open()
        out = [False] * len(keys)
        jobs = []
        for i, (key, parts) in enumerate(zip(keys, dsts)):
            obj = self._objects.get(key)
            if obj is None or obj[0] != sum(p.numel() for p in parts):
                continue
            jobs.append((parts, obj[2]))
            out[i] = True
        copy_many(jobs)
        return out

    def _delete(self, keys: Sequence[str]) -> None:
        with self._lock:
            for key in keys:
                obj = self._objects.pop(key, None)
                if obj is not None:
                    self._alloc.free(obj[1])
                    self._used -= obj[0]

    def _contains(self, keys: Sequence[str]) -> list[bool]:
        return [k in self._objects for k in keys]

    @property
    def used_bytes(self) -> int:
        return self._used

    def extra_stats(self) -> dict[str, Any]:
        return {"device": str(self.device), "objects": len(self._objects), "free_extents": len(self._alloc._by_off)}

    def close(self) -> None:
        super().close()
        with self._lock:
            self._objects.clear()
            self.slab = torch.empty(0, dtype=torch.uint8)

