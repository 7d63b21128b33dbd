"""``inspect_dir``: what an ``ssd`` directory holds, for the operator's ``tierkv inspect``.

Read-only unless ``repair=True``: it opens files for reading only, takes no lock (so it
works while a writer holds the directory) and changes nothing.  ``verify=True`` reads
every live object and checks its sums.  ``repair=True`` takes the writer lock (a
``ConfigError`` naming the holder if a writer is running), verifies everything and
drops the corrupt objects.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from tierkv.errors import ConfigError

from . import checkpoint as C
from . import deadlog, recovery
from . import format as F
from . import region as R


def inspect_dir(path: str, verify: bool = False, repair: bool = False) -> dict[str, Any]:
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isdir(path):
        raise ConfigError(f"ssd inspect: {path} is not a directory")
    if repair:
        return _repair(path)
    from .tier import REGIONS_DIR, check_old_layout

    try:
        check_old_layout(path)
        layout = "regions"
    except ConfigError:
        layout = "files-per-object (old)"
    rdir = os.path.join(path, REGIONS_DIR)
    regions: dict[int, R.Region] = {}
    others: list[str] = []
    fds = []
    try:
        for name in sorted(os.listdir(rdir)) if os.path.isdir(rdir) else []:
            idx = R.parse_region_name(name)
            if idx is None:
                others.append(name)
                continue
            r = R.Region(idx, os.path.join(rdir, name))
            try:
                r.fd = os.open(r.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            except OSError:
                others.append(name)
                continue
            fds.append(r.fd)
            h, _ = R.read_header(r.fd, False)
            if h is None or h.index != idx:
                others.append(name)
                continue
            r.seq = h.seq
            r.live_bytes = h.region_size  # (the region's size, until counted below)
            regions[idx] = r
        sizes = [r.live_bytes for r in regions.values()]
        region_size = max(set(sizes), key=sizes.count) if sizes else 0
        regions = {i: r for i, r in regions.items() if r.live_bytes == region_size}
        ckpt = C.read(path)
        ckpt_info = {"present": os.path.exists(os.path.join(path, C.NAME)), "valid": ckpt is not None,
                     "objects": len(ckpt.cols["digest"]) if ckpt is not None else 0,
                     "covered_seq": ckpt.covered_seq if ckpt is not None else None}
        if ckpt is not None and ckpt.region_size != region_size:
            ckpt = None
        loaded = recovery.load(path, regions, region_size, False, ckpt, deadlog.read(path)) if regions else None
        c = loaded.cands if loaded is not None else None
        corrupt: list[str] = []
        if verify and c is not None:
            for i, k in enumerate(recovery.key_list(c)):
                r = regions[int(c.region[i])]
                data: memoryview | bytes
                try:
                    data = R.read_span(r.fd, int(c.offset[i]), int(c.rec_len[i]), False)
                except OSError:
                    data = b""
                h = F.parse_record(data, r.seq)
                if h is None or h.key != k.encode():
                    corrupt.append(k)
        out_regions = []
        for idx, r in sorted(regions.items()):
            sel = np.flatnonzero(c.region == idx) if c is not None else np.zeros(0, dtype=np.int64)
            st = os.fstat(r.fd)
            out_regions.append({
                "index": idx, "seq": r.seq, "objects": int(len(sel)),
                "live_bytes": int(c.rec_len[sel].sum()) if c is not None and len(sel) else 0,
                "size_bytes": region_size, "file_bytes": st.st_size,
                "sealed": R.read_summary(r.fd, region_size, r.seq, False) is not None,
                "read": loaded is not None and idx in loaded.read_regions})
        return {
            "path": path, "layout": layout, "region_size": region_size, "regions": out_regions,
            "objects": int(len(c.digest)) if c is not None else 0,
            "bytes": int(c.raw_len.sum()) if c is not None else 0,
            "corrupt": len(corrupt), "corrupt_keys": corrupt[:100], "repaired": 0,
            "torn_regions": loaded.torn if loaded is not None else 0,
            "recovered_from": loaded.source if loaded is not None else "empty",
            "skipped_files": others, "checkpoint": ckpt_info,
        }
    finally:
        for fd in fds:
            os.close(fd)


def _repair(path: str) -> dict[str, Any]:
    """Verify under the writer lock and drop what fails."""
    report = inspect_dir(path, verify=True)
    from .tier import SSDTier

    nreg = max(1, len(report["regions"]))
    size = report["region_size"] or (64 << 20)
    tier = SSDTier("inspect", nreg * size, path, direct_io=False, region_size=size)  # takes the lock
    try:
        tier.recover()
        if report["corrupt_keys"]:
            tier.delete(report["corrupt_keys"])
        tier.flush()
    finally:
        tier.close()
    out = inspect_dir(path, verify=True)
    out["repaired"] = report["corrupt"]
    return out
