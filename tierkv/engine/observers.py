"""Store observers: the hook ``TieredStore`` calls once per batch.

``Observers`` (held by ``TieredStore``) keeps the observers: after each
``put`` / ``get`` / ``lookup`` batch the store calls
``observer.observe(op, keys, result, seconds, sizes)`` outside its lock (``sizes``:
bytes per key, None for lookups); an observer's ``tier_stats()`` (``{tier: {...}}``)
is merged into ``stats()`` and its ``close()`` is called by ``close()``.  An
observer that raises is logged once and never reaches the caller; observers that
share state between threads lock it themselves.

The observers a store config turns on (``trace_path``, ``shadow``) are attached by
``tierkv.config_observers``, above the engine: this module imports no observer.

``RemovalListeners`` (held by ``TieredStore``, handed to the parts that remove chunks: the
``Placer`` evicting, ``Losses`` dropping what a medium lost, the store's ``remove``) keeps
the callables told of keys that left every tier.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("tierkv")


class Observers:
    """The observers of one store, in order (see the module docstring)."""

    def __init__(self) -> None:
        self.attached: list[Any] = []  # copy on write: batches in flight keep their list
        self._faults: set[tuple[int, str]] = set()

    def add(self, observer: Any) -> None:
        self.attached = [*self.attached, observer]

    def remove(self, observer: Any) -> None:
        self.attached = [o for o in self.attached if o is not observer]

    def observe(self, op: str, keys: list[str], result: Any, t0: float, prepared: Any) -> None:
        """Tell every observer of a batch that took since ``t0`` (``time.perf_counter``)."""
        dt = time.perf_counter() - t0
        sizes = None if prepared is None else [n for _, n in prepared]
        for obs in self.attached:
            try:
                obs.observe(op, keys, result, dt, sizes)
            except Exception as e:  # an observer's fault never reaches the caller  # noqa: BLE001 - a plug-in or medium fault is contained here by design
                self._failed(obs, "observe", e)

    def merge_stats(self, tiers: dict[str, dict[str, Any]]) -> None:
        """Merge each observer's ``tier_stats()`` into ``tiers``."""
        for obs in self.attached:
            try:
                extra = obs.tier_stats() if hasattr(obs, "tier_stats") else {}
                for name, d in extra.items():
                    tiers.get(name, {}).update(d)
            except Exception as e:  # noqa: BLE001 - a plug-in or medium fault is contained here by design
                self._failed(obs, "tier_stats", e)

    def close(self) -> None:
        for obs in self.attached:
            close = getattr(obs, "close", None)
            if close is None:
                continue
            try:
                close()
            except Exception as e:  # noqa: BLE001 - a plug-in or medium fault is contained here by design
                self._failed(obs, "close", e)

    def _failed(self, obs: Any, what: str, e: Exception) -> None:
        first = (id(obs), what) not in self._faults
        self._faults.add((id(obs), what))
        (log.warning if first else log.debug)("tierkv: observer %s %s failed: %s", type(obs).__name__, what, e)


class RemovalListeners:
    """The callables told of keys that left every tier (``TieredStore.add_removal_listener``): the one owner
    of that list (copied on write, so a notification in progress keeps the list it started with)."""

    def __init__(self) -> None:
        self._fns: list[Callable[[list[str]], None]] = []

    def add(self, fn: Callable[[list[str]], None]) -> None:
        self._fns = [*self._fns, fn]

    def remove(self, fn: Callable[[list[str]], None]) -> None:
        self._fns = [f for f in self._fns if f != fn]

    def tell(self, keys: list[str]) -> None:
        """Call every listener with ``keys``; one that raises is logged and never reaches the store's caller."""
        for fn in self._fns:
            try:
                fn(keys)
            except Exception as e:  # noqa: BLE001 - a listener's fault never reaches the store's caller
                log.warning("tierkv: removal listener %r failed: %s", fn, e)
