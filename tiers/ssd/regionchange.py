"""Region changes of ``SSDTier``: sealing the active region, choosing and beginning the next.

A full region is sealed (its summary and footer written at its end, behind the caller: ``_seal``,
``_wait_seals``) and the next one begun: a free region file first, then a file not yet created;
when only the spare is left, the emptiest sealed region's live objects are re-appended into it
(``reclaim.py``).  A reused file's new header leaves with the region's first write-out
(``_begin``; a checkpoint writes it first: ``_header_out``).

Files not yet created are offered only as far as the file system can take them (``statvfs``): on a
full file system the last file it takes plays the spare, and when it takes none (or creating one fails
for lack of space: the partial file is removed) the tier lives on its files, compacting the emptiest
region within its own file when none is free (``_compact_in_place``).  A region is reclaimed there only
when that leaves room for the largest object; until removals make one that empty, writes are refused.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Optional, cast

import numpy as np

from . import format as F
from . import region as R
from .deadlog import DeadLog
from .hostbuf import image_address
from .index import DigestIndex

log = logging.getLogger(__name__)


class RegionChange:
    # state of ``SSDTier`` (set in its ``__init__`` and ``Tier.__init__``)
    direct_io: bool
    region_size: int
    _what: str
    _lock: threading.Lock
    _regions: dict[int, R.Region]
    _active: Optional[R.Region]
    _index: DigestIndex
    _dead: DeadLog
    _live_total: int
    _counters: dict[str, int]
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
        @property
        def usable(self) -> int: ...
        @property
        def max_slot(self) -> int: ...
        def regions_needed(self) -> int: ...
        def _count(self, what: str, n: int = 1) -> None: ...
        def _io_error(self, e: OSError, what: str) -> None: ...
        def _no_space(self, what: str) -> None: ...
        def _space_reserve(self) -> int: ...
        def _check_removed(self, dirty: bool = False) -> bool: ...
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
        """The active region with room for a record, sealing and reclaiming as needed; None if impossible
        (counted: ``enospc``)."""
        r = self._active
        if r is not None and r.fits(rec_len, key_len, self.region_size):
            return r
        try:
            r = self._rotate()
        except OSError as e:
            self._io_error(e, "starting a region")
            return None
        if r is None or not r.fits(rec_len, key_len, self.region_size):
            self._no_space("no region has room: the write is refused")
            return None
        return r

    def _free_regions(self, allow_new: bool = True) -> tuple[list[int], bool]:
        """Indices usable for a new region: free files first (a sealed region none of whose objects is live
        any more is free: reusing it costs no copy), then files not yet created.  A file already written
        is also cheaper to write again than fresh preallocated blocks (no unwritten extents to convert).

        Files not yet created are offered only as far as the file system can take them (``_files_room``;
        none unless ``allow_new``): the second value says whether it, not the provisioning, set the limit."""
        with self._lock:
            for r in self._regions.values():
                if r.state == R.SEALED and r.live_count == 0 and not r.foreign:
                    r.state = R.FREE
        free = [i for i, r in sorted(self._regions.items()) if r.state == R.FREE and not r.foreign]
        usable = sum(1 for r in self._regions.values() if not r.foreign)
        want = self.regions_needed() - usable
        limited = False
        if want > 0:
            room = self._files_room() if allow_new else 0
            if room < want:
                limited, want = True, room
        i = 0
        for _ in range(want):
            while i in self._regions:
                i += 1
            free.append(i)
            i += 1
        return free, limited

    def _files_room(self) -> int:
        """How many more region files the file system can take, holding back room for a checkpoint and the
        dead log (the last of them is the destination of reclamation: see ``_rotate``)."""
        try:
            st = os.statvfs(self.regions_dir)
        except OSError:
            return 1 << 30  # (unknown: creating the file will tell)
        return max(0, (st.f_bavail * st.f_frsize - self._space_reserve()) // self.region_size)

    def _rotate(self) -> Optional[R.Region]:
        """Seal the active region and begin the next; None if there is none to begin.

        When only one region is free (the spare provisioning keeps, or the last file the file system can
        take) the emptiest sealed region's live objects are moved into it first, and it becomes the spare.
        When the file system is full (it takes no more files, or creating one fails for lack of space: the
        partial file is removed) the tier lives on the files it has: a free one, else the emptiest sealed
        region compacted within its own file (``_compact_in_place``).  Either way a region is reclaimed only
        if that leaves room for the largest object; else the write is refused (the caller counts it)."""
        if self._active is not None:
            self._check_removed()  # (its file is sealed under the directory, not into a removed file)
            self._seal(self._active)
        for allow_new in (True, False):
            free, limited = self._free_regions(allow_new)
            if not free:
                return self._compact_in_place() if limited else None
            victim = None
            if len(free) == 1:  # the spare: refill it with the emptiest region's live objects
                victim = self._pick_victim()
                if limited and victim is not None and not self._worth_reclaiming(victim):
                    return None
            try:
                new = self._begin(free[0])
            except OSError as e:
                if not allow_new or not R.no_space(e):
                    raise
                self._io_error(e, f"creating region file {R.region_name(free[0])}")
                continue  # (the file system was fuller than it said: the files there are)
            break
        else:  # pragma: no cover  (the second pass raises or breaks)
            return None
        if victim is not None:
            if limited:
                self._count("gc_disk_full")
            self._reclaim(victim, new)
        if self._sealed_since_ckpt >= self._checkpoint_every():
            self._checkpoint(durable=self.fsync == "always")
        return new

    def _worth_reclaiming(self, victim: R.Region) -> bool:
        """Whether moving the victim's live objects leaves room for the largest object (always, when the
        provisioning holds; on a full file system, only once enough was removed)."""
        return victim.live_bytes <= self.usable - self.max_slot

    def _compact_in_place(self) -> Optional[R.Region]:
        """The file system takes no more region files and none is free: the emptiest sealed region's live
        records are read into memory and it begins again, in its own file, under a new seq, holding them at
        its start (written out and synced at once).  None if no region would leave room.

        The one moment a crash can cost flushed objects: while this region's new start is being written,
        its moved objects are in memory only (the old copies are being overwritten).  A reopen then finds
        what reached the file (every record is checked against the region's new seq: a miss, never a wrong
        byte).  Counted: ``gc_in_place``."""
        victim = self._pick_victim()
        if victim is None or victim.fd < 0 or not self._worth_reclaiming(victim):
            return None
        self._wait_seals(drop=victim)  # (a summary of its old use still due would land over its new one)
        with self._lock:
            slots = self._index.in_region(victim.index)
            offs = self._index.offset[slots].astype(np.int64)
            order = np.argsort(offs)
            slots, offs = slots[order], offs[order]
            lens = self._index.rec_len[slots].astype(np.int64)
        whole = R.read_span(victim.fd, 0, self.region_size, self.direct_io)  # (OSError: the caller counts it)
        image, self._spare_image = self._spare_image, None
        if image is None:
            image = F.aligned_buffer(self.region_size, populate=True)
            self._image_addrs[id(image)] = image_address(image)
        old_seq, new_seq = victim.seq, self._next_seq
        mv = memoryview(image)
        pos = F.BLOCK
        moved = []  # (slot, old offset, new offset, rec_len, raw_len, key, flags)
        for slot, off, ln in zip(slots.tolist(), offs.tolist(), lens.tolist()):
            h = F.parse_record(whole[off:off + ln], old_seq)
            if h is None:
                moved.append((slot, off, -1, ln, 0, b"", 0))  # (bad bytes: dropped below, counted)
                continue
            mv[pos:pos + ln] = whole[off:off + ln]
            F.reseq_record(image, pos, new_seq)
            moved.append((slot, off, pos, ln, h.raw_len, h.key, h.flags))
            pos = F.align_up(pos + ln, F.ALIGN)
        del whole
        self._count("gc_runs")
        self._count("gc_in_place")
        self._count("gc_disk_full")
        with self._lock:  # (readers find each object where it was until the region changes here, at once)
            self._image_addr = self._image_addrs[id(image)][0]
            victim.start(new_seq, self.region_size, image)
            self._dead.mark(new_seq)
            self._next_seq += 1
            relocated = 0
            for slot, off, new, ln, raw_len, key, flags in moved:
                live = (self._index.digest.item(slot) > F.TOMB and self._index.region.item(slot) == victim.index
                        and self._index.offset.item(slot) == off)
                m = F.measure(ln)
                if live:
                    self._live_total -= m
                    self._dead.add(victim.index, off, old_seq)
                if new < 0 or not live:
                    if live:  # (its bytes were bad)
                        self._index.digest[slot] = F.TOMB
                        self._index.count -= 1
                        self._counters["corrupt"] += 1
                    elif new >= 0:  # (dropped by a reader meanwhile: its new copy is no object either)
                        victim.add_entry(F.key_digest(key), new, ln, raw_len, key, flags)
                        self._dead.add(victim.index, new, new_seq)
                    continue
                self._index.move(slot, victim.index, new)
                victim.add_entry(F.key_digest(key), new, ln, raw_len, key, flags)
                victim.live_bytes += m
                victim.live_count += 1
                self._live_total += m
                relocated += 1
            self._counters["gc_relocated"] += relocated
            victim.pos = pos
            self._active = victim
            self._changed = True
        if self._write_out(victim, F.align_up(pos), pos) and self.fsync != "never":
            try:
                os.fdatasync(victim.fd)
            except OSError as e:
                self._io_error(e, f"fsync of {victim.path}")
        log.warning("%s: the file system is full: region %s compacted in place (%d objects moved); "
                    "writes go on in the room that leaves", self._what, victim.path, relocated)
        return victim
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
        if fresh:  # (a file of zeros would read as foreign at the next open: it gets its header at once)
            self._ensure_dirs()
            existed = os.path.lexists(r.path)
            fd = R.open_fd(r.path, self.direct_io, create=True)
            try:
                R.preallocate(fd, self.region_size)
                head = F.aligned_buffer(F.BLOCK)
                F.pack_region_header(head, idx, self._next_seq, self.region_size)
                R.pwrite_all(fd, head, 0)
            except OSError:
                os.close(fd)
                if not existed:  # (a file without a header would be skipped as foreign, and kept, forever)
                    try:
                        os.unlink(r.path)
                        self._count("partial_files_removed")
                    except OSError:
                        pass
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
        self._dead.mark(self._next_seq)  # (a seq is never handed out again, even if this file is lost)
        if fresh:
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

    def _resume(self, r: R.Region, end: int, entries: bytes, keys: bytes) -> None:
        """Make region ``r``, unsealed with its records up to ``end`` (a scan at open), the active region
        again, filled on from ``end`` under its own seq: at open, when every region holds live objects
        (a crash in the middle of a reclamation) and ``r`` is the newest, so what is appended stays the
        newest.  The file after ``end`` is zeroed first (no record of an interrupted write is found there
        later).  Raises OSError."""
        image, self._spare_image = self._spare_image, None
        if image is None:
            image = F.aligned_buffer(self.region_size, populate=True)
            self._image_addrs[id(image)] = image_address(image)
        start = F.align_down(end)
        mv = memoryview(image)
        mv[:start] = R.read_span(r.fd, 0, start, self.direct_io) if start else b""
        mv[start:end] = R.read_span(r.fd, start, end - start, self.direct_io)
        mv[end:self.region_size] = bytes(self.region_size - end)
        R.pwrite_all(r.fd, mv[start:self.region_size], start)
        self._dirty_fds.add(r.fd)
        self._image_addr = self._image_addrs[id(image)][0]
        with self._lock:
            r.buf = image
            r.state = R.ACTIVE
            r.pos = end
            r.written = start if self.direct_io else end
            r.entries = bytearray(entries)
            r.keys = bytearray(keys)
            r.count = len(entries) // F.ENTRY
            r.sum_start = 0
            r.direct = set()
            r.tail = (0, 0)
            self._active = r
