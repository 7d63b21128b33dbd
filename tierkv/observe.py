"""Observers a store config turns on: ``trace_path`` (+ ``trace``) and ``shadow``.

``"trace_path": PATH`` records every ``lookup`` as a hash-only request trace
(``tierkv.trace``); ``"trace": {"max_bytes": "64MiB", "max_files": 8,
"block_tokens": 256, "salt": "..."}`` tunes it.  ``"shadow": true`` or
``{"rate": 0.05, "factors": [0.5, 2, 4]}`` estimates hit rates at other
capacities (``tierkv.shadow``).
"""

from __future__ import annotations

from typing import Any

from tierkv.errors import ConfigError
from tierkv.options import check_bool, check_str


def attach_from_config(store: Any, cfg: dict[str, Any]) -> None:
    """Attach the observers ``cfg`` asks for; on a bad value the store is closed and ``ConfigError`` raised."""
    try:
        path = cfg.get("trace_path")
        if cfg.get("trace") is not None and path is None:
            raise ConfigError("config key 'trace' needs 'trace_path'")
        if path is not None:
            from tierkv.trace import StoreTracer, TraceWriter

            opts = cfg.get("trace") or {}
            if not isinstance(opts, dict):
                raise ConfigError(f"config key 'trace' must be a mapping, got {opts!r}")
            store.add_observer(StoreTracer(TraceWriter.from_options(check_str(path, "config key 'trace_path'"),
                                                                    opts)))
        shadow = cfg.get("shadow")
        if shadow is not None and shadow is not False:
            from tierkv.shadow import attach

            if isinstance(shadow, dict):
                opts = dict(shadow)
                unknown = set(opts) - {"rate", "factors"}
                if unknown:
                    raise ConfigError(f"config key 'shadow': unknown option(s) {sorted(unknown)}; known: factors, rate")
                attach(store, **opts)
            else:
                check_bool(shadow, "config key 'shadow'")
                attach(store)
    except Exception:
        store.close()
        raise
