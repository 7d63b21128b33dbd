"""A batch's records on their way to a region file: ``Segment``, the write path's unit of commit.

``SegmentWriter.append`` (``segmentwriter.py``) appends a batch's records to the active image and hands
the segment's bytes to the writer threads piece by piece (with O_DIRECT they pump what is ready:
``Segment.offer``); ``SegmentWriter.commit`` writes the rest, waits for the pieces, and only then
indexes the segment's records.  This module knows no component: ``wait`` reports a failed write to
``Health`` (``health.py``) and a written file to the callable it is given (``RegionIO.note_dirty``).
"""

from __future__ import annotations

import _thread
import mmap
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Optional, cast

from . import region as R
from .health import Health
from .hostbuf import ctype_of

#: writes of one segment in flight at most, and the backlog that starts the second (two in flight keep a
#: device busier than one when the caller is ahead of it)
PUMPS = 2
SECOND_PUMP = 2 << 20
#: how long a hand-off waits for the writer thread to take its piece (it normally takes microseconds)
_HANDOFF_WAIT = 0.002


def _handoff(pool: ThreadPoolExecutor, wait: bool, fn, *args):
    """Submit ``fn(*args)`` to the writer thread; with ``wait`` (the O_DIRECT pieces), wait (without the GIL)
    until it has begun.

    A woken writer needs the GIL to begin, and the caller, copying on in steps that release the GIL only
    briefly, takes it back first, again and again: the device then idles up to the interpreter's switch
    interval, where the writer needs microseconds to start.  The caller is ahead of the device, so
    waiting for the start costs nothing the device would have used.  Buffered pieces are not worth the
    wait: a batch of small records would pay it once per batch, a large share of its work, and the page
    cache takes a piece in microseconds (docs/history-2026-12-01-to-03.md, 2026-12-02)."""
    if not wait:
        return pool.submit(fn, *args)
    started = _thread.allocate_lock()
    started.acquire()

    def run():
        started.release()
        fn(*args)

    fut = pool.submit(run)
    started.acquire(timeout=_HANDOFF_WAIT)
    return fut


