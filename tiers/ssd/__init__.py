"""``ssd``: a log-structured store of chunks in large region files, surviving restarts.

``SSDTier`` (``tierkv.tiers.ssd:SSDTier``) is the medium; ``inspect_dir`` reports on a
directory for ``tierkv inspect`` without touching it.  Layouts: ``format.py``
(records, region headers, summaries), ``checkpoint.py``; the engine: ``tier.py``
(writes, reclamation), ``readpath.py``, ``persist.py``, ``recovery.py``; ``index.py``
the compact index; ``lock.py`` one writer per directory.

A directory in the former one-file-per-object layout is refused with a ``ConfigError``.
"""

from .format import CHECKSUMS, FLAG_CRC32C, FLAG_LZ4
from .inspect import inspect_dir
from .tier import DEFAULT_REGION, SSDTier

__all__ = ["CHECKSUMS", "DEFAULT_REGION", "FLAG_CRC32C", "FLAG_LZ4", "SSDTier", "inspect_dir"]
