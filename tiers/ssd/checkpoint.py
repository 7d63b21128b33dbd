"""The index checkpoint: every live object's location and key, so a reopen reads one file.

Layout of ``checkpoint`` (written to ``checkpoint.tmp``, synced, then renamed over)::

    header (64 bytes): magic "TKVC", version u16, pad u16, count u32, regions u32,
                       covered_seq u64, region_size u64, body length u64, body sum u64
                       (xxh3-64), header check u64 (of the 48 bytes before it)
    body: region seqs u64[regions] (0: never used), then per object digest u64,
          region u32, offset u32, rec_len u32, raw_len u32, key_len u16 (each a column),
          then the keys back to back; then, when the index held exactly these objects, its
          slots: slots u64, count u64, used u64, digest u64[slots], region, offset, rec_len,
          raw_len u32[slots] (what a reopen that finds every object current loads as is)

``covered_seq``: every record in a region whose seq is below it (and matches the seq
the checkpoint lists for that region) is reflected in the checkpoint; regions of
that seq or later are read again on open.  A checkpoint that fails a check is
ignored (the regions' summaries are read instead), never trusted in part.
"""

from __future__ import annotations

import mmap
import os
import struct
from typing import NamedTuple, Optional

import numpy as np

from .format import VERSION, xxh3

NAME = "checkpoint"
MAGIC = b"TKVC"
_HDR = struct.Struct("<4sHHIIQQQQ")  # 48 bytes, then check u64
HDR = 64
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_TABLE = struct.Struct("<QQQ")  # slots, count, used; then digest u64, region, offset, rec_len, raw_len u32 a slot
_TABLE_TYPES = (np.uint64, np.uint32, np.uint32, np.uint32, np.uint32)
_COLS = (("digest", np.uint64), ("region", np.uint32), ("offset", np.uint32), ("rec_len", np.uint32),
         ("raw_len", np.uint32), ("key_len", np.uint16))


class Checkpoint(NamedTuple):
    covered_seq: int
    region_size: int
    region_seqs: np.ndarray
    cols: dict  # column name -> array (views of the file's bytes)
    keys: "bytes | memoryview"  # (a view of the file's bytes)
    key_offs: np.ndarray
    table: Optional[tuple] = None  # the index's slots when written with them: (count, used, 5 arrays)


def encode(covered_seq: int, region_size: int, region_seqs, cols: dict, keys: "bytes | memoryview",
           table: Optional[tuple] = None) -> list:
    """The checkpoint file's bytes, as a list of buffers.  ``table``: (count, used, digest, region,
    offset, rec_len, raw_len) of the index holding exactly these objects, stored after the keys so a
    reopen can take the index as it was instead of building it."""
    n = len(cols["digest"])
    body: list = [np.ascontiguousarray(region_seqs, dtype=np.uint64).tobytes()]
    body += [np.ascontiguousarray(cols[c], dtype=t).tobytes() for c, t in _COLS]
    body.append(keys)
    if table is not None:
        count, used, *arrays = table
        body.append(_TABLE.pack(len(arrays[0]), count, used))
        body += [memoryview(np.ascontiguousarray(a, dtype=t)).cast("B")  # type: ignore[arg-type]  # ndarray exports a buffer
                 for a, t in zip(arrays, _TABLE_TYPES)]
    blen = sum(len(b) for b in body)
    head = bytearray(HDR)
    _HDR.pack_into(head, 0, MAGIC, VERSION, 0, n, len(region_seqs), covered_seq, region_size, blen, xxh3(body))
    struct.pack_into("<Q", head, _HDR.size, xxh3([bytes(head[:_HDR.size])]))
    return [bytes(head), *body]


def write(dirpath: str, bufs: list, fsync: bool) -> None:
    """Atomically replace the checkpoint (temp file, fsync, rename, fsync of the directory)."""
    tmp = os.path.join(dirpath, NAME + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        for b in bufs:
            view = memoryview(b)
            while view:
                n = os.write(fd, view)
                view = view[n:]
        if fsync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    os.close(fd)
    os.rename(tmp, os.path.join(dirpath, NAME))
    if fsync:
        dfd = os.open(dirpath, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def sync(dirpath: str) -> None:
    """Make a checkpoint written without ``fsync`` durable: the file, then the directory (its rename)."""
    fd = os.open(os.path.join(dirpath, NAME), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    dfd = os.open(dirpath, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def read(dirpath: str) -> Optional[Checkpoint]:
    """The checkpoint, or None when absent or failing any check."""
    try:
        with open(os.path.join(dirpath, NAME), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < HDR:
                return None
            # mapped, not read: its columns and keys are used where the page cache holds them (no copy of
            # a file of ~90 bytes an object); the file is only ever replaced (rename), never changed
            data: "bytes | mmap.mmap" = mmap.mmap(f.fileno(), size, flags=mmap.MAP_SHARED | _POPULATE,
                                                  prot=mmap.PROT_READ)
    except (OSError, ValueError):
        return None
    return decode(data)


def decode(data) -> Optional[Checkpoint]:
    if len(data) < HDR:
        return None
    magic, version, _, n, nreg, covered, region_size, blen, bsum = _HDR.unpack_from(data, 0)
    if magic != MAGIC or version != VERSION:
        return None
    if struct.unpack_from("<Q", data, _HDR.size)[0] != xxh3([data[:_HDR.size]]):
        return None
    body = memoryview(data)[HDR:]
    if len(body) != blen or xxh3([body]) != bsum:
        return None
    pos = 0
    seqs = np.frombuffer(body, dtype=np.uint64, count=nreg, offset=pos)
    pos += 8 * nreg
    cols = {}
    for c, t in _COLS:
        cols[c] = np.frombuffer(body, dtype=t, count=n, offset=pos)
        pos += np.dtype(t).itemsize * n
    offs = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(cols["key_len"], out=offs[1:])
    kend = pos + int(offs[-1])
    if kend > len(body):
        return None
    keys = body[pos:kend]  # (no copy: the columns keep the file's bytes anyway)
    table = None
    if kend < len(body):  # the index's slots follow
        if len(body) - kend < _TABLE.size:
            return None
        slots, count, used = _TABLE.unpack_from(body, kend)
        at = kend + _TABLE.size
        if slots < 16 or slots & (slots - 1) or len(body) - at != slots * 24 or not count <= used < slots:
            return None
        arrays = []
        for t in _TABLE_TYPES:
            arrays.append(np.frombuffer(body, dtype=t, count=slots, offset=at))
            at += np.dtype(t).itemsize * slots
        table = (count, used, *arrays)
    return Checkpoint(covered, region_size, seqs, cols, keys, offs, table)
