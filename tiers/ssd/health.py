"""``Health``: whether the SSD tier can write now, and its way back after a passing fault.

A fault that passes (a permission error, a full or failing device, a directory that cannot be
reached or made again) makes the tier *not writable* for as long as it lasts: ``SSDTier.available``
says False, so the store places nothing there (its puts answer False and are counted), and
``extra_stats()`` names the cause (``fault``).  Nothing here decides that a fault is permanent: a
probe (``SSDTier._probe``, run by the lock's watcher thread) tries again what failed, first after
``PROBE_FIRST`` seconds, then at doubling intervals up to ``PROBE_MAX``, and the first probe that
succeeds makes the tier writable again.  Only another process taking the directory (``lock.py``:
``DirLock.lost``) stops writes for good.

Owns: the passing fault (``fault``, ``failed``, ``passed``, the probe's schedule), the directory's lock
(``lock_file``, handed over once at open: ``refusal`` asks it whether the directory was taken), and the
reporting of I/O errors (``io_error``, ``write_failed``, ``no_space``: logged, never raised, and counted in
the tier's ``SSDCounters``, under the engine's ``lock``).  Every component that writes or reads the files
is given this object and reports its errors here; none changes its state otherwise.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Optional

from . import region as R
from .counters import SSDCounters
from .lock import DirLock

log = logging.getLogger(__name__)

#: seconds from a fault to the first probe
PROBE_FIRST = 0.05
#: the longest wait between two probes (a fault that passed is found within this)
PROBE_MAX = 1.0
#: a lack of room is logged at most once in this many seconds (every one is counted: ``enospc``)
NO_SPACE_LOG_EVERY = 10.0


class Health:
    """A tier's fault, if any, and when to probe for its end (see the module docstring)."""

    def __init__(self, what: str, path: str, counters: SSDCounters, lock: threading.Lock) -> None:
        self.what = what
        self.path = path
        self.lock_file: Optional[DirLock] = None  # (the directory's, from the open on: ``attach``)
        self._counters = counters  # (the tier's; ``io_errors`` and ``enospc`` counted here, under ``lock``)
        self._lock = lock
        self._no_space_logged = -NO_SPACE_LOG_EVERY  # (monotonic time of the last line about it)
        self._no_space_unlogged = 0
        self.fault: Optional[str] = None  # what made the tier not writable, while it lasts
        self.faults = 0  # faults begun since the open
        self._mu = threading.Lock()
        self._since = 0.0
        self._delay = PROBE_FIRST
        self._next = 0.0

    @property
    def writable(self) -> bool:
        return self.fault is None

    def attach(self, lock_file: DirLock) -> None:
        """The directory's lock, taken by the open (``lock.py``)."""
        self.lock_file = lock_file

    def refusal(self) -> Optional[str]:
        """Why the tier cannot write now, None when it can: another process took the directory (for good),
        or a passing fault (the lock's, ``lock.py``, or a write's, here)."""
        lf = self.lock_file
        if lf is not None and lf.lost:
            who = f"process {lf.holder}" if lf.holder is not None else "another process"
            return f"lock_lost: {who} took {self.path}"
        if lf is not None and lf.fault is not None:
            return lf.fault
        return self.fault

    def lock_lost(self) -> bool:
        """Another process took the directory (for good)."""
        return self.lock_file is not None and self.lock_file.lost

    # -- errors reported by the components ----------------------------------------------------------
    def io_error(self, e: OSError, what: str) -> None:
        """An I/O error: counted (``io_errors``; a lack of room: ``enospc``) and logged, never raised."""
        if R.no_space(e):
            self.no_space(f"{what} failed: {e}")
            return
        with self._lock:
            self._counters.io_errors += 1
        log.warning("%s: %s failed: %s", self.what, what, e)

    def write_failed(self, e: OSError, what: str) -> None:
        """A write the tier owes failed: counted and logged (``io_error``), and the tier is not writable
        until a probe finds the cause gone."""
        self.io_error(e, what)
        self.failed(f"{what} failed: {e.strerror or e}")

    def no_space(self, what: str) -> None:
        """Count a lack of room (``enospc``: a refused write, or the file system's ENOSPC, EDQUOT or EFBIG)
        and log it, at most once every ``NO_SPACE_LOG_EVERY`` seconds (with how many since the last line)."""
        now = time.monotonic()
        with self._lock:
            self._counters.enospc += 1
            self._no_space_unlogged += 1
            if now - self._no_space_logged < NO_SPACE_LOG_EVERY:
                return
            n, self._no_space_unlogged, self._no_space_logged = self._no_space_unlogged, 0, now
            total = self._counters.enospc
        log.warning("%s: no space: %s (%d such events since the last line, %d in all)", self.what, what, n, total)

    def failed(self, cause: str) -> None:
        """A write, or a probe, failed for ``cause``: the tier is not writable until a probe succeeds."""
        now = time.monotonic()
        with self._mu:
            first = self.fault is None
            if first:
                self._since, self._delay = now, PROBE_FIRST
                self.faults += 1
            else:
                self._delay = min(self._delay * 2, PROBE_MAX)
            self.fault = cause
            self._next = now + self._delay
        if first:
            log.warning("%s: cannot write: %s; writes are refused until it passes (probed at most every %.0f s)",
                        self.what, cause, PROBE_MAX)

    def due(self) -> bool:
        """Whether a probe is due (a fault, and its wait over)."""
        return self.fault is not None and time.monotonic() >= self._next

    def passed(self) -> None:
        """A probe succeeded: writable again (logged)."""
        with self._mu:
            if self.fault is None:
                return
            cause, self.fault = self.fault, None
            took = time.monotonic() - self._since
        log.warning("%s: writable again after %.1f s (%s passed)", self.what, took, cause)
