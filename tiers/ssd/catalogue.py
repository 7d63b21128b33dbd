"""``Catalogue``: the SSD engine's objects — the index, the dead log, whether either changed since the last
checkpoint, and whether large objects are stored.

The catalogue owns the bookkeeping every component does alike when an object stops being one: its
record leaves its region's live count (``RegionTable``) and the dead log names it, so a reopen never
finds it again (``retire``); a large object's pieces go with it (``drop_pieces``, ``lose``).  The
components look objects up in ``index`` and add them there (``DigestIndex``'s own methods), name
records in ``dead`` (``DeadLog``), and tell the catalogue what happened instead of setting its flags:
``mark_changed`` (the index or dead log changed: the next checkpoint has work),
``note_large`` (a large object was stored: writes look for them).  Only the ``Checkpointer`` clears
``changed`` (``checkpointed``).

Locks (``state.EngineLocks``): every method, and every change to ``index`` and ``dead.pending``, is
called under ``lock``; writing the dead log's file is the writer's, under ``wlock``.
"""

from __future__ import annotations

import os
from typing import Optional

import numpy as np

from . import checkpoint as C
from . import deadlog
from . import format as F
from . import large as L
from .deadlog import DeadLog
from .engineconfig import EngineConfig
from .index import DigestIndex
from .regiontable import RegionTable

#: room a full file system keeps beyond a checkpoint's and the dead log's (see ``space_reserve``)
SPACE_SLACK = 256 << 10


class Catalogue:
    """The objects of one SSD tier (see the module docstring)."""

    dead: DeadLog  # (opened by ``open_dead`` once the directory is there)

    def __init__(self, config: EngineConfig, table: RegionTable) -> None:
        self._config = config
        self._table = table
        self.index = DigestIndex()
        self._changed = False
        self._has_large = False

    def open_dead(self) -> DeadLog:
        """Open the directory's dead log (with room reserved: removals are recorded on a full file system)."""
        self.dead = DeadLog(self._config.path)
        self.dead.reserve()
        return self.dead

    # -- flags ---------------------------------------------------------------------------------
    @property
    def changed(self) -> bool:
        """The index or the dead log changed since the last checkpoint."""
        return self._changed

    def mark_changed(self) -> None:
        self._changed = True

    def checkpointed(self) -> None:
        """A checkpoint covers the index as it is (``Checkpointer``)."""
        self._changed = False

    @property
    def has_large(self) -> bool:
        """A large object (``large.py``) was stored or found: writes and removals look for them."""
        return self._has_large

    def note_large(self) -> None:
        self._has_large = True

    def load_large(self, raw_len: np.ndarray) -> None:
        """At open: whether any object found (raw lengths ``raw_len``) is a large one."""
        self._has_large = bool(len(raw_len)) and bool((raw_len > self._config.geometry().single).any())

    # -- objects leaving -----------------------------------------------------------------------
    def retire(self, old: tuple, seq: Optional[int] = None) -> None:
        """A record that stopped being an object (``old``: the index's (region, offset, rec_len, ...)): its
        bytes leave the region's live count and the dead log names it, so a reopen never finds it again.
        ``seq``: the record's seq as a reader found it (default: its region's now)."""
        self._table.unlive(old[0], old[2])
        self.dead.add(old[0], old[1], self._table.regions[old[0]].seq if seq is None else seq)
        self._changed = True

    def drop_pieces(self, d: int, lo: int, hi: int) -> None:
        """Remove pieces ``lo`` to ``hi - 1`` of the large object of digest ``d``."""
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
        finds the manifest short drops it and counts it)."""
        n = len(digest)
        if not n or not self._has_large:
            return n
        geom = self._config.geometry()
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

    # -- room ----------------------------------------------------------------------------------
    def space_reserve(self) -> int:
        """Bytes of the file system kept for a checkpoint (a new one is written beside the old) and the dead
        log when deciding how many region files it can take."""
        sizes = 0
        for name in (C.NAME, deadlog.NAME):
            try:
                sizes += os.path.getsize(os.path.join(self._config.path, name))
            except OSError:
                pass
        want = len(self.index) * (F.ENTRY + 64) + self.index.nbytes  # (a checkpoint of what is indexed now)
        return 2 * max(sizes, want) + SPACE_SLACK
