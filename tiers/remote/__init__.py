"""Remote tiers: ``dram_pool`` and ``remote_npu`` over distributed object stores.

Modules, one concern each:

    ``client``      what a backend provides: the ``RemoteClient`` protocol, ``Outcome``
                    (backend codes mapped to OK / NOT_FOUND / EXISTS / NO_SPACE / ...),
                    ``Backend`` / ``BackendSpec``
    ``options``     the options every remote tier shares (typed readers)
    ``backends``    the backend table (name → ``Backend`` class), resolved lazily
    ``mooncake``    Mooncake Store (embedded or standalone mode)
    ``memcache``    MemFabric memcache (Ascend; tested against a fake)
    ``session``     one client's worker threads: the deadline executor, background close,
                    memory registrations
    ``presence``    the short-lived cache of what the shared pool holds
    ``staging``     laying parts out for a backend; the host staging buffer
    ``pool``        ``RemotePoolTier``: availability, probing and the Tier operations
    ``media``       ``DramPoolTier`` and ``RemoteNPUTier`` (config → backend → tier)
    ``standalone``  running a standalone Mooncake pool (``mooncake_client``) on a node

Backends import only ``client`` and ``options``, never each other.  Importing
this package imports no backend library.
"""

from __future__ import annotations

from .client import Backend, BackendSpec, Outcome, RemoteClient
from .media import DramPoolTier, RemoteNPUTier
from .pool import RemotePoolTier

__all__ = ["Backend", "BackendSpec", "DramPoolTier", "Outcome", "RemoteClient", "RemoteNPUTier", "RemotePoolTier"]
