"""How the connector survives the engine going down, whatever way it goes.

What runs when vLLM's OpenAI server is stopped (SIGINT, SIGTERM; the default
``--shutdown-timeout 0``): the API server sends SIGTERM to the engine-core
process and, at once, SIGKILL to it and its worker processes.  A worker then
runs no Python at all, so no in-process hook can be relied on.  Layers, each for
a path that does run:

* **Nothing queued between steps.**  ``wait_for_save`` returns once the step's
  saves are in the store (worker.py), so a kill between steps loses no save.
* **Signals, chained to vLLM's own.**  In vLLM's engine-core and worker
  processes (where vLLM installed a Python handler for SIGTERM / SIGINT) the
  connector's handler runs first: a worker drains and closes at once, an
  engine core tells its workers to (when vLLM aborts rather than drains); then
  vLLM's handler runs as before.  Processes with Python's default handlers
  (an ``LLM`` in a user's script) are left alone.
* **Exit and collection.**  Each connector has a ``weakref.finalize`` (it also
  runs at interpreter exit), so an engine dropped or an interpreter ending
  without ``shutdown`` still drains and closes.
* **A watcher outside the process tree.**  A worker starts one small stdlib-only
  process (reaper.py) that vLLM's kill does not reach: the worker sends it its
  totals as they change; if the worker dies before its connector shut down, the
  watcher prints the totals line and removes any file socket left behind.
  Channel sockets live in the abstract namespace on Linux (nothing to leave), and
  a worker start removes file sockets of dead predecessors (lookup.py).
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable
from typing import IO, Any, cast

logger = logging.getLogger("vllm.tierkv.lifecycle")

_lock = threading.Lock()
_on_signal: list[weakref.ref] = []  # callables (bound methods, weakly) run on SIGTERM / SIGINT
_chained: dict[int, Any] = {}  # signal -> the handler we replaced


def _run_callbacks(signum: int) -> None:
    with _lock:
        refs = list(_on_signal)
    for ref in refs:
        fn = ref()
        if fn is None:
            continue
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - never stand between the engine and its own handler
            logger.warning("TierKVConnector: shutdown on signal %d failed: %s", signum, e)


def _handler(signum: int, frame: Any) -> None:
    _run_callbacks(signum)
    _chained[signum](signum, frame)  # the engine's own handler (only callables are chained)


def on_engine_signal(fn: Callable[[], None]) -> bool:
    """Run ``fn`` on SIGTERM / SIGINT before the engine's own handler (held weakly if a bound method).

    Installs the chained handler only in the main thread and only where the
    engine replaced Python's defaults (vLLM's engine-core and worker processes).
    Returns whether ``fn`` will run on those signals.
    """
    if threading.current_thread() is not threading.main_thread():
        return False
    with _lock:
        for sig in (signal.SIGTERM, signal.SIGINT):
            if sig in _chained:
                continue
            cur = signal.getsignal(sig)
            if not callable(cur) or cur is signal.default_int_handler or cur is _handler:
                continue  # Python's defaults: not an engine process, leave it be
            _chained[sig] = cur
            signal.signal(sig, _handler)
        if not _chained:
            return False
        ref = weakref.WeakMethod(fn) if hasattr(fn, "__self__") else (lambda f=fn: f)
        _on_signal.append(ref)  # type: ignore[arg-type]
        return True


def on_exit(owner: object, fn: Callable[[], None]) -> weakref.finalize:
    """Run ``fn`` when ``owner`` is collected or the interpreter exits, whichever comes first."""
    return weakref.finalize(owner, fn)


# ---------------------------------------------------------------------------------------
# the watcher
# ---------------------------------------------------------------------------------------
class Watcher:
    """This process's handle on its reaper (reaper.py); one per process, shared by its workers."""

    _instance: Watcher | None = None
    _instance_pid = 0

    def __init__(self) -> None:
        from tierkv.adapters.vllm import reaper

        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", reaper.__file__, str(os.getpid())],
            stdin=subprocess.PIPE, stdout=None, stderr=None, close_fds=True, start_new_session=True,
        )
        self._pipe = proc.stdin  # (kept: its descriptor stays open while this handle lives)
        self._fd = cast("IO[bytes]", proc.stdin).fileno()
        proc.wait(timeout=30)  # it forks the watcher and exits at once: reap it
        if proc.returncode != 0:
            raise RuntimeError(f"the watcher did not start (exit {proc.returncode})")

    @classmethod
    def get(cls) -> Watcher | None:
        """The process's watcher, started on first use; None where it cannot run."""
        with _lock:
            if cls._instance is None or cls._instance_pid != os.getpid():
                try:
                    cls._instance, cls._instance_pid = cls(), os.getpid()
                except Exception as e:  # noqa: BLE001 - the connector works without it
                    logger.info("TierKVConnector: no exit watcher (%s)", e)
                    return None
            return cls._instance

    def send(self, kind: str, ident: str, payload: Any = None) -> None:
        """Tell the watcher one line; never raises (the watcher gone, there is nothing more to tell it).

        Every line leaves in one ``write(2)`` of at most ``PIPE_BUF`` bytes, which the kernel keeps whole
        between writers, so no lock is taken: the worker's shutdown runs in a signal handler on the engine's
        thread, and a lock held by that thread's interrupted ``send`` would never be released for the
        handler's own report (``logged``).  A line that would be longer (none is: totals are a dozen
        counters, a socket path at most 108 bytes) goes with its payload replaced by its length.
        """
        data = (json.dumps([kind, ident, payload], default=str) + "\n").encode()
        if len(data) > select.PIPE_BUF:
            data = (json.dumps([kind, ident, {"over_pipe_buf": len(data)}]) + "\n").encode()
        self._write(data)

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self._fd, view):]
        except OSError:
            pass  # the watcher is gone: nothing more to tell it

    def watch(self, ident: str, socket_paths: list[str]) -> Callable[[str, dict | None], None]:
        """Register a worker and its channels' sockets; returns its ``report(kind, payload)`` (kinds: totals,
        logged, clean)."""
        self.send("start", ident, {"sockets": list(socket_paths)})
        return lambda kind, payload=None: self.send(kind, ident, payload)  # type: ignore[misc]  # (a lambda's default)
