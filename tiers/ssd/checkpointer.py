"""``Checkpointer``: the SSD engine's durability — flush, checkpoints, and files removed behind the tier.

``flush()`` makes every acknowledged write and removal durable: the active image's tail, the dead log, an
fsync of each file written since.  A reopen finds them without a checkpoint (it reads the summaries of
the regions sealed since the last checkpoint and scans the active region's records), so a flush writes a
checkpoint only when one is due: when as many regions were sealed since the last as make a writer take
one on its own, or the dead log wants compacting.  A flush therefore costs what was written since the
last, never O(objects); close always checkpoints.  ``check_removed`` (called by the writer after each
batch, by ``RegionChanger`` before a seal and by every flush) finds files removed behind the tier and
rebuilds what it owes.  Uses the owners ``SSDTier`` hands it (``EngineConfig``, ``RegionTable``,
``Catalogue``, ``EngineLocks``, ``SSDCounters``: ``state.py``) and ``RegionIO``, reports errors to
``Health``; calls no other component.

Owns the checkpoint's bookkeeping: what the last checkpoint covers (``covered``), the regions sealed
since (``note_sealed``, asked by ``RegionChanger``: ``sealed_enough``), whether the checkpoint file
still wants an fsync, and the objects written since the last flush (``note_written``, told by
``SegmentWriter``): the others tell it and ask it, never change these themselves.

A checkpoint holds every live object's location and key.  Key strings are not kept in
memory, so writing one gathers them from the regions' summaries (one read per region
with live objects; the active region's from memory).
"""

from __future__ import annotations

import logging
import os
from typing import Optional, cast

import numpy as np

from tierkv.durability import TierFlushError

from . import checkpoint as C
from . import format as F
from . import region as R
from . import reopen
from .catalogue import Catalogue
from .counters import SSDCounters
from .engineconfig import EngineConfig
from .health import Health
from .regionio import RegionIO
from .regiontable import RegionTable
from .state import EngineLocks

log = logging.getLogger(__name__)


