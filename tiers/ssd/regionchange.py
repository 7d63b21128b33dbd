"""``RegionChanger``: the SSD engine's region changes — sealing the active region, choosing and beginning the next.

A full region is sealed (its summary and footer written at its end, behind the caller: ``seal``,
``RegionIO.wait_seals``) and the next one begun: a free region file first, then a file not yet created;
when only the spare is left, the emptiest sealed region's live objects are re-appended into it
(``Reclaimer.reclaim``).  A reused file's new header leaves with the region's first write-out
(``begin``; a checkpoint writes it first: ``RegionIO.header_out``).  Every ``checkpoint_every`` regions
sealed, ``rotate`` has the ``Checkpointer`` write a checkpoint.

Files not yet created are offered only as far as the file system can take them (``statvfs``): on a
full file system the last file it takes plays the spare, and when it takes none (or creating one fails
for lack of space: the partial file is removed) the tier lives on its files, compacting the emptiest
region within its own file when none is free (``Reclaimer.compact_in_place``).  A region is reclaimed there only
when that leaves room for the largest object; until removals make one that empty, writes are refused.
"""

from __future__ import annotations

import logging
import mmap
import os
from typing import Optional, cast

from . import format as F
from . import region as R
from .catalogue import Catalogue
from .checkpointer import Checkpointer
from .counters import SSDCounters
from .engineconfig import EngineConfig
from .health import Health
from .reclaim import Reclaimer
from .regionio import RegionIO
from .regiontable import RegionTable
from .state import EngineLocks

log = logging.getLogger(__name__)


