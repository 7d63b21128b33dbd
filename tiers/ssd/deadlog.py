"""The dead log: which records on disk are no longer objects (removed, replaced, moved, dropped).

A region's summary lists every record it holds, live or not; this file says which of
them died after they were written.  Each entry is 16 bytes: a key naming the record
(region index, offset, the region's seq) and a check of the key, appended on ``write``.
Reopening reads it whole (one file) and drops the records it names, from the
checkpoint and from the summaries alike, so a removed key never comes back and of
several versions of a key only the newest can.  An entry whose region has since been
reused (another seq) names nothing any more; compaction rewrites the file without them.
A torn or flipped entry fails its check and is ignored.

A *mark* entry (region field ``MARK_REGION``, no real region's index) carries a seq in full:
each region begun appends one, so the highest seq ever handed out is known at the next open
even when the region file that bore it is lost or its header damaged.  A new region's seq is
always above it, so no seq is handed out twice and an entry can only ever name the record it
was written for.  (A directory written before marks existed has none: its regions'
headers and checkpoint say what was used.)
"""

from __future__ import annotations

import os

import numpy as np

NAME = "dead"
_DTYPE = np.dtype([("key", "<u8"), ("check", "<u8")])
_SEQ_BITS = 19
_OFF_BITS = 25  # offset / 64 for regions up to 2 GiB
#: bytes of blocks kept reserved after the file's end (65536 entries), so that removals can still be
#: recorded once the file system is full (``write``)
RESERVE = 1 << 20
_REGION_SHIFT = _OFF_BITS + _SEQ_BITS
#: the region field of a mark entry (region indices stop at 999999, six digits in a file name)
MARK_REGION = (1 << (64 - _REGION_SHIFT)) - 1
_MARK_SEQ = (1 << _REGION_SHIFT) - 1


def dead_keys(region, offset, seq) -> np.ndarray:
    """The key of each record (vectorised)."""
    region = np.asarray(region, dtype=np.uint64)
    offset = np.asarray(offset, dtype=np.uint64)
    seq = np.asarray(seq, dtype=np.uint64)
    return ((region << np.uint64(_OFF_BITS + _SEQ_BITS)) | ((offset >> np.uint64(6)) << np.uint64(_SEQ_BITS))
            | (seq & np.uint64((1 << _SEQ_BITS) - 1)))


