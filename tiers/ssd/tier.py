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
      for lack of space.  An object too large for one slot is stored as pieces of at most
      one slot each and a manifest (``large.py``), its footprint theirs; only an object
      larger than the whole tier is refused (``too_large``, logged).
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
      a file the tier cannot interpret is skipped and never written or deleted (but a region
      file never begun, empty or zeros where its header belongs, is removed at open); a broken
      layout or a directory it cannot write is a ``ConfigError`` naming the path.
    * Files are 0600 in directories 0700 that this user owns.  Files removed behind the tier's
      back (the directory, ``regions``, a region file, ``LOCK``) are found after each write, at
      region changes and at flush: what was acknowledged since the last flush is recreated from the
      removed files, still open; the other removed regions' objects are dropped and counted
      (``dir_removed``, ``objects_lost``); the lock is taken again (``lock.py``).
    * Disk full or any I/O error refuses the write (counted: ``enospc``, ``io_errors``);
      nothing raises into the caller.  A full file system is lived with: the tier keeps the last
      file it can create to reclaim into, else compacts a region within its own file
      (``regionchange.py``), so writes get in again once objects are removed.
Thread safety: ``_wlock`` serialises appends, reclamation and checkpoints; ``_lock``
guards the index and region states, held only briefly, so reads run beside a writer.

