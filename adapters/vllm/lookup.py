"""Scheduler -> worker lookups.

vLLM's scheduler decides how many tokens to load, but the store that holds
them lives with the workers, often in other processes (vLLM starts workers as
separate processes even for one rank).  Each worker therefore answers lookups
for its own store on a local socket; the scheduler asks the workers of every
KV-head shard and takes the smallest answer.  When scheduler and worker share a
process, the call is direct.

Requests are ``(op, args)`` tuples over ``multiprocessing.connection`` (Unix
socket, authenticated with a key derived from the engine id):

``("lookup", (hashes, base, lo, hi, salt))`` -> blocks ``lo..hi-1`` stored for every
layer, counted from ``lo`` (``hashes[i]`` is block ``base+i``'s hash)
``("locate", (hashes, base, lo, hi, salt))`` -> ``[(tier name, locality) | None]`` per block
``("probe", (hashes, 0, lo, hi, salt))`` -> ``(reach, held, where)``: a request's whole lookup in one
round trip (hashes from block 0): ``lookup`` of ``lo..hi-1``, ``lookup`` of ``0..lo-1``, and ``locate``
of the ``reach`` blocks found from ``lo``
``("shutdown", ())`` -> None: the worker drains and closes (the engine is going down)

Sockets leave nothing behind: on Linux they live in the abstract namespace
(the kernel drops the name when its owner dies, however it dies); elsewhere they
are files in the temp directory, and a file whose owner is gone (no process
listens on it) is removed when a worker starts (:func:`sweep_stale_sockets`).
"""

from __future__ import annotations

import atexit
import glob
import hashlib
import logging
import os
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Client, Listener
from typing import TYPE_CHECKING, Any, Optional, cast

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

log = logging.getLogger("tierkv.adapters.vllm")

Handler = Callable[..., Any]  # handler(op, *args)

# in-process workers: address -> handler (a scheduler in the same process calls it directly)
_local: dict[str, Handler] = {}
_local_lock = threading.Lock()


#: abstract-namespace Unix sockets (no file, released by the kernel when the owner dies)
ABSTRACT = sys.platform.startswith("linux")

SOCKET_GLOB = "tierkv-*.sock"


def endpoint(engine_id: str, dp_rank: int, tp_rank: int, abstract: bool | None = None) -> tuple[str, bytes]:
    """Socket address and auth key of one worker's lookup service.

    The address is ``tierkv-<hash>-<tp_rank>.sock``: in the abstract namespace
    (a leading NUL) on Linux, else a file in the temp directory.
    """
    digest = hashlib.sha256(f"tierkv-lookup\x00{engine_id}\x00{dp_rank}".encode()).hexdigest()
    name = f"tierkv-{digest[:20]}-{tp_rank}.sock"
    use_abstract = ABSTRACT if abstract is None else abstract
    path = "\x00" + name if use_abstract else os.path.join(tempfile.gettempdir(), name)
    return path, hashlib.sha256(b"tierkv-auth\x00" + engine_id.encode()).digest()


def _bound_unix_paths() -> set[str] | None:
    """Paths of every Unix socket some live process has bound (Linux), or None when unknown."""
    try:
        with open("/proc/net/unix") as f:
            lines = f.read().splitlines()[1:]
    except OSError:
        return None
    return {parts[7] for parts in (line.split() for line in lines) if len(parts) >= 8}


def _is_stale(path: str, bound: set[str] | None) -> bool:
    if bound is not None:
        return path not in bound
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(0.5)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        return True  # a file nobody listens on: its owner is gone
    except OSError:
        return False
    finally:
        probe.close()
    return False


def sweep_stale_sockets(directory: str | None = None) -> list[str]:
    """Remove lookup socket files left by workers that died (no process listens on them); returns them."""
    directory = directory or tempfile.gettempdir()
    bound = _bound_unix_paths()
    removed = []
    for path in glob.glob(os.path.join(directory, SOCKET_GLOB)):
        try:
            if not _is_stale(path, bound):
                continue
            st = os.lstat(path)
            if st.st_uid != os.getuid():
                continue  # another user's: not ours to judge
            os.unlink(path)
            removed.append(path)
        except OSError:
            continue
    if removed:
        log.info("tierkv: removed %d stale lookup socket(s) of dead workers", len(removed))
    return removed


