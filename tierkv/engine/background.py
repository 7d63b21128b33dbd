"""The background queue: the copies a store makes on its own (write-behind, promotion), off the caller's thread.

``submit`` never blocks the caller: when ``max_queued`` jobs already wait, the
new ones are dropped, counted and handed to ``on_drop`` with the reason (the device
cannot keep up; a chunk is still stored above and may reach the persistent tier
later by demotion).  A batch whose copy raises, and jobs still queued when ``close``
gives up waiting, go to ``on_drop`` too: ``flush`` reports every one of them.  One thread
drains the queue in batches through the ``run`` callback (the ``Copier``'s); ``drain``
waits until everything submitted so far has been handled (``flush`` and
``close`` use it).  A job names a chunk (a key, a key and a level), never a caller's
buffer: the background copy reads the chunk back from the tier that holds it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Optional

from tierkv.durability import DropReason

log = logging.getLogger("tierkv")


class BackgroundQueue:
    """A bounded queue of jobs and the one thread that runs them."""

    def __init__(self, run: Callable[[list[Any]], None], max_queued: int = 65536, batch: int = 256,
                 on_drop: Optional[Callable[[list[Any], DropReason], None]] = None) -> None:
        self._copy = run
        self._on_drop = on_drop
        self.max_queued = max_queued
        self._batch = batch
        self._queue: deque[Any] = deque()
        self._cv = threading.Condition()
        self._busy = False
        self._stop = False
        self._thread: Optional[threading.Thread] = None
        self.submitted = 0
        self.dropped = 0
        self.failed_batches = 0

    def submit(self, keys: Sequence[Any]) -> int:
        """Queue jobs; returns how many were dropped because the queue is full (or closed)."""
        if not keys:
            return 0
        with self._cv:
            if self._stop:
                self.dropped += len(keys)
                lost, why = list(keys), DropReason.CLOSED
            else:
                room = max(0, self.max_queued - len(self._queue))
                take = keys if len(keys) <= room else keys[:room]
                self._queue.extend(take)
                self.submitted += len(take)
                lost, why = list(keys[len(take):]), DropReason.QUEUE_FULL
                self.dropped += len(lost)
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="tierkv-copier", daemon=True)
                    self._thread.start()
                self._cv.notify_all()
        if lost:
            self._dropped(lost, why)
        return len(lost)

    def _dropped(self, keys: list[Any], why: DropReason) -> None:
        if self._on_drop is not None:
            try:
                self._on_drop(keys, why)
            except Exception as e:  # noqa: BLE001 - the bookkeeping of a drop never costs the caller
                log.warning("tierkv: write-behind drop report failed: %s", e)

    def pending(self) -> int:
        with self._cv:
            return len(self._queue) + (1 if self._busy else 0)

    def drain(self, timeout: Optional[float] = None) -> bool:
        """Wait until every job submitted so far has run (or failed); False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self._queue or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def close(self, timeout: Optional[float] = None) -> bool:
        """Drain, then stop the thread.  Jobs submitted afterwards are dropped."""
        done = self.drain(timeout)
        with self._cv:
            self._stop = True
            lost = list(self._queue) if not done else []
            self.dropped += len(lost)
            self._queue.clear()
            self._cv.notify_all()
            thread = self._thread
        if lost:
            self._dropped(lost, DropReason.CLOSED)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)
        return done

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._stop:
                    self._cv.wait()
                if not self._queue:
                    return
                batch = [self._queue.popleft() for _ in range(min(self._batch, len(self._queue)))]
                self._busy = True
            try:
                self._copy(batch)
            except Exception as e:  # a copy that fails costs the copy, never the thread  # noqa: BLE001 - a plug-in or medium fault is contained here by design
                self.failed_batches += 1
                log.warning("tierkv: background copy of %d chunks failed: %s", len(batch), e)
                self._dropped(batch, DropReason.COPY_FAILED)
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()
