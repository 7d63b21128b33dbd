"""``ssd``: a log-structured store of chunks in large region files, surviving restarts.

``SSDTier`` (``tierkv.tiers.ssd:SSDTier``) is the medium; ``inspect_dir`` (``survey.py``) reports on
a directory for ``tierkv inspect`` without touching it.  Layouts: ``format.py`` (records, region
headers, summaries), ``checkpoint.py``, ``deadlog.py``, ``large.py`` (pieces and manifests).

The engine (its structure and invariants: ``tier.py``'s docstring): ``SSDTier`` (``tier.py``) is a
facade over components sharing one ``EngineState`` (``state.py``): ``SegmentWriter`` (``segmentwriter.py``,
with ``segment.py``), ``RecordReader`` (``recordreader.py``), ``RegionChanger`` (``regionchange.py``),
``Reclaimer`` (``reclaim.py``), ``Checkpointer`` (``checkpointer.py``) and ``RegionIO``
(``regionio.py``); ``reopen.py`` reads a directory at open, ``index.py`` is the compact index,
``lock.py`` one writer per directory.

A directory in the former one-file-per-object layout is refused with a ``ConfigError``.
"""

from .format import CHECKSUMS, FLAG_CRC32C, FLAG_LZ4
from .survey import inspect_dir
from .tier import DEFAULT_REGION, SSDTier

__all__ = ["CHECKSUMS", "DEFAULT_REGION", "FLAG_CRC32C", "FLAG_LZ4", "SSDTier", "inspect_dir"]
