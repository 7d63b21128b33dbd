"""The channels between the scheduler and its workers: Unix sockets carrying typed requests.

vLLM's scheduler decides how many tokens to load, but the store that holds
them lives with the workers, often in other processes (vLLM starts workers as
separate processes even for one rank).  Each worker therefore serves its own
store's answers on local sockets; the scheduler asks the workers of every
KV-head shard and takes the smallest answer.  When scheduler and worker share a
process, the call is direct (no socket, the same checks).

A worker has one socket per :class:`~.service.Channel`, each carrying one request
type of service.py over ``multiprocessing.connection`` (authenticated with a key
derived from the engine id): ``lookup`` (``ProbeRequest`` -> ``ProbeAnswer``) and
``lifecycle`` (``ShutdownRequest``).  A reply is ``("ok", answer)`` or
``("error", message)``; a request of another type is an error that names it.

Sockets leave nothing behind: on Linux they live in the abstract namespace
(the kernel drops the name when its owner dies, however it dies); elsewhere they
are files in the temp directory, and a file whose owner is gone (no process
listens on it) is removed when a worker starts (:func:`sweep_stale_sockets`).
"""

from __future__ import annotations

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

from .service import REQUEST_TYPE, Channel

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

log = logging.getLogger("tierkv.adapters.vllm")

#: a channel's handler: its request in, the answer out
Handler = Callable[[Any], Any]

# in-process workers: address -> (channel, handler) (a scheduler in the same process calls it directly)
_local: dict[str, tuple[Channel, Handler]] = {}
_local_lock = threading.Lock()


#: abstract-namespace Unix sockets (no file, released by the kernel when the owner dies)
ABSTRACT = sys.platform.startswith("linux")

SOCKET_GLOB = "tierkv-*.sock"


def endpoint(engine_id: str, dp_rank: int, tp_rank: int, channel: Channel = Channel.LOOKUP,
             abstract: bool | None = None) -> tuple[str, bytes]:
    """Socket address and auth key of one worker's ``channel``.

    The address is ``tierkv-<hash>-<tp_rank>.sock`` (lookups) or
    ``tierkv-<hash>-<tp_rank>-lifecycle.sock``: in the abstract namespace (a leading
    NUL) on Linux, else a file in the temp directory.
    """
    digest = hashlib.sha256(f"tierkv-lookup\x00{engine_id}\x00{dp_rank}".encode()).hexdigest()
    suffix = "" if channel is Channel.LOOKUP else f"-{channel.value}"
    name = f"tierkv-{digest[:20]}-{tp_rank}{suffix}.sock"
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


def answer(channel: Channel, handler: Handler, request: Any) -> Any:
    """``handler``'s answer to ``request``, which must be the one request type ``channel`` carries."""
    want = REQUEST_TYPE[channel]
    if not isinstance(request, want):
        raise TypeError(f"the {channel.value} channel takes a {want.__name__}, got {type(request).__name__}")
    return handler(request)


class ChannelServer:
    """Serves one of a worker's channels on a Unix socket (and in-process)."""

    def __init__(self, path: str, authkey: bytes, channel: Channel, handler: Handler) -> None:
        self.path = path
        self.channel = channel
        self._handler = handler
        self._closed = False
        with _local_lock:
            _local[path] = (channel, handler)
        self._is_file = not path.startswith("\x00")
        try:
            if self._is_file and os.path.exists(path) and _is_stale(path, _bound_unix_paths()):
                os.unlink(path)
            self._listener: Optional[Listener] = Listener(path, family="AF_UNIX", authkey=authkey)
        except OSError as e:  # the in-process path still works
            log.warning("tierkv: lookup socket %s unavailable: %s", path, e)
            self._listener = None
            return
        self._thread = threading.Thread(target=self._accept, name=f"tierkv-{channel.value}", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn = cast(Listener, self._listener).accept()  # (None once closed: raises, handled below)
            except Exception:  # noqa: BLE001 - closed, or a client that failed auth
                if self._closed:
                    return
                continue
            threading.Thread(target=self._serve, args=(conn,), name=f"tierkv-{self.channel.value}-conn",
                             daemon=True).start()

    def _serve(self, conn) -> None:
        with conn:
            while not self._closed:
                try:
                    request = conn.recv()
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
                    reply = ("ok", answer(self.channel, self._handler, request))
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


class ChannelClient:
    """The scheduler's handle on one of a worker's channels."""

    def __init__(self, path: str, authkey: bytes, connect_timeout: float = 5.0) -> None:
        self.path = path
        self._authkey = authkey
        self._timeout = connect_timeout
        self._conn: Optional[Connection] = None
        self._lock = threading.Lock()

    def _in_process(self) -> tuple[Channel, Handler] | None:
        with _local_lock:
            return _local.get(self.path)

    def call(self, request: Any) -> Any:
        """The worker's answer to ``request``; a ``RuntimeError`` carries the worker's error."""
        local = self._in_process()
        if local is not None:
            return answer(*local, request)
        with self._lock:
            for attempt in range(2):
                if self._conn is None:
                    self._conn = self._connect()
                try:
                    self._conn.send(request)
                    status, value = self._conn.recv()
                    break
                except (EOFError, OSError):
                    self._conn = None
                    if attempt:
                        raise
            if status != "ok":
                raise RuntimeError(f"worker {type(request).__name__} failed: {value}")
            return value

    def post(self, request: Any) -> None:
        """Send ``request`` without waiting for the answer (used while the engine goes down)."""
        local = self._in_process()
        if local is not None:
            answer(*local, request)
            return
        with self._lock:
            if self._conn is None:
                self._conn = self._connect()
            self._conn.send(request)

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
