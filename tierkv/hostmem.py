"""Host memory that devices move fast: huge-page buffers, the staging arena, and where they lie.

A DMA transfer (an O_DIRECT read or write, a copy to or from an accelerator) is split into one
segment per physically contiguous run of pages.  A buffer of 4 KiB pages is as many segments as
pages, merged only where neighbours happen to lie side by side; a 2 MiB transparent huge page is
one, so a transfer from huge pages runs faster than one of the same bytes from 4 KiB pages
(``bench/bench_dio_buffers.py`` measures it; figures in docs/ssd.md, "Figures").

* ``page_buffer`` maps a zeroed, page-aligned buffer, advised as huge pages from ``HUGE`` bytes on.
* ``StagingArena`` keeps one such buffer for staging batches of chunks between tiers, reused batch
  after batch, each chunk at a 4 KiB boundary; ``StagingPool`` lends arenas, one per batch in
  flight, to every copy a store makes between tiers (write-behind, promotion, demotion).
* ``advise_huge`` advises the whole 2 MiB pages of memory mapped elsewhere (a host slab's tensor)
  before their first touch.
* ``contiguous(addr, n)`` says whether ``[addr, addr + n)`` lies in one registered huge-page range
  (an arena's buffer, a slab's interior): the ``ssd`` tier writes such payloads to the device
  straight from where they are instead of copying them into its region image first.

Invariants: a range is registered only while its memory is mapped and held by its owner (an arena
unregisters a buffer before it lets it go, a slab its range at close), and only when the kernel
took the huge-page advice.
The registry decides speed only: any memory is written correctly by either path.
"""

from __future__ import annotations

import bisect
import mmap
import threading
from typing import Optional

import torch

#: buffers at least this long ask for transparent huge pages
HUGE = 2 << 20
#: whether they do when the caller does not say (benchmarks compare both)
HUGE_PAGES = True
#: chunks carved from a staging arena start on this boundary (the unit of O_DIRECT transfers)
CARVE_ALIGN = 4096
_MADV_POPULATE_WRITE = 23  # (Linux 5.14; not named by the mmap module)


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _map(n: int, populate: bool, huge: Optional[bool]) -> tuple[mmap.mmap, bool]:
    """(buffer, whether the kernel took the huge-page advice)."""
    size = max(_round_up(n, mmap.PAGESIZE), mmap.PAGESIZE)
    want = (HUGE_PAGES if huge is None else huge) and size >= HUGE and hasattr(mmap, "MADV_HUGEPAGE")
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    if populate and not want:
        flags |= getattr(mmap, "MAP_POPULATE", 0)
    buf = mmap.mmap(-1, size, flags=flags)
    advised = False
    if want:
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
            advised = True
        except OSError:  # (a kernel without transparent huge pages: 4 KiB pages)
            pass
        if populate:  # after the advice, so the pages faulted in are huge ones
            try:
                buf.madvise(_MADV_POPULATE_WRITE)
            except OSError:  # (an older kernel: touch each page)
                for at in range(0, size, mmap.PAGESIZE):
                    buf[at] = 0
    return buf, advised


def page_buffer(n: int, populate: bool = False, huge: Optional[bool] = None) -> mmap.mmap:
    """A zeroed, page-aligned anonymous buffer of at least ``n`` bytes (what O_DIRECT needs).

    ``populate`` faults its pages in at once (touching fresh pages one by one costs more than
    the copy into them on a virtual machine).  From ``HUGE`` bytes on it asks for transparent
    huge pages (``huge=False`` does not; ``None`` follows ``HUGE_PAGES``).
    """
    return _map(n, populate, huge)[0]


# -- where huge-page buffers lie ----------------------------------------------------------
_lock = threading.Lock()
_starts: list[int] = []  # sorted
_ends: list[int] = []  # _ends[i] belongs to _starts[i]


def register(addr: int, n: int) -> None:
    """Record ``[addr, addr + n)`` as huge-page memory (until ``unregister(addr)``)."""
    with _lock:
        i = bisect.bisect_left(_starts, addr)
        _starts.insert(i, addr)
        _ends.insert(i, addr + n)


def unregister(addr: int) -> None:
    with _lock:
        i = bisect.bisect_left(_starts, addr)
        if i < len(_starts) and _starts[i] == addr:
            del _starts[i]
            del _ends[i]


def contiguous(addr: int, n: int) -> bool:
    """Whether ``[addr, addr + n)`` lies within one registered huge-page buffer."""
    with _lock:
        i = bisect.bisect_right(_starts, addr) - 1
        return i >= 0 and addr + n <= _ends[i]


