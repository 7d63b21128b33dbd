"""One writer per directory: an exclusive ``flock`` on ``LOCK``, which records the holder's pid.

``flock`` locks belong to an open file description, so a second tier in the same
process conflicts just as another process does; the kernel drops the lock when the
holder dies (SIGKILL included), so a stale file never blocks a restart.
"""

from __future__ import annotations

import fcntl
import os
from typing import Optional

from tierkv.errors import ConfigError

LOCK_NAME = "LOCK"


def holder_pid(path: str) -> Optional[int]:
    try:
        with open(os.path.join(path, LOCK_NAME), "rb") as f:
            return int(f.read(32).split()[0])
    except (OSError, ValueError, IndexError):
        return None


class DirLock:
    """Held from construction until ``release()``."""

    def __init__(self, path: str, what: str) -> None:
        self.path = os.path.join(path, LOCK_NAME)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            pid = holder_pid(path)
            who = f"process {pid}" if pid is not None else "another process"
            raise ConfigError(f"{what}: directory {path} is in use by {who} (lock {self.path}); "
                              "one writer per directory") from None
        except OSError as e:
            os.close(fd)
            raise ConfigError(f"{what}: cannot lock {self.path}: {e}") from e
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd >= 0:
            try:
                os.ftruncate(self._fd, 0)
            except OSError:
                pass
            os.close(self._fd)  # closing drops the flock
            self._fd = -1
