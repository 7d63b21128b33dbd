"""How a level receives the chunks stored above it: the ``persist`` option of a tier.

``write_behind`` (the default of a persistent managed medium) copies every admitted
chunk down on a background writer; ``write_through`` writes it within the put;
``on_evict`` only receives demotions.  ``write_through: true`` is the older
spelling of ``persist: "write_through"``; giving both must agree.
"""

from __future__ import annotations

from typing import Optional

from tierkv.errors import ConfigError
from tierkv.options import check_bool, check_choice
from tierkv.tiers.base import Tier

#: how a level receives chunks stored above it
PERSIST_MODES = ("write_behind", "write_through", "on_evict")


def resolve_persist(tier: Tier, persist: Optional[str], write_through: Optional[bool]) -> str:
    """The level's persistence mode from the two options (``write_through`` is the older spelling)."""
    what = f"tier {tier.name!r}"
    if write_through is not None:
        write_through = check_bool(write_through, f"{what} option 'write_through'")
    if persist is not None:
        persist = check_choice(persist, f"{what} option 'persist'", PERSIST_MODES)
        if write_through is not None and write_through != (persist == "write_through"):
            raise ConfigError(f"{what}: 'write_through': {str(write_through).lower()} contradicts "
                              f"'persist': {persist!r} (give only 'persist')")
        return persist
    if write_through:
        return "write_through"
    return "write_behind" if (tier.persistent and tier.managed) else "on_evict"
