"""``Health``: whether the SSD tier can write now, and its way back after a passing fault.

A fault that passes (a permission error, a full or failing device, a directory that cannot be
reached or made again) makes the tier *not writable* for as long as it lasts: ``SSDTier.available``
says False, so the store places nothing there (its puts answer False and are counted), and
``extra_stats()`` names the cause (``fault``).  Nothing here decides that a fault is permanent: a
probe (``SSDTier._probe``, run by the lock's watcher thread) tries again what failed, first after
``PROBE_FIRST`` seconds, then at doubling intervals up to ``PROBE_MAX``, and the first probe that
succeeds makes the tier writable again.  Only another process taking the directory (``lock.py``:
``DirLock.lost``) stops writes for good.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Optional

log = logging.getLogger(__name__)

#: seconds from a fault to the first probe
PROBE_FIRST = 0.05
#: the longest wait between two probes (a fault that passed is found within this)
PROBE_MAX = 1.0


class Health:
    """A tier's fault, if any, and when to probe for its end (see the module docstring)."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.fault: Optional[str] = None  # what made the tier not writable, while it lasts
        self.faults = 0  # faults begun since the open
        self._mu = threading.Lock()
        self._since = 0.0
        self._delay = PROBE_FIRST
        self._next = 0.0

    @property
    def writable(self) -> bool:
        return self.fault is None

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
