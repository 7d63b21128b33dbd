"""Orderly shutdown at interpreter exit: open stores first, then the media's backend clients.

Python finalizes the interpreter after its ``atexit`` callbacks.  A thread still
running then dies at its next attempt to take the interpreter lock, and if a native
destructor is on its stack at that moment (the last reference to caller memory, a
Mooncake client) the process aborts ("terminate called without an active
exception") after its work was done.  So, before finalization:

1. ``STORES``: every store still open is closed, as ``close()`` would (copies in
   flight finish, persistent tiers are flushed, every tier is closed);
2. ``CLIENTS``: every backend client still open is closed and its worker threads
   joined (``tierkv.tiers.remote.session``).

Callbacks run in phase order, then in the order they were added; one that raises is
logged and the rest still run.  A process killed by a signal runs none of this.  Only
what this process made is closed: a forked child that exits normally leaves its
parent's stores and clients alone (its copies have none of their threads).
"""

from __future__ import annotations

import atexit
import logging
from collections.abc import Callable

log = logging.getLogger("tierkv")

STORES = 0
CLIENTS = 1

_callbacks: list[tuple[int, int, Callable[[], None]]] = []


def at_exit(phase: int, fn: Callable[[], None]) -> None:
    """Run ``fn`` at interpreter exit, in ``phase`` (``STORES`` before ``CLIENTS``)."""
    _callbacks.append((phase, len(_callbacks), fn))


@atexit.register
def _run() -> None:
    for _, _, fn in sorted(_callbacks, key=lambda c: c[:2]):
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - one failing callback must not skip the rest
            log.warning("tierkv: shutting down at exit: %s failed: %r", getattr(fn, "__qualname__", fn), e)
