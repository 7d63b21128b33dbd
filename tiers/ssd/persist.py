"""Durability of ``SSDTier``: flush, checkpoints, stats and close.

``flush()`` makes every acknowledged write and removal durable: the active image's tail,
the dead log, an fsync of each file written since.  A reopen finds them without a
checkpoint (it reads the summaries of the regions sealed since the last checkpoint and
scans the active region's records), so a flush writes a checkpoint only when one is due:
when as many regions were sealed since the last as make a writer take one on its own, or
the dead log wants compacting.  A flush therefore costs what was written since the last,
never O(objects); close always checkpoints.

A checkpoint holds every live object's location and key.  Key strings are not kept in
memory, so writing one gathers them from the regions' summaries (one read per region
with live objects; the active region's from memory).
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Optional, cast

import numpy as np

from . import checkpoint as C
from . import format as F
from . import recovery
from . import region as R
from .deadlog import DeadLog
from .index import DigestIndex
from .lock import DirLock

log = logging.getLogger(__name__)


class Persistence:
    # state of ``SSDTier`` (set in its ``__init__`` and ``Tier.__init__``)
    path: str
    compression: Optional[str]
    checksum: str
    fsync: str
    direct_io: bool
    region_size: int
    recovered_from: str
    _what: str
    _closed: bool
    _lock: threading.Lock
    _wlock: threading.Lock
    _lock_file: Optional[DirLock]
    _counters: dict[str, int]
    _regions: dict[int, R.Region]
    _active: Optional[R.Region]
    _index: DigestIndex
    _dead: DeadLog
    _live_total: int
    _changed: bool
    _covered: int
    _sealed_since_ckpt: int
    _ckpt_unsynced: bool
    _dir_id: tuple[int, int, int]  # (``_dir_ids``) as of the open, or the last rebuild after a removal
    _rebuilding: bool  # (``_after_removal`` is running: its own flush does not look again)
    _next_seq: int
    _dirty_fds: set[int]
    _pool: ThreadPoolExecutor
    _writer: Optional[ThreadPoolExecutor]

    _has_large: bool

    if TYPE_CHECKING:  # defined by ``SSDTier``
        def _geometry(self) -> Any: ...
        def _io_error(self, e: OSError, what: str) -> None: ...
        def _write_out(self, r: R.Region, end: int, data_end: int) -> bool: ...
        def _ensure_dirs(self) -> None: ...
        def _seal(self, r: R.Region) -> None: ...
        def _wait_seals(self, drop: Optional[R.Region] = None) -> bool: ...
        def _header_out(self) -> bool: ...
        def _seal_scanned(self, r: R.Region, sc: recovery.Scanned) -> None: ...
        def _unlive(self, idx: int, rec_len: int) -> None: ...

    def flush(self) -> None:
        if self._closed:
            return
        with self._wlock:
            self._flush_locked(checkpoint=self._checkpoint_due())

    def checkpoint(self) -> None:
        """``flush()``, then a durable checkpoint of the index if it changed since the last one: the next open
        reads the checkpoint (and the regions written after it) instead of the summaries.  Close takes one;
        call this before a planned kill, or at quiet times.  Costs O(objects).  Never raises."""
        if self._closed:
            return
        with self._wlock:
            self._flush_locked(checkpoint=True)

    def _checkpoint_every(self) -> int:
        """Regions sealed after which a writer checkpoints on its own (reopen reads at most these summaries)."""
        return max(8, len(self._regions) // 2)

    def _checkpoint_due(self) -> bool:
        return self._changed and (self._sealed_since_ckpt >= self._checkpoint_every()
                                  or self._dead.size() > max(1 << 16, 4 * self._dead.compacted))

    def _flush_locked(self, checkpoint: bool) -> None:
        """Everything acknowledged to the file and, with ``fsync`` other than ``"never"``, the disk; then a
        checkpoint if ``checkpoint`` and the index changed since the last one.  A checkpoint a writer took on
        its own (not fsynced) is made durable here without being written again.  Files removed behind the
        tier are found first (``_check_removed``): what was acknowledged is in files under the directory."""
        if self._lock_lost():
            return
        self._check_removed(dirty=True)
        r = self._active
        if r is not None:
            self._write_out(r, F.align_up(r.pos), r.pos)
        self._wait_seals()
        if self.fsync != "never":  # the regions first: an entry of the dead log may name a record whose new
            for fd in list(self._dirty_fds):  # copy (reclamation) is among what these write out
                try:
                    os.fdatasync(fd)  # (the files keep their size: data and allocation are what matter)
                except OSError as e:
                    self._io_error(e, "fsync")
            self._dirty_fds.clear()
        try:
            self._dead.write(self.fsync != "never")
        except OSError as e:
            self._io_error(e, "writing the dead log")
        if checkpoint and self._changed:
            self._checkpoint()
        elif self._ckpt_unsynced and self.fsync != "never":
            try:
                C.sync(self.path)
                self._ckpt_unsynced = False
            except FileNotFoundError:  # (removed behind the tier: the next checkpoint writes it again)
                self._ckpt_unsynced = False
            except OSError as e:
                self._io_error(e, "fsync of the checkpoint")

    # -- files removed behind the tier ----------------------------------------------------------------
    def _lock_lost(self) -> bool:
        """Whether another process holds the directory now (its ``LOCK`` was removed and taken by another
        opener before this tier took it again): nothing more is written there."""
        return self._lock_file is not None and self._lock_file.lost

    def _dir_ids(self) -> tuple[int, int, int]:
        """(inode of the directory, of ``regions``, the time ``regions`` last changed): other inodes mean they
        were removed and made again; another time, that a file in ``regions`` may have been removed."""
        try:
            st = os.stat(os.path.join(self.path, "regions"))
            return os.stat(self.path).st_ino, st.st_ino, st.st_mtime_ns
        except OSError:
            return 0, 0, 0

    @staticmethod
    def _gone(r: R.Region, deep: bool = True) -> bool:
        """Whether a region's file was removed (``deep``: or replaced) behind the tier."""
        if r.fd < 0:
            return False
        try:
            if os.fstat(r.fd).st_nlink == 0:
                return True
            return deep and os.stat(r.path).st_ino != r.ino
        except OSError:
            return True

    def _check_removed(self, dirty: bool = False) -> bool:
        """Find files removed behind the tier (a tmp cleaner, an operator) and rebuild what the tier owes
        (``_after_removal``); True if there were.  Cheap: the active region's file; with ``dirty`` also every
        file written since the last flush and the directories' identity, and every file only when
        ``regions`` changed since the last look.  Caller holds ``_wlock``."""
        if self._rebuilding:
            return False
        r = self._active
        found = r is not None and self._gone(r, deep=dirty)
        if not found and dirty:
            try:
                found = any(os.fstat(fd).st_nlink == 0 for fd in self._dirty_fds)
            except OSError:
                found = True
            now = self._dir_ids()
            if not found and now != self._dir_id:
                # (a region file made or removed changes ``regions``: one look at every file, rarely)
                found = now[:2] != self._dir_id[:2] or any(
                    self._gone(r, deep=False) for r in self._regions.values() if not r.foreign)
                if not found:
                    self._dir_id = now
        if found and not self._lock_lost():
            self._after_removal()
        return found

    def _after_removal(self) -> None:
        """The directory, or files in it, were removed behind the tier: make the directory and ``LOCK`` again
        (taking the lock again), recreate from the removed files, still open, every region file written since
        the last flush (it may hold writes acknowledged after the removal) and the active one, and drop the
        objects of the other removed regions (they went with the removal: ``objects_lost``).  The removed
        dead log's entries for the recreated regions are written again, and a checkpoint is taken, so that
        a reopen finds exactly what the index holds.  Counted (``dir_removed``) and logged.  Caller holds
        ``_wlock``."""
        if self._lock_file is not None and not self._lock_file.retake():
            return  # (another process holds the directory now: ``_lock_lost``)
        self._count("dir_removed")
        self._rebuilding = True
        try:
            self._rebuild()
        finally:
            self._rebuilding = False

    def _rebuild(self) -> None:
        try:
            self._ensure_dirs()
        except OSError as e:
            self._io_error(e, f"recreating {self.path}")
            return
        self._wait_seals()
        dirty = set(self._dirty_fds)
        recreated, lost = [], 0
        for r in list(self._regions.values()):
            if r.foreign or not self._gone(r):
                continue
            if r is self._active or r.fd in dirty:
                try:
                    self._revive(r)
                    recreated.append(r)
                    continue
                except OSError as e:  # (its objects go as the others' do: acknowledged, they are reported)
                    self._io_error(e, f"recreating {r.path}")
            with self._lock:
                slots = self._index.in_region(r.index)
                if len(slots):
                    self._index.digest[slots] = F.TOMB
                    self._index.count -= len(slots)
                    lost += len(slots)
                self._live_total -= r.live_bytes
                r.live_bytes = r.live_count = 0
                if r is self._active:  # (no more writes into the removed file: the next begins a new region)
                    self._spare_image, r.buf = r.buf, None
                    r.entries = r.keys = None
                    r.direct = set()
                    self._active = None
                r.state = R.FREE
            self._close_region_fd(r)  # (reused later as a new file)
        for r in recreated:  # records that died before the removal are named again
            self._name_dead(r)
        self._counters["objects_lost"] += lost
        self._dead.reserve()
        self._dead.mark(self._next_seq - 1)  # (the removed log's mark of the seqs handed out)
        self._dir_id = self._dir_ids()
        self._changed = True
        self._flush_locked(checkpoint=True)
        log.warning("%s: %s was removed behind the tier (files in it or all of it): directory and lock made "
                    "again, %d region files recreated from the removed ones, %d objects lost with the others",
                    self._what, self.path, len(recreated), lost)

    def _name_dead(self, r: R.Region) -> None:
        """Name in the dead log every record of a region that is not a live object (its old entries went with
        the removed dead log)."""
        if r is self._active:
            ent = np.frombuffer(bytes(cast(bytearray, r.entries)), dtype=F.ENTRY_DTYPE)
        else:
            got = R.read_summary(r.fd, self.region_size, r.seq, self.direct_io, r.sum_start)
            if got is None:
                return
            ent = got[0]
        with self._lock:
            live = self._index.offset[self._index.in_region(r.index)].astype(np.int64)
        offs = ent["offset"].astype(np.int64)
        for off in offs[~np.isin(offs, live)].tolist():
            self._dead.add(r.index, off, r.seq)

    def _revive(self, r) -> None:
        """Recreate a region's file if it was removed: the active region's from its image (with O_DIRECT and
        nothing written from the caller's memory), any other from the removed file, still open."""
        try:
            if os.stat(r.path).st_ino == r.ino:
                return
        except FileNotFoundError:
            pass
        self._ensure_dirs()
        existed = os.path.lexists(r.path)
        fd = R.open_fd(r.path, self.direct_io, create=True)
        length = r.written if r.state == R.ACTIVE else self.region_size
        try:
            R.preallocate(fd, self.region_size)
            if r.state == R.ACTIVE and self.direct_io and not r.direct:
                R.pwrite_all(fd, memoryview(r.buf)[:length], 0)
            else:  # the image lacks payloads written from the caller's memory (``segment.Segment``):
                for at in range(0, length, 1 << 20):  # the removed file's bytes, still open
                    R.pwrite_all(fd, R.read_span(r.fd, at, min(1 << 20, length - at), self.direct_io), at)
        except OSError:
            os.close(fd)
            if not existed:
                try:
                    os.unlink(r.path)
                except OSError:
                    pass
            raise
        self._close_region_fd(r)
        r.fd, r.ino = fd, os.fstat(fd).st_ino
        self._dirty_fds.add(fd)
        if r.state == R.ACTIVE:
            r.tail = (0, 0)  # (the new file holds ``written`` bytes, not the partial block after them)

    def _gather(self, tables: Optional[list] = None) -> recovery.Candidates:
        """Every live object with its key, read from the summaries.  Caller holds ``_wlock``.
        ``tables``: a list that gets the index's slots as they were when its objects were listed."""
        self._wait_seals()  # (a summary still on its way to the file would read as unreadable)
        with self._lock:
            slots = self._index.live()
            ix = self._index
            cols = {"digest": ix.digest[slots].copy(), "region": ix.region[slots].astype(np.int64),
                    "offset": ix.offset[slots].astype(np.int64), "rec_len": ix.rec_len[slots].astype(np.int64),
                    "raw_len": ix.raw_len[slots].astype(np.int64)}
            if tables is not None:
                tables.append(ix.table())
        n = len(slots)
        key_start = np.zeros(n, dtype=np.int64)
        key_len = np.zeros(n, dtype=np.int64)
        have = np.ones(n, dtype=bool)
        blobs, base = [], 0
        order = np.argsort(cols["region"], kind="stable")
        bounds = np.flatnonzero(np.diff(cols["region"][order])) + 1
        for grp in np.split(order, bounds) if n else []:
            r = self._regions[int(cols["region"][grp[0]])]
            if r is self._active:
                ent = np.frombuffer(bytes(cast(bytearray, r.entries)), dtype=F.ENTRY_DTYPE)  # (set while ACTIVE)
                keys = bytes(cast(bytearray, r.keys))
                offs = np.zeros(len(ent) + 1, dtype=np.int64)
                np.cumsum(ent["key_len"], out=offs[1:])
                got = (ent, keys, offs)
            else:
                got = R.read_summary(r.fd, self.region_size, r.seq, self.direct_io, r.sum_start)
                if got is None:  # (a summary cut or damaged since: the records say the same)
                    got = self._rescan(r)
            if got is None:
                have[grp] = False
                continue
            ent, keys, offs = got
            if not len(ent):  # (a region cut to its header: none of the objects listed there is in it)
                have[grp] = False
                continue
            eo = ent["offset"].astype(np.int64)
            srt = np.argsort(eo, kind="stable")
            want = cols["offset"][grp]
            pos = np.searchsorted(eo[srt], want)
            pos = np.minimum(pos, len(eo) - 1)
            hit = eo[srt][pos] == want
            e = srt[pos]
            have[grp[~hit]] = False
            key_start[grp] = offs[e] + base
            key_len[grp] = ent["key_len"][e]
            blobs.append(keys)
            base += len(keys)
        seqs = np.array([self._regions[i].seq for i in cols["region"].tolist()], dtype=np.uint64) if n else \
            np.zeros(0, dtype=np.uint64)
        c = recovery.Candidates(cols["digest"], cols["region"], seqs, cols["offset"], cols["rec_len"],
                                cols["raw_len"], np.zeros(n, dtype=np.uint8), key_start, key_len, b"".join(blobs))
        if not have.all():  # objects no summary or record names any more: dropped, and counted
            self._drop_lost(cols["digest"][~have], cols["region"][~have], cols["offset"][~have],
                            cols["rec_len"][~have])
        return recovery.take(c, np.flatnonzero(have))

    def _rescan(self, r: R.Region):
        """(entries, keys, key offsets) of a sealed region whose summary cannot be read, from its records
        (one read of the region), and its summary written again from them; None if that read fails."""
        try:
            data = R.read_span(r.fd, 0, self.region_size, self.direct_io)
        except OSError as e:
            self._io_error(e, f"reading {r.path}")
            return None
        entries, keys, offs, end = R.scan(data, r.seq)
        del data
        self._count("summaries_rebuilt")
        log.warning("%s: the summary of %s could not be read; rebuilt from its %d records", self._what, r.path,
                    len(entries))
        self._seal_scanned(r, recovery.Scanned(entries, keys, end))
        return entries, keys, offs

    def _drop_lost(self, digest, region, offset, rec_len) -> None:
        """Index entries whose records can no longer be found: counted (``corrupt``), removed, named dead."""
        with self._lock:
            for d, rg, off, ln in zip(digest.tolist(), region.tolist(), offset.tolist(), rec_len.tolist()):
                slot = self._index.find(d)
                if slot < 0 or self._index.region.item(slot) != rg or self._index.offset.item(slot) != off:
                    continue
                self._index.remove(d)
                self._unlive(rg, ln)
                self._dead.add(rg, off, self._regions[rg].seq)
                self._counters["corrupt"] += 1
                self._changed = True
        log.warning("%s: %d objects whose records could not be found were dropped", self._what, len(digest))

    def _checkpoint(self, cands: Optional[recovery.Candidates] = None, durable: bool = True) -> None:
        """Write the index (with keys; ``cands`` when the caller has them) atomically.

        ``durable``: first fsync the regions it points at, and the checkpoint itself (with
        ``fsync`` other than ``"never"``).  The checkpoints a writer takes on its own between
        flushes are not durable: they only shorten a reopen, and their fsyncs would make the
        put that rotates a region wait for the device to take every byte written since the
        last one.  Such a checkpoint still reaches the file system whole (temp file and
        rename), so a killed process leaves it valid; after a power loss it may point at
        records that never reached the disk, which read as misses (every record is checked
        against its own header, sequence and checksums), or be missing, when a reopen reads
        the region summaries instead.  The regions stay in the set to fsync at the next flush.

        A failure is counted, never raised.
        """
        sync = durable and self.fsync != "never"
        # (it reads the summaries; it names the active region's seq, and may compact the dead log)
        if not self._wait_seals() or not self._header_out():
            self._count("checkpoint_errors")
            return
        try:
            tables: list = []
            if cands is None:
                c = self._gather(tables)
            else:
                c = cands
                with self._lock:
                    tables.append(self._index.table())
            # the slots go with the checkpoint when the index held exactly the objects it lists (a key
            # whose summary could not be read is left out of both, by leaving the slots out)
            table = tables[0] if tables and tables[0][0] == len(c.digest) else None
            c = recovery.take(c, np.lexsort((c.offset, c.seq)))  # oldest first: a reopen need not sort
            covered = self._active.seq if self._active is not None else self._next_seq
            nreg = max(self._regions) + 1 if self._regions else 0
            seqs = np.zeros(nreg, dtype=np.uint64)
            for i, r in self._regions.items():
                if not r.foreign:
                    seqs[i] = r.seq
            blob = _gather_keys(c)
            cols = {"digest": c.digest, "region": c.region, "offset": c.offset, "rec_len": c.rec_len,
                    "raw_len": c.raw_len, "key_len": c.key_len}
            if sync:
                for fd in list(self._dirty_fds):  # the records the checkpoint points at reach the disk first
                    os.fsync(fd)
                self._dirty_fds.clear()
            C.write(self.path, C.encode(covered, self.region_size, seqs, cols, blob, table), sync)
        except OSError as e:
            self._count("checkpoint_errors")
            log.warning("%s: checkpoint failed: %s", self._what, e)
            return
        self._count("checkpoints")
        self._changed = False
        self._ckpt_unsynced = not sync and self.fsync != "never"  # the next flush makes it durable
        try:
            if self._dead.size() > max(1 << 16, 4 * self._dead.compacted):
                self._dead.write(self.fsync != "never")
                self._dead.compact({i: r.seq for i, r in self._regions.items() if not r.foreign},
                                   self.fsync != "never", self._next_seq - 1)
        except OSError as e:
            self._io_error(e, "compacting the dead log")
        self._covered = covered
        self._sealed_since_ckpt = 0

    # -- bookkeeping ------------------------------------------------------------------------
    def _count(self, what: str, n: int = 1) -> None:
        with self._lock:
            self._counters[what] += n

    @property
    def used_bytes(self) -> int:
        return self._live_total

    @property
    def index_bytes(self) -> int:
        return self._index.nbytes

    def extra_stats(self) -> dict[str, Any]:
        with self._lock:
            regions = [r for r in self._regions.values() if not r.foreign]
            large, pieces = self._large_count()
            return {"path": self.path, "objects": len(self._index) - pieces, "large_objects": large,
                    "compression": self.compression or "none",
                    "checksum": self.checksum, "direct_io": self.direct_io, "region_size": self.region_size,
                    "regions": len(regions), "regions_free": sum(r.state == R.FREE for r in regions),
                    "index_bytes": self._index.nbytes, "recovered_from": self.recovered_from,
                    **self._counters}

    def _large_count(self) -> tuple[int, int]:
        """(large objects, their pieces) in the index (``large.py``).  Caller holds ``_lock``."""
        if not self._has_large:
            return 0, 0
        geom = self._geometry()
        ix = self._index
        big = ix.raw_len[(ix.raw_len > geom.single) & (ix.digest > F.TOMB)].astype(np.int64)
        return len(big), int((-(-big // geom.piece)).sum())

    def _close_region_fd(self, r) -> None:
        if r.fd >= 0:
            self._wait_seals(drop=r)  # (none may be writing to it)
            self._dirty_fds.discard(r.fd)
            try:
                os.close(r.fd)
            except OSError:
                pass
            r.fd = -1

    def _close_fds(self) -> None:
        for r in self._regions.values():
            self._close_region_fd(r)

    def close(self) -> None:
        if self._closed:
            return
        try:
            with self._wlock:
                if self._active is not None and not self._lock_lost():  # sealed: the next open reads its
                    try:  # summary, not its records
                        self._check_removed()
                        self._seal(self._active)
                    except OSError as e:
                        self._io_error(e, "sealing at close")
                self._flush_locked(checkpoint=True)
        finally:
            self._pool.shutdown(wait=True)
            if self._writer is not None:
                self._writer.shutdown(wait=True)
            super().close()  # type: ignore[misc]  # Tier.close, next in SSDTier's MRO
            with self._wlock:
                self._close_fds()
                self._active = None
                if self._lock_file is not None:
                    self._lock_file.release()


def _gather_keys(c: recovery.Candidates) -> "bytes | memoryview":
    """The candidates' keys back to back, in their order."""
    n = len(c.key_start)
    if not n:
        return b""
    starts, lens = c.key_start, c.key_len
    s0 = int(starts[0])
    if (starts[1:] == s0 + np.cumsum(lens[:-1])).all():  # already back to back
        return c.keys[s0:s0 + int(lens.sum())]
    import gc

    keys = c.keys
    gc_was = gc.isenabled()
    gc.disable()  # (a million short-lived slices: see recovery.key_list)
    try:
        return b"".join([keys[a:a + m] for a, m in zip(starts.tolist(), lens.tolist())])
    finally:
        if gc_was:
            gc.enable()
