"""Storage media.  ``MEDIA`` maps a config's ``"medium"`` name to its class.

Built-in media are imported lazily, so selecting ``hbm`` never imports a
distributed-store client and vice versa.  A config may also name any class as
``"package.module:Class"``; ``register_medium`` adds a name.
"""

from __future__ import annotations

import importlib

from tierkv.errors import ConfigError

from .base import Tier

#: medium name -> "module:Class" (resolved on first use) or the class itself
MEDIA: dict[str, object] = {
    "hbm": "tierkv.tiers.hbm:HBMTier",
    "dram": "tierkv.tiers.dram:DRAMTier",
    "ssd": "tierkv.tiers.ssd:SSDTier",
    "dram_pool": "tierkv.tiers.remote.media:DramPoolTier",
    "remote_npu": "tierkv.tiers.remote.media:RemoteNPUTier",
    "null": "tierkv.tiers.null:NullTier",  # payload-free, for the simulator
}


def register_medium(name: str, cls: type[Tier]) -> None:
    """Make ``{"medium": name}`` build ``cls``."""
    if not (isinstance(cls, type) and issubclass(cls, Tier)):
        raise TypeError(f"medium {name!r} must be a Tier subclass, got {cls!r}")
    MEDIA[name] = cls


def load_object(spec: str, what: str) -> object:
    """Import ``"package.module:Name"``; raises ``ConfigError`` naming ``what`` on failure."""
    mod_name, sep, attr = spec.partition(":")
    if not sep or not mod_name or not attr:
        raise ConfigError(f"{what}: {spec!r} is neither a known name nor 'package.module:Class'")
    try:
        mod = importlib.import_module(mod_name)
        return getattr(mod, attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{what}: cannot load {spec!r}: {e}") from e


def medium_class(name: str) -> type[Tier]:
    """The Tier class for a medium name or ``"package.module:Class"``."""
    if not isinstance(name, str):
        raise ConfigError(f"medium must be a string, got {name!r}")
    entry = MEDIA.get(name)
    if entry is None:
        if ":" not in name:
            raise ConfigError(f"unknown medium {name!r}; known: {sorted(MEDIA)} (or 'package.module:Class')")
        entry = name
    if isinstance(entry, str):
        cls = load_object(entry, f"medium {name!r}")
        if isinstance(cls, type) and issubclass(cls, Tier) and name in MEDIA:
            MEDIA[name] = cls
    else:
        cls = entry
    if not (isinstance(cls, type) and issubclass(cls, Tier)):
        raise ConfigError(f"medium {name!r} resolved to {cls!r}, which is not a Tier subclass")
    return cls


__all__ = ["MEDIA", "Tier", "load_object", "medium_class", "register_medium"]