def advise_huge(addr: int, n: int) -> Optional[tuple[int, int]]:
    """Advise the whole 2 MiB pages inside ``[addr, addr + n)`` of memory mapped elsewhere (a tensor's) as
    huge pages, before they are first touched, and register them; returns the range, or None where the
    kernel refuses or fewer than two whole pages fit.  The owner unregisters it before it lets the memory go."""
    lo, hi = _round_up(addr, HUGE), (addr + n) // HUGE * HUGE
    if not HUGE_PAGES or hi - lo < 2 * HUGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), mmap.MADV_HUGEPAGE) != 0:
        return None
    register(lo, hi - lo)
    return lo, hi


class StagingArena:
    """One reusable huge-page buffer that batches of chunks are staged in.

    ``carve(sizes)`` returns one flat ``uint8`` tensor per size, each starting on a
    ``CARVE_ALIGN`` boundary, all views of the arena's buffer: valid until the next
    ``carve`` or ``release`` (one batch at a time; the owner serialises its users).  The
    buffer grows to the largest batch asked for and is kept (populated once, never faulted
    again); while it holds huge pages its range is registered (``contiguous``).
    """

    def __init__(self) -> None:
        self._buf: Optional[mmap.mmap] = None
        self._tensor: Optional[torch.Tensor] = None
        self._addr = 0

    @property
    def nbytes(self) -> int:
        return len(self._buf) if self._buf is not None else 0

    def carve(self, sizes: list[int]) -> list[torch.Tensor]:
        offs = []
        total = 0
        for n in sizes:
            offs.append(total)
            total += _round_up(n, CARVE_ALIGN)
        if self._tensor is None or total > self.nbytes:
            self._grow(total)
        t = self._tensor
        assert t is not None
        return [t[o:o + n] for o, n in zip(offs, sizes)]

    def _grow(self, total: int) -> None:
        self.release()
        buf, huge = _map(_round_up(max(total, 1), HUGE), True, None)
        tensor = torch.frombuffer(buf, dtype=torch.uint8)
        self._buf, self._tensor, self._addr = buf, tensor, tensor.data_ptr()
        if huge:
            register(self._addr, len(buf))

    def release(self) -> None:
        """Let the buffer go (views carved from it keep it mapped while they live, unregistered)."""
        if self._buf is not None:
            unregister(self._addr)
        self._buf = self._tensor = None
        self._addr = 0


class StagingPool:
    """Arenas lent one per batch in flight: the one staging mechanism for copies between tiers.

    ``with pool.carve(sizes) as bufs:`` lends a free arena (or a new one), carves ``bufs`` from it
    and takes it back when the block ends; the views must not be used after it.  A copy that
    stages while another is staging (a demotion that makes room by demoting further down, two
    puts evicting at once) simply holds another arena.  At most ``keep`` arenas stay mapped
    between batches; ``release`` lets every idle one go (a store's ``close``).
    """

    def __init__(self, keep: int = 2) -> None:
        self._free: list[StagingArena] = []
        self._lent = 0
        self._keep = keep
        self._lock = threading.Lock()
        self._closed = False

    def carve(self, sizes: list[int]) -> _Lease:
        with self._lock:
            arena = self._free.pop() if self._free else StagingArena()
            self._lent += 1
        return _Lease(self, arena, sizes)

    def _give_back(self, arena: StagingArena) -> None:
        with self._lock:
            self._lent -= 1
            if not self._closed and len(self._free) < self._keep:
                self._free.append(arena)
                return
        arena.release()

    @property
    def nbytes(self) -> int:
        """Bytes mapped by the idle arenas kept for the next batches."""
        with self._lock:
            return sum(a.nbytes for a in self._free)

    @property
    def lent(self) -> int:
        """Arenas lent now (batches being staged)."""
        return self._lent

    def release(self) -> None:
        """Let every idle arena go; arenas lent now are let go when given back."""
        with self._lock:
            self._closed = True
            free, self._free = self._free, []
        for arena in free:
            arena.release()


class _Lease:
    """One arena lent for one batch (``StagingPool.carve``)."""

    __slots__ = ("_arena", "_pool", "_sizes")

    def __init__(self, pool: StagingPool, arena: StagingArena, sizes: list[int]) -> None:
        self._pool, self._arena, self._sizes = pool, arena, sizes

    def __enter__(self) -> list[torch.Tensor]:
        try:
            return self._arena.carve(self._sizes)
        except BaseException:
            self._pool._give_back(self._arena)
            raise

    def __exit__(self, *exc: object) -> None:
        self._pool._give_back(self._arena)
