"""``Losses``: the store's index forgets what a persistent medium lost on its own.

A persistent medium may lose acknowledged objects without being asked (the ``ssd`` tier's files
removed behind it: ``Tier.objects_lost`` rises).  Its level's index would then still claim them, and
``lookup`` / ``contains`` / ``locate`` answer hits that every ``get`` misses.  So whenever a medium's
``objects_lost`` has risen since the last look (after a put, and at every ``flush``), the level's
READY keys are asked of the medium (one ``contains`` batch) and those it no longer holds are dropped
from the level, as a failed read drops a copy (a lease that held one lists it in ``unheld`` and
releases its pin); a key no other level holds is told to the removal listeners.  Costs nothing
while no medium loses anything (one integer read per persistent level); counting the lost chunks
(``DropReason.LOST``) stays with ``TieredStore.flush``.
"""

from __future__ import annotations

import logging

from tierkv.engine.chain import Chain
from tierkv.engine.leases import LeaseBook
from tierkv.engine.observers import RemovalListeners
from tierkv.engine.tierio import TierIO

log = logging.getLogger("tierkv")


class Losses:
    """Per persistent level, the medium's ``objects_lost`` as of the last look (see the module docstring)."""

    def __init__(self, chain: Chain, io: TierIO, removals: RemovalListeners, leases: LeaseBook) -> None:
        self._chain = chain
        self._leases = leases  # a lease holding a lost chunk says it no longer does (``unheld``)
        self._removals = removals  # told of the chunks a loss took from every tier
        self._io = io
        self._seen: dict[int, int] = {}
        for k, lvl in enumerate(chain.levels):
            if lvl.tier.persistent and lvl.managed:
                self._seen[k] = self._lost(k)  # (what was lost before the open is not in the index)

    def _lost(self, k: int) -> int:
        try:
            return int(self._chain.levels[k].tier.objects_lost)
        except Exception:  # noqa: BLE001 - a medium's count never costs a call
            return 0

    def notice(self) -> None:
        """Forget, in each level whose medium lost objects since the last look, the keys it no longer holds."""
        for k, seen in self._seen.items():
            now = self._lost(k)
            if now > seen:
                self._seen[k] = now
                self._forget(k)

    def _forget(self, k: int) -> None:
        chain = self._chain
        lvl = chain.levels[k]
        with chain.lock:
            keys = lvl.ready_keys()
        if not keys:
            return
        have = self._io.contains(lvl, keys)
        if have is None:  # (the medium failed: the next look asks again)
            self._seen[k] -= 1
            return
        gone = [key for key, h in zip(keys, have) if not h]
        if not gone:
            return
        with chain.lock:
            gone = [key for key in gone if lvl.holds(key)]
            self._leases.let_go(lvl, gone)
            for key in gone:
                lvl.drop(key)
            nowhere = [key for key in gone if not any(o.holds(key) for o in chain.levels if o.managed)]
        if nowhere:
            self._removals.tell(nowhere)
        log.warning("tierkv: tier %s lost %d chunks on its own (objects_lost): dropped from its index",
                    lvl.name, len(gone))
