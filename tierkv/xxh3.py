"""xxh3-64 over host memory outside the interpreter lock, and a copy that sums the bytes it moves.

The ``xxhash`` package's extension module exports xxHash's C functions (the one-shot
``XXH3_64bits`` and the streaming ``XXH3_createState`` / ``_reset`` / ``_update`` /
``_digest``, with ``_dispatch`` variants that pick AVX2 or AVX-512 at run time).
Called through ``ctypes`` they release the interpreter lock for the whole call, which
the package's own Python functions do not, so two threads hash at once, and a copy
can hash each piece right after moving it, while the piece is still in the core's
cache.  Where the build exports no such functions every call here falls back to the
package's Python functions: the same values, holding the lock.  The values are
always ``xxhash.xxh3_64_intdigest`` of the same bytes (seed 0); ``tests/test_xxh3.py``
checks the two ways agree.

A copy that sums (``copy_and_sum``) runs in C when tierkv's C helper was built at
install (``tierkv/_copysum.c``, an optional extension loaded with ``ctypes``): it copies
and hashes in ``FUSED_PIECE_BYTES`` pieces without coming back to the interpreter
(``FUSED``), a batch in one call per thread, the threads taking jobs from a shared
counter in C (``FUSED_BATCH``; a build without that function: one call per object).
Without the helper the pieces are copied and hashed by separate calls, each a release
and a retake of the interpreter lock: the same sums, slower.

Addresses are of host memory the caller keeps valid for the whole call.
"""

from __future__ import annotations

import ctypes
import glob
import os
import threading
from collections.abc import Sequence
from typing import Any, Optional

import xxhash

from tierkv.buffers import on_two_threads

#: a copy that sums moves and hashes at most this many bytes at a time, hashed from the core's caches right after
#: their copy.  Smaller pieces stay in a faster cache but cost more calls, each a release and a retake of the
#: interpreter lock: on a 2-core machine with other work running, 512 KiB pieces cost a checked pool read more
#: than 2 MiB ones did (bench/bench_integrity.py)
PIECE_BYTES = 2 << 20

Move = tuple[int, int, int]  # (dst, src, nbytes)


def _load() -> Optional[Any]:
    """xxHash's C functions from the ``xxhash`` extension, typed; None when they are not exported."""
    try:
        import xxhash._xxhash as ext

        lib = ctypes.CDLL(ext.__file__)
    except (ImportError, OSError, AttributeError):
        return None
    vp, sz, u64 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64
    fns: dict[str, Any] = {}
    for name, fallback, args, res in (
            ("XXH3_64bits_dispatch", "XXH3_64bits", [vp, sz], u64),
            ("XXH3_64bits_update_dispatch", "XXH3_64bits_update", [vp, vp, sz], ctypes.c_int),
            ("XXH3_createState", None, [], vp),
            ("XXH3_freeState", None, [vp], ctypes.c_int),
            ("XXH3_64bits_reset", None, [vp], ctypes.c_int),
            ("XXH3_64bits_digest", None, [vp], u64)):
        fn = getattr(lib, name, None) or (getattr(lib, fallback, None) if fallback else None)
        if fn is None:
            return None
        fn.argtypes, fn.restype = args, res
        fns[name] = fn
    return fns


_C = _load()
#: True when hashing here runs outside the interpreter lock (xxHash's C functions were found)
NATIVE = _C is not None

#: the piece a fused copy moves and then hashes: small enough to be hashed from the core's first caches
FUSED_PIECE_BYTES = 64 << 10


