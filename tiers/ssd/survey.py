"""``inspect_dir``: what an ``ssd`` directory holds, for the operator's ``tierkv inspect``.

A directory is an ssd tier's when it holds a checkpoint of ours, region files under
``regions/``, or an empty ``regions/`` beside a ``LOCK`` (a tier opened it and wrote
nothing).  Anything else (an empty directory, a typo'd path) is refused with a
``ConfigError`` before anything is read or written.

Three modes, each saying in ``checked`` what it actually checked:

* plain: reads the region headers, the summaries (or an unsealed region's records),
  the checkpoint and the dead log; never a sealed region's records.  It takes no lock
  and writes nothing, so it works beside a running writer: then (``live_writer``, the
  holder's pid) the directory may change under it, and no file is judged corrupt.
* ``verify=True``: also reads every listed object's record and checks its header,
  key, region seq, length and payload sum.  It holds a shared ``flock`` on ``LOCK``
  while it reads, so the view is consistent; a live writer is refused with a
  ``ConfigError`` naming its pid (and a tier opening the directory meanwhile is
  refused, as a second writer is).
* ``repair=True``: takes the writer lock (``lock.DirLock``: a live writer is refused,
  naming its pid), verifies, and names each corrupt object's record in the dead log,
  which is exactly how the tier drops a corrupt object it reads; nothing else is
  written, no capacity applies, so no intact object is ever dropped.  ``removed``
  lists what was removed; the rest of the report is the directory afterwards.

A region file whose header fails its check is reported (``corrupt_objects`` entry with
``file``) and left in place: the tier skips such a file and never writes or deletes it.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable
from typing import Any, Optional

import numpy as np

from tierkv.errors import ConfigError

from . import checkpoint as C
from . import deadlog, reopen
from . import format as F
from . import large as L
from . import region as R
from .lock import LOCK_NAME, DirLock, holder_pid

REGIONS_DIR = "regions"  # (engineconfig.REGIONS_DIR; not imported from there, to keep this module light)
_RDONLY = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)


def inspect_dir(path: str, verify: bool = False, repair: bool = False,
                progress: Optional[Callable[[int, int], None]] = None) -> dict[str, Any]:
    """Describe (``verify``: and check; ``repair``: and fix) an ssd directory (see the module docstring).
    ``progress(done, total)`` is called now and then while objects are verified."""
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isdir(path):
        raise ConfigError(f"{path}: not a directory")
    refuse_foreign(path)
    if repair:
        return _repair(path, progress)
    if verify:
        fd = _shared_lock(path, "verify")
        try:
            info = _scan(path, verify=True, live=None, progress=progress)
        finally:
            if fd >= 0:
                os.close(fd)
        if fd < 0:  # (no LOCK file: no writer was running; one may have started since)
            pid = _writer(path)
            if pid is not None:
                raise ConfigError(f"{path}: a writer ({_who(pid)}) opened the directory during the check; "
                                  "a live directory cannot be verified")
        return info
    pid = _writer(path)
    try:
        info = _scan(path, verify=False, live=pid)
        if pid is None and (pid := _writer(path)) is not None:  # it started meanwhile: judge nothing
            info = _scan(path, verify=False, live=pid)
    except OSError as e:
        if pid is None:
            raise
        raise ConfigError(f"{path} is in use by {_who(pid)} and changed while it was read "
                          f"({e.filename or path}: {e.strerror or e}); try again") from None
    return info


# -- whose directory ---------------------------------------------------------------------
def refuse_foreign(path: str) -> None:
    """Raise a ``ConfigError`` unless ``path`` holds ssd tier data (see the module docstring)."""
    try:
        names = os.listdir(path)
    except OSError as e:
        raise ConfigError(f"{path}: cannot list: {e.strerror}") from None
    if not names:
        raise ConfigError(f"{path}: empty directory, not an ssd tier's directory")
    if C.NAME in names and _starts_with(os.path.join(path, C.NAME), C.MAGIC):
        return
    rdir = os.path.join(path, REGIONS_DIR)
    if REGIONS_DIR in names and os.path.isdir(rdir):
        try:
            entries = os.listdir(rdir)
        except OSError as e:
            raise ConfigError(f"{rdir}: cannot list: {e.strerror}") from None
        if any(R.parse_region_name(n) is not None for n in entries):
            return
        if not entries and LOCK_NAME in names:
            return
    if any(n.endswith(".kv") for n in names):
        raise ConfigError(f"{path} holds the old one-file-per-object layout (*.kv files), not regions")
    raise ConfigError(f"{path}: not an ssd tier's directory (no checkpoint, no region files under "
                      f"{REGIONS_DIR}/); nothing was read or changed")


def _starts_with(fpath: str, magic: bytes) -> bool:
    try:
        with open(fpath, "rb") as f:
            return f.read(len(magic)) == magic
    except OSError:
        return False


# -- the writer's lock ------------------------------------------------------------------
def _who(pid: Optional[int]) -> str:
    return f"process {pid}" if pid is not None and pid > 0 else "another process"


def _writer(path: str) -> Optional[int]:
    """None when no writer holds ``LOCK`` now, else its pid (0 when the file does not say)."""
    try:
        fd = os.open(os.path.join(path, LOCK_NAME), _RDONLY)
    except OSError:
        return None  # (no LOCK: no tier has it open; a writer creates it before anything else)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None
    except BlockingIOError:
        return holder_pid(path) or 0
    except OSError:
        return None
    finally:
        os.close(fd)  # (drops the probe's shared lock at once: a writer starting now is not refused)


def _shared_lock(path: str, what: str) -> int:
    """A shared ``flock`` on ``LOCK`` held until the fd is closed; -1 when there is no ``LOCK``."""
    try:
        fd = os.open(os.path.join(path, LOCK_NAME), _RDONLY)
    except FileNotFoundError:
        return -1
    except OSError as e:
        raise ConfigError(f"{path}: cannot open {LOCK_NAME}: {e.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConfigError(f"{path} is in use by {_who(holder_pid(path))} (it holds {LOCK_NAME}): a live "
                          f"directory cannot be checked ({what}); stop the writer, or inspect without "
                          "--verify/--repair") from None
    except OSError as e:
        os.close(fd)
        raise ConfigError(f"{path}: cannot lock {LOCK_NAME}: {e.strerror}") from None
    return fd


# -- reading ------------------------------------------------------------------------------
def _scan(path: str, verify: bool, live: Optional[int], bad_out: Optional[list] = None,
          progress: Optional[Callable[[int, int], None]] = None) -> dict[str, Any]:
    """The report.  ``live``: a writer's pid (files are then not judged).  ``bad_out`` receives
    (region, offset, seq) of each corrupt record found by ``verify``."""
    judge = live is None
    rdir = os.path.join(path, REGIONS_DIR)
    regions: dict[int, R.Region] = {}
    sizes: dict[int, int] = {}
    skipped: list[dict] = []  # files the tier does not read (not judged corrupt)
    bad_files: list[dict] = []  # region files of ours that fail their header check
    fds: list[int] = []
    try:
        names = sorted(os.listdir(rdir)) if os.path.isdir(rdir) else []
        for name in names:
            rel = os.path.join(REGIONS_DIR, name)
            idx = R.parse_region_name(name)
            if idx is None:
                skipped.append({"file": rel, "reason": "not a region file name"})
                continue
            try:
                fd = os.open(os.path.join(rdir, name), _RDONLY)
            except OSError as e:
                bad_files.append({"file": rel, "reason": f"unreadable: {e.strerror}"})
                continue
            fds.append(fd)
            try:
                head = bytes(R.read_span(fd, 0, F.BLOCK, False))
            except OSError as e:
                bad_files.append({"file": rel, "reason": f"unreadable: {e.strerror}"})
                continue
            h = F.parse_region_header(head)
            if h is None:
                if any(head):
                    bad_files.append({"file": rel, "index": idx, "reason": "bad region header"})
                else:
                    skipped.append({"file": rel, "reason": "no header (a region file never written)"})
                continue
            if h.index != idx:
                bad_files.append({"file": rel, "index": idx, "reason": f"its header names region {h.index}"})
                continue
            r = R.Region(idx, os.path.join(rdir, name))
            r.fd, r.seq = fd, h.seq
            regions[idx] = r
            sizes[idx] = h.region_size
        counts = list(sizes.values())
        region_size = max(set(counts), key=counts.count) if counts else 0
        for idx in [i for i, s in sizes.items() if s != region_size]:
            r = regions.pop(idx)
            skipped.append({"file": os.path.join(REGIONS_DIR, os.path.basename(r.path)),
                            "reason": f"region size {sizes[idx]}, the others' {region_size}"})
        ckpt = C.read(path)
        ckpt_info = {"present": os.path.exists(os.path.join(path, C.NAME)), "valid": ckpt is not None,
                     "objects": int(np.count_nonzero(~_pieces_of(ckpt))) if ckpt is not None else 0,
                     "covered_seq": ckpt.covered_seq if ckpt is not None else None}
        if ckpt is not None and ckpt.region_size != region_size and regions:
            ckpt = None
        dead = deadlog.read(path)
        if ckpt is not None:  # what the checkpoint lists, alive, in a region file that fails or is gone is lost
            lost_in = _listed_alive(ckpt, dead)
            for b in bad_files:
                if "index" in b:
                    b["objects_lost"] = int(lost_in[b["index"]]) if b["index"] < len(lost_in) else 0
            present = {R.parse_region_name(n) for n in names}
            for idx in np.flatnonzero(lost_in).tolist():
                if idx not in present:
                    bad_files.append({"file": os.path.join(REGIONS_DIR, R.region_name(idx)), "index": idx,
                                      "reason": "missing", "objects_lost": int(lost_in[idx])})
        loaded = reopen.load(path, regions, region_size, False, ckpt, dead) if regions else None
        c = loaded.cands if loaded is not None else None
        corrupt: list[dict] = []
        checked = ["region headers", "checkpoint", "dead log"]
        if loaded is not None and len(loaded.read_regions) > len(loaded.scanned):
            checked.append(f"summaries of {len(loaded.read_regions) - len(loaded.scanned)} region(s) the "
                           "checkpoint does not cover")
        if loaded is not None and loaded.scanned:
            checked.append(f"every record of {len(loaded.scanned)} unsealed region(s)")
        unverified = 0
        large = _Large(c, region_size) if c is not None else None
        if verify and c is not None and large is not None:
            keys = reopen.key_list(c)
            for i, k in enumerate(keys):
                if progress is not None and not i % 4096:
                    progress(i, len(keys))
                idx, off, n = int(c.region[i]), int(c.offset[i]), int(c.rec_len[i])
                start: list = []
                why = _check_record(regions[idx].fd, off, n, regions[idx].seq, k.encode(), start)
                if large.part(i, k, why, start):  # a piece or a manifest: judged with its object below
                    continue
                if why is None:
                    continue
                if why == _CANNOT_TELL:
                    unverified += 1
                    continue
                corrupt.append({"key": k, "region": idx, "offset": off, "reason": why})
                if bad_out is not None:
                    bad_out.append((idx, off, regions[idx].seq))
            if progress is not None:
                progress(len(keys), len(keys))
            checked.append("every object's record: header, key, seq, length, payload sum")
        if c is not None and large is not None and large.any and judge:  # (whole or damaged: all its pieces)
            keys_of = reopen.key_list(c)
            damaged = large.damaged()
            unverified += len(large.unverified)
            for m, why in sorted(damaged.items()):
                corrupt.append({"key": keys_of[m], "region": int(c.region[m]), "offset": int(c.offset[m]),
                                "reason": why})
                if bad_out is not None:
                    bad_out += [(int(c.region[j]), int(c.offset[j]), regions[int(c.region[j])].seq)
                                for j in large.records_of(m)]
            if verify:
                checked.append("every large object's pieces: present, intact, of its manifest's put")
        if judge:
            corrupt = bad_files + corrupt
        else:
            skipped += [{**b, "reason": b["reason"] + " (not judged: a writer is live)"} for b in bad_files]
            checked = [f"nothing judged: a writer ({_who(live)}) holds the directory; read as it changed"]
        out_regions = []
        nreg = max(regions, default=-1) + 1
        counts_of = np.bincount(c.region, minlength=nreg) if c is not None else np.zeros(nreg, dtype=np.int64)
        bytes_of = np.bincount(c.region, weights=c.rec_len, minlength=nreg) if c is not None else \
            np.zeros(nreg)
        for idx, r in sorted(regions.items()):
            st = os.fstat(r.fd)
            out_regions.append({
                "index": idx, "seq": r.seq, "objects": int(counts_of[idx]), "live_bytes": int(bytes_of[idx]),
                "size_bytes": region_size, "file_bytes": st.st_size,
                "sealed": R.read_summary(r.fd, region_size, r.seq, False) is not None,
                "read": loaded is not None and idx in loaded.read_regions})
        # (a large object is its manifest, at its full size: its pieces are no objects of their own, ``large.py``)
        whole = ~L.piece_mask(c.key_len, c.key_start, c.keys) if c is not None else np.zeros(0, dtype=bool)
        return {
            "path": path, "layout": "regions", "region_size": region_size, "regions": out_regions,
            "objects": int(whole.sum()),
            "bytes": int(c.raw_len[whole].sum()) if c is not None else 0,
            "corrupt": len(corrupt), "corrupt_keys": [e["key"] for e in corrupt if "key" in e],
            "corrupt_objects": corrupt, "unverified": unverified, "repaired": 0, "removed": [],
            "torn_regions": loaded.torn if loaded is not None else 0,
            "recovered_from": loaded.source if loaded is not None else "empty",
            "skipped_files": skipped, "checkpoint": ckpt_info, "verified": verify, "checked": checked,
            "live_writer": live,
        }
    finally:
        for fd in fds:
            os.close(fd)


_CANNOT_TELL = "cannot tell"


def _pieces_of(ckpt: C.Checkpoint) -> np.ndarray:
    """Which entries of a checkpoint are pieces of large objects (no objects of their own, ``large.py``)."""
    return L.piece_mask(ckpt.cols["key_len"].astype(np.int64), ckpt.key_offs[:-1].astype(np.int64), ckpt.keys)


def _listed_alive(ckpt: C.Checkpoint, dead: np.ndarray) -> np.ndarray:
    """Per region index: how many objects the checkpoint lists there that the dead log does not name (a
    large object by its manifest; one whose pieces alone are there is reported by its key)."""
    reg = ckpt.cols["region"].astype(np.int64)
    if not len(reg):
        return np.zeros(0, dtype=np.int64)
    seqs = ckpt.region_seqs
    ok = (reg < len(seqs)) & ~_pieces_of(ckpt)
    reg = reg[ok]
    alive = np.ones(len(reg), dtype=bool)
    if len(dead):
        alive = ~np.isin(deadlog.dead_keys(reg, ckpt.cols["offset"][ok], seqs[reg]), dead)
    return np.bincount(reg[alive], minlength=int(reg.max()) + 1 if len(reg) else 0)


def _check_record(fd: int, offset: int, rec_len: int, seq: int, key: bytes,
                  head: Optional[list] = None) -> Optional[str]:
    """None when the record at ``offset`` is ``key``'s, intact; else why not.  ``head`` receives the first
    ``TABLE.size`` bytes of an intact record's payload (a manifest's table, a piece's nonce; ``large.py``)."""
    try:
        data = R.read_span(fd, offset, rec_len, False)
    except OSError as e:
        return f"unreadable: {e.strerror}"
    if len(data) < rec_len:
        return "short: the file ends inside the record"
    klen = F.record_key_len(data)
    if F.REC_HDR + klen > len(data):
        return "bad record header"
    h = F.parse_record_header(data[:F.REC_HDR], bytes(data[F.REC_HDR:F.REC_HDR + klen]))
    if h is None:
        return "bad record header"
    if h.key != key:
        return "another key's record"
    if h.seq != seq:
        return "stale record (an earlier use of the region)"
    if h.rec_len != rec_len:
        return "record length differs from the index"
    if h.flags & F.FLAG_TOMB:
        return None
    body = data[h.body_at:h.rec_len]
    s = F.payload_sum([body], h.flags)
    if s is None:
        return _CANNOT_TELL
    if s != h.psum:
        return "payload sum mismatch"
    if head is not None:
        head.append(_payload_head(body, h))
    return None


