"""What a lookup found, held until its load: one store lease and its load plan per request, in the worker.

A probe that names a request (``ProbeRequest.req_id``) leases every slice's object
of the chunks it reports (``TieredStore.lease``, for ``lease_timeout_s``), so the
chunks a hit counts on cannot be evicted before the load reads them, and keeps the
probe's :class:`~.probe.LoadPlan` beside the lease: the chunks, their keys and
tiers, which the load reads without locating them again.  Both live where the
store is, in the worker process; the scheduler's metadata names the request (and
its blocks' hashes, which the plan must match) and nothing more.

Ownership
    :class:`RequestLeases` is the only owner of the worker's leases and the only
    code that releases one: every exit goes through :meth:`RequestLeases.release`
    (or its whole-book form at shutdown), which lets each lease go exactly once and
    counts the exit by :class:`LeaseEnd`.  The exits, whichever comes first:

    * ``LOADED``: the request's load is over (read, failed or skipped: a ``Loader``
      job settled, a load between steps reported, a load with nothing to fill);
    * ``NOT_LOADED``: the scheduler says the lookup will not be loaded
      (``TierKVConnectorMetadata.lease_releases``: no blocks allocated for the hit,
      the request finished or aborted before its load);
    * ``FINISHED``: vLLM tells the worker the request finished or was aborted
      (``get_finished``);
    * ``PREEMPTED``: the step's ``preempted``;
    * ``REPLACED``: a new probe of the same request (its lease and plan are replaced);
    * ``SHUTDOWN``: the worker shuts down.

    The store may end a lease on its own (its deadline, counted ``lease_expired``,
    or the store's close); the owner still lets go of it on one of the exits above
    and counts the expiry then.

Thread-safe: probes arrive on the lookup channel's thread, loads end on the
engine's thread or the background loader's.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from tierkv.engine.leases import Lease

    from .probe import LoadPlan

logger = logging.getLogger("vllm.tierkv.leases")


class LeaseEnd(enum.Enum):
    """Why a request's lease ended (see the module docstring)."""

    LOADED = "loaded"
    NOT_LOADED = "not_loaded"
    FINISHED = "finished"
    PREEMPTED = "preempted"
    REPLACED = "replaced"
    SHUTDOWN = "shutdown"


class _Held(NamedTuple):
    #: None: the lease held nothing (every key in a shared pool, say): the plan is kept all the same
    lease: Lease | None
    plan: LoadPlan


class RequestLeases:
    """Live leases and their load plans by request id, and what became of them.

    ``taken``/``expired``: leases that held something, and those found expired when
    let go (since the last :meth:`take_counts`); ``ends``: how many leases ended by
    each :class:`LeaseEnd` (since the worker started).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_req: dict[str, _Held] = {}
        self.taken = 0
        self.expired = 0
        self.ends: Counter[LeaseEnd] = Counter()

    def hold(self, req_id: str, lease: Lease | None, plan: LoadPlan | None) -> None:
        """Keep ``plan`` and the ``lease`` that holds its chunks for ``req_id``, ending what an earlier lookup
        of it kept (``REPLACED``).  A plan of no chunk is not kept; a lease that holds nothing is let go at
        once (its plan is kept: the load reads it, unprotected)."""
        keep = plan is not None and bool(plan.chunks)
        holding = keep and lease is not None and lease.held > 0
        with self._lock:
            old = self._by_req.pop(req_id, None)
            if keep:
                self.taken += holding
                self._by_req[req_id] = _Held(lease if holding else None, plan)  # type: ignore[arg-type]
        if old is not None:
            self._let_go([old], LeaseEnd.REPLACED)
        if lease is not None and not holding:
            lease.release()  # (holds nothing: never the owner's)

    def plans(self, req_ids: Iterable[str]) -> dict[str, LoadPlan]:
        """The plans held for these requests (those without a lease are left out).  A plan is never changed
        once held: a reader may keep it while its lease lives."""
        with self._lock:
            if not self._by_req:
                return {}
            return {r: h.plan for r in req_ids if (h := self._by_req.get(r)) is not None}

    def release(self, req_ids: Iterable[str], why: LeaseEnd = LeaseEnd.LOADED) -> int:
        """The one release path: end the leases of these requests for ``why`` (requests without one are
        ignored, so an exit noticed twice releases once); how many ended."""
        with self._lock:
            if not self._by_req:
                return 0
            gone = [self._by_req.pop(r) for r in set(req_ids) if r in self._by_req]
        self._let_go(gone, why)
        return len(gone)

    def release_all(self, why: LeaseEnd = LeaseEnd.SHUTDOWN) -> int:
        """End every lease (the worker shuts down); how many ended."""
        with self._lock:
            gone, self._by_req = list(self._by_req.values()), {}
        self._let_go(gone, why)
        return len(gone)

    def held(self) -> set[str]:
        """The requests holding a lease now."""
        with self._lock:
            return {r for r, h in self._by_req.items() if h.lease is not None}

    def take_counts(self) -> tuple[int, int]:
        """``(taken, expired)`` since the last call."""
        with self._lock:
            out = self.taken, self.expired
            self.taken = self.expired = 0
        return out

    def _let_go(self, gone: list[_Held], why: LeaseEnd) -> None:
        expired = 0
        for held in gone:
            if held.lease is None:
                continue
            try:
                held.lease.release()
            except Exception as e:  # noqa: BLE001 - a store gone already holds nothing
                logger.debug("TierKVConnector: lease release failed: %s", e)
            expired += bool(held.lease.expired)
        if gone:
            with self._lock:
                self.expired += expired
                self.ends[why] += len(gone)
