"""``dram_pool``: host DRAM pooled across nodes by a distributed object store.

Backends (config ``"backend"``):
    ``mooncake`` (default)  Mooncake Store: a master, clients that each contribute
                            a memory segment, and the Transfer Engine.
    ``memcache``            MemFabric's ``memcache_hybrid.DistributedObjectStore``
                            (Ascend only; see ``tiers/_memcache.py``).

``RemotePoolTier`` holds everything the remote media share (``remote_npu`` is a
subclass); a backend only supplies a blocking client (``_mooncake.MooncakeClient``,
``_memcache.MemcacheClient``).

Invariants
    * The caller's path never makes a blocking backend call it cannot abandon:
      every call runs on a session worker thread and the caller waits at most
      ``timeout + nbytes / min_bandwidth`` seconds.  A call that does not answer
      in time, or answers "master down" (``DOWN``) or "segment owner
      unreachable" (``PEER``), marks the tier unavailable; from then on every
      operation answers a miss / refusal at once, without touching the backend,
      until the background probe has confirmed the backend answers again.
    * A client is never called after its ``close()``: a session that is retired
      accepts no new call and closes its client on the last in-flight call's
      thread; a session whose calls never come back is never closed.
    * Lookups never claim a key that a restarted master has lost: every
      ``contains`` batch carries this tier's sentinel key, and when the
      sentinel is gone every remembered key is forgotten (``pool_lost``).
      Presence learned within ``presence_ttl`` seconds answers without asking
      again (exists calls take a lease on the objects: no exists-storms).
    * ``read`` returns True only when the backend reports exactly the object's
      size filled in; ``write`` counts an existing key as stored (dedup).
    * A pool that is full (``FULL``) is retried once after ``full_retry_delay``
      seconds, then the write is refused and counted; nothing waits for space.
    * Memory handed to the backend is registered.  Callers' buffers are
      registered by their whole storage and the registration is cached (LRU,
      ``register_limit`` bytes, plus anything registered with ``register()``);
      a cached registration keeps its storage alive, so a registered address is
      never freed and reused while registered.  Parts the backend cannot reach
      (a device tensor over ``tcp``) go through a tier-owned host staging buffer.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import concurrent.futures
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tierkv.buffers import host_copy
from tierkv.errors import ConfigError
from tierkv.units import parse_size

from . import _mooncake as mc
from .base import Parts, Tier

log = logging.getLogger("tierkv.tiers.remote")

_TIMEOUT = object()  # a call that did not answer within its deadline
_REFUSED = object()  # the session was retired before the call could start


def _pop_seconds(name: str, options: dict[str, Any], key: str, default: float) -> float:
    raw = options.pop(key, default)
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or raw <= 0:
        raise ConfigError(f"tier {name!r}: {key!r} must be a positive number of seconds, got {raw!r}")
    return float(raw)


def _pop_str(name: str, options: dict[str, Any], key: str, default: str | None, env: str | None = None) -> str:
    """A string option; the environment variable ``env``, when set, overrides the config."""
    value = options.pop(key, default)
    if env and os.environ.get(env):
        value = os.environ[env]
    if value is None:
        raise ConfigError(f"tier {name!r}: {key!r} is required")
    if not isinstance(value, str) or not value:
        raise ConfigError(f"tier {name!r}: {key!r} must be a non-empty string, got {value!r}")
    return value


_closers: set[threading.Thread] = set()
_closers_lock = threading.Lock()


def _close_in_background(fn: Callable[[], None]) -> None:
    """Run a client's close (which takes seconds) off the caller's path; exit waits for it (bounded)."""
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


@atexit.register
def _wait_for_closers(timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    with _closers_lock:
        pending = list(_closers)
    for t in pending:
        t.join(max(0.0, end - time.monotonic()))


#: a read copied out of the local segment counts only if it ended this soon after the master granted
#: its lease (Mooncake's read lease lasts several seconds; a copy takes milliseconds)
LOCAL_LEASE_GUARD_S = 1.0


class _Registration:
    __slots__ = ("ptr", "nbytes", "storage", "pins", "permanent", "external")

    def __init__(self, ptr: int, nbytes: int, storage: Any, permanent: bool) -> None:
        self.ptr, self.nbytes, self.storage, self.pins, self.permanent = ptr, nbytes, storage, 0, permanent
        self.external = False  # registered by someone else: never unregistered by the tier


class _Session:
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
        self._closed = False
        self._closed_event = threading.Event()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._regs: collections.OrderedDict[int, _Registration] = collections.OrderedDict()
        self._cached_bytes = 0
        self.external_regions = 0
        self._threads = [threading.Thread(target=self._work, name=f"tierkv-remote-{i}", daemon=True)
                         for i in range(workers)]
        for t in self._threads:
            t.start()

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
            close_now = self.retired and self._inflight == 0 and not self._closed
            if close_now:
                self._closed = True
        if close_now:
            _close_in_background(self._close_client)

    def retire(self, close: bool = True) -> None:
        """Accept no new call.  With ``close`` the client is closed once idle; without, it is left alone
        (closing holds the interpreter lock for seconds, which a running engine must not see)."""
        with self._lock:
            if self.retired:
                return
            self.retired = True
            if not close:
                self._closed = True  # never closed: its segment lives until the process ends
            close_now = self._inflight == 0 and not self._closed
            if close_now:
                self._closed = True
            for _ in self._threads:
                self._queue.put(None)
        if close_now:
            _close_in_background(self._close_client)

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
            self._leave()

    def call(self, fn: Callable[[Any], Any], deadline: float,
             after: Callable[[concurrent.futures.Future], None] | None = None) -> Any:
        """``fn(client)`` on a worker; its result, or ``_TIMEOUT`` / ``_REFUSED``.

        ``after(future)`` runs on the worker once the call has finished or was
        cancelled, whether or not the caller still waits (cleanup of abandoned calls).
        Exceptions raised by ``fn`` are re-raised here.
        """
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:  # queued before retire() queues the workers' stop marks, or not at all
            if self.retired:
                return _REFUSED
            self._inflight += 1
            self._queue.put((fn, fut, after))
        try:
            return fut.result(timeout=deadline)
        except concurrent.futures.TimeoutError:
            fut.cancel()  # only succeeds if it had not started: then it never runs
            return _TIMEOUT

    def direct(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(client)`` on the calling thread, for local, non-blocking client calls (registration)."""
        if not self._enter():
            return _REFUSED
        try:
            return fn(self.client)
        finally:
            self._leave()

    # -- registrations ---------------------------------------------------------
    def pin(self, t: torch.Tensor, permanent: bool = False) -> _Registration | None:
        """Register (or find registered) the storage under ``t``; pinned until ``unpin``. None on failure."""
        storage = t.untyped_storage()
        base, nbytes = storage.data_ptr(), storage.nbytes()
        with self._lock:
            reg = self._regs.get(base)
            if reg is not None and reg.nbytes >= nbytes:
                self._regs.move_to_end(base)
                reg.pins += 1
                reg.permanent = reg.permanent or permanent
                return reg
        rc = self.direct(lambda c: c.register(base, nbytes))
        if rc is _REFUSED:
            return None
        external = rc != 0
        if external:
            # refused, most often because this memory overlaps a region the owner of the client registered
            # itself; the transfer is tried anyway: an unregistered address fails the transfer (a miss),
            # it never moves wrong bytes.  Cached, so registration is not retried on every call.
            self.external_regions += 1
        reg = _Registration(base, nbytes, storage, permanent)
        reg.external = external
        reg.pins = 1
        with self._lock:
            old = self._regs.pop(base, None)
            if old is not None and not old.permanent:
                self._cached_bytes -= old.nbytes
            self._regs[base] = reg
            if not permanent:
                self._cached_bytes += nbytes
        self._trim()
        return reg

    def repin(self, regs: Sequence[_Registration]) -> None:
        with self._lock:
            for r in regs:
                r.pins += 1

    def unpin(self, regs: Sequence[_Registration]) -> None:
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
        self._trim()

    def _trim(self) -> None:
        victims = []
        with self._lock:
            if self._cached_bytes <= self.register_limit:
                return
            for base, reg in list(self._regs.items()):
                if self._cached_bytes <= self.register_limit:
                    break
                if reg.permanent or reg.pins:
                    continue
                del self._regs[base]
                self._cached_bytes -= reg.nbytes
                victims.append(reg)
        for reg in victims:
            if not reg.external:
                self.direct(lambda c, p=reg.ptr: c.unregister(p))

    @property
    def registered_bytes(self) -> int:
        with self._lock:
            return sum(r.nbytes for r in self._regs.values())