class Segment:
    """Records of one batch appended to the active image but not yet written out and indexed.

    Its lists are cleared in place (``reset``): the appender keeps their ``append`` methods.

    Buffered (``gather``), the segment's bytes go to the file as a list of pieces in file order, one
    ``pwritev`` each write: a record's header and key from the image, its payload (of ``_GATHER_MIN``
    bytes or more) straight from the caller's parts, zeros up to the next record; a smaller payload is
    copied into the image and its whole record taken from there.  The file then holds the region's
    bytes and the image only their headers, so a buffered region's ``written`` is exact (no block is
    written twice) and its records, once written, are read from the file.

    With O_DIRECT, an uncompressed single-part payload of ``F.DIRECT_MIN`` bytes or more that lies in
    huge-page memory (``tierkv.hostmem.contiguous``: a host slab above, the store's staging arena) is not
    copied either (from 4 KiB pages a device takes it slower than a copy plus a write from the image:
    docs/ssd.md):
    its record gets a pad (``format.py``) that gives the payload's file offset the phase of its
    address modulo 4 KiB, so its whole blocks are a *hole* of the image, written from the caller's memory
    (``holes``: file start, file end, address), and only the partial blocks at its two ends are copied
    into the image around it.  Every write of the segment takes the image's bytes and the holes' in file
    order (``runs``); the records are indexed once all of them are in the file, and are read from the
    file from then on (``Region.direct``: the image never holds their payloads)."""

    __slots__ = ("digests", "direct", "end", "entries", "futures", "gather", "hole_i", "holes", "idx", "iov",
                 "key_bytes", "keys", "lock", "n", "offsets", "pumping", "raw_lens", "ready", "rec_lens", "region",
                 "start", "submitted")

    def __init__(self) -> None:
        self.idx: list[int] = []
        self.digests: list[int] = []
        self.offsets: list[int] = []
        self.rec_lens: list[int] = []
        self.raw_lens: list[int] = []
        self.entries: list[bytes] = []
        self.keys: list[bytes] = []
        self.holes: list[tuple[int, int, int]] = []
        self.direct: list[int] = []
        self.region: Optional[R.Region] = None
        self.futures: list = []
        self.lock = threading.Lock()  # (``submitted`` and ``ready`` between the caller and the writer: ``offer``)
        self.reset()

    def reset(self) -> None:
        for lst in (self.idx, self.digests, self.offsets, self.rec_lens, self.raw_lens, self.entries, self.keys,
                    self.holes, self.direct):
            lst.clear()
        self.n = self.key_bytes = self.end = self.start = self.hole_i = 0
        self.submitted = self.ready = 0
        self.pumping = 0
        self.region = None
        self.futures = []
        self.gather = False
        self.iov: list = []

    def begin(self, r: R.Region, pos: int, gather: bool) -> None:
        self.region, self.start, self.gather = r, pos, gather
        self.submitted = self.ready = r.written

    def submit_gathered(self, pool: ThreadPoolExecutor, r: R.Region, upto: int) -> None:
        """Write the pieces gathered so far (``[submitted, upto)`` of the file) on the writer thread."""
        self.futures.append(_handoff(pool, False, R.pwritev_all, r.fd, self.iov, self.submitted))
        self.iov = []
        self.submitted = upto

    def idle(self) -> bool:
        """Whether the writer has finished every piece submitted so far."""
        return not self.futures or self.futures[-1].done()

    def offer(self, pool: ThreadPoolExecutor, r: R.Region, upto: int, least: int) -> None:
        """The image is copied up to ``upto`` (block aligned): the writer threads take it.  A writer already
        pumping takes it when its write in flight returns (no wake-up: it goes on while bytes are ready, each
        write taking all of them); the first is started once ``least`` bytes wait, a second (``PUMPS``) once
        ``SECOND_PUMP`` bytes wait beside a write in flight."""
        with self.lock:
            if upto > self.ready:
                self.ready = upto
            backlog = self.ready - self.submitted
            if backlog < (least if not self.pumping else SECOND_PUMP if self.pumping < PUMPS else 1 << 62):
                return
            self.pumping += 1
        self.futures.append(_handoff(pool, True, self._pump, r))

    def _pump(self, r: R.Region) -> None:
        """On the writer thread: write what is ready, again and again, until nothing is."""
        mv = memoryview(cast(mmap.mmap, r.buf))
        try:
            while True:
                with self.lock:
                    start, upto = self.submitted, self.ready
                    if upto <= start:
                        self.pumping -= 1
                        return
                    runs = self.runs(mv, start, upto) if self.holes else None
                    self.submitted = upto
                if runs is not None:
                    R.pwrite_runs(r.fd, runs)
                else:
                    R.pwrite_all(r.fd, mv[start:upto], start)
        except BaseException:
            with self.lock:
                self.pumping -= 1
            raise

    def claim_rest(self) -> int:
        """The commit's: everything not yet taken by the writer is the caller's to write; returns where that
        begins (the writer takes nothing more)."""
        with self.lock:
            self.ready = max(self.ready, self.submitted)
            start = self.submitted
            self.submitted = self.ready = 1 << 62
            return start

    def submit_hole(self, pool: ThreadPoolExecutor, r: R.Region, lo: int, hi: int, addr: int) -> None:
        """Write a hole (``[lo, hi)`` of the file from ``addr``) on the writer thread now, ahead of the bytes
        before it: the segment's first record, so the device has work while its payload is summed.  The hole
        is recorded as written (address -1): ``runs`` leaves it out."""
        self.futures.append(_handoff(pool, True, R.pwrite_all, r.fd, ctype_of(hi - lo).from_address(addr), lo))
        self.holes.append((lo, hi, -1))

    def runs(self, mv: memoryview, start: int, end: int) -> list[tuple[int, list]]:
        """``[start, end)`` of the file (both block aligned) as runs of buffers, each run (file offset,
        buffers) for one ``pwritev``: the image ``mv`` around the holes, each hole from the caller's memory;
        a hole already written (``submit_hole``) ends a run.  Holes are passed in file order, so those before
        ``end`` are done."""
        out: list = []
        cur: list = []
        at = run_at = start
        holes = self.holes
        i = self.hole_i
        while i < len(holes):
            lo, hi, addr = holes[i]
            if lo >= end:
                break
            i += 1
            if hi <= at:
                continue
            if lo > at:
                cur.append(mv[at:lo])
            elif addr >= 0:  # (a hole begun before ``start``: only its rest)
                addr += at - lo
                lo = at
            h = min(hi, end)
            if addr < 0:  # written ahead: the run ends before it, the next begins after it
                if cur:
                    out.append((run_at, cur))
                    cur = []
                run_at = h
            else:
                cur.append(ctype_of(h - lo).from_address(addr))
            at = h
            if h < hi:  # (its rest is the next write's)
                i -= 1
                break
        self.hole_i = i
        if at < end:
            cur.append(mv[at:end])
        if cur:
            out.append((run_at, cur))
        return out

    def wait(self, health: Health, dirty: Callable[[int], None]) -> bool:
        """Wait for the submitted writes; False (reported to ``health``) if any failed, else the region's
        file is ``dirty`` (``RegionIO.note_dirty``: it owes an fsync)."""
        ok = True
        for f in self.futures:
            try:
                f.result()
            except OSError as e:
                health.write_failed(e, f"writing {cast(R.Region, self.region).path}")
                ok = False
        if self.futures and ok:
            dirty(cast(R.Region, self.region).fd)
        self.futures = []
        return ok