class RegionChanger:
    """Seals the active region and begins the next (``room``, ``rotate``); at open, resumes or settles the
    regions an earlier process left (``resume``, ``settle``, ``remove_surplus``)."""

    def __init__(self, cfg: EngineConfig, table: RegionTable, cat: Catalogue, locks: EngineLocks, counters: SSDCounters,
                 health: Health, io: RegionIO, reclaimer: Reclaimer, checkpointer: Checkpointer) -> None:
        # (the owners, as ``state.py`` lists them: alike in each component's constructor, as each uses all five)
        self._cfg, self._table, self._cat, self._locks, self._counters = cfg, table, cat, locks, counters
        self._health = health
        self._io = io
        self._reclaimer = reclaimer
        self._checkpointer = checkpointer

    def room(self, rec_len: int, key_len: int) -> Optional[R.Region]:
        """The active region with room for a record, sealing and reclaiming as needed; None if impossible
        (counted: ``enospc``)."""
        r = self._table.active
        if r is not None and r.fits(rec_len, key_len, self._cfg.region_size):
            return r
        try:
            r = self.rotate()
        except OSError as e:
            self._health.write_failed(e, "starting a region")
            return None
        if r is None or not r.fits(rec_len, key_len, self._cfg.region_size):
            self._health.no_space("no region has room: the write is refused")
            return None
        return r

    def free_regions(self, allow_new: bool = True) -> tuple[list[int], bool]:
        """Indices usable for a new region: free files first (a sealed region none of whose objects is live
        any more is free: reusing it costs no copy), then files not yet created.  A file already written
        is also cheaper to write again than fresh preallocated blocks (no unwritten extents to convert).

        Files not yet created are offered only as far as the file system can take them (``_files_room``;
        none unless ``allow_new``): the second value says whether it, not the provisioning, set the limit."""
        with self._locks.lock:
            self._table.free_empty()
        free = [i for i, r in sorted(self._table.regions.items()) if r.state == R.FREE and not r.foreign]
        usable = sum(1 for r in self._table.regions.values() if not r.foreign)
        want = self._cfg.regions_needed() - usable
        limited = False
        if want > 0:
            room = self._files_room() if allow_new else 0
            if room < want:
                limited, want = True, room
        i = 0
        for _ in range(want):
            while i in self._table.regions:
                i += 1
            free.append(i)
            i += 1
        return free, limited

    def _files_room(self) -> int:
        """How many more region files the file system can take, holding back room for a checkpoint and the
        dead log (the last of them is the destination of reclamation: see ``rotate``)."""
        try:
            fs = os.statvfs(self._cfg.regions_dir)
        except OSError:
            return 1 << 30  # (unknown: creating the file will tell)
        return max(0, (fs.f_bavail * fs.f_frsize - self._cat.space_reserve()) // self._cfg.region_size)

    def rotate(self) -> Optional[R.Region]:
        """Seal the active region and begin the next; None if there is none to begin.

        When only one region is free (the spare provisioning keeps, or the last file the file system can
        take) the emptiest sealed region's live objects are moved into it first, and it becomes the spare.
        When the file system is full (it takes no more files, or creating one fails for lack of space: the
        partial file is removed) the tier lives on the files it has: a free one, else the emptiest sealed
        region compacted within its own file (``Reclaimer.compact_in_place``).  Either way a region is reclaimed only
        if that leaves room for the largest object; else the write is refused (the caller counts it)."""
        if self._table.active is not None:
            self._checkpointer.check_removed()  # (its file is sealed under the directory, not into a removed file)
            self.seal(self._table.active)
        for allow_new in (True, False):
            free, limited = self.free_regions(allow_new)
            if not free:
                return self._reclaimer.compact_in_place() if limited else None
            victim = None
            if len(free) == 1:  # the spare: refill it with the emptiest region's live objects
                victim = self._reclaimer.pick_victim()
                if limited and victim is not None and not self._reclaimer.worth_reclaiming(victim):
                    return None
            try:
                new = self.begin(free[0])
            except OSError as e:
                if not allow_new or not R.no_space(e):
                    raise
                self._health.io_error(e, f"creating region file {R.region_name(free[0])}")
                continue  # (the file system was fuller than it said: the files there are)
            break
        else:  # pragma: no cover  (the second pass raises or breaks)
            return None
        if victim is not None:
            if limited:
                with self._locks.lock:
                    self._counters.gc_disk_full += 1
            self._reclaimer.reclaim(victim, new)
        if self._checkpointer.sealed_enough():
            self._checkpointer.write(durable=self._cfg.fsync == "always")
        return new

    def begin(self, idx: int) -> R.Region:
        r = self._table.regions.get(idx)
        if r is None:
            r = R.Region(idx, os.path.join(self._cfg.regions_dir, R.region_name(idx)))
        elif self._io.sealing(r):
            self._io.wait_seals(drop=r)  # (its old summary, if still due, is no longer; others stay behind)
        fresh = r.fd < 0
        if not fresh:
            try:
                fresh = os.stat(r.path).st_ino != r.ino  # removed behind our back
            except OSError:
                fresh = True
        if fresh:  # (a file of zeros would read as foreign at the next open: it gets its header at once)
            self._cfg.ensure_dirs()
            existed = os.path.lexists(r.path)
            fd = R.open_fd(r.path, self._cfg.direct_io, create=True)
            try:
                R.preallocate(fd, self._cfg.region_size)
                head = F.aligned_buffer(F.BLOCK)
                F.pack_region_header(head, idx, self._table.next_seq, self._cfg.region_size)
                R.pwrite_all(fd, head, 0)
            except OSError:
                os.close(fd)
                if not existed:  # (a file without a header would be skipped as foreign, and kept, forever)
                    try:
                        os.unlink(r.path)
                        with self._locks.lock:
                            self._counters.partial_files_removed += 1
                    except OSError:
                        pass
                raise
            if r.fd >= 0:
                self._io.close_region_fd(r)
            r.fd, r.ino = fd, os.fstat(fd).st_ino
        image = self._io.take_image()
        self._table.note_image(self._io.address_of(image))
        r.start(self._table.next_seq, self._cfg.region_size, image)
        self._cat.dead.mark(self._table.next_seq)  # (a seq is never handed out again, even if this file is lost)
        if fresh:
            r.written = F.BLOCK
            self._io.note_dirty(r.fd)
        # else the new header leaves with the region's first write-out (``written`` 0): until then the file
        # is what it was, a region of the old seq whose records are all dead (the dead log names them until
        # a compaction, which a checkpoint runs only once the new header is out: ``RegionIO.header_out``)
        self._table.take_seq()
        with self._locks.lock:
            self._table.add(r)
            self._table.activate(r)
        return r

    def seal(self, r: R.Region) -> None:
        """Write the rest of the active image, then its summary and footer behind the caller (the writer
        thread: ``RegionIO.wait_seals``); raises OSError (the region stays active).

        The summary is copied out of the image first (the image is the next region's); the region's own file
        is written again only once its summary is out (``begin`` waits for it), so a summary never lands
        over a newer use of the file.  One that fails to reach the file is tried again (``RegionIO.wait_seals``); a
        region without one costs the next open a scan of its records (``reopen``)."""
        buf = cast(mmap.mmap, r.buf)  # (set while ACTIVE, as are entries and keys)
        self._io.wait_seals()  # (they are few: the last seal's, or one that failed)
        start = F.pack_summary(buf, self._cfg.region_size, r.seq, bytes(cast(bytearray, r.entries)),
                               bytes(cast(bytearray, r.keys)), r.count)
        mv = memoryview(buf)
        end = F.align_up(r.pos)
        # (with O_DIRECT the last write-out usually took the partial last block with zeros after the data)
        if end > r.written and not (self._cfg.direct_io and r.tail[0] == r.pos and r.tail[1] >= end):
            mv[r.pos:end] = bytes(end - r.pos)  # (a reused image holds old bytes)
            R.pwrite_all(r.fd, mv[r.written:end], r.written)
        summary = F.aligned_buffer(self._cfg.region_size - start)
        summary[:] = mv[start:self._cfg.region_size]
        self._io.write_summary(r, summary, start)
        self._io.note_dirty(r.fd)
        with self._locks.lock:  # readers copy from the image under this lock: none is using it now
            r.sum_start = start
            self._io.give_back(r.buf)
            r.buf = None
            r.entries = r.keys = None
            r.direct = set()
            self._table.sealed(r)
            self._cat.mark_changed()
        self._checkpointer.note_sealed()

    def resume(self, r: R.Region, end: int, entries: bytes, keys: bytes) -> None:
        """Make region ``r``, unsealed with its records up to ``end`` (a scan at open), the active region
        again, filled on from ``end`` under its own seq: at open, when every region holds live objects
        (a crash in the middle of a reclamation) and ``r`` is the newest, so what is appended stays the
        newest.  The file after ``end`` is zeroed first (no record of an interrupted write is found there
        later).  Raises OSError."""
        image = self._io.take_image()
        start = F.align_down(end)
        mv = memoryview(image)
        mv[:start] = R.read_span(r.fd, 0, start, self._cfg.direct_io) if start else b""
        mv[start:end] = R.read_span(r.fd, start, end - start, self._cfg.direct_io)
        mv[end:self._cfg.region_size] = bytes(self._cfg.region_size - end)
        R.pwrite_all(r.fd, mv[start:self._cfg.region_size], start)
        self._io.note_dirty(r.fd)
        self._table.note_image(self._io.address_of(image))
        with self._locks.lock:
            r.buf = image
            r.pos = end
            r.written = start if self._cfg.direct_io else end
            r.entries = bytearray(entries)
            r.keys = bytearray(keys)
            r.count = len(entries) // F.ENTRY
            r.sum_start = 0
            r.direct = set()
            r.tail = (0, 0)
            self._table.activate(r)

    # -- at open ----------------------------------------------------------------------------
    def _room_left(self, dest: R.Region) -> int:
        """Live bytes (``format.measure``) that surely fit in the active region ``dest``."""
        keys = cast(bytearray, dest.keys)
        return self._cfg.region_size - F.FOOTER - F.BLOCK - dest.count * F.ENTRY - len(keys) - dest.pos

    def _holding(self) -> list[R.Region]:
        """Our regions other than the active one that hold live objects."""
        active = self._table.active
        return [r for r in self._table.regions.values() if not r.foreign and r.live_count > 0 and r is not active]

    def settle(self) -> int:
        """At open: leave at most ``regions_needed() - 1`` regions holding objects, so a region is always
        there to write into (a crash in the middle of a reclamation, or a smaller ``capacity``, can leave
        objects in every region).  The emptiest regions are reclaimed into a free one (or the active one);
        with no free file, the emptiest is first compacted within its own file (once); a region that still
        cannot be (no room anywhere) is dropped, the emptiest first, and its objects counted (``trimmed``).
        Returns the objects dropped."""
        need = self._cfg.regions_needed()
        dropped = 0
        in_place = False
        for _ in range(2 * len(self._table.regions) + 4):
            held = self._holding()
            if len(held) + (self._table.active is not None) <= need - 1:
                return dropped
            victim = min(held, key=lambda r: (r.live_bytes, r.seq))
            dest = self._table.active
            try:
                if dest is not None and victim.live_bytes > self._room_left(dest):
                    self.seal(dest)
                    dest = None
                if dest is None:
                    free, _ = self.free_regions()
                    if free:
                        dest = self.begin(free[0])
                    elif not in_place:  # (no file to move into: the emptiest is compacted within its own)
                        in_place = True
                        if self._reclaimer.compact_in_place() is not None:
                            continue
            except OSError as e:
                self._health.io_error(e, "making room at open")
                dest = self._table.active
            if dest is not None and victim.live_bytes <= self._room_left(dest):
                self._reclaimer.reclaim(victim, dest)
            else:
                dropped += self._drop_region(victim)
        while True:
            held = self._holding()
            if len(held) + (self._table.active is not None) <= need - 1 or not held:
                return dropped
            dropped += self._drop_region(min(held, key=lambda r: r.seq))

    def _drop_region(self, r: R.Region) -> int:
        """Drop every object of region ``r`` (named in the dead log; counted ``trimmed`` and ``objects_lost`` as
        the chunks stored they were: a large object once, its parts elsewhere with it)."""
        with self._locks.lock:
            slots = self._cat.index.in_region(r.index)
            offs = self._cat.index.offset[slots].tolist()
            for off, ln in zip(offs, self._cat.index.rec_len[slots].tolist()):
                self._cat.retire((r.index, off, ln))
            gone = self._cat.index.drop_slots(slots)
            n = self._cat.lose(*gone)
            self._counters.trimmed += n
            self._counters.objects_lost += n
            self._table.free(r)
            self._cat.mark_changed()  # (also when it held none)
        log.warning("ssd %s: no free region at open: dropped the %d objects of %s", self._cfg.path, n, r.path)
        return len(slots)

    def remove_surplus(self) -> None:
        """At open: delete region files beyond ``regions_needed()`` that hold no live object (highest index
        first), so the disk holds what the capacity provisions (after a reopen with a smaller one)."""
        need = self._cfg.regions_needed()
        mine = sorted(i for i, r in self._table.regions.items() if not r.foreign)
        for i in reversed(mine):
            if len(mine) <= need:
                break
            r = self._table.regions[i]
            if r is self._table.active or r.live_count > 0:
                continue
            self._io.close_region_fd(r)
            try:
                os.unlink(r.path)
            except FileNotFoundError:
                pass
            except OSError as e:
                self._health.io_error(e, f"removing {r.path}")
                continue
            with self._locks.lock:
                self._table.remove(i)
            mine.remove(i)
            self._counters.regions_removed += 1
            self._cat.mark_changed()
