"""``PoolHealth``: whether a remote pool tier can be used now, and the background probe that decides it.

``RemotePoolTier`` (``pool.py``) serves reads, writes and lookups; this object owns everything about
reaching the backend: the current ``Session`` (a client and its workers), whether the tier is
*available*, the last error, the sentinel key's standing, and the probe thread that (re)connects.

Invariants
    * Only the probe thread makes the tier available, and only after a probe succeeded: the backend
      answered an ``exists`` of the sentinel key and the sentinel is stored in the current pool.
    * Anyone may make it unavailable (``fail``: a deadline missed, a master unreachable); the probe
      then tries at backoff intervals (0.05 s doubling to 2 s) until a probe succeeds.
    * While available, a probe runs every ``probe_interval`` seconds (or at once when woken: a
      failure, a pool found lost) and a failed one makes the tier unavailable.
    * Every fifth failed probe in a row (or at once, for a client that refuses the sentinel and owns
      no segment) retires the session: the next probe connects a fresh client.  A setup that outlives
      ``connect_timeout`` is abandoned (what it builds is never used nor closed).
    * A new session, or a pool found lost (the sentinel gone: a master restarted, the sentinel
      evicted), clears what the tier remembers of the pool (``Presence.clear``).

Owns: ``session``, ``available``, ``last_error``, ``unavailable_since``, the sentinel's standing and the
counters of these events (``failures``, ``connects``, ``reconnects``, ``pool_lost``,
``probe_failures``, ``abandoned_clients``), all changed under its own lock.  Asks: the tier's
``Presence`` (cleared), the tier's ``closed`` state and, after each successful probe, the tier's
``on_probed`` (the deletes the backend refused, tried again).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .client import Outcome
from .presence import Presence
from .session import TIMEOUT, Session

log = logging.getLogger("tierkv.tiers.remote")


@dataclass(frozen=True)
class ProbeOptions:
    """How the probe reaches the backend (the tier's options, validated by its maker)."""

    timeout: float  #: seconds a probe call may take
    connect_timeout: float  #: seconds a client's setup may take
    probe_interval: float  #: seconds between two probes while available
    workers: int  #: a session's worker threads
    register_limit: int  #: bytes a session may keep registered


@dataclass(slots=True)
class HealthCounters:
    """The availability events of one tier (exported by ``RemotePoolTier.extra_stats``)."""

    failures: int = 0  #: times the tier became unavailable
    connects: int = 0  #: times a probe made it available
    reconnects: int = 0  #: of those, after it had been available before
    pool_lost: int = 0  #: times the sentinel was found gone
    probe_failures: int = 0  #: failed probes in a row (reset by a successful one)
    abandoned_clients: int = 0  #: sessions retired for failing probes


class PoolHealth:
    """One remote tier's reachability (see the module docstring)."""

    def __init__(self, name: str, description: str, sentinel: str, open_client: Callable[[], Any],
                 reachable: Callable[[], bool], presence: Presence, options: ProbeOptions,
                 closed: Callable[[], bool], on_probed: Callable[[Session], None]) -> None:
        self.name, self.description = name, description
        self.sentinel = sentinel
        self.options = options
        self.counters = HealthCounters()
        self.session: Session | None = None
        self.available = False
        self.last_error = ""
        self.unavailable_since: float | None = time.monotonic()
        self._open_client = open_client
        self._reachable = reachable
        self._presence = presence
        self._closed = closed
        self._on_probed = on_probed
        self._sentinel_ok = False  # the sentinel is known to be stored in the current pool
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._prober = threading.Thread(target=self._loop, name=f"tierkv-probe-{name}", daemon=True)

    def start(self, connect_wait: float) -> bool:
        """Start the probe thread and wait up to ``connect_wait`` seconds for the tier to become available;
        whether it did."""
        self._prober.start()
        deadline = time.monotonic() + connect_wait
        while not self.available and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.available

    def stop(self) -> Session | None:
        """The tier closed: unavailable from now on, the probe woken to end; returns the session, now
        no longer this object's (the caller retires it)."""
        self.available = False
        self._wake.set()
        with self._lock:
            session, self.session = self.session, None
        return session

    # -- what the data path reports -------------------------------------------------------------
    def fail(self, why: str) -> None:
        """The backend failed a call: unavailable until a probe succeeds (logged once per outage)."""
        with self._lock:
            was = self.available
            self.available = False
            self.last_error = why
            if was:
                self.counters.failures += 1
                self.unavailable_since = time.monotonic()
        if was:
            log.warning("tier %r (%s) unavailable: %s", self.name, self.description, why)
        self._wake.set()

    def note_error(self, why: str) -> None:
        """A call could not even start (no registration, no staging): remembered as the last error only."""
        self.last_error = why

    def pool_lost(self, wake: bool = True) -> None:
        """The sentinel is gone: the pool this tier knew is gone (master restarted or sentinel evicted).

        ``wake`` asks the prober to store a new sentinel now; the prober itself passes False."""
        with self._lock:
            if self._sentinel_ok:
                self.counters.pool_lost += 1
            self._sentinel_ok = False
            self._presence.clear()
        if wake:
            self._wake.set()

    def call(self, session: Session, fn: Callable[[Any], Any]) -> Any:
        """``fn(client)`` on ``session`` within the probe's timeout: its answer, ``TIMEOUT`` or the exception."""
        try:
            return session.call(fn, self.options.timeout)
        except Exception as e:  # noqa: BLE001
            return e

    # -- the probe --------------------------------------------------------------------------------
    def _probe_once(self) -> bool:
        """One step of (re)connection; True when the tier is available afterwards."""
        if not self._reachable():
            self.last_error = f"{self.description}: master not reachable"
            return False
        session = self.session
        if session is None or session.retired:
            client = self._connect()
            if client is None:
                return False
            session = Session(client, self.options.workers, self.options.register_limit)
            if self._closed():
                session.retire()
                return False
            with self._lock:
                self.session = session
                self._sentinel_ok = False
                self._presence.clear()
        r = self.call(session, lambda c: c.exists([self.sentinel]))
        if not isinstance(r, list) or not r or r[0] < 0:
            why = "timed out" if r is TIMEOUT else repr(r)
            self.last_error = f"{self.description}: probe failed ({why})"
            self._probe_failed(session)
            return False
        if r[0] != 1:
            self.pool_lost(wake=False)
            rc = self.call(session, lambda c: c.put_sentinel(self.sentinel))
            outcome = session.client.outcome(rc) if isinstance(rc, int) else None
            if outcome not in (Outcome.OK, Outcome.EXISTS):
                self.last_error = f"{self.description}: cannot store the sentinel key ({rc!r})"
                if outcome is not Outcome.NO_SPACE:  # a pool without room is normal; a refusing client is not
                    # a client without a segment of its own is cheap to replace: at once
                    self._probe_failed(session, now=not getattr(session.client, "owns_segment", True))
                return False
            with self._lock:
                self._sentinel_ok = True
        self.counters.probe_failures = 0
        self._on_probed(session)
        return True

    def _probe_failed(self, session: Session, now: bool = False) -> None:
        """Count a failed probe; every fifth in a row (or this one, ``now``) starts over with a fresh client."""
        self.counters.probe_failures += 1
        if (now or self.counters.probe_failures % 5 == 0) and session is self.session:
            # the service answers but this client keeps failing.  A client that contributed a segment is
            # left open (closing unmounts it, holding the interpreter lock for seconds); others are closed
            session.retire(close=not getattr(session.client, "owns_segment", True))
            self.counters.abandoned_clients += 1

    def _connect(self) -> Any:
        """A freshly set-up client, or None.  Setup that outlives ``connect_timeout`` is abandoned."""
        box: dict[str, Any] = {}
        done = threading.Event()

        def run() -> None:
            try:
                box["client"] = self._open_client()
            except Exception as e:  # noqa: BLE001
                box["error"] = e
            done.set()

        threading.Thread(target=run, name=f"tierkv-connect-{self.name}", daemon=True).start()
        if not done.wait(self.options.connect_timeout):
            # an abandoned setup keeps running; whatever it builds is never used nor closed
            self.last_error = f"{self.description}: setup did not finish in {self.options.connect_timeout:.0f}s"
            return None
        if "error" in box:
            self.last_error = f"{self.description}: {box['error']}"
            return None
        return box["client"]

    def _loop(self) -> None:
        backoff = 0.05
        while not self._closed():
            if self.available:
                self._wake.wait(self.options.probe_interval)
                self._wake.clear()
                if self._closed():
                    break
                if self.available and not self._probe_once():
                    self.fail(self.last_error)
                backoff = 0.05
                continue
            if self._probe_once() and not self._closed():
                with self._lock:
                    recovered = self.unavailable_since is not None and self.counters.connects > 0
                    self.available = True
                    self.unavailable_since = None
                    self.counters.connects += 1
                    if recovered:
                        self.counters.reconnects += 1
                backoff = 0.05
                continue
            self._wake.wait(backoff)
            self._wake.clear()
            backoff = min(backoff * 2, 2.0)
