"""Turning callers' tensors into byte parts, and copying between part lists.

An object's bytes are given as *parts*: a list of one-dimensional, contiguous
``torch.uint8`` tensors whose concatenation is the object.  A single tensor is one
part; an engine that keeps one tensor per layer passes one part per layer and
nothing is gathered into a staging copy first.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional, Union

import torch

from .errors import BufferSizeError

Parts = list[torch.Tensor]
Value = Union[torch.Tensor, Sequence[torch.Tensor]]


def _one(v: torch.Tensor) -> Parts:
    return [v]


def as_bytes(t: torch.Tensor, what: str = "tensor") -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (no copy); raises if not contiguous."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_contiguous():
        raise ValueError(f"{what} must be contiguous (shape {tuple(t.shape)}, stride {t.stride()})")
    _check_has_bytes(t, what)
    if t.dtype == torch.uint8 and t.dim() == 1:
        return t
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    return t.reshape(-1).view(torch.uint8)


def _check_has_bytes(t: torch.Tensor, what: str) -> None:
    """Refuse a tensor whose bytes live nowhere: a ``meta`` tensor, or one (a fake tensor) with no storage."""
    if t.is_meta:
        raise ValueError(f"{what} is a 'meta' tensor: it holds no bytes to store or to fill")
    if type(t) is not torch.Tensor:
        try:
            from torch._subclasses.fake_tensor import FakeTensor
        except ImportError:  # (a torch without fake tensors)
            return
        if isinstance(t, FakeTensor):
            raise ValueError(f"{what} is a fake tensor: it holds no bytes to store or to fill")


def to_parts(value: Value, what: str = "value") -> tuple[Parts, int]:
    """Normalise a tensor or a sequence of tensors to (parts, total nbytes)."""
    if (type(value) is torch.Tensor and value.dtype is torch.uint8 and value.dim() == 1 and value.is_contiguous()
            and not value.is_meta):
        return [value], value.numel()  # the common case, without the general checks
    if isinstance(value, torch.Tensor):
        p = as_bytes(value, what)
        return [p], p.numel()
    if isinstance(value, (list, tuple)) and value:
        parts = [as_bytes(v, f"{what} part {i}") for i, v in enumerate(value)]
        return parts, sum(p.numel() for p in parts)
    raise TypeError(f"{what} must be a torch.Tensor or a non-empty list of tensors, got {type(value).__name__}")


class HostViews(list):
    """Flat ``uint8`` views cut from one contiguous host tensor, listed with their addresses and sizes.

    Made by :meth:`over` (which checks the tensor once) and filled by :meth:`add` / :meth:`add_rows`
    (which check each span's bounds); ``to_parts_ptrs`` then takes the views without checking each
    again: per view, those checks cost more than the store's own work on a small chunk.
    Invariant: ``ptrs[i] == self[i].data_ptr()`` and ``sizes[i] == self[i].numel()`` for every ``i``.
    Change the list only through its methods (one changed otherwise is checked at its ends and
    lengths, not view by view).
    """

    __slots__ = ("_base", "_flat", "_size", "ptrs", "sizes")
    _flat: Optional[torch.Tensor]
    _base: int
    _size: int
    ptrs: list[int]
    sizes: list[int]

    @classmethod
    def over(cls, flat: torch.Tensor) -> "HostViews":
        """No views yet, to be cut from ``flat`` (a flat, contiguous ``uint8`` tensor in host memory)."""
        if not (type(flat) is torch.Tensor and flat.dtype is torch.uint8 and flat.dim() == 1
                and flat.is_contiguous() and flat.is_cpu):
            raise ValueError("HostViews are cut from a flat, contiguous uint8 host tensor")
        out = cls()
        out._flat, out._base, out._size = flat, flat.data_ptr(), flat.numel()
        out.ptrs, out.sizes = [], []
        return out

    @classmethod
    def join(cls, lists: Sequence["HostViews"]) -> "HostViews":
        """The views of ``lists`` one after another (cut from different tensors: nothing more can be added)."""
        out = cls()
        out._flat, out._base, out._size = None, 0, -1
        out.ptrs, out.sizes = [], []
        for v in lists:
            if type(v) is not HostViews:
                raise TypeError(f"HostViews.join takes HostViews, got {type(v).__name__}")
            out.extend(v)
            out.ptrs.extend(v.ptrs)
            out.sizes.extend(v.sizes)
        return out

    def add(self, start: int, n: int) -> None:
        """One view: bytes ``[start, start + n)`` of the tensor."""
        if self._flat is None:
            raise TypeError("joined HostViews take no more views")
        if start < 0 or n < 0 or start + n > self._size:
            raise ValueError(f"span ({start}, {n}) reaches outside a tensor of {self._size} bytes")
        view = self._flat[start:start + n]
        self.append(view)
        self.ptrs.append(self._base + start if n else view.data_ptr())  # (torch may give an empty view none)
        self.sizes.append(n)

    def add_rows(self, start: int, count: int, n: int) -> None:
        """``count`` views of ``n`` bytes each, back to back from byte ``start`` (one unbind)."""
        if self._flat is None:
            raise TypeError("joined HostViews take no more views")
        if start < 0 or count < 0 or n <= 0 or start + count * n > self._size:
            raise ValueError(f"{count} rows of {n} bytes from {start} reach outside a tensor of {self._size} bytes")
        self.extend(self._flat[start:start + count * n].view(count, n).unbind(0))
        at = self._base + start
        self.ptrs.extend(range(at, at + count * n, n))
        self.sizes.extend([n] * count)


def to_parts_ptrs(values: Sequence[Value], what: str) -> tuple[list[tuple[Parts, int]], Optional[list[int]]]:
    """``to_parts`` of each value (errors name ``what[i]``), and the host address of each value when every
    one is a flat, contiguous ``uint8`` tensor in host memory (else None): what a located host tier can copy
    by address alone.

    ``HostViews`` are taken on trust (their maker checked them), unless their lengths disagree."""
    if type(values) is HostViews:
        at: Optional[list[int]] = getattr(values, "ptrs", None)
        ns: Optional[list[int]] = getattr(values, "sizes", None)
        if (at is not None and ns is not None and len(at) == len(values) == len(ns)
                and (not at or (values[0].data_ptr() == at[0] and values[-1].data_ptr() == at[-1]))):
            return list(zip(map(_one, values), ns)), list(at)
    out: list[tuple[Parts, int]] = []
    append = out.append
    ptrs: Optional[list[int]] = []
    tensor, u8 = torch.Tensor, torch.uint8
    for i, v in enumerate(values):
        if type(v) is tensor and v.dtype is u8 and v.dim() == 1 and v.is_contiguous():
            append(([v], v.numel()))
            if ptrs is not None and v.is_cpu:
                ptrs.append(v.data_ptr())
            else:  # (a device tensor: no host address; and never one without bytes)
                ptrs = None
                if v.is_meta:
                    _check_has_bytes(v, f"{what}[{i}]")
        else:
            append(to_parts(v, f"{what}[{i}]"))
            ptrs = None
    return out, ptrs


def check_size(key: str, parts_n: int, stored_n: int) -> None:
    if parts_n != stored_n:
        raise BufferSizeError(f"buffer for key {key[:16]}… holds {parts_n} bytes but the stored chunk has {stored_n}")


def coalesce(parts: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
    """The same bytes in fewer parts: neighbours that are adjacent in one storage become one view.

    Engines often hand over consecutive blocks of one cache tensor as separate
    parts; one large copy moves them faster (and on more threads) than many
    small ones.  Parts are one-dimensional uint8 views, as ``to_parts`` makes them.
    """
    n = len(parts)
    if n < 2:
        return parts
    out: list[torch.Tensor] = []
    i = 0
    while i < n:
        head = parts[i]
        end = head.data_ptr() + head.numel()
        j = i + 1
        while j < n and parts[j].data_ptr() == end and parts[j].numel():
            end += parts[j].numel()
            j += 1
        if j - i == 1:
            out.append(head)
        else:
            size = end - head.data_ptr()
            storage = head.untyped_storage()
            # adjacent addresses in another allocation are not ours to span
            if (head.storage_offset() + size <= storage.nbytes()
                    and all(p.untyped_storage().data_ptr() == storage.data_ptr() for p in parts[i + 1:j])):
                out.append(head.as_strided((size,), (1,), head.storage_offset()))
            else:
                out.extend(parts[i:j])
        i = j
    return out


# libc memmove through ctypes: a foreign call, so the GIL is released while it runs
_memmove = ctypes.memmove


def host_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for tensors of equal byte size; one ``memmove`` when both are contiguous host memory.

    Inside a vLLM CPU engine process torch's copy kernel moves host bytes slower
    than ``memmove`` (docs/benchmarks.md), and it holds the GIL while it runs;
    ``memmove`` through ctypes releases it.
    On a thread other than the engine's, a parallel torch op also starts an
    OpenMP team for that thread, whose workers then spin on the engine's cores.
    Anything else (a device tensor, a strided view, a dtype conversion) goes
    through ``copy_``.
    """
    n = dst.numel() * dst.element_size()
    if (dst.device.type == "cpu" and src.device.type == "cpu" and dst.is_contiguous() and src.is_contiguous()
            and n == src.numel() * src.element_size() and dst.dtype == src.dtype):
        if n:
            _memmove(dst.data_ptr(), src.data_ptr(), n)
        return
    dst.copy_(src)


def copy_parts(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    """Copy the concatenation of ``src`` into the concatenation of ``dst`` (same total)."""
    dst, src = coalesce(dst), coalesce(src)
    if len(dst) == 1 and len(src) == 1:
        host_copy(dst[0], src[0])
        return
    di = si = doff = soff = 0
    while di < len(dst) and si < len(src):
        d, s = dst[di], src[si]
        dn, sn = d.numel(), s.numel()
        n = min(dn - doff, sn - soff)
        if n:
            if n == dn and n == sn:  # part for part: no slicing
                host_copy(d, s)
            else:
                host_copy(d[doff:doff + n], s[soff:soff + n])
        doff += n
        soff += n
        if doff == dn:
            di, doff = di + 1, 0
        if soff == sn:
            si, soff = si + 1, 0


#: below this many bytes a batch of copies runs on the calling thread alone
PARALLEL_COPY_MIN = 8 << 20

_helper: ThreadPoolExecutor | None = None
_helper_lock = threading.Lock()


def _copy_helper() -> ThreadPoolExecutor:
    global _helper
    with _helper_lock:
        if _helper is None:
            _helper = ThreadPoolExecutor(1, thread_name_prefix="tierkv-copy")
        return _helper


def share_work(body: Callable[[int], None], n: int, pool: ThreadPoolExecutor, helpers: int) -> None:
    """``body(i)`` for every ``i < n``, on the calling thread and up to ``helpers`` threads of ``pool``.

    Each thread takes the next index until none is left (``body`` must release the
    GIL to run in parallel), so the work ends when it is done even when one thread
    gets less of the CPU than another, and a pool thread still busy with someone
    else's work is not waited for: the caller takes its share.
    """
    nxt = itertools.count()  # next() on it is atomic under the GIL

    def work() -> None:
        while True:
            i = next(nxt)
            if i >= n:
                return
            body(i)

    futures = [pool.submit(work) for _ in range(max(0, min(helpers, n - 1)))]
    try:
        work()
    finally:
        for f in futures:  # one that never started has nothing left to do
            if not f.cancel():
                f.result()


def on_two_threads(run_one: Callable[[Any], None], jobs: Sequence, sizes: Sequence[int]) -> None:
    """``run_one(job)`` for every job; a batch of ``PARALLEL_COPY_MIN`` bytes or more on the caller
    and the helper thread (see ``share_work``)."""
    if len(jobs) < 2 or sum(sizes) < PARALLEL_COPY_MIN:
        for job in jobs:
            run_one(job)
        return
    share_work(lambda i: run_one(jobs[i]), len(jobs), _copy_helper(), 1)


def _copy_job(job: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]) -> None:
    copy_parts(*job)


def copy_many(jobs: Sequence[tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]]) -> None:
    """``copy_parts(dst, src)`` for every (dst, src) pair; a large batch of host copies on two threads.

    One thread does not saturate memory bandwidth: a batch of at least
    ``PARALLEL_COPY_MIN`` bytes of host memory is shared between the caller and a
    helper thread (``memmove`` releases the GIL), each taking the next pair until
    none is left.  Returns when every copy is done; the destinations must not
    overlap one another.
    """
    if any(p.device.type != "cpu" for dst, src in jobs for p in (*dst, *src)):
        for job in jobs:
            _copy_job(job)
        return
    on_two_threads(_copy_job, jobs, [sum(p.numel() * p.element_size() for p in dst) for dst, _ in jobs])


def _move(move: tuple[int, int, int]) -> None:
    _memmove(*move)


def memmove_many(moves: Sequence[tuple[int, int, int]]) -> None:
    """``memmove(dst, src, n)`` for every (dst, src, n) of host addresses, on two threads when large.

    For memory that is not a tensor (another library's buffers); the caller
    guarantees every range is valid for the whole call and that destinations do
    not overlap one another.
    """
    on_two_threads(_move, moves, [n for _, _, n in moves])


def staging(nbytes: int, pin: bool = False) -> torch.Tensor:
    """A host buffer for moving a chunk between tiers."""
    t = torch.empty(nbytes, dtype=torch.uint8)
    if pin:
        try:
            t = t.pin_memory()
        except RuntimeError:  # no accelerator runtime: pinning is impossible and unnecessary
            pass
    return t
