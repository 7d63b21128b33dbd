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
``("locate", (hashes, base, lo, hi, salt))`` -> ``[(tier name, medium) | None]`` per block
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import os
import tempfile
import threading
import time
from multiprocessing.connection import Client, Listener
from typing import Any, Callable

log = logging.getLogger("tierkv.adapters.vllm")

Handler = Callable[..., Any]  # handler(op, *args)

# in-process workers: address -> handler (a scheduler in the same process calls it directly)
_local: dict[str, Handler] = {}
_local_lock = threading.Lock()


def endpoint(engine_id: str, dp_rank: int, tp_rank: int) -> tuple[str, bytes]:
    """Socket path and auth key of one worker's lookup service."""
    digest = hashlib.sha256(f"tierkv-lookup\x00{engine_id}\x00{dp_rank}".encode()).hexdigest()
    path = os.path.join(tempfile.gettempdir(), f"tierkv-{digest[:20]}-{tp_rank}.sock")
    return path, hashlib.sha256(b"tierkv-auth\x00" + engine_id.encode()).digest()


class LookupServer:
    """Serves one worker's lookups on a Unix socket (and in-process)."""

    def __init__(self, path: str, authkey: bytes, handler: Handler) -> None:
        self.path = path
        self._handler = handler
        self._closed = False
        with _local_lock:
            _local[path] = handler
        try:
            if os.path.exists(path):
                os.unlink(path)
            self._listener = Listener(path, family="AF_UNIX", authkey=authkey)
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
                conn = self._listener.accept()
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
        if self._listener is not None:
            try:
                self._listener.close()
            except OSError:
                pass
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
        self._conn = None
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
