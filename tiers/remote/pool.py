"""``RemotePoolTier``: a tier over a distributed object store, whatever the backend.

A backend (``backends.BACKENDS``) supplies a blocking ``RemoteClient``; this
class supplies everything the remote media share: deadlines, presence caching,
staging and the Tier operations.  Availability and reconnection are
``PoolHealth``'s (``poolhealth.py``): it owns the session, the probe thread and
the tier's availability; this class asks it for the session, reports failures
to it (``fail``, ``pool_lost``) and owns only the data path's counters
(``PoolCounters``) and the ``Presence`` cache it shares with the probe.

Invariants
    * The caller's path never makes a blocking backend call it cannot abandon:
      every call runs on a session worker (``session.Session``) and the caller
      waits at most ``timeout + nbytes / min_bandwidth`` seconds (a read into the
      caller's memory that has started by then: ``late_read_wait`` more, below).  A call that
      does not answer in time, or answers ``UNAVAILABLE`` (master down) or
      ``PEER_UNREACHABLE`` (the memory holding an object is gone), marks the tier
      unavailable; from then on every operation answers a miss / refusal at
      once, without touching the backend, until the background probe has
      confirmed the backend answers again.
    * Lookups never claim a key that a restarted pool has lost: every
      ``contains`` batch carries this tier's sentinel key, and when the sentinel
      is gone every remembered key is forgotten (``pool_lost``).  Presence
      learned within ``presence_ttl`` seconds answers without asking again.
      While the sentinel cannot be stored (a pool with no segment mounted) the
      tier stays unavailable: misses, never errors.
    * ``read`` returns True only when the backend reports exactly the object's
      size filled in, and ``CORRUPT`` for an object found in this node's own
      segment with another size; ``write`` counts an existing key as stored
      (dedup).
    * A pool that is full (``NO_SPACE``) is retried once after
      ``full_retry_delay`` seconds, then the write is refused and counted.
    * A put abandoned at its deadline that later succeeds is removed again: it
      may have read a buffer its caller reused meanwhile.
    * A read never returns while the backend may still write into its caller's
      memory: a get into the caller's buffers that has started when its deadline
      passes is waited out (up to ``late_read_wait`` seconds more; counted
      ``late_reads_waited``) and answered as a miss.  One still running after
      that is counted ``late_reads_running`` and logged as an error: the one case
      where the caller's memory may be written after the answer.  A get into the
      tier's staging buffer is not waited out: that buffer is abandoned instead.
    * What a call pins (registrations, the staging buffer) is released when the
      backend call finishes, on every path, even if the caller gave up on it.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tierkv.buffers import host_copy
from tierkv.checksum import ReadSums

from ..base import CORRUPT, Parts, Tier
from .client import Outcome
from .poolhealth import PoolHealth, ProbeOptions
from .presence import Presence
from .session import HELD, LATE, REFUSED, TIMEOUT, Registration, Session
from .staging import Staging

log = logging.getLogger("tierkv.tiers.remote")

#: a read copied out of the local segment counts only if it ended this soon after the master granted
#: its lease (Mooncake's read lease lasts several seconds; a copy takes milliseconds)
LOCAL_LEASE_GUARD_S = 1.0


@dataclass(slots=True)
class PoolCounters:
    """The data path's events of one tier (``PoolHealth.counters`` holds the availability ones)."""

    refused: int = 0  #: objects a write did not store (no room, an error, no staging)
    refused_unavailable: int = 0  #: objects refused at once while the tier was unavailable
    misses_unavailable: int = 0  #: objects missed at once while the tier was unavailable
    full_retries: int = 0  #: writes tried again after a full pool
    local_reads: int = 0  #: objects copied out of this node's own segment
    timeouts: int = 0  #: calls answered at their deadline (they may still touch their memory)
    late_reads_waited: int = 0  #: of those, reads into the caller's memory waited out
    late_reads_running: int = 0  #: of those, reads still running after that wait
    transfer_errors: int = 0  #: calls that found a segment's owner unreachable
    errors: int = 0  #: calls that raised
    put_errors: int = 0  #: objects a write refused with an error code
    misses: int = 0  #: objects a read did not find whole


