"""Region files: one preallocated file per region, and the reads that interpret one.

A ``Region`` is the tier's bookkeeping for one file.  States: ``FREE`` (reusable: no
live object; its old contents are ignored once it is reused with a new seq),
``ACTIVE`` (the one being filled: its image lives in memory, ``buf``, and reads of it
are served from there) and ``SEALED`` (written out with its summary).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
from typing import Optional, cast

import numpy as np

from . import format as F

FREE, ACTIVE, SEALED = 0, 1, 2
#: how much of a region's tail one read fetches for its summary (a longer summary costs a second read)
TAIL_READ = 1 << 20


def region_name(index: int) -> str:
    return f"r{index:06d}.region"


def parse_region_name(name: str) -> Optional[int]:
    if len(name) == 14 and name.startswith("r") and name.endswith(".region") and name[1:7].isdigit():
        return int(name[1:7])
    return None


class Region:
    __slots__ = (
        "buf",
        "count",
        "direct",
        "entries",
        "fd",
        "foreign",
        "index",
        "ino",
        "keys",
        "live_bytes",
        "live_count",
        "path",
        "pos",
        "seq",
        "state",
        "sum_start",
        "tail",
        "written",
    )
    buf: Optional[mmap.mmap]  # the image while ACTIVE (``format.aligned_buffer``)
    entries: Optional[bytearray]  # summary entries and keys while ACTIVE
    keys: Optional[bytearray]
    direct: set[int]  # offsets of the active region's records whose payload is in the file only
    tail: tuple[int, int]  # (data end, end) of the last write-out: the file holds zeros between them

    def __init__(self, index: int, path: str) -> None:
        self.index = index
        self.path = path
        self.fd = -1
        self.ino = 0
        self.seq = 0
        self.state = FREE
        self.live_bytes = 0  # slot bytes (record + summary entry) of live objects
        self.live_count = 0
        self.foreign = False  # a file we cannot interpret: never written, never deleted
        self.buf = None
        self.pos = self.written = self.count = 0
        self.entries = self.keys = None
        self.direct = set()
        self.sum_start = 0  # where the summary of this use of the region starts, when known (0: unknown)
        self.tail = (0, 0)

    # -- the active image ------------------------------------------------------------
    def start(self, seq: int, region_size: int, image: mmap.mmap) -> None:
        """Become the active region, filling ``image`` (a region-sized aligned buffer, maybe reused)."""
        self.seq = seq
        self.state = ACTIVE
        self.buf = image
        F.pack_region_header(self.buf, self.index, seq, region_size)
        self.pos = F.BLOCK
        self.written = 0
        self.entries = bytearray()
        self.keys = bytearray()
        self.count = 0
        self.live_bytes = self.live_count = 0
        self.sum_start = 0
        self.direct = set()
        self.tail = (0, 0)

    def fits(self, rec_len: int, key_len: int, region_size: int) -> bool:
        end = F.align_up(self.pos + rec_len, F.ALIGN)
        return F.summary_start(region_size, self.count + 1, len(cast(bytearray, self.keys)) + key_len) >= end

    def add_entry(self, digest: int, offset: int, rec_len: int, raw_len: int, kb: bytes, flags: int) -> None:
        entries, keys = cast(bytearray, self.entries), cast(bytearray, self.keys)  # (set while ACTIVE)
        entries += F.pack_entry(digest, offset, rec_len, raw_len, len(kb), flags)
        keys += kb
        self.count += 1


# -- file operations ------------------------------------------------------------------
def open_fd(path: str, direct: bool, create: bool = False) -> int:
    flags = os.O_RDWR | getattr(os, "O_CLOEXEC", 0) | (os.O_CREAT if create else 0)
    if direct:
        flags |= os.O_DIRECT
    return os.open(path, flags, 0o600)


def no_space(e: OSError) -> bool:
    """Whether an error says the file system (or a quota, or a file size limit) has no room."""
    return e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def preallocate(fd: int, size: int) -> None:
    """Reserve the region's blocks now, so a full disk shows here and not mid-region."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)):
            raise
        os.ftruncate(fd, size)


_FALLOC_KEEP_SIZE = 1
_libc = None


def reserve_beyond_end(fd: int, nbytes: int) -> bool:
    """Reserve ``nbytes`` of blocks after the file's end without changing its size (``fallocate`` with
    ``FALLOC_FL_KEEP_SIZE``), so appends there need no new blocks (a file system that fills up later still
    takes them).  False where the file system cannot or has no room (nothing is reserved then)."""
    global _libc
    if _libc is None:
        import ctypes

        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    try:
        end = os.fstat(fd).st_size
    except OSError:
        return False
    return _libc.fallocate(fd, _FALLOC_KEEP_SIZE, end, nbytes) == 0


def pwrite_all(fd: int, view, offset: int) -> None:
    view = memoryview(view)
    while view:
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OSError(errno.EIO, "short write")
        view, offset = view[n:], offset + n


_IOV_MAX = 1024  # (Linux's limit on the buffers of one pwritev)


def pwritev_all(fd: int, bufs: list, offset: int) -> None:
    """Write the buffers back to back from ``offset`` (as many ``pwritev`` calls as it takes)."""
    for i in range(0, len(bufs), _IOV_MAX):
        chunk = bufs[i:i + _IOV_MAX]
        got = os.pwritev(fd, chunk, offset)
        want = sum(len(b) for b in chunk)
        if got < want:  # (a short write: the rest piece by piece)
            if got < 0:
                raise OSError(errno.EIO, "short write")
            at = offset + got
            for b in chunk:
                n = len(b)
                if got >= n:
                    got -= n
                    continue
                rest = memoryview(b).cast("B")[got:]
                got = 0
                pwrite_all(fd, rest, at)
                at += len(rest)
        offset += want


