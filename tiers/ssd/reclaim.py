"""Whole-region reclamation for ``SSDTier``: the emptiest sealed region's live objects move on.

Called by the writer (holding ``_wlock``) when only the spare region is free: the
spare becomes the active region, the victim's live records are copied into it (their
header re-stamped with the new region's seq), the victim's copies are named in the
dead log, and the victim becomes the new spare.  The provisioning of ``SSDTier``
guarantees the victim's live bytes fit with room to spare (see its module docstring).
"""

from __future__ import annotations

import mmap
import threading
from typing import TYPE_CHECKING, Optional, cast

import numpy as np

from . import format as F
from . import region as R
from .deadlog import DeadLog
from .format import WRITE_UNIT
from .index import DigestIndex


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

    if TYPE_CHECKING:  # defined by ``SSDTier`` and ``Persistence``
        def _count(self, what: str, n: int = 1) -> None: ...
        def _io_error(self, e: OSError, what: str) -> None: ...
        def _unlive(self, idx: int, rec_len: int) -> None: ...
        def _write_out(self, r: R.Region, end: int, data_end: int) -> bool: ...

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

