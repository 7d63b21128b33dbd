"""``RegionIO``: the SSD engine's writes to region files, its region images and its writer threads.

The lowest component of ``SSDTier`` above the file primitives of ``region.py``: every other component
writes the active image through ``write_out``, hands summaries to the writer threads through
``write_summary`` (and waits for them with ``wait_seals`` before anything that needs them in the file),
takes a region image with ``take_image`` and closes a region's file with ``close_region_fd``.  It
calls no other component.
"""

from __future__ import annotations

import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Optional, cast

from . import format as F
from . import region as R
from . import reopen, segment
from .engineconfig import EngineConfig
from .health import Health
from .hostbuf import image_address
from .regiontable import RegionTable
from .segment import Segment


class RegionIO:
    """Write-outs, summaries behind a seal, region images and file handles of one tier's regions."""

    def __init__(self, cfg: EngineConfig, table: RegionTable, health: Health) -> None:
        self._cfg = cfg
        self._table = table
        self._health = health
        self._writer: Optional[ThreadPoolExecutor] = None  # write-outs overlapping a batch's copies
        #: (region, future or None, summary buffer, its offset) of summaries on their way (``write_summary``)
        self._seals: list = []
        self._spare_image: Optional[mmap.mmap] = None  # the last sealed region's image, reused by the next
        self._image_addrs: dict[int, tuple] = {}  # id(image) -> (address, keeper)
        self._dirty: set[int] = set()  # region files written since their last fsync (``note_dirty``)

    # -- images --------------------------------------------------------------------------------
    def take_image(self) -> mmap.mmap:
        """A region image: the spare one (the last sealed region's), else a new one."""
        image, self._spare_image = self._spare_image, None
        if image is None:
            image = F.aligned_buffer(self._cfg.region_size, populate=True)
            self._image_addrs[id(image)] = image_address(image)
        return image

    def address_of(self, image: mmap.mmap) -> int:
        """The address of an image ``take_image`` gave."""
        return self._image_addrs[id(image)][0]

    def give_back(self, image: Optional[mmap.mmap]) -> None:
        """An image no region uses any more: the next region's (``take_image``)."""
        self._spare_image = image

    # -- writer threads ------------------------------------------------------------------------
    def writer_pool(self) -> ThreadPoolExecutor:
        w = self._writer
        if w is None:
            w = self._writer = ThreadPoolExecutor(max_workers=segment.PUMPS,
                                                  thread_name_prefix=f"tierkv-{self._cfg.name}-w")
        return w

    def shutdown(self) -> None:
        if self._writer is not None:
            self._writer.shutdown(wait=True)

    # -- write-outs ----------------------------------------------------------------------------
    def write_out(self, r: R.Region, end: int, data_end: int, seg: Optional[Segment] = None) -> bool:
        """Write the active image from ``r.written`` up to ``end`` (block aligned); its bytes end at
        ``data_end`` (a partial last block is written again next time).  ``seg``: the segment being
        committed, whose payloads written from the caller's memory take their place (``Segment``).
        False (counted) on an I/O error."""
        if not self._cfg.direct_io:  # buffered: exactly the bytes not yet written (the image may not hold the
            end = min(end, data_end)  # payloads of records written before, see ``Segment``)
        if end <= r.written:
            return True
        buf = cast("mmap.mmap", r.buf)  # (the active image)
        if end > data_end:  # the tail of a partial block: zeros, not an earlier region's bytes
            memoryview(buf)[data_end:end] = bytes(end - data_end)
        try:
            if seg is not None and seg.holes:
                R.pwrite_runs(r.fd, seg.runs(memoryview(buf), r.written, end))
            else:
                R.pwrite_all(r.fd, memoryview(buf)[r.written:end], r.written)
        except OSError as e:
            self._health.write_failed(e, f"writing {r.path}")
            return False
        self.note_dirty(r.fd)
        r.written = min(end, F.align_down(data_end)) if self._cfg.direct_io else end
        r.tail = (data_end, end)
        return True

    def header_out(self) -> bool:
        """Write the active region's header if it has not left yet (``RegionChanger.begin``): before a
        checkpoint names the region's new seq or compacts the dead log.  False if that fails."""
        r = self._table.active
        if r is None or r.written > 0:
            return True
        return self.write_out(r, F.BLOCK, F.BLOCK)

    # -- summaries -----------------------------------------------------------------------------
    def write_summary(self, r: R.Region, summary: mmap.mmap, start: int) -> None:
        """Write a sealed region's summary (``summary``, at ``start``) on the writer thread."""
        fut = self.writer_pool().submit(R.pwrite_all, r.fd, summary, start)
        self._seals.append((r, fut, summary, start))

    def sealing(self, r: R.Region) -> bool:
        """Whether a summary of ``r`` is on its way to its file."""
        return any(e[0] is r for e in self._seals)

    def wait_seals(self, drop: Optional[R.Region] = None) -> bool:
        """Wait for the summaries ``write_summary`` handed to the writer thread.  One that failed is written
        again from the caller's thread; if that fails too it is counted and kept, to be tried again by the
        next call, and the result is False (a checkpoint then waits: it would cover the region, whose summary
        it reads).  ``drop``: a region whose file is going away or being reused: its summary is no longer
        due.  Called before anything that needs them in the file: a flush, a checkpoint, closing or reusing
        a region's file, the next seal."""
        kept = []
        for r, fut, summary, start in self._seals:
            if fut is not None:
                try:
                    fut.result()
                    summary.close()
                    continue
                except OSError as e:
                    self._health.io_error(e, f"writing the summary of {r.path} (tried again)")
            if r is drop or r.state != R.SEALED:
                summary.close()
                continue
            try:
                R.pwrite_all(r.fd, summary, start)
                summary.close()
            except OSError as e:
                self._health.io_error(e, f"writing the summary of {r.path}")
                kept.append((r, None, summary, start))
        self._seals = kept
        return not kept

    def seal_scanned(self, r: R.Region, sc: reopen.Scanned) -> None:
        """Write the summary of a region whose records a scan found (``sc``), left unsealed by an earlier
        process or with a summary that could not be read; no room for one: it is scanned again next time."""
        count = len(sc.entries)
        if count == 0:
            return
        if F.summary_start(self._cfg.region_size, count, len(sc.keys)) < F.align_up(sc.end, F.ALIGN):
            return  # no room for a summary: it stays unsealed and is scanned again next time
        img = F.aligned_buffer(self._cfg.region_size)
        start = F.pack_summary(img, self._cfg.region_size, r.seq, sc.entries.tobytes(), sc.keys, count)
        try:
            R.pwrite_all(r.fd, memoryview(img)[start:self._cfg.region_size], start)
            self.note_dirty(r.fd)
            r.sum_start = start
        except OSError as e:
            self._health.io_error(e, f"sealing {r.path}")

    # -- what owes an fsync: RegionIO's own writes, and those the others tell it of ----------------
    def note_dirty(self, fd: int) -> None:
        """Region file ``fd`` was written: it owes an fsync.  Caller holds ``wlock``."""
        self._dirty.add(fd)

    def clean(self, fd: int) -> None:
        """Region file ``fd`` owes nothing more (synced, or being closed).  Caller holds ``wlock``."""
        self._dirty.discard(fd)

    def all_clean(self) -> None:
        """Every region file was synced.  Caller holds ``wlock``."""
        self._dirty.clear()

    def dirty(self) -> list[int]:
        """The region files written since their last fsync (a copy)."""
        return list(self._dirty)

    # -- file handles --------------------------------------------------------------------------
    def close_region_fd(self, r: R.Region) -> None:
        if r.fd >= 0:
            self.wait_seals(drop=r)  # (none may be writing to it)
            self.clean(r.fd)
            try:
                os.close(r.fd)
            except OSError:
                pass
            r.fd = -1

    def close_fds(self) -> None:
        for r in self._table.regions.values():
            self.close_region_fd(r)
