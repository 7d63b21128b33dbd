"""What a level indexes of the objects a persistent medium kept from an earlier process.

``plan_recovery`` is pure arithmetic over the columns a tier hands over (``Tier.recover_columns``):
no store, no medium, no per-object Python loop; ``recover`` applies the plan to a store's levels.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from tierkv.engine.level import Level

log = logging.getLogger("tierkv")


def recover(levels: list[Level]) -> dict[int, int]:
    """Index what persistent media kept from an earlier process: the newest that fit.  Returns, per level
    position, how many chunks the medium listed that did not fit and were deleted (trimmed: lost to the
    store; the store reports them at its first ``flush``).

    Bulk from end to end (nothing here runs per object in Python): the tier hands its objects over as
    columns (``recover_columns``), ``plan_recovery`` picks the newest version of each key and the
    newest keys whose footprints fit, and ``Level.adopt`` loads them, READY, into the index and the
    eviction policy.  Keys that do not fit are deleted from the medium.
    """
    trims: dict[int, int] = {}
    for k, lvl in enumerate(levels):
        if not (lvl.managed and lvl.tier.persistent):
            continue
        keys, sizes = lvl.tier.recover_columns()  # oldest first
        if not len(keys):
            continue
        room = lvl.capacity - lvl.used
        keep, sizes_kept, trimmed = plan_recovery(keys, sizes, lvl.footprint, room)
        if trimmed:
            lvl.tier.delete(trimmed)  # the configured capacity shrank: the oldest go
        if not lvl.adopt(keep, sizes_kept):  # some key listed twice: its newest entry counts
            keep, sizes_kept, more = plan_recovery(keys, sizes, lvl.footprint, room, distinct=True)
            if more:
                lvl.tier.delete(more)
            trimmed = [*trimmed, *more]
            lvl.adopt(keep, sizes_kept)
        if trimmed:
            trims[k] = len(set(trimmed).difference(keep))  # (a key listed twice, trimmed once and kept: kept)
            log.warning("tierkv: tier %s: %d chunks it kept did not fit its capacity and were deleted",
                        lvl.name, trims[k])
        log.info("tierkv: tier %s recovered %d chunks (%d bytes); dropped %d", lvl.name, len(keep), lvl.used,
                 len(keys) - len(keep))
    return trims


def plan_recovery(keys: list[str], sizes: Any, footprint: Any, room: int,
                  distinct: bool = False) -> tuple[list[str], np.ndarray, list[str]]:
    """Which recovered objects (oldest first) a level indexes: (kept keys, their nbytes, keys to delete).

    Of a key listed more than once the newest entry counts; then the newest keys whose footprints
    (``footprint(nbytes)``, asked once per distinct size) add up to at most ``room`` are kept, in their
    order, and the older rest is trimmed.  When everything fits, the keys are handed back as they are
    unless ``distinct`` asks for the newest entry of each first (``Level.adopt`` finds repeated keys on
    its own, at no cost).  Every step is a C-level operation over the whole list.
    """
    n = len(keys)
    sizes = np.asarray(sizes, dtype=np.int64).reshape(-1)
    if len(sizes) != n:
        raise ValueError(f"recovery listed {n} keys but {len(sizes)} sizes")
    for attempt in (0, 1):
        if n and sizes.min() == sizes.max():  # one size (the common case): no sort
            fps = np.full(n, footprint(int(sizes[0])), dtype=np.int64)
        else:
            uniq, inv = np.unique(sizes, return_inverse=True)
            fps = np.fromiter(map(footprint, uniq.tolist()), dtype=np.int64, count=len(uniq))[inv.reshape(-1)]
        if attempt or distinct or int(fps.sum()) > room:
            if attempt or len(set(keys)) == n:
                break
            newest = dict(zip(keys, range(n)))  # (a later entry of a key replaces its earlier one)
            pos = np.fromiter(newest.values(), dtype=np.int64, count=len(newest))
            del newest
            pos.sort()
            keys = list(map(keys.__getitem__, pos.tolist()))
            sizes = sizes[pos]
            n = len(keys)
            continue
        return keys, sizes, []
    if int(fps.sum()) <= room:
        return keys, sizes, []
    fit = int(np.searchsorted(np.cumsum(fps[::-1]), room, side="right"))  # how many of the newest fit
    cut = n - fit
    return keys[cut:], sizes[cut:], keys[:cut]
