"""``Reclaimer``: whole-region reclamation of the SSD engine — the emptiest sealed region's live objects move on.

Called by ``RegionChanger`` (holding ``wlock``) when only the spare region is free: the spare becomes the
active region, the victim's live records are copied into it (their header re-stamped with the new
region's seq), the victim's copies are named in the dead log, and the victim becomes the new spare
(``reclaim``).  The provisioning of ``SSDTier`` guarantees the victim's live bytes fit with room to spare
(see its module docstring).  On a full file system with no free file, the victim is compacted within its
own file instead (``compact_in_place``).  Uses the owners ``SSDTier`` hands it (``EngineConfig``,
``RegionTable``, ``Catalogue``, ``EngineLocks``, ``SSDCounters``: ``state.py``) and ``RegionIO``; calls
no other component.
"""

from __future__ import annotations

import logging
import mmap
import os
from typing import Optional, cast

import numpy as np

from . import format as F
from . import region as R
from .catalogue import Catalogue
from .counters import SSDCounters
from .engineconfig import EngineConfig
from .format import WRITE_UNIT
from .health import Health
from .regionio import RegionIO
from .regiontable import RegionTable
from .state import EngineLocks

log = logging.getLogger(__name__)


class Reclaimer:
    """Chooses a victim region and moves its live objects: into the spare (``reclaim``) or within its own
    file (``compact_in_place``)."""

    def __init__(self, cfg: EngineConfig, table: RegionTable, cat: Catalogue, locks: EngineLocks, counters: SSDCounters,
                 health: Health, io: RegionIO) -> None:
        # (the owners, as ``state.py`` lists them: alike in each component's constructor, as each uses all five)
        self._cfg, self._table, self._cat, self._locks, self._counters = cfg, table, cat, locks, counters
        self._health = health
        self._io = io

    def _live_records(self, victim: R.Region) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(index slots, offsets, record lengths) of the victim's live objects, in file order."""
        ix = self._cat.index
        with self._locks.lock:
            slots = ix.in_region(victim.index)
            offs = ix.offset[slots].astype(np.int64)
            order = np.argsort(offs)
            slots, offs = slots[order], offs[order]
            lens = ix.rec_len[slots].astype(np.int64)
        return slots, offs, lens

    def pick_victim(self) -> Optional[R.Region]:
        sealed = [r for r in self._table.regions.values() if r.state == R.SEALED and not r.foreign]
        return min(sealed, key=lambda r: (r.live_bytes, r.seq)) if sealed else None

    def reclaim(self, victim: R.Region, dest: R.Region) -> None:
        """Re-append the victim's live objects into ``dest``, then free the victim."""
        with self._locks.lock:
            self._counters.gc_runs += 1
        ix = self._cat.index
        slots, offs, lens = self._live_records(victim)
        whole = None
        if len(slots) > 16:
            try:
                whole = R.read_span(victim.fd, 0, self._cfg.region_size, self._cfg.direct_io)
            except OSError as e:
                self._health.io_error(e, f"reading {victim.path}")
        data: memoryview | bytes
        for slot, off, ln in zip(slots.tolist(), offs.tolist(), lens.tolist()):
            try:
                data = whole[off:off + ln] if whole is not None else R.read_span(victim.fd, off, ln,
                                                                                 self._cfg.direct_io)
            except OSError as e:
                self._health.io_error(e, f"reading {victim.path}")
                data = b""
            h = F.parse_record(data, victim.seq)
            klen = len(h.key) if h is not None else 0
            if h is None or not dest.fits(ln, klen, self._cfg.region_size):
                with self._locks.lock:
                    gone = ix.drop_slots(slice(slot, slot + 1))
                    self._cat.retire((victim.index, off, ln))
                    n = self._cat.lose(*gone)  # (a large object goes whole, counted once)
                    if h is None:
                        self._counters.corrupt += n
                    else:
                        self._counters.gc_dropped += n
                    self._counters.objects_lost += n
                continue
            pos = dest.pos
            buf = cast(mmap.mmap, dest.buf)  # (the active image)
            buf[pos:pos + ln] = data
            F.reseq_record(buf, pos, dest.seq)
            end = F.align_up(pos + ln, F.ALIGN)
            d = F.key_digest(h.key)
            with self._locks.lock:
                if ix.digest.item(slot) <= F.TOMB or ix.region.item(slot) != victim.index:
                    continue  # dropped meanwhile by a reader that found it corrupt
                ix.move(slot, dest.index, pos)
                self._cat.retire((victim.index, off, ln))  # (its old copy: named until the victim is reused)
                self._table.enliven(dest, ln)
                dest.pos = end
            dest.add_entry(d, pos, ln, h.raw_len, h.key, h.flags)
            with self._locks.lock:
                self._counters.gc_relocated += 1
            if end - dest.written >= WRITE_UNIT:
                self._io.write_out(dest, F.align_down(end), end)
        with self._locks.lock:
            self._table.free(victim)
        self.settle_move(dest)

    def settle_move(self, dest: R.Region) -> None:
        """Make a finished reclamation what a crash leaves: the new copies in the file (and, with ``fsync``
        other than ``"never"``, on the disk), then the victim's old copies named in the dead log.  Until the
        log names them a reopen finds both copies (the newer wins); after it, the victim is free."""
        end = F.align_up(dest.pos)
        if not self._io.write_out(dest, end, dest.pos):
            return  # (counted; the dead log waits for the next flush, which writes the copies first)
        try:
            if self._cfg.fsync != "never":
                os.fdatasync(dest.fd)
                self._io.clean(dest.fd)
            self._cat.dead.write(False)
        except OSError as e:
            self._health.io_error(e, "writing the dead log after a reclamation")

    def worth_reclaiming(self, victim: R.Region) -> bool:
        """Whether moving the victim's live objects leaves room for the largest object (always, when the
        provisioning holds; on a full file system, only once enough was removed)."""
        return victim.live_bytes <= self._cfg.usable - self._cfg.max_slot

    def compact_in_place(self) -> Optional[R.Region]:
        """The file system takes no more region files and none is free: the emptiest sealed region's live
        records are read into memory and it begins again, in its own file, under a new seq, holding them at
        its start (written out and synced at once).  None if no region would leave room.

        The one moment a crash can cost flushed objects: while this region's new start is being written,
        its moved objects are in memory only (the old copies are being overwritten).  A reopen then finds
        what reached the file (every record is checked against the region's new seq: a miss, never a wrong
        byte).  Counted: ``gc_in_place``."""
        ix = self._cat.index
        victim = self.pick_victim()
        if victim is None or victim.fd < 0 or not self.worth_reclaiming(victim):
            return None
        self._io.wait_seals(drop=victim)  # (a summary of its old use still due would land over its new one)
        slots, offs, lens = self._live_records(victim)
        whole = R.read_span(victim.fd, 0, self._cfg.region_size, self._cfg.direct_io)  # (OSError: the caller counts it)
        image = self._io.take_image()
        old_seq, new_seq = victim.seq, self._table.next_seq
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
        with self._locks.lock:
            self._counters.gc_runs += 1
            self._counters.gc_in_place += 1
            self._counters.gc_disk_full += 1
        with self._locks.lock:  # (readers find each object where it was until the region changes here, at once)
            self._table.note_image(self._io.address_of(image))
            victim.start(new_seq, self._cfg.region_size, image)
            self._cat.dead.mark(new_seq)
            self._table.take_seq()
            relocated = 0
            for slot, off, new, ln, raw_len, key, flags in moved:
                live = (ix.digest.item(slot) > F.TOMB and ix.region.item(slot) == victim.index
                        and ix.offset.item(slot) == off)
                m = F.measure(ln)
                if live:
                    self._table.left_restarted(m)
                    self._cat.dead.add(victim.index, off, old_seq)
                if new < 0 or not live:
                    if live:  # (its bytes were bad)
                        gone = ix.drop_slots(slice(slot, slot + 1))
                        n = self._cat.lose(*gone, drop=False)  # (a piece: its object is dropped, and counted, when read)
                        self._counters.corrupt += n
                        self._counters.objects_lost += n
                    elif new >= 0:  # (dropped by a reader meanwhile: its new copy is no object either)
                        victim.add_entry(F.key_digest(key), new, ln, raw_len, key, flags)
                        self._cat.dead.add(victim.index, new, new_seq)
                    continue
                ix.move(slot, victim.index, new)
                victim.add_entry(F.key_digest(key), new, ln, raw_len, key, flags)
                self._table.enliven(victim, ln)
                relocated += 1
            self._counters.gc_relocated += relocated
            victim.pos = pos
            self._table.activate(victim)
            self._cat.mark_changed()
        if self._io.write_out(victim, F.align_up(pos), pos) and self._cfg.fsync != "never":
            try:
                os.fdatasync(victim.fd)
            except OSError as e:
                self._health.io_error(e, f"fsync of {victim.path}")
        log.warning("%s: the file system is full: region %s compacted in place (%d objects moved); "
                    "writes go on in the room that leaves", self._cfg.what, victim.path, relocated)
        return victim