def key_region_seq(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return keys >> np.uint64(_REGION_SHIFT), keys & np.uint64((1 << _SEQ_BITS) - 1)


def names_from(keys: np.ndarray, region: int, seq: int, offset: int) -> bool:
    """Whether any of ``keys`` names a record of ``region`` under ``seq`` at ``offset`` or after."""
    reg, sq = key_region_seq(keys)
    mine = keys[(reg == np.uint64(region)) & (sq == np.uint64(seq & ((1 << _SEQ_BITS) - 1)))]
    offs = ((mine >> np.uint64(_SEQ_BITS)) & np.uint64((1 << _OFF_BITS) - 1)) << np.uint64(6)
    return bool((offs >= np.uint64(offset)).any())


def mark_key(seq: int) -> int:
    """The key of a mark entry for ``seq``."""
    return (MARK_REGION << _REGION_SHIFT) | (seq & _MARK_SEQ)


def high_water(keys: np.ndarray) -> int:
    """The highest seq a mark among ``keys`` names (0: none)."""
    m = keys[(keys >> np.uint64(_REGION_SHIFT)) == np.uint64(MARK_REGION)]
    return int((m & np.uint64(_MARK_SEQ)).max()) if len(m) else 0


def _check(keys: np.ndarray) -> np.ndarray:
    """A 64-bit mix of each key (splitmix64): any flipped bit fails it."""
    with np.errstate(over="ignore"):
        z = keys + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def read(dirpath: str) -> np.ndarray:
    """Keys of the valid entries (absent file: none)."""
    try:
        with open(os.path.join(dirpath, NAME), "rb") as f:
            data = f.read()
    except OSError:
        return np.zeros(0, dtype=np.uint64)
    e = np.frombuffer(data, dtype=_DTYPE, count=len(data) // _DTYPE.itemsize)
    return e["key"][_check(e["key"]) == e["check"]].copy()


def encode(keys: np.ndarray) -> bytes:
    e = np.zeros(len(keys), dtype=_DTYPE)
    e["key"] = keys
    e["check"] = _check(e["key"])
    return e.tobytes()


class DeadLog:
    """Entries added in memory, appended to the file by ``write`` (which may raise OSError)."""

    def __init__(self, dirpath: str) -> None:
        self.dirpath = dirpath
        self.pending: list[tuple[int, int, int]] = []
        self.compacted = 0  # entries in the file after the last compaction
        self.reserved = 0  # bytes reserved after the file's end (``RESERVE``), as far as this process knows

    @property
    def path(self) -> str:
        return os.path.join(self.dirpath, NAME)

    def add(self, region: int, offset: int, seq: int) -> None:
        self.pending.append((region, offset, seq))

    def reserve(self) -> None:
        """Reserve ``RESERVE`` bytes after the file's end now (creating it empty), if the file system has them."""
        from .region import reserve_beyond_end

        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_CLOEXEC", 0), 0o600)
        except OSError:
            return
        try:
            if reserve_beyond_end(fd, RESERVE):
                self.reserved = RESERVE
        finally:
            os.close(fd)
    def mark(self, seq: int) -> None:
        """Record that ``seq`` was handed out.  Written ahead of every entry added after it (one append)."""
        self.pending.append((MARK_REGION, 0, seq))

    def write(self, fsync: bool, start: int = 0) -> None:
        """Append the entries added so far (``start``: only those from this position in ``pending``, the
        others stay pending) to the file; they leave ``pending`` once written."""
        if len(self.pending) <= start:
            return
        a = np.array(self.pending[start:], dtype=np.uint64)
        keys = dead_keys(a[:, 0], a[:, 1], a[:, 2])
        is_mark = a[:, 0] == np.uint64(MARK_REGION)
        if is_mark.any():
            keys[is_mark] = [mark_key(int(x)) for x in a[is_mark, 2].tolist()]
        data = encode(keys)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_CLOEXEC", 0), 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if self.reserved <= RESERVE // 2:  # (blocks for the next appends, taken while there is room)
                from .region import reserve_beyond_end

                if reserve_beyond_end(fd, RESERVE):
                    self.reserved = RESERVE
            else:
                self.reserved -= len(data)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        del self.pending[start:]

    def size(self) -> int:
        try:
            return os.path.getsize(self.path) // _DTYPE.itemsize
        except OSError:
            return 0

    def compact(self, current_seq: dict, fsync: bool, high: int = 0) -> None:
        """Rewrite without the entries of reused regions (``current_seq``: region index -> seq), and with
        one mark: the highest seq handed out (``high`` or a mark's, whichever is higher)."""
        keys = read(self.dirpath)
        high = max(high, high_water(keys))
        keys = keys[(keys >> np.uint64(_REGION_SHIFT)) != np.uint64(MARK_REGION)]
        reg, sq = key_region_seq(keys)
        table = np.full(max(current_seq, default=0) + 2, -1, dtype=np.int64)
        for i, s in current_seq.items():
            table[i] = s & ((1 << _SEQ_BITS) - 1)
        reg = np.minimum(reg.astype(np.int64), len(table) - 1)
        keep = keys[table[reg] == sq.astype(np.int64)]
        if high:
            keep = np.concatenate([np.array([mark_key(high)], dtype=np.uint64), keep])
        tmp = self.path + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o600)
        try:
            view = memoryview(encode(keep))
            while view:
                view = view[os.write(fd, view):]
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, self.path)
        self.compacted = len(keep)
        self.reserved = 0
