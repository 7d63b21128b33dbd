"""Opening a directory: what survives, from a checkpoint plus the regions written after it.

Sources of candidate entries, each (digest, region, seq, offset, rec_len, raw_len, flags, key):

* the checkpoint, for regions whose on-disk seq still matches the one it lists and is
  older than its ``covered_seq`` (those regions are not read at all);
* every other region: its summary when it was sealed (one read), else a scan of its
  records (one read of the region), which stops at the first record failing its checks
  (a torn tail).

Resolution is the log's order: for each digest the entry of the highest (seq, offset)
wins.  Records named in the dead log (``deadlog.py``) are dropped first: removed,
replaced or moved, they are no objects.  All of it is vectorised.
"""

from __future__ import annotations

import logging
from typing import NamedTuple, Optional

import numpy as np

from . import checkpoint as C
from . import format as F
from . import region as R
from .deadlog import dead_keys

log = logging.getLogger(__name__)


class Candidates(NamedTuple):
    digest: np.ndarray
    region: np.ndarray
    seq: np.ndarray
    offset: np.ndarray
    rec_len: np.ndarray
    raw_len: np.ndarray
    flags: np.ndarray
    key_start: np.ndarray  # into ``keys``
    key_len: np.ndarray
    keys: "bytes | memoryview"


class Scanned(NamedTuple):
    """An unsealed region read at open: what its summary will say."""
    entries: np.ndarray
    keys: bytes
    end: int


class Loaded(NamedTuple):
    cands: Candidates  # resolved: live objects only, oldest first
    source: str  # "checkpoint", "summaries" or "empty"
    read_regions: list  # region indices read (not covered by the checkpoint)
    scanned: dict  # region index -> Scanned (unsealed regions)
    torn: int  # regions whose records stopped at a bad record before their end
    tombstones: dict  # region index -> tombstones it holds (among those read)
    #: objects the checkpoint lists, named in no dead log, in a region file gone or begun again (another seq)
    #: since: lost with it unless a later record of the key was found (then in ``cands``)
    unreached: Optional[Candidates] = None


def _empty() -> dict:
    return {k: [] for k in ("digest", "region", "seq", "offset", "rec_len", "raw_len", "flags", "key_start",
                            "key_len")}


def load(dirpath: str, regions: dict, region_size: int, direct: bool, ckpt: Optional[C.Checkpoint],
         dead: Optional[np.ndarray] = None) -> Loaded:
    """Collect and resolve candidates.  ``regions``: index -> Region with fd and seq set (valid headers only)."""
    parts = _empty()
    unreached: Optional[Candidates] = None
    blobs: list = []
    base = 0
    covered: set[int] = set()
    source = "empty"
    if ckpt is not None and ckpt.region_size == region_size:
        source = "checkpoint"
        seqs = ckpt.region_seqs
        for idx, r in regions.items():
            if idx < len(seqs) and int(seqs[idx]) == r.seq and r.seq < ckpt.covered_seq:
                covered.add(idx)
        cols = ckpt.cols
        reg = cols["region"].astype(np.int64)
        ok = np.zeros(len(reg), dtype=bool)
        if len(reg):
            cur = np.zeros(int(reg.max()) + 1, dtype=np.uint64)
            for idx, r in regions.items():
                if idx < len(cur):
                    cur[idx] = r.seq
            ok = (cur[reg] == seqs[np.minimum(reg, len(seqs) - 1)]) & (reg < len(seqs))
        sel: slice | np.ndarray = slice(None) if ok.all() else np.flatnonzero(ok)  # (a slice copies nothing)
        if not isinstance(sel, slice):
            out = np.flatnonzero(~ok)
            unreached = Candidates(
                cols["digest"][out].astype(np.uint64), reg[out], seqs[np.minimum(reg[out], len(seqs) - 1)],
                cols["offset"][out].astype(np.int64), cols["rec_len"][out].astype(np.int64),
                cols["raw_len"][out].astype(np.int64), np.zeros(len(out), dtype=np.uint8),
                ckpt.key_offs[:-1][out].astype(np.int64), cols["key_len"][out].astype(np.int64), ckpt.keys)
            if dead is not None and len(dead):
                unreached = take(unreached, np.flatnonzero(~np.isin(
                    dead_keys(unreached.region, unreached.offset, unreached.seq), dead)))
        parts["digest"].append(cols["digest"][sel])
        parts["region"].append(reg[sel])
        parts["seq"].append(seqs[reg[sel]])
        parts["offset"].append(cols["offset"][sel])
        parts["rec_len"].append(cols["rec_len"][sel])
        parts["raw_len"].append(cols["raw_len"][sel])
        parts["flags"].append(np.zeros(len(reg[sel]), dtype=np.uint8))
        parts["key_start"].append(ckpt.key_offs[:-1][sel] + base)
        parts["key_len"].append(cols["key_len"][sel])
        blobs.append(ckpt.keys)
        base += len(ckpt.keys)
    elif any(True for _ in regions):
        source = "summaries"
    read_regions, scanned, tombstones = [], {}, {}
    torn = 0
    for idx in sorted(regions, key=lambda i: regions[i].seq):
        if idx in covered:
            continue
        r = regions[idx]
        read_regions.append(idx)
        got = R.read_summary(r.fd, region_size, r.seq, direct)
        if got is not None:
            entries, keys, offs = got
            r.sum_start = F.summary_start(region_size, len(entries), len(keys))
        else:
            try:
                data = R.read_span(r.fd, 0, region_size, direct)
            except OSError as e:
                log.warning("ssd: cannot read region %s: %s", r.path, e)
                continue
            entries, keys, offs, end = R.scan(data, r.seq)
            del data
            scanned[idx] = Scanned(entries, keys, end)
            if end + F.REC_HDR <= region_size and len(entries) and _looks_torn(r, end, direct):
                torn += 1
        n = len(entries)
        tombstones[idx] = int(np.count_nonzero(entries["flags"] & F.FLAG_TOMB))
        parts["digest"].append(entries["digest"])
        parts["region"].append(np.full(n, idx, dtype=np.int64))
        parts["seq"].append(np.full(n, r.seq, dtype=np.uint64))
        parts["offset"].append(entries["offset"])
        parts["rec_len"].append(entries["rec_len"])
        parts["raw_len"].append(entries["raw_len"])
        parts["flags"].append(entries["flags"])
        parts["key_start"].append(offs[:-1] + base)
        parts["key_len"].append(entries["key_len"])
        blobs.append(keys)
        base += len(keys)
    in_order = not read_regions  # a checkpoint alone: unique entries, written oldest first
    cat = {k: (np.concatenate(v) if len(v) > 1 else v[0] if v else np.zeros(0, dtype=np.int64))
           for k, v in parts.items()}
    keys = b"".join(blobs) if len(blobs) != 1 else blobs[0]
    cands = Candidates(  # (astype copies only where the type changes)
        cat["digest"].astype(np.uint64, copy=False), cat["region"].astype(np.int64, copy=False),
        cat["seq"].astype(np.uint64, copy=False), cat["offset"].astype(np.int64, copy=False),
        cat["rec_len"].astype(np.int64, copy=False), cat["raw_len"].astype(np.int64, copy=False),
        cat["flags"].astype(np.uint8, copy=False), cat["key_start"].astype(np.int64, copy=False),
        cat["key_len"].astype(np.int64, copy=False), keys)
    if dead is not None and len(dead) and len(cands.digest):  # records that died after they were written
        alive = ~np.isin(dead_keys(cands.region, cands.offset, cands.seq), dead)
        cands = take(cands, np.flatnonzero(alive))
    return Loaded(cands if in_order else resolve(cands), source, read_regions, scanned, torn, tombstones, unreached)


