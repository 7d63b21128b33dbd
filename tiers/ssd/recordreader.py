"""``RecordReader``: the SSD engine's read path — locate under the lock, then read and verify outside it.

A record in the active region is copied from its in-memory image (buffered, only one not yet written to
the file: the image holds the headers of the others; with O_DIRECT, any but one whose payload was written
from the caller's memory, ``Region.direct``); any other is one pread (straight into the caller's parts
when buffered and uncompressed, else one block-aligned read into a private buffer).  Every read checks
header, seq, full key and payload sum.  A check that fails is looked at again once under the lock: if the
object moved meanwhile (its region was reclaimed) the new copy is read; otherwise it is corrupt, counted
and dropped.  Uses the owners ``SSDTier`` hands it (``EngineConfig``, ``RegionTable``, ``Catalogue``,
``EngineLocks``, ``SSDCounters``: ``state.py``) only: it calls no other component, and takes ``wlock``
only to drop a large object that did not read whole.
"""

from __future__ import annotations

import ctypes
import operator
import os
import struct
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import numpy as np
import torch
import xxhash

from tierkv.buffers import share_work

from ..base import Parts
from . import format as F
from . import large as L
from . import region as R
from .catalogue import Catalogue
from .counters import SSDCounters
from .engineconfig import EngineConfig
from .health import Health
from .hostbuf import cbuffer, ctype_of, scatter
from .regiontable import RegionTable
from .state import EngineLocks

_OK, _BAD, _OTHER, _SIZE = 1, 2, 3, 4  # exact; corrupt or moved; another key's record; size mismatch
_ZERO_CHECK = bytes(8)  # a header's check field, as its check was computed
_RUN_GAP = 4096  # records at most this far apart are read together
_RUN_MAX = 1 << 20  # a run's span is at most this long
#: O_DIRECT runs may be longer: a device serves one long read faster than several short ones
#: (``bench/bench_ssd.py``; docs/ssd.md, "Figures")
_RUN_MAX_DIRECT = (2 << 20) + (64 << 10)  # (2 MiB of payloads with their records' headers, keys and pads)
_RUN_OBJECT = 256 << 10  # records longer than this are read on their own
_MANY = 64  # batches of at least this many keys are looked up in the index with numpy
_PLACE = operator.itemgetter(0, 1)  # (region, offset) of a record to read
_XXH = xxhash.xxh3_64_intdigest
#: a record header's fixed fields (``F.RECORD_STRUCT`` up to the payload sum): magic, version, flags,
#: key length, seq, raw and stored length, all known before the read; then the sum and check, then padding
_EXPECT = struct.Struct("<4sBBHQII")
_FIXED = _EXPECT.size
_PSUM_AT = _FIXED
_SUMS = struct.Struct("<QQ")
_PAD_AT = F.RECORD_CHECK_AT + 8
_PAD = bytes(F.REC_HDR - _PAD_AT)


def _count_lost(counters: SSDCounters, key: str) -> None:
    """A chunk dropped as corrupt (``corrupt``, ``objects_lost``): a large object once, by its manifest, never
    by its piece (``key`` a piece's: its object is dropped, and counted, by ``_drop_large``).  Caller holds
    ``EngineLocks.lock``."""
    if len(key) == L.PIECE_KEY_LEN and key[0] == "\x00":
        return
    counters.corrupt += 1
    counters.objects_lost += 1


def _loc(t: tuple, kbs: list, digs: list) -> tuple:
    """A record to read as ``_read_one`` takes it: (key bytes, digest, region, offset, rec_len, raw_len,
    seq, image or None), from a batch's entry (region index, offset, i, rec_len, raw_len, region, seq)."""
    i = t[2]
    return kbs[i], digs[i], t[5], t[1], t[3], t[4], t[6], None


