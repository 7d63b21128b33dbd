"""A worker's bookkeeping: what its loads and saves moved, per interval, in total and per request.

The save thread, the background loader and the engine's thread all report here;
one lock guards every counter.  ``interval`` goes to vLLM with each step's stats
(:meth:`WorkerCounters.take_interval`), ``totals`` into the totals line and the
exit watcher, ``request_records`` into each finished request's log line.  Blocks
that failed to load wait here until vLLM asks for them
(:meth:`WorkerCounters.take_load_errors`).  Nothing here touches a store.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any

from .audit import AuditTally
from .connector_stats import RequestRecords, SaveTally, TierKVConnectorStats, add_tier_load
from .load_mode import LoadMode
from .loading import LoadJob

logger = logging.getLogger("vllm.tierkv.worker")

#: KV event drops are logged at most this often (each line counts those since the last)
EVENTS_LOG_EVERY_S = 60.0


class WorkerCounters:
    """The counters of one worker (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.interval = TierKVConnectorStats()
        self.totals = TierKVConnectorStats()
        self.request_records = RequestRecords()
        #: load jobs run, by where they ran: in the engine's step or between steps
        self.load_counts: dict[LoadMode, int] = dict.fromkeys(LoadMode, 0)
        #: the last load jobs' per-layer timestamps (submit, begin, end, wait_return)
        self.load_trace: collections.deque = collections.deque(maxlen=64)
        self._load_errors: set[int] = set()
        self._totals_sent: dict | None = None
        self._events_dropped_unlogged = 0
        self._events_logged_at: float | None = None

    def add_save(self, req_id: str, tally: SaveTally, audit: AuditTally | None = None) -> None:
        with self._lock:
            tally.add_to(self.interval)
            tally.add_to(self.totals)
            self.request_records.add_save(req_id, tally)
            if audit is not None and (audit.audits or audit.skipped):
                audit.add_to(self.interval.data)
                audit.add_to(self.totals.data)
                audit.add_to(self.request_records.record(req_id))

    def add_load(self, job: LoadJob, mode: LoadMode) -> None:
        """Count one finished load job; one run in the step (``SYNC``) has its failed blocks reported to vLLM
        at the step's end (an ``ASYNC`` one's go with its request: :meth:`add_load_errors`)."""
        elapsed = max(job.end) - job.submit_t if job.end else 0.0
        failed = set(job.failed_blocks)
        # each tier's share of the job's time, by its share of the tokens (the decline rule's samples;
        # a job that failed says nothing about a tier's speed)
        served = {t: n for t, n in job.hit_tokens.items() if t != "miss" and n > 0}
        total = sum(served.values())
        with self._lock:
            self.load_counts[mode] += 1
            if mode is LoadMode.SYNC:
                self._load_errors |= failed
            for s in (self.interval, self.totals):
                d = s.data
                d["load_requests"] += len(job.per_req)
                d["load_blocks"] += job.nblocks
                d["load_tokens"] += job.ntokens
                d["load_bytes"] += job.nbytes
                d["load_s"] += elapsed
                d["load_errors"] += len(failed)
                hits = d.setdefault("hit_tokens", {})
                for tier, n in job.hit_tokens.items():
                    hits[tier] = hits.get(tier, 0) + n
                if total and not failed and elapsed > 0:
                    for tier, n in served.items():
                        add_tier_load(d, tier, n, elapsed * n / total, 1)
            for rid, pr in job.per_req.items():
                rec = self.request_records.record(rid)
                rec["load_tokens"] += pr["tokens"]
                rec["load_bytes"] += pr["bytes"]
                rec["load_s"] += elapsed
                for tier, n in pr["hit_tokens"].items():
                    rec["hit_tokens"][tier] = rec["hit_tokens"].get(tier, 0) + n
                if rid in job.failed_reqs:
                    rec["load_errors"] += 1
            self.load_trace.append(job.trace())
        if failed:
            logger.warning("TierKVConnector: %d block(s) failed to load; vLLM recomputes them", len(failed))

    def add_step(self, tokens: int, seconds: float) -> None:
        """One engine step: ``tokens`` scheduled, computed in ``seconds`` (the decline rule's compute samples)."""
        self._add(steps=1, step_tokens=tokens, step_s=seconds)

    def _add(self, **counts: float) -> None:
        """Add ``counts`` to this interval's figures and the totals."""
        with self._lock:
            for s in (self.interval, self.totals):
                for name, n in counts.items():
                    s.data[name] = s.data.get(name, 0) + n

    def add_leases(self, taken: int, expired: int) -> None:
        """Leases the worker's lookups took, and those found expired when let go (their load may have failed)."""
        if not taken and not expired:
            return
        self._add(leases=taken, lease_expired=expired)
        if expired:
            logger.warning("TierKVConnector: %d lease(s) expired before their load (lease_timeout_s); their chunks "
                           "could be evicted", expired)

    def add_probe_cut(self, gone: int) -> None:
        """A lookup's reach cut at objects the store lost between the probe's ``locate`` and its lease."""
        self._add(lease_cuts=gone)

    def add_events(self, dropped: int, unmapped: int) -> None:
        """KV event records dropped (a full queue, or a failed ``locate``), and removed keys no chunk this worker
        wrote maps to."""
        if not dropped and not unmapped:
            return
        self._add(events_dropped=dropped, events_unmapped=unmapped)
        if not dropped:
            return
        # (a queue nothing drains drops with every step: one line a minute, with the count since the last)
        self._events_dropped_unlogged += dropped
        now = time.monotonic()
        if self._events_logged_at is None or now - self._events_logged_at >= EVENTS_LOG_EVERY_S:
            n, self._events_dropped_unlogged, self._events_logged_at = self._events_dropped_unlogged, 0, now
            logger.warning("TierKVConnector: %d KV event record(s) dropped: the worker's queue was full (vLLM did not "
                           "collect them: behind vLLM 0.32's MultiConnector it does not), or the store could not say "
                           "where a chunk lies", n)

    def add_load_errors(self, blocks: set[int]) -> None:
        """Blocks to report as failed at the next :meth:`take_load_errors` (a load between steps)."""
        with self._lock:
            self._load_errors |= blocks

    def take_load_errors(self) -> set[int]:
        with self._lock:
            out, self._load_errors = self._load_errors, set()
        return out

    def take_interval(self, due: bool) -> TierKVConnectorStats | None:
        """The interval's counters (a fresh interval starts), or None when it moved nothing, timed no step and
        ``due`` is false."""
        with self._lock:
            if self.interval.is_empty() and not due and not self.interval.data.get("steps"):
                return None
            out, self.interval = self.interval, TierKVConnectorStats()
        return out

    def reduced_totals(self) -> dict[str, Any]:
        with self._lock:
            return self.totals.reduce()

    def totals_if_changed(self) -> dict[str, Any] | None:
        """The reduced totals when they changed since the last call that returned them, else None."""
        reduced = self.reduced_totals()
        if reduced == self._totals_sent:
            return None
        self._totals_sent = reduced
        return reduced

    def summary(self, req_id: str) -> str | None:
        """The log line of a finished request (None when it moved nothing)."""
        with self._lock:
            rec = self.request_records.get(req_id)
            return RequestRecords.summary(req_id, rec) if rec is not None else None
