"""``EngineState``: the owners of one SSD tier's state, held together for ``SSDTier`` to hand out; ``EngineLocks``.

``EngineState`` is no shared field bag: it only builds and holds the owners, and ``SSDTier`` hands each
component the ones it needs (constructor arguments).  No component holds an ``EngineState``.

    ``config``     ``EngineConfig`` (``engineconfig.py``): settings and geometry, fixed once the tier is open
    ``table``      ``RegionTable`` (``regiontable.py``): regions, the active one, seqs, live bytes
    ``catalogue``  ``Catalogue`` (``catalogue.py``): index, dead log, ``changed``, ``has_large``; retiring
    ``counters``   ``SSDCounters`` (``counters.py``)
    ``locks``      ``EngineLocks`` (below)

Owners elsewhere: ``Health`` (``health.py``) the fault and the directory's lock, the ``Checkpointer`` its
bookkeeping, ``RegionIO`` the files that owe an fsync and the region images.

``SegmentWriter``, ``RecordReader``, ``RegionChanger``, ``Reclaimer`` and ``Checkpointer`` each use all five
owners, so their constructors begin alike ``(config, table, catalogue, locks, counters, health, io)``;
they stay separate arguments (``RegionIO`` takes the two it uses) so that a component names what it uses
and the owners are never one bundle that every component reaches through.
"""

from __future__ import annotations

import threading
from typing import Optional

from .catalogue import Catalogue
from .counters import SSDCounters
from .engineconfig import EngineConfig
from .regiontable import RegionTable


class EngineLocks:
    """The SSD engine's two locks, and what each guards.

    ``wlock`` serialises the writers: appends (``SegmentWriter``), region changes (``RegionChanger``),
    reclamation (``Reclaimer``) and checkpoints and flushes (``Checkpointer``).  It guards what only a
    writer changes: the region files and the active image's bytes, ``RegionTable``'s seqs and
    ``image_addr``, the dead log's file, the ``Checkpointer``'s bookkeeping and ``RegionIO``'s dirty
    files and images.  A reader takes it only to drop a large object that did not read whole.

    ``lock`` guards what readers look at beside a writer, held only briefly: ``RegionTable``'s regions,
    their states and live counts and ``active``; the ``Catalogue`` (the index, the dead log's pending
    entries, its flags); ``SSDCounters``; and ``Health``'s fault.  Order: ``wlock`` before ``lock``.
    """

    __slots__ = ("lock", "wlock")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.wlock = threading.Lock()


class EngineState:
    """The owners of one SSD tier's state (see the module docstring), built from the options as ``SSDTier``
    validated them."""

    __slots__ = ("catalogue", "config", "counters", "locks", "table")

    def __init__(self, name: str, what: str, path: str, capacity_bytes: int, region_size: int,
                 compression: Optional[str], checksum: str, fsync: str) -> None:
        self.config = EngineConfig(name, what, path, capacity_bytes, region_size, compression, checksum, fsync)
        self.locks = EngineLocks()
        self.counters = SSDCounters()  # (``counters.py``; changed under ``locks.lock``)
        self.table = RegionTable()
        self.catalogue = Catalogue(self.config, self.table)
