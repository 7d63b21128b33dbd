"""Loopback ports for the tests and the benchmarks: the one place that picks a free port and waits for one to open.

A port from :func:`free_port` was free when asked and is closed again at once: whoever uses it binds it later
(a server started with ``--port``), so another process could take it in between; the tests accept that race.
Used as it is, it is also a port nothing listens on (a "closed port" for tests of unreachable endpoints).
"""

from __future__ import annotations

import socket
import time

HOST = "127.0.0.1"


def free_port(host: str = HOST) -> int:
    """A TCP port on ``host`` that nothing had bound a moment ago (and that nothing listens on now)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float, host: str = HOST) -> bool:
    """Whether a TCP connection to ``host:port`` succeeded within ``timeout`` seconds (tried every 50 ms)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return True
        except OSError:
            time.sleep(0.05)
    return False
