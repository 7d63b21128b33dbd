"""Orderly shutdown at interpreter exit: open stores first, then the media's backend clients.

At a normal end (the script's end, ``sys.exit``, an uncaught exception) Python runs, in
order: the hooks registered with ``threading._register_atexit`` (last registered first;
``concurrent.futures`` registers the one that stops every thread pool from taking new
work), then it joins the non-daemon threads, then runs the ``atexit`` callbacks, then
finalizes the interpreter.  tierkv's hook is registered after the thread pools' own, so
it runs first, while the pools its tiers write through still take work:

1. ``STORES``: every store still open is closed, as ``close()`` would (copies in
   flight finish, persistent tiers are flushed and checkpointed, every tier is closed);
2. ``CLIENTS``: every backend client still open is closed and its worker threads
   joined (``tierkv.tiers.remote.session``).

So no thread of tierkv's is left running while the interpreter finalizes (a native
destructor on a dying thread's stack would abort the process after its work was done).
(CPython 3.12.0 to 3.12.2 refuse to start a thread at exit even this early: there, a
close that needs a new thread fails and is logged.)
A thread of the program's own that still calls a store after this gets
``StoreClosedError``, as it would after ``close()``.

Callbacks run in phase order, then in the order they were added; one that raises is
logged and the rest still run.  A process killed by a signal, or ended by ``os._exit``,
runs none of this.  Only what this process made is closed: a forked child that exits
normally leaves its parent's stores and clients alone (its copies have none of their
threads).
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401 - its exit hook is registered first, so it runs after ours
import logging
import os
import signal
import threading
from collections.abc import Callable

log = logging.getLogger("tierkv")

STORES = 0
CLIENTS = 1

_callbacks: list[tuple[int, int, Callable[[], None]]] = []


def at_exit(phase: int, fn: Callable[[], None]) -> None:
    """Run ``fn`` at interpreter exit, in ``phase`` (``STORES`` before ``CLIENTS``)."""
    _callbacks.append((phase, len(_callbacks), fn))


def _run() -> None:
    for _, _, fn in sorted(_callbacks, key=lambda c: c[:2]):
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - one failing callback must not skip the rest
            log.warning("tierkv: shutting down at exit: %s failed: %r", getattr(fn, "__qualname__", fn), e)


# (CPython 3.9 and later have the hook; ``atexit`` is the fallback of an interpreter without it, or of an
# import while the program is already exiting)
try:
    threading._register_atexit(_run)  # type: ignore[attr-defined]
except (AttributeError, RuntimeError):  # pragma: no cover - (no such hook, or imported while exiting)
    atexit.register(_run)


#: how long a SIGTERM waits for the stores to close before the process ends anyway (seconds)
TERMINATE_WAIT_S = 10.0
_terminate_installed = False


def _terminate(signum: int, frame: object) -> None:
    # The default action comes back first: a second SIGTERM ends the process at once.  The stores are
    # closed on a thread of their own, so a lock the interrupted main thread holds costs the wait, not a hang.
    signal.signal(signum, signal.SIG_DFL)
    log.warning("tierkv: signal %d: closing the stores still open (at most %.0f s), then ending", signum,
                TERMINATE_WAIT_S)
    t = threading.Thread(target=_run, name="tierkv-terminate", daemon=True)
    t.start()
    t.join(TERMINATE_WAIT_S)
    if t.is_alive():
        log.error("tierkv: the stores did not close within %.0f s of signal %d: ending without", TERMINATE_WAIT_S,
                  signum)
    os.kill(os.getpid(), signum)


def close_on_terminate() -> bool:
    """Close every open store (as at a normal exit) before a SIGTERM ends this process.

    For processes an engine ends with SIGTERM while Python's default disposition is in place (which ends
    the process at once, running no exit hook: SGLang's scheduler processes, for one).  Installed only from
    the main thread and only over that default, never over a handler the program set itself; returns
    whether the handler is in place.  A process killed by SIGKILL still runs nothing.
    """
    global _terminate_installed
    if _terminate_installed:
        return True
    if threading.current_thread() is not threading.main_thread():
        return False
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return False
    signal.signal(signal.SIGTERM, _terminate)
    _terminate_installed = True
    return True
