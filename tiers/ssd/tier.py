"""``SSDTier``: the log-structured engine behind the ``ssd`` medium.

Layout (see ``format.py``): under ``path``, ``LOCK`` (one writer per directory),
``checkpoint`` (the index, checkpointed) and ``regions/rNNNNNN.region``, a few large
preallocated files.  Objects are appended to the active region's in-memory image and
written out in large block-aligned writes (O_DIRECT where the file system allows it);
reads of the active region are served from that image, others are one aligned pread.
A region is reclaimed whole: the emptiest sealed one (the oldest among equals) has its
live objects re-appended, then is reused under a new seq.

Invariants:
    * Exact bytes or a miss.  A read checks the record's header check, seq, full key
      and payload sum; a torn or flipped byte is a miss, counted (``corrupt``), and the
      object is dropped.  Two keys of one digest never serve each other (``collisions``).
    * Capacity.  ``footprint(n)`` bounds what an object takes (record with the longest
      key, 64-byte alignment, its summary entry).  The tier provisions
      ``ceil(capacity / (U - M)) + 2`` regions (``U`` a region's usable bytes, ``M`` the
      largest object slot, ``U // 8``), so whenever live footprints fit ``capacity_bytes``
      the emptiest sealed region holds less than ``U - M`` live bytes, and reclaiming it
      into the spare region always leaves room: a write the store reserved never fails
      for lack of space.  Objects whose slot exceeds ``M`` are refused (``too_large``).
    * Durability.  ``flush()`` writes out the active image, fsyncs, and checkpoints the
      index; after it, everything written survives SIGKILL (and power loss unless
      ``fsync: "never"``).  Every record that stops being an object (removed, replaced,
      moved by reclamation, dropped as corrupt) is named in the dead log (``deadlog.py``),
      which a reopen applies to the checkpoint and the summaries alike: a removed key is
      never resurrected, and of a key re-put only the newest record can win.
    * Reopen reads the checkpoint plus the regions written after it; without a valid
      checkpoint, one read per region (its summary, or for an unsealed region the region
      itself, up to its first bad record).  ``recover()`` lists objects oldest first, and
      drops the oldest when they exceed a smaller ``capacity_bytes``, so the newest stay.
    * A directory in the old one-file-per-object layout is refused with a ``ConfigError``;
      a file the tier cannot interpret is skipped and never written or deleted.
    * Files are 0600 in directories 0700 that this user owns.  A directory removed
      behind the tier's back is recreated when the next region or checkpoint is written.
    * Disk full or any I/O error refuses the write (counted: ``enospc``, ``io_errors``);
      nothing raises into the caller.
Thread safety: ``_wlock`` serialises appends, reclamation and checkpoints; ``_lock``
guards the index and region states, held only briefly, so reads run beside a writer.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional, cast

import numpy as np
import xxhash

from tierkv.errors import ConfigError
from tierkv.options import (
    check_bool,
    check_choice,
    check_int,
    check_str,
    pop_bool,
    pop_choice,
    pop_int,
    pop_size,
    pop_str,
)
from tierkv.units import parse_size

from ..base import Parts, Tier
from . import checkpoint as C
from . import deadlog, recovery
from . import format as F
from . import region as R
from .deadlog import DeadLog
from .format import WRITE_UNIT
from .hostbuf import _host_view, cbuffer, image_address  # noqa: F401  (cbuffer: tests)
from .index import DigestIndex
from .lock import DirLock
from .persist import Persistence
from .readpath import ReadPath
from .reclaim import Reclaim

log = logging.getLogger(__name__)

DEFAULT_REGION = 64 << 20
MIN_REGION = 1 << 20
MAX_REGION = 2 << 30
REGIONS_DIR = "regions"
#: a batch's finished bytes go to the writer thread in pieces of at least this much
PIPE_UNIT = 512 << 10
_COUNTERS = ("io_errors", "corrupt", "enospc", "too_large", "bad_key", "collisions", "rereads", "gc_runs",
             "gc_relocated", "gc_dropped", "checkpoints", "checkpoint_errors", "torn_regions", "skipped_files",
             "trimmed")


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


def footprint_of(nbytes):
    """``footprint`` for an int or a numpy array of sizes."""
    return (F.REC_HDR + F.MAX_KEY + nbytes + F.ALIGN - 1) // F.ALIGN * F.ALIGN + F.ENTRY + F.MAX_KEY


class SSDTier(ReadPath, Reclaim, Persistence, Tier):
    """Chunks in a log of large region files under ``path`` (see the module docstring)."""

    medium = "ssd"
    locality = "disk"
    persistent = True
    managed = True

    def __init__(self, name: str, capacity_bytes: int, path: str, compression: Optional[str] = None,
                 direct_io: Optional[bool] = None, io_threads: Optional[int] = None, fsync: str = "flush",
                 checksum: str = "xxh3", region_size: Any = DEFAULT_REGION) -> None:
        super().__init__(name, capacity_bytes)
        what = f"tier {name!r} (ssd)"
        path = check_str(os.fspath(path) if isinstance(path, os.PathLike) else path, f"{what} option 'path'")
        if compression is not None:
            check_choice(compression, f"{what} option 'compression'", ("lz4", "none"))
        self.compression = "lz4" if compression == "lz4" else None
        if self.compression:
            import lz4.block  # noqa: F401  (fail at config time, not on the hot path)
        self.checksum = check_choice(checksum, f"{what} option 'checksum'", F.CHECKSUMS)
        if checksum == "crc32c" and F.crc32c_sum is None:
            raise ConfigError(f"{what}: checksum 'crc32c' needs the crc32c package")
        self.fsync = check_choice(fsync, f"{what} option 'fsync'", ("flush", "always", "never"))
        if direct_io is not None:
            check_bool(direct_io, f"{what} option 'direct_io'")
        if io_threads is not None:
            io_threads = check_int(io_threads, f"{what} option 'io_threads'", min_value=1, max_value=64)
        rs = parse_size(region_size, f"{what} option 'region_size'")
        if rs % F.BLOCK or not MIN_REGION <= rs <= MAX_REGION:
            raise ConfigError(f"{what} option 'region_size': must be a multiple of 4 KiB between 1 MiB and 2 GiB, "
                              f"got {rs}")
        self.path = os.path.abspath(os.path.expanduser(path))
        self._what = what
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._wlock = threading.Lock()
        self._lock_file: Optional[DirLock] = None
        self._regions: dict[int, R.Region] = {}
        self._active: Optional[R.Region] = None
        self._index = DigestIndex()
        self._live_total = 0
        self._changed = False
        self._covered = 0  # checkpoint covers regions of seq below this
        self._sealed_since_ckpt = 0
        self._next_seq = 1
        self._dirty_fds: set[int] = set()
        self._recovered: Optional[tuple[list[str], list[int]]] = None
        self._spare_image: Optional[mmap.mmap] = None  # the last sealed region's image, reused by the next
        self._image_addrs: dict[int, tuple] = {}  # id(image) -> (address, keeper)
        self._image_addr = 0
        self._prepare_dir()
        check_old_layout(self.path)
        self._lock_file = DirLock(self.path, what)
        try:
            self.direct_io = self._probe_direct(direct_io)
            self.region_size = rs
            self._open()
        except BaseException:
            self._close_fds()
            self._lock_file.release()
            raise
        self._threads = io_threads or min(4, max(2, os.cpu_count() or 2))
        self._pool = ThreadPoolExecutor(max_workers=self._threads, thread_name_prefix=f"tierkv-{name}")
        self._writer: Optional[ThreadPoolExecutor] = None  # write-outs overlapping a batch's copies

    @classmethod
    def from_config(cls, name: str, options: dict[str, Any]) -> "SSDTier":
        capacity = cls.pop_capacity(name, options)
        what = f"tier {name!r} (ssd)"
        path = pop_str(options, "path", None, what)
        if not path:
            raise ConfigError(f"{what}: 'path' is required (a directory tierkv may own)")
        kw = {
            "compression": pop_choice(options, "compression", None, what, ("lz4", "none")),
            "direct_io": pop_bool(options, "direct_io", None, what),
            "io_threads": pop_int(options, "io_threads", None, what, min_value=1, max_value=64),
            "fsync": pop_choice(options, "fsync", "flush", what, ("flush", "always", "never")),
            "checksum": pop_choice(options, "checksum", "xxh3", what, F.CHECKSUMS),
            "region_size": pop_size(options, "region_size", DEFAULT_REGION, what),
        }
        cls.reject_unknown(name, options)
        return cls(name, capacity, path, **kw)

    # -- geometry ----------------------------------------------------------------------
    @property
    def usable(self) -> int:
        return self.region_size - 2 * F.BLOCK - F.FOOTER

    @property
    def max_slot(self) -> int:
        return self.usable // 8

    def regions_needed(self) -> int:
        per = self.usable - self.max_slot
        return -(-self.capacity_bytes // per) + 2

    def footprint(self, nbytes: int) -> int:
        return int(footprint_of(int(nbytes)))

    # -- directory -------------------------------------------------------------------------
    def _prepare_dir(self) -> None:
        try:
            os.makedirs(self.path, mode=0o700, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"{self._what}: cannot create directory {self.path}: {e}") from e
        st = os.stat(self.path)
        if st.st_uid != os.geteuid():
            raise ConfigError(f"{self._what}: directory {self.path} is owned by uid {st.st_uid}, not us")
        if st.st_mode & 0o077:
            os.chmod(self.path, 0o700)

    @property
    def regions_dir(self) -> str:
        return os.path.join(self.path, REGIONS_DIR)

    def _ensure_dirs(self) -> None:
        os.makedirs(self.regions_dir, mode=0o700, exist_ok=True)

    def _probe_direct(self, want: Optional[bool]) -> bool:
        if want is False:
            return False
        probe = os.path.join(self.path, ".probe-direct")
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
            raise ConfigError(f"{self._what}: direct_io is not supported on {self.path}: {err}")
        return ok

    # -- open and recover ---------------------------------------------------------------
    def _open(self) -> None:
        self._ensure_dirs()
        headers = {}
        for name in sorted(os.listdir(self.regions_dir)):
            idx = R.parse_region_name(name)
            if idx is None:
                continue
            r = R.Region(idx, os.path.join(self.regions_dir, name))
            try:
                r.fd = R.open_fd(r.path, self.direct_io)
                r.ino = os.fstat(r.fd).st_ino
            except OSError as e:
                log.warning("%s: cannot open %s: %s; skipped", self._what, r.path, e)
                r.foreign = True
                self._counters["skipped_files"] += 1
                self._regions[idx] = r
                continue
            h, ours = R.read_header(r.fd, self.direct_io)
            if h is None and not ours:
                r.foreign = True  # not a region of ours: never reused, never deleted
                self._counters["skipped_files"] += 1
            elif h is not None and h.index != idx:
                r.foreign = True
                self._counters["skipped_files"] += 1
            headers[idx] = h
            self._regions[idx] = r
        sizes = [h.region_size for h in headers.values() if h is not None]
        if sizes:
            stored = max(set(sizes), key=sizes.count)
            if stored != self.region_size:
                log.info("%s: %s keeps regions of %d bytes; region_size %d applies to a new directory only",
                         self._what, self.path, stored, self.region_size)
            self.region_size = stored
        valid = {}
        for idx, h in headers.items():
            r = self._regions[idx]
            if h is None or r.foreign:
                continue
            if h.region_size != self.region_size:
                r.foreign = True
                self._counters["skipped_files"] += 1
                continue
            r.seq = h.seq
            r.state = R.SEALED
            valid[idx] = r
        ckpt = C.read(self.path)
        if ckpt is not None and ckpt.region_size != self.region_size:
            ckpt = None
        self._dead = DeadLog(self.path)
        loaded = recovery.load(self.path, valid, self.region_size, self.direct_io, ckpt, deadlog.read(self.path))
        self._counters["torn_regions"] = loaded.torn
        self.recovered_from = loaded.source if valid else "empty"
        seqs = [r.seq for r in valid.values()]
        self._next_seq = max([*seqs, ckpt.covered_seq if ckpt is not None else 0]) + 1
        c = loaded.cands
        # a smaller capacity keeps the newest that fit
        fps = footprint_of(c.raw_len)
        keep_from_end = np.cumsum(fps[::-1])[::-1] <= self.capacity_bytes if len(fps) else np.zeros(0, bool)
        dropped = recovery.take(c, np.flatnonzero(~keep_from_end))
        c = recovery.take(c, np.flatnonzero(keep_from_end))
        self._index.bulk_load(c.digest, c.region.astype(np.uint32), c.offset.astype(np.uint32),
                              c.rec_len.astype(np.uint32), c.raw_len.astype(np.uint32))
        for idx, r in valid.items():  # noqa: B007 - the name documents the loop
            r.state = R.FREE
        if len(c.digest):
            meas = ((c.rec_len + F.ALIGN - 1) // F.ALIGN * F.ALIGN + F.ENTRY + F.MAX_KEY)
            nreg = int(c.region.max()) + 1
            live = np.bincount(c.region, weights=meas, minlength=nreg)
            cnt = np.bincount(c.region, minlength=nreg)
            for idx in np.flatnonzero(cnt).tolist():
                r = self._regions[idx]
                r.state, r.live_bytes, r.live_count = R.SEALED, int(live[idx]), int(cnt[idx])
            self._live_total = int(meas.sum())
        self._covered = ckpt.covered_seq if ckpt is not None else 0
        for idx, sc in loaded.scanned.items():  # seal what an earlier process left unsealed
            self._seal_scanned(valid[idx], sc)
        self._recovered = (recovery.key_list(c), c.raw_len.tolist())
        if len(dropped.digest):
            self._counters["trimmed"] = len(dropped.digest)
            for rg, off, sq in zip(dropped.region.tolist(), dropped.offset.tolist(), dropped.seq.tolist()):
                self._dead.add(rg, off, sq)
        if any(valid[i].seq >= self._covered for i in loaded.read_regions) or len(dropped.digest):
            with self._wlock:  # the keys are at hand: the checkpoint needs no summary read
                self._flush_locked(checkpoint=False)
                self._checkpoint(c)

    def _seal_scanned(self, r: R.Region, sc: recovery.Scanned) -> None:
        count = len(sc.entries)
        if count == 0:
            return
        if F.summary_start(self.region_size, count, len(sc.keys)) < F.align_up(sc.end, F.ALIGN):
            return  # no room for a summary: it stays unsealed and is scanned again next time
        img = F.aligned_buffer(self.region_size)
        start = F.pack_summary(img, self.region_size, r.seq, sc.entries.tobytes(), sc.keys, count)
        try:
            R.pwrite_all(r.fd, memoryview(img)[start:self.region_size], start)
            self._dirty_fds.add(r.fd)
            r.sum_start = start
        except OSError as e:
            self._io_error(e, f"sealing {r.path}")

    def recover(self) -> list[tuple[str, int]]:
        """(key, nbytes) of the objects found on open, oldest first (within ``capacity_bytes``)."""
        if self._recovered is not None:
            import gc

            keys, sizes = self._recovered
            self._recovered = None  # the tier keeps no key strings once the store has them
            gc_was = gc.isenabled()
            gc.disable()  # (a million tuples: see recovery.key_list)
            try:
                return list(zip(keys, sizes))
            finally:
                if gc_was:
                    gc.enable()
        with self._wlock:
            c = self._gather()
        c = recovery.take(c, np.lexsort((c.offset, c.seq)))
        return list(zip(recovery.key_list(c), c.raw_len.tolist()))

    # -- writes ---------------------------------------------------------------------------
    def _write(self, keys: Sequence[str], srcs: Sequence[Parts]) -> list[bool]:
        with self._wlock:
            out, one_by_one = self._append_batch(keys, srcs)
            r = self._active
            if r is not None:
                if self.fsync == "always":
                    self._flush_locked(checkpoint=False)
                elif one_by_one and r.pos > r.written:  # (the others reached the file when committed)
                    self._write_out(r, F.align_up(r.pos), r.pos)
        return out

    def _append_batch(self, keys: Sequence[str], srcs: Sequence[Parts]) -> tuple[list[bool], bool]:
        """Append a batch: host objects are copied into the active image one after another (each
        finished stretch of ``PIPE_UNIT`` or more written out by the writer thread while the next is
        copied) and committed per region in one go: the batch's bytes reach the file, then its
        digests enter the index together.  Compressed or device objects take ``_put_one``.
        Returns the results and whether any object took ``_put_one``."""
        out = [False] * len(keys)
        one_by_one = False
        seg = _Segment()
        flags = F.FLAG_CRC32C if self.checksum == "crc32c" else 0
        psum_of = F.sum_function(flags)
        max_slot = self.max_slot
        region_size = self.region_size
        hdr = F.RECORD_STRUCT.pack_into
        chk = F.CHECK_STRUCT.pack_into
        digest_of = xxhash.xxh3_64_intdigest
        memmove = ctypes.memmove
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
            if klen > F.MAX_KEY:
                self._count("bad_key")
                continue
            raw_len = 0
            host = not self.compression
            for p in parts:
                raw_len += p.numel()
                if host and not (p.is_cpu and p.is_contiguous()):
                    host = False
            if not host:
                self._commit(seg, out)
                out[i] = self._put_one(key, parts)
                one_by_one = True
                r = self._active
                if r is not None:
                    buf, mv, base = r.buf, memoryview(cast("mmap.mmap", r.buf)), self._image_addr
                continue
            rec_len = F.REC_HDR + klen + raw_len
            if ((rec_len + F.ALIGN - 1) & -F.ALIGN) + F.ENTRY + F.MAX_KEY > max_slot or raw_len >= 1 << 32:
                self._count("too_large")  # (``F.measure``)
                continue
            pos = seg.end if seg.n else (r.pos if r is not None else 0)
            end = (pos + rec_len + F.ALIGN - 1) & -F.ALIGN
            if r is None or F.summary_start(region_size, r.count + seg.n + 1,
                                            len(r.keys) + seg.key_bytes + klen) < end:  # type: ignore[arg-type]  # (set while ACTIVE)
                self._commit(seg, out)
                r = self._room(rec_len, klen)
                if r is None:
                    continue
                buf, mv, base = r.buf, memoryview(cast("mmap.mmap", r.buf)), self._image_addr
                pos = r.pos
                end = (pos + rec_len + F.ALIGN - 1) & -F.ALIGN
            if not seg.n:
                seg.begin(r, pos)
            at = pos + F.REC_HDR + klen
            dst = base + at
            for p in parts:
                n = p.numel()
                if n:
                    memmove(dst, p.data_ptr(), n)
                    dst += n
            psum = psum_of(mv[at:at + raw_len])
            hdr(buf, pos, F.RECORD_MAGIC, F.VERSION, flags, klen, r.seq, raw_len, raw_len, psum, 0)
            mv[pos + F.REC_HDR:at] = kb
            chk(buf, pos + F.RECORD_CHECK_AT, digest_of(mv[pos:at]))
            seg.add(i, F.key_digest(kb), pos, rec_len, raw_len, kb, flags, end)
            if end - seg.submitted >= PIPE_UNIT and i + 1 < len(keys):  # (the last piece: written by the commit)
                seg.submit(self._writer_pool(), r, F.align_down(end))
        self._commit(seg, out)
        return out, one_by_one

    def _writer_pool(self) -> ThreadPoolExecutor:
        w = self._writer
        if w is None:
            w = self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"tierkv-{self.name}-w")
        return w

    def _commit(self, seg: "_Segment", out: list[bool]) -> None:
        """Write out the segment's bytes, then index its records; on an I/O error none of them is indexed
        (``out`` stays False for them, and the next records overwrite their bytes)."""
        if not seg.n:
            return
        r = cast(R.Region, seg.region)
        ok = seg.wait(self)
        if ok:
            r.written = max(r.written, seg.written)
            ok = self._write_out(r, F.align_up(seg.end), seg.end)
        if not ok:
            r.written = min(r.written, F.align_down(seg.start))
            seg.reset()
            return
        n = seg.n
        meas = seg.measured
        with self._lock:
            olds = self._index.put_many(seg.digests, r.index, seg.offsets, seg.rec_lens, seg.raw_lens)
            r.live_bytes += meas
            r.live_count += n
            self._live_total += meas
            for o_r, o_off, o_rec in olds:
                self._unlive(o_r, o_rec)  # the older version is dead: it must never come back
                self._dead.add(o_r, o_off, self._regions[o_r].seq)
            r.pos = seg.end
            self._changed = True
        cast(bytearray, r.entries).extend(b"".join(seg.entries))
        cast(bytearray, r.keys).extend(b"".join(seg.keys))
        r.count += n
        for i in seg.idx:
            out[i] = True
        seg.reset()

    def _put_one(self, key: str, parts: Parts) -> bool:
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
        if None in hosts or self.compression:
            payload = [_host_view(p) for p in parts if p.numel()]
            direct = None
        else:
            payload = direct = cast("list[Any]", hosts)
        if self.compression and raw_len:
            import lz4.block

            packed = lz4.block.compress(payload[0] if len(payload) == 1 else b"".join(payload), store_size=False)
            if len(packed) < raw_len:
                payload, flags = [memoryview(packed)], flags | F.FLAG_LZ4
        stored = raw_len if direct is not None else sum(len(v) for v in payload)
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

    def _unlive(self, idx: int, rec_len: int) -> None:
        """An object left region ``idx``.  Caller holds ``_lock``."""
        o = self._regions[idx]
        m = F.measure(rec_len)
        o.live_bytes -= m
        o.live_count -= 1
        self._live_total -= m

    def _write_out(self, r: R.Region, end: int, data_end: int) -> bool:
        """Write the active image from ``r.written`` up to ``end`` (block aligned); its bytes end at
        ``data_end`` (a partial last block is written again next time)."""
        if end <= r.written:
            return True
        buf = cast("mmap.mmap", r.buf)  # (the active image)
        if end > data_end:  # the tail of a partial block: zeros, not an earlier region's bytes
            memoryview(buf)[data_end:end] = bytes(end - data_end)
        try:
            R.pwrite_all(r.fd, memoryview(buf)[r.written:end], r.written)
        except OSError as e:
            self._io_error(e, f"writing {r.path}")
            return False
        self._dirty_fds.add(r.fd)
        r.written = min(end, F.align_down(data_end))
        return True

    def _io_error(self, e: OSError, what: str) -> None:
        self._count("enospc" if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) else "io_errors")
        log.warning("%s: %s failed: %s", self._what, what, e)

    def _room(self, rec_len: int, key_len: int) -> Optional[R.Region]:
        """The active region with room for a record, sealing and reclaiming as needed; None if impossible."""
        r = self._active
        if r is not None and r.fits(rec_len, key_len, self.region_size):
            return r
        try:
            r = self._rotate()
        except OSError as e:
            self._io_error(e, "starting a region")
            return None
        if r is None or not r.fits(rec_len, key_len, self.region_size):
            self._count("enospc")
            return None
        return r

    def _free_regions(self) -> list[int]:
        """Indices usable for a new region: free files first, then files not yet created."""
        free = [i for i, r in sorted(self._regions.items()) if r.state == R.FREE and not r.foreign]
        usable = sum(1 for r in self._regions.values() if not r.foreign)
        i = 0
        while usable < self.regions_needed():
            while i in self._regions:
                i += 1
            free.append(i)
            usable += 1
            i += 1
        return free

    def _rotate(self) -> Optional[R.Region]:
        if self._active is not None:
            self._seal(self._active)
        free = self._free_regions()
        if not free:
            return None
        victim = None
        if len(free) == 1:  # the spare: refill it with the emptiest region's live objects
            victim = self._pick_victim()
        new = self._begin(free[0])
        if victim is not None:
            self._reclaim(victim, new)
        if self._sealed_since_ckpt >= max(8, len(self._regions) // 2):
            self._checkpoint(durable=self.fsync == "always")
        return new

    def _begin(self, idx: int) -> R.Region:
        r = self._regions.get(idx)
        if r is None:
            r = R.Region(idx, os.path.join(self.regions_dir, R.region_name(idx)))
        fresh = r.fd < 0
        if not fresh:
            try:
                fresh = os.stat(r.path).st_ino != r.ino  # removed behind our back
            except OSError:
                fresh = True
        if fresh:
            self._ensure_dirs()
            fd = R.open_fd(r.path, self.direct_io, create=True)
            try:
                R.preallocate(fd, self.region_size)
            except OSError:
                os.close(fd)
                raise
            if r.fd >= 0:
                self._close_region_fd(r)
            r.fd, r.ino = fd, os.fstat(fd).st_ino
        image, self._spare_image = self._spare_image, None
        if image is None:
            image = F.aligned_buffer(self.region_size, populate=True)
            self._image_addrs[id(image)] = image_address(image)
        self._image_addr = self._image_addrs[id(image)][0]
        r.start(self._next_seq, self.region_size, image)
        # the new seq reaches the disk before anything refers to it
        R.pwrite_all(r.fd, memoryview(cast("mmap.mmap", r.buf))[:F.BLOCK], 0)
        r.written = F.BLOCK
        self._dirty_fds.add(r.fd)
        self._next_seq += 1
        with self._lock:
            self._regions[idx] = r
            self._active = r
        return r

    def _seal(self, r: R.Region) -> None:
        """Write the rest of the active image and its summary; raises OSError (the region stays active)."""
        buf = cast("mmap.mmap", r.buf)  # (set while ACTIVE, as are entries and keys)
        start = F.pack_summary(buf, self.region_size, r.seq, bytes(cast(bytearray, r.entries)),
                               bytes(cast(bytearray, r.keys)), r.count)
        mv = memoryview(buf)
        mv[r.pos:F.align_up(r.pos)] = bytes(F.align_up(r.pos) - r.pos)  # (a reused image holds old bytes)
        if F.align_up(r.pos) > r.written:
            R.pwrite_all(r.fd, mv[r.written:F.align_up(r.pos)], r.written)
        R.pwrite_all(r.fd, mv[start:self.region_size], start)
        self._dirty_fds.add(r.fd)
        with self._lock:  # readers copy from the image under this lock: none is using it now
            r.sum_start = start
            r.state = R.SEALED
            self._spare_image, r.buf = r.buf, None
            r.entries = r.keys = None
            self._active = None
            self._changed = True
        self._sealed_since_ckpt += 1

    # -- deletes ----------------------------------------------------------------------------
    def _delete(self, keys: Sequence[str]) -> None:
        with self._wlock, self._lock:  # (_wlock: reclamation may be moving these very objects)
            for key in keys:
                old = self._index.remove(F.key_digest(key.encode()))
                if old is not None:
                    self._unlive(old[0], old[2])
                    self._dead.add(old[0], old[1], self._regions[old[0]].seq)
                    self._changed = True

    def _contains(self, keys: Sequence[str]) -> list[bool]:
        with self._lock:
            return [self._index.find(F.key_digest(k.encode())) >= 0 for k in keys]


class _Segment:
    """Records of one batch appended to the active image but not yet written out and indexed."""

    __slots__ = ("digests", "end", "entries", "futures", "idx", "key_bytes", "keys", "measured", "n", "offsets", "raw_lens",
                 "rec_lens", "region", "start", "submitted", "written")

    def __init__(self) -> None:
        self.region: Optional[R.Region] = None
        self.futures: list = []
        self.reset()

    def reset(self) -> None:
        self.idx: list[int] = []
        self.digests: list[int] = []
        self.offsets: list[int] = []
        self.rec_lens: list[int] = []
        self.raw_lens: list[int] = []
        self.entries: list[bytes] = []
        self.keys: list[bytes] = []
        self.n = self.key_bytes = self.end = self.start = self.measured = 0
        self.submitted = self.written = 0
        self.region = None
        self.futures = []

    def begin(self, r: R.Region, pos: int) -> None:
        self.region, self.start = r, pos
        self.submitted = self.written = r.written

    def add(self, i: int, d: int, pos: int, rec_len: int, raw_len: int, kb: bytes, flags: int, end: int) -> None:
        self.idx.append(i)
        self.digests.append(d)
        self.offsets.append(pos)
        self.rec_lens.append(rec_len)
        self.raw_lens.append(raw_len)
        self.entries.append(F.pack_entry(d, pos, rec_len, raw_len, len(kb), flags))
        self.keys.append(kb)
        self.key_bytes += len(kb)
        self.measured += end - pos + F.ENTRY + F.MAX_KEY  # (``F.measure``: ``end`` is the aligned end)
        self.n += 1
        self.end = end

    def submit(self, pool: ThreadPoolExecutor, r: R.Region, upto: int) -> None:
        """Write ``[submitted, upto)`` of the image on the writer thread while the caller copies on."""
        start = self.submitted
        if upto <= start:
            return
        view = memoryview(cast("mmap.mmap", r.buf))[start:upto]
        self.futures.append(pool.submit(R.pwrite_all, r.fd, view, start))
        self.submitted = self.written = upto

    def wait(self, tier: "SSDTier") -> bool:
        """Wait for the submitted writes; False (counted) if any failed."""
        ok = True
        for f in self.futures:
            try:
                f.result()
            except OSError as e:
                tier._io_error(e, f"writing {cast(R.Region, self.region).path}")
                ok = False
        if self.futures and ok:
            tier._dirty_fds.add(cast(R.Region, self.region).fd)
        self.futures = []
        return ok