def _looks_torn(r, end: int, direct: bool) -> bool:
    """Whether bytes follow the last good record (a torn tail), rather than clean zeros."""
    try:
        b = R.read_span(r.fd, end, F.REC_HDR, direct)
    except OSError:
        return False
    return any(b)


def take(c: Candidates, sel: np.ndarray) -> Candidates:
    return Candidates(*(a[sel] for a in c[:-1]), c.keys)  # type: ignore[call-arg]  # one array per field but keys


def resolve(c: Candidates) -> Candidates:
    """The winner per digest in log order, tombstones dropped, oldest first."""
    n = len(c.digest)
    if n == 0:
        return c
    order = np.lexsort((c.offset, c.seq, c.digest))
    d = c.digest[order]
    last = np.ones(n, dtype=bool)
    last[:-1] = d[1:] != d[:-1]
    win = order[last]
    win = win[(c.flags[win] & F.FLAG_TOMB) == 0]
    win = win[np.lexsort((c.offset[win], c.seq[win]))]
    return take(c, win)


def key_list(c: Candidates) -> list[str]:
    """The candidates' keys as strings, in order."""
    return _keys(c, None)


def listing(c: Candidates) -> list[tuple[str, int]]:
    """(key, raw_len) of each candidate, in order: what ``recover()`` hands the store, made in one pass."""
    return _keys(c, c.raw_len.tolist())


def _keys(c: Candidates, sizes: Optional[list]) -> list:
    """The keys as strings, or with ``sizes`` (key, size) pairs."""
    import gc

    keys = c.keys
    gc_was = gc.isenabled()
    gc.disable()  # a million new strings would run the cycle collector over and over, for nothing
    try:
        n = len(c.key_len)
        strs = _split_one_length(c) if n else []
        if strs is None:
            try:
                text = str(keys, "ascii")  # one decode; byte offsets are character offsets
            except UnicodeDecodeError:
                text = None
            spans = zip(c.key_start.tolist(), c.key_len.tolist())
            if text is not None:
                strs = [text[a:a + k] for a, k in spans]
            else:
                strs = [str(keys[a:a + k], "utf-8", "replace") for a, k in spans]
        return strs if sizes is None else list(zip(strs, sizes))
    finally:
        if gc_was:
            gc.enable()


def _split_one_length(c: Candidates) -> Optional[list]:
    """The keys as strings when they are ASCII, of one length and back to back (the store's content
    addresses), made by one ``str.split`` over a copy of them with a newline after each (the strings
    made in C, not by a slice each); None when that does not apply (some key holds a newline)."""
    n = len(c.key_len)
    m = int(c.key_len[0])
    if not m or int(c.key_len.min()) != m or int(c.key_len.max()) != m:
        return None
    s0 = int(c.key_start[0])
    if n > 1 and not bool((np.diff(c.key_start) == m).all()):
        return None
    lined = np.empty((n, m + 1), dtype=np.uint8)
    lined[:, :m] = np.frombuffer(c.keys, dtype=np.uint8, count=n * m, offset=s0).reshape(n, m)
    lined[:, m] = 10
    try:
        text = str(lined.reshape(-1).data, "ascii")
    except UnicodeDecodeError:
        return None
    del lined
    strs = text.split("\n")
    if len(strs) != n + 1:  # (some key holds a newline)
        return None
    strs.pop()  # (after the last newline)
    return strs