class Checkpointer:
    """Flush, checkpoints and files removed behind the tier (see the module docstring)."""

    def __init__(self, cfg: EngineConfig, table: RegionTable, cat: Catalogue, locks: EngineLocks, counters: SSDCounters,
                 health: Health, io: RegionIO) -> None:
        # (the owners, as ``state.py`` lists them: alike in each component's constructor, as each uses all five)
        self._cfg, self._table, self._cat, self._locks, self._counters = cfg, table, cat, locks, counters
        self._health = health
        self._io = io
        self.covered = 0  # the last checkpoint covers regions of seq below this (read by the open)
        self._sealed_since = 0  # regions sealed since the last checkpoint (``note_sealed``)
        self._ckpt_unsynced = False  # the checkpoint file was written without fsync (``write``)
        self._unsynced = 0  # objects written since the last flush (what a failed one cannot call durable)
        self._dir_id = (0, 0, 0)  # (``_dir_ids``) as of the open, or the last rebuild after a removal
        self._rebuilding = False  # (``_after_removal`` is running: its own flush does not look again)

    def flush(self) -> None:
        """``SSDTier.flush``: ``flush_locked``, with a checkpoint only when one is due (``due``).  Raises
        ``TierFlushError`` naming what failed, with the objects written since the last good flush, when
        anything it owes could not be made durable (counted and logged as well)."""
        with self._locks.wlock:
            failed = self.flush_locked(checkpoint=self.due())
            n, self._unsynced = self._unsynced, 0  # (each is reported by one flush: the next starts afresh)
        if failed:
            raise TierFlushError(f"{self._cfg.what}: not durable: {'; '.join(failed)}"[:300], n)

    def checkpoint(self) -> None:
        """``SSDTier.checkpoint``: ``flush_locked`` with a checkpoint if the index changed since the last."""
        with self._locks.wlock:
            self.flush_locked(checkpoint=True)

    # -- what the writer and the changer report ----------------------------------------------------
    def note_written(self, n: int) -> None:
        """``n`` more objects were written since the last flush.  Caller holds ``wlock``."""
        self._unsynced += n

    def written(self) -> int:
        """Objects written since the last flush (a failed flush reports them).  Caller holds ``wlock``."""
        return self._unsynced

    def set_written(self, n: int) -> None:
        """Correct the count of objects written since the last flush (a large object counts once, its
        pieces never, ``SegmentWriter._put_large``).  Caller holds ``wlock``."""
        self._unsynced = n

    def note_sealed(self) -> None:
        """A region was sealed.  Caller holds ``wlock``."""
        self._sealed_since += 1

    def sealed_enough(self) -> bool:
        """Enough regions were sealed since the last checkpoint that a writer takes one (``every``)."""
        return self._sealed_since >= self.every()

    def note_opened(self, covered: int) -> None:
        """The open read a checkpoint covering regions of seq below ``covered`` (0: none)."""
        self.covered = covered

    def every(self) -> int:
        """Regions sealed after which a writer checkpoints on its own (reopen reads at most these summaries)."""
        return max(8, len(self._table.regions) // 2)

    def due(self) -> bool:
        return self._cat.changed and (self._sealed_since >= self.every()
                               or self._cat.dead.size() > max(1 << 16, 4 * self._cat.dead.compacted))

    def flush_locked(self, checkpoint: bool) -> list[str]:
        """Everything acknowledged to the file and, with ``fsync`` other than ``"never"``, the disk; then a
        checkpoint if ``checkpoint`` and the index changed since the last one.  A checkpoint a writer took on
        its own (not fsynced) is made durable here without being written again.  Files removed behind the
        tier are found first (``check_removed``): what was acknowledged is in files under the directory.
        Returns what could not be made durable (each also counted and logged); empty when all was.  A file
        whose fsync failed is synced again by the next flush."""
        if self.lock_lost():
            return [cast(str, self._health.refusal())]
        failed: list[str] = []
        self.check_removed(dirty=True)
        r = self._table.active
        if r is not None and not self._io.write_out(r, F.align_up(r.pos), r.pos):
            failed.append(f"writing {r.path}")
        self._io.wait_seals()  # (a summary that failed is no loss: its region is scanned at the next open)
        if self._cfg.fsync != "never":  # the regions first: an entry of the dead log may name a record whose new
            for fd in self._io.dirty():  # copy (reclamation) is among what these write out
                try:
                    os.fdatasync(fd)  # (the files keep their size: data and allocation are what matter)
                    self._io.clean(fd)
                except OSError as e:
                    self._health.io_error(e, "fsync")
                    failed.append(f"fsync of a region file: {e.strerror or e}")
        try:
            self._cat.dead.write(self._cfg.fsync != "never")
        except OSError as e:
            self._health.io_error(e, "writing the dead log")
            failed.append(f"writing the dead log: {e.strerror or e}")
        if checkpoint and self._cat.changed:
            self.write()
        elif self._ckpt_unsynced and self._cfg.fsync != "never":
            try:
                C.sync(self._cfg.path)
                self._ckpt_unsynced = False
            except FileNotFoundError:  # (removed behind the tier: the next checkpoint writes it again)
                self._ckpt_unsynced = False
            except OSError as e:  # (not a loss: a reopen without it reads the summaries)
                self._health.io_error(e, "fsync of the checkpoint")
        return failed

    # -- files removed behind the tier ----------------------------------------------------------------
    def lock_lost(self) -> bool:
        """Whether another process holds the directory now (its ``LOCK`` was removed and taken by another
        opener before this tier took it again): nothing more is written there."""
        return self._health.lock_lost()

    def note_dir(self) -> None:
        """Remember the directory's identity as it is now (at open): ``check_removed`` compares with it."""
        self._dir_id = self._dir_ids()

    def _dir_ids(self) -> tuple[int, int, int]:
        """(inode of the directory, of ``regions``, the time ``regions`` last changed): other inodes mean they
        were removed and made again; another time, that a file in ``regions`` may have been removed.  Raises
        ``OSError`` when that cannot be told (a permission error: a fault, not a removal)."""
        try:
            st = os.stat(os.path.join(self._cfg.path, "regions"))
            return os.stat(self._cfg.path).st_ino, st.st_ino, st.st_mtime_ns
        except (FileNotFoundError, NotADirectoryError):
            return 0, 0, 0

    @staticmethod
    def _gone(r: R.Region, deep: bool = True) -> bool:
        """Whether a region's file was removed (``deep``: or replaced) behind the tier; raises ``OSError``
        when that cannot be told."""
        if r.fd < 0:
            return False
        if os.fstat(r.fd).st_nlink == 0:
            return True
        try:
            return deep and os.stat(r.path).st_ino != r.ino
        except (FileNotFoundError, NotADirectoryError):
            return True

    def check_removed(self, dirty: bool = False) -> bool:
        """Find files removed behind the tier (a tmp cleaner, an operator) and rebuild what the tier owes
        (``_after_removal``); True if there were.  Cheap: the active region's file; with ``dirty`` also every
        file written since the last flush and the directories' identity, and every file only when
        ``regions`` changed since the last look.  Caller holds ``_wlock``."""
        if self._rebuilding:
            return False
        try:
            found = self._removed(dirty)
        except OSError as e:  # (it cannot be told now: a passing fault, probed until it passes)
            self._health.failed(f"cannot reach {e.filename or self._cfg.path}: {e.strerror or e}")
            return False
        if found and not self.lock_lost():
            self._after_removal()
        return found

    def _removed(self, dirty: bool) -> bool:
        """Whether files were removed behind the tier (``check_removed``); raises ``OSError`` when that
        cannot be told."""
        r = self._table.active
        found = r is not None and self._gone(r, deep=dirty)
        if not found and dirty:
            found = any(os.fstat(fd).st_nlink == 0 for fd in self._io.dirty())
            now = self._dir_ids()
            if not found and now != self._dir_id:
                # (a region file made or removed changes ``regions``: one look at every file, rarely)
                found = now[:2] != self._dir_id[:2] or any(
                    self._gone(r, deep=False) for r in self._table.regions.values() if not r.foreign)
                if not found:
                    self._dir_id = now
        return found

    def _after_removal(self) -> None:
        """The directory, or files in it, were removed behind the tier: make the directory and ``LOCK`` again
        (taking the lock again), recreate from the removed files, still open, every region file written since
        the last flush (it may hold writes acknowledged after the removal) and the active one, and drop the
        objects of the other removed regions (they went with the removal: ``objects_lost``).  The removed
        dead log's entries for the recreated regions are written again, and a checkpoint is taken, so that
        a reopen finds exactly what the index holds.  Counted (``dir_removed``) and logged.  Caller holds
        ``_wlock``."""
        if self._health.lock_file is not None and not self._health.lock_file.retake():
            return  # (another process holds the directory now: ``lock_lost``)
        with self._locks.lock:
            self._counters.dir_removed += 1
        self._rebuilding = True
        try:
            self._rebuild()
        finally:
            self._rebuilding = False

    def _rebuild(self) -> None:
        try:
            self._cfg.ensure_dirs()
        except OSError as e:
            self._health.io_error(e, f"recreating {self._cfg.path}")
            return
        self._io.wait_seals()
        dirty = set(self._io.dirty())
        recreated: list = []
        gone: list = []  # (digests, raw lengths) of the objects lost with the removed files
        for r in list(self._table.regions.values()):
            if r.foreign or not self._gone(r):
                continue
            if r is self._table.active or r.fd in dirty:
                try:
                    self._revive(r)
                    recreated.append(r)
                    continue
                except OSError as e:  # (its objects go as the others' do: acknowledged, they are reported)
                    self._health.io_error(e, f"recreating {r.path}")
            with self._locks.lock:
                slots = self._cat.index.in_region(r.index)
                if len(slots):
                    gone.append(self._cat.index.drop_slots(slots))
                self._table.emptied(r)
                if r is self._table.active:  # (no more writes into the removed file: the next begins a new region)
                    self._io.give_back(r.buf)
                    r.buf = None
                    r.entries = r.keys = None
                    r.direct = set()
                    self._table.deactivate()
            self._io.close_region_fd(r)  # (reused later as a new file)
        with self._locks.lock:  # (counted as chunks stored: a large object once, whatever became of its pieces)
            lost = self._cat.lose(np.concatenate([g[0] for g in gone]), np.concatenate([g[1] for g in gone])) if gone else 0
        for r in recreated:  # records that died before the removal are named again
            self._name_dead(r)
        self._counters.objects_lost += lost
        self._cat.dead.reserve()
        self._cat.dead.mark(self._table.next_seq - 1)  # (the removed log's mark of the seqs handed out)
        self._dir_id = self._dir_ids()
        self._cat.mark_changed()
        self.flush_locked(checkpoint=True)
        log.warning("%s: %s was removed behind the tier (files in it or all of it): directory and lock made "
                    "again, %d region files recreated from the removed ones, %d objects lost with the others",
                    self._cfg.what, self._cfg.path, len(recreated), lost)

    def _name_dead(self, r: R.Region) -> None:
        """Name in the dead log every record of a region that is not a live object (its old entries went with
        the removed dead log)."""
        if r is self._table.active:
            ent = np.frombuffer(bytes(cast(bytearray, r.entries)), dtype=F.ENTRY_DTYPE)
        else:
            got = R.read_summary(r.fd, self._cfg.region_size, r.seq, self._cfg.direct_io, r.sum_start)
            if got is None:
                return
            ent = got[0]
        with self._locks.lock:
            live = self._cat.index.offset[self._cat.index.in_region(r.index)].astype(np.int64)
        offs = ent["offset"].astype(np.int64)
        for off in offs[~np.isin(offs, live)].tolist():
            self._cat.dead.add(r.index, off, r.seq)

    def _revive(self, r) -> None:
        """Recreate a region's file if it was removed: the active region's from its image (with O_DIRECT and
        nothing written from the caller's memory), any other from the removed file, still open."""
        try:
            if os.stat(r.path).st_ino == r.ino:
                return
        except FileNotFoundError:
            pass
        self._cfg.ensure_dirs()
        existed = os.path.lexists(r.path)
        fd = R.open_fd(r.path, self._cfg.direct_io, create=True)
        length = r.written if r.state == R.ACTIVE else self._cfg.region_size
        try:
            R.preallocate(fd, self._cfg.region_size)
            if r.state == R.ACTIVE and self._cfg.direct_io and not r.direct:
                R.pwrite_all(fd, memoryview(r.buf)[:length], 0)
            else:  # the image lacks payloads written from the caller's memory (``segment.Segment``):
                for at in range(0, length, 1 << 20):  # the removed file's bytes, still open
                    R.pwrite_all(fd, R.read_span(r.fd, at, min(1 << 20, length - at), self._cfg.direct_io), at)
        except OSError:
            os.close(fd)
            if not existed:
                try:
                    os.unlink(r.path)
                except OSError:
                    pass
            raise
        self._io.close_region_fd(r)
        r.fd, r.ino = fd, os.fstat(fd).st_ino
        self._io.note_dirty(fd)
        if r.state == R.ACTIVE:
            r.tail = (0, 0)  # (the new file holds ``written`` bytes, not the partial block after them)

    def gather(self, tables: Optional[list] = None) -> reopen.Candidates:
        """Every live object with its key, read from the summaries.  Caller holds ``_wlock``.
        ``tables``: a list that gets the index's slots as they were when its objects were listed."""
        self._io.wait_seals()  # (a summary still on its way to the file would read as unreadable)
        with self._locks.lock:
            slots = self._cat.index.live()
            ix = self._cat.index
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
            r = self._table.regions[int(cols["region"][grp[0]])]
            if r is self._table.active:
                ent = np.frombuffer(bytes(cast(bytearray, r.entries)), dtype=F.ENTRY_DTYPE)  # (set while ACTIVE)
                keys = bytes(cast(bytearray, r.keys))
                offs = np.zeros(len(ent) + 1, dtype=np.int64)
                np.cumsum(ent["key_len"], out=offs[1:])
                got = (ent, keys, offs)
            else:
                got = R.read_summary(r.fd, self._cfg.region_size, r.seq, self._cfg.direct_io, r.sum_start)
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
        seqs = np.array([self._table.regions[i].seq for i in cols["region"].tolist()], dtype=np.uint64) if n else \
            np.zeros(0, dtype=np.uint64)
        c = reopen.Candidates(cols["digest"], cols["region"], seqs, cols["offset"], cols["rec_len"],
                                cols["raw_len"], np.zeros(n, dtype=np.uint8), key_start, key_len, b"".join(blobs))
        if not have.all():  # objects no summary or record names any more: dropped, and counted
            self._drop_lost(cols["digest"][~have], cols["region"][~have], cols["offset"][~have],
                            cols["rec_len"][~have])
            with self._locks.lock:  # (a large object went whole: its other parts are no objects either)
                have &= self._cat.index.find_many(cols["digest"]) >= 0
        return reopen.take(c, np.flatnonzero(have))

    def _rescan(self, r: R.Region):
        """(entries, keys, key offsets) of a sealed region whose summary cannot be read, from its records
        (one read of the region), and its summary written again from them; None if that read fails."""
        try:
            data = R.read_span(r.fd, 0, self._cfg.region_size, self._cfg.direct_io)
        except OSError as e:
            self._health.io_error(e, f"reading {r.path}")
            return None
        entries, keys, offs, end = R.scan(data, r.seq)
        del data
        with self._locks.lock:
            self._counters.summaries_rebuilt += 1
        log.warning("%s: the summary of %s could not be read; rebuilt from its %d records", self._cfg.what, r.path,
                    len(entries))
        self._io.seal_scanned(r, reopen.Scanned(entries, keys, end))
        return entries, keys, offs

    def _drop_lost(self, digest, region, offset, rec_len) -> None:
        """Index entries whose records can no longer be found: removed, named dead, and counted (``corrupt``,
        ``objects_lost``) as the chunks stored they were (a large object once, its other parts with it)."""
        with self._locks.lock:
            gone, sizes = [], []
            for d, rg, off, ln in zip(digest.tolist(), region.tolist(), offset.tolist(), rec_len.tolist()):
                slot = self._cat.index.find(d)
                if slot < 0 or self._cat.index.region.item(slot) != rg or self._cat.index.offset.item(slot) != off:
                    continue
                gone.append(d)
                sizes.append(self._cat.index.raw_len.item(slot))
                self._cat.index.remove(d)
                self._cat.retire((rg, off, ln))
            lost = self._cat.lose(np.array(gone, dtype=np.uint64), np.array(sizes, dtype=np.int64))
            self._counters.corrupt += lost
            self._counters.objects_lost += lost
        log.warning("%s: %d objects whose records could not be found were dropped", self._cfg.what, len(digest))

    def write(self, cands: Optional[reopen.Candidates] = None, durable: bool = True) -> None:
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
        sync = durable and self._cfg.fsync != "never"
        # (it reads the summaries; it names the active region's seq, and may compact the dead log)
        if not self._io.wait_seals() or not self._io.header_out():
            with self._locks.lock:
                self._counters.checkpoint_errors += 1
            return
        try:
            tables: list = []
            if cands is None:
                c = self.gather(tables)
            else:
                c = cands
                with self._locks.lock:
                    tables.append(self._cat.index.table())
            # the slots go with the checkpoint when the index held exactly the objects it lists (a key
            # whose summary could not be read is left out of both, by leaving the slots out)
            table = tables[0] if tables and tables[0][0] == len(c.digest) else None
            c = reopen.take(c, np.lexsort((c.offset, c.seq)))  # oldest first: a reopen need not sort
            covered = self._table.active.seq if self._table.active is not None else self._table.next_seq
            nreg = max(self._table.regions) + 1 if self._table.regions else 0
            seqs = np.zeros(nreg, dtype=np.uint64)
            for i, r in self._table.regions.items():
                if not r.foreign:
                    seqs[i] = r.seq
            blob = _gather_keys(c)
            cols = {"digest": c.digest, "region": c.region, "offset": c.offset, "rec_len": c.rec_len,
                    "raw_len": c.raw_len, "key_len": c.key_len}
            if sync:
                for fd in self._io.dirty():  # the records the checkpoint points at reach the disk first
                    os.fsync(fd)
                self._io.all_clean()
            C.write(self._cfg.path, C.encode(covered, self._cfg.region_size, seqs, cols, blob, table), sync)
        except OSError as e:
            with self._locks.lock:
                self._counters.checkpoint_errors += 1
            log.warning("%s: checkpoint failed: %s", self._cfg.what, e)
            return
        with self._locks.lock:
            self._counters.checkpoints += 1
        self._cat.checkpointed()
        self._ckpt_unsynced = not sync and self._cfg.fsync != "never"  # the next flush makes it durable
        try:
            if self._cat.dead.size() > max(1 << 16, 4 * self._cat.dead.compacted):
                self._cat.dead.write(self._cfg.fsync != "never")
                self._cat.dead.compact({i: r.seq for i, r in self._table.regions.items() if not r.foreign},
                                self._cfg.fsync != "never", self._table.next_seq - 1)
        except OSError as e:
            self._health.io_error(e, "compacting the dead log")
        self.covered = covered
        self._sealed_since = 0


def _gather_keys(c: reopen.Candidates) -> "bytes | memoryview":
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
    gc.disable()  # (a million short-lived slices: see reopen.key_list)
    try:
        return b"".join([keys[a:a + m] for a, m in zip(starts.tolist(), lens.tolist())])
    finally:
        if gc_was:
            gc.enable()