The write path is in ``writepath.py`` (a batch on its way to the file: ``segment.py``), region
changes in ``regionchange.py``, the read path in ``readpath.py``, reclamation in ``reclaim.py``,
flush / checkpoint / close in ``persist.py``; this module opens a directory.
"""

from __future__ import annotations

import logging
import mmap
import os
import stat
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

import numpy as np

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

from ..base import Locality, Tier
from . import checkpoint as C
from . import deadlog, recovery
from . import format as F
from . import large as L
from . import region as R
from .deadlog import DeadLog
from .index import DigestIndex
from .lock import LOCK_NAME, DirLock
from .persist import Persistence
from .readpath import ReadPath
from .reclaim import Reclaim
from .regionchange import RegionChange
from .writepath import PIPE_UNIT, WritePath  # noqa: F401  (PIPE_UNIT: tests)

log = logging.getLogger(__name__)

DEFAULT_REGION = 64 << 20
MIN_REGION = 1 << 20
MAX_REGION = 2 << 30
REGIONS_DIR = "regions"
_COUNTERS = ("io_errors", "corrupt", "enospc", "too_large", "bad_key", "collisions", "rereads", "gc_runs",
             "gc_relocated", "gc_dropped", "gc_disk_full", "gc_in_place", "checkpoints", "checkpoint_errors",
             "torn_regions", "skipped_files", "partial_files_removed", "dir_removed", "objects_lost", "lock_lost",
             "trimmed", "direct_writes", "summaries_rebuilt", "regions_removed")
#: a lack of room is logged at most once in this many seconds (every one is counted: ``enospc``)
NO_SPACE_LOG_EVERY = 10.0
#: room a full file system keeps beyond a checkpoint's and the dead log's (see ``_space_reserve``)
SPACE_SLACK = 256 << 10


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
    """What one record of ``nbytes`` takes at most (an int or a numpy array of them): ``large.record_footprint``."""
    return L.record_footprint(nbytes)


class SSDTier(WritePath, RegionChange, ReadPath, Reclaim, Persistence, Tier):
    """Chunks in a log of large region files under ``path`` (see the module docstring)."""

    medium = "ssd"
    locality = Locality.DISK
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
        self._no_space_logged = -NO_SPACE_LOG_EVERY  # (monotonic time of the last line about it)
        self._no_space_unlogged = 0
        self._wlock = threading.Lock()
        self._lock_file: Optional[DirLock] = None
        self._regions: dict[int, R.Region] = {}
        self._active: Optional[R.Region] = None
        self._index = DigestIndex()
        self._live_total = 0
        self._changed = False
        self._covered = 0  # checkpoint covers regions of seq below this
        self._sealed_since_ckpt = 0
        self._ckpt_unsynced = False  # the checkpoint file was written without fsync (see ``_checkpoint``)
        self._next_seq = 1
        self._dirty_fds: set[int] = set()
        self._recovered: Optional[recovery.Candidates] = None  # what the open found, until recover()
        self._spare_image: Optional[mmap.mmap] = None  # the last sealed region's image, reused by the next
        self._image_addrs: dict[int, tuple] = {}  # id(image) -> (address, keeper)
        self._image_addr = 0
        self._writer: Optional[ThreadPoolExecutor] = None  # write-outs overlapping a batch's copies
        self._seals: list = []  # summaries being written behind a seal (``RegionChange._seal``)
        self._dir_id = (0, 0, 0)  # (set by ``_open``: see ``Persistence._check_removed``)
        self._rebuilding = False
        self._has_large = False  # a large object was stored or found (``large.py``): writes look for them
        self._too_large_quiet = 0.0
        self._prepare_dir()
        check_old_layout(self.path)
        self._check_layout()
        self._lock_file = DirLock(self.path, what)
        try:
            self.direct_io = self._probe_direct(direct_io)
            self.region_size = rs
            try:
                self._open()
            except OSError as e:  # (a read-only volume, a file where a directory belongs, ...)
                raise ConfigError(f"{what}: cannot open {e.filename or self.path}: {e.strerror or e}") from e
        except BaseException:
            self._close_fds()
            self._lock_file.release()
            raise
        self._lock_file.watch()
        self._threads = io_threads or min(4, max(2, os.cpu_count() or 2))
        self._pool = ThreadPoolExecutor(max_workers=self._threads, thread_name_prefix=f"tierkv-{name}")

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

    def _geometry(self) -> L.Geometry:
        """The size rule of this directory's region size (``large.py``)."""
        g = self.__dict__.get("_geom")
        rs = self.__dict__.get("region_size", DEFAULT_REGION)
        if g is None or g.region_size != rs:
            if not isinstance(rs, int):  # (the simulator's footprint probe holds the option as configured)
                rs = parse_size(rs, "region_size")
            g = self._geom = L.Geometry.of(rs)
        return g

    def footprint(self, nbytes: int) -> int:
        """One record's bound, or for an object too large for one (more than ``_geometry().single`` bytes)
        the sum of its pieces' and its manifest's (``large.py``)."""
        return int(self._geometry().footprint(int(nbytes)))

    # -- directory -------------------------------------------------------------------------
    def _prepare_dir(self) -> None:
        try:
            os.makedirs(self.path, mode=0o700, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"{self._what}: cannot create directory {self.path}: {e}") from e
        st = os.stat(self.path)
        if st.st_uid != os.geteuid():
            raise ConfigError(f"{self._what}: directory {self.path} is owned by uid {st.st_uid}, not us")
        if not stat.S_ISDIR(st.st_mode):
            raise ConfigError(f"{self._what}: {self.path} is not a directory")
        if st.st_mode & 0o077:
            try:
                os.chmod(self.path, 0o700)
            except OSError as e:
                raise ConfigError(f"{self._what}: cannot make {self.path} private (0700): {e.strerror or e}") from e

    def _check_layout(self) -> None:
        """A ``ConfigError`` naming the path if something of the layout is of the wrong kind."""
        for name, want_dir in ((REGIONS_DIR, True), (LOCK_NAME, False), (C.NAME, False), (deadlog.NAME, False)):
            p = os.path.join(self.path, name)
            try:
                st = os.stat(p)
            except FileNotFoundError:
                continue
            except OSError as e:
                raise ConfigError(f"{self._what}: cannot use {p}: {e.strerror or e}") from e
            if want_dir and not stat.S_ISDIR(st.st_mode):
                raise ConfigError(f"{self._what}: {p} is not a directory (the tier keeps its region files there); "
                                  "move it away or give the tier another directory")
            if not want_dir and not stat.S_ISREG(st.st_mode):
                raise ConfigError(f"{self._what}: {p} is not a regular file (the tier keeps its {name} file "
                                  "there); move it away or give the tier another directory")

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
        self._dir_id = self._dir_ids()
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
            if h is None and not ours and R.never_begun(r.fd, self.direct_io):
                # a region file whose creation failed (a full disk) or was cut short: no header, nothing in it
                os.close(r.fd)
                try:
                    os.unlink(r.path)
                    self._counters["partial_files_removed"] += 1
                    log.info("%s: removed %s, a region file never begun (no header, no data)", self._what, r.path)
                except OSError as e:
                    log.warning("%s: cannot remove %s, a region file never begun: %s", self._what, r.path, e)
                continue
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
        self._dead.reserve()  # (removals are recorded even once the file system is full)
        dead = deadlog.read(self.path)
        loaded = recovery.load(self.path, valid, self.region_size, self.direct_io, ckpt, dead)
        self._counters["torn_regions"] = loaded.torn
        self.recovered_from = loaded.source if valid else "empty"
        # above every seq ever handed out: the regions' headers, the checkpoint's, the dead log's marks (a
        # region file lost or damaged since took its seq with it, and the dead log may name its records)
        seqs = [h.seq for h in headers.values() if h is not None]
        if ckpt is not None:
            seqs += [ckpt.covered_seq, int(ckpt.region_seqs.max()) if len(ckpt.region_seqs) else 0]
        self._next_seq = max([*seqs, deadlog.high_water(dead)], default=0) + 1
        c = loaded.cands
        geom = self._geometry()
        # pieces no manifest claims (a process killed before the manifest was written) go (``large.py``)
        keep = ~L.orphans(c.digest, c.raw_len, c.key_start, c.key_len, c.keys, geom)
        pieces = L.piece_mask(c.key_len, c.key_start, c.keys)
        # a smaller capacity keeps the newest that fit (a large object's footprint is its manifest's)
        fps = np.where(pieces, 0, geom.footprint(c.raw_len))
        if int(fps[keep].sum()) > self.capacity_bytes:
            keep &= (np.cumsum(np.where(keep, fps, 0)[::-1])[::-1] <= self.capacity_bytes) | pieces
            keep &= ~L.orphans(c.digest, c.raw_len, c.key_start, c.key_len, c.keys, geom, alive=keep)
        if keep.all():  # (nothing to select)
            dropped = recovery.take(c, np.zeros(0, dtype=np.int64))
        else:
            dropped = recovery.take(c, np.flatnonzero(~keep))
            c = recovery.take(c, np.flatnonzero(keep))
        self._has_large = bool(len(c.raw_len)) and bool((c.raw_len > geom.single).any())
        if (ckpt is not None and ckpt.table is not None and not loaded.read_regions and not len(dropped.digest)
                and len(c.digest) == len(ckpt.cols["digest"]) == ckpt.table[0]):
            self._index.load_table(ckpt.table)  # every object the checkpoint lists is current: its index as is
        else:
            self._index.bulk_load(c.digest, c.region, c.offset, c.rec_len, c.raw_len)  # (stored as uint32 there)
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
        if len(dropped.digest):
            self._counters["trimmed"] = len(dropped.digest)
            for rg, off, sq in zip(dropped.region.tolist(), dropped.offset.tolist(), dropped.seq.tolist()):
                self._dead.add(rg, off, sq)
        resume = self._to_resume(valid, loaded.scanned, dead)
        for idx, sc in loaded.scanned.items():  # seal what an earlier process left unsealed
            if idx != resume:
                self._seal_scanned(valid[idx], sc)
        moved = 0
        with self._wlock:
            if resume is not None:
                sc = loaded.scanned[resume]
                try:
                    self._resume(valid[resume], sc.end, sc.entries.tobytes(), sc.keys)
                except OSError as e:
                    self._io_error(e, f"reopening {valid[resume].path}")
                    self._seal_scanned(valid[resume], sc)
            gc_before = self._counters["gc_runs"]
            lost = self._settle()  # never every region holding objects
            moved = self._counters["gc_runs"] - gc_before
            self._remove_surplus()  # never more region files than the capacity provisions
        if lost:
            c = recovery.take(c, np.flatnonzero(self._index.find_many(c.digest) >= 0))
        self._recovered = c  # (its key strings are made by recover(), in the pass that pairs them with sizes)
        if (any(valid[i].seq >= self._covered for i in loaded.read_regions) or len(dropped.digest) or lost
                or moved or resume is not None or self._counters["regions_removed"]):
            with self._wlock:  # the keys are at hand unless objects moved: then the summaries say where
                self._flush_locked(checkpoint=False)
                self._checkpoint(None if moved or resume is not None else c)

    def _to_resume(self, valid: dict, scanned: dict, dead: np.ndarray) -> Optional[int]:
        """The region to fill on at open, if one must be: when every region holds live objects (no free
        one, none left to create), the newest if it is unsealed, has room and no dead-log entry names an
        offset at or after its last good record (those offsets will hold new records)."""
        need = self.regions_needed()
        mine = [r for r in self._regions.values() if not r.foreign]
        free = sum(1 for r in mine if r.live_count == 0) + max(0, need - len(mine))
        if free or not valid:
            return None
        newest = max(valid.values(), key=lambda r: r.seq)
        sc = scanned.get(newest.index)
        if sc is None or sc.end + (64 << 10) > F.summary_start(self.region_size, len(sc.entries), len(sc.keys)):
            return None
        return None if deadlog.names_from(dead, newest.index, newest.seq, sc.end) else newest.index

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
        return recovery.listing(self._objects_found())

    def recover_columns(self) -> tuple[list[str], np.ndarray]:
        """``recover`` as (keys, nbytes as an int64 array), oldest first, made without a pair per object."""
        c = self._objects_found()
        return recovery.key_list(c), c.raw_len.astype(np.int64, copy=False)

    def _objects_found(self) -> recovery.Candidates:
        """The objects ``recover`` lists, oldest first: a large object once, as its manifest (its pieces are
        no objects of their own, ``large.py``)."""
        if self._recovered is not None:
            c, self._recovered = self._recovered, None  # the tier keeps no keys once the store has them
        else:
            with self._wlock:
                c = self._gather()
            c = recovery.take(c, np.lexsort((c.offset, c.seq)))
        pieces = L.piece_mask(c.key_len, c.key_start, c.keys)
        return recovery.take(c, np.flatnonzero(~pieces)) if pieces.any() else c

    # -- bookkeeping --------------------------------------------------------------------------
    def _unlive(self, idx: int, rec_len: int) -> None:
        """An object left region ``idx``.  Caller holds ``_lock``."""
        o = self._regions[idx]
        m = F.measure(rec_len)
        o.live_bytes -= m
        o.live_count -= 1
        self._live_total -= m

    def _io_error(self, e: OSError, what: str) -> None:
        if R.no_space(e):
            self._no_space(f"{what} failed: {e}")
            return
        self._count("io_errors")
        log.warning("%s: %s failed: %s", self._what, what, e)

    def _no_space(self, what: str) -> None:
        """Count a lack of room (``enospc``: a refused write, or the file system's ENOSPC, EDQUOT or EFBIG)
        and log it, at most once every ``NO_SPACE_LOG_EVERY`` seconds (with how many since the last line)."""
        now = time.monotonic()
        with self._lock:
            self._counters["enospc"] += 1
            self._no_space_unlogged += 1
            if now - self._no_space_logged < NO_SPACE_LOG_EVERY:
                return
            n, self._no_space_unlogged, self._no_space_logged = self._no_space_unlogged, 0, now
        log.warning("%s: no space: %s (%d such events since the last line, %d in all)", self._what, what, n,
                    self._counters["enospc"])

    def _space_reserve(self) -> int:
        """Bytes of the file system kept for a checkpoint (a new one is written beside the old) and the dead
        log when deciding how many region files it can take."""
        sizes = 0
        for name in (C.NAME, deadlog.NAME):
            try:
                sizes += os.path.getsize(os.path.join(self.path, name))
            except OSError:
                pass
        want = len(self._index) * (F.ENTRY + 64) + self._index.nbytes  # (a checkpoint of what is indexed now)
        return 2 * max(sizes, want) + SPACE_SLACK

    # -- deletes ----------------------------------------------------------------------------
    def _delete(self, keys: Sequence[str]) -> None:
        geom = self._geometry()
        with self._wlock, self._lock:  # (_wlock: reclamation may be moving these very objects)
            for key in keys:
                d = F.key_digest(key.encode())
                e = self._index.get(d) if self._has_large else None
                old = self._index.remove(d)
                if old is not None:
                    self._unlive(old[0], old[2])
                    self._dead.add(old[0], old[1], self._regions[old[0]].seq)
                    self._changed = True
                    if e is not None and e[3] > geom.single:  # a large object: its pieces go with it
                        self._drop_pieces(d, 0, geom.layout(e[3])[0])

    def _contains(self, keys: Sequence[str]) -> list[bool]:
        with self._lock:
            return [self._index.find(F.key_digest(k.encode())) >= 0 for k in keys]
