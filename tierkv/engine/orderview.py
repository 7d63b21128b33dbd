"""``OrderView``: a level's order as an eviction policy that follows it sees it.

Ownership: a ``LevelIndex`` (``tierkv/engine/levelindex.py``) hands one out (``LevelIndex.order``) to
the eviction policy of its level; the view reads the index's slots in their order and makes the one
change a policy may make, ``move_to_end`` (which reorders keys, never changes a slot's state, a pin
or a count).  It reads the index through its questions (``IndexQueries``), so it imports nothing
above them.  It yields exactly the READY slots, ``ready_count`` of them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import repeat
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from tierkv.engine.indexqueries import IndexQueries

class OrderView:
    """The level's order as an eviction policy that follows it sees it (``policies/eviction.py``, ``LevelOrder``).

    Iterating yields ``(key, footprint)`` of each READY entry, oldest first (a key enters the
    order when room is reserved for it); ``move_to_end`` is the one change a policy may make.
    The order never changes while the policy is not being called, and a policy changes it
    only after a walk is over.
    """

    __slots__ = ("_index", "_slots")

    def __init__(self, index: IndexQueries) -> None:
        self._index = index
        self._slots = index._slots

    def __iter__(self) -> Iterator[tuple[str, int]]:
        fp = self._index._value_footprint
        for key, v in self._slots.items():
            if type(v) is int and v > 0:  # READY (not reserved, not doomed)
                yield key, fp(v)

    def footprint(self, key: Any) -> int:
        """The footprint of ``key`` if it is READY, else -1."""
        return self._index.ready_footprint(key)

    def footprints(self, keys: list) -> Optional[list[int]]:
        """The footprint of each key when every one is READY, else None (C loops in the common case)."""
        return self._index.ready_footprints(keys)

    def move_to_end(self, keys: Sequence[Any]) -> None:
        """Put each key present (in any state) at the end of the order, in the order given."""
        slots = self._slots
        pop = slots.pop
        if type(keys) is list and len(set(keys)) == len(keys):
            got: list[Any] = list(map(pop, keys, repeat(None)))
            slots.update(zip(keys, got) if None not in got else [(k, v) for k, v in zip(keys, got) if v is not None])
            return
        for key in keys:
            v = pop(key, None)
            if v is not None:
                slots[key] = v

    def ready_count(self) -> int:
        """How many READY entries the order holds."""
        return self._index.ready_count

    def ready_bytes(self) -> int:
        """The sum of the READY entries' footprints."""
        return self._index.ready_bytes

    def settled(self) -> bool:
        """Whether every entry is READY (no reservation out, no doomed chunk still read)."""
        return len(self._slots) == self._index.ready_count

