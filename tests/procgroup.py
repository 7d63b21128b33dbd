"""Child processes that run in a process group of their own (``start_new_session=True``): a server and the
processes it starts (vLLM's engine core, SGLang's scheduler), stopped together.

* :func:`kill_group`: one signal to the whole group; a group already gone is no error.
* :func:`stop_group`: ``sig`` to the group, ``grace`` seconds for the leader to exit, then SIGKILL to whatever of
  the group is left (children that outlived the leader included).
* :func:`wait_healthy`: poll an HTTP health URL until it answers 200, failing early (with the caller's log) when
  the leader exits first.

The caller that started a process owns it and calls :func:`stop_group` on every path, failures included.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable


def kill_group(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to ``proc``'s process group (``proc`` must have been started in a session of its own)."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_group(proc: subprocess.Popen, sig: int = signal.SIGTERM, grace: float = 60.0) -> None:
    """Stop ``proc`` and its group: ``sig`` while the leader runs, up to ``grace`` s for it to exit, then SIGKILL."""
    if proc.poll() is None:
        kill_group(proc, sig)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    kill_group(proc, signal.SIGKILL)  # the rest of the group, and a leader that ignored ``sig``
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        pass


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float, what: str, log: Callable[[], str],
                 interval: float = 0.5, started: float | None = None) -> float:
    """Poll ``url`` until it answers 200; the seconds since ``started`` (default: now) it took.

    Raises RuntimeError naming ``what``, with ``log()``, when ``proc`` exits first or ``timeout`` s (from
    ``started``) pass.
    """
    started = time.monotonic() if started is None else started
    end = started + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited (rc={proc.returncode}) during startup:\n{log()}")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return time.monotonic() - started
        except OSError:  # (URLError, refused, reset, timed out: not up yet)
            pass
        time.sleep(interval)  # (a starting server offers no handshake: polling it is all there is)
    raise RuntimeError(f"{what} not healthy after {timeout:.0f} s:\n{log()}")
