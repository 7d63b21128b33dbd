"""Whole-region reclamation for ``SSDTier``: the emptiest sealed region's live objects move on.

Called by the writer (holding ``_wlock``) when only the spare region is free: the
spare becomes the active region, the victim's live records are copied into it (their
header re-stamped with the new region's seq), the victim's copies are named in the
dead log, and the victim becomes the new spare.  The provisioning of ``SSDTier``
guarantees the victim's live bytes fit with room to spare (see its module docstring).
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from typing import TYPE_CHECKING, Optional, cast

import numpy as np

from . import format as F
from . import region as R
from .deadlog import DeadLog
from .format import WRITE_UNIT
from .index import DigestIndex

log = logging.getLogger(__name__)


class Reclaim:
    # state of ``SSDTier`` (set in its ``__init__`` and ``Tier.__init__``)
    direct_io: bool
    region_size: int
    _lock: threading.Lock
    _regions: dict[int, R.Region]
    _index: DigestIndex
    _dead: DeadLog
    _live_total: int
    _changed: bool
    _counters: dict[str, int]
    _active: Optional[R.Region]
    path: str
    _dirty_fds: set[int]
    fsync: str

    if TYPE_CHECKING:  # defined by ``SSDTier`` and ``Persistence``
        def _count(self, what: str, n: int = 1) -> None: ...
        def _io_error(self, e: OSError, what: str) -> None: ...
        def _unlive(self, idx: int, rec_len: int) -> None: ...
        def _write_out(self, r: R.Region, end: int, data_end: int) -> bool: ...
        def regions_needed(self) -> int: ...
        def _seal(self, r: R.Region) -> None: ...
        def _free_regions(self, allow_new: bool = True) -> tuple[list[int], bool]: ...
        def _compact_in_place(self) -> Optional[R.Region]: ...
        def _begin(self, idx: int) -> R.Region: ...
        def _close_region_fd(self, r: R.Region) -> None: ...

    def _pick_victim(self) -> Optional[R.Region]:
        sealed = [r for r in self._regions.values() if r.state == R.SEALED and not r.foreign]
        return min(sealed, key=lambda r: (r.live_bytes, r.seq)) if sealed else None

    def _reclaim(self, victim: R.Region, dest: R.Region) -> None:
        """Re-append the victim's live objects into ``dest``, then free the victim."""
        self._count("gc_runs")
        with self._lock:
            slots = self._index.in_region(victim.index)
            offs = self._index.offset[slots].astype(np.int64)
            order = np.argsort(offs)
            slots, offs = slots[order], offs[order]
            lens = self._index.rec_len[slots].astype(np.int64)
        whole = None
        if len(slots) > 16:
            try:
                whole = R.read_span(victim.fd, 0, self.region_size, self.direct_io)
            except OSError as e:
                self._io_error(e, f"reading {victim.path}")
        data: memoryview | bytes
        for slot, off, ln in zip(slots.tolist(), offs.tolist(), lens.tolist()):
            try:
                data = whole[off:off + ln] if whole is not None else R.read_span(victim.fd, off, ln,
                                                                                 self.direct_io)
            except OSError as e:
                self._io_error(e, f"reading {victim.path}")
                data = b""
            h = F.parse_record(data, victim.seq)
            klen = len(h.key) if h is not None else 0
            if h is None or not dest.fits(ln, klen, self.region_size):
                self._count("corrupt" if h is None else "gc_dropped")
                with self._lock:
                    self._index.digest[slot] = F.TOMB
                    self._index.count -= 1
                    self._unlive(victim.index, ln)
                    self._dead.add(victim.index, off, victim.seq)
                    self._changed = True
                continue
            pos = dest.pos
            buf = cast(mmap.mmap, dest.buf)  # (the active image)
            buf[pos:pos + ln] = data
            F.reseq_record(buf, pos, dest.seq)
            end = F.align_up(pos + ln, F.ALIGN)
            d = F.key_digest(h.key)
            with self._lock:
                if self._index.digest.item(slot) <= F.TOMB or self._index.region.item(slot) != victim.index:
                    continue  # dropped meanwhile by a reader that found it corrupt
                self._index.move(slot, dest.index, pos)
                self._unlive(victim.index, ln)
                self._dead.add(victim.index, off, victim.seq)  # until the victim is reused
                m = F.measure(ln)
                dest.live_bytes += m
                dest.live_count += 1
                self._live_total += m
                dest.pos = end
                self._changed = True
            dest.add_entry(d, pos, ln, h.raw_len, h.key, h.flags)
            self._count("gc_relocated")
            if end - dest.written >= WRITE_UNIT:
                self._write_out(dest, F.align_down(end), end)
        with self._lock:
            victim.state = R.FREE
            victim.live_bytes = victim.live_count = 0
        self._settle_move(dest)

    def _settle_move(self, dest: R.Region) -> None:
        """Make a finished reclamation what a crash leaves: the new copies in the file (and, with ``fsync``
        other than ``"never"``, on the disk), then the victim's old copies named in the dead log.  Until the
        log names them a reopen finds both copies (the newer wins); after it, the victim is free."""
        end = F.align_up(dest.pos)
        if not self._write_out(dest, end, dest.pos):
            return  # (counted; the dead log waits for the next flush, which writes the copies first)
        try:
            if self.fsync != "never":
                os.fdatasync(dest.fd)
                self._dirty_fds.discard(dest.fd)
            self._dead.write(False)
        except OSError as e:
            self._io_error(e, "writing the dead log after a reclamation")


    # -- at open ----------------------------------------------------------------------------
    def _room_left(self, dest: R.Region) -> int:
        """Live bytes (``format.measure``) that surely fit in the active region ``dest``."""
        keys = cast(bytearray, dest.keys)
        return self.region_size - F.FOOTER - F.BLOCK - dest.count * F.ENTRY - len(keys) - dest.pos

    def _holding(self) -> list[R.Region]:
        """Our regions other than the active one that hold live objects."""
        return [r for r in self._regions.values() if not r.foreign and r.live_count > 0 and r is not self._active]

    def _settle(self) -> int:
        """At open: leave at most ``regions_needed() - 1`` regions holding objects, so a region is always
        there to write into (a crash in the middle of a reclamation, or a smaller ``capacity``, can leave
        objects in every region).  The emptiest regions are reclaimed into a free one (or the active one);
        with no free file, the emptiest is first compacted within its own file (once); a region that still
        cannot be (no room anywhere) is dropped, the emptiest first, and its objects counted (``trimmed``).
        Returns the objects dropped."""
        need = self.regions_needed()
        dropped = 0
        in_place = False
        for _ in range(2 * len(self._regions) + 4):
            held = self._holding()
            if len(held) + (self._active is not None) <= need - 1:
                return dropped
            victim = min(held, key=lambda r: (r.live_bytes, r.seq))
            dest = self._active
            try:
                if dest is not None and victim.live_bytes > self._room_left(dest):
                    self._seal(dest)
                    dest = None
                if dest is None:
                    free, _ = self._free_regions()
                    if free:
                        dest = self._begin(free[0])
                    elif not in_place:  # (no file to move into: the emptiest is compacted within its own)
                        in_place = True
                        if self._compact_in_place() is not None:
                            continue
            except OSError as e:
                self._io_error(e, "making room at open")
                dest = self._active
            if dest is not None and victim.live_bytes <= self._room_left(dest):
                self._reclaim(victim, dest)
            else:
                dropped += self._drop_region(victim)
        while True:
            held = self._holding()
            if len(held) + (self._active is not None) <= need - 1 or not held:
                return dropped
            dropped += self._drop_region(min(held, key=lambda r: r.seq))

    def _drop_region(self, r: R.Region) -> int:
        """Drop every object of region ``r`` (named in the dead log, counted ``trimmed``)."""
        with self._lock:
            slots = self._index.in_region(r.index)
            offs = self._index.offset[slots].tolist()
            for off, ln in zip(offs, self._index.rec_len[slots].tolist()):
                self._unlive(r.index, ln)
                self._dead.add(r.index, off, r.seq)
            self._index.digest[slots] = F.TOMB
            self._index.count -= len(slots)
            self._counters["trimmed"] += len(slots)
            r.state = R.FREE
            r.live_bytes = r.live_count = 0
            self._changed = True
        log.warning("ssd %s: no free region at open: dropped the %d objects of %s", self.path, len(slots), r.path)
        return len(slots)

    def _remove_surplus(self) -> None:
        """At open: delete region files beyond ``regions_needed()`` that hold no live object (highest index
        first), so the disk holds what the capacity provisions (after a reopen with a smaller one)."""
        need = self.regions_needed()
        mine = sorted(i for i, r in self._regions.items() if not r.foreign)
        for i in reversed(mine):
            if len(mine) <= need:
                break
            r = self._regions[i]
            if r is self._active or r.live_count > 0:
                continue
            self._close_region_fd(r)
            try:
                os.unlink(r.path)
            except FileNotFoundError:
                pass
            except OSError as e:
                self._io_error(e, f"removing {r.path}")
                continue
            with self._lock:
                del self._regions[i]
            mine.remove(i)
            self._counters["regions_removed"] += 1
            self._changed = True
