"""The tier's directory, before the engine opens it: this user's and private, of this tier's layout.

``prepare_dir`` creates ``path`` (0700) or checks the one there: owned by this user, a
directory, made private if it was not; refused if it holds the former
one-file-per-object layout (``*.kv`` files, ``check_old_layout``) or if a name of
the layout (``regions``, ``LOCK``, ``checkpoint``, the dead log) is of the wrong
kind.  ``probe_direct`` says whether the file system takes ``O_DIRECT`` writes.
Every refusal is a ``ConfigError`` naming the path.
"""

from __future__ import annotations

import os
import stat
from typing import Optional

from tierkv.errors import ConfigError

from . import checkpoint as C
from . import deadlog
from . import format as F
from .engineconfig import REGIONS_DIR
from .lock import LOCK_NAME


def prepare_dir(path: str, what: str) -> None:
    """Make ``path`` the tier's directory (created 0700, or checked and made private); ``what`` names the
    tier in errors.  Then ``check_old_layout`` and ``check_layout``."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{what}: cannot create directory {path}: {e}") from e
    st = os.stat(path)
    if st.st_uid != os.geteuid():
        raise ConfigError(f"{what}: directory {path} is owned by uid {st.st_uid}, not us")
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{what}: {path} is not a directory")
    if st.st_mode & 0o077:
        try:
            os.chmod(path, 0o700)
        except OSError as e:
            raise ConfigError(f"{what}: cannot make {path} private (0700): {e.strerror or e}") from e
    check_old_layout(path)
    check_layout(path, what)


def check_old_layout(path: str) -> None:
    """Raise if ``path`` holds the former one-file-per-object layout (shard dirs of ``*.kv`` files)."""
    try:
        names = os.listdir(path)
    except OSError:
        return
    for n in names:
        p = os.path.join(path, n)
        if n.endswith(".kv") or (len(n) == 2 and os.path.isdir(p) and any(
                f.endswith(".kv") for f in os.listdir(p))):
            raise ConfigError(f"ssd directory {path} holds the old one-file-per-object layout (*.kv files); "
                              "this tier keeps regions: give it a new directory, or remove the old files")


def check_layout(path: str, what: str) -> None:
    """A ``ConfigError`` naming the path if something of the layout is of the wrong kind."""
    for name, want_dir in ((REGIONS_DIR, True), (LOCK_NAME, False), (C.NAME, False), (deadlog.NAME, False)):
        p = os.path.join(path, name)
        try:
            st = os.stat(p)
        except FileNotFoundError:
            continue
        except OSError as e:
            raise ConfigError(f"{what}: cannot use {p}: {e.strerror or e}") from e
        if want_dir and not stat.S_ISDIR(st.st_mode):
            raise ConfigError(f"{what}: {p} is not a directory (the tier keeps its region files there); "
                              "move it away or give the tier another directory")
        if not want_dir and not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{what}: {p} is not a regular file (the tier keeps its {name} file "
                              "there); move it away or give the tier another directory")


def probe_direct(path: str, what: str, want: Optional[bool]) -> bool:
    """Whether the tier writes with ``O_DIRECT`` in ``path``: ``want`` False never, None when the file system
    takes it (one block written to a probe file, then removed), True or a ``ConfigError``."""
    if want is False:
        return False
    probe = os.path.join(path, ".probe-direct")
    try:
        fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o600)
        try:
            os.pwrite(fd, F.aligned_buffer(F.BLOCK), 0)
        finally:
            os.close(fd)
        ok, err = True, None
    except OSError as e:
        ok, err = False, e
    finally:
        try:
            os.unlink(probe)
        except OSError:
            pass
    if want and not ok:
        raise ConfigError(f"{what}: direct_io is not supported on {path}: {err}")
    return ok