class RecordReader:
    """Reads records (see the module docstring); ``threads`` readers share a batch of long runs."""

    def __init__(self, cfg: EngineConfig, table: RegionTable, cat: Catalogue, locks: EngineLocks, counters: SSDCounters,
                 health: Health, threads: int) -> None:
        # (the owners, as ``state.py`` lists them: alike in each component's constructor, as each uses all five)
        self._cfg, self._table, self._cat, self._locks, self._counters = cfg, table, cat, locks, counters
        self._health = health
        self._threads = threads
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=f"tierkv-{cfg.name}")

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)

    def read(self, keys: Sequence[str], dsts: Sequence[Parts]) -> list[bool]:
        n = len(keys)
        out = [False] * n
        kbs = list(map(str.encode, keys))
        digs = list(map(F.key_digest, kbs))
        todo: list = []  # (region, offset, i, rec_len, raw_len, Region, seq) of each record to read
        large: list = []  # (i, raw_len) of the large objects (``large.py``)
        single = self._cfg.geometry().single
        with self._locks.lock:
            if n >= _MANY:
                _, reg, off, rec, raw = self._cat.index.get_many(np.array(digs, dtype=np.uint64))
                # (an absent digest has all four 0: no record has length 0)
                hit = np.flatnonzero(rec)
                found: list = list(zip(hit.tolist(), reg[hit].tolist(), off[hit].tolist(), rec[hit].tolist(),
                                       raw[hit].tolist()))
            else:  # (a few keys: one loop of probes costs less than the numpy calls)
                found = self._cat.index.lookup(digs)
            active = self._table.active
            regions = self._table.regions
            # (buffered, the active region's records already written are read from the file: the image
            # holds their headers only, see ``segment.Segment``; with O_DIRECT, so are the records whose
            # payload went to the file from the caller's memory, ``Region.direct``)
            in_image = active is not None and self._cfg.direct_io
            written = active.written if active is not None else 0
            direct = active.direct if active is not None else ()
            for i, ri, o, rl, wl in found:
                if wl > single:  # a large object's manifest: its pieces are read below
                    large.append((i, wl))
                    continue
                r = regions[ri]
                if r is active and (in_image or o + rl > written) and o not in direct:
                    # copied and checked under the lock, so the image cannot be reused meanwhile
                    out[i] = self._image_read(keys[i], (kbs[i], digs[i], r, o, rl, wl, r.seq, r.buf), dsts[i])
                else:
                    todo.append((ri, o, i, rl, wl, r, r.seq))
        if large:
            self._read_large(large, keys, kbs, digs, dsts, out)
        if not todo:
            return out
        runs = self._runs(todo, dsts, (kbs, digs))
        total = sum(run[2] for run in runs)

        def one(j: int) -> None:
            self._read_run(runs[j], keys, dsts, out)

        if len(runs) <= 1 or total < (1 << 20):
            for j in range(len(runs)):
                one(j)
        else:
            share_work(one, len(runs), self._pool, self._threads - 1)
        return out

    def _runs(self, todo: list, dsts: Sequence[Parts], ctx: tuple) -> list:
        """Records to read grouped into runs of neighbours in one file: (``ctx``, [todo entry], span bytes).

        Small records a short gap apart are read with one pread; a large record (buffered reads go
        straight into the caller's parts) is a run of its own.  A record of another size than the
        caller's parts is a miss without a read."""
        todo.sort(key=_PLACE)
        runs: list = []
        cur: list = []
        start = end = -1
        cur_r = -1
        alone = _RUN_OBJECT if not self._cfg.direct_io else 1 << 62  # (O_DIRECT: every run through the scratch)
        limit = (_RUN_MAX_DIRECT if self._cfg.direct_io else _RUN_MAX) + _RUN_GAP
        for t in todo:
            ri, o, i, rl, wl = t[:5]
            parts = dsts[i]
            if wl != (parts[0].numel() if len(parts) == 1 else sum(p.numel() for p in parts)):
                continue
            if rl > alone:  # (straight into the caller's parts when buffered)
                runs.append((ctx, [t], rl))
                continue
            if cur and ri == cur_r and o - end <= _RUN_GAP and o + rl - start <= limit:
                cur.append(t)
                if o + rl > end:
                    end = o + rl
                continue
            if cur:
                runs.append((ctx, cur, end - start))
            cur, cur_r, start, end = [t], ri, o, o + rl
        if cur:
            runs.append((ctx, cur, end - start))
        return runs

    def _read_run(self, run: tuple, keys: Sequence[str], dsts: Sequence[Parts], out: list[bool]) -> None:
        """Read and check one run: ((key bytes, digests) of the batch, [todo entry], span bytes)."""
        (kbs, digs), items, span = run
        if self._cfg.direct_io:
            self._read_run_direct(items, span, keys, kbs, digs, dsts, out)
        elif len(items) == 1:
            t = items[0]
            out[t[2]] = self._read_one(keys[t[2]], _loc(t, kbs, digs), dsts[t[2]])
        else:
            self._read_run_into(items, keys, kbs, digs, dsts, out)

    def _read_run_direct(self, items: list, span: int, keys: Sequence[str], kbs: list, digs: list,
                         dsts: Sequence[Parts], out: list[bool]) -> None:
        """O_DIRECT: one aligned read of a run's span into this thread's scratch, then each record checked
        and copied out there (a second look, on its own, for any that fails)."""
        start = items[0][1]
        try:
            view, addr = R.read_span_scratch(items[0][5].fd, start, span, True)
        except OSError:
            view = None
        again = []
        for t in items:
            i = t[2]
            if view is not None:
                o = t[1] - start
                if self._settled(self._from_view(view[o:o + t[3]], kbs[i], t[6], dsts[i], addr + o), i, out):
                    continue
            again.append(t)
        for t in again:  # a second look decides: moved, corrupt or an I/O error (the scratch is reused)
            i = t[2]
            out[i] = self._read_one(keys[i], _loc(t, kbs, digs), dsts[i])

    def _read_run_into(self, items: list, keys: Sequence[str], kbs: list, digs: list, dsts: Sequence[Parts],
                       out: list[bool]) -> None:
        """A buffered run in one preadv: headers, keys and gaps into this thread's scratch, each payload
        straight into the caller's parts; then each record checked, a few C calls a record (see
        ``_check_fast``); any that does not pass there is parsed field by field, and one that fails that
        is looked at again on its own."""
        scratch, saddr = R.scratch(_RUN_MAX + _RUN_GAP)
        smv = memoryview(scratch)
        iov: list = []
        add = iov.append
        plan: list = []  # (i, scratch offset of its header, key bytes, seq, payload views or None, entry)
        sp = 0
        first = items[0][1]
        pos = first
        head0 = F.REC_HDR
        typ, typ_len = ctype_of(1), 1  # (the buffer type of the last payload length)
        for t in items:
            o, i, rl, wl = t[1], t[2], t[3], t[4]
            if o > pos:
                add(smv[sp:sp + o - pos])
                sp += o - pos
            kb = kbs[i]
            head = head0 + len(kb)
            views: Optional[list] = None
            if rl == head + wl and wl:
                parts = dsts[i]
                if len(parts) == 1:
                    p = parts[0]
                    if p.is_cpu and p.is_contiguous():
                        if wl != typ_len:
                            typ, typ_len = ctype_of(wl), wl
                        views = [typ.from_address(p.data_ptr())]
                else:
                    views = []
                    for p in parts:
                        b = cbuffer(p)
                        if b is None:
                            views = None
                            break
                        if len(b):
                            views.append(b)
            if views is not None:
                add(smv[sp:sp + head])
                iov += views
                plan.append((i, sp, kb, t[6], views, t))
                sp += head
            else:
                add(smv[sp:sp + rl])
                plan.append((i, sp, kb, t[6], None, t))
                sp += rl
            pos = o + rl
        try:
            got = os.preadv(items[0][5].fd, iov, first)
        except OSError:
            got = -1
        again = []
        if got == pos - first:
            for p_ in self._check_fast(scratch, smv, plan, out):
                i, at, kb, seq, views, t = p_
                if views is None:
                    res = self._from_view(smv[at:at + t[3]], kb, seq, dsts[i], saddr + at)
                else:
                    res = self._head_then(smv[at:at + F.REC_HDR + len(kb)], kb, seq, t[4], views)
                if not self._settled(res, i, out):
                    again.append(t)
        else:
            again = [p_[5] for p_ in plan]
        for t in again:  # a second look decides: moved, corrupt or an I/O error
            i = t[2]
            out[i] = self._read_one(keys[i], _loc(t, kbs, digs), dsts[i])

    def _check_fast(self, scratch, smv: memoryview, plan: list, out: list[bool]) -> list:
        """Check a run's records read into the caller's parts (headers and keys in ``scratch``), a few C
        calls a record: the header's fixed fields and padding against the bytes the index, the region's
        seq and the key say they must be, the full key, the header check (one xxh3 call, over the header
        with its check field zeroed in the scratch, and the key) and the payload sum (one call; records of
        another sum or with other flags are left to ``_head_then``).  Sets ``out`` for the records that
        pass; returns the plan entries of the others (their header as read)."""
        expect = _EXPECT.pack
        sums = _SUMS.unpack_from
        dig = _XXH
        xxh3 = F.xxh3
        magic, version, head = F.RECORD_MAGIC, F.VERSION, F.REC_HDR
        rest = []
        for p in plan:
            _, a, kb, seq, views, _t = p
            if views is not None:
                klen = len(kb)
                end = a + head + klen
                wl = _t[4]
                # (slices of the scratch map are bytes: compared with one memcmp, unlike memoryviews)
                if scratch[a:a + _FIXED] == expect(magic, version, 0, klen, seq, wl, wl) and \
                        scratch[a + _PAD_AT:end] == _PAD + kb:
                    psum, check = sums(scratch, a + _PSUM_AT)
                    scratch[a + F.RECORD_CHECK_AT:a + _PAD_AT] = _ZERO_CHECK
                    if dig(smv[a:end]) == check and (dig(views[0]) if len(views) == 1 else xxh3(views)) == psum:
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
            with self._locks.lock:
                self._counters.collisions += 1
            return True
        return res == _SIZE

    def _head_then(self, head, kb: bytes, seq: int, want: int, views: list) -> int:
        """Check a header read into ``head`` and the payload read into ``views`` (the caller's parts):
        the record of key ``kb`` in a region of ``seq``, ``want`` bytes long."""
        magic, version, flags, klen, rseq, raw_len, stored, psum, check, pad = F.RECORD_STRUCT.unpack_from(head, 0)
        if magic != F.RECORD_MAGIC or version != F.VERSION or klen != len(kb) or pad:
            return _BAD  # (a padded record is never read this way: its length is not header + key + payload)
        h = xxhash.xxh3_64(head[:F.RECORD_CHECK_AT])
        h.update(_ZERO_CHECK)
        h.update(head[F.RECORD_CHECK_AT + 8:])
        if h.intdigest() != check or rseq != seq or flags & (F.FLAG_TOMB | F.FLAG_LZ4):
            return _BAD
        if head[F.REC_HDR:] != kb:
            return _BAD  # (a key of this length but another: a private read tells corrupt from collision)
        if stored != raw_len or raw_len != want:
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
        res = self._from_view(memoryview(loc[7])[off:off + rec_len], kb, loc[6], parts, self._table.image_addr + off)
        if res == _OTHER:
            self._counters.collisions += 1
        elif res == _BAD:  # an image is never torn: memory went bad, or a bug; never serve it
            self._cat.index.remove(d)
            self._cat.retire((r.index, off, rec_len), seq=loc[6])  # (the index changed: the next checkpoint says so)
            _count_lost(self._counters, key)
        return res == _OK

    def _locate(self, kb: bytes):
        """(key bytes, digest, region, offset, rec_len, raw_len, seq, image or None).  Caller holds ``_lock``."""
        d = F.key_digest(kb)
        e = self._cat.index.get(d)
        if e is None:
            return None
        r = self._table.regions[e[0]]
        image = (r is self._table.active and (self._cfg.direct_io or e[1] + e[2] > r.written)
                 and e[1] not in r.direct)  # (see ``_read``)
        return kb, d, r, e[1], e[2], e[3], r.seq, (r.buf if image else None)

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
                self._health.io_error(e, f"reading {key[:16]}")
                return False
            if res == _OK:
                return True
            if res == _OTHER:
                with self._locks.lock:
                    self._counters.collisions += 1
                return False
            if res == _SIZE:
                return False
            with self._locks.lock:
                now = self._locate(loc[0])
                if now is not None and now[7] is not None:  # moved into the active region
                    return self._image_read(key, now, parts)
                if now is not None and now[2:4] == loc[2:4] and now[6] == loc[6]:
                    # still where it was: the bytes there are bad
                    self._cat.index.remove(loc[1])
                    self._cat.retire((loc[2].index, loc[3], loc[4]), seq=loc[6])
                    now = None
                    _count_lost(self._counters, key)
            if now is None or attempt:
                return False
            loc = now
        return False

    def _fetch(self, loc, parts: Parts) -> int:
        kb, _, r, off, rec_len, raw_len, seq, image = loc
        if image is not None:  # moved into the active region since: read the file copy it came from
            return _BAD
        fd = r.fd
        if not self._cfg.direct_io and rec_len == F.record_len(len(kb), raw_len) and raw_len:
            return self._direct_into(fd, off, rec_len, kb, seq, raw_len, parts)
        return self._from_view(R.read_span(fd, off, rec_len, self._cfg.direct_io, scratch=True), kb, seq, parts)

    def _from_view(self, view, kb: bytes, seq: int, parts: Parts, addr: int = 0) -> int:
        """Check the record at the start of ``view`` (header, seq, key, payload sum) and copy its payload
        into ``parts``; ``addr``: the address of ``view``'s first byte, when known (one memmove a part)."""
        if len(view) < F.REC_HDR:
            return _BAD
        magic, version, flags, klen, rseq, raw_len, stored, psum, check, pad = F.RECORD_STRUCT.unpack_from(view, 0)
        key_end = F.REC_HDR + klen
        body_at = key_end + pad
        rec_len = body_at + stored
        if magic != F.RECORD_MAGIC or version != F.VERSION or len(view) < rec_len or pad >= F.BLOCK:
            return _BAD
        h = xxhash.xxh3_64(view[:F.RECORD_CHECK_AT])
        h.update(_ZERO_CHECK)
        h.update(view[F.RECORD_CHECK_AT + 8:key_end])
        if h.intdigest() != check or rseq != seq or flags & F.FLAG_TOMB:
            return _BAD
        if view[F.REC_HDR:key_end] != kb:
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

    # -- large objects (``large.py``) -------------------------------------------------------
    def _read_large(self, items: list, keys: Sequence[str], kbs: list, digs: list, dsts: Sequence[Parts],
                    out: list[bool]) -> None:
        """Each large object's manifest, then all their pieces in one batch, each straight into its part of
        the caller's buffer (its nonce into a scratch beside it).  Served when every piece is there and
        carries the manifest's nonce; a manifest whose pieces are gone or of another put is dropped."""
        geom = self._cfg.geometry()
        reqs: list = []  # (i, table, nonces, manifest's place, first piece's position in the batch)
        pkeys: list[str] = []
        pdsts: list[Parts] = []
        for i, wl in items:
            parts = dsts[i]
            if sum(p.numel() for p in parts) != wl:
                continue
            got = self._manifest(kbs[i], digs[i], geom)
            if got is None:
                continue
            table, place = got
            if table is None:  # one record after all (lz4 made it fit, before large objects existed)
                with self._locks.lock:
                    loc = self._locate(kbs[i])
                out[i] = self._read_one(keys[i], loc, parts)
                continue
            nonces = torch.empty(table.count * L.NONCE, dtype=torch.uint8)
            reqs.append((i, table, nonces, place, len(pkeys)))
            pkeys += L.piece_keys(digs[i], 0, table.count)
            for j in range(table.count):
                lo = j * table.piece
                pdsts.append([nonces[j * L.NONCE:(j + 1) * L.NONCE],
                              *L.slices(parts, lo, min(table.total, lo + table.piece))])
        if not pkeys:
            return
        res = self.read(pkeys, pdsts)
        for i, table, nonces, place, at in reqs:
            got = res[at:at + table.count]
            mine = table.nonce.to_bytes(L.NONCE, "little")
            seen = nonces.numpy().tobytes()
            if all(got) and seen == mine * table.count:
                out[i] = True
                continue
            other = any(ok and seen[j * L.NONCE:(j + 1) * L.NONCE] != mine for j, ok in enumerate(got))
            self._drop_large(digs[i], place, geom, other)

    def _manifest(self, kb: bytes, d: int, geom: L.Geometry):
        """(table, (region, offset, seq)) of the large object of key ``kb``; (None, place) for a record that
        is no manifest; None for a miss (a bad manifest is dropped with its pieces)."""
        for attempt in (0, 1):
            with self._locks.lock:
                loc = self._locate(kb)
                if loc is None:
                    return None
                _, _, r, off, rec_len, raw_len, seq, image = loc
                view: "bytes | memoryview | None" = \
                    bytes(memoryview(image)[off:off + rec_len]) if image is not None else None
            place = (r.index, off, seq)
            if view is None:
                try:
                    view = R.read_span(r.fd, off, rec_len, self._cfg.direct_io)
                except OSError as e:
                    self._health.io_error(e, f"reading the manifest of {kb[:16]!r}")
                    return None
            h = F.parse_record(view, seq)
            if h is not None and h.key != kb:
                with self._locks.lock:
                    self._counters.collisions += 1
                return None
            if h is not None:
                if not h.flags & F.FLAG_LARGE:
                    return None, place
                table = L.parse_table(view[h.body_at:h.rec_len], geom)
                if table is not None and table.total == h.raw_len == raw_len:
                    return table, place
            if attempt:  # bad twice where the index says it is: corrupt
                self._drop_large(d, place, geom, True)
        return None

    def _drop_large(self, d: int, place: tuple, geom: L.Geometry, broken: bool) -> None:
        """A large object that did not read whole: if its manifest is still at ``place`` and it is
        ``broken`` (a bad manifest, a piece of another put) or a piece is gone, the manifest and its pieces
        are dropped (counted ``corrupt``); otherwise (a fault of the moment, or written again meanwhile)
        it was a miss and nothing changes."""
        with self._locks.wlock, self._locks.lock:  # (_wlock: no write of it is half done while this looks)
            e = self._cat.index.get(d)
            if e is None or (e[0], e[1]) != place[:2] or self._table.regions[e[0]].seq != place[2]:
                return
            count = geom.layout(e[3])[0]
            if not broken and all(self._cat.index.find(F.key_digest(k.encode())) >= 0
                                  for k in L.piece_keys(d, 0, count)):
                return
            self._cat.index.remove(d)
            self._cat.retire(e, seq=place[2])
            self._cat.drop_pieces(d, 0, count)
            _count_lost(self._counters, "")

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
        if h is None or h.seq != seq or h.flags & (F.FLAG_TOMB | F.FLAG_LZ4) or h.key != kb or h.pad:
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
            with self._locks.lock:
                self._counters.rereads += 1
            scatter(memoryview(data), parts)
            return _OK
        for p, hp in host:
            p.copy_(hp)
        return _OK
