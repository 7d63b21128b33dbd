"""The backend table: a config's ``"backend"`` name → the ``Backend`` class that builds it.

Entries are ``"package.module:Class"`` strings resolved on first use, so a
backend's client library is imported only when a tier selects it.  Adding a
backend is one ``register_backend`` call (or one line here); nothing else in
the remote tiers names a backend.
"""

from __future__ import annotations

from typing import cast

from tierkv.errors import ConfigError

from .. import load_object
from .client import Backend

#: backend name -> "module:Class" (resolved on first use) or the class itself
BACKENDS: dict[str, str | type[Backend]] = {
    "mooncake": "tierkv.tiers.remote.mooncake:MooncakeBackend",
    "memcache": "tierkv.tiers.remote.memcache:MemcacheBackend",
}

DEFAULT_BACKEND = "mooncake"


def register_backend(name: str, cls: type[Backend]) -> None:
    """Make ``{"backend": name}`` build ``cls``."""
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise TypeError(f"backend {name!r} must be a Backend subclass, got {cls!r}")
    BACKENDS[name] = cls


def backend_class(name: object, tier: str, medium: str) -> type[Backend]:
    """The backend ``name`` for a ``medium`` tier; ``ConfigError`` when unknown or unfit for the medium."""
    entry = BACKENDS.get(name) if isinstance(name, str) else None
    if entry is None:
        raise ConfigError(f"tier {tier!r} ({medium}): unknown backend {name!r}; known: {sorted(BACKENDS)}")
    if isinstance(entry, str):
        cls = load_object(entry, f"backend {name!r}")
        if not (isinstance(cls, type) and issubclass(cls, Backend)):
            raise ConfigError(f"backend {name!r} resolved to {cls!r}, which is not a Backend")
        BACKENDS[cast(str, name)] = cls  # (a str: only a str key found an entry)
    else:
        cls = entry
    if medium not in cls.media:
        fit = sorted(n for n, e in BACKENDS.items() if isinstance(e, type) and medium in e.media)
        raise ConfigError(f"tier {tier!r} ({medium}): backend {name!r} does not serve {medium}"
                          + (f"; use one of {fit}" if fit else ""))
    return cls
