"""The read path of ``SSDTier``: locate under the lock, then read and verify outside it.

A record in the active region is copied from its in-memory image; any other is one
pread (straight into the caller's parts when buffered and uncompressed, else one
block-aligned read into a private buffer).  Every read checks header, seq, full key
and payload sum.  A check that fails is looked at again once under the lock: if the
object moved meanwhile (its region was reclaimed) the new copy is read; otherwise it
is corrupt, counted and dropped.
"""

from __future__ import annotations

import ctypes
import operator
import os
import struct
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Optional, cast

import numpy as np
import torch
import xxhash

from tierkv.buffers import share_work

from ..base import Parts
from . import format as F
from . import region as R
from .deadlog import DeadLog
from .hostbuf import cbuffer, scatter
from .index import DigestIndex

_OK, _BAD, _OTHER, _SIZE = 1, 2, 3, 4  # exact; corrupt or moved; another key's record; size mismatch
_ZERO_CHECK = bytes(8)  # a header's check field, as its check was computed
_ADDR = R.buffer_address
_RUN_GAP = 4096  # records at most this far apart are read together
_RUN_MAX = 1 << 20  # a run's span is at most this long
_RUN_OBJECT = 256 << 10  # records longer than this are read on their own
_MANY = 64  # batches of at least this many keys are looked up in the index with numpy
_PLACE = operator.itemgetter(0, 1)  # (region, offset) of a record to read
_VECTOR_MIN = 4  # a buffered run of at least this many records is checked by ``_check_plan``
#: a record header's fixed fields (``F.RECORD_STRUCT`` up to the payload sum): magic, version, flags,
#: key length, seq, raw and stored length, all known before the read; then the sum and check, then padding
_EXPECT = struct.Struct("<4sBBHQII")
_FIXED = _EXPECT.size
_PSUM_AT = _FIXED
_SUMS = struct.Struct("<QQ")
_PAD_AT = F.RECORD_CHECK_AT + 8
_PAD = bytes(F.REC_HDR - _PAD_AT)


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
    _image_addr: int

    if TYPE_CHECKING:  # defined by ``SSDTier`` and ``Persistence``
        def _count(self, what: str, n: int = 1) -> None: ...
        def _io_error(self, e: OSError, what: str) -> None: ...
        def _unlive(self, idx: int, rec_len: int) -> None: ...

    def _read(self, keys: Sequence[str], dsts: Sequence[Parts]) -> list[bool]:
        n = len(keys)
        out = [False] * n
        kbs = [k.encode() for k in keys]
        key_digest = F.key_digest
        digs = [key_digest(kb) for kb in kbs]
        todo: list = []
        with self._lock:
            if n >= _MANY:
                _, reg, off, rec, raw = self._index.get_many(np.array(digs, dtype=np.uint64))
                # (an absent digest has all four 0: no record has length 0)
                hit = np.flatnonzero(rec)
                found: list = list(zip(hit.tolist(), reg[hit].tolist(), off[hit].tolist(), rec[hit].tolist(),
                                       raw[hit].tolist()))
            else:  # (a few keys: the probes one by one cost less than the numpy calls)
                found = []
                get = self._index.get
                for i, d in enumerate(digs):
                    e = get(d)
                    if e is not None:
                        found.append((i, *e))
            active = self._active
            regions = self._regions
            for i, ri, o, rl, wl in found:
                r = regions[ri]
                if r is active:  # copied and checked under the lock, so the image cannot be reused meanwhile
                    out[i] = self._image_read(keys[i], (kbs[i], digs[i], r, o, rl, wl, r.seq, r.buf), dsts[i])
                else:
                    todo.append((ri, o, i, (kbs[i], digs[i], r, o, rl, wl, r.seq, None)))
        if not todo:
            return out
        runs = self._runs(todo, dsts)
        total = sum(run[2] for run in runs)

        def one(j: int) -> None:
            self._read_run(runs[j], keys, dsts, out)

        if len(runs) <= 1 or total < (1 << 20):
            for j in range(len(runs)):
                one(j)
        else:
            share_work(one, len(runs), self._pool, self._threads - 1)
        return out

    def _runs(self, todo: list, dsts: Sequence[Parts]) -> list:
        """Records to read grouped into runs of neighbours in one file: (region, [(i, loc)], span bytes).

        Small records a short gap apart are read with one pread; a large record (buffered reads go
        straight into the caller's parts) is a run of its own."""
        todo.sort(key=_PLACE)
        runs: list = []
        cur: list = []
        start = end = -1
        cur_r = -1
        for ri, o, i, loc in todo:
            rl = loc[4]
            parts = dsts[i]
            if loc[5] != (parts[0].numel() if len(parts) == 1 else sum(p.numel() for p in parts)):
                continue  # not the size the caller expects: a miss without a read
            if rl > _RUN_OBJECT and not self.direct_io:  # (straight into the caller's parts)
                runs.append((ri, [(i, loc)], rl))
                continue
            if cur and ri == cur_r and o - end <= _RUN_GAP and o + rl - start <= _RUN_MAX + _RUN_GAP:
                cur.append((i, loc))
                end = max(end, o + rl)
                continue
            if cur:
                runs.append((cur_r, cur, end - start))
            cur, cur_r, start, end = [(i, loc)], ri, o, o + rl
        if cur:
            runs.append((cur_r, cur, end - start))
        return runs

    def _read_run(self, run, keys: Sequence[str], dsts: Sequence[Parts], out: list[bool]) -> None:
        """One read of a run's span into this thread's scratch buffer, then each record checked there."""
        _, items, span = run
        if not self.direct_io:
            if len(items) == 1:
                i, loc = items[0]
                out[i] = self._read_one(keys[i], loc, dsts[i])
            else:
                self._read_run_into(items, keys, dsts, out)
            return
        first = items[0][1]
        start = first[3]
        try:
            view, addr = R.read_span_scratch(first[2].fd, start, span, self.direct_io)
        except OSError:
            view = None
        again = []
        for i, loc in items:
            if view is not None:
                o = loc[3] - start
                if self._settled(self._from_view(view[o:o + loc[4]], loc[0], loc[6], dsts[i], addr + o), i, out):
                    continue
            again.append((i, loc))
        for i, loc in again:  # a second look decides: moved, corrupt or an I/O error (the scratch is reused)
            out[i] = self._read_one(keys[i], loc, dsts[i])

    def _read_run_into(self, items: list, keys: Sequence[str], dsts: Sequence[Parts], out: list[bool]) -> None:
        """A buffered run in one preadv: headers, keys and gaps into this thread's scratch, each payload
        straight into the caller's parts; then each record checked (a second look for any that fails)."""
        scratch, _ = R.scratch(_RUN_MAX)
        smv = memoryview(scratch)
        iov: list = []
        plan: list = []  # (i, loc, scratch offset of its header, payload views or None)
        sp = 0
        pos = items[0][1][3]
        fd = items[0][1][2].fd
        for i, loc in items:
            kb, off, rec_len, raw_len = loc[0], loc[3], loc[4], loc[5]
            if off > pos:
                iov.append(smv[sp:sp + off - pos])
                sp += off - pos
            head = F.REC_HDR + len(kb)
            views: Optional[list] = []
            if rec_len == head + raw_len and raw_len:
                for p in dsts[i]:
                    b = cbuffer(p)
                    if b is None:
                        views = None
                        break
                    if len(b):
                        cast(list, views).append(b)
            else:
                views = None
            n = head if views is not None else rec_len
            iov.append(smv[sp:sp + n])
            plan.append((i, loc, sp, views))
            sp += n
            if views is not None:
                iov += views
            pos = off + rec_len
        try:
            got = os.preadv(fd, iov, items[0][1][3])
        except OSError:
            got = -1
        again = []
        want = pos - items[0][1][3]
        if got == want and len(plan) >= _VECTOR_MIN and all(p[3] is not None for p in plan):
            plan = self._check_plan(scratch, smv, plan, out)  # (what it cannot settle: looked at one by one)
        for i, loc, at, views in plan:
            if got == want:
                if views is None:
                    res = self._from_view(smv[at:at + loc[4]], loc[0], loc[6], dsts[i], _ADDR(scratch) + at)
                else:
                    res = self._head_then(smv[at:at + F.REC_HDR + len(loc[0])], loc, views)
                if self._settled(res, i, out):
                    continue
            again.append((i, loc))
        for i, loc in again:  # a second look decides: moved, corrupt or an I/O error
            out[i] = self._read_one(keys[i], loc, dsts[i])

    def _check_plan(self, scratch, smv: memoryview, plan: list, out: list[bool]) -> list:
        """Check a run's records read into the caller's parts (headers and keys in ``scratch``), a few C
        calls a record: the header's fixed fields and padding against the bytes the index, the region's
        seq and the key say they must be, the full key, the header check (one xxh3 call, over the header
        with its check field zeroed in the scratch, and the key) and the payload sum (one call; records of
        another sum or with other flags are left to ``_head_then``).  Sets ``out`` for the records that
        pass; returns the plan entries of those that do not (their check field as read)."""
        expect = _EXPECT.pack
        sums = _SUMS.unpack_from
        dig = xxhash.xxh3_64_intdigest
        magic, version, head = F.RECORD_MAGIC, F.VERSION, F.REC_HDR
        rest = []
        for p in plan:
            _, loc, a, views = p
            kb = loc[0]
            psum, check = sums(scratch, a + _PSUM_AT)
            end = a + head + len(kb)
            if (smv[a:a + _FIXED] == expect(magic, version, 0, len(kb), loc[6], loc[5], loc[5])
                    and smv[a + _PAD_AT:a + head] == _PAD and smv[a + head:end] == kb):
                scratch[a + F.RECORD_CHECK_AT:a + F.RECORD_CHECK_AT + 8] = _ZERO_CHECK
                if dig(smv[a:end]) == check and (dig(views[0]) if len(views) == 1 else F.xxh3(views)) == psum:
                    out[p[0]] = True
                    continue
                F.CHECK_STRUCT.pack_into(scratch, a + F.RECORD_CHECK_AT, check)
            rest.append(p)
        return rest

    def _settled(self, res: int, i: int, out: list[bool]) -> bool:
        """Whether a record's check decides read ``i``: served (``out[i]`` set), another key's record
        (a collision, counted) or a size that differs; otherwise it needs a second look on its own."""
        if res == _OK:
            out[i] = True
            return True
        if res == _OTHER:
            self._count("collisions")
            return True
        return res == _SIZE

    def _head_then(self, head, loc, views: list) -> int:
        """Check a header read into ``head`` and the payload read into ``views`` (the caller's parts)."""
        magic, version, flags, klen, rseq, raw_len, stored, psum, check = F.RECORD_STRUCT.unpack_from(head, 0)
        if magic != F.RECORD_MAGIC or version != F.VERSION or klen != len(loc[0]):
            return _BAD
        h = xxhash.xxh3_64(head[:F.RECORD_CHECK_AT])
        h.update(_ZERO_CHECK)
        h.update(head[F.RECORD_CHECK_AT + 8:])
        if h.intdigest() != check or rseq != loc[6] or flags & (F.FLAG_TOMB | F.FLAG_LZ4):
            return _BAD
        if head[F.REC_HDR:] != loc[0]:
            return _BAD  # (a key of this length but another: a private read tells corrupt from collision)
        if stored != raw_len or raw_len != loc[5]:
            return _BAD
        sum_of = F.sum_function(flags)
        if sum_of is None:
            return _SIZE
        s = sum_of(views[0]) if len(views) == 1 else F.payload_sum(views, flags)
        return _OK if s == psum else _BAD

    def _image_read(self, key: str, loc, parts: Parts) -> bool:
        """A read from the active image.  Caller holds ``_lock``."""
        if loc[5] != sum(p.numel() for p in parts):
            return False
        kb, d, r, off, rec_len = loc[:5]
        res = self._from_view(memoryview(loc[7])[off:off + rec_len], kb, loc[6], parts, self._image_addr + off)
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

    def _from_view(self, view, kb: bytes, seq: int, parts: Parts, addr: int = 0) -> int:
        """Check the record at the start of ``view`` (header, seq, key, payload sum) and copy its payload
        into ``parts``; ``addr``: the address of ``view``'s first byte, when known (one memmove a part)."""
        if len(view) < F.REC_HDR:
            return _BAD
        magic, version, flags, klen, rseq, raw_len, stored, psum, check = F.RECORD_STRUCT.unpack_from(view, 0)
        body_at = F.REC_HDR + klen
        rec_len = body_at + stored
        if magic != F.RECORD_MAGIC or version != F.VERSION or len(view) < rec_len:
            return _BAD
        h = xxhash.xxh3_64(view[:F.RECORD_CHECK_AT])
        h.update(_ZERO_CHECK)
        h.update(view[F.RECORD_CHECK_AT + 8:body_at])
        if h.intdigest() != check or rseq != seq or flags & F.FLAG_TOMB:
            return _BAD
        if view[F.REC_HDR:body_at] != kb:
            return _OTHER
        body = view[body_at:rec_len]
        sum_of = F.sum_function(flags)
        if sum_of is None:
            return _SIZE  # summed with an algorithm this build lacks: a miss, the object stays
        if sum_of(body) != psum:
            return _BAD
        if flags & F.FLAG_LZ4:
            import lz4.block

            try:
                raw = lz4.block.decompress(body, uncompressed_size=raw_len, return_bytearray=True)
            except Exception:  # lz4 raises its own error types on malformed input  # noqa: BLE001 - a plug-in or medium fault is contained here by design
                return _BAD
            if len(raw) != raw_len:
                return _BAD
            body, addr = memoryview(raw), 0
        want = 0
        host = addr != 0
        for p in parts:
            want += p.numel()
            if host and not (p.is_cpu and p.is_contiguous()):
                host = False
        if len(body) != want:
            return _SIZE
        if host:
            src = addr + body_at
            for p in parts:
                n = p.numel()
                if n:
                    ctypes.memmove(p.data_ptr(), src, n)
                    src += n
        else:
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
