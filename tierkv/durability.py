"""What ``TieredStore.flush`` answers: which acknowledged chunks did not become durable, and why.

The contract (``docs/ssd.md``, "What survives, and what it costs"): after ``flush()`` returns, every chunk
acknowledged before the call is durable in every persistent ``write_behind`` tier whose
admission policy accepts it, **or the answer says which are not**.  A chunk is
*undurable* when the store gave up on its copy into such a tier (the queue was full,
the tier refused it: too large for it, no room, disk full; a read or a write failed, the
tier was unavailable) and no persistent tier holds it *now*, or it left the fast tiers
before its copy landed and its demotion failed too.  A chunk whose copy was given up but
that reached a persistent tier since (a demotion, a later copy, a put again) is durable;
a chunk removed by ``remove`` is not undurable: it is gone on purpose.

``DropLedger`` gathers those events under the store's lock: lifetime counts per reason
(``stats()``'s ``write_behind_dropped``, the exporter's counter), and the chunks not
durable now (``settle`` forgets those that became durable; ``flush`` names the rest, each
one by every ``flush`` until it is durable, and a chunk that left every tier by the first
``flush`` after it left), with one warning log line at most every ``LOG_EVERY`` seconds.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Optional

log = logging.getLogger("tierkv")

#: most keys one ``FlushResult`` lists (the counts are always whole)
KEYS_LIMIT = 65536
#: seconds between two warning lines about undurable chunks
LOG_EVERY = 10.0


class DropReason(enum.Enum):
    """Why a write-behind copy of an acknowledged chunk was given up."""

    QUEUE_FULL = "queue_full"  #: the write-behind queue was full (the device could not keep up)
    CLOSED = "closed"  #: queued after, or still queued at, ``close`` (its drain timed out)
    TOO_LARGE = "too_large"  #: larger than the persistent tier can ever hold
    NO_ROOM = "no_room"  #: no room could be made in the persistent tier
    DISK_FULL = "disk_full"  #: the tier's device is full (ENOSPC, quota)
    WRITE_FAILED = "write_failed"  #: the persistent tier failed the write
    READ_FAILED = "read_failed"  #: the chunk could not be read back from the tier above
    UNAVAILABLE = "unavailable"  #: the persistent tier was down
    EVICTED = "evicted"  #: evicted above before its copy landed, and its demotion failed
    COPY_FAILED = "copy_failed"  #: the background copy raised (logged)
    LOST = "lost"  #: the persistent tier lost chunks it had acknowledged (its files removed behind it, damage)


class TierFlushError(OSError):
    """A persistent tier's ``flush`` could not make everything it acknowledged durable (an fsync or a write
    failed).  Raised by ``Tier.flush``; ``TieredStore.flush`` names the tier in ``tier_errors`` and counts
    ``not_durable`` chunks (the tier's count of those written since its last good flush) as ``write_failed``."""

    def __init__(self, message: str, not_durable: int = 0) -> None:
        super().__init__(message)
        self.not_durable = not_durable


@dataclass(frozen=True)
class FlushResult:
    """What ``flush`` made durable; true only when everything acknowledged before it is durable.

    ``not_durable``: how many acknowledged chunks will not be in a persistent tier that
    admits them, with ``reasons`` (``DropReason`` value -> count) and ``keys`` (at most
    ``KEYS_LIMIT`` of them); ``pending``: copies still queued when ``timeout`` ran out
    (they may land later); ``tier_errors``: tier name -> why its flush (fsync) failed.
    """

    not_durable: int = 0
    reasons: dict[str, int] = field(default_factory=dict)
    keys: tuple[str, ...] = ()
    pending: int = 0
    tier_errors: dict[str, str] = field(default_factory=dict)

    @property
    def durable(self) -> bool:
        """Everything acknowledged before the flush is durable where it is admitted."""
        return not self.not_durable and not self.pending and not self.tier_errors

    @property
    def timed_out(self) -> bool:
        return self.pending > 0

    def __bool__(self) -> bool:
        return self.durable

    def __str__(self) -> str:
        if self.durable:
            return "flush: everything durable"
        parts = []
        if self.not_durable:
            why = ", ".join(f"{n} {r}" for r, n in sorted(self.reasons.items()))
            parts.append(f"{self.not_durable} chunks not durable ({why})")
        if self.pending:
            parts.append(f"{self.pending} copies still queued at the timeout")
        for name, err in sorted(self.tier_errors.items()):
            parts.append(f"tier {name} flush failed: {err}")
        return "flush: " + "; ".join(parts)


class DropLedger:
    """Undurable chunks: lifetime counts per reason, and the chunks not durable now.

    Not thread safe: the store calls it under its lock.
    """

    def __init__(self) -> None:
        self.totals: dict[DropReason, int] = dict.fromkeys(DropReason, 0)
        self._since: dict[str, DropReason] = {}  # key -> reason, not durable when last settled (first reason wins)
        self._left_out: dict[DropReason, int] = {}  # counted since the last take, keys not kept
        self._unlogged: dict[DropReason, int] = {}
        self._logged_at = 0.0

    @property
    def total(self) -> int:
        return sum(self.totals.values())

    def record(self, keys: Iterable[str], reason: DropReason) -> int:
        """Note ``keys`` as undurable for ``reason`` (a key already noted and not durable since counts once);
        returns how many were new."""
        since = self._since
        n = 0
        for key in keys:
            if key in since:
                continue
            if len(since) < KEYS_LIMIT:
                since[key] = reason
            else:
                self._left_out[reason] = self._left_out.get(reason, 0) + 1
            n += 1
        if not n:
            return 0
        self.totals[reason] += n
        self._unlogged[reason] = self._unlogged.get(reason, 0) + n
        self._maybe_log()
        return n

    def record_count(self, n: int, reason: DropReason) -> None:
        """Note ``n`` undurable chunks whose keys nobody can name (a medium reports only how many it lost)."""
        if n <= 0:
            return
        self._left_out[reason] = self._left_out.get(reason, 0) + n
        self.totals[reason] += n
        self._unlogged[reason] = self._unlogged.get(reason, 0) + n
        self._maybe_log()

    def _maybe_log(self) -> None:
        now = time.monotonic()
        if now - self._logged_at < LOG_EVERY or not self._unlogged:
            return
        self._logged_at = now
        why = ", ".join(f"{n} {r.value}" for r, n in self._unlogged.items())
        log.warning("tierkv: the copy into a persistent tier of %d acknowledged chunks was given up (%s); "
                    "flush() names those still not durable", sum(self._unlogged.values()), why)
        self._unlogged = {}

    def forget(self, keys: Iterable[str]) -> None:
        """``keys`` were removed: gone on purpose, no longer undurable."""
        since = self._since
        if since:
            for key in keys:
                since.pop(key, None)

    def settle(self, owed: Callable[[str], bool], present: Callable[[str], bool]) -> list[str]:
        """Forget the chunks durable now; returns those still held only in volatile tiers (``owed``: a later
        copy may still make them durable).  A chunk held nowhere (``present`` false) stays until the next
        ``take`` reports it."""
        still: list[str] = []
        durable: list[str] = []
        for key in self._since:
            if owed(key):
                still.append(key)
            elif present(key):
                durable.append(key)  # (a demotion, a later copy or a put again reached a persistent tier)
        for key in durable:
            del self._since[key]
        return still

    def not_durable(self, owed: Callable[[str], bool], present: Callable[[str], bool]) -> int:
        """How many acknowledged chunks are not durable now (what the next ``take`` would count)."""
        self.settle(owed, present)
        return len(self._since) + sum(self._left_out.values())

    def take(self, owed: Callable[[str], bool],
             present: Callable[[str], bool]) -> tuple[int, dict[str, int], tuple[str, ...]]:
        """(count, reason -> count, keys) of the chunks not durable now.  Those held nowhere any more, and
        those counted without a key, are reported by this take only; the others until they are durable."""
        self.settle(owed, present)
        since, left = self._since, self._left_out
        self._since = {key: r for key, r in since.items() if present(key)}
        self._left_out = {}
        reasons: dict[str, int] = {}
        for r in since.values():
            reasons[r.value] = reasons.get(r.value, 0) + 1
        for r, n in left.items():
            reasons[r.value] = reasons.get(r.value, 0) + n
        return sum(reasons.values()), reasons, tuple(since)

    def by_reason(self) -> dict[str, int]:
        """Lifetime counts per reason (every reason, zeros included)."""
        return {r.value: n for r, n in self.totals.items()}


#: a medium's ``extra_stats`` counters that say why it refused a write
FAULT_COUNTERS = (("enospc", DropReason.DISK_FULL), ("too_large", DropReason.TOO_LARGE))
#: a medium's ``extra_stats`` counter of acknowledged objects it lost on its own (ssd: its files removed)
LOST_COUNTER = "objects_lost"


def fault_counts(stats: Optional[dict]) -> dict[str, int]:
    """The ``FAULT_COUNTERS`` of a medium's ``extra_stats`` (zeros where it has none)."""
    stats = stats or {}
    out = {}
    for name, _ in FAULT_COUNTERS:
        try:
            out[name] = int(stats.get(name) or 0)
        except (TypeError, ValueError):
            out[name] = 0
    return out


def lost_count(stats: Optional[dict]) -> int:
    """A medium's ``LOST_COUNTER`` (0 where it has none)."""
    try:
        return int((stats or {}).get(LOST_COUNTER) or 0)
    except (TypeError, ValueError):
        return 0


def reason_of_failed_write(before: dict[str, int], after: dict[str, int]) -> DropReason:
    """Why a tier failed a write, from its fault counters before and after (ssd: ``enospc``,
    ``too_large``); ``WRITE_FAILED`` when they say nothing."""
    for counter, reason in FAULT_COUNTERS:
        if after.get(counter, 0) > before.get(counter, 0):
            return reason
    return DropReason.WRITE_FAILED