def pwrite_runs(fd: int, runs: list) -> None:
    """``pwritev_all`` of each (offset, buffers) run."""
    for offset, bufs in runs:
        pwritev_all(fd, bufs, offset)


_tls = threading.local()


def _scratch(n: int):
    """This thread's reusable aligned read buffer, at least ``n`` bytes."""
    buf = getattr(_tls, "buf", None)
    if buf is None or len(buf) < n:
        buf = _tls.buf = F.aligned_buffer(max(n, 1 << 20), populate=True)
        _tls.keeper = ctypes.c_char.from_buffer(buf)
        _tls.addr = ctypes.addressof(_tls.keeper)
    return buf


def scratch(n: int) -> tuple[mmap.mmap, int]:
    """This thread's scratch buffer (at least ``n`` bytes) and its address."""
    buf = _scratch(n)
    return buf, _tls.addr


def buffer_address(buf) -> int:
    """The address of this thread's scratch buffer ``buf``."""
    assert buf is _tls.buf
    return _tls.addr


def read_span_scratch(fd: int, offset: int, length: int, direct: bool) -> tuple[memoryview, int]:
    """``read_span(scratch=True)`` and the address of the view's first byte."""
    if direct:
        start, end = F.align_down(offset), F.align_up(offset + length)
    else:
        start, end = offset, offset + length
    buf = _scratch(end - start)
    got = os.preadv(fd, [memoryview(buf)[:end - start]], start)
    lo = offset - start
    return memoryview(buf)[lo:max(lo, min(got, lo + length))], _tls.addr + lo


def read_span(fd: int, offset: int, length: int, direct: bool, scratch: bool = False) -> memoryview:
    """Bytes ``[offset, offset+length)`` of a file in one aligned read (fewer at end of file).

    With ``scratch`` the bytes land in this thread's reusable buffer: valid until its
    next ``read_span(scratch=True)``.
    """
    if not direct:
        buf = _scratch(length) if scratch else bytearray(length)
        got = os.preadv(fd, [memoryview(buf)[:length]], offset)
        return memoryview(buf)[:got]
    start = F.align_down(offset)
    end = F.align_up(offset + length)
    buf = _scratch(end - start) if scratch else F.aligned_buffer(end - start)
    got = os.preadv(fd, [memoryview(buf)[:end - start]], start)
    return memoryview(buf)[offset - start:max(offset - start, min(got, offset - start + length))]


def read_header(fd: int, direct: bool):
    """(header or None, whether the first bytes carry our magic)."""
    try:
        b = read_span(fd, 0, F.BLOCK, direct)
    except OSError:
        return None, False
    return F.parse_region_header(b), F.is_region_magic(b)


def never_begun(fd: int, direct: bool) -> bool:
    """Whether a region file is what a failed or interrupted creation leaves: empty, or zeros where its
    header belongs (a file the tier made gets its header right after its blocks are reserved)."""
    try:
        if os.fstat(fd).st_size == 0:
            return True
        b = read_span(fd, 0, F.BLOCK, direct)
    except OSError:
        return False
    return not any(b)


def read_summary(fd: int, region_size: int, seq: int, direct: bool, start_hint: int = 0):
    """(entries, keys, key offsets) from a sealed region's summary, or None (unsealed, torn, stale).

    ``start_hint``: where the summary was written (known for a region this process sealed or read),
    so one read of exactly its bytes; else the region's last ``TAIL_READ`` bytes, and a second read
    when the summary is longer."""
    tail = min(TAIL_READ, region_size - F.BLOCK)
    if F.BLOCK <= start_hint < region_size - F.FOOTER:
        tail = region_size - start_hint
    try:
        b = read_span(fd, region_size - tail, tail, direct)
    except OSError:
        return None
    ft = F.parse_footer(b)
    if ft is None or ft.seq != seq or ft.body_len > region_size - F.BLOCK - F.FOOTER:
        return None
    start = F.align_down(region_size - F.FOOTER - ft.body_len)
    if start < region_size - tail:
        try:
            b = read_span(fd, start, region_size - start, direct)
        except OSError:
            return None
        base = start
    else:
        base = region_size - tail
    body = b[start - base:start - base + ft.body_len]
    if len(body) != ft.body_len or F.xxh3([body]) != ft.body_sum:
        return None
    return F.parse_summary_body(body, ft.count)


def scan(data, seq: int):
    """Records of an unsealed region image, in order, up to the first that fails its checks.

    Returns (entries, keys, key offsets, end): a torn tail is where the scan stops.
    """
    rows, keys = [], []
    pos = F.BLOCK
    limit = len(data)
    while pos + F.REC_HDR <= limit:
        h = F.parse_record(data[pos:], seq)
        if h is None:
            break
        rows.append((F.key_digest(h.key), pos, h.rec_len, h.raw_len, len(h.key), h.flags, 0))
        keys.append(h.key)
        pos = F.align_up(pos + h.rec_len, F.ALIGN)
    entries = np.array(rows, dtype=F.ENTRY_DTYPE) if rows else np.zeros(0, dtype=F.ENTRY_DTYPE)
    kb = b"".join(keys)
    offs = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(entries["key_len"], out=offs[1:])
    return entries, kb, offs, pos