class LookupServer:
    """Serves one worker's lookups on a Unix socket (and in-process)."""

    def __init__(self, path: str, authkey: bytes, handler: Handler) -> None:
        self.path = path
        self._handler = handler
        self._closed = False
        with _local_lock:
            _local[path] = handler
        self._is_file = not path.startswith("\x00")
        try:
            if self._is_file and os.path.exists(path) and _is_stale(path, _bound_unix_paths()):
                os.unlink(path)
            self._listener: Optional[Listener] = Listener(path, family="AF_UNIX", authkey=authkey)
        except OSError as e:  # the in-process path still works
            log.warning("tierkv: lookup socket %s unavailable: %s", path, e)
            self._listener = None
            return
        self._thread = threading.Thread(target=self._accept, name="tierkv-lookup", daemon=True)
        self._thread.start()
        atexit.register(self.close)  # workers are often stopped without a connector shutdown

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn = cast(Listener, self._listener).accept()  # (None once closed: raises, handled below)
            except Exception:  # noqa: BLE001 - closed, or a client that failed auth
                if self._closed:
                    return
                continue
            threading.Thread(target=self._serve, args=(conn,), name="tierkv-lookup-conn", daemon=True).start()

    def _serve(self, conn) -> None:
        with conn:
            while not self._closed:
                try:
                    op, args = conn.recv()
                except (EOFError, OSError):
                    return
                except Exception as e:  # noqa: BLE001 - a malformed message from an authenticated peer
                    reply = ("error", f"bad request: {e!r}")
                    try:
                        conn.send(reply)
                    except OSError:
                        return
                    continue
                try:
                    reply = ("ok", self._handler(op, *args))
                except Exception as e:  # noqa: BLE001 - reported to the caller, never fatal here
                    reply = ("error", repr(e))
                try:
                    conn.send(reply)
                except OSError:
                    return

    def close(self) -> None:
        self._closed = True
        with _local_lock:
            _local.pop(self.path, None)
        listener, self._listener = self._listener, None
        if listener is not None:
            # a thread blocked in accept() keeps the socket bound: wake it with a connection
            # it will drop (it sees _closed), then close, so the name is free at once
            try:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                    s.settimeout(1.0)
                    s.connect(self.path)
            except OSError:
                pass
            if self._thread is not threading.current_thread():
                self._thread.join(timeout=2.0)
            try:
                listener.close()  # unlinks a file socket too
            except OSError:
                pass
            if self._is_file:
                try:
                    os.unlink(self.path)
                except OSError:
                    pass


class LookupClient:
    """The scheduler's handle on one worker's lookup service."""

    def __init__(self, path: str, authkey: bytes, connect_timeout: float = 5.0) -> None:
        self.path = path
        self._authkey = authkey
        self._timeout = connect_timeout
        self._conn: Optional[Connection] = None
        self._lock = threading.Lock()

    def _handler(self) -> Handler | None:
        with _local_lock:
            return _local.get(self.path)

    def call(self, op: str, *args: Any) -> Any:
        h = self._handler()
        if h is not None:
            return h(op, *args)
        with self._lock:
            for attempt in range(2):
                if self._conn is None:
                    self._conn = self._connect()
                try:
                    self._conn.send((op, args))
                    status, value = self._conn.recv()
                    break
                except (EOFError, OSError):
                    self._conn = None
                    if attempt:
                        raise
            if status != "ok":
                raise RuntimeError(f"worker lookup failed: {value}")
            return value

    def post(self, op: str, *args: Any) -> None:
        """Send ``op`` without waiting for the answer (used while the engine goes down)."""
        h = self._handler()
        if h is not None:
            h(op, *args)
            return
        with self._lock:
            if self._conn is None:
                self._conn = self._connect()
            self._conn.send((op, args))

    def _connect(self):
        deadline = time.monotonic() + self._timeout
        while True:
            try:
                return Client(self.path, family="AF_UNIX", authkey=self._authkey)
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                try:
                    self._conn.close()
                except OSError:
                    pass
                self._conn = None
