"""The process's stores: one per store config, shared by the engine adapters of one process, leased.

The scheduler-side and worker-side connectors of one engine often share a process
(and a test or a script may build several engines in one); connectors with the same
store config must then see the same (private) tiers, so they share one store.

Ownership
    :data:`STORES` is the process's registry.  :meth:`StoreRegistry.acquire` builds the
    store on first use and hands out a :class:`StoreLease`; the store is flushed and
    closed when its last lease is released.  A lease is released exactly once,
    whichever comes first: :meth:`StoreLease.release` (the worker's shutdown), the
    lease being collected, or the interpreter's exit (a ``weakref.finalize`` per
    lease), so no path leaves a store open and none closes it twice.  A store
    that fails to build leaves nothing in the registry.

Identity
    Two configs are the same store when they are equal as JSON (keys sorted) or name
    the same file (its real path).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import weakref
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("tierkv.stores")


def config_identity(config: dict[str, Any] | str) -> str:
    """What makes two store configs the same store."""
    if isinstance(config, str):
        return "file:" + os.path.realpath(config)
    return "dict:" + json.dumps(config, sort_keys=True, default=str)


@dataclass
class _Entry:
    store: Any
    leases: int


class StoreLease:
    """One holder's use of a registry store; :meth:`release` it (idempotent) when done."""

    def __init__(self, registry: StoreRegistry, ident: str, store: Any) -> None:
        self.store = store
        self._finalizer = weakref.finalize(self, registry._drop, ident, store)

    @property
    def released(self) -> bool:
        return not self._finalizer.alive

    def release(self) -> None:
        """Give the store back; the last lease of a store flushes and closes it."""
        self._finalizer()


class StoreRegistry:
    """Stores by config identity, each with the count of its live leases."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}

    def acquire(self, config: dict[str, Any] | str) -> StoreLease:
        """A lease on the store of ``config``, built now if no live lease holds it."""
        from tierkv import TieredStore

        ident = config_identity(config)
        with self._lock:
            entry = self._entries.get(ident)
            if entry is None:
                entry = self._entries[ident] = _Entry(TieredStore.from_config(config), 0)
            entry.leases += 1
            return StoreLease(self, ident, entry.store)

    def open_stores(self) -> int:
        """How many stores are open (held by a live lease)."""
        with self._lock:
            return len(self._entries)

    def _drop(self, ident: str, store: Any) -> None:
        with self._lock:
            entry = self._entries.get(ident)
            if entry is None or entry.store is not store:
                return
            entry.leases -= 1
            if entry.leases > 0:
                return
            del self._entries[ident]
        try:
            store.flush()
        except Exception as e:  # noqa: BLE001 - a flush that fails still closes the store
            logger.warning("TierKVConnector: flushing the store failed: %s", e)
        finally:
            store.close()


#: this process's registry (connector.py leases its workers' stores from it)
STORES = StoreRegistry()
