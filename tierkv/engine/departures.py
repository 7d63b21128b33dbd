"""``Departures``: the store's bounded memory of chunks that left it, and why (``tierkv.outcome.MissReason``).

The store records a *departure* whenever a chunk stops being servable for a reason an operator would
want named: it was evicted from the last tier holding it (``Placer.evict``), a put was refused by every
tier (``Writer``), a copy was dropped as corrupt or after a failed audit, a lease ran out, or
``TieredStore.remove(keys, reason=...)`` was told why.  Each record is (reason, tier, policy, monotonic
time); ``TieredStore.why_missing`` and ``TieredStore.departures`` answer from it.

Bounded: it keeps the last ``capacity`` departures (``miss_memory``, ``DEFAULT_MISS_MEMORY`` by default;
0 keeps none).  The N+1-th pushes out the oldest, whose key is then answered ``NEVER_STORED`` — which
reads "never stored, or not among the last N departures".  A key recorded twice holds two of the N
places; the newer record is the answer.

Cost: a batch shares one record object, so recording n keys is one C-level ``dict.update`` plus,
when the memory is full, a trim that touches each pushed-out key once (amortized O(1) per departure).
Nothing is done on a hit: the memory is asked only about keys already missed.  Thread-safe (its own lock).

Ownership: the store builds one (``TieredStore(miss_memory=...)``) and hands it to the parts that record
departures (``Placer``'s evictions, ``Writer``'s refusals, ``TierIO``'s corrupt drops) and answers from it
(``why_missing``, ``departures``, ``stats()``); only its own methods change it.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Optional

from tierkv.outcome import MissReason

#: departures remembered by default (about 200 bytes each with a 64-character key: ~13 MiB when full)
DEFAULT_MISS_MEMORY = 1 << 16


@dataclass(frozen=True)
class Departure:
    """One recorded departure: why, from which tier (None: every tier), by which policy (None: no policy),
    and when (``time.monotonic()``)."""

    reason: MissReason
    tier: Optional[str]
    policy: Optional[str]
    at: float

    def age(self, now: Optional[float] = None) -> float:
        """Seconds since the departure."""
        return (time.monotonic() if now is None else now) - self.at


class _Batch:
    __slots__ = ("keys", "record", "start")

    def __init__(self, keys: list[str], record: Departure) -> None:
        self.keys = keys
        self.record = record
        self.start = 0  # keys before it were pushed out already


class Departures:
    """The last ``capacity`` departures, key -> ``Departure``, and the misses explained by reason."""

    def __init__(self, capacity: int = DEFAULT_MISS_MEMORY) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"miss_memory must be an int >= 0, got {capacity!r}")
        self.capacity = capacity
        self._last: dict[str, Departure] = {}
        self._batches: deque[_Batch] = deque()
        self._held = 0  # departures in ``_batches`` not yet pushed out (<= capacity)
        self._lock = threading.Lock()
        #: misses explained so far, by reason (every reason present)
        self.counts: dict[MissReason, int] = dict.fromkeys(MissReason, 0)

    def __len__(self) -> int:
        """Departures remembered (at most ``capacity``)."""
        return self._held

    def record(self, keys: Sequence[str], reason: MissReason, tier: Optional[str] = None,
               policy: Optional[str] = None) -> None:
        """Remember that ``keys`` departed for ``reason`` (from ``tier``, by ``policy``), now.  ``tier`` None:
        they left every tier.  Any thread, the store's lock held or not.

        The engine records here every copy dropped for a reason a miss should name (a corrupt read, a
        refusal, an eviction from the last tier holding it): the memory is asked only about keys that are
        missing, so a copy another tier still serves costs nothing but one of the ``capacity`` places."""
        n = len(keys)
        if not n or not self.capacity:
            return
        keys = list(keys[-self.capacity:]) if n > self.capacity else list(keys)
        rec = Departure(MissReason(reason), tier, policy, time.monotonic())
        with self._lock:
            self._last.update(zip(keys, repeat(rec)))
            self._batches.append(_Batch(keys, rec))
            self._held += len(keys)
            if self._held > self.capacity:
                self._trim()

    def _trim(self) -> None:
        """Push out the oldest departures until ``capacity`` are left.  Lock held."""
        last, batches = self._last, self._batches
        over = self._held - self.capacity
        while over > 0:
            b = batches[0]
            take = min(over, len(b.keys) - b.start)
            rec = b.record
            for key in b.keys[b.start:b.start + take]:
                if last.get(key) is rec:  # (a newer record of the key stays)
                    del last[key]
            b.start += take
            over -= take
            self._held -= take
            if b.start == len(b.keys):
                batches.popleft()

    def forget(self, keys: Iterable[str]) -> None:
        """Drop what is remembered of ``keys`` (they are answered ``NEVER_STORED`` until they depart again)."""
        with self._lock:
            pop = self._last.pop
            for key in keys:
                pop(key, None)

    def recall(self, keys: Sequence[str]) -> list[Optional[Departure]]:
        """The last departure of each key (None where none is remembered)."""
        with self._lock:
            return list(map(self._last.get, keys))

    def explain(self, keys: Sequence[str], fallback: MissReason, count: bool = True) -> list[MissReason]:
        """The reason of each key: its last departure's, else ``fallback``; counted in ``counts`` if ``count``."""
        with self._lock:
            recs = list(map(self._last.get, keys, repeat(None)))
            if not self._last or recs.count(None) == len(recs):  # nothing remembered of them (the common case)
                out = [fallback] * len(recs)
            else:
                out = [fallback if r is None else r.reason for r in recs]
            if count and out:
                counts = self.counts
                for r, n in Counter(out).items():  # (counted in C)
                    counts[r] += n
        return out

    def count(self, reason: MissReason, n: int = 1) -> None:
        """Count ``n`` misses explained elsewhere (e.g. by an adapter that knows the namespace)."""
        with self._lock:
            self.counts[MissReason(reason)] += n

    def counts_by_reason(self) -> dict[str, int]:
        """``counts`` keyed by the reasons' words (every reason present, 0 when none)."""
        with self._lock:
            return {str(r): n for r, n in self.counts.items()}
