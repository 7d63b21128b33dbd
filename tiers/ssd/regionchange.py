"""Region changes of ``SSDTier``: sealing the active region, choosing and beginning the next.

A full region is sealed (its summary and footer written at its end, behind the caller: ``_seal``,
``_wait_seals``) and the next one begun: a free region file first, then a file not yet created;
when only the spare is left, the emptiest sealed region's live objects are re-appended into it
(``reclaim.py``).  A reused file's new header leaves with the region's first write-out
(``_begin``; a checkpoint writes it first: ``_header_out``).
"""

from __future__ import annotations

import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Optional, cast

from . import format as F
from . import region as R
from .hostbuf import image_address


class RegionChange:
    # state of ``SSDTier`` (set in its ``__init__`` and ``Tier.__init__``)
    direct_io: bool
    region_size: int
    _lock: threading.Lock
    _regions: dict[int, R.Region]
    _active: Optional[R.Region]
    _changed: bool
    _sealed_since_ckpt: int
    _next_seq: int
    _dirty_fds: set[int]
    _spare_image: Optional[mmap.mmap]
    _seals: list  # (region, future, summary buffer, its offset) of summaries on a writer thread (``_seal``)
    _image_addrs: dict[int, tuple]
    _image_addr: int

    if TYPE_CHECKING:  # defined by ``SSDTier``, ``WritePath``, ``Persistence`` and ``Reclaim``
        @property
        def regions_dir(self) -> str: ...
        def regions_needed(self) -> int: ...
        def _count(self, what: str, n: int = 1) -> None: ...
        def _io_error(self, e: OSError, what: str) -> None: ...
        def _ensure_dirs(self) -> None: ...
        def _close_region_fd(self, r: R.Region) -> None: ...
        def _checkpoint(self, cands: Any = None, durable: bool = True) -> None: ...
        def _checkpoint_every(self) -> int: ...
        def _pick_victim(self) -> Optional[R.Region]: ...
        def _reclaim(self, victim: R.Region, dest: R.Region) -> None: ...
        def _writer_pool(self) -> ThreadPoolExecutor: ...
        def _write_out(self, r: R.Region, end: int, data_end: int, seg: Any = None) -> bool: ...
        fsync: str

    def _room(self, rec_len: int, key_len: int) -> Optional[R.Region]:
        """The active region with room for a record, sealing and reclaiming as needed; None if impossible."""
        r = self._active
        if r is not None and r.fits(rec_len, key_len, self.region_size):
            return r
        try:
            r = self._rotate()
        except OSError as e:
            self._io_error(e, "starting a region")
            return None
        if r is None or not r.fits(rec_len, key_len, self.region_size):
            self._count("enospc")
            return None
        return r

    def _free_regions(self) -> list[int]:
        """Indices usable for a new region: free files first (a sealed region none of whose objects is live
        any more is free: reusing it costs no copy), then files not yet created.  A file already written
        is also cheaper to write again than fresh preallocated blocks (no unwritten extents to convert)."""
        with self._lock:
            for r in self._regions.values():
                if r.state == R.SEALED and r.live_count == 0 and not r.foreign:
                    r.state = R.FREE
        free = [i for i, r in sorted(self._regions.items()) if r.state == R.FREE and not r.foreign]
        usable = sum(1 for r in self._regions.values() if not r.foreign)
        i = 0
        while usable < self.regions_needed():
            while i in self._regions:
                i += 1
            free.append(i)
            usable += 1
            i += 1
        return free

    def _rotate(self) -> Optional[R.Region]:
        if self._active is not None:
            self._seal(self._active)
        free = self._free_regions()
        if not free:
            return None
        victim = None
        if len(free) == 1:  # the spare: refill it with the emptiest region's live objects
            victim = self._pick_victim()
        new = self._begin(free[0])
        if victim is not None:
            self._reclaim(victim, new)
        if self._sealed_since_ckpt >= self._checkpoint_every():
            self._checkpoint(durable=self.fsync == "always")
        return new

    def _begin(self, idx: int) -> R.Region:
        r = self._regions.get(idx)
        if r is None:
            r = R.Region(idx, os.path.join(self.regions_dir, R.region_name(idx)))
        elif any(e[0] is r for e in self._seals):
            self._wait_seals(drop=r)  # (its old summary, if still due, is no longer; others stay behind)
        fresh = r.fd < 0
        if not fresh:
            try:
                fresh = os.stat(r.path).st_ino != r.ino  # removed behind our back
            except OSError:
                fresh = True
        if fresh:
            self._ensure_dirs()
            fd = R.open_fd(r.path, self.direct_io, create=True)
            try:
                R.preallocate(fd, self.region_size)
            except OSError:
                os.close(fd)
                raise
            if r.fd >= 0:
                self._close_region_fd(r)
            r.fd, r.ino = fd, os.fstat(fd).st_ino
        image, self._spare_image = self._spare_image, None
        if image is None:
            image = F.aligned_buffer(self.region_size, populate=True)
            self._image_addrs[id(image)] = image_address(image)
        self._image_addr = self._image_addrs[id(image)][0]
        r.start(self._next_seq, self.region_size, image)
        if fresh:  # (a file of zeros would read as foreign at the next open)
            R.pwrite_all(r.fd, memoryview(cast("mmap.mmap", r.buf))[:F.BLOCK], 0)
            r.written = F.BLOCK
            self._dirty_fds.add(r.fd)
        # else the new header leaves with the region's first write-out (``written`` 0): until then the file
        # is what it was, a region of the old seq whose records are all dead (the dead log names them until
        # a compaction, which a checkpoint runs only once the new header is out: ``_header_out``)
        self._next_seq += 1
        with self._lock:
            self._regions[idx] = r
            self._active = r
        return r

    def _seal(self, r: R.Region) -> None:
        """Write the rest of the active image, then its summary and footer behind the caller (the writer
        thread: ``_wait_seals``); raises OSError (the region stays active).

        The summary is copied out of the image first (the image is the next region's); the region's own file
        is written again only once its summary is out (``_begin`` waits for it), so a summary never lands
        over a newer use of the file.  One that fails to reach the file is tried again (``_wait_seals``); a
        region without one costs the next open a scan of its records (``recovery``)."""
        buf = cast("mmap.mmap", r.buf)  # (set while ACTIVE, as are entries and keys)
        self._wait_seals()  # (they are few: the last seal's, or one that failed)
        start = F.pack_summary(buf, self.region_size, r.seq, bytes(cast(bytearray, r.entries)),
                               bytes(cast(bytearray, r.keys)), r.count)
        mv = memoryview(buf)
        end = F.align_up(r.pos)
        # (with O_DIRECT the last write-out usually took the partial last block with zeros after the data)
        if end > r.written and not (self.direct_io and r.tail[0] == r.pos and r.tail[1] >= end):
            mv[r.pos:end] = bytes(end - r.pos)  # (a reused image holds old bytes)
            R.pwrite_all(r.fd, mv[r.written:end], r.written)
        summary = F.aligned_buffer(self.region_size - start)
        summary[:] = mv[start:self.region_size]
        fut = self._writer_pool().submit(R.pwrite_all, r.fd, summary, start)
        self._seals.append((r, fut, summary, start))
        self._dirty_fds.add(r.fd)
        with self._lock:  # readers copy from the image under this lock: none is using it now
            r.sum_start = start
            r.state = R.SEALED
            self._spare_image, r.buf = r.buf, None
            r.entries = r.keys = None
            r.direct = set()
            self._active = None
            self._changed = True
        self._sealed_since_ckpt += 1

    def _wait_seals(self, drop: Optional[R.Region] = None) -> bool:
        """Wait for the summaries ``_seal`` handed to the writer thread.  One that failed is written again
        from the caller's thread; if that fails too it is counted and kept, to be tried again by the next
        call, and the result is False (a checkpoint then waits: it would cover the region, whose summary it
        reads).  ``drop``: a region whose file is going away or being reused: its summary is no longer due.
        Called before anything that needs them in the file: a flush, a checkpoint, closing or reusing a
        region's file, the next seal."""
        kept = []
        for r, fut, summary, start in self._seals:
            if fut is not None:
                try:
                    fut.result()
                    summary.close()
                    continue
                except OSError as e:
                    self._io_error(e, f"writing the summary of {r.path} (tried again)")
            if r is drop or r.state != R.SEALED:
                summary.close()
                continue
            try:
                R.pwrite_all(r.fd, summary, start)
                summary.close()
            except OSError as e:
                self._io_error(e, f"writing the summary of {r.path}")
                kept.append((r, None, summary, start))
        self._seals = kept
        return not kept

    def _header_out(self) -> bool:
        """Write the active region's header if it has not left yet (``_begin``): before a checkpoint names
        the region's new seq or compacts the dead log.  False if that fails."""
        r = self._active
        if r is None or r.written > 0:
            return True
        return self._write_out(r, F.BLOCK, F.BLOCK)