def _payload_head(body, h: F.RecordHeader) -> Optional[bytes]:
    """The first ``L.TABLE.size`` bytes of a record's payload as stored by the put (decompressed); None when
    they cannot be had here (lz4 missing)."""
    n = L.TABLE.size
    if not h.flags & F.FLAG_LZ4:
        return bytes(body[:n])
    try:
        import lz4.block

        return lz4.block.decompress(bytes(body), uncompressed_size=h.raw_len)[:n]
    except Exception:  # noqa: BLE001 - (no lz4 here, or a payload that does not decompress: not judged)
        return None


class _Large:
    """The large objects among the objects found (``large.py``): which records are their parts, and what
    ails each (a part that fails its check, a piece missing, a piece of another put).  A large object is
    reported, and repaired, whole, under the key its user stored."""

    def __init__(self, c: reopen.Candidates, region_size: int) -> None:
        self.geom = L.Geometry.of(region_size)
        self.cols = (c.digest, c.raw_len, c.key_start, c.key_len, c.keys, self.geom)
        self.pieces, at, claim = L.claims(*self.cols, None)
        self.owner = np.full(len(c.digest), -1, dtype=np.int64)  # the manifest of each piece claimed
        self.owner[at] = claim
        self.manifest = ~self.pieces & (c.raw_len > self.geom.single)
        self.raw_len = c.raw_len
        self.any = bool(self.manifest.any()) or bool(len(at))
        self.why: dict[int, str] = {}  # manifest position -> the first fault found
        self.nonce: dict[int, Optional[bytes]] = {}  # manifest -> its put's nonce; piece -> the nonce it carries
        self.unverified: set[int] = set()  # manifests one of whose parts could not be checked here

    def part(self, i: int, key: str, why: Optional[str], head: list) -> bool:
        """Take the check of record ``i`` (key ``key``): True when it is part of a large object (or a piece no
        manifest claims, no object: the tier drops it at open)."""
        if self.pieces[i]:
            m = int(self.owner[i])
            if m >= 0:
                self._judge(m, f"piece {int(key[17:], 16)} of {self.count(m)}", why)
                self.nonce[i] = head[0][:L.NONCE] if head and head[0] is not None else None
            return True
        if not self.manifest[i]:
            return False
        self._judge(i, "manifest", why)
        if head and head[0] is not None:
            t = L.parse_table(head[0], self.geom)
            if t is None or t.total != int(self.raw_len[i]):
                self.why.setdefault(i, "manifest: not a table of this object")
            else:
                self.nonce[i] = t.nonce.to_bytes(L.NONCE, "little")
        return True

    def _judge(self, m: int, what: str, why: Optional[str]) -> None:
        if why == _CANNOT_TELL:
            self.unverified.add(m)
        elif why is not None:
            self.why.setdefault(m, f"{what}: {why}")

    def count(self, m: int) -> int:
        return self.geom.layout(int(self.raw_len[m]))[0]

    def damaged(self) -> dict[int, str]:
        """Manifest position -> why, for every large object that cannot read whole."""
        out = dict(self.why)
        for m in np.flatnonzero(L.incomplete(*self.cols)).tolist():
            have = int(np.count_nonzero(self.owner == m))
            out.setdefault(m, f"{self.count(m) - have} of its {self.count(m)} pieces missing")
        for i in np.flatnonzero(self.owner >= 0).tolist():
            m = int(self.owner[i])
            mine, seen = self.nonce.get(m), self.nonce.get(i)
            if mine is not None and seen is not None and seen != mine:
                out.setdefault(m, "a piece of another put of the key (a put cut short)")
        for m in out:
            self.unverified.discard(m)
        return out

    def records_of(self, m: int) -> list[int]:
        """Positions of a large object's records: its manifest and every piece found."""
        return [m, *np.flatnonzero(self.owner == m).tolist()]


# -- repair -------------------------------------------------------------------------------
def _repair(path: str, progress: Optional[Callable[[int, int], None]] = None) -> dict[str, Any]:
    """Under the writer lock: verify, name each corrupt record in the dead log, report what is left."""
    lock = DirLock(path, f"ssd repair of {path}")  # a live writer is refused, naming its pid
    try:
        bad: list = []
        before = _scan(path, verify=True, live=None, bad_out=bad, progress=progress)
        if bad:
            log = deadlog.DeadLog(path)
            existed = os.path.exists(log.path)
            for rg, off, sq in bad:
                log.add(rg, off, sq)
            try:
                log.write(fsync=True)
                if not existed:
                    _fsync_dir(path)
            except OSError as e:
                raise ConfigError(f"{path}: repair could not write {log.path}: {e.strerror}; "
                                  "nothing was removed") from None
        after = _scan(path, verify=False, live=None)  # (what is left was verified above, under the same lock)
    finally:
        lock.release()
    after.update(verified=True, checked=before["checked"], unverified=before["unverified"])
    removed = [e for e in before["corrupt_objects"] if "key" in e]
    after["repaired"] = len(removed)
    after["removed"] = removed
    return after


def _fsync_dir(path: str) -> None:
    fd = os.open(path, _RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
