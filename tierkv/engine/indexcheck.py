"""The invariant checker of a level's index: ``check_index`` and the error it raises.

Ownership: reads a ``LevelIndex`` (``tierkv/engine/levelindex.py``, whose docstring lists the
invariants) and changes nothing; ``Level.check`` calls it.  It walks the whole index: for tests and
diagnostics, never the hot path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tierkv.engine.indexqueries import Entry, size_value
from tierkv.engine.orderview import OrderView

if TYPE_CHECKING:
    from tierkv.engine.indexqueries import IndexQueries


class IndexInvariantError(AssertionError):
    """An invariant of a level's index does not hold (``check_index``)."""


def check_index(index: IndexQueries) -> None:
    """Verify every invariant of ``index`` (``levelindex``'s docstring); ``IndexInvariantError`` (an
    ``AssertionError``) naming each one that does not hold."""
    bad: list[str] = []
    used = ready_bytes = ready_count = 0
    codes: dict[int, str] = {}
    for key, v in index._slots.items():
        if type(v) is Entry:
            used += v.footprint
            if not v.doomed:
                bad.append(f"{key!r}: an Entry that is not doomed")
            if index._pins.get(key, 0) < 1:
                bad.append(f"{key!r}: doomed but no reader holds it (never freed)")
            continue
        if type(v) is not int or v == 0:
            bad.append(f"{key!r}: slot {v!r} is neither an int nor an Entry")
            continue
        nb, fp = index._unpack(v)
        used += fp
        if v > 0:
            ready_count += 1
            ready_bytes += fp
        if index.located:
            c = v if v > 0 else -v
            if c in codes:
                bad.append(f"{key!r} and {codes[c]!r} hold one location code {c}")
            codes[c] = key
        elif abs(v) != size_value(nb):
            bad.append(f"{key!r}: value {v} is not the shared value of its size {nb}")
        if v < 0 and key in index._pins:
            bad.append(f"{key!r}: a reservation is pinned")
    for key, n in index._pins.items():
        if n < 1 or key not in index._slots:
            bad.append(f"{key!r}: pinned {n} times, slot {index._slots.get(key)!r}")
        elif index.evictable_footprint([key]) is not None:
            bad.append(f"{key!r}: pinned but offered for eviction")
    if used != index.used:
        bad.append(f"used is {index.used}, the slots add up to {used}")
    if ready_count != index.ready_count or ready_bytes != index.ready_bytes:
        bad.append(f"ready_count/ready_bytes are {index.ready_count}/{index.ready_bytes}, "
                   f"the READY slots {ready_count}/{ready_bytes}")
    if index.used > index.tier.capacity_bytes:
        bad.append(f"used {index.used} exceeds the capacity {index.tier.capacity_bytes}")
    walked = list(OrderView(index))
    if len(walked) != ready_count or sum(fp for _, fp in walked) != ready_bytes:
        bad.append(f"the order yields {len(walked)} READY entries, the index holds {ready_count}")
    if index.ledger is not None and sum(index.ledger.usage.values()) != index.used:
        bad.append(f"the tenant ledger holds {sum(index.ledger.usage.values())} bytes, the index {index.used}")
    if bad:
        raise IndexInvariantError(f"tier {index.name!r}: " + "; ".join(bad[:8]))
