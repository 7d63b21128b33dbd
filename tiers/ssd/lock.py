"""One writer per directory: an exclusive ``flock`` on ``LOCK``, which records the holder's pid.

``flock`` locks belong to an open file description, so a second tier in the same
process conflicts just as another process does; the kernel drops the lock when the
holder dies (SIGKILL included), so a stale file never blocks a restart.

The lock holds for the holder's whole life, even when the directory is removed behind it
(a tmp cleaner, an operator): a lock on a removed file guards nothing, so a watcher thread
checks every ``WATCH_INTERVAL`` seconds that ``LOCK`` is still the file it holds and, if not,
recreates the directory and ``LOCK`` and takes the lock again (``retake``).  Within this
process the paths held are also registered, so a second opener here is refused even before
the watcher has run.  If another live process holds the recreated lock, the lock is *lost*
(``lost``, its pid in ``holder`` and the log): the tier then refuses every write for good (the
directory is someone else's).  Anything else that keeps the watcher from seeing or taking ``LOCK``
(a permission error, an I/O error, a directory it cannot make again) is a *fault* (``fault``, its
cause) that lasts only as long as its cause: the watcher looks again at every interval and clears it
once ``LOCK`` is the file held again.
"""

from __future__ import annotations

import fcntl
import logging
import os
import stat
import threading
from collections.abc import Callable
from typing import Optional

from tierkv.errors import ConfigError

log = logging.getLogger(__name__)

LOCK_NAME = "LOCK"
#: how often the watcher checks that ``LOCK`` is still the file held (seconds)
WATCH_INTERVAL = 0.1

_held: dict[str, "DirLock"] = {}  # directory -> its lock, for every lock this process holds
_held_lock = threading.Lock()


def holder_pid(path: str) -> Optional[int]:
    try:
        with open(os.path.join(path, LOCK_NAME), "rb") as f:
            return int(f.read(32).split()[0])
    except (OSError, ValueError, IndexError):
        return None


class LockHeld(ConfigError):
    """The directory's lock is held by another writer (``pid``: its pid, when ``LOCK`` names one)."""

    def __init__(self, message: str, pid: Optional[int]) -> None:
        super().__init__(message)
        self.pid = pid


def _in_use(what: str, path: str, lock_path: str, pid: Optional[int]) -> LockHeld:
    who = f"process {pid}" if pid is not None else "another process"
    return LockHeld(f"{what}: directory {path} is in use by {who} (lock {lock_path}); one writer per directory", pid)


class DirLock:
    """Held from construction until ``release()`` (raises ``ConfigError`` if it cannot be taken)."""

    def __init__(self, path: str, what: str) -> None:
        self.dir = path
        self.path = os.path.join(path, LOCK_NAME)
        self.what = what
        self.lost = False  # another process holds the directory's (recreated) lock: for good
        self.holder: Optional[int] = None  # (its pid, once lost)
        self.fault: Optional[str] = None  # why ``LOCK`` cannot be seen or taken now, while that lasts
        self.retaken = 0  # times the lock was taken again after ``LOCK`` was removed
        self._mu = threading.Lock()  # (``_fd`` between the owner and the watcher)
        self._stop = threading.Event()
        self._watcher: Optional[threading.Thread] = None
        with _held_lock:
            other = _held.get(path)
            if other is not None:
                raise _in_use(what, path, self.path, os.getpid())
            self._fd = self._take()
            _held[path] = self

    def _take(self) -> int:
        """Open ``LOCK``, lock it, write our pid; the fd.  ConfigError if it is held or cannot be."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600)
        except OSError as e:
            raise ConfigError(f"{self.what}: cannot open the lock file {self.path}: {e.strerror or e}") from e
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ConfigError(f"{self.what}: the lock file {self.path} is not a regular file")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise _in_use(self.what, self.dir, self.path, holder_pid(self.dir)) from None
            except OSError as e:
                raise ConfigError(f"{self.what}: cannot lock {self.path}: {e.strerror or e}") from e
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            except OSError as e:
                raise ConfigError(f"{self.what}: cannot write the lock file {self.path}: {e.strerror or e}") from e
        except BaseException:
            os.close(fd)
            raise
        return fd

    def watch(self, tick: Optional[Callable[[], None]] = None) -> None:
        """Start the watcher thread (see the module docstring); it also calls ``tick`` at every interval."""
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch, args=(tick,),
                                             name=f"tierkv-lock-{os.path.basename(self.dir)}", daemon=True)
            self._watcher.start()

    def _watch(self, tick: Optional[Callable[[], None]]) -> None:
        while not self._stop.wait(WATCH_INTERVAL):
            if not self.lost:
                self.retake()
            if tick is not None:
                try:
                    tick()
                except Exception as e:  # noqa: BLE001 - the watcher outlives any one look
                    log.warning("%s: %s", self.what, e)

    def intact(self) -> bool:
        """Whether ``LOCK`` is still the file this lock holds (not removed, not replaced); raises ``OSError``
        when that cannot be told (a permission error, an I/O error)."""
        with self._mu:
            return self._intact()

    def _intact(self) -> bool:
        if self._fd < 0:
            return True
        st = os.fstat(self._fd)
        if st.st_nlink == 0:
            return False
        try:
            return os.stat(self.path).st_ino == st.st_ino
        except (FileNotFoundError, NotADirectoryError):
            return False

    def _fail(self, cause: str) -> None:
        if self.fault is None:
            log.warning("%s: %s; writes are refused until it passes", self.what, cause)
        self.fault = cause

    def retake(self) -> bool:
        """Whether the lock holds: ``LOCK`` is the file held, or the directory and ``LOCK`` were made again
        and locked again.  False while that cannot be done (``fault``, tried again at the watcher's next
        look) and for good once another process holds the lock (``lost``, ``holder``; logged)."""
        with self._mu:
            if self._fd < 0 or self.lost:
                return False
            try:
                if self._intact():
                    return self._cleared()
                os.makedirs(self.dir, mode=0o700, exist_ok=True)
                fd = self._take()
            except LockHeld as e:
                self.lost, self.holder = True, e.pid
                log.error("%s: %s was removed and process %s took the directory meanwhile: no more writes to "
                          "this directory", self.what, self.path, e.pid if e.pid is not None else "(unknown)")
                return False
            except (OSError, ConfigError) as e:
                self._fail(f"cannot reach or lock {self.path}: {getattr(e, 'strerror', None) or e}")
                return False
            os.close(self._fd)
            self._fd = fd
            self.retaken += 1
            log.warning("%s: %s was removed behind the tier; recreated and locked again", self.what, self.path)
            return self._cleared()

    def _cleared(self) -> bool:
        if self.fault is not None:
            log.warning("%s: %s reachable and held again (%s passed)", self.what, self.path, self.fault)
            self.fault = None
        return True

    def release(self) -> None:
        self._stop.set()
        w = self._watcher
        if w is not None and w is not threading.current_thread():
            w.join()
        with self._mu:
            if self._fd >= 0:
                if not self.lost:
                    try:
                        os.ftruncate(self._fd, 0)
                    except OSError:
                        pass
                os.close(self._fd)  # closing drops the flock
                self._fd = -1
        with _held_lock:
            if _held.get(self.dir) is self:
                del _held[self.dir]
