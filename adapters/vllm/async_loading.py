"""Loads that run between engine steps (option ``load_async``): one background thread per worker.

vLLM parks a request whose hit is loaded asynchronously (``WAITING_FOR_REMOTE_KVS``)
and keeps stepping the others.  :class:`AsyncLoads` takes each step's batch of such
loads and runs it on its own thread, one request after another (``run(specs)`` fills
the blocks and returns the :class:`~.loading.LoadJob` with the blocks that failed); it
hands back, from :meth:`AsyncLoads.take_finished`, the requests whose loads are over
together with every block that failed for them, so that the worker reports both in
the same step (a request is never released before its bad blocks are known).  Each
request is released as soon as its own load is over: in a burst of hits the first
need not wait for the last.

The blocks of a parked request stay allocated until the request is reported
here, even when it is aborted meanwhile (vLLM delays their free), so nothing is
ever written into a freed block: a load not yet started for a finished request
is skipped (:meth:`cancel`), one under way runs to its end.  :meth:`close` skips
what is queued and waits for the load under way.  Every request submitted is
reported exactly once, whatever happens to its load.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

from .metadata import LoadSpec

logger = logging.getLogger("vllm.tierkv.async_loading")


class AsyncLoads:
    """A queue of load batches, one thread running them, and the set of requests they finished.

    ``run(specs)`` loads the specs' blocks and returns an object with a
    ``failed_blocks`` set (a :class:`~.loading.LoadJob`); ``on_done(job)`` is told
    of each job run (statistics), on the loading thread.
    """

    def __init__(self, run: Callable[[list[LoadSpec]], Any], on_done: Callable[[Any], None] | None = None,
                 name: str = "tierkv-async-load") -> None:
        self._run = run
        self._on_done = on_done
        self._name = name
        self._cond = threading.Condition()
        self._queue: collections.deque[list[LoadSpec]] = collections.deque()
        self._thread: threading.Thread | None = None
        #: requests submitted and not yet taken by take_finished
        self._in_flight: set[str] = set()
        #: finished requests whose loads must not start
        self._cancelled: set[str] = set()
        self._done: set[str] = set()
        self._failed: set[int] = set()
        #: requests of those done with a block that failed (several KV cache groups report them so)
        self._failed_reqs: set[str] = set()
        self._busy = False
        self.closed = False

    # ---- the engine's side ---------------------------------------------------------
    def submit(self, specs: list[LoadSpec]) -> None:
        """Queue one step's loads; after :meth:`close` they fail at once (vLLM recomputes them)."""
        if not specs:
            return
        with self._cond:
            self._in_flight.update(s.req_id for s in specs)
            if self.closed:
                self._finish(specs, failed=True)
                return
            self._queue.append(list(specs))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def fail(self, specs: list[LoadSpec]) -> None:
        """Report the specs' requests finished with every block failed (nothing was written)."""
        with self._cond:
            self._in_flight.update(s.req_id for s in specs)
            self._finish(specs, failed=True)

    def cancel(self, req_ids: Iterable[str]) -> None:
        """These requests are finished: skip their loads not yet started (they are still reported)."""
        with self._cond:
            self._cancelled.update(r for r in req_ids if r in self._in_flight)

    def in_flight(self) -> set[str]:
        with self._cond:
            return set(self._in_flight)

    def take_finished(self) -> tuple[set[str], set[int]]:
        """Requests whose loads are over since the last call, and every block that failed for them."""
        with self._cond:
            done, failed = self._done, self._failed
            self._done, self._failed = set(), set()
            self._in_flight -= done
            self._cancelled -= done
            return done, failed

    def take_failed_requests(self) -> set[str]:
        """Requests a load failed for (a block or all of it), since the last call."""
        with self._cond:
            out, self._failed_reqs = self._failed_reqs, set()
            return out

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until nothing is queued or running; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._busy, timeout=timeout)

    def close(self, timeout: float | None = None) -> bool:
        """Skip the queued loads (reported as failed) and wait for the one under way; False on timeout."""
        with self._cond:
            self.closed = True
            while self._queue:
                self._finish(self._queue.popleft(), failed=True)
            self._cond.notify_all()
            thread = self._thread
        if thread is None:
            return True
        thread.join(timeout)
        return not thread.is_alive()

    # ---- the loading thread ---------------------------------------------------------
    def _finish(self, specs: list[LoadSpec], failed: bool, failed_blocks: Iterable[int] = ()) -> None:
        # caller holds the lock
        failed_blocks = set(failed_blocks)
        for s in specs:
            self._done.add(s.req_id)
            if failed and s.req_id not in self._cancelled:
                for g in range(1 if s.group_block_ids is None else len(s.group_block_ids)):
                    self._failed.update(s.ids_of(g))
                self._failed_reqs.add(s.req_id)
            elif failed_blocks and s.req_id not in self._cancelled:
                self._failed_reqs.add(s.req_id)  # (one request per call: see _run_group)
        self._failed.update(failed_blocks)
        self._cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self.closed)
                if not self._queue:
                    return  # closed, nothing left
                batch = self._queue.popleft()
                self._busy = True
            try:
                # one request at a time, each reported as soon as its own load is over: the first of a
                # step's hits is released at the next step's end, not when the last of them is in
                for group in _by_request(batch):
                    self._run_group(group)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _run_group(self, group: list[LoadSpec]) -> None:
        """Load one request's specs (skipped if it finished meanwhile) and report it."""
        with self._cond:
            # a finished request's blocks are about to be freed: never start writing them
            if group[0].req_id in self._cancelled:
                self._finish(group, failed=False)
                return
            if self.closed:  # closing: what has not started is skipped, as the queued loads are
                self._finish(group, failed=True)
                return
        job, failed_all = None, False
        try:
            job = self._run(group)
        except BaseException as e:  # noqa: BLE001 - a load that breaks is a miss; the thread goes on
            logger.warning("TierKVConnector: background load failed: %s; vLLM recomputes request %s",
                           e, group[0].req_id)
            failed_all = True
        if job is not None and self._on_done is not None:
            try:
                self._on_done(job)
            except Exception as e:  # noqa: BLE001 - bookkeeping never loses a load's verdict
                logger.debug("TierKVConnector: async load accounting failed: %s", e)
        with self._cond:
            self._finish(group, failed=failed_all,
                         failed_blocks=getattr(job, "failed_blocks", ()) if job is not None else ())


def _by_request(specs: list[LoadSpec]) -> list[list[LoadSpec]]:
    """The specs grouped by request, in the order their requests first appear."""
    groups: dict[str, list[LoadSpec]] = {}
    for s in specs:
        groups.setdefault(s.req_id, []).append(s)
    return list(groups.values())
