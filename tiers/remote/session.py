"""The session: one backend client, the worker threads that call it, and its memory registrations.

``Session.call`` is a deadline executor: it runs a blocking client call on a
worker and waits at most a deadline, so a caller never waits on a backend it
cannot abandon.  A call that had not started when its caller gave up is
cancelled and never runs; one that had started finishes on its worker, and an
``after`` hook cleans up after it whether or not anyone still waits.

Invariants
    * A client is never called after its ``close()``: after ``retire()`` no call
      starts; the client is closed by the thread that finishes the last in-flight
      call (or at once when idle), in the background (``close_in_background``:
      closing a Mooncake client takes seconds and holds the interpreter lock).
      A session whose call never returns is never closed.
    * Nothing outlives the interpreter: at exit every session is retired, its
      workers joined and its client closed (``_shut_down_at_exit``); an idle worker
      holds no reference to its last call (caller memory, registrations).
    * A registered address is never freed and reused while registered: a cached
      ``Registration`` holds a reference to the storage it covers.  Cached
      registrations are bounded by ``register_limit`` bytes and by
      ``REGISTER_COUNT_LIMIT`` entries (LRU: callers that hand a fresh small buffer
      to every call must not grow it without end); permanent ones
      (``pin(..., permanent=True)``) and pinned ones are never evicted.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from tierkv import shutdown

log = logging.getLogger("tierkv.tiers.remote")

#: the most cached (not permanent) registrations a session keeps, whatever their bytes
REGISTER_COUNT_LIMIT = 1024

TIMEOUT = object()  # a call that did not answer within its deadline (and, asked to be held, never started)
HELD = object()  # a call that ran past its deadline and was waited out: it has ended (``call``'s ``hold``)
LATE = object()  # a call that ran past its deadline and its hold too: it may still be running
REFUSED = object()  # the session was retired before the call could start

_closers: set[threading.Thread] = set()
_closers_lock = threading.Lock()
_sessions: weakref.WeakSet[Session] = weakref.WeakSet()  # every session not yet collected


def close_in_background(fn: Callable[[], None]) -> None:
    """Run a client's close (which takes seconds) off the caller's path; exit waits for it (``_shut_down_at_exit``)."""
    def run() -> None:
        try:
            fn()
        finally:
            with _closers_lock:
                _closers.discard(threading.current_thread())

    t = threading.Thread(target=run, name="tierkv-remote-close", daemon=True)
    with _closers_lock:
        _closers.add(t)
    t.start()


def _shut_down_at_exit(timeout: float = 30.0) -> None:
    """Retire and close every session before the interpreter finalizes.

    A worker thread still alive when the interpreter finalizes dies at its next attempt
    to take the interpreter lock, and a native destructor it runs then (the last
    reference to caller memory, a client) aborts the process.  So at exit every
    session is retired, its workers are joined, and its client is closed, on this
    thread when idle; a call that never returns keeps its session open (bounded wait,
    then a warning).
    """
    end = time.monotonic() + timeout
    sessions = [s for s in list(_sessions) if s.pid == os.getpid()]  # (a forked child's copies are its parent's)
    for s in sessions:
        s.retire(close=True, force=True)
    for s in sessions:
        for t in s._threads:
            t.join(max(0.0, end - time.monotonic()))
    with _closers_lock:
        pending = list(_closers)
    for t in pending:
        t.join(max(0.0, end - time.monotonic()))
    stuck = sum(1 for s in sessions if not s._closed_event.is_set())
    if stuck:
        log.warning("tierkv: %d remote client(s) still busy at exit; left open", stuck)


shutdown.at_exit(shutdown.CLIENTS, _shut_down_at_exit)


class Registration:
    """One registered storage: its base address, size, pin count; it keeps the storage alive."""

    __slots__ = ("external", "nbytes", "permanent", "pins", "ptr", "storage")

    def __init__(self, ptr: int, nbytes: int, storage: Any, permanent: bool) -> None:
        self.ptr, self.nbytes, self.storage, self.pins, self.permanent = ptr, nbytes, storage, 0, permanent
        self.external = False  # registered by someone else: never unregistered by the tier


class Session:
    """One backend client, its worker threads and its memory registrations.

    ``call`` runs a function on a worker and waits at most a deadline; a call that
    has not started when its caller gives up is cancelled and never runs.  After
    ``retire()`` no call starts; the client is closed by the thread that finishes
    the last in-flight call (or at once when idle).  A session whose call never
    returns is simply never closed.
    """

    def __init__(self, client: Any, workers: int, register_limit: int) -> None:
        self.client = client
        self.register_limit = register_limit
        self._lock = threading.Lock()
        self._inflight = 0
        self.retired = False
        self._close_wanted = False
        self._closed = False
        self._closed_event = threading.Event()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._regs: collections.OrderedDict[int, Registration] = collections.OrderedDict()
        self._cached_bytes = 0
        self._cached_count = 0
        self.external_regions = 0
        self._threads = [threading.Thread(target=self._work, name=f"tierkv-remote-{i}", daemon=True)
                         for i in range(workers)]
        for t in self._threads:
            t.start()
        self.pid = os.getpid()
        _sessions.add(self)

    # -- in-flight accounting: the only guard between calls and close() --------
    def _enter(self) -> bool:
        with self._lock:
            if self.retired:
                return False
            self._inflight += 1
            return True

    def _leave(self) -> None:
        with self._lock:
            self._inflight -= 1
            close_now = self.retired and self._close_wanted and self._inflight == 0 and not self._closed
            if close_now:
                self._closed = True
        if close_now:
            close_in_background(self._close_client)

    def retire(self, close: bool = True, force: bool = False) -> None:
        """Accept no new call.  With ``close`` the client is closed once idle; without, it is left alone
        until the process exits (closing holds the interpreter lock for seconds, which a running engine
        must not see).  ``force`` (at exit): close even a client retired earlier without ``close``, on
        this thread when idle."""
        with self._lock:
            first = not self.retired
            self.retired = True
            self._close_wanted = self._close_wanted or close
            close_now = self._close_wanted and self._inflight == 0 and not self._closed
            if close_now:
                self._closed = True
            if first:
                for _ in self._threads:
                    self._queue.put(None)
        if close_now:
            if force:
                self._close_client()
            else:
                close_in_background(self._close_client)

    def wait_closed(self, timeout: float) -> bool:
        return self._closed_event.wait(timeout)

    def _close_client(self) -> None:
        self._regs.clear()
        try:
            self.client.close()
        except Exception as e:  # noqa: BLE001 (closing is best effort)
            log.debug("closing a remote client failed: %r", e)
        self._closed_event.set()

    # -- calls --------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, fut, after = item
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(self.client))
                except BaseException as e:  # noqa: BLE001 (handed to the caller)
                    fut.set_exception(e)
            if after is not None:
                try:
                    after(fut)
                except Exception as e:  # noqa: BLE001
                    log.debug("remote call cleanup failed: %r", e)
            # an idle worker holds nothing of its last call (its buffers, its registrations)
            item = fn = fut = after = None
            self._leave()

    def call(self, fn: Callable[[Any], Any], deadline: float,
             after: Callable[[concurrent.futures.Future], None] | None = None, hold: float = 0.0) -> Any:
        """``fn(client)`` on a worker; its result, or ``TIMEOUT`` / ``HELD`` / ``LATE`` / ``REFUSED``.

        ``after(future)`` runs on the worker once the call has finished or was
        cancelled, whether or not the caller still waits (cleanup of abandoned calls).
        Exceptions raised by ``fn`` are re-raised here.

        ``hold``: a call that had started when its deadline passed may still write
        into memory its caller owns; with ``hold`` the caller keeps waiting, at most
        that many seconds more, until it has ended (``HELD``; its result is not
        used), and learns ``LATE`` when it still runs after that.  A call that had
        not started is cancelled and never runs (``TIMEOUT``).
        """
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:  # queued before retire() queues the workers' stop marks, or not at all
            if self.retired:
                return REFUSED
            self._inflight += 1
            self._queue.put((fn, fut, after))
        try:
            return fut.result(timeout=deadline)
        except concurrent.futures.TimeoutError:
            if fut.cancel() or hold <= 0:  # (cancel succeeds only if it had not started: then it never runs)
                return TIMEOUT
        done, _ = concurrent.futures.wait([fut], timeout=hold)
        return HELD if done else LATE

    @contextlib.contextmanager
    def hold(self) -> Iterator[bool]:
        """Keep the client open for the block (the caller uses memory the client owns); yields False, and
        holds nothing, when the session is retired."""
        entered = self._enter()
        try:
            yield entered
        finally:
            if entered:
                self._leave()

    def direct(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(client)`` on the calling thread, for local, non-blocking client calls (registration)."""
        if not self._enter():
            return REFUSED
        try:
            return fn(self.client)
        finally:
            self._leave()

    # -- registrations ---------------------------------------------------------
    def pin(self, t: torch.Tensor, permanent: bool = False) -> Registration | None:
        """Register (or find registered) the storage under ``t``; pinned until ``unpin``. None on failure."""
        storage = t.untyped_storage()
        base, nbytes = storage.data_ptr(), storage.nbytes()
        with self._lock:
            reg = self._regs.get(base)
            if reg is not None and reg.nbytes >= nbytes:
                self._regs.move_to_end(base)
                reg.pins += 1
                if permanent and not reg.permanent:  # (a cached one made permanent leaves the LRU's count)
                    reg.permanent = True
                    self._cached_bytes -= reg.nbytes
                    self._cached_count -= 1
                return reg
        rc = self.direct(lambda c: c.register(base, nbytes))
        if rc is REFUSED:
            return None
        external = rc != 0
        if external:
            # refused, most often because this memory overlaps a region the owner of the client registered
            # itself; the transfer is tried anyway: an unregistered address fails the transfer (a miss),
            # it never moves wrong bytes.  Cached, so registration is not retried on every call.
            self.external_regions += 1
        reg = Registration(base, nbytes, storage, permanent)
        reg.external = external
        reg.pins = 1
        with self._lock:
            old = self._regs.pop(base, None)
            if old is not None and not old.permanent:
                self._cached_bytes -= old.nbytes
                self._cached_count -= 1
            self._regs[base] = reg
            if not permanent:
                self._cached_bytes += nbytes
                self._cached_count += 1
        self._trim()
        return reg

    def repin(self, regs: Sequence[Registration]) -> None:
        with self._lock:
            for r in regs:
                r.pins += 1

    def unpin(self, regs: Sequence[Registration]) -> None:
        with self._lock:
            for r in regs:
                r.pins -= 1
        self._trim()

    def forget(self, t: torch.Tensor) -> None:
        """Drop a permanent registration (it becomes an ordinary cached one)."""
        with self._lock:
            reg = self._regs.get(t.untyped_storage().data_ptr())
            if reg is not None and reg.permanent:
                reg.permanent = False
                self._cached_bytes += reg.nbytes
                self._cached_count += 1
        self._trim()

    def _trim(self) -> None:
        victims = []
        with self._lock:
            if self._cached_bytes <= self.register_limit and self._cached_count <= REGISTER_COUNT_LIMIT:
                return
            for base, reg in list(self._regs.items()):
                if self._cached_bytes <= self.register_limit and self._cached_count <= REGISTER_COUNT_LIMIT:
                    break
                if reg.permanent or reg.pins:
                    continue
                del self._regs[base]
                self._cached_bytes -= reg.nbytes
                self._cached_count -= 1
                victims.append(reg)
        for reg in victims:
            if not reg.external:
                self.direct(lambda c, p=reg.ptr: c.unregister(p))  # type: ignore[misc]  # (a lambda's default argument)

    @property
    def registered_bytes(self) -> int:
        with self._lock:
            return sum(r.nbytes for r in self._regs.values())
