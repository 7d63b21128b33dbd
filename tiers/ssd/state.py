"""``EngineState``: what the SSD engine's components still share — regions, index, dead log, locks.

Every component of ``SSDTier`` (``tier.py``) holds the one ``EngineState`` of its tier and reads and
changes it directly; the bookkeeping every component does alike (an object leaving a region, a large
object's pieces dropped) is here, once.  Parts with an owner of their own are not here: the fault and
the reporting of I/O errors are ``Health``'s (``health.py``, handed to each component that meets
one); ``counters`` is the tier's ``SSDCounters`` (``counters.py``), held here so that the components
add to it under ``lock``.

Locks: ``wlock`` serialises appends, region changes, reclamation and checkpoints (a component that
writes to the files holds it); ``lock`` guards the index, the regions' states and counters and
``active``, held only briefly, so reads run beside a writer.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Optional

import numpy as np

from . import checkpoint as C
from . import deadlog
from . import format as F
from . import large as L
from . import region as R
from .counters import SSDCounters
from .deadlog import DeadLog
from .index import DigestIndex

log = logging.getLogger(__name__)

REGIONS_DIR = "regions"
#: room a full file system keeps beyond a checkpoint's and the dead log's (see ``space_reserve``)
SPACE_SLACK = 256 << 10


class EngineState:
    """The shared state of one SSD tier's engine (see the module docstring); configuration as validated
    by ``SSDTier``.  ``region_size`` is the directory's (its stored regions') once the tier is open."""

    dead: DeadLog  # (made by the open, once the directory is there)

    def __init__(self, name: str, what: str, path: str, capacity_bytes: int, region_size: int,
                 compression: Optional[str], checksum: str, fsync: str) -> None:
        self.name = name
        self.what = what
        self.path = path
        self.capacity_bytes = capacity_bytes
        self.region_size = region_size
        self.compression = compression
        self.checksum = checksum
        self.fsync = fsync
        self.direct_io = False  # (probed by ``SSDTier`` before the open)
        self.lock = threading.Lock()
        self.wlock = threading.Lock()
        self.counters = SSDCounters()  # (``counters.py``; changed under ``lock``)
        self.regions: dict[int, R.Region] = {}
        self.active: Optional[R.Region] = None
        self.index = DigestIndex()
        self.live_total = 0  # ``F.measure`` of every live object
        self.changed = False  # the index changed since the last checkpoint
        self.next_seq = 1
        self.image_addr = 0  # the address of the active region's image
        self.has_large = False  # a large object was stored or found (``large.py``): writes look for them
        self._geom: Optional[L.Geometry] = None

    # -- geometry ------------------------------------------------------------------------------
    @property
    def usable(self) -> int:
        """Bytes of a region that records and the summary may take (header block and footer excluded)."""
        return self.region_size - 2 * F.BLOCK - F.FOOTER

    @property
    def max_slot(self) -> int:
        """The most one record takes (``F.measure``): an eighth of a region."""
        return self.usable // 8

    def regions_needed(self) -> int:
        """Region files the capacity provisions: ``ceil(capacity / (usable - max_slot)) + 2``."""
        per = self.usable - self.max_slot
        return -(-self.capacity_bytes // per) + 2

    def geometry(self) -> L.Geometry:
        """The size rule of this directory's region size (``large.py``)."""
        g = self._geom
        if g is None or g.region_size != self.region_size:
            g = self._geom = L.Geometry.of(self.region_size)
        return g

    @property
    def regions_dir(self) -> str:
        return os.path.join(self.path, REGIONS_DIR)

    def ensure_dirs(self) -> None:
        os.makedirs(self.regions_dir, mode=0o700, exist_ok=True)

    # -- bookkeeping ---------------------------------------------------------------------------
    def enliven(self, r: R.Region, rec_len: int) -> None:
        """An object of ``rec_len`` bytes entered region ``r``.  Caller holds ``lock``."""
        m = F.measure(rec_len)
        r.live_bytes += m
        r.live_count += 1
        self.live_total += m

    def unlive(self, idx: int, rec_len: int) -> None:
        """An object left region ``idx``.  Caller holds ``lock``."""
        o = self.regions[idx]
        m = F.measure(rec_len)
        o.live_bytes -= m
        o.live_count -= 1
        self.live_total -= m

    def retire(self, old: tuple) -> None:
        """A record that stopped being an object (``old``: the index's (region, offset, rec_len, ...)): its
        bytes leave the region's live count and the dead log names it, so a reopen never finds it again.
        Caller holds ``lock``."""
        self.unlive(old[0], old[2])
        self.dead.add(old[0], old[1], self.regions[old[0]].seq)
        self.changed = True

    def drop_pieces(self, d: int, lo: int, hi: int) -> None:
        """Remove pieces ``lo`` to ``hi - 1`` of the large object of digest ``d``.  Caller holds ``lock``."""
        for k in L.piece_keys(d, lo, hi):
            old = self.index.remove(F.key_digest(k.encode()))
            if old is not None:
                self.retire(old)

    def lose(self, digest, raw_len, drop: bool = True) -> int:
        """Objects of digests ``digest`` (raw lengths ``raw_len``, numpy arrays) left the index as lost (their
        file removed or damaged; the caller removed them): what is left of each large object one of them
        belonged to goes too (its manifest and every piece, ``large.py``: it can never read whole).  Returns
        how many chunks a user stored that makes: a large object counts once, its pieces never.  With
        ``drop`` false nothing more is removed, and a piece whose manifest stays counts nothing (the read that
        finds the manifest short drops it and counts it).  Caller holds ``lock``."""
        n = len(digest)
        if not n or not self.has_large:
            return n
        geom = self.geometry()
        ix = self.index
        gone = set(digest.tolist())
        at = np.flatnonzero((ix.raw_len > geom.single) & (ix.digest > F.TOMB))
        big = raw_len > geom.single
        manifests = [*zip(ix.digest[at].tolist(), ix.raw_len[at].tolist()),
                     *zip(digest[big].tolist(), raw_len[big].tolist())]
        for d, total in manifests:  # (a few: a large object is an eighth of a region or more)
            count = geom.layout(total)[0]
            pieces = sum(F.key_digest(k.encode()) in gone for k in L.piece_keys(d, 0, count))
            if d not in gone:
                if not pieces:
                    continue
                if not drop:
                    n -= pieces
                    continue
                n += 1  # (its pieces count as the one chunk below)
                old = ix.remove(d)
                if old is not None:
                    self.retire(old)
            n -= pieces
            if drop:
                self.drop_pieces(d, 0, count)
        return n

    def space_reserve(self) -> int:
        """Bytes of the file system kept for a checkpoint (a new one is written beside the old) and the dead
        log when deciding how many region files it can take."""
        sizes = 0
        for name in (C.NAME, deadlog.NAME):
            try:
                sizes += os.path.getsize(os.path.join(self.path, name))
            except OSError:
                pass
        want = len(self.index) * (F.ENTRY + 64) + self.index.nbytes  # (a checkpoint of what is indexed now)
        return 2 * max(sizes, want) + SPACE_SLACK