class RemotePoolTier(Tier):
    """An unmanaged tier over a distributed object store (see the module docstring for invariants)."""

    managed = False
    persistent = False
    #: prefix of every key this medium writes: f"{namespace}/{key_tag}/{key}"
    key_tag = "pool"
    max_key_len = 4096

    def __init__(self, name: str, capacity_bytes: int, open_client: Callable[[], Any], *,
                 reachable: Callable[[], bool] | None = None, namespace: str = "tierkv",
                 timeout: float = 1.0, min_bandwidth: float = 100e6, connect_timeout: float = 30.0,
                 connect_wait: float = 5.0, probe_interval: float = 1.0, presence_ttl: float = 1.0,
                 full_retry_delay: float = 0.02, register_limit: int = 4 << 30, workers: int = 4,
                 description: str = "") -> None:
        super().__init__(name, capacity_bytes)
        self._open_client = open_client
        self._reachable = reachable or (lambda: True)
        self._prefix = f"{namespace}/{self.key_tag}/"
        self.timeout, self.min_bandwidth = timeout, min_bandwidth
        self.connect_timeout, self.probe_interval = connect_timeout, probe_interval
        self.presence_ttl, self.full_retry_delay = presence_ttl, full_retry_delay
        self.register_limit, self.workers = register_limit, workers
        self.description = description or type(self).__name__
        self._sentinel = f"{namespace}/sentinel/{self.key_tag}/{os.getpid()}-{id(self):x}-{time.time_ns():x}"
        self._session: _Session | None = None
        self._available = False
        self._sentinel_ok = False  # the sentinel is known to be stored in the current pool
        self._wake = threading.Event()
        self._state_lock = threading.Lock()
        self._present: dict[str, tuple[float, int]] = {}  # key -> (confirmed at, nbytes or -1)
        self._tombstones: dict[str, float] = {}  # deleted keys the backend still holds (leased)
        self._staging: torch.Tensor | None = None
        self._staging_lock = threading.Lock()
        self._counters = collections.Counter()
        self._last_error = ""
        self._unavailable_since: float | None = time.monotonic()
        self._prober = threading.Thread(target=self._probe_loop, name=f"tierkv-probe-{name}", daemon=True)
        self._prober.start()
        deadline = time.monotonic() + connect_wait
        while not self._available and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self._available:
            log.warning("tier %r (%s): not connected after %.1fs (%s); serving misses while it keeps trying",
                        name, self.description, connect_wait, self._last_error or "no answer")

    # -- availability ---------------------------------------------------------
    @property
    def available(self) -> bool:
        return self._available and not self._closed

    def _fail(self, why: str) -> None:
        with self._state_lock:
            was = self._available
            self._available = False
            self._last_error = why
            if was:
                self._counters["failures"] += 1
                self._unavailable_since = time.monotonic()
        if was:
            log.warning("tier %r (%s) unavailable: %s", self.name, self.description, why)
        self._wake.set()

    def _pool_lost(self) -> None:
        """The sentinel is gone: the pool this tier knew is gone (master restarted or sentinel evicted)."""
        with self._state_lock:
            if self._sentinel_ok:
                self._counters["pool_lost"] += 1
            self._sentinel_ok = False
            self._present.clear()
            self._tombstones.clear()
        self._wake.set()

    def _deadline(self, nbytes: int = 0) -> float:
        return self.timeout + nbytes / self.min_bandwidth

    def _probe_call(self, session: _Session, fn: Callable[[Any], Any]) -> Any:
        try:
            return session.call(fn, self.timeout)
        except Exception as e:  # noqa: BLE001
            return e

    def _probe_once(self) -> bool:
        """One step of (re)connection; True when the tier is available afterwards."""
        if not self._reachable():
            self._last_error = f"{self.description}: master not reachable"
            return False
        session = self._session
        if session is None or session.retired:
            client = self._connect()
            if client is None:
                return False
            session = _Session(client, self.workers, self.register_limit)
            if self._closed:
                session.retire()
                return False
            with self._state_lock:
                self._session = session
                self._sentinel_ok = False
                self._present.clear()
                self._tombstones.clear()
        r = self._probe_call(session, lambda c: c.exists([self._sentinel]))
        if not isinstance(r, list) or not r or r[0] < 0:
            why = "timed out" if r is _TIMEOUT else repr(r)
            self._last_error = f"{self.description}: probe failed ({why})"
            self._counters["probe_failures"] += 1
            if self._counters["probe_failures"] % 5 == 0 and session is self._session:
                # the master answers TCP but this client keeps failing: start over with a fresh one
                session.retire(close=False)
                self._counters["abandoned_clients"] += 1
            return False
        if r[0] != 1:
            self._pool_lost()
            rc = self._probe_call(session, lambda c: c.put_sentinel(self._sentinel))
            if not isinstance(rc, int) or session.client.classify(rc) not in (mc.OK, mc.DUPLICATE):
                self._last_error = f"{self.description}: cannot store the sentinel key ({rc!r})"
                return False
            with self._state_lock:
                self._sentinel_ok = True
        self._counters["probe_failures"] = 0
        self._reap_tombstones(session)
        return True

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
        if not done.wait(self.connect_timeout):
            # an abandoned setup keeps running; whatever it builds is never used nor closed
            self._last_error = f"{self.description}: setup did not finish in {self.connect_timeout:.0f}s"
            return None
        if "error" in box:
            self._last_error = f"{self.description}: {box['error']}"
            return None
        return box["client"]

    def _probe_loop(self) -> None:
        backoff = 0.05
        while not self._closed:
            if self._available:
                self._wake.wait(self.probe_interval)
                self._wake.clear()
                if self._closed:
                    break
                if self._available and not self._probe_once():
                    self._fail(self._last_error)
                backoff = 0.05
                continue
            if self._probe_once() and not self._closed:
                with self._state_lock:
                    recovered = self._unavailable_since is not None and self._counters["connects"] > 0
                    self._available = True
                    self._unavailable_since = None
                    self._counters["connects"] += 1
                    if recovered:
                        self._counters["reconnects"] += 1
                backoff = 0.05
                continue
            self._wake.wait(backoff)
            self._wake.clear()
            backoff = min(backoff * 2, 2.0)

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

    def _remember(self, key: str, nbytes: int) -> None:
        self._present[key] = (time.monotonic(), nbytes)
        self._tombstones.pop(key, None)

    def _known_present(self, key: str) -> bool:
        hit = self._present.get(key)
        return hit is not None and time.monotonic() - hit[0] < self.presence_ttl

    def _run(self, fn: Callable[[Any], Any], nbytes: int, what: str,
             after: Callable[[concurrent.futures.Future], None] | None = None) -> Any:
        """Run a data/control call on the current session; None (and unavailable) on failure."""
        session = self._session
        if session is None or not self._available:
            if after is not None:
                after(None)
            return None
        try:
            r = session.call(fn, self._deadline(nbytes), after)
        except Exception as e:  # noqa: BLE001 (a backend exception is a fault, not a caller error)
            self._counters["errors"] += 1
            self._fail(f"{what} raised {e!r}")
            return None
        if r is _TIMEOUT:
            self._counters["timeouts"] += 1
            self._fail(f"{what} did not answer within {self._deadline(nbytes):.2f}s")
            return None
        if r is _REFUSED:
            if after is not None:
                after(None)
            return None
        return r

    def _check_codes(self, session_client: Any, codes: Sequence[int], what: str) -> None:
        classes = {session_client.classify(c) for c in codes}
        if mc.DOWN in classes:
            self._fail(f"{what}: master unreachable (codes {sorted(set(codes))})")
        elif mc.PEER in classes:
            self._counters["transfer_errors"] += 1
            self._fail(f"{what}: segment owner unreachable (codes {sorted(set(codes))})")

    def _staging_guard(self, session: _Session, objs: Sequence[Parts]) -> Any:
        """The staging lock when some part must be staged through host memory; calls without one run
        concurrently."""
        accepts = session.client.accepts_device
        for parts in objs:
            types = {p.device.type for p in parts if p.numel()}
            if len(types) > 1 or not all(accepts(t) for t in types):
                return self._staging_lock
        return contextlib.nullcontext()

    def _staging_buffer(self, nbytes: int) -> torch.Tensor:
        if self._staging is None or self._staging.numel() < nbytes:
            self._staging = torch.empty(max(nbytes, 1 << 20), dtype=torch.uint8)
        return self._staging

    def _layout(self, session: _Session, objs: Sequence[Parts], pins: list[_Registration],
                staged: list[tuple[int, int, int]]) -> tuple[list[list[int]], list[list[int]]] | None:
        """(ptrs, sizes) per object, empty parts left out; registers storages (pinned into ``pins``).

        Parts the backend cannot reach (a device tensor over ``tcp``) are laid out
        in the tier's staging buffer; ``staged`` gets (object, part, staging offset)
        for each.  Returns None when registration fails.
        """
        ptrs: list[list[int]] = []
        sizes: list[list[int]] = []
        rebase: list[tuple[int, int, int]] = []  # (object, slot in its ptr list, staging offset)
        off = 0
        client = session.client
        for i, parts in enumerate(objs):
            pl, sl = [], []
            mixed = len({p.device.type for p in parts if p.numel()}) > 1  # one copy direction per object
            for j, p in enumerate(parts):
                n = p.numel()
                if n == 0:
                    continue
                if client.accepts_device(p.device.type) and not (mixed and p.device.type != "cpu"):
                    reg = session.pin(p)
                    if reg is None:
                        return None
                    pins.append(reg)
                    pl.append(p.data_ptr())
                else:
                    staged.append((i, j, off))
                    rebase.append((i, len(pl), off))
                    pl.append(0)
                    off += n
                sl.append(n)
            ptrs.append(pl)
            sizes.append(sl)
        if rebase:
            buf = self._staging_buffer(off)
            reg = session.pin(buf)
            if reg is None:
                return None
            pins.append(reg)
            for i, slot, soff in rebase:
                ptrs[i][slot] = buf.data_ptr() + soff
        return ptrs, sizes

    @staticmethod
    def _devices(session: _Session, objs: Sequence[Parts]) -> list[str]:
        """Per object, the device type its bytes move from/to ("cpu" when staged through host)."""
        out = []
        for parts in objs:
            types = {p.device.type for p in parts if p.numel()}
            dev = types.pop() if len(types) == 1 else "cpu"
            out.append(dev if session.client.accepts_device(dev) else "cpu")
        return out

    # -- the Tier interface ---------------------------------------------------
    def _write(self, keys: Sequence[str], srcs: Sequence[Parts]) -> list[bool]:
        self._check_open()
        if len(keys) != len(srcs):
            raise ValueError(f"tier {self.name!r}: {len(keys)} keys but {len(srcs)} sources")
        fkeys = self._full_keys(keys)
        ok = [False] * len(keys)
        if not self.available:
            self._counters["refused_unavailable"] += len(keys)
            return ok
        todo: list[int] = []
        seen: set[str] = set()
        for i, fk in enumerate(fkeys):
            if sum(p.numel() for p in srcs[i]) == 0:
                raise ValueError(f"tier {self.name!r}: cannot store an empty object under {keys[i][:32]!r}")
            if self._known_present(fk):
                ok[i] = True  # dedup: the pool already holds this content
            elif fk not in seen:
                seen.add(fk)
                todo.append(i)
        first = set(todo)
        dups = [i for i in range(len(keys)) if not ok[i] and i not in first]
        if todo:
            self._put(todo, fkeys, srcs, ok)
        for i in dups:  # a key repeated within the batch: stored iff its first copy was
            ok[i] = fkeys[i] in self._present
        return ok

    def _put(self, todo: list[int], fkeys: list[str], srcs: Sequence[Parts], ok: list[bool]) -> None:
        session = self._session
        if session is None:
            return
        objs = [srcs[i] for i in todo]
        with self._staging_guard(session, objs):
            pins: list[_Registration] = []
            staged: list[tuple[int, int, int]] = []
            layout = self._layout(session, objs, pins, staged)
            if layout is None:
                session.unpin(pins)
                self._counters["refused"] += len(todo)
                self._last_error = "memory registration failed"
                return
            if staged:
                buf = self._staging
                for oi, pj, soff in staged:
                    p = objs[oi][pj]
                    host_copy(buf[soff:soff + p.numel()], p)
            ptrs, sizes = layout
            devices = self._devices(session, objs)
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

                codes = self._run(lambda c, keys=keys, pending=pending: c.put(
                    keys, [ptrs[k] for k in pending], [sizes[k] for k in pending], [devices[k] for k in pending]),
                    nbytes, "put", cleanup)
                if codes is None:
                    abandoned.set()
                    if staged:  # the abandoned call may still read it: later calls get a fresh buffer
                        self._staging = None
                    break
                full = []
                for k, code in zip(pending, codes):
                    cls = session.client.classify(code)
                    i = todo[k]
                    if cls in (mc.OK, mc.DUPLICATE):
                        ok[i] = True
                        self._remember(fkeys[i], sum(sizes[k]))
                    elif cls == mc.FULL:
                        full.append(k)
                    else:
                        self._counters["put_errors"] += 1
                        self._counters["refused"] += 1
                self._check_codes(session.client, codes, "put")
                if not full:
                    break
                if attempt == 0 and self.available:
                    self._counters["full_retries"] += 1
                    time.sleep(self.full_retry_delay)
                    pending = full
                    continue
                self._counters["refused"] += len(full)
            session.unpin(pins)

    def _read(self, keys: Sequence[str], dsts: Sequence[Parts]) -> list[bool]:
        self._check_open()
        if len(keys) != len(dsts):
            raise ValueError(f"tier {self.name!r}: {len(keys)} keys but {len(dsts)} destinations")
        fkeys = self._full_keys(keys)
        ok = [False] * len(keys)
        if not self.available:
            self._counters["misses_unavailable"] += len(keys)
            return ok
        todo = [i for i, fk in enumerate(fkeys)
                if fk not in self._tombstones and sum(p.numel() for p in dsts[i]) > 0]
        if not todo:
            return ok
        session = self._session
        if session is None:
            return ok
        if getattr(session.client, "reads_locally", False):
            todo = self._read_local(session, todo, fkeys, dsts, ok)
            if not todo:
                return ok
        objs = [dsts[i] for i in todo]
        with self._staging_guard(session, objs):
            pins: list[_Registration] = []
            staged: list[tuple[int, int, int]] = []
            layout = self._layout(session, objs, pins, staged)
            if layout is None:
                session.unpin(pins)
                self._last_error = "memory registration failed"
                return ok
            ptrs, sizes = layout
            devices = self._devices(session, objs)
            want = [sum(s) for s in sizes]
            # pins of a call that outlives its caller are released when it finishes
            codes = self._run(lambda c: c.get([fkeys[i] for i in todo], ptrs, sizes, devices), sum(want), "get",
                              lambda _fut: session.unpin(pins))
            if codes is None:
                if staged:  # the abandoned call may still write into it: later calls get a fresh buffer
                    self._staging = None
                return ok
            for k, code in enumerate(codes):
                i = todo[k]
                if code == want[k]:
                    ok[i] = True
                    self._remember(fkeys[i], want[k])
                else:
                    self._present.pop(fkeys[i], None)
                    self._counters["misses"] += 1
            if staged and any(ok):
                buf = self._staging
                for oi, pj, soff in staged:
                    if ok[todo[oi]]:
                        p = objs[oi][pj]
                        host_copy(p, buf[soff:soff + p.numel()])
            self._check_codes(session.client, codes, "get")
        return ok

    def _read_local(self, session: _Session, todo: list[int], fkeys: list[str], dsts: Sequence[Parts],
                    ok: list[bool]) -> list[int]:
        """Serve what lies in this node's own segment by a plain copy; returns the keys left for a get."""
        host = [i for i in todo if all(p.device.type == "cpu" and p.is_contiguous() for p in dsts[i])]
        if not host:
            return todo
        ptrs = [[p.data_ptr() for p in dsts[i] if p.numel()] for i in host]
        sizes = [[p.numel() for p in dsts[i] if p.numel()] for i in host]
        want = [sum(s) for s in sizes]
        got = self._run(lambda c: c.read_local([fkeys[i] for i in host], ptrs, sizes, LOCAL_LEASE_GUARD_S),
                        sum(want), "local read")
        if got is None:
            return []  # the pool failed: the tier is unavailable and every key is a miss
        for i, n, w in zip(host, got, want):
            if n == w:
                ok[i] = True
                self._remember(fkeys[i], w)
                self._counters["local_reads"] += 1
        return [i for i in todo if not ok[i]]

    def _contains(self, keys: Sequence[str]) -> list[bool]:
        self._check_open()
        fkeys = self._full_keys(keys)
        out = [False] * len(keys)
        if not self.available or not keys:
            return out
        ask = sorted({fk for fk in fkeys if fk not in self._tombstones and not self._known_present(fk)})
        # one exists call per lookup; the sentinel in it proves the remembered keys still stand
        codes = self._run(lambda c: c.exists([self._sentinel, *ask]), 0, "exists")
        if codes is None:
            return out
        if codes[0] != 1:
            if codes[0] == 0:
                self._pool_lost()
            elif codes[0] < 0:
                self._fail(f"exists: code {codes[0]}")
                return out
        answers = dict(zip(ask, codes[1:]))
        for i, fk in enumerate(fkeys):
            if fk in self._tombstones:
                continue
            if fk in answers:
                if answers[fk] == 1:
                    out[i] = True
                    hit = self._present.get(fk)
                    self._present[fk] = (time.monotonic(), hit[1] if hit else -1)
                else:
                    self._present.pop(fk, None)
            else:
                out[i] = self._known_present(fk)
        return out

    def _delete(self, keys: Sequence[str]) -> None:
        self._check_open()
        fkeys = list(dict.fromkeys(self._full_keys(keys)))
        now = time.monotonic()
        for fk in fkeys:
            self._present.pop(fk, None)
            self._tombstones[fk] = now  # until the backend confirms the removal
        if not self.available:
            return
        codes = self._run(lambda c: c.remove(fkeys), 0, "remove")
        if codes is None:
            return
        for fk, code in zip(fkeys, codes):
            if code == 0 or code == mc.NOT_FOUND or self._session.client.classify(code) == mc.MISSING:
                self._tombstones.pop(fk, None)

    def _reap_tombstones(self, session: _Session) -> None:
        """Retry removals the backend refused (objects leased by readers); runs on the probe thread."""
        if not self._tombstones:
            return
        keys = list(self._tombstones)[:1024]
        codes = self._probe_call(session, lambda c: c.remove(keys))
        if isinstance(codes, list):
            for fk, code in zip(keys, codes):
                if code == 0 or session.client.classify(code) == mc.MISSING:
                    self._tombstones.pop(fk, None)

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
    def used_bytes(self) -> int:
        """Bytes of objects this instance stored or read and believes present (an estimate: the pool is shared)."""
        return sum(n for _, n in list(self._present.values()) if n > 0)

    def extra_stats(self) -> dict[str, Any]:
        c = self._counters
        session = self._session
        down_for = None
        if self._unavailable_since is not None:
            down_for = round(time.monotonic() - self._unavailable_since, 3)
        return {
            "backend": self.description,
            "available": self.available,
            "unavailable_for_s": down_for,
            "last_error": self._last_error,
            "refused": c["refused"],
            "refused_unavailable": c["refused_unavailable"],
            "misses_unavailable": c["misses_unavailable"],
            "full_retries": c["full_retries"],
            "local_reads": c["local_reads"],
            "failures": c["failures"],
            "timeouts": c["timeouts"],
            "transfer_errors": c["transfer_errors"],
            "reconnects": c["reconnects"],
            "pool_lost": c["pool_lost"],
            "pending_deletes": len(self._tombstones),
            "abandoned_clients": c["abandoned_clients"],
            "registered_bytes": session.registered_bytes if session else 0,
            "external_regions": session.external_regions if session else 0,
        }

    def close(self) -> None:
        """Stop serving; the client is closed in the background once no call is in flight.

        Closing a Mooncake client takes about two seconds and holds the interpreter
        lock meanwhile; the process's exit waits (at most 10 s) for pending closes.
        """
        if self._closed:
            return
        super().close()
        self._available = False
        self._wake.set()
        session, self._session = self._session, None
        if session is not None:
            session.retire()  # the client is closed once no call is in flight, never before