def _load_fused() -> tuple[Optional[Any], Optional[Any]]:
    """tierkv's copy-and-sum helper (``tierkv/_copysum.c``): its one-job and its batch function, typed
    (None where it was not built; the batch function None where the build predates it)."""
    if _C is None:
        return None, None
    here = os.path.dirname(os.path.abspath(__file__))
    for path in sorted(glob.glob(os.path.join(here, "_copysum*.so"))):
        try:
            lib = ctypes.CDLL(path)
            fn = lib.tierkv_copy_sum
        except (OSError, AttributeError):
            continue
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        fn.argtypes = [ctypes.POINTER(vp), ctypes.POINTER(vp), ctypes.POINTER(sz), sz, sz, sz, vp, vp, vp, vp]
        fn.restype = ctypes.c_uint64
        jobs = getattr(lib, "tierkv_copy_sum_jobs", None)
        if jobs is not None:
            jobs.argtypes = [vp, vp, vp, vp, sz, vp, vp, vp, sz, vp, vp, vp, vp]
            jobs.restype = None
        return fn, jobs
    return None, None


_FUSED, _FUSED_JOBS = _load_fused()
#: True when a copy that sums runs in one call per object (the C helper was built and xxHash's C functions found)
FUSED = _FUSED is not None
#: True when a batch of copies that sum runs in one call per thread (the C helper's ``tierkv_copy_sum_jobs``)
FUSED_BATCH = _FUSED_JOBS is not None
if _C is not None:
    _FNS = tuple(ctypes.cast(_C[n], ctypes.c_void_p).value
                 for n in ("XXH3_64bits_reset", "XXH3_64bits_update_dispatch", "XXH3_64bits_digest"))
_states = threading.local()  # one streaming state per thread, kept for its life


def _state() -> int:
    s = getattr(_states, "s", None)
    if s is None:
        s = _states.s = _C["XXH3_createState"]()  # type: ignore[index]
        if not s:
            raise MemoryError("xxh3: no memory for a hashing state")
    return int(s)


def _fused_job(moves: Sequence[Move], sum_bytes: int) -> int:
    m = len(moves)
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    dst, src, lens = (vp * m)(), (vp * m)(), (sz * m)()
    for k, (d, s, n) in enumerate(moves):
        dst[k], src[k], lens[k] = d, s, n
    return int(_FUSED(dst, src, lens, m, max(0, sum_bytes), FUSED_PIECE_BYTES,  # type: ignore[misc]
                      _state(), *_FNS))


def _fused_batch(jobs: Sequence[Sequence[Move]], sum_bytes: Sequence[int]) -> list[int]:
    """``copy_and_sum`` by the C helper's batch function: the moves in flat arrays, one C call on each thread
    (``on_two_threads`` of two calls), which take the next job from a shared counter until none is left."""
    dst: list[int] = []
    src: list[int] = []
    lens: list[int] = []
    first = [0]
    for job in jobs:
        for d, s, n in job:
            dst.append(d)
            src.append(s)
            lens.append(n)
        first.append(len(dst))
    nj, m = len(jobs), len(dst)
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    c_dst, c_src, c_len = (vp * m)(*dst), (vp * m)(*src), (sz * m)(*lens)
    c_first = (sz * (nj + 1))(*first)
    c_sum = (sz * nj)(*(max(0, b) for b in sum_bytes))
    out = (ctypes.c_uint64 * nj)()
    nxt = sz(0)  # the shared counter: the next job to take
    args = (c_dst, c_src, c_len, c_first, nj, c_sum, out, ctypes.byref(nxt), FUSED_PIECE_BYTES)

    def run(_: int) -> None:
        _FUSED_JOBS(*args, _state(), *_FNS)  # type: ignore[misc]

    # two calls: the caller's and the copy helper's when the batch is large (a call that finds the counter
    # spent returns at once)
    on_two_threads(run, (0, 1), (sum(lens), 0))
    return list(out)


def _view(ptr: int, n: int) -> memoryview:
    return memoryview((ctypes.c_char * n).from_address(ptr)).cast("B")


