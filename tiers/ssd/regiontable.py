"""``RegionTable``: the SSD engine's regions — which files there are, which one is active, the seqs handed out
and the live bytes the regions hold.

The table owns these facts; the components read them (``regions``, ``active``, ``next_seq``,
``image_addr``, ``live_total``) and change them only through its methods, each of which says what
happened (an object entered or left a region, a region began or was sealed, a file was removed).
Invariant: ``live_total`` is the sum of the regions' ``live_bytes`` (``format.measure`` of every live
object), except while a region is being compacted in place (``left_restarted``).

Of a ``Region`` (``region.py``), the table changes its ``state``, ``seq`` (at open) and live counts; the
fields of its use as the active region (``buf``, ``pos``, ``written``, ``entries``, ``keys``, ``count``,
``direct``, ``tail``, ``sum_start``) are the writers' (``SegmentWriter``, ``RegionChanger``,
``Reclaimer``; ``Region.start`` begins them), and its file (``fd``, ``ino``) ``RegionIO``'s and the
changer's.

Locks (``state.EngineLocks``): the methods that change a region's live counts, the table or ``active``
are called under ``lock`` (readers look at them under it too); seqs and ``image_addr`` are changed by
the writer alone, under ``wlock``.  The table itself takes no lock.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Optional

import numpy as np

from . import format as F
from . import region as R


class RegionTable:
    """The regions of one SSD tier (see the module docstring)."""

    __slots__ = ("_active", "_image_addr", "_live_total", "_next_seq", "regions")

    def __init__(self) -> None:
        self.regions: dict[int, R.Region] = {}  # index -> Region; changed by ``add`` and ``remove`` only
        self._active: Optional[R.Region] = None
        self._next_seq = 1
        self._image_addr = 0
        self._live_total = 0

    # -- what the others read ----------------------------------------------------------------
    @property
    def active(self) -> Optional[R.Region]:
        """The region being written (its image in memory), if any."""
        return self._active

    @property
    def next_seq(self) -> int:
        """The seq the next region begun takes: above every seq ever handed out."""
        return self._next_seq

    @property
    def image_addr(self) -> int:
        """The address of the active region's image (``hostbuf.image_address``)."""
        return self._image_addr

    @property
    def live_total(self) -> int:
        """``format.measure`` of every live object."""
        return self._live_total

    # -- the files -----------------------------------------------------------------------------
    def add(self, r: R.Region) -> None:
        """Region file ``r`` (found at open, or begun) is the table's under its index."""
        self.regions[r.index] = r

    def remove(self, idx: int) -> None:
        """Region file ``idx`` was deleted (it held no live object)."""
        del self.regions[idx]

    # -- seqs and the active region ------------------------------------------------------------
    def start_seqs(self, high: int) -> None:
        """At open: ``high`` is the highest seq ever handed out (headers, checkpoint, dead log)."""
        self._next_seq = high + 1

    def take_seq(self) -> int:
        """Hand out the next seq (a region begun or compacted in place takes it)."""
        seq = self._next_seq
        self._next_seq += 1
        return seq

    def note_image(self, addr: int) -> None:
        """The active region's image (about to be) at ``addr``."""
        self._image_addr = addr

    def activate(self, r: R.Region) -> None:
        """``r`` (its image begun: ``Region.start``, or resumed) is the region written from now on."""
        r.state = R.ACTIVE
        self._active = r

    def sealed(self, r: R.Region) -> None:
        """The active region ``r`` was sealed (its summary on its way): no region is active until the next
        begins."""
        r.state = R.SEALED
        self._active = None

    def deactivate(self) -> None:
        """No region is active (its file removed, or the tier closing)."""
        self._active = None

    def found(self, r: R.Region, seq: int) -> None:
        """At open: ``r`` is a region of this directory's size, of ``seq``; sealed until its objects are
        counted (``load_live``)."""
        r.seq = seq
        r.state = R.SEALED

    def free_empty(self) -> None:
        """Every sealed region of ours holding no live object becomes free (reusing it costs no copy)."""
        for r in self.regions.values():
            if r.state == R.SEALED and r.live_count == 0 and not r.foreign:
                r.state = R.FREE

    # -- live bytes ----------------------------------------------------------------------------
    def enliven(self, r: R.Region, rec_len: int) -> None:
        """An object of ``rec_len`` bytes entered region ``r``."""
        m = F.measure(rec_len)
        r.live_bytes += m
        r.live_count += 1
        self._live_total += m

    def enliven_run(self, r: R.Region, measured: int, n: int) -> None:
        """``n`` objects entered region ``r``, ``measured`` their ``format.measure`` together."""
        r.live_bytes += measured
        r.live_count += n
        self._live_total += measured

    def unlive(self, idx: int, rec_len: int) -> None:
        """An object of ``rec_len`` bytes left region ``idx``."""
        o = self.regions[idx]
        m = F.measure(rec_len)
        o.live_bytes -= m
        o.live_count -= 1
        self._live_total -= m

    def left_restarted(self, measured: int) -> None:
        """An object of ``format.measure`` ``measured`` left a region compacted in place, whose own counts
        ``Region.start`` already reset (what moves is counted again by ``enliven``)."""
        self._live_total -= measured

    def free(self, r: R.Region) -> None:
        """Region ``r`` holds no live object any more (each one's leaving was counted): it may be reused."""
        r.state = R.FREE
        r.live_bytes = r.live_count = 0

    def emptied(self, r: R.Region) -> None:
        """Region ``r``'s objects are gone with its file, uncounted one by one: its live bytes leave the total,
        and it is free (its file is made again when it is reused)."""
        self._live_total -= r.live_bytes
        r.live_bytes = r.live_count = 0
        r.state = R.FREE

    def load_live(self, valid: Iterable[R.Region], region: np.ndarray, measured: np.ndarray) -> None:
        """At open: the objects kept, by region (``region``) and ``format.measure`` (``measured``); of the
        regions ``valid`` (those ``found``), each holding one is sealed, with its live bytes and count, the
        others free; ``live_total`` is their sum."""
        for r in valid:
            r.state = R.FREE
        if not len(region):
            return
        nreg = int(region.max()) + 1
        live = np.bincount(region, weights=measured, minlength=nreg)
        cnt = np.bincount(region, minlength=nreg)
        for idx in np.flatnonzero(cnt).tolist():
            r = self.regions[idx]
            r.state, r.live_bytes, r.live_count = R.SEALED, int(live[idx]), int(cnt[idx])
        self._live_total = int(measured.sum())
