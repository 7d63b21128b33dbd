"""``SegmentWriter``: the SSD engine's write path — batches appended to the active region's image.

A ``write`` call is one batch: its host objects are copied into the active image one after
another (header packed in one call, its check one xxh3 call over header and key; buffered,
large payloads are written from the caller's parts instead, see ``Segment``) while
writer threads write out what is already copied; at the end of the batch (or of a region)
the rest is written and only then do the batch's digests enter the index, together.  So
every object ``write`` acknowledged is in the region file when it returns, and a write-out
that fails indexes none of the batch's objects (the next records overwrite their bytes).
Compressed or device objects take ``_put_one``, one at a time; objects too large for one record
are stored as pieces and a manifest (``_put_large``, ``large.py``).

Calls: ``RegionChanger.room`` when the active region is full (it seals it and begins the next),
``RegionIO`` for write-outs and the writer threads, ``Checkpointer`` for ``fsync: "always"`` and
to find files removed behind the tier after each batch; the owners of the engine's state
(``state.py``) for the rest: objects enter the ``Catalogue``'s index and the ``RegionTable``'s live
counts (``enliven_run``) together, under ``EngineLocks.lock``.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import time
from collections.abc import Sequence
from typing import Any, Optional, cast

import torch
import xxhash

from tierkv.hostmem import contiguous

from ..base import Parts
from . import format as F
from . import large as L
from . import region as R
from .catalogue import Catalogue
from .checkpointer import Checkpointer
from .counters import SSDCounters
from .engineconfig import EngineConfig
from .format import WRITE_UNIT
from .health import Health
from .hostbuf import _host_view, cbuffer, ctype_of
from .regionchange import RegionChanger
from .regionio import RegionIO
from .regiontable import RegionTable
from .segment import Segment
from .state import EngineLocks

log = logging.getLogger(__name__)

#: a batch's finished bytes go to the writer thread in pieces of at least this much (buffered writes)
PIPE_UNIT = 512 << 10
#: the same with O_DIRECT: the first piece of a batch leaves as soon as this much is copied
PIPE_MIN_DIRECT = 256 << 10
#: buffered, payloads at least this long are written from the caller's parts, not copied into the image
_GATHER_MIN = 4096
_ZEROS = memoryview(bytes(F.ALIGN))
#: a payload copied into the image from this size on is summed first and copied in steps of ``_STREAM_STEP``
_STREAM_MIN = 1 << 20
_STREAM_STEP = 512 << 10
# (record layout and C helpers the append loop uses per object)
_HDR = F.RECORD_STRUCT.pack_into
_CHK = F.CHECK_STRUCT.pack_into
_DIGEST = xxhash.xxh3_64_intdigest
_ENTRY_OF = F.ENTRY_STRUCT.pack
_memmove = ctypes.memmove
_MAGIC, _VERSION = F.RECORD_MAGIC, F.VERSION
_HEAD, _CHECK_AT, _ALIGN, _BLOCK = F.REC_HDR, F.RECORD_CHECK_AT, F.ALIGN, F.BLOCK
_ENTRY, _MAX_KEY, _FOOTER = F.ENTRY, F.MAX_KEY, F.FOOTER


class _Appending:
    """What ``SegmentWriter.append`` keeps while it appends one batch: the batch's constants, its segment,
    its results, and where it writes (``aim``: the active region, its image, a view and the address of it)."""

    __slots__ = ("base", "buf", "flags", "gather", "mv", "out", "pipe_min", "psum_of", "r", "seg", "seq")
    # (None only before the batch's first record is placed: ``_place`` aims the batch before any copy)
    r: Any
    buf: Any
    mv: Any

    def __init__(self, cfg: EngineConfig, table: RegionTable, out: list[bool]) -> None:
        self.flags = F.FLAG_CRC32C if cfg.checksum == "crc32c" else 0
        self.psum_of: Any = F.sum_function(self.flags)
        self.pipe_min = PIPE_MIN_DIRECT if cfg.direct_io else PIPE_UNIT
        self.gather = not cfg.direct_io  # (see ``Segment``)
        self.seg = Segment()
        self.out = out
        self.aim(table.active, table.image_addr)

    def aim(self, r: Optional[R.Region], addr: int) -> None:
        """Write into region ``r`` (the active one, or None), whose image lies at ``addr``."""
        self.r = r
        if r is None:
            self.buf = self.mv = None
            self.base = self.seq = 0
        else:
            self.buf, self.mv, self.base, self.seq = r.buf, memoryview(cast(mmap.mmap, r.buf)), addr, r.seq


class SegmentWriter:
    """Appends batches to the active region (see the module docstring)."""

    def __init__(self, cfg: EngineConfig, table: RegionTable, cat: Catalogue, locks: EngineLocks, counters: SSDCounters,
                 health: Health, io: RegionIO, changer: RegionChanger, checkpointer: Checkpointer) -> None:
        # (the owners, as ``state.py`` lists them: alike in each component's constructor, as each uses all five)
        self._cfg, self._table, self._cat, self._locks, self._counters = cfg, table, cat, locks, counters
        self._health = health
        self._io = io
        self._changer = changer
        self._checkpointer = checkpointer
        self._too_large_quiet = 0.0  # no ``too_large`` warning is logged before this (monotonic) time

    # -- writes ---------------------------------------------------------------------------
    def write(self, keys: Sequence[str], srcs: Sequence[Parts]) -> list[bool]:
        if keys and min(keys) < "\x01":  # (one C pass: no key of the store starts so)
            return self._write_reserved(keys, srcs)
        with self._locks.wlock:
            if self._checkpointer.lock_lost():  # (the directory is another process's now: see ``lock.py``)
                with self._locks.lock:
                    self._counters.lock_lost += len(keys)
                return [False] * len(keys)
            lf = self._health.lock_file
            if lf is not None and lf.fault is not None:  # (the directory cannot be seen: refused until it can)
                with self._locks.lock:
                    self._counters.not_writable += len(keys)
                return [False] * len(keys)
            prior = self._large_before(keys) if self._cat.has_large else None
            out, one_by_one, large = self.append(keys, srcs)
            for i in large:
                out[i] = self._put_large(keys[i], srcs[i])
                one_by_one = True
            if prior:
                self._replaced_large(prior, keys, srcs, out)
            r = self._table.active
            if r is not None:
                if self._cfg.fsync == "always":
                    self._checkpointer.flush_locked(checkpoint=False)
                elif one_by_one and r.pos > r.written:  # (the others reached the file when committed)
                    self._io.write_out(r, F.align_up(r.pos), r.pos)
            # what was acknowledged is in a file under the directory: one removed behind the tier is made
            # again before the answer (``Checkpointer.check_removed``); an object that went with a file that
            # could not be is answered False (and counted there: ``objects_lost``)
            if self._checkpointer.check_removed():
                with self._locks.lock:
                    for i, k in enumerate(keys):
                        if out[i] and self._cat.index.find(F.key_digest(k.encode())) < 0:
                            out[i] = False
            if self._health.fault is not None and True in out:  # (a write that went through: the fault passed;
                self._health.passed()  # the store sends none while the tier says it is not writable)
        return out

    def _key_fits(self, kb: bytes) -> bool:
        """Whether key ``kb`` fits a record (``F.MAX_KEY``); one that does not is refused, counted ``bad_key``.
        (``append`` makes the same check inline, in its loop over a batch.)"""
        if len(kb) <= F.MAX_KEY:
            return True
        with self._locks.lock:
            self._counters.bad_key += 1
        return False

    def _write_reserved(self, keys: Sequence[str], srcs: Sequence[Parts]) -> list[bool]:
        """A batch holding keys that are empty or start with NUL (the names of pieces, ``large.py``):
        those are refused (``bad_key``), the others written."""
        good = [i for i, k in enumerate(keys) if k[:1] > "\x00"]
        with self._locks.lock:
            self._counters.bad_key += len(keys) - len(good)
        out = [False] * len(keys)
        if good:
            for i, ok in zip(good, self.write([keys[i] for i in good], [srcs[i] for i in good])):
                out[i] = ok
        return out

    def append(self, keys: Sequence[str], srcs: Sequence[Parts]) -> tuple[list[bool], bool, list[int]]:
        """Append a batch: host objects are copied into the active image one after another (buffered,
        a payload of ``_GATHER_MIN`` bytes or more is only summed, and written from the caller's parts:
        see ``Segment``) and committed per region in one go: the batch's bytes reach the file, then its
        digests enter the index together.  With O_DIRECT, each finished copy step or object is offered
        to the writer threads (``Segment.offer``): once ``PIPE_MIN_DIRECT`` bytes wait, a writer pumps
        whatever is finished, write after write, while the caller goes on (a second joins when the
        backlog grows); buffered, an idle writer is handed everything since its last write once
        ``PIPE_UNIT`` bytes wait.  The commit writes the rest beside the writers' last pieces.
        Compressed or device objects take ``_put_one``.  Objects of more than ``Geometry.single`` bytes
        are left to the caller (``_put_large``).

        Each object goes through five phases: what it is (length, host memory, huge pages); its place
        (after the segment, or in the next region: ``_next_region``); its bytes (one of ``_copy_direct``,
        ``_copy_gathered``, ``_copy_streamed``, ``_copy_into_image``); into the segment; the writer
        threads take what is finished.  Then ``commit``.  (The phases that run for every object stay in
        the loop, on locals: a call each would cost a tenth of a 16 KiB put.)
        Returns the results, whether any object took ``_put_one``, and the positions of the large objects."""
        out = [False] * len(keys)
        one_by_one = False
        large: list[int] = []
        single = self._cfg.geometry().single
        max_slot = self._cfg.max_slot
        plain = not self._cfg.compression
        direct_min = F.DIRECT_MIN if self._cfg.direct_io else 1 << 62  # (see ``Segment``)
        key_digest = F.key_digest
        region_size = self._cfg.region_size
        b = _Appending(self._cfg, self._table, out)
        seg = b.seg
        gather, flags, pipe_min, psum_of = b.gather, b.flags, b.pipe_min, b.psum_of
        _ctype = ctype_of
        head, align, block, per_entry, max_key, footer = _HEAD, _ALIGN, _BLOCK, _ENTRY, _MAX_KEY, _FOOTER
        hdr, chk, digest_of, entry_of = _HDR, _CHK, _DIGEST, _ENTRY_OF
        # (the segment's lists are cleared in place by each commit, so these stay bound to them)
        s_idx, s_dig, s_off, s_rec, s_raw = (seg.idx.append, seg.digests.append, seg.offsets.append,
                                            seg.rec_lens.append, seg.raw_lens.append)
        s_ent, s_key = seg.entries.append, seg.keys.append
        r = b.r
        last = len(keys) - 1
        for i, key in enumerate(keys):
            # what it is: its length, whether it is in host memory, and in huge pages (``direct``)
            parts = srcs[i]
            kb = key.encode()
            klen = len(kb)
            if klen > max_key:
                with self._locks.lock:
                    self._counters.bad_key += 1
                continue
            direct = False
            if len(parts) == 1:
                p = parts[0]
                raw_len = p.numel()
                host = plain and p.is_cpu and p.is_contiguous()
                direct = host and raw_len >= direct_min and contiguous(p.data_ptr(), raw_len)
            else:
                raw_len = 0
                host = plain
                for p in parts:
                    raw_len += p.numel()
                    if host and not (p.is_cpu and p.is_contiguous()):
                        host = False
            if raw_len > single:  # (pieces and a manifest: ``large.py``)
                large.append(i)
                continue
            if not host:
                self.commit(seg, out)
                out[i] = self._put_one(key, parts)
                one_by_one = True
                b.aim(self._table.active, self._table.image_addr)
                r = b.r
                continue
            # its place (a payload written from the caller's memory gets a pad, known once its place is:
            # room for the most)
            rec_len = head + klen + raw_len + (block - 1 if direct else 0)
            if ((rec_len + align - 1) & -align) + per_entry + max_key > max_slot or raw_len >= 1 << 32:
                with self._locks.lock:
                    self._counters.too_large += 1  # (``F.measure``)
                continue
            n = seg.n
            pos = seg.end if n else (r.pos if r is not None else 0)
            # (``F.summary_start``: the region's summary, this record's entry and key included, must
            # start at or after the record's end)
            if r is None or (region_size - (r.count + n + 1) * per_entry - len(r.keys) - seg.key_bytes - klen
                             - footer) & -block < (pos + rec_len + align - 1) & -align:
                r = self._next_region(b, rec_len, klen)
                if r is None:
                    continue
                pos, n = r.pos, 0
            buf, mv = b.buf, b.mv
            if not n:
                seg.begin(r, pos, gather)
                if gather and r.written < pos:  # (a header, records copied into the image: they lead the pieces)
                    seg.iov.append(b.mv[r.written:pos])
            # its bytes, by the way its payload travels to the file
            if direct:
                rec_len = self._copy_direct(b, pos, kb, parts[0].data_ptr(), raw_len)
            elif gather and raw_len >= _GATHER_MIN and len(parts) == 1:  # (the page cache's common case, inline)
                at = pos + head + klen
                src = _ctype(raw_len).from_address(parts[0].data_ptr())
                hdr(buf, pos, _MAGIC, _VERSION, flags, klen, r.seq, raw_len, raw_len, psum_of(src), 0, 0)
                mv[pos + head:at] = kb
                chk(buf, pos + _CHECK_AT, digest_of(mv[pos:at]))
                iov = seg.iov
                iov.append(mv[pos:at])
                iov.append(src)
                if (pos + rec_len + align - 1) & -align > at + raw_len:
                    iov.append(_ZEROS[:((pos + rec_len + align - 1) & -align) - at - raw_len])
            elif gather and raw_len >= _GATHER_MIN:
                self._copy_gathered(b, pos, kb, parts, raw_len)
            elif len(parts) == 1 and raw_len >= _STREAM_MIN:
                self._copy_streamed(b, pos, kb, parts[0].data_ptr(), raw_len)
            else:
                self._copy_into_image(b, pos, kb, parts, raw_len)
            end = (pos + rec_len + align - 1) & -align
            # into the segment: indexed when it is committed
            d = key_digest(kb)
            s_idx(i)
            s_dig(d)
            s_off(pos)
            s_rec(rec_len)
            s_raw(raw_len)
            s_ent(entry_of(d, pos, rec_len, raw_len, klen, flags, 0))
            s_key(kb)
            seg.key_bytes += klen
            seg.n = n + 1
            seg.end = end
            # the writer threads take what is finished (the last piece is the commit's)
            if i < last:
                if not gather:
                    seg.offer(self._io.writer_pool(), r, end & -block, pipe_min)
                elif end - seg.submitted >= pipe_min and seg.idle():
                    seg.submit_gathered(self._io.writer_pool(), r, end)
        self.commit(seg, out)
        return out, one_by_one, large

    def _next_region(self, b: _Appending, rec_len: int, klen: int) -> Optional[R.Region]:
        """The active region cannot hold a record of ``rec_len`` bytes (key ``klen``) with its summary entry
        and key: commit the segment, and aim the batch at the next region (``RegionChanger.room``: it seals
        this one and begins the next).  None if no region has room (counted there)."""
        self.commit(b.seg, b.out)
        r = self._changer.room(rec_len, klen)
        b.aim(self._table.active, self._table.image_addr)
        return r

    def _copy_direct(self, b: _Appending, pos: int, kb: bytes, src_addr: int, raw_len: int) -> int:
        """O_DIRECT, a payload in huge pages: its whole blocks go to the file from the caller's memory (a
        hole of the segment, ``Segment``), only the partial blocks at its two ends into the image.  Returns
        the record's length, its pad included."""
        klen = len(kb)
        at = pos + _HEAD + klen
        pad = (src_addr - at) & (_BLOCK - 1)
        body = at + pad  # (its file offset has the address's phase: ``lo`` and ``hi`` are both aligned)
        lo = (body + _BLOCK - 1) & -_BLOCK
        hi = (body + raw_len) & -_BLOCK
        base, seg = b.base, b.seg
        if pad:
            ctypes.memset(base + at, 0, pad)
        _memmove(base + body, src_addr, lo - body)  # the partial blocks at both ends: into the image
        _memmove(base + hi, src_addr + hi - body, body + raw_len - hi)
        if not seg.n and hi > lo:  # a segment's first: its blocks leave now, while the payload is summed
            seg.submit_hole(self._io.writer_pool(), b.r, lo, hi, src_addr + lo - body)
        else:
            seg.holes.append((lo, hi, src_addr + lo - body))
        psum = b.psum_of(ctype_of(raw_len).from_address(src_addr))
        buf, mv = b.buf, b.mv
        _HDR(buf, pos, _MAGIC, _VERSION, b.flags, klen, b.seq, raw_len, raw_len, psum, 0, pad)
        mv[pos + _HEAD:at] = kb
        _CHK(buf, pos + _CHECK_AT, _DIGEST(mv[pos:at]))
        seg.direct.append(pos)
        return _HEAD + klen + pad + raw_len

    def _copy_gathered(self, b: _Appending, pos: int, kb: bytes, parts: Parts, raw_len: int) -> None:
        """Buffered, a payload of ``_GATHER_MIN`` bytes or more: only summed; the segment's pieces take the
        record's header and key from the image, the payload from the caller's parts, then zeros."""
        klen = len(kb)
        at = pos + _HEAD + klen
        end = (at + raw_len + _ALIGN - 1) & -_ALIGN
        buf, mv, iov = b.buf, b.mv, b.seg.iov
        if len(parts) == 1:
            src = ctype_of(raw_len).from_address(parts[0].data_ptr())
            _HDR(buf, pos, _MAGIC, _VERSION, b.flags, klen, b.seq, raw_len, raw_len, b.psum_of(src), 0, 0)
            mv[pos + _HEAD:at] = kb
            _CHK(buf, pos + _CHECK_AT, _DIGEST(mv[pos:at]))
            iov.append(mv[pos:at])
            iov.append(src)
        else:
            views = [cbuffer(p) for p in parts if p.numel()]
            psum = F.payload_sum(views, b.flags)
            _HDR(buf, pos, _MAGIC, _VERSION, b.flags, klen, b.seq, raw_len, raw_len, psum, 0, 0)
            mv[pos + _HEAD:at] = kb
            _CHK(buf, pos + _CHECK_AT, _DIGEST(mv[pos:at]))
            iov.append(mv[pos:at])
            iov += views
        if end > at + raw_len:
            iov.append(_ZEROS[:end - at - raw_len])

    def _copy_streamed(self, b: _Appending, pos: int, kb: bytes, src_addr: int, raw_len: int) -> None:
        """O_DIRECT, a payload of ``_STREAM_MIN`` bytes or more from ordinary memory: summed first, then
        copied in steps that the writer threads take as they are done (they never wait a whole copy)."""
        klen = len(kb)
        at = pos + _HEAD + klen
        psum = b.psum_of(ctype_of(raw_len).from_address(src_addr))
        buf, mv, base = b.buf, b.mv, b.base
        _HDR(buf, pos, _MAGIC, _VERSION, b.flags, klen, b.seq, raw_len, raw_len, psum, 0, 0)
        mv[pos + _HEAD:at] = kb
        _CHK(buf, pos + _CHECK_AT, _DIGEST(mv[pos:at]))
        done = 0
        while done < raw_len:
            m = min(_STREAM_STEP, raw_len - done)
            _memmove(base + at + done, src_addr + done, m)
            done += m
            if done < raw_len:
                b.seg.offer(self._io.writer_pool(), b.r, (at + done) & -_BLOCK, b.pipe_min)

    def _copy_into_image(self, b: _Appending, pos: int, kb: bytes, parts: Parts, raw_len: int) -> None:
        """Any other payload: copied into the image (one memmove a part), summed there."""
        klen = len(kb)
        at = pos + _HEAD + klen
        buf, mv, base = b.buf, b.mv, b.base
        if len(parts) == 1:
            if raw_len:
                _memmove(base + at, parts[0].data_ptr(), raw_len)
        else:
            dst = base + at
            for p in parts:
                m = p.numel()
                if m:
                    _memmove(dst, p.data_ptr(), m)
                    dst += m
        psum = b.psum_of(mv[at:at + raw_len])
        _HDR(buf, pos, _MAGIC, _VERSION, b.flags, klen, b.seq, raw_len, raw_len, psum, 0, 0)
        mv[pos + _HEAD:at] = kb
        _CHK(buf, pos + _CHECK_AT, _DIGEST(mv[pos:at]))
        if b.seg.gather:
            b.seg.iov.append(mv[pos:(at + raw_len + _ALIGN - 1) & -_ALIGN])

    def commit(self, seg: Segment, out: list[bool]) -> None:
        """Write out the segment's bytes, then index its records; on an I/O error none of them is indexed
        (``out`` stays False for them, and the next records overwrite their bytes)."""
        if not seg.n:
            return
        r = cast(R.Region, seg.region)
        if seg.gather:
            ok = True
            if seg.iov:
                try:  # (beside the writer's piece in flight)
                    R.pwritev_all(r.fd, seg.iov, seg.submitted)
                except OSError as e:
                    self._health.write_failed(e, f"writing {r.path}")
                    ok = False
            ok = seg.wait(self._health, self._io.note_dirty) and ok
            if ok:
                r.written = seg.end
                self._io.note_dirty(r.fd)
        else:
            r.written = max(r.written, seg.claim_rest())
            ok = self._io.write_out(r, F.align_up(seg.end), seg.end, seg)  # (beside the writer's piece in flight)
            ok = seg.wait(self._health, self._io.note_dirty) and ok
        if not ok:  # (buffered, the file holds exactly ``written`` bytes; O_DIRECT rewrites a partial block)
            r.written = min(r.written, F.align_down(seg.start) if self._cfg.direct_io else seg.start)
            seg.reset()
            return
        n = seg.n
        meas = seg.end - seg.start + n * (F.ENTRY + F.MAX_KEY)  # (``F.measure`` of each: they lie end to end)
        with self._locks.lock:
            olds = self._cat.index.put_many(seg.digests, r.index, seg.offsets, seg.rec_lens, seg.raw_lens)
            self._table.enliven_run(r, meas, n)
            for old in olds:
                self._cat.retire(old)  # the older version is dead: it must never come back
            r.pos = seg.end
            if seg.direct:
                r.direct.update(seg.direct)
                self._counters.direct_writes += len(seg.direct)
            self._cat.mark_changed()
        cast(bytearray, r.entries).extend(b"".join(seg.entries))
        cast(bytearray, r.keys).extend(b"".join(seg.keys))
        r.count += n
        self._checkpointer.note_written(n)
        for i in seg.idx:
            out[i] = True
        seg.reset()

    def _put_one(self, key: str, parts: Parts, large_total: int = 0) -> bool:
        """One record, copied into the active image (compressed when that is smaller).  ``large_total``: the
        record is the manifest of a large object of that many bytes (``large.py``): never compressed, its
        raw length the object's."""
        kb = key.encode()
        if not self._key_fits(kb):
            return False
        raw_len = 0
        hosts: list[Optional[tuple[int, int]]] = []  # (address, nbytes) of host parts copied with one memmove each
        for p in parts:
            n = p.numel()
            raw_len += n
            if n:
                hosts.append((p.data_ptr(), n) if p.device.type == "cpu" and p.is_contiguous() else None)
        flags = F.FLAG_CRC32C if self._cfg.checksum == "crc32c" else 0
        direct: Optional[list[Optional[tuple[int, int]]]]
        payload: list[Any]
        compression = self._cfg.compression and not large_total
        if None in hosts or compression:
            payload = [_host_view(p) for p in parts if p.numel()]
            direct = None
        else:
            payload = direct = cast("list[Any]", hosts)
        if compression and raw_len:
            import lz4.block

            packed = lz4.block.compress(payload[0] if len(payload) == 1 else b"".join(payload), store_size=False)
            if len(packed) < raw_len:
                payload, flags = [memoryview(packed)], flags | F.FLAG_LZ4
        stored = raw_len if direct is not None else sum(len(v) for v in payload)
        if large_total:
            flags |= F.FLAG_LARGE
            raw_len = large_total
        rec_len = F.record_len(len(kb), stored)
        if F.measure(rec_len) > self._cfg.max_slot or raw_len >= 1 << 32:
            with self._locks.lock:
                self._counters.too_large += 1
            return False
        r = self._changer.room(rec_len, len(kb))
        if r is None:
            return False
        pos = r.pos
        buf = cast("mmap.mmap", r.buf)  # (the active image)
        at = pos + F.REC_HDR + len(kb)
        mv = memoryview(buf)
        if direct is not None:
            base = self._table.image_addr
            for addr, n in cast("list[tuple[int, int]]", direct):  # (no None: those went to ``payload``)
                ctypes.memmove(base + at, addr, n)
                at += n
        else:
            for v in payload:
                mv[at:at + len(v)] = v
                at += len(v)
        psum = cast(int, F.payload_sum([mv[pos + F.REC_HDR + len(kb):at]], flags))  # (a checksum this build has)
        F.pack_record_header(buf, pos, flags, kb, r.seq, raw_len, stored, psum)
        end = F.align_up(pos + rec_len, F.ALIGN)
        if end - r.written >= WRITE_UNIT and not self._io.write_out(r, F.align_down(end), end):
            return False  # nothing indexed: the next record overwrites these bytes
        d = F.key_digest(kb)
        with self._locks.lock:
            old = self._cat.index.put(d, r.index, pos, rec_len, raw_len)
            if old is not None:  # the older version is dead: it must never come back
                self._cat.retire(old)
            self._table.enliven(r, rec_len)
            r.pos = end
            self._cat.mark_changed()
        r.add_entry(d, pos, rec_len, raw_len, kb, flags)
        self._checkpointer.note_written(1)
        return True

    # -- large objects (``large.py``) -------------------------------------------------------
    def _put_large(self, key: str, parts: Parts) -> bool:
        """Pieces, in the file before the manifest is appended; if any piece or the manifest fails, the
        pieces written are removed (none is left behind).  Caller holds ``_wlock``."""
        kb = key.encode()
        if not self._key_fits(kb):
            return False
        total = sum(p.numel() for p in parts)
        geom = self._cfg.geometry()
        if geom.footprint(total) > self._cfg.capacity_bytes:  # (``NEVER`` past ``MAX_OBJECT``)
            self._refuse_large(total)
            return False
        count, piece = geom.layout(total)
        nonce = int.from_bytes(os.urandom(8), "little")
        d = F.key_digest(kb)
        tag = torch.frombuffer(bytearray(nonce.to_bytes(L.NONCE, "little")), dtype=torch.uint8)
        srcs = [[tag, *L.slices(parts, i * piece, min(total, (i + 1) * piece))] for i in range(count)]
        unsynced = self._checkpointer.written()
        res, _, _ = self.append(L.piece_keys(d, 0, count), srcs)
        table = torch.frombuffer(bytearray(L.pack_table(count, piece, total, nonce)), dtype=torch.uint8)
        if all(res) and self._put_one(key, [table], large_total=total):
            self._cat.note_large()
            self._checkpointer.set_written(unsynced + 1)  # (one chunk stored, whatever its pieces)
            return True
        self._checkpointer.set_written(unsynced)
        with self._locks.lock:
            self._cat.drop_pieces(d, 0, count)
        return False

    def _large_before(self, keys: Sequence[str]) -> list[tuple[int, int, int]]:
        """(position, digest, object length) of each key of a batch that names a large object now."""
        digs = [F.key_digest(k.encode()) for k in keys]
        single = self._cfg.geometry().single
        with self._locks.lock:
            found = self._cat.index.lookup(digs)
        return [(i, digs[i], raw) for i, _, _, _, raw in found if raw > single]

    def _replaced_large(self, prior: list[tuple[int, int, int]], keys: Sequence[str], srcs: Sequence[Parts],
                        out: list[bool]) -> None:
        """Large objects a batch replaced: their pieces that the new value did not replace go too."""
        geom = self._cfg.geometry()
        with self._locks.lock:
            for i, d, old_total in prior:
                if not out[i]:
                    continue
                total = sum(p.numel() for p in srcs[i])
                now = geom.layout(total)[0] if total > geom.single else 0
                self._cat.drop_pieces(d, now, geom.layout(old_total)[0])

    def _refuse_large(self, nbytes: int) -> None:
        """An object larger than the whole tier: counted (``too_large``), logged at most once a minute."""
        with self._locks.lock:
            self._counters.too_large += 1
        now = time.monotonic()
        if now >= self._too_large_quiet:
            self._too_large_quiet = now + 60.0
            log.warning("%s: refused an object of %d bytes: larger than the tier (capacity %d bytes, the object "
                        "takes %s); too_large: %d so far", self._cfg.what, nbytes, self._cfg.capacity_bytes,
                        self._cfg.geometry().footprint(nbytes) if nbytes <= L.MAX_OBJECT else "4 GiB or more: too long",
                        self._counters.too_large)
