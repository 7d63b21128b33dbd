"""``Durability``: the chunks acknowledged but not durable, and why (``tierkv.durability``).

A chunk a put acknowledged is owed to every write-behind level below the one it went to; when
a copy into a persistent level is given up (the level down, full, failing, the chunk evicted
first), the chunk is recorded in the drop ledger with its reason, and ``flush`` reports what
is still held only in volatile levels.  ``Durability`` owns that ledger and the media's fault
counters its reasons are read from; it asks the chain where keys are and which levels want
them.  The store builds one and hands it to the ``Placer`` (which the ``Copier`` shares).

Every method whose docstring says "lock held" expects the caller to hold the chain's lock.
"""

from __future__ import annotations

from tierkv.durability import DropLedger, DropReason, fault_counts, reason_of_failed_write
from tierkv.engine.chain import UNAVAILABLE, Chain
from tierkv.engine.level import Level


class Durability:
    """The drop ledger of one chain and the questions about it (see the module docstring)."""

    def __init__(self, chain: Chain) -> None:
        self._chain = chain
        #: acknowledged chunks whose copy into a persistent level was given up (``flush`` reports them)
        self.drops = DropLedger()
        #: level -> its medium's fault counters when last asked (``drop_reason``)
        self._faults_seen: dict[int, dict[str, int]] = {}

    def baseline_faults(self, k: int) -> None:
        """What level ``k``'s medium counted before now is no write's fault: keep its fault counters as the
        base ``drop_reason`` compares with (a medium whose stats fail leaves none).  Lock held or not."""
        try:
            self._faults_seen[k] = fault_counts(self._chain.levels[k].tier.extra_stats())
        except Exception:  # noqa: BLE001 - a medium's stats never cost the bookkeeping
            pass

    def drop_reason(self, k: int) -> DropReason:
        """Why level ``k`` failed a write just now, from its medium's fault counters.  Lock held."""
        try:
            now = fault_counts(self._chain.levels[k].tier.extra_stats())
        except Exception:  # noqa: BLE001 - a medium's stats never cost the bookkeeping
            now = {}
        seen = self._faults_seen.get(k)
        self._faults_seen[k] = now
        return reason_of_failed_write(seen if seen is not None else fault_counts(None), now)

    def wanted_below(self, j: int, mask: int, key: str, nbytes: int, down: list[str]) -> int:
        """The bits (``level.bit``) of the available write-behind levels below ``j`` that lack ``key`` and admit
        it (0: none).  Lock held.

        ``key`` is appended to ``down`` (once) when such a level would admit it but is unavailable.
        """
        wanted = 0
        for k in self._chain.behind:
            lvl = self._chain.levels[k]
            if k > j and not mask & lvl.bit and self._chain.admits(lvl, key, nbytes):
                if lvl.tier.available:
                    wanted |= lvl.bit
                elif not down or down[-1] != key:
                    down.append(key)
        return wanted

    def still_wanted(self, key: str) -> bool:
        """Whether ``key`` is READY above some write-behind level that lacks and admits it.  Lock held."""
        mask = self._chain.mask(key)
        if not mask:
            return False  # removed (or gone) meanwhile: nothing to make durable
        j = (mask & -mask).bit_length() - 1
        nbytes = self._chain.levels[j].ready_nbytes(key)
        down: list[str] = []
        return nbytes >= 0 and (bool(self.wanted_below(j, mask, key, nbytes, down)) or bool(down))

    def owed(self, key: str) -> bool:
        """Whether ``key`` is held (or being written) in some managed level and READY in no persistent one:
        a chunk whose copy was given up is durable again once a persistent level holds it.  Lock held."""
        levels = self._chain.levels
        return self._chain.busy(key) and not any(levels[k].holds(key) for k in self._chain.persistent)

    def undurable(self) -> list[str]:
        """Settle the drop ledger against what the levels hold now (those that reached a persistent level
        since are forgotten); returns those still held only in volatile levels.  Lock held."""
        return self.drops.settle(self.owed, self._chain.busy)

    def take_undurable(self) -> tuple[int, dict[str, int], tuple[str, ...]]:
        """What ``flush`` reports: the chunks not durable now (``DropLedger.take``).  Lock held."""
        return self.drops.take(self.owed, self._chain.busy)

    def not_durable(self) -> int:
        """How many acknowledged chunks are not durable now (``stats()``, health).  Lock held."""
        return self.drops.not_durable(self.owed, self._chain.busy)

    def note_evicted(self, j: int, keys: list[str]) -> None:
        """Victims of level ``j`` about to leave it without a demotion: note as undurable those a write-behind
        level below lacks and admits, and no level above holds.  Lock held."""
        lvl = self._chain.levels[j]
        lost = []
        for key in keys:
            nbytes = lvl.ready_nbytes(key)
            if nbytes < 0:
                continue  # removed meanwhile
            mask = self._chain.mask(key)
            if mask & (lvl.bit - 1):
                continue  # still held above
            down: list[str] = []
            if self.wanted_below(j, mask, key, nbytes, down) or down:
                lost.append(key)
        if lost:
            self.drops.record(lost, DropReason.EVICTED)

    def refused_below(self, lvl: Level, key: str, nbytes: int, flags: int) -> None:
        """Note why persistent level ``lvl`` took no copy of ``key`` (the placement's ``flags``)."""
        with self._chain.lock:
            if lvl.knows(key):
                return  # another writer holds it there (a demotion in flight): not lost
            if lvl.footprint(nbytes) > lvl.capacity:
                why = DropReason.TOO_LARGE
            elif flags & UNAVAILABLE:
                why = DropReason.UNAVAILABLE
            else:
                why = DropReason.NO_ROOM
            self.drops.record([key], why)
