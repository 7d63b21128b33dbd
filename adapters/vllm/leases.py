"""What a lookup found, held until its load: one store lease per request, in the worker that owns the store.

A probe that names a request (``ProbeRequest.req_id``) leases every layer's
object of the chunks it reports (``TieredStore.lease``, for ``lease_timeout_s``),
so the chunks a hit counts on cannot be evicted before the load reads them.  The
lease lives where the store is, in the worker process, and is released there
exactly once, on whichever path comes first:

* the request's load is over (loaded or failed: ``Loader`` job settled, a load
  between steps reported done, or never started because the worker is closed);
* the scheduler says the lookup will not be loaded (``TierKVConnectorMetadata.
  lease_releases``: no blocks allocated for the hit, the request finished or
  aborted before its load, a new lookup of it);
* vLLM tells the worker the request finished or was aborted (``get_finished``) or
  preempted (the step's ``preempted``);
* a new probe of the same request (its lease is replaced);
* the worker shuts down, or the store closes;
* the deadline: the store releases it itself and counts it (``lease_expired``);
  the connector counts it too when the request's lease is then let go.

Thread-safe: probes arrive on the lookup channel's thread, loads end on the
engine's thread or the background loader's.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import Any

logger = logging.getLogger("vllm.tierkv.leases")


class RequestLeases:
    """Live leases by request id, and what became of them (``taken``, ``expired``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_req: dict[str, Any] = {}
        #: leases that held something, and those found expired when let go (since the last ``take_counts``)
        self.taken = 0
        self.expired = 0

    def hold(self, req_id: str, lease: Any) -> None:
        """Keep ``lease`` for ``req_id``, releasing the one an earlier lookup of it took."""
        with self._lock:
            old = self._by_req.pop(req_id, None)
            if lease.held:
                self.taken += 1
                self._by_req[req_id] = lease
        if old is not None:
            self._let_go(old)
        if not lease.held:
            lease.release()

    def release(self, req_ids: Iterable[str]) -> int:
        """Release the leases of these requests (those without one are ignored); how many were released."""
        with self._lock:
            if not self._by_req:
                return 0
            gone = [self._by_req.pop(r) for r in req_ids if r in self._by_req]
        for lease in gone:
            self._let_go(lease)
        return len(gone)

    def release_all(self) -> int:
        with self._lock:
            gone, self._by_req = list(self._by_req.values()), {}
        for lease in gone:
            self._let_go(lease)
        return len(gone)

    def held(self) -> set[str]:
        """The requests holding a lease now."""
        with self._lock:
            return set(self._by_req)

    def take_counts(self) -> tuple[int, int]:
        """``(taken, expired)`` since the last call."""
        with self._lock:
            out = self.taken, self.expired
            self.taken = self.expired = 0
        return out

    def _let_go(self, lease: Any) -> None:
        try:
            lease.release()
        except Exception as e:  # noqa: BLE001 - a store gone already holds nothing
            logger.debug("TierKVConnector: lease release failed: %s", e)
        if lease.expired:
            with self._lock:
                self.expired += 1