class Hasher:
    """xxh3-64 of the byte ranges given to ``update``, in order."""

    __slots__ = ("_py", "_state")

    def __init__(self) -> None:
        self._state: Optional[int] = None
        self._py: Any = None
        if _C is not None:
            self._state = _C["XXH3_createState"]()
            if self._state:
                _C["XXH3_64bits_reset"](self._state)
                return
        self._py = xxhash.xxh3_64()

    def update(self, ptr: int, n: int) -> None:
        if n <= 0:
            return
        if self._py is None:
            _C["XXH3_64bits_update_dispatch"](self._state, ptr, n)  # type: ignore[index]
        else:
            self._py.update(_view(ptr, n))

    def digest(self) -> int:
        """The sum so far; the hasher is spent afterwards."""
        if self._py is not None:
            return int(self._py.intdigest())
        state, self._state = self._state, None
        try:
            return int(_C["XXH3_64bits_digest"](state))  # type: ignore[index]
        finally:
            _C["XXH3_freeState"](state)  # type: ignore[index]


def sum_at(ptr: int, n: int) -> int:
    """xxh3-64 of ``n`` bytes at ``ptr``."""
    if _C is not None:
        return int(_C["XXH3_64bits_dispatch"](ptr, n))
    return int(xxhash.xxh3_64_intdigest(_view(ptr, n) if n else b""))


def sum_ranges(ranges: Sequence[tuple[int, int]]) -> int:
    """xxh3-64 of the concatenation of the (ptr, nbytes) ranges."""
    if len(ranges) == 1:
        return sum_at(*ranges[0])
    h = Hasher()
    for ptr, n in ranges:
        h.update(ptr, n)
    return h.digest()


def sum_many(objs: Sequence[Sequence[tuple[int, int]]]) -> list[int]:
    """``sum_ranges`` of each object; a large batch on two threads (``tierkv.buffers.on_two_threads``)."""
    out = [0] * len(objs)

    def one(i: int) -> None:
        out[i] = sum_ranges(objs[i])

    if NATIVE:
        on_two_threads(one, range(len(objs)), [sum(n for _, n in r) for r in objs])
    else:
        for i in range(len(objs)):
            one(i)
    return out


def copy_and_sum(jobs: Sequence[Sequence[Move]], sum_bytes: Sequence[int]) -> list[int]:
    """``memmove(dst, src, n)`` for every move of every job, and for each job the xxh3-64 of the first
    ``sum_bytes[j]`` bytes its moves wrote, in order.

    Each move is copied a piece at a time and each piece hashed right after its copy,
    from the cache, so the sum costs no second pass over memory: with the C helper
    (``FUSED``, ``FUSED_PIECE_BYTES`` pieces) a batch in one call per thread
    (``FUSED_BATCH``) or one call per job, else ``PIECE_BYTES`` pieces, two calls each.
    A large batch is shared by two threads as ``memmove_many``'s is.  Destinations must not
    overlap one another nor any source.
    """
    if len(jobs) != len(sum_bytes):
        raise ValueError(f"copy_and_sum: {len(jobs)} jobs but {len(sum_bytes)} sum lengths")
    if _FUSED is not None and _FUSED_JOBS is not None and len(jobs) > 1:
        return _fused_batch(jobs, sum_bytes)
    out = [0] * len(jobs)
    move = ctypes.memmove
    piece = PIECE_BYTES

    def one(j: int) -> None:
        if _FUSED is not None:
            out[j] = _fused_job(jobs[j], sum_bytes[j])
            return
        left = sum_bytes[j]
        moves = jobs[j]
        if moves and left <= moves[0][2] <= piece:  # the common case: the summed bytes lie in the first move
            for dst, src, n in moves:
                move(dst, src, n)
            out[j] = sum_at(moves[0][0], left)
            return
        h = Hasher()
        for dst, src, n in moves:
            if left <= 0:
                move(dst, src, n)
                continue
            off = 0
            while off < n:
                m = min(piece, n - off)
                move(dst + off, src + off, m)
                if left > 0:
                    h.update(dst + off, min(m, left))
                    left -= m
                off += m
        out[j] = h.digest()

    on_two_threads(one, range(len(jobs)), [sum(n for _, _, n in job) for job in jobs])
    return out
