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
      (``Reclaimer.compact_in_place``), so writes get in again once objects are removed.

Structure.  ``SSDTier`` is a facade: it checks the options, opens the directory, and delegates each
``Tier`` call to the component that owns it.  The engine's state has owners (``state.py``), each
handed to the components that use it: ``EngineConfig`` (settings and geometry, fixed once open),
``RegionTable`` (regions, the active one, seqs, live bytes), ``Catalogue`` (index, dead log, the
bookkeeping of an object that leaves), ``SSDCounters`` and ``EngineLocks``; the components change the
table and the catalogue through their methods, report faults and I/O errors to the tier's ``Health``
(``health.py``, which owns the fault and the directory's lock) and call one another by name; the graph
has no cycle (each is built from those below it):

    SSDTier ─ write ──▶ SegmentWriter (segmentwriter.py; a batch on its way: Segment, segment.py)
       │                  ├─▶ RegionChanger.room (regionchange.py: seal, begin, resume/settle at open)
       │                  │     ├─▶ Reclaimer (reclaim.py: reclaim into the spare, compact in place)
       │                  │     └─▶ Checkpointer (checkpointer.py)
       │                  └─▶ Checkpointer (fsync "always"; files removed behind the tier)
       ├─ read ───▶ RecordReader (recordreader.py)
       ├─ flush, checkpoint ─▶ Checkpointer (flush, checkpoints, files removed behind the tier)
       └─ open, recover, delete, close: here (the directory checked first: directory.py)
    every component ─▶ RegionIO (regionio.py: write-outs, summaries behind a seal, images, fds)
                     ─▶ Health (health.py: ``io_error``, ``write_failed``, ``no_space``, ``refusal``)
                     ─▶ RegionTable (regiontable.py: ``enliven``, ``unlive``, ``activate``, ``take_seq``)
                     ─▶ Catalogue (catalogue.py: ``retire``, ``drop_pieces``, ``lose``, ``mark_changed``)

Thread safety (``state.EngineLocks``): ``wlock`` serialises appends, region changes, reclamation and
checkpoints (the writer, the changer, the reclaimer and the checkpointer run under it);
``lock`` guards the region table, the catalogue and the counters, held only briefly, so the
reader runs beside a writer (it takes ``wlock`` only to drop a large object that did not read
whole).  Only ``SegmentWriter.commit`` and the single-record paths add objects to the index, and
only after their bytes are in the file.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
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

from ..base import Locality, Parts, Tier
from . import checkpoint as C
from . import deadlog, reopen
from . import format as F
from . import large as L
from . import region as R
from .checkpointer import Checkpointer
from .directory import prepare_dir, probe_direct
from .health import NO_SPACE_LOG_EVERY, Health  # noqa: F401  (NO_SPACE_LOG_EVERY: tests, tools)
from .lock import DirLock
from .reclaim import Reclaimer
from .recordreader import RecordReader
from .regionchange import RegionChanger
from .regionio import RegionIO
from .segmentwriter import PIPE_UNIT, SegmentWriter  # noqa: F401  (PIPE_UNIT: tests)
from .state import EngineState

log = logging.getLogger(__name__)

DEFAULT_REGION = 64 << 20
MIN_REGION = 1 << 20
MAX_REGION = 2 << 30


def footprint_of(nbytes):
    """What one record of ``nbytes`` takes at most (an int or a numpy array of them): ``large.record_footprint``."""
    return L.record_footprint(nbytes)


class SSDTier(Tier):
    """Chunks in a log of large region files under ``path`` (see the module docstring): the facade over
    the engine's components, each call delegated to the one that owns it."""

    medium = "ssd"
    locality = Locality.DISK
    #: each record's payload sum is checked on every read (xxh3-64 of an uncompressed payload: the chunk's sum)
    verifies_reads = True
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
        self._recovered: Optional[reopen.Candidates] = None  # what the open found, until recover()
        # the engine: the owners of its state, and its components, each handed the owners and components it uses
        st = self._state = EngineState(name, what, self.path, capacity_bytes, rs, self.compression,
                                       self.checksum, self.fsync)
        cfg, table, cat, locks, counters = self._cfg, self._table, self._cat, self._locks, self._counters = (
            st.config, st.table, st.catalogue, st.locks, st.counters)
        owners = (cfg, table, cat, locks, counters)
        health = self._health = Health(what, self.path, counters, locks.lock)
        self._io = RegionIO(cfg, table, health)
        self._checkpointer = Checkpointer(*owners, health, self._io)
        self._reclaimer = Reclaimer(*owners, health, self._io)
        self._changer = RegionChanger(*owners, health, self._io, self._reclaimer, self._checkpointer)
        self._writer = SegmentWriter(*owners, health, self._io, self._changer, self._checkpointer)
        prepare_dir(self.path, what)
        lock_file = DirLock(self.path, what)
        health.attach(lock_file)
        try:
            self.direct_io = probe_direct(self.path, what, direct_io)
            cfg.learn_direct_io(self.direct_io)
            try:
                self._open()
            except OSError as e:  # (a read-only volume, a file where a directory belongs, ...)
                raise ConfigError(f"{what}: cannot open {e.filename or self.path}: {e.strerror or e}") from e
        except BaseException:
            self._io.close_fds()
            lock_file.release()
            raise
        cfg.fix()
        self.region_size = cfg.region_size  # (the directory's, once open)
        lock_file.watch(self._tick)
        self._reader = RecordReader(*owners, health, io_threads or min(4, max(2, os.cpu_count() or 2)))

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
        return self._cfg.usable

    @property
    def max_slot(self) -> int:
        return self._cfg.max_slot

    def regions_needed(self) -> int:
        return self._cfg.regions_needed()

    @property
    def regions_dir(self) -> str:
        return self._cfg.regions_dir

    def _geometry(self) -> L.Geometry:
        """The size rule of this directory's region size (``large.py``).  Read from the attributes alone:
        the simulator's footprint probe (``tierkv.tools.sim.replay.footprint_rule``) is a bare instance holding
        the options as configured."""
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

    # -- open and recover ---------------------------------------------------------------
    def _open(self) -> None:
        """Open the directory, in phases: its region files (``_find_regions``), which of them are regions of
        this size (``_valid_regions``), their objects from the checkpoint, the summaries and scans
        (``reopen.load``), those kept (``_keep``: no orphan pieces, within capacity), the index and the
        regions' live counts (``_index_objects``), then a region to write into (``_settle``).  A checkpoint
        is written if the open changed anything or read regions after the last one."""
        self._cfg.ensure_dirs()
        self._checkpointer.note_dir()
        headers = self._find_regions()
        valid = self._valid_regions(headers)
        ckpt = C.read(self._cfg.path)
        if ckpt is not None and ckpt.region_size != self._cfg.region_size:
            ckpt = None
        self._cat.open_dead()  # (with room reserved: removals are recorded even once the file system is full)
        dead = deadlog.read(self._cfg.path)
        loaded = reopen.load(self._cfg.path, valid, self._cfg.region_size, self._cfg.direct_io, ckpt, dead)
        self._counters.torn_regions = loaded.torn
        self.recovered_from = loaded.source if valid else "empty"
        # above every seq ever handed out: the regions' headers, the checkpoint's, the dead log's marks (a
        # region file lost or damaged since took its seq with it, and the dead log may name its records)
        seqs = [h.seq for h in headers.values() if h is not None]
        if ckpt is not None:
            seqs += [ckpt.covered_seq, int(ckpt.region_seqs.max()) if len(ckpt.region_seqs) else 0]
        self._table.start_seqs(max([*seqs, deadlog.high_water(dead)], default=0))
        c, dropped, trimmed, broken = self._keep(loaded.cands)
        self._index_objects(c, valid, ckpt if not loaded.read_regions and not len(dropped.digest) else None)
        self._checkpointer.note_opened(ckpt.covered_seq if ckpt is not None else 0)
        if len(dropped.digest):
            for rg, off, sq in zip(dropped.region.tolist(), dropped.offset.tolist(), dropped.seq.tolist()):
                self._cat.dead.add(rg, off, sq)
        unreached = self._unreached(loaded)
        self._counters.trimmed += trimmed
        self._counters.objects_lost += unreached + broken + trimmed
        if unreached or broken:
            log.warning("%s: %d objects lost since the last open (%d listed in region files removed, emptied or "
                        "unreadable; %d large objects missing a piece)", self._cfg.what, unreached + broken, unreached,
                        broken)
        resume, lost, moved = self._settle(valid, loaded.scanned, dead)
        if lost:
            c = reopen.take(c, np.flatnonzero(self._cat.index.find_many(c.digest) >= 0))
        self._recovered = c  # (its key strings are made by recover(), in the pass that pairs them with sizes)
        if (any(valid[i].seq >= self._checkpointer.covered for i in loaded.read_regions) or len(dropped.digest) or lost
                or moved or resume is not None or self._counters.regions_removed):
            with self._locks.wlock:  # the keys are at hand unless objects moved: then the summaries say where
                self._checkpointer.flush_locked(checkpoint=False)
                self._checkpointer.write(None if moved or resume is not None else c)

    def _find_regions(self) -> dict[int, Optional[F.RegionHeader]]:
        """Open every region file of the directory: index -> its header (None for a file not ours, which is
        kept as foreign, never written or deleted).  A region file never begun (no header, nothing in it)
        is removed; one that cannot be opened is skipped (both counted)."""
        headers: dict[int, Optional[F.RegionHeader]] = {}
        for name in sorted(os.listdir(self._cfg.regions_dir)):
            idx = R.parse_region_name(name)
            if idx is None:
                continue
            r = R.Region(idx, os.path.join(self._cfg.regions_dir, name))
            try:
                r.fd = R.open_fd(r.path, self._cfg.direct_io)
                r.ino = os.fstat(r.fd).st_ino
            except OSError as e:
                log.warning("%s: cannot open %s: %s; skipped", self._cfg.what, r.path, e)
                r.foreign = True
                self._counters.skipped_files += 1
                self._table.add(r)
                continue
            h, ours = R.read_header(r.fd, self._cfg.direct_io)
            if h is None and not ours and R.never_begun(r.fd, self._cfg.direct_io):
                # a region file whose creation failed (a full disk) or was cut short: no header, nothing in it
                os.close(r.fd)
                try:
                    os.unlink(r.path)
                    self._counters.partial_files_removed += 1
                    log.info("%s: removed %s, a region file never begun (no header, no data)", self._cfg.what, r.path)
                except OSError as e:
                    log.warning("%s: cannot remove %s, a region file never begun: %s", self._cfg.what, r.path, e)
                continue
            if h is None and not ours:
                r.foreign = True  # not a region of ours: never reused, never deleted
                self._counters.skipped_files += 1
            elif h is not None and h.index != idx:
                r.foreign = True
                self._counters.skipped_files += 1
            headers[idx] = h
            self._table.add(r)
        return headers

    def _valid_regions(self, headers: dict[int, Optional[F.RegionHeader]]) -> dict[int, R.Region]:
        """The regions of this directory's region size (the size most of its regions have: ``region_size``
        applies to a new directory only), sealed until their objects are counted; others are foreign."""
        sizes = [h.region_size for h in headers.values() if h is not None]
        if sizes:
            stored = max(set(sizes), key=sizes.count)
            if stored != self._cfg.region_size:
                log.info("%s: %s keeps regions of %d bytes; region_size %d applies to a new directory only",
                         self._cfg.what, self._cfg.path, stored, self._cfg.region_size)
            self._cfg.adopt_region_size(stored)
        valid = {}
        for idx, h in headers.items():
            r = self._table.regions[idx]
            if h is None or r.foreign:
                continue
            if h.region_size != self._cfg.region_size:
                r.foreign = True
                self._counters.skipped_files += 1
                continue
            self._table.found(r, h.seq)
            valid[idx] = r
        return valid

    def _keep(self, c: reopen.Candidates) -> tuple[reopen.Candidates, reopen.Candidates, int, int]:
        """(kept, dropped, chunks trimmed, chunks lost) of the objects found (``large.py``): pieces no manifest
        claims (a process killed before the manifest was written: never acknowledged) go; a large object
        missing a piece (its file removed or damaged) goes whole, lost; and a smaller capacity keeps the
        newest that fit (a large object's footprint is its manifest's), the others trimmed.  The counts are
        of chunks stored: a large object once, never its pieces."""
        geom = self._cfg.geometry()
        cols = (c.digest, c.raw_len, c.key_start, c.key_len, c.keys, geom)
        broken = L.incomplete(*cols)
        keep = ~(L.orphans(*cols) | broken)
        if broken.any():  # (the pieces it still has are no object's now)
            keep &= ~L.orphans(*cols, alive=keep)
        pieces = L.piece_mask(c.key_len, c.key_start, c.keys)
        fps = np.where(pieces, 0, geom.footprint(c.raw_len))
        trimmed = 0
        if int(fps[keep].sum()) > self._cfg.capacity_bytes:
            fit = (np.cumsum(np.where(keep, fps, 0)[::-1])[::-1] <= self._cfg.capacity_bytes) | pieces
            trimmed = int(np.count_nonzero(keep & ~fit))
            keep &= fit
            keep &= ~L.orphans(*cols, alive=keep)
        lost = int(np.count_nonzero(broken))
        if keep.all():  # (nothing to select)
            return c, reopen.take(c, np.zeros(0, dtype=np.int64)), trimmed, lost
        return reopen.take(c, np.flatnonzero(keep)), reopen.take(c, np.flatnonzero(~keep)), trimmed, lost

    @staticmethod
    def _unreached(loaded: reopen.Loaded) -> int:
        """Chunks the checkpoint lists in region files removed, emptied or unreadable since, found nowhere
        else (``reopen.Loaded.unreached``): lost.  A large object counts once, by its manifest."""
        u = loaded.unreached
        if u is None or not len(u.digest):
            return 0
        mine = ~L.piece_mask(u.key_len, u.key_start, u.keys) & ~np.isin(u.digest, loaded.cands.digest)
        return int(np.count_nonzero(mine))

    def _index_objects(self, c: reopen.Candidates, valid: dict[int, R.Region], ckpt: Optional[C.Checkpoint]) -> None:
        """The index of the objects kept, and each region's live bytes and count (a region holding none is
        free).  ``ckpt``: the checkpoint, when it alone was read and nothing was dropped: if it lists exactly
        these objects its index is taken as it is (no table built)."""
        self._cat.load_large(c.raw_len)
        if (ckpt is not None and ckpt.table is not None
                and len(c.digest) == len(ckpt.cols["digest"]) == ckpt.table[0]):
            self._cat.index.load_table(ckpt.table)  # every object the checkpoint lists is current: its index as is
        else:
            self._cat.index.bulk_load(c.digest, c.region, c.offset, c.rec_len, c.raw_len)  # (stored as uint32 there)
        self._table.load_live(valid.values(), c.region,
                              (c.rec_len + F.ALIGN - 1) // F.ALIGN * F.ALIGN + F.ENTRY + F.MAX_KEY)

    def _settle(self, valid: dict[int, R.Region], scanned: dict, dead: np.ndarray) -> tuple[Optional[int], int, int]:
        """A region to write into: the unsealed regions an earlier process left are sealed, or the newest
        filled on (``_to_resume``); then ``RegionChanger.settle`` leaves a region free and
        ``remove_surplus`` the files the capacity provisions.  Returns (the region resumed, objects
        dropped, reclamations run)."""
        resume = self._to_resume(valid, scanned, dead)
        for idx, sc in scanned.items():  # seal what an earlier process left unsealed
            if idx != resume:
                self._io.seal_scanned(valid[idx], sc)
        with self._locks.wlock:
            if resume is not None:
                sc = scanned[resume]
                try:
                    self._changer.resume(valid[resume], sc.end, sc.entries.tobytes(), sc.keys)
                except OSError as e:
                    self._health.io_error(e, f"reopening {valid[resume].path}")
                    self._io.seal_scanned(valid[resume], sc)
            gc_before = self._counters.gc_runs
            lost = self._changer.settle()  # never every region holding objects
            moved = self._counters.gc_runs - gc_before
            self._changer.remove_surplus()  # never more region files than the capacity provisions
        return resume, lost, moved

    def _to_resume(self, valid: dict, scanned: dict, dead: np.ndarray) -> Optional[int]:
        """The region to fill on at open, if one must be: when every region holds live objects (no free
        one, none left to create), the newest if it is unsealed, has room and no dead-log entry names an
        offset at or after its last good record (those offsets will hold new records)."""
        need = self._cfg.regions_needed()
        mine = [r for r in self._table.regions.values() if not r.foreign]
        free = sum(1 for r in mine if r.live_count == 0) + max(0, need - len(mine))
        if free or not valid:
            return None
        newest = max(valid.values(), key=lambda r: r.seq)
        sc = scanned.get(newest.index)
        if sc is None or sc.end + (64 << 10) > F.summary_start(self._cfg.region_size, len(sc.entries), len(sc.keys)):
            return None
        return None if deadlog.names_from(dead, newest.index, newest.seq, sc.end) else newest.index

    def recover(self) -> list[tuple[str, int]]:
        """(key, nbytes) of the objects found on open, oldest first (within ``capacity_bytes``)."""
        return reopen.listing(self._objects_found())

    def recover_columns(self) -> tuple[list[str], np.ndarray]:
        """``recover`` as (keys, nbytes as an int64 array), oldest first, made without a pair per object."""
        c = self._objects_found()
        return reopen.key_list(c), c.raw_len.astype(np.int64, copy=False)

    def _objects_found(self) -> reopen.Candidates:
        """The objects ``recover`` lists, oldest first: a large object once, as its manifest (its pieces are
        no objects of their own, ``large.py``)."""
        if self._recovered is not None:
            c, self._recovered = self._recovered, None  # the tier keeps no keys once the store has them
        else:
            with self._locks.wlock:
                c = self._checkpointer.gather()
            c = reopen.take(c, np.lexsort((c.offset, c.seq)))
        pieces = L.piece_mask(c.key_len, c.key_start, c.keys)
        return reopen.take(c, np.flatnonzero(~pieces)) if pieces.any() else c

    # -- the medium: each call is one component's ---------------------------------------------
    def _write(self, keys: Sequence[str], srcs: Sequence[Parts]) -> list[bool]:
        return self._writer.write(keys, srcs)

    def _read(self, keys: Sequence[str], dsts: Sequence[Parts]) -> list[bool]:
        return self._reader.read(keys, dsts)

    def flush(self) -> None:
        if self._closed:
            return
        self._checkpointer.flush()

    def checkpoint(self) -> None:
        """``flush()``, then a durable checkpoint of the index if it changed since the last one: the next open
        reads the checkpoint (and the regions written after it) instead of the summaries.  Close takes one;
        call this before a planned kill, or at quiet times.  Costs O(objects).  Never raises."""
        if self._closed:
            return
        self._checkpointer.checkpoint()

    @property
    def used_bytes(self) -> int:
        return self._table.live_total

    @property
    def objects_lost(self) -> int:
        return self._counters.objects_lost

    @property
    def available(self) -> bool:
        """False while the tier cannot write (``Health.refusal``: a passing fault, or the directory taken
        by another process): the store places nothing here meanwhile; what the tier holds is still read."""
        return not self._closed and self._health.refusal() is None

    # -- a passing fault's end (``health.py``) ----------------------------------------------------
    def _tick(self) -> None:
        """The lock watcher's call at every interval: a probe when one is due; skipped while a writer holds
        the files (it finds the fault's end itself, or the next tick does)."""
        if not self._health.due() or self._closed or not self._locks.wlock.acquire(blocking=False):
            return
        try:
            if not self._closed and not self._checkpointer.lock_lost():
                self._probe()
        finally:
            self._locks.wlock.release()

    def _probe(self) -> None:
        """Try again what a write needs: the directory and ``regions`` reachable (what a removal took is made
        again, ``Checkpointer.check_removed``) and the active region's header written again (the same
        bytes: a write the device must take).  Success ends the fault; a failure waits longer.  Caller
        holds ``wlock``."""
        try:
            self._checkpointer.check_removed(dirty=True)
            os.stat(os.path.join(self._cfg.regions_dir, "."))  # (still missing, or unreachable: not yet)
            r = self._table.active
            if r is not None and r.buf is not None and r.fd >= 0:
                if r.written >= F.BLOCK:
                    R.pwrite_all(r.fd, memoryview(r.buf)[:F.BLOCK], 0)
                elif not self._io.header_out():
                    raise OSError(f"writing the header of {r.path} failed")
            elif not os.access(self._cfg.regions_dir, os.W_OK | os.X_OK):
                raise PermissionError(f"{self._cfg.regions_dir} is not writable")
        except OSError as e:
            self._health.failed(f"probe: {e.strerror or e}" + (f": {e.filename}" if e.filename else ""))
            return
        if self._health.lock_file is None or self._health.lock_file.fault is None:
            self._health.passed()

    @property
    def index_bytes(self) -> int:
        return self._cat.index.nbytes

    def extra_stats(self) -> dict[str, Any]:
        fault = self._health.refusal()
        holder = self._health.lock_file.holder if self._health.lock_file is not None else None
        with self._locks.lock:
            regions = [r for r in self._table.regions.values() if not r.foreign]
            large, pieces = self._large_count()
            return {"path": self._cfg.path, "objects": max(0, len(self._cat.index) - pieces), "large_objects": large,
                    "compression": self._cfg.compression or "none",
                    "checksum": self._cfg.checksum, "direct_io": self._cfg.direct_io, "region_size": self._cfg.region_size,
                    "regions": len(regions), "regions_free": sum(r.state == R.FREE for r in regions),
                    "index_bytes": self._cat.index.nbytes, "recovered_from": self.recovered_from,
                    "writable": fault is None, "last_error": fault or "", "lock_holder": holder,
                    **self._counters.as_dict()}

    def _large_count(self) -> tuple[int, int]:
        """(large objects, their pieces) in the index (``large.py``).  Caller holds ``EngineLocks.lock``."""
        if not self._cat.has_large:
            return 0, 0
        geom = self._cfg.geometry()
        ix = self._cat.index
        big = ix.raw_len[(ix.raw_len > geom.single) & (ix.digest > F.TOMB)].astype(np.int64)
        return len(big), int((-(-big // geom.piece)).sum())

    def close(self) -> None:
        if self._closed:
            return
        try:
            with self._locks.wlock:
                if self._table.active is not None and not self._checkpointer.lock_lost():  # sealed: the next open
                    try:  # reads its summary, not its records
                        self._checkpointer.check_removed()
                        self._changer.seal(self._table.active)
                    except OSError as e:
                        self._health.io_error(e, "sealing at close")
                self._checkpointer.flush_locked(checkpoint=True)
        finally:
            self._reader.shutdown()
            self._io.shutdown()
            super().close()
            with self._locks.wlock:
                self._io.close_fds()
                self._table.deactivate()
                if self._health.lock_file is not None:
                    self._health.lock_file.release()

    # -- deletes ----------------------------------------------------------------------------
    def _delete(self, keys: Sequence[str]) -> None:
        with self._locks.wlock:  # (reclamation may be moving these very objects)
            first = self._unindex(keys)
            # The removals reach the dead log's file before the answer, as a write reaches its region's
            # file: a process killed after a removal never brings the object back beside writes made after
            # it (which may have taken its room: a reopen over capacity would drop the oldest, flushed
            # objects).  Durable on disk at the next flush (or now with ``fsync: "always"``); a failed
            # append leaves them pending for the flush.
            try:
                self._cat.dead.write(self._cfg.fsync == "always", start=first)
            except OSError as e:
                self._health.io_error(e, "writing the dead log")

    def _unindex(self, keys: Sequence[str]) -> int:
        """Remove ``keys`` from the index (the dead log names their records, in ``pending``); returns where
        in ``pending`` their entries begin.  Caller holds ``wlock``."""
        geom = self._cfg.geometry()
        with self._locks.lock:
            first = len(self._cat.dead.pending)
            for key in keys:
                d = F.key_digest(key.encode())
                e = self._cat.index.get(d) if self._cat.has_large else None
                old = self._cat.index.remove(d)
                if old is not None:
                    self._cat.retire(old)
                    if e is not None and e[3] > geom.single:  # a large object: its pieces go with it
                        self._cat.drop_pieces(d, 0, geom.layout(e[3])[0])
        return first

    def _contains(self, keys: Sequence[str]) -> list[bool]:
        with self._locks.lock:
            return [self._cat.index.find(F.key_digest(k.encode())) >= 0 for k in keys]
