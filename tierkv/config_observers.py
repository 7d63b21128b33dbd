"""The observers a store config turns on: request tracing and shadow caches.

Config keys (``tierkv.config``):

``"trace_path": PATH`` records every ``lookup`` as a hash-only request trace
(``tierkv.trace``: a ``StoreTracer`` writing through a ``TraceWriter``);
``"trace": {"max_bytes": "64MiB", "max_files": 8, "block_tokens": 256, "salt": "..."}``
tunes it and needs ``trace_path``.  ``"shadow": true`` or ``{"rate": 0.05,
"factors": [0.5, 2, 4]}`` estimates hit rates at other capacities
(``tierkv.shadow``); ``false`` or absent attaches none.

Ownership: ``TieredStore.from_config`` calls :func:`attach_from_config` once, after the
store is built; the observers it attaches belong to the store (its ``close()`` closes
them).  This module sits above the store engine: the engine's observer hook
(``tierkv.engine.observers``) knows observers only by their ``observe`` / ``tier_stats``
/ ``close`` methods and imports neither the tracer nor the shadow.
"""

from __future__ import annotations

from typing import Any

from tierkv.errors import ConfigError
from tierkv.options import check_bool, check_str
from tierkv.shadow import attach as attach_shadow
from tierkv.trace import StoreTracer, TraceWriter

SHADOW_OPTIONS = frozenset({"rate", "factors"})


def attach_from_config(store: Any, cfg: dict[str, Any]) -> None:
    """Attach the observers ``cfg`` asks for; on a bad value the store is closed and ``ConfigError`` raised."""
    try:
        path = cfg.get("trace_path")
        if cfg.get("trace") is not None and path is None:
            raise ConfigError("config key 'trace' needs 'trace_path'")
        if path is not None:
            opts = cfg.get("trace") or {}
            if not isinstance(opts, dict):
                raise ConfigError(f"config key 'trace' must be a mapping, got {opts!r}")
            store.add_observer(StoreTracer(TraceWriter.from_options(check_str(path, "config key 'trace_path'"),
                                                                    opts)))
        shadow = cfg.get("shadow")
        if shadow is not None and shadow is not False:
            if isinstance(shadow, dict):
                unknown = set(shadow) - SHADOW_OPTIONS
                if unknown:
                    raise ConfigError(f"config key 'shadow': unknown option(s) {sorted(unknown)}; known: factors, rate")
                attach_shadow(store, **shadow)
            else:
                check_bool(shadow, "config key 'shadow'")
                attach_shadow(store)
    except Exception:
        store.close()
        raise
