"""How a level receives the chunks stored above it: the ``persist`` option of a tier.

``write_behind`` (the default of a persistent managed medium) copies every admitted
chunk down on a background writer; ``write_through`` writes it within the put;
``on_evict`` only receives demotions (the default otherwise).  The mode is a
``PersistMode``; its values are the config spellings, and being a ``str`` it prints
and serialises (stats, JSON) as that spelling.

A contract module: it names what it reads of a medium (``Medium``: its ``persistent`` and
``managed`` flags, a tier's ``name``) as protocols and imports no medium, so the media,
the engine and the tools may all depend on it (``tests/test_import_direction.py``).
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any, Optional, Protocol

from tierkv.enums import StrEnum
from tierkv.errors import ConfigError
from tierkv.options import check_enum, pop_enum


class PersistMode(StrEnum):
    """How a level receives chunks stored above it (the tier option ``"persist"``)."""

    WRITE_BEHIND = "write_behind"  #: a background queue copies in every chunk stored above that it admits
    WRITE_THROUGH = "write_through"  #: copied in synchronously, before ``put`` returns
    ON_EVICT = "on_evict"  #: only demotions


#: the config spellings of ``persist``
PERSIST_MODES = tuple(m.value for m in PersistMode)


class Medium(Protocol):
    """What the default mode depends on: a medium's flags, read from a ``Tier`` or its class."""

    @property
    def persistent(self) -> bool: ...  #: its bytes survive the process

    @property
    def managed(self) -> bool: ...  #: the store does its accounting and eviction


class NamedMedium(Medium, Protocol):
    """A tier: its flags and its name (for the error a bad ``persist`` gets)."""

    @property
    def name(self) -> str: ...


def default_persist(medium: Medium | type[Medium]) -> PersistMode:
    """The mode of a tier of ``medium`` that gives no ``persist``: write-behind into a persistent managed medium."""
    return PersistMode.WRITE_BEHIND if (medium.persistent and medium.managed) else PersistMode.ON_EVICT


def pop_persist(options: MutableMapping[str, Any], what: str) -> Optional[PersistMode]:
    """Remove and check a tier config's ``persist`` (None when absent); the removed ``write_through`` is refused."""
    if "write_through" in options:
        raise ConfigError(f"{what}: option 'write_through' is no longer accepted: use "
                          "\"persist\": \"write_through\"")
    return pop_enum(options, "persist", None, what, PersistMode)


def resolve_persist(tier: NamedMedium, persist: Optional[str], write_through: Optional[bool] = None) -> PersistMode:
    """The level's persistence mode from its ``persist`` option (None: the medium's default).

    ``write_through`` is a removed option: giving it is a ``ConfigError`` naming ``"persist"``.
    """
    what = f"tier {tier.name!r}"
    if write_through is not None:
        raise ConfigError(f"{what}: option 'write_through' is no longer accepted: use "
                          "\"persist\": \"write_through\"")
    if persist is not None:
        return check_enum(persist, f"{what} option 'persist'", PersistMode)
    return default_persist(tier)
