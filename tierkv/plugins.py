"""Parts the store builds from its config but does not import: names resolved to ``"module:Name"`` on first use.

A store config may turn on request tracing (``"trace_path"``); the tracer and its
file writer live with the operator tools (``tierkv.tools.trace``), and the store
engine never imports a tool.  The engine asks this registry for them by name
(``plugin("store_tracer")``), so the dependency points from the registry's table to
the tool, is resolved only when a config asks for it, and a package may put its own
implementation under a name with ``register_plugin``.
"""

from __future__ import annotations

import importlib
from typing import Any

from tierkv.errors import ConfigError

#: name -> "package.module:Name" (imported on first use) or the object itself
PLUGINS: dict[str, Any] = {
    "store_tracer": "tierkv.tools.trace:StoreTracer",  # the observer a config's "trace_path" attaches
    "trace_writer": "tierkv.tools.trace:TraceWriter",  # the rotating hash-only trace file it writes through
}


def register_plugin(name: str, obj: Any) -> None:
    """Make ``plugin(name)`` answer ``obj`` (an object, or a ``"package.module:Name"`` string)."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"a plugin name must be a non-empty string, got {name!r}")
    PLUGINS[name] = obj


def plugin(name: str) -> Any:
    """The object registered under ``name``; a ``ConfigError`` when the name is unknown or its module fails to load."""
    entry = PLUGINS.get(name)
    if entry is None:
        raise ConfigError(f"unknown plugin {name!r}; known: {sorted(PLUGINS)}")
    if not isinstance(entry, str):
        return entry
    mod_name, sep, attr = entry.partition(":")
    if not sep or not mod_name or not attr:
        raise ConfigError(f"plugin {name!r}: {entry!r} is not 'package.module:Name'")
    try:
        obj = getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"plugin {name!r}: cannot load {entry!r}: {e}") from e
    PLUGINS[name] = obj
    return obj


__all__ = ["PLUGINS", "plugin", "register_plugin"]