def pop_remote_options(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """Options every remote tier shares (timeouts, cache sizes) as ``RemotePoolTier`` keyword arguments."""
    out: dict[str, Any] = {
        "namespace": _pop_str(name, options, "namespace", "tierkv"),
        "timeout": _pop_seconds(name, options, "timeout", 1.0),
        "connect_timeout": _pop_seconds(name, options, "connect_timeout", 30.0),
        "connect_wait": _pop_seconds(name, options, "connect_wait", 5.0),
        "probe_interval": _pop_seconds(name, options, "probe_interval", 1.0),
        "presence_ttl": _pop_seconds(name, options, "presence_ttl", 1.0),
        "full_retry_delay": _pop_seconds(name, options, "full_retry_delay", 0.02),
        "min_bandwidth": float(parse_size(options.pop("min_bandwidth", "100MB"), f"tier {name!r} min_bandwidth")),
        "register_limit": parse_size(options.pop("register_limit", "4GiB"), f"tier {name!r} register_limit"),
    }
    workers = options.pop("workers", 4)
    if isinstance(workers, bool) or not isinstance(workers, int) or not 1 <= workers <= 64:
        raise ConfigError(f"tier {name!r}: 'workers' must be an integer in 1..64, got {workers!r}")
    out["workers"] = workers
    return out


def pop_mooncake_settings(name: str, options: dict[str, Any], default_protocol: str = "tcp") -> mc.MooncakeSettings:
    """Mooncake connection options; ``TIERKV_MOONCAKE_*`` environment variables override them."""
    master = _pop_str(name, options, "master", None, "TIERKV_MOONCAKE_MASTER")
    mc.parse_host_port(master, f"tier {name!r} master")
    metadata = _pop_str(name, options, "metadata_server", None, "TIERKV_MOONCAKE_METADATA_SERVER")
    protocol = _pop_str(name, options, "protocol", default_protocol, "TIERKV_MOONCAKE_PROTOCOL")
    if protocol not in ("tcp", "rdma", "ascend"):
        raise ConfigError(f"tier {name!r}: protocol must be 'tcp', 'rdma' or 'ascend', got {protocol!r}")
    segment = parse_size(options.pop("segment", "512MiB"), f"tier {name!r} segment")
    if segment < mc.MIN_SEGMENT:
        raise ConfigError(f"tier {name!r}: segment must be at least 16MiB (Mooncake refuses smaller), got {segment}")
    buffer = parse_size(options.pop("buffer", "16MiB"), f"tier {name!r} buffer")
    hostname = _pop_str(name, options, "local_hostname", "127.0.0.1", "TIERKV_MOONCAKE_LOCAL_HOSTNAME")
    device_name = options.pop("device_name", "")
    if not isinstance(device_name, str):
        raise ConfigError(f"tier {name!r}: 'device_name' must be a string, got {device_name!r}")
    return mc.MooncakeSettings(master=master, metadata_server=metadata, protocol=protocol, segment_bytes=segment,
                               buffer_bytes=buffer, local_hostname=hostname, device_name=device_name)


class DramPoolTier(RemotePoolTier):
    """Host DRAM pooled across nodes; ``backend`` "mooncake" (default) or "memcache"."""

    medium = "dram_pool"
    locality = "remote"
    key_tag = "dram_pool"

    @classmethod
    def from_config(cls, name: str, options: dict[str, Any]) -> "DramPoolTier":
        backend = options.pop("backend", "mooncake")
        if backend == "mooncake":
            settings = pop_mooncake_settings(name, options)
            local = options.pop("local_reads", True)
            if not isinstance(local, bool):
                raise ConfigError(f"tier {name!r}: 'local_reads' must be true or false, got {local!r}")
            settings.local_reads = local
            capacity = cls.pop_capacity(name, options, settings.segment_bytes)
            common = pop_remote_options(name, options)
            cls.reject_unknown(name, options)
            mc.import_mooncake()  # a missing client is a config error now, not a probe failure later
            host, port = settings.master_addr
            return cls(name, capacity, lambda: mc.MooncakeClient(settings),
                       reachable=lambda: mc.tcp_reachable(host, port, 0.2),
                       description=f"mooncake master {settings.master} ({settings.protocol})", **common)
        if backend == "memcache":
            from . import _memcache  # noqa: PLC0415 (imported only when selected)

            mset = _memcache.pop_memcache_settings(name, options)
            capacity = cls.pop_capacity(name, options, mset.capacity_default)
            common = pop_remote_options(name, options)
            cls.reject_unknown(name, options)
            _memcache.import_memcache()
            tier = cls(name, capacity, lambda: _memcache.MemcacheClient(mset),
                       description="memfabric memcache", **common)
            tier.max_key_len = _memcache.MAX_KEY_BYTES
            return tier
        raise ConfigError(f"tier {name!r} (dram_pool): unknown backend {backend!r}; known: 'mooncake', 'memcache'")
