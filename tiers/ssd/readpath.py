"""The read path of ``SSDTier``: locate under the lock, then read and verify outside it.

A record in the active region is copied from its in-memory image; any other is one
pread (straight into the caller's parts when buffered and uncompressed, else one
block-aligned read into a private buffer).  Every read checks header, seq, full key
and payload sum.  A check that fails is looked at again once under the lock: if the
object moved meanwhile (its region was reclaimed) the new copy is read; otherwise it
is corrupt, counted and dropped.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Optional

import torch

from tierkv.buffers import share_work

from ..base import Parts
from . import format as F
from . import region as R
from .deadlog import DeadLog
from .hostbuf import cbuffer, scatter
from .index import DigestIndex

_OK, _BAD, _OTHER, _SIZE = 1, 2, 3, 4  # exact; corrupt or moved; another key's record; size mismatch


class ReadPath:
    # state of ``SSDTier`` (set in its ``__init__`` and ``Tier.__init__``)
    direct_io: bool
    _lock: threading.Lock
    _counters: dict[str, int]
    _regions: dict[int, R.Region]
    _active: Optional[R.Region]
    _index: DigestIndex
    _dead: DeadLog
    _changed: bool
    _threads: int
    _pool: ThreadPoolExecutor

    if TYPE_CHECKING:  # defined by ``SSDTier`` and ``Persistence``
        def _count(self, what: str, n: int = 1) -> None: ...
        def _io_error(self, e: OSError, what: str) -> None: ...
        def _unlive(self, idx: int, rec_len: int) -> None: ...

    def _read(self, keys: Sequence[str], dsts: Sequence[Parts]) -> list[bool]:
        n = len(keys)
        out = [False] * n
        todo: list = []
        with self._lock:
            for i, k in enumerate(keys):
                loc = self._locate(k.encode())
                if loc is None:
                    continue
                if loc[7] is None:
                    todo.append((i, loc))
                else:  # in the active image: copied and checked under the lock, so it cannot be reused meanwhile
                    out[i] = self._image_read(keys[i], loc, dsts[i])
        total = sum(p.numel() for i, _ in todo for p in dsts[i])

        def one(j: int) -> None:
            i, loc = todo[j]
            out[i] = self._read_one(keys[i], loc, dsts[i])

        if len(todo) <= 1 or total < (1 << 20):
            for j in range(len(todo)):
                one(j)
        else:
            share_work(one, len(todo), self._pool, self._threads - 1)
        return out

    def _image_read(self, key: str, loc, parts: Parts) -> bool:
        """A read from the active image.  Caller holds ``_lock``."""
        if loc[5] != sum(p.numel() for p in parts):
            return False
        kb, d, r, off, rec_len = loc[:5]
        res = self._from_view(memoryview(loc[7])[off:off + rec_len], kb, loc[6], parts)
        if res == _OTHER:
            self._counters["collisions"] += 1
        elif res == _BAD:  # an image is never torn: memory went bad, or a bug; never serve it
            self._index.remove(d)
            self._unlive(r.index, rec_len)
            self._dead.add(r.index, off, loc[6])
            self._counters["corrupt"] += 1
        return res == _OK

    def _locate(self, kb: bytes):
        """(key bytes, digest, region, offset, rec_len, raw_len, seq, image or None).  Caller holds ``_lock``."""
        d = F.key_digest(kb)
        e = self._index.get(d)
        if e is None:
            return None
        r = self._regions[e[0]]
        return kb, d, r, e[1], e[2], e[3], r.seq, (r.buf if r is self._active else None)

    def _read_one(self, key: str, loc, parts: Parts) -> bool:
        if loc is None:
            return False
        want = sum(p.numel() for p in parts)
        for attempt in (0, 1):
            if loc[5] != want:
                return False
            try:
                res = self._fetch(loc, parts)
            except OSError as e:
                self._io_error(e, f"reading {key[:16]}")
                return False
            if res == _OK:
                return True
            if res == _OTHER:
                self._count("collisions")
                return False
            if res == _SIZE:
                return False
            with self._lock:
                now = self._locate(loc[0])
                if now is not None and now[7] is not None:  # moved into the active region
                    return self._image_read(key, now, parts)
                if now is not None and now[2:4] == loc[2:4] and now[6] == loc[6]:
                    # still where it was: the bytes there are bad
                    self._index.remove(loc[1])
                    self._unlive(loc[2].index, loc[4])
                    self._dead.add(loc[2].index, loc[3], loc[6])
                    self._changed = True
                    now = None
                    self._counters["corrupt"] += 1
            if now is None or attempt:
                return False
            loc = now
        return False

    def _fetch(self, loc, parts: Parts) -> int:
        kb, _, r, off, rec_len, raw_len, seq, image = loc
        if image is not None:  # moved into the active region since: read the file copy it came from
            return _BAD
        fd = r.fd
        if not self.direct_io and rec_len == F.record_len(len(kb), raw_len) and raw_len:
            return self._direct_into(fd, off, rec_len, kb, seq, raw_len, parts)
        return self._from_view(R.read_span(fd, off, rec_len, self.direct_io, scratch=True), kb, seq, parts)

    def _from_view(self, view, kb: bytes, seq: int, parts: Parts) -> int:
        klen = F.record_key_len(view)
        h = F.parse_record_header(view[:F.REC_HDR], bytes(view[F.REC_HDR:F.REC_HDR + klen])) \
            if len(view) >= F.REC_HDR + klen else None
        if h is None or h.seq != seq or h.flags & F.FLAG_TOMB or len(view) < h.rec_len:
            return _BAD
        if h.key != kb:
            return _OTHER
        body = view[F.REC_HDR + klen:h.rec_len]
        s = F.payload_sum([body], h.flags)
        if s is None:
            return _SIZE  # summed with an algorithm this build lacks: a miss, the object stays
        if s != h.psum:
            return _BAD
        if h.flags & F.FLAG_LZ4:
            import lz4.block

            try:
                raw = lz4.block.decompress(body, uncompressed_size=h.raw_len, return_bytearray=True)
            except Exception:  # lz4 raises its own error types on malformed input  # noqa: BLE001 - a plug-in or medium fault is contained here by design
                return _BAD
            if len(raw) != h.raw_len:
                return _BAD
            body = memoryview(raw)
        if len(body) != sum(p.numel() for p in parts):
            return _SIZE
        scatter(body, parts)
        return _OK

    def _direct_into(self, fd: int, off: int, rec_len: int, kb: bytes, seq: int, raw_len: int, parts: Parts) -> int:
        """One preadv: header and key into a small buffer, the payload into the caller's parts."""
        head = bytearray(F.REC_HDR + len(kb))
        host, views = [], []
        for p in parts:
            b = cbuffer(p)
            if b is None:  # a device or strided part: through a host copy
                tmp = torch.empty(p.numel(), dtype=torch.uint8)
                host.append((p, tmp))
                b = cbuffer(tmp)
            if len(b):
                views.append(b)
        got = os.preadv(fd, [head, *views], off)
        h = F.parse_record_header(head[:F.REC_HDR], bytes(head[F.REC_HDR:]))
        if h is None or h.seq != seq or h.flags & (F.FLAG_TOMB | F.FLAG_LZ4) or h.key != kb:
            # not what the index said: a private read of the record tells corrupt from another key's
            return self._from_view(R.read_span(fd, off, rec_len, False, scratch=True), kb, seq, parts)
        if got != len(head) + raw_len or h.stored_len != raw_len:
            return _BAD
        s = F.payload_sum(views, h.flags)
        if s is None:
            return _SIZE
        if s != h.psum:
            # the caller's parts may overlap one another: a private copy decides
            data = bytearray(raw_len)
            if os.preadv(fd, [data], off + len(head)) != raw_len or F.payload_sum([data], h.flags) != h.psum:
                return _BAD
            self._count("rereads")
            scatter(memoryview(data), parts)
            return _OK
        for p, hp in host:
            p.copy_(hp)
        return _OK
