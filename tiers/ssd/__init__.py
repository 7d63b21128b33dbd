"""``ssd``: a log-structured store of chunks in large region files, surviving restarts.

``SSDTier`` (``tierkv.tiers.ssd:SSDTier``) is the medium; ``inspect_dir`` (``survey.py``) reports on
a directory for ``tierkv inspect`` without touching it.  Layouts: ``format.py`` (records, region
headers, summaries), ``checkpoint.py``, ``deadlog.py``, ``large.py`` (pieces and manifests).

The engine (its structure and invariants: ``tier.py``'s docstring): ``SSDTier`` (``tier.py``) is a
facade over components, each handed the owners of the state it uses (``state.py``): ``SegmentWriter``
(``segmentwriter.py``, with ``segment.py``), ``RecordReader`` (``recordreader.py``), ``RegionChanger`` (``regionchange.py``),
``Reclaimer`` (``reclaim.py``), ``Checkpointer`` (``checkpointer.py``) and ``RegionIO``
(``regionio.py``); ``reopen.py`` reads a directory at open, ``index.py`` is the compact index,
``lock.py`` one writer per directory.

Who owns what.  ``Health`` (``health.py``) owns the tier's fault, the directory's lock and the
reporting of I/O errors: every component that meets an error tells it (``io_error``,
``write_failed``, ``no_space``) and asks it whether the tier may write (``refusal``); only the probe
and a write that went through end a fault.  ``SSDCounters`` (``counters.py``) is the tier's typed
counters, one attribute per event, added to under ``EngineLocks.lock`` and named as strings only in
``extra_stats``.  ``Checkpointer`` owns the checkpoint's bookkeeping (what the last one covers, the
regions sealed since, the objects written since the last flush): ``SegmentWriter`` and
``RegionChanger`` tell it (``note_written``, ``note_sealed``) and ask it (``sealed_enough``).
``RegionIO`` owns the set of region files that owe an fsync: the others tell it (``note_dirty``,
``clean``) and ask it (``dirty``).  ``EngineConfig`` (``engineconfig.py``) holds the settings and
geometry, fixed once the tier is open.  ``RegionTable`` (``regiontable.py``) owns the regions, the
active one, the seqs handed out and the live bytes; ``Catalogue`` (``catalogue.py``) owns the index,
the dead log and what an object's leaving does (``retire``, ``lose``, ``drop_pieces``): the others
read them and change them through their methods, under the locks ``EngineLocks`` (``state.py``) names.

A directory in the former one-file-per-object layout is refused with a ``ConfigError``.
"""

from .format import CHECKSUMS, FLAG_CRC32C, FLAG_LZ4
from .survey import inspect_dir
from .tier import DEFAULT_REGION, SSDTier

__all__ = ["CHECKSUMS", "DEFAULT_REGION", "FLAG_CRC32C", "FLAG_LZ4", "SSDTier", "inspect_dir"]