class RemotePoolTier(Tier):
    """An unmanaged tier over a distributed object store (see the module docstring for invariants)."""

    managed = False
    persistent = False
    #: the store keeps each chunk's checksum in a trailer inside the object: any process reading it checks it
    sum_inside = True
    #: an object copied out of this node's own segment is summed as it is copied (``read``'s ``sums``)
    sums_copies = True
    #: prefix of every key this medium writes: f"{namespace}/{key_tag}/{key}"
    key_tag = "pool"
    max_key_len = 4096

    def __init__(self, name: str, capacity_bytes: int, open_client: Callable[[], Any], *,
                 reachable: Callable[[], bool] | None = None, namespace: str = "tierkv",
                 timeout: float = 1.0, min_bandwidth: float = 100e6, connect_timeout: float = 30.0,
                 connect_wait: float = 5.0, probe_interval: float = 1.0, presence_ttl: float = 1.0,
                 full_retry_delay: float = 0.02, late_read_wait: float = 60.0, register_limit: int = 4 << 30,
                 workers: int = 4,
                 description: str = "", max_key_len: int | None = None) -> None:
        super().__init__(name, capacity_bytes)
        if max_key_len is not None:
            self.max_key_len = max_key_len
        self._prefix = f"{namespace}/{self.key_tag}/"
        self.timeout, self.min_bandwidth = timeout, min_bandwidth
        self.connect_timeout, self.probe_interval = connect_timeout, probe_interval
        self.presence_ttl, self.full_retry_delay = presence_ttl, full_retry_delay
        self.late_read_wait = late_read_wait
        self.register_limit, self.workers = register_limit, workers
        self.description = description or type(self).__name__
        sentinel = f"{namespace}/sentinel/{self.key_tag}/{os.getpid()}-{id(self):x}-{time.time_ns():x}"
        self._sentinel = sentinel
        self._presence = Presence(presence_ttl)
        self._staging = Staging()
        self._counters = PoolCounters()
        self._health = PoolHealth(name, self.description, sentinel, open_client, reachable or (lambda: True),
                                  self._presence, ProbeOptions(timeout, connect_timeout, probe_interval, workers,
                                                               register_limit),
                                  closed=lambda: self._closed, on_probed=self._reap_tombstones)
        if not self._health.start(connect_wait):
            log.warning("tier %r (%s): not connected after %.1fs (%s); serving misses while it keeps trying",
                        name, self.description, connect_wait, self._health.last_error or "no answer")

    # -- availability ---------------------------------------------------------
    @property
    def available(self) -> bool:
        return self._health.available and not self._closed

    @property
    def _session(self) -> Session | None:
        """The current session (``PoolHealth`` owns it; None while none is connected)."""
        return self._health.session

    def _deadline(self, nbytes: int = 0) -> float:
        return self.timeout + nbytes / self.min_bandwidth

    # -- helpers ----------------------------------------------------------------
    def _full_keys(self, keys: Sequence[str]) -> list[str]:
        out = []
        for k in keys:
            if not isinstance(k, str) or not k:
                raise TypeError(f"tier {self.name!r}: keys must be non-empty strings, got {k!r}")
            fk = self._prefix + k
            if len(fk.encode()) > self.max_key_len:
                raise ValueError(f"tier {self.name!r}: key {k[:32]!r}… is too long for {self.description} "
                                 f"({len(fk)} > {self.max_key_len} bytes with its prefix)")
            out.append(fk)
        return out

    def _run(self, fn: Callable[[Any], Any], nbytes: int, what: str,
             after: Callable[[concurrent.futures.Future | None], None] | None = None,
             session: Session | None = None, hold: float = 0.0) -> Any:
        """Run a data/control call on ``session`` (default: the current one); None (and unavailable) on failure.

        Calls that laid out memory pass the session they registered it with: a
        newer session's client must never see another client's registrations.
        ``hold`` (a read into the caller's memory): past the deadline, wait that much
        longer for the call to end before answering (``Session.call``)."""
        session = session or self._session
        if session is None or not self._health.available:
            if after is not None:
                after(None)
            return None
        try:
            r = session.call(fn, self._deadline(nbytes), after, hold)
        except Exception as e:  # noqa: BLE001 (a backend exception is a fault, not a caller error)
            self._counters.errors += 1
            self._health.fail(f"{what} raised {e!r}")
            return None
        if r is TIMEOUT or r is HELD or r is LATE:
            self._counters.timeouts += 1
            if r is HELD:
                self._counters.late_reads_waited += 1
            elif r is LATE:
                self._counters.late_reads_running += 1
                log.error("tierkv: tier %s: a %s into the caller's memory still runs %.0fs past its deadline; it "
                          "may write there after the miss was answered", self.name, what, hold)
            self._health.fail(f"{what} did not answer within {self._deadline(nbytes):.2f}s")
            return None
        if r is REFUSED:
            if after is not None:
                after(None)
            return None
        return r

    def _check_codes(self, client: Any, codes: Sequence[int], what: str) -> None:
        outcomes = {client.outcome(c) for c in codes}
        if Outcome.UNAVAILABLE in outcomes:
            self._health.fail(f"{what}: master unreachable (codes {sorted(set(codes))})")
        elif Outcome.PEER_UNREACHABLE in outcomes:
            self._counters.transfer_errors += 1
            self._health.fail(f"{what}: segment owner unreachable (codes {sorted(set(codes))})")

    # -- the Tier interface ---------------------------------------------------
    def _write(self, keys: Sequence[str], srcs: Sequence[Parts]) -> list[bool]:
        self._check_open()
        if len(keys) != len(srcs):
            raise ValueError(f"tier {self.name!r}: {len(keys)} keys but {len(srcs)} sources")
        fkeys = self._full_keys(keys)
        ok = [False] * len(keys)
        if not self.available:
            self._counters.refused_unavailable += len(keys)
            return ok
        todo: list[int] = []
        seen: set[str] = set()
        for i, fk in enumerate(fkeys):
            if sum(p.numel() for p in srcs[i]) == 0:
                raise ValueError(f"tier {self.name!r}: cannot store an empty object under {keys[i][:32]!r}")
            if self._presence.known(fk):
                ok[i] = True  # dedup: the pool already holds this content
            elif fk not in seen:
                seen.add(fk)
                todo.append(i)
        first = set(todo)
        dups = [i for i in range(len(keys)) if not ok[i] and i not in first]
        session = self._session
        if session is not None:
            for batch in self._staging.batches(session, todo, srcs):
                self._put(session, batch, fkeys, srcs, ok)
        for i in dups:  # a key repeated within the batch: stored iff its first copy was
            ok[i] = self._presence.held(fkeys[i])
        return ok

    def _put(self, session: Session, todo: list[int], fkeys: list[str], srcs: Sequence[Parts],
             ok: list[bool]) -> None:
        objs = [srcs[i] for i in todo]
        with self._staging.guard(session, objs) as live:
            if not live:
                self._counters.refused += len(todo)
                return
            pins: list[Registration] = []
            staged: list[tuple[int, int, int]] = []
            try:  # every exit releases what the layout pinned; a call that outlives us holds its own pins
                layout = self._staging.layout(session, objs, pins, staged)
                if layout is None:
                    self._counters.refused += len(todo)
                    self._health.note_error("memory registration or staging failed")
                    return
                if staged:
                    buf = self._staging.buffer
                    for oi, pj, soff in staged:
                        p = objs[oi][pj]
                        host_copy(buf[soff:soff + p.numel()], p)
                ptrs, sizes = layout
                devices = self._staging.devices(session, objs)
                nbytes = sum(sum(s) for s in sizes)
                pending = list(range(len(todo)))
                for attempt in (0, 1):
                    keys = [fkeys[todo[k]] for k in pending]
                    abandoned = threading.Event()

                    session.repin(pins)  # released when this call finishes, even if abandoned

                    def cleanup(fut: concurrent.futures.Future | None, keys: list[str] = keys,
                                abandoned: threading.Event = abandoned) -> None:
                        session.unpin(pins)
                        # a put that finished after its caller gave up may have read a buffer the caller
                        # reused meanwhile: never leave such an object behind
                        if fut is not None and abandoned.is_set() and not fut.cancelled() and fut.exception() is None:
                            stored = [k for k, c in zip(keys, fut.result()) if c == 0]
                            if stored:
                                session.client.remove(stored)

                    codes = self._run(lambda c, keys=keys, pending=pending: c.put(  # type: ignore[misc]  # (a lambda's defaults)
                        keys, [ptrs[k] for k in pending], [sizes[k] for k in pending], [devices[k] for k in pending]),
                        nbytes, "put", cleanup, session)
                    if codes is None:
                        abandoned.set()
                        if staged:  # the abandoned call may still read it: later calls get a fresh buffer
                            self._staging.abandon(session)
                        break
                    full = []
                    for k, code in zip(pending, codes):
                        cls = session.client.outcome(code)
                        i = todo[k]
                        if cls in (Outcome.OK, Outcome.EXISTS):
                            ok[i] = True
                            self._presence.remember(fkeys[i], sum(sizes[k]))
                        elif cls is Outcome.NO_SPACE:
                            full.append(k)
                        else:
                            self._counters.put_errors += 1
                            self._counters.refused += 1
                    self._check_codes(session.client, codes, "put")
                    if not full:
                        break
                    if attempt == 0 and self.available:
                        self._counters.full_retries += 1
                        time.sleep(self.full_retry_delay)
                        pending = full
                        continue
                    self._counters.refused += len(full)
            finally:
                session.unpin(pins)

    def _read(self, keys: Sequence[str], dsts: Sequence[Parts]) -> list[bool]:
        return self._read_summed(keys, dsts, None)

    def _read_summed(self, keys: Sequence[str], dsts: Sequence[Parts], sums: ReadSums | None) -> list[bool]:
        self._check_open()
        if len(keys) != len(dsts):
            raise ValueError(f"tier {self.name!r}: {len(keys)} keys but {len(dsts)} destinations")
        fkeys = self._full_keys(keys)
        ok: list[Any] = [False] * len(keys)
        if not self.available:
            self._counters.misses_unavailable += len(keys)
            return ok
        todo = [i for i, fk in enumerate(fkeys)
                if not self._presence.buried(fk) and sum(p.numel() for p in dsts[i]) > 0]
        if not todo:
            return ok
        session = self._session
        if session is None:
            return ok
        if getattr(session.client, "reads_locally", False):
            todo = self._read_local(session, todo, fkeys, dsts, ok, sums)
        for batch in self._staging.batches(session, todo, dsts):
            self._get(session, batch, fkeys, dsts, ok)
        return ok

    def _get(self, session: Session, todo: list[int], fkeys: list[str], dsts: Sequence[Parts],
             ok: list[bool]) -> None:
        objs = [dsts[i] for i in todo]
        with self._staging.guard(session, objs) as live:
            if not live:
                return
            pins: list[Registration] = []
            staged: list[tuple[int, int, int]] = []
            handed = False  # once the call has the pins, it releases them when it finishes (even abandoned)
            try:
                layout = self._staging.layout(session, objs, pins, staged)
                if layout is None:
                    self._health.note_error("memory registration or staging failed")
                    return
                ptrs, sizes = layout
                devices = self._staging.devices(session, objs)
                want = [sum(s) for s in sizes]
                handed = True
                # a get that writes straight into the caller's memory is waited out past its deadline (the
                # caller may hand that memory to others once answered); one into the staging buffer is not
                into_caller = len(staged) < sum(1 for o in objs for p in o if p.numel())
                codes = self._run(lambda c: c.get([fkeys[i] for i in todo], ptrs, sizes, devices), sum(want),
                                  "get", lambda _fut: session.unpin(pins), session,
                                  self.late_read_wait if into_caller else 0.0)
            finally:
                if not handed:
                    session.unpin(pins)
            if codes is None:
                if staged:  # the abandoned call may still write into it: later calls get a fresh buffer
                    self._staging.abandon(session)
                return
            for k, code in enumerate(codes):
                i = todo[k]
                if code == want[k]:
                    ok[i] = True
                    self._presence.remember(fkeys[i], want[k])
                else:
                    self._presence.forget(fkeys[i])
                    self._counters.misses += 1
            if staged and any(ok):
                buf = self._staging.buffer
                for oi, pj, soff in staged:
                    if ok[todo[oi]]:
                        p = objs[oi][pj]
                        host_copy(p, buf[soff:soff + p.numel()])
            self._check_codes(session.client, codes, "get")

    def _read_local(self, session: Session, todo: list[int], fkeys: list[str], dsts: Sequence[Parts],
                    ok: list[Any], sums: ReadSums | None) -> list[int]:
        """Serve what lies in this node's own segment by a plain copy (summed as it goes when ``sums`` asks);
        returns the keys left for a get."""
        host = [i for i in todo if all(p.device.type == "cpu" and p.is_contiguous() for p in dsts[i])]
        if not host:
            return todo
        ptrs = [[p.data_ptr() for p in dsts[i] if p.numel()] for i in host]
        sizes = [[p.numel() for p in dsts[i] if p.numel()] for i in host]
        want = [sum(s) for s in sizes]
        asked = None if sums is None else sums.part(host)
        got = self._run(lambda c: c.read_local([fkeys[i] for i in host], ptrs, sizes, LOCAL_LEASE_GUARD_S, asked),
                        sum(want), "local read", session=session)
        if got is None:
            return []  # the pool failed: the tier is unavailable and every key is a miss
        wrong: set[int] = set()
        for k, (i, n, w) in enumerate(zip(host, got, want)):
            if n == w:
                ok[i] = True
                self._presence.remember(fkeys[i], w)
                self._counters.local_reads += 1
                if sums is not None and asked is not None:
                    sums.sums[i] = asked.sums[k]
            elif n < 0:  # present here with another size: not the object stored under this key
                ok[i] = CORRUPT
                wrong.add(i)
        return [i for i in todo if not ok[i] and i not in wrong]

    def _contains(self, keys: Sequence[str]) -> list[bool]:
        self._check_open()
        fkeys = self._full_keys(keys)
        out = [False] * len(keys)
        if not self.available or not keys:
            return out
        ask = sorted({fk for fk in fkeys if not self._presence.buried(fk) and not self._presence.known(fk)})
        # one exists call per lookup; the sentinel in it proves the remembered keys still stand
        codes = self._run(lambda c: c.exists([self._sentinel, *ask]), 0, "exists")
        if codes is None:
            return out
        if codes[0] != 1:
            if codes[0] == 0:
                self._health.pool_lost()
            elif codes[0] < 0:
                self._health.fail(f"exists: code {codes[0]}")
                return out
        answers = dict(zip(ask, codes[1:]))
        for i, fk in enumerate(fkeys):
            if self._presence.buried(fk):
                continue
            if fk in answers:
                if answers[fk] == 1:
                    out[i] = True
                    self._presence.remember(fk, -1)
                else:
                    self._presence.forget(fk)
            else:
                out[i] = self._presence.known(fk)
        return out

    def _delete(self, keys: Sequence[str]) -> None:
        self._check_open()
        fkeys = list(dict.fromkeys(self._full_keys(keys)))
        for fk in fkeys:
            self._presence.bury(fk)  # until the backend confirms the removal
        session = self._session
        if not self.available or session is None:
            return
        codes = self._run(lambda c: c.remove(fkeys), 0, "remove", session=session)
        if codes is None:
            return
        for fk, code in zip(fkeys, codes):
            if session.client.outcome(code) in (Outcome.OK, Outcome.NOT_FOUND):
                self._presence.unbury(fk)

    def _reap_tombstones(self, session: Session) -> None:
        """Retry removals the backend refused (objects leased by readers); runs on the probe thread."""
        if not self._presence.tombstones:
            return
        keys = list(self._presence.tombstones)[:1024]
        codes = self._health.call(session, lambda c: c.remove(keys))
        if isinstance(codes, list):
            for fk, code in zip(keys, codes):
                if session.client.outcome(code) in (Outcome.OK, Outcome.NOT_FOUND):
                    self._presence.unbury(fk)

    # -- memory registration for callers with long-lived buffers -------------
    def register(self, tensor: torch.Tensor) -> bool:
        """Register a long-lived buffer (an engine's KV pool) so its parts move without per-call setup."""
        self._check_open()
        session = self._session
        if session is None or not session.client.accepts_device(tensor.device.type):
            return False
        reg = session.pin(tensor, permanent=True)
        if reg is None:
            return False
        session.unpin([reg])
        return True

    def unregister(self, tensor: torch.Tensor) -> None:
        session = self._session
        if session is not None:
            session.forget(tensor)

    # -- accounting -----------------------------------------------------------
    @property
    def abandoned_calls(self) -> int:
        """Calls answered at their deadline so far (``timeouts``): such a call may still touch its memory."""
        return self._counters.timeouts

    @property
    def used_bytes(self) -> int:
        """Bytes of objects this instance stored or read and believes present (an estimate: the pool is shared)."""
        return self._presence.used_bytes

    def extra_stats(self) -> dict[str, Any]:
        c, h = self._counters, self._health.counters
        session = self._session
        down_for = None
        since = self._health.unavailable_since
        if since is not None:
            down_for = round(time.monotonic() - since, 3)
        return {
            "backend": self.description,
            "available": self.available,
            "unavailable_for_s": down_for,
            "last_error": self._health.last_error,
            "refused": c.refused,
            "refused_unavailable": c.refused_unavailable,
            "misses_unavailable": c.misses_unavailable,
            "full_retries": c.full_retries,
            "local_reads": c.local_reads,
            "failures": h.failures,
            "timeouts": c.timeouts,
            "late_reads_waited": c.late_reads_waited,
            "late_reads_running": c.late_reads_running,
            "transfer_errors": c.transfer_errors,
            "reconnects": h.reconnects,
            "pool_lost": h.pool_lost,
            "pending_deletes": len(self._presence.tombstones),
            "abandoned_clients": h.abandoned_clients,
            "registered_bytes": session.registered_bytes if session else 0,
            "external_regions": session.external_regions if session else 0,
        }

    def close(self) -> None:
        """Stop serving; the client is closed in the background once no call is in flight.

        Closing a Mooncake client takes about two seconds and holds the interpreter
        lock meanwhile; at exit every client still open is closed first (``tierkv.shutdown``).
        """
        if self._closed:
            return
        super().close()
        session = self._health.stop()
        if session is not None:
            session.retire()  # the client is closed once no call is in flight, never before
