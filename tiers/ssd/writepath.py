"""The write path of ``SSDTier``: appends into the active region's image, write-outs, region changes.

A ``write`` call is one batch: its host objects are copied into the active image one after
another (header packed in one call, its check one xxh3 call over header and key; buffered,
large payloads are written from the caller's parts instead, see ``Segment``) while
writer threads write out what is already copied; at the end of the batch (or of a region)
the rest is written and only then do the batch's digests enter the index, together.  So
every object ``write`` acknowledged is in the region file when it returns, and a write-out
that fails indexes none of the batch's objects (the next records overwrite their bytes).
Compressed or device objects take ``_put_one``, one at a time.

A full region is sealed and the next one begun by ``regionchange.py``.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Optional, cast

import torch
import xxhash

from tierkv.hostmem import contiguous

from ..base import Parts
from . import format as F
from . import large as L
from . import region as R
from . import segment
from .deadlog import DeadLog
from .format import WRITE_UNIT
from .hostbuf import _host_view, cbuffer, ctype_of
from .index import DigestIndex
from .segment import Segment

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


class WritePath:
    # state of ``SSDTier`` (set in its ``__init__`` and ``Tier.__init__``)
    name: str
    path: str
    compression: Optional[str]
    checksum: str
    fsync: str
    direct_io: bool
    region_size: int
    _lock: threading.Lock
    _wlock: threading.Lock
    _regions: dict[int, R.Region]
    _active: Optional[R.Region]
    _index: DigestIndex
    _dead: DeadLog
    _live_total: int
    _changed: bool
    _sealed_since_ckpt: int
    _next_seq: int
    _dirty_fds: set[int]
    _writer: Optional[ThreadPoolExecutor]
    _spare_image: Optional[mmap.mmap]
    _seals: list  # (region, future, summary buffer, its offset) of summaries on the writer thread (``_seal``)
    _image_addrs: dict[int, tuple]
    _image_addr: int
    _counters: dict[str, int]
    _what: str
    capacity_bytes: int
    _has_large: bool  # a large object was stored or found since the open (``large.py``)
    _too_large_quiet: float  # no ``too_large`` warning is logged before this (monotonic) time

    if TYPE_CHECKING:  # defined by ``SSDTier``, ``Persistence`` and ``Reclaim``
        def _geometry(self) -> L.Geometry: ...
        @property
        def max_slot(self) -> int: ...
        @property
        def regions_dir(self) -> str: ...
        def regions_needed(self) -> int: ...
        def _count(self, what: str, n: int = 1) -> None: ...
        def _io_error(self, e: OSError, what: str) -> None: ...
        def _unlive(self, idx: int, rec_len: int) -> None: ...
        def _ensure_dirs(self) -> None: ...
        def _close_region_fd(self, r: R.Region) -> None: ...
        def _flush_locked(self, checkpoint: bool) -> None: ...
        def _checkpoint(self, cands: Any = None, durable: bool = True) -> None: ...
        def _checkpoint_every(self) -> int: ...
        def _pick_victim(self) -> Optional[R.Region]: ...
        def _reclaim(self, victim: R.Region, dest: R.Region) -> None: ...
        def _room(self, rec_len: int, key_len: int) -> Optional[R.Region]: ...
        def _lock_lost(self) -> bool: ...
        def _check_removed(self, dirty: bool = False) -> bool: ...

    # -- writes ---------------------------------------------------------------------------
    def _write(self, keys: Sequence[str], srcs: Sequence[Parts]) -> list[bool]:
        if keys and min(keys) < "\x01":  # (one C pass: no key of the store starts so)
            return self._write_reserved(keys, srcs)
        with self._wlock:
            if self._lock_lost():  # (the directory is another process's now: see ``lock.py``)
                self._count("lock_lost", len(keys))
                return [False] * len(keys)
            prior = self._large_before(keys) if self._has_large else None
            out, one_by_one, large = self._append_batch(keys, srcs)
            for i in large:
                out[i] = self._put_large(keys[i], srcs[i])
                one_by_one = True
            if prior:
                self._replaced_large(prior, keys, srcs, out)
            r = self._active
            if r is not None:
                if self.fsync == "always":
                    self._flush_locked(checkpoint=False)
                elif one_by_one and r.pos > r.written:  # (the others reached the file when committed)
                    self._write_out(r, F.align_up(r.pos), r.pos)
            # what was acknowledged is in a file under the directory: one removed behind the tier is made
            # again before the answer (``Persistence._after_removal``); an object that went with a file that
            # could not be is answered False (and counted there: ``objects_lost``)
            if self._check_removed():
                with self._lock:
                    for i, k in enumerate(keys):
                        if out[i] and self._index.find(F.key_digest(k.encode())) < 0:
                            out[i] = False
        return out

    def _write_reserved(self, keys: Sequence[str], srcs: Sequence[Parts]) -> list[bool]:
        """A batch holding keys that are empty or start with NUL (the names of pieces, ``large.py``):
        those are refused (``bad_key``), the others written."""
        good = [i for i, k in enumerate(keys) if k[:1] > "\x00"]
        self._count("bad_key", len(keys) - len(good))
        out = [False] * len(keys)
        if good:
            for i, ok in zip(good, self._write([keys[i] for i in good], [srcs[i] for i in good])):
                out[i] = ok
        return out

    def _append_batch(self, keys: Sequence[str], srcs: Sequence[Parts]) -> tuple[list[bool], bool, list[int]]:
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
        Returns the results, whether any object took ``_put_one``, and the positions of the large objects."""
        out = [False] * len(keys)
        one_by_one = False
        large: list[int] = []
        single = self._geometry().single
        seg = Segment()
        flags = F.FLAG_CRC32C if self.checksum == "crc32c" else 0
        psum_of = F.sum_function(flags)
        max_slot = self.max_slot
        region_size = self.region_size
        hdr = F.RECORD_STRUCT.pack_into
        chk = F.CHECK_STRUCT.pack_into
        entry = F.ENTRY_STRUCT.pack
        digest_of = xxhash.xxh3_64_intdigest
        key_digest = F.key_digest
        memmove = ctypes.memmove
        _ctype = ctype_of
        magic, version = F.RECORD_MAGIC, F.VERSION
        head, check_at, align = F.REC_HDR, F.RECORD_CHECK_AT, F.ALIGN
        per_entry, max_key, footer = F.ENTRY, F.MAX_KEY, F.FOOTER
        pipe_min = PIPE_MIN_DIRECT if self.direct_io else PIPE_UNIT
        plain = not self.compression
        gather = not self.direct_io  # (see ``Segment``)
        direct_min = F.DIRECT_MIN if self.direct_io else 1 << 62  # (see ``Segment``)
        block = F.BLOCK
        memset = ctypes.memset
        iov: list = []
        # (the segment's lists are cleared in place by each commit, so these stay bound to them)
        s_idx, s_dig, s_off, s_rec, s_raw = (seg.idx.append, seg.digests.append, seg.offsets.append,
                                            seg.rec_lens.append, seg.raw_lens.append)
        s_ent, s_key = seg.entries.append, seg.keys.append
        s_hole, s_direct = seg.holes.append, seg.direct.append
        last = len(keys) - 1
        r = self._active
        buf: Any = None
        mv: Any = None
        base = 0
        if r is not None:
            buf, mv, base = r.buf, memoryview(cast("mmap.mmap", r.buf)), self._image_addr
        for i, key in enumerate(keys):
            parts = srcs[i]
            kb = key.encode()
            klen = len(kb)
            if klen > max_key:
                self._count("bad_key")
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
                self._commit(seg, out)
                out[i] = self._put_one(key, parts)
                one_by_one = True
                r = self._active
                if r is not None:
                    buf, mv, base = r.buf, memoryview(cast("mmap.mmap", r.buf)), self._image_addr
                continue
            # (a payload written from the caller's memory gets a pad, known once its place is: room for the most)
            rec_len = head + klen + raw_len + (block - 1 if direct else 0)
            if ((rec_len + align - 1) & -align) + per_entry + max_key > max_slot or raw_len >= 1 << 32:
                self._count("too_large")  # (``F.measure``)
                continue
            n = seg.n
            pos = seg.end if n else (r.pos if r is not None else 0)
            end = (pos + rec_len + align - 1) & -align
            # (``F.summary_start``: the region's summary, this record's entry and key included, must
            # start at or after the record's end)
            if r is None or (region_size - (r.count + n + 1) * per_entry - len(r.keys)  # type: ignore[arg-type]  # (set while ACTIVE)
                             - seg.key_bytes - klen - footer) & -F.BLOCK < end:
                self._commit(seg, out)
                r = self._room(rec_len, klen)
                if r is None:
                    continue
                buf, mv, base = r.buf, memoryview(cast("mmap.mmap", r.buf)), self._image_addr
                pos = r.pos
                end = (pos + rec_len + align - 1) & -align
                n = 0
            if not n:
                seg.begin(r, pos, gather)
                iov = seg.iov
                if gather and r.written < pos:  # (a header, records copied into the image: they lead the pieces)
                    iov.append(mv[r.written:pos])
            at = pos + head + klen
            if direct:  # O_DIRECT: the payload's whole blocks go to the file from the caller's memory
                src_addr = parts[0].data_ptr()
                pad = (src_addr - at) & (block - 1)
                body = at + pad  # (its file offset has the address's phase: ``lo`` and ``hi`` are both aligned)
                rec_len = head + klen + pad + raw_len
                end = (pos + rec_len + align - 1) & -align
                lo = (body + block - 1) & -block
                hi = (body + raw_len) & -block
                if pad:
                    memset(base + at, 0, pad)
                memmove(base + body, src_addr, lo - body)  # the partial blocks at both ends: into the image
                memmove(base + hi, src_addr + hi - body, body + raw_len - hi)
                if not n and hi > lo:  # a segment's first: its blocks leave now, while the payload is summed
                    seg.submit_hole(self._writer_pool(), r, lo, hi, src_addr + lo - body)
                else:
                    s_hole((lo, hi, src_addr + lo - body))
                psum = psum_of(_ctype(raw_len).from_address(src_addr))
                hdr(buf, pos, magic, version, flags, klen, r.seq, raw_len, raw_len, psum, 0, pad)
                mv[pos + head:at] = kb
                chk(buf, pos + check_at, digest_of(mv[pos:at]))
                s_direct(pos)
            elif seg.gather and raw_len >= _GATHER_MIN:  # the payload goes to the file from the caller's parts
                if len(parts) == 1:
                    src = _ctype(raw_len).from_address(parts[0].data_ptr())
                    psum = psum_of(src)
                    hdr(buf, pos, magic, version, flags, klen, r.seq, raw_len, raw_len, psum, 0, 0)
                    mv[pos + head:at] = kb
                    chk(buf, pos + check_at, digest_of(mv[pos:at]))
                    iov.append(mv[pos:at])
                    iov.append(src)
                else:
                    views = [cbuffer(p) for p in parts if p.numel()]
                    psum = F.payload_sum(views, flags)
                    hdr(buf, pos, magic, version, flags, klen, r.seq, raw_len, raw_len, psum, 0, 0)
                    mv[pos + head:at] = kb
                    chk(buf, pos + check_at, digest_of(mv[pos:at]))
                    iov.append(mv[pos:at])
                    iov += views
                if end > at + raw_len:
                    iov.append(_ZEROS[:end - at - raw_len])
            elif len(parts) == 1 and raw_len >= _STREAM_MIN:  # summed first, then copied in steps that the
                src_addr = parts[0].data_ptr()  # writer can take as they are done (it never waits a whole copy)
                psum = psum_of(_ctype(raw_len).from_address(src_addr))
                hdr(buf, pos, magic, version, flags, klen, r.seq, raw_len, raw_len, psum, 0, 0)
                mv[pos + head:at] = kb
                chk(buf, pos + check_at, digest_of(mv[pos:at]))
                done = 0
                while done < raw_len:
                    m = min(_STREAM_STEP, raw_len - done)
                    memmove(base + at + done, src_addr + done, m)
                    done += m
                    if done < raw_len:
                        seg.offer(self._writer_pool(), r, (at + done) & -block, pipe_min)
            else:
                if len(parts) == 1:
                    if raw_len:
                        memmove(base + at, parts[0].data_ptr(), raw_len)
                else:
                    dst = base + at
                    for p in parts:
                        m = p.numel()
                        if m:
                            memmove(dst, p.data_ptr(), m)
                            dst += m
                psum = psum_of(mv[at:at + raw_len])
                hdr(buf, pos, magic, version, flags, klen, r.seq, raw_len, raw_len, psum, 0, 0)
                mv[pos + head:at] = kb
                chk(buf, pos + check_at, digest_of(mv[pos:at]))
                if seg.gather:
                    iov.append(mv[pos:end])
            d = key_digest(kb)
            s_idx(i)
            s_dig(d)
            s_off(pos)
            s_rec(rec_len)
            s_raw(raw_len)
            s_ent(entry(d, pos, rec_len, raw_len, klen, flags, 0))
            s_key(kb)
            seg.key_bytes += klen
            seg.n = n + 1
            seg.end = end
            if i < last:  # (the last piece: the commit's)
                if not seg.gather:
                    seg.offer(self._writer_pool(), r, F.align_down(end), pipe_min)
                elif end - seg.submitted >= pipe_min and seg.idle():
                    seg.submit_gathered(self._writer_pool(), r, end)
                    iov = seg.iov
        self._commit(seg, out)
        return out, one_by_one, large

    def _writer_pool(self) -> ThreadPoolExecutor:
        w = self._writer
        if w is None:
            w = self._writer = ThreadPoolExecutor(max_workers=segment.PUMPS, thread_name_prefix=f"tierkv-{self.name}-w")
        return w

    def _commit(self, seg: "Segment", out: list[bool]) -> None:
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
                    self._io_error(e, f"writing {r.path}")
                    ok = False
            ok = seg.wait(self) and ok
            if ok:
                r.written = seg.end
                self._dirty_fds.add(r.fd)
        else:
            r.written = max(r.written, seg.claim_rest())
            ok = self._write_out(r, F.align_up(seg.end), seg.end, seg)  # (beside the writer's piece in flight)
            ok = seg.wait(self) and ok
        if not ok:  # (buffered, the file holds exactly ``written`` bytes; O_DIRECT rewrites a partial block)
            r.written = min(r.written, F.align_down(seg.start) if self.direct_io else seg.start)
            seg.reset()
            return
        n = seg.n
        meas = seg.end - seg.start + n * (F.ENTRY + F.MAX_KEY)  # (``F.measure`` of each: they lie end to end)
        with self._lock:
            olds = self._index.put_many(seg.digests, r.index, seg.offsets, seg.rec_lens, seg.raw_lens)
            r.live_bytes += meas
            r.live_count += n
            self._live_total += meas
            for o_r, o_off, o_rec in olds:
                self._unlive(o_r, o_rec)  # the older version is dead: it must never come back
                self._dead.add(o_r, o_off, self._regions[o_r].seq)
            r.pos = seg.end
            if seg.direct:
                r.direct.update(seg.direct)
                self._counters["direct_writes"] += len(seg.direct)
            self._changed = True
        cast(bytearray, r.entries).extend(b"".join(seg.entries))
        cast(bytearray, r.keys).extend(b"".join(seg.keys))
        r.count += n
        for i in seg.idx:
            out[i] = True
        seg.reset()

    def _put_one(self, key: str, parts: Parts, large_total: int = 0) -> bool:
        """One record, copied into the active image (compressed when that is smaller).  ``large_total``: the
        record is the manifest of a large object of that many bytes (``large.py``): never compressed, its
        raw length the object's."""
        kb = key.encode()
        if len(kb) > F.MAX_KEY:
            self._count("bad_key")
            return False
        raw_len = 0
        hosts: list[Optional[tuple[int, int]]] = []  # (address, nbytes) of host parts copied with one memmove each
        for p in parts:
            n = p.numel()
            raw_len += n
            if n:
                hosts.append((p.data_ptr(), n) if p.device.type == "cpu" and p.is_contiguous() else None)
        flags = F.FLAG_CRC32C if self.checksum == "crc32c" else 0
        direct: Optional[list[Optional[tuple[int, int]]]]
        payload: list[Any]
        compression = self.compression and not large_total
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
        if F.measure(rec_len) > self.max_slot or raw_len >= 1 << 32:
            self._count("too_large")
            return False
        r = self._room(rec_len, len(kb))
        if r is None:
            return False
        pos = r.pos
        buf = cast("mmap.mmap", r.buf)  # (the active image)
        at = pos + F.REC_HDR + len(kb)
        mv = memoryview(buf)
        if direct is not None:
            base = self._image_addr
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
        if end - r.written >= WRITE_UNIT and not self._write_out(r, F.align_down(end), end):
            return False  # nothing indexed: the next record overwrites these bytes
        d = F.key_digest(kb)
        with self._lock:
            old = self._index.put(d, r.index, pos, rec_len, raw_len)
            if old is not None:  # the older version is dead: it must never come back
                self._unlive(old[0], old[2])
                self._dead.add(old[0], old[1], self._regions[old[0]].seq)
            m = F.measure(rec_len)
            r.live_bytes += m
            r.live_count += 1
            self._live_total += m
            r.pos = end
            self._changed = True
        r.add_entry(d, pos, rec_len, raw_len, kb, flags)
        return True

    # -- large objects (``large.py``) -------------------------------------------------------
    def _put_large(self, key: str, parts: Parts) -> bool:
        """Pieces, in the file before the manifest is appended; if any piece or the manifest fails, the
        pieces written are removed (none is left behind).  Caller holds ``_wlock``."""
        kb = key.encode()
        if len(kb) > F.MAX_KEY:
            self._count("bad_key")
            return False
        total = sum(p.numel() for p in parts)
        geom = self._geometry()
        if geom.footprint(total) > self.capacity_bytes:  # (``NEVER`` past ``MAX_OBJECT``)
            self._refuse_large(total)
            return False
        count, piece = geom.layout(total)
        nonce = int.from_bytes(os.urandom(8), "little")
        d = F.key_digest(kb)
        tag = torch.frombuffer(bytearray(nonce.to_bytes(L.NONCE, "little")), dtype=torch.uint8)
        srcs = [[tag, *L.slices(parts, i * piece, min(total, (i + 1) * piece))] for i in range(count)]
        res, _, _ = self._append_batch(L.piece_keys(d, 0, count), srcs)
        table = torch.frombuffer(bytearray(L.pack_table(count, piece, total, nonce)), dtype=torch.uint8)
        if all(res) and self._put_one(key, [table], large_total=total):
            self._has_large = True
            return True
        with self._lock:
            self._drop_pieces(d, 0, count)
        return False

    def _large_before(self, keys: Sequence[str]) -> list[tuple[int, int, int]]:
        """(position, digest, object length) of each key of a batch that names a large object now."""
        digs = [F.key_digest(k.encode()) for k in keys]
        single = self._geometry().single
        with self._lock:
            found = self._index.lookup(digs)
        return [(i, digs[i], raw) for i, _, _, _, raw in found if raw > single]

    def _replaced_large(self, prior: list[tuple[int, int, int]], keys: Sequence[str], srcs: Sequence[Parts],
                        out: list[bool]) -> None:
        """Large objects a batch replaced: their pieces that the new value did not replace go too."""
        geom = self._geometry()
        with self._lock:
            for i, d, old_total in prior:
                if not out[i]:
                    continue
                total = sum(p.numel() for p in srcs[i])
                now = geom.layout(total)[0] if total > geom.single else 0
                self._drop_pieces(d, now, geom.layout(old_total)[0])

    def _drop_pieces(self, d: int, lo: int, hi: int) -> None:
        """Remove pieces ``lo`` to ``hi - 1`` of the large object of digest ``d``.  Caller holds ``_lock``."""
        for k in L.piece_keys(d, lo, hi):
            old = self._index.remove(F.key_digest(k.encode()))
            if old is not None:
                self._unlive(old[0], old[2])
                self._dead.add(old[0], old[1], self._regions[old[0]].seq)
                self._changed = True

    def _refuse_large(self, nbytes: int) -> None:
        """An object larger than the whole tier: counted (``too_large``), logged at most once a minute."""
        self._count("too_large")
        now = time.monotonic()
        if now >= self._too_large_quiet:
            self._too_large_quiet = now + 60.0
            log.warning("%s: refused an object of %d bytes: larger than the tier (capacity %d bytes, the object "
                        "takes %s); too_large: %d so far", self._what, nbytes, self.capacity_bytes,
                        self._geometry().footprint(nbytes) if nbytes <= L.MAX_OBJECT else "4 GiB or more: too long",
                        self._counters["too_large"])

    def _write_out(self, r: R.Region, end: int, data_end: int, seg: Optional["Segment"] = None) -> bool:
        """Write the active image from ``r.written`` up to ``end`` (block aligned); its bytes end at
        ``data_end`` (a partial last block is written again next time).  ``seg``: the segment being
        committed, whose payloads written from the caller's memory take their place (``Segment``)."""
        if not self.direct_io:  # buffered: exactly the bytes not yet written (the image may not hold the
            end = min(end, data_end)  # payloads of records written before, see ``Segment``)
        if end <= r.written:
            return True
        buf = cast("mmap.mmap", r.buf)  # (the active image)
        if end > data_end:  # the tail of a partial block: zeros, not an earlier region's bytes
            memoryview(buf)[data_end:end] = bytes(end - data_end)
        try:
            if seg is not None and seg.holes:
                R.pwrite_runs(r.fd, seg.runs(memoryview(buf), r.written, end))
            else:
                R.pwrite_all(r.fd, memoryview(buf)[r.written:end], r.written)
        except OSError as e:
            self._io_error(e, f"writing {r.path}")
            return False
        self._dirty_fds.add(r.fd)
        r.written = min(end, F.align_down(data_end)) if self.direct_io else end
        r.tail = (data_end, end)
        return True
