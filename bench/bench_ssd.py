"""Benchmarks of the ssd tier's log engine, each figure beside a baseline measured in the same run.

    .venv/bin/python bench/bench_ssd.py [--quick] [--dir DIR] [--json out.json]

* put / get of 256 KiB, 2 MiB and 4 MiB objects (batches of 8) vs raw sequential
  ``pwrite`` / ``pread`` of the same bytes into one file on the same file system
  (O_DIRECT on both sides when the tier uses it).  Both sides end a put round durable: the
  raw side with one ``fsync``, the tier with ``flush()`` (its regions and dead log synced, and
  a checkpoint the writer took on its own, if any).  Both overwrite blocks written before: the
  raw file is preallocated once and rewritten each round; the tier, its objects removed between
  rounds, writes into the region files earlier rounds wrote, as a full tier cycling its regions does;
* the store's write-behind (``dram`` -> ``ssd``, puts and ``flush()`` timed) of 2 MiB and 4 MiB objects vs raw
  ``pwrite`` of the same bytes from huge-page buffers, and the same drain through a staged copy;
* 16 KiB puts/s and gets/s from the page cache (``direct_io: false``, batches of 32) vs raw
  ``pwrite`` / ``pread`` of 16 KiB (targets ≥ 50 K puts/s, ≥ 100 K gets/s);
* reopen of 1 M objects (``--quick``: 200 K) from the checkpoint (target ≤ 1 s) and from the
  region summaries alone (≤ 10 s), vs a raw read of the same files;
* the index's bytes per object at that count (target ≤ 64);
* ``--sections open``: opening a ``TieredStore`` whose ``ssd`` tier holds 1 M and 10 M objects
  (``--open-objects``; ``--quick``: 200 K) beside the tier's own recovery of the same directory
  (``SSDTier`` + ``recover()``), alternating rounds: the store's extra time per object (target ≤ 1 µs).
  Directories of ``--synthetic-from`` objects or more (default 2 M) are built synthetically: sealed
  regions holding a header and a summary, no payloads (``build_synthetic``), opened once to write the
  checkpoint; smaller ones by writing each object.
Ratios are tier / baseline throughput (above 1: faster than the baseline), medians of paired rounds;
the large objects' get rounds alternate the two sides batch by batch (see ``interleaved``).

The raw side's buffers are page-aligned copies of the objects in ordinary 4 KiB pages, as a caller's
memory is.  The tier stages its writes in region images of transparent huge pages
(``format.aligned_buffer``), which a virtual disk takes much faster.  Each large size also measures
both sides from huge-page memory (``put_staged_*`` against ``raw_write_huge_GiBps``): the raw side
from huge-page buffers, the tier from the objects staged in a ``tierkv.hostmem.StagingArena`` as the
store's write-behind stages them, which it writes from where they are (padded records, no copy).
``raw_read_huge_GiBps`` is a reference without a target.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from typing import Optional

import numpy as np
import torch

from tierkv import hostmem
from tierkv.hostmem import StagingArena
from tierkv.tiers.ssd import SSDTier
from tierkv.tiers.ssd.format import aligned_buffer

MiB = 1 << 20


def paired(base, fn, rounds: int, base_setup=None, setup=None, ratios=None):
    """(median base s, median tier s, median base/tier time ratio) of back-to-back rounds; ``ratios``, a list,
    receives every round's."""
    tb, tt = [], []
    ratios = [] if ratios is None else ratios
    for _ in range(rounds):
        if base_setup:
            base_setup()
        os.sync()  # each side starts without the other's dirty pages to write back
        t0 = time.perf_counter()
        base()
        b = time.perf_counter() - t0
        if setup:
            setup()
        os.sync()
        t0 = time.perf_counter()
        fn()
        t = time.perf_counter() - t0
        tb.append(b)
        tt.append(t)
        ratios.append(b / t)
    return statistics.median(tb), statistics.median(tt), statistics.median(ratios)


def quartiles(xs: list[float]) -> tuple[float, float]:
    """The first and third quartiles of ``xs`` (its middle half lies between them)."""
    if len(xs) < 2:
        return (xs[0], xs[0]) if xs else (float("nan"), float("nan"))
    q = statistics.quantiles(xs, n=4)
    return q[0], q[2]


class Raw:
    """Sequential pwrite / pread of the same objects into one preallocated file."""

    def __init__(self, path: str, sizes: list[int], direct: bool, huge: bool = False) -> None:
        self.path, self.direct, self.huge = path, direct, huge
        self.offs, pos = [], 0
        for n in sizes:
            self.offs.append(pos)
            pos += (n + 4095) // 4096 * 4096
        flags = os.O_RDWR | os.O_CREAT | (os.O_DIRECT if direct else 0)
        self.fd = os.open(path, flags, 0o600)
        os.posix_fallocate(self.fd, 0, pos)

    def buffers(self, srcs):
        if not self.direct:
            return [memoryview(s.numpy()) for s in srcs]
        if self.huge:  # one huge-page buffer, each object on a 4 KiB boundary (kept alive by its views)
            views = StagingArena().carve([(s.numel() + 4095) // 4096 * 4096 for s in srcs])
            for v, s in zip(views, srcs):
                v[:s.numel()].copy_(s)
            return [memoryview(v.numpy()) for v in views]
        out = []
        for s in srcs:  # O_DIRECT needs aligned memory: the baseline gets it for free
            b = aligned_buffer(s.numel(), huge=False)
            b[:s.numel()] = s.numpy().tobytes()
            out.append(memoryview(b)[:(s.numel() + 4095) // 4096 * 4096])
        return out

    def write(self, bufs, lo: int = 0, hi: Optional[int] = None, sync: bool = True) -> None:
        for b, off in zip(bufs[lo:hi], self.offs[lo:hi]):
            os.pwrite(self.fd, b, off)
        if sync:
            os.fsync(self.fd)

    def read(self, bufs, lo: int = 0, hi: Optional[int] = None) -> None:
        for b, off in zip(bufs[lo:hi], self.offs[lo:hi]):
            os.preadv(self.fd, [b], off)

    def close(self) -> None:
        os.close(self.fd)
        os.unlink(self.path)


def interleaved(base_steps, steps, rounds: int, base_end=None, end=None, setup=None, ratios=None):
    """``paired`` at the grain of one batch: each round runs base batch 0, tier batch 0, base batch 1, ...
    (then ``base_end`` and ``end``, each timed with its side), so a device that changes its speed in the
    middle of a round (a virtual disk does, by 2-4x within seconds) slows both sides alike.  For reads:
    a side leaves nothing behind that the other's batches would pay for.  ``ratios`` as in ``paired``."""
    tb, tt = [], []
    ratios = [] if ratios is None else ratios
    for _ in range(rounds):
        if setup:
            setup()
        os.sync()
        b = t = 0.0
        for base_step, step in zip(base_steps, steps):
            t0 = time.perf_counter()
            base_step()
            t1 = time.perf_counter()
            step()
            t2 = time.perf_counter()
            b += t1 - t0
            t += t2 - t1
        if base_end:
            t0 = time.perf_counter()
            base_end()
            b += time.perf_counter() - t0
        if end:
            t0 = time.perf_counter()
            end()
            t += time.perf_counter() - t0
        tb.append(b)
        tt.append(t)
        ratios.append(b / t)
    return statistics.median(tb), statistics.median(tt), statistics.median(ratios)


def bench_large(root: str, size: int, total: int, rounds: int) -> dict:
    n = max(8, total // size)
    srcs = [torch.randint(0, 255, (size,), dtype=torch.uint8) for _ in range(n)]
    dsts = [torch.zeros(size, dtype=torch.uint8) for _ in range(n)]
    path = os.path.join(root, f"tier-{size}")
    t = SSDTier("ssd", 2 * n * size + 256 * MiB, path)
    raw = Raw(os.path.join(root, f"raw-{size}"), [size] * n, t.direct_io)
    rbufs = raw.buffers(srcs)
    dbufs = raw.buffers(dsts)
    keys = [f"o{size}-{i}" for i in range(n)]
    at = range(0, n, 8)

    def get(i: int):
        def step() -> None:
            assert all(t.read(keys[i:i + 8], [[d] for d in dsts[i:i + 8]]))
        return step

    def put_all() -> None:
        for i in at:
            t.write(keys[i:i + 8], [[s] for s in srcs[i:i + 8]])
        t.flush()

    # (puts pair whole rounds: a flush or fsync makes the device write back what either side left in
    # its cache, so batch by batch the side that syncs first would pay for both)
    put_ratios: list[float] = []
    get_ratios: list[float] = []
    raw_w, put_s, put_ratio = paired(lambda: raw.write(rbufs), put_all, rounds, setup=lambda: t.delete(keys),
                                     ratios=put_ratios)
    raw_r, get_s, get_ratio = interleaved([lambda i=i: raw.read(dbufs, i, i + 8) for i in at],
                                          [get(i) for i in at], rounds, ratios=get_ratios)
    assert all(torch.equal(a, b) for a, b in zip(srcs, dsts))
    # both sides from huge-page memory: the raw side's buffers, and for the tier the objects staged in a
    # ``StagingArena`` (as the store's write-behind stages them), which it writes from where they are
    huge = Raw(os.path.join(root, f"raw-huge-{size}"), [size] * n, t.direct_io, huge=True)
    hbufs, hdsts = huge.buffers(srcs), huge.buffers(dsts)
    arena = StagingArena()
    staged = arena.carve([size] * n)
    for v, s in zip(staged, srcs):
        v.copy_(s)
    written = t.extra_stats()["direct_writes"]

    def put_staged() -> None:
        for i in at:
            t.write(keys[i:i + 8], [[s] for s in staged[i:i + 8]])
        t.flush()

    huge_w, staged_s, staged_ratio = paired(lambda: huge.write(hbufs), put_staged, rounds,
                                            setup=lambda: t.delete(keys))
    direct_share = (t.extra_stats()["direct_writes"] - written) / (rounds * n)
    huge_r = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        huge.read(hdsts)
        huge_r.append(time.perf_counter() - t0)
    ok, outs = t.read(keys, [[d] for d in dsts]), dsts
    assert all(ok) and all(torch.equal(a, b) for a, b in zip(srcs, outs))
    arena.release()
    huge.close()
    direct = t.direct_io
    t.close()
    raw.close()
    shutil.rmtree(path)
    gb = n * size / 2**30
    return {"size_KiB": size >> 10, "objects": n, "direct_io": direct, "raw_write_GiBps": gb / raw_w,
            "put_GiBps": gb / put_s, "put_ratio": put_ratio, "raw_read_GiBps": gb / raw_r,
            "get_GiBps": gb / get_s, "get_ratio": get_ratio,
            "put_ratio_quartiles": quartiles(put_ratios), "get_ratio_quartiles": quartiles(get_ratios),
            "raw_write_huge_GiBps": gb / huge_w, "put_staged_GiBps": gb / staged_s,
            "put_staged_ratio": staged_ratio, "put_staged_direct_share": direct_share,
            "raw_read_huge_GiBps": gb / statistics.median(huge_r)}


def bench_behind(root: str, size: int, total: int, rounds: int) -> dict:
    """The store's write-behind into the ssd tier: ``dram`` (1 GiB) -> ``ssd``, each round's objects put
    (batches of 8) and ``flush()``ed, timed together: from the caller's tensors to durable on the SSD (the
    copies into the slab included; the background copies start while the puts go on).  Beside it, raw
    ``pwrite`` of the same bytes from huge-page buffers plus ``fsync``, paired round by round; and the same
    with the slab's views turned off (every chunk read into the staging arena first, the path of any
    source tier without views)."""
    from tierkv import TieredStore
    from tierkv.tiers.slab import SlabTier

    n = max(8, total // size)
    srcs = [torch.randint(0, 255, (size,), dtype=torch.uint8) for _ in range(n)]
    st = TieredStore.from_config({"tiers": [
        {"medium": "dram", "capacity": "1GiB"},
        {"medium": "ssd", "path": os.path.join(root, f"behind-{size}"), "capacity": f"{4 * n * size >> 20}MiB"}]})
    raw = Raw(os.path.join(root, f"raw-behind-{size}"), [size] * n, st.levels[1].tier.direct_io, huge=True)
    rbufs = raw.buffers(srcs)
    views = SlabTier.views_at
    state = {"round": 0}

    def setup(staged: bool):
        def run() -> None:
            SlabTier.views_at = (lambda self, codes: None) if staged else views  # type: ignore[method-assign]
            if "keys" in state:
                st.remove(state["keys"])
            state["round"] += 1
            state["keys"] = [f"b{size}-{state['round']}-{i}" for i in range(n)]
        return run

    def put_flush() -> None:
        keys = state["keys"]
        for i in range(0, n, 8):
            assert all(st.put(keys[i:i + 8], srcs[i:i + 8]))
        assert st.flush()

    try:
        raw_s, zc_s, zc_ratio = paired(lambda: raw.write(rbufs), put_flush, rounds, setup=setup(False))
        _, staged_s, staged_ratio = paired(lambda: raw.write(rbufs), put_flush, rounds, setup=setup(True))
        direct = st.levels[1].tier.extra_stats()["direct_writes"]
    finally:
        SlabTier.views_at = views  # type: ignore[method-assign]
        st.close()
        raw.close()
    gb = n * size / 2**30
    return {"size_KiB": size >> 10, "objects": n, "raw_write_huge_GiBps": gb / raw_s,
            "drain_GiBps": gb / zc_s, "drain_ratio": zc_ratio, "drain_staged_GiBps": gb / staged_s,
            "drain_staged_ratio": staged_ratio, "direct_writes": direct}


def bench_small(root: str, n: int, rounds: int) -> dict:
    size = 16 << 10
    srcs = [torch.randint(0, 255, (size,), dtype=torch.uint8) for _ in range(64)]
    dst = [torch.zeros(size, dtype=torch.uint8) for _ in range(32)]
    path = os.path.join(root, "tier-16k")
    t = SSDTier("ssd", n * 20 * 1024 + 256 * MiB, path, direct_io=False)
    raw = Raw(os.path.join(root, "raw-16k"), [size] * n, False)
    rviews = [memoryview(s.numpy()) for s in srcs]
    dview = memoryview(dst[0].numpy())
    keys = [f"{i:064x}" for i in range(n)]

    def raw_put():
        fd = raw.fd
        for i, off in enumerate(raw.offs):
            os.pwrite(fd, rviews[i & 63], off)

    def raw_get():
        fd = raw.fd
        for off in raw.offs:
            os.preadv(fd, [dview], off)

    def put():
        for i in range(0, n, 32):
            t.write(keys[i:i + 32], [[srcs[(i + j) & 63]] for j in range(32)])

    def get():
        for i in range(0, n, 32):
            t.read(keys[i:i + 32], [[d] for d in dst])

    raw_w, put_s, put_ratio = paired(raw_put, put, rounds, setup=lambda: t.delete(keys))
    t.flush()
    raw_r, get_s, get_ratio = paired(raw_get, get, rounds)
    ok = t.read(keys[:32], [[d] for d in dst])
    assert all(ok) and all(torch.equal(d, srcs[j & 63]) for j, d in enumerate(dst))
    t.close()
    raw.close()
    shutil.rmtree(path)
    return {"objects": n, "raw_puts_per_s": n / raw_w, "puts_per_s": n / put_s, "put_ratio": put_ratio,
            "raw_gets_per_s": n / raw_r, "gets_per_s": n / get_s, "get_ratio": get_ratio}


def _read_files(path: str) -> float:
    t0 = time.perf_counter()
    for r, _, fs in os.walk(path):
        for f in fs:
            with open(os.path.join(r, f), "rb") as fh:
                while fh.read(8 * MiB):
                    pass
    return time.perf_counter() - t0


def bench_reopen(root: str, n: int) -> dict:
    path = os.path.join(root, "tier-many")
    cap = n * 700 + 256 * MiB
    t = SSDTier("ssd", cap, path, direct_io=False)
    one = torch.ones(64, dtype=torch.uint8)
    t0 = time.perf_counter()
    step = 1000
    for i in range(0, n, step):
        t.write([f"{j:064x}" for j in range(i, min(n, i + step))], [[one]] * min(step, n - i))
    fill = time.perf_counter() - t0
    t.close()
    ckpt_bytes = os.path.getsize(os.path.join(path, "checkpoint"))
    t0 = time.perf_counter()
    ckpt_raw = time.perf_counter()
    with open(os.path.join(path, "checkpoint"), "rb") as f:
        f.read()
    ckpt_raw = time.perf_counter() - ckpt_raw
    t0 = time.perf_counter()
    t = SSDTier("ssd", cap, path, direct_io=False)
    got = t.recover()
    from_ckpt = time.perf_counter() - t0
    assert len(got) == n and t.extra_stats()["recovered_from"] == "checkpoint"
    index_bpo = t.index_bytes / len(got)
    del got
    t.close()
    os.unlink(os.path.join(path, "checkpoint"))
    regions_bytes = sum(os.path.getsize(os.path.join(path, "regions", f)) for f in os.listdir(os.path.join(path,
                                                                                                          "regions")))
    t0 = time.perf_counter()
    t = SSDTier("ssd", cap, path, direct_io=False)
    got = t.recover()
    from_summaries = time.perf_counter() - t0
    assert len(got) == n and t.extra_stats()["recovered_from"] == "summaries"
    regions = t.extra_stats()["regions"]
    del got
    t.close()
    raw_all = _read_files(os.path.join(path, "regions"))
    shutil.rmtree(path)
    return {"objects": n, "fill_s": fill, "checkpoint_MiB": ckpt_bytes / MiB, "raw_checkpoint_read_s": ckpt_raw,
            "reopen_checkpoint_s": from_ckpt, "regions": regions, "regions_MiB": regions_bytes / MiB,
            "raw_regions_read_s": raw_all, "reopen_summaries_s": from_summaries, "index_bytes_per_object": index_bpo}


def build_synthetic(path: str, n: int, region_size: int = 64 * MiB) -> None:
    """A directory of ``n`` objects of 64 bytes (keys ``f"{i:064x}"``), made without writing them: sealed
    regions holding only a header and a summary (sparse files), as ``SSDTier`` seals them.  An open reads
    the summaries alone and writes the checkpoint, so the next opens read the checkpoint, as after a clean
    close.  The payloads are zeros: any read of them fails its sum (this directory is for opening only)."""
    from tierkv.tiers.ssd import format as F
    from tierkv.tiers.ssd import region as R

    os.makedirs(os.path.join(path, "regions"), mode=0o700)
    os.chmod(path, 0o700)
    key_len, raw = 64, 64
    rec = F.record_len(key_len, raw)
    per = (region_size - F.BLOCK - F.FOOTER - F.BLOCK) // (F.align_up(rec, F.ALIGN) + F.ENTRY + key_len)
    for idx, lo in enumerate(range(0, n, per)):
        hi = min(n, lo + per)
        count = hi - lo
        keys = [f"{i:064x}".encode() for i in range(lo, hi)]
        e = np.zeros(count, dtype=F.ENTRY_DTYPE)
        e["digest"] = np.fromiter(map(F.key_digest, keys), dtype=np.uint64, count=count)
        e["offset"] = F.BLOCK + np.arange(count, dtype=np.uint64) * F.align_up(rec, F.ALIGN)
        e["rec_len"], e["raw_len"], e["key_len"] = rec, raw, key_len
        blob = b"".join(keys)
        tail = bytearray(region_size)  # (only its summary end is written)
        start = F.pack_summary(tail, region_size, idx + 1, e.tobytes(), blob, count)
        head = bytearray(F.BLOCK)
        F.pack_region_header(head, idx, idx + 1, region_size)
        fd = os.open(os.path.join(path, "regions", R.region_name(idx)), os.O_CREAT | os.O_WRONLY, 0o600)
        try:
            os.ftruncate(fd, region_size)
            os.pwrite(fd, bytes(head), 0)
            os.pwrite(fd, bytes(tail[start:]), start)
        finally:
            os.close(fd)
        del tail, keys, blob, e
    t = SSDTier("ssd", n * 700 + 256 * MiB, path, direct_io=False)  # from the summaries; writes the checkpoint
    got = t.recover()
    if len(got) != n:
        raise RuntimeError(f"the synthetic directory holds {len(got)} objects, not {n}")
    del got
    t.close()


def bench_open(root: str, n: int, rounds: int, synthetic: bool) -> dict:
    """Opening a ``TieredStore`` whose ``ssd`` tier holds ``n`` objects, beside the tier's own recovery
    (``SSDTier(...)`` + ``recover()``) of the same directory: alternating rounds, medians; the store's
    extra time per object is the figure (target <= 1 us)."""
    import gc

    from tierkv import TieredStore

    path = os.path.join(root, "tier-open")
    cap = n * 700 + 256 * MiB
    t0 = time.perf_counter()
    if synthetic:
        build_synthetic(path, n)
    else:
        t = SSDTier("ssd", cap, path, direct_io=False)
        one = torch.ones(64, dtype=torch.uint8)
        for i in range(0, n, 1000):
            t.write([f"{j:064x}" for j in range(i, min(n, i + 1000))], [[one]] * min(1000, n - i))
        t.close()
    fill = time.perf_counter() - t0
    cfg = {"tiers": [{"medium": "ssd", "path": path, "capacity": cap, "direct_io": False}]}
    tier_s, tier_cpu, store_s, store_cpu = [], [], [], []
    for r in range(rounds):
        for side in (("tier", "store") if r % 2 == 0 else ("store", "tier")):
            gc.collect()
            w0, c0 = time.perf_counter(), time.process_time()
            if side == "tier":
                t = SSDTier("ssd", cap, path, direct_io=False)
                got = t.recover()
                w, c = time.perf_counter() - w0, time.process_time() - c0
                if len(got) != n or t.extra_stats()["recovered_from"] != "checkpoint":
                    raise RuntimeError("the tier did not recover every object from the checkpoint")
                del got
                t.close()
                tier_s.append(w)
                tier_cpu.append(c)
            else:
                st = TieredStore.from_config(cfg)
                w, c = time.perf_counter() - w0, time.process_time() - c0
                if st.stats()["ssd"]["entries"] != n:
                    raise RuntimeError("the store did not index every object")
                st.close()
                store_s.append(w)
                store_cpu.append(c)
    shutil.rmtree(path)
    med = statistics.median
    return {"objects": n, "synthetic": synthetic, "fill_s": fill, "rounds": rounds,
            "tier_s": med(tier_s), "store_s": med(store_s), "tier_cpu_s": med(tier_cpu),
            "store_cpu_s": med(store_cpu),
            "extra_us_per_object": (med(store_s) - med(tier_s)) / n * 1e6,
            "extra_cpu_us_per_object": (med(store_cpu) - med(tier_cpu)) / n * 1e6}


class WriteLog:
    """Every ``os.pwrite`` / ``os.pwritev`` of this process timed, with its thread and size, while active."""

    def __init__(self) -> None:
        self.events: list[tuple[float, float, bool, int]] = []  # (start, end, on the main thread, bytes)
        self._real = (os.pwrite, os.pwritev)

    def __enter__(self) -> "WriteLog":
        pwrite, pwritev = self._real
        main = threading.main_thread()
        ev = self.events

        def timed_pwrite(fd, buf, offset):
            t0 = time.perf_counter()
            n = pwrite(fd, buf, offset)
            ev.append((t0, time.perf_counter(), threading.current_thread() is main, n))
            return n

        def timed_pwritev(fd, bufs, offset, *flags):
            t0 = time.perf_counter()
            n = pwritev(fd, bufs, offset, *flags)
            ev.append((t0, time.perf_counter(), threading.current_thread() is main, n))
            return n

        os.pwrite, os.pwritev = timed_pwrite, timed_pwritev  # type: ignore[assignment]
        return self

    def __exit__(self, *exc) -> None:
        os.pwrite, os.pwritev = self._real  # type: ignore[assignment]

    def idle(self, t0: float, t1: float) -> float:
        """Seconds of ``[t0, t1)`` with no write in flight (the device given nothing to do)."""
        busy, a0, b0 = 0.0, None, None
        for a, b, _, _ in sorted(self.events):
            if b0 is None or a > b0:
                if b0 is not None:
                    busy += b0 - a0
                a0, b0 = a, b
            else:
                b0 = max(b0, b)
        if b0 is not None:
            busy += b0 - a0
        return (t1 - t0) - busy


def bench_timeline(root: str, size: int, total: int, rounds: int) -> dict:
    """Where a put round leaves the device idle: every write timed, for the tier (batches of 8, ``flush()``)
    and for raw ``pwrite`` + ``fsync`` of the same bytes; medians over rounds of the idle time (no write in
    flight), the writes, and the small ones (< 64 KiB) the caller's own thread made.  Less at the mercy of
    the device's speed than the put ratio: the gaps are the writer's own work between writes."""
    n = max(8, total // size)
    srcs = [torch.randint(0, 255, (size,), dtype=torch.uint8) for _ in range(n)]
    path = os.path.join(root, f"timeline-{size}")
    t = SSDTier("ssd", 2 * n * size + 256 * MiB, path)
    raw = Raw(os.path.join(root, f"raw-timeline-{size}"), [size] * n, t.direct_io)
    rbufs = raw.buffers(srcs)
    keys = [f"t{size}-{i}" for i in range(n)]
    rows: dict[str, list] = {"tier": [], "raw": []}

    def measure(side: str, fn) -> None:
        os.sync()
        with WriteLog() as wl:
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
        small = sum(1 for _, _, main, nb in wl.events if main and nb < 64 << 10)
        rows[side].append((t1 - t0, wl.idle(t0, t1), len(wl.events), small))

    def put_all() -> None:
        for i in range(0, n, 8):
            t.write(keys[i:i + 8], [[s] for s in srcs[i:i + 8]])
        t.flush()

    for _ in range(rounds + 1):  # (the first: files fresh on both sides, not counted)
        t.delete(keys)
        measure("raw", lambda: raw.write(rbufs))
        measure("tier", put_all)
    t.close()
    raw.close()
    shutil.rmtree(path)
    out: dict = {"size_KiB": size >> 10, "objects": n, "rounds": rounds}
    for side, rs in rows.items():
        rs = rs[1:]
        out[side] = {"round_ms": statistics.median(r[0] for r in rs) * 1e3,
                     "idle_ms": statistics.median(r[1] for r in rs) * 1e3,
                     "idle_share": statistics.median(r[1] / r[0] for r in rs),
                     "writes": statistics.median(r[2] for r in rs),
                     "small_writes_on_caller": statistics.median(r[3] for r in rs)}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes and fewer rounds")
    ap.add_argument("--dir", help="directory on the file system to measure (default: a temp dir)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--pages", choices=("huge", "4k"), default="huge",
                    help="the tier's region images and read scratch: transparent huge pages (its default) or 4 KiB")
    ap.add_argument("--rounds", type=int, default=None,
                    help="paired rounds per figure (default 5, 3 with --quick): more rounds, a steadier median")
    ap.add_argument("--sections", default="large,behind,small,reopen",
                    help="comma-separated: large, behind, small, reopen, timeline, open (the last two not in the "
                         "default)")
    ap.add_argument("--open-objects", default="1000000,10000000",
                    help="object counts of the open section (default 1 M and 10 M; --quick: 200 K)")
    ap.add_argument("--synthetic-from", type=int, default=2_000_000,
                    help="the open section builds directories of this many objects or more synthetically "
                         "(sealed regions' summaries, no payloads) instead of writing each object")
    args = ap.parse_args(argv)
    hostmem.HUGE_PAGES = args.pages == "huge"
    sections = set(args.sections.split(","))
    if args.dir is not None and not os.path.isdir(args.dir):
        ap.error(f"--dir {args.dir}: no such directory")
    root = tempfile.mkdtemp(prefix="tierkv-bench-ssd-", dir=args.dir)
    if args.rounds is not None and args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    rounds = args.rounds if args.rounds is not None else (3 if args.quick else 5)
    try:
        res: dict = {"pages": args.pages}
        if "large" in sections:
            res["large"] = [bench_large(root, s, (64 if args.quick else 256) * MiB, rounds)
                            for s in (256 << 10, 2 * MiB, 4 * MiB)]
        if "behind" in sections:
            res["behind"] = [bench_behind(root, s, (64 if args.quick else 256) * MiB, rounds)
                             for s in (2 * MiB, 4 * MiB)]
        if "small" in sections:
            res["small"] = bench_small(root, 20_000 if args.quick else 100_000, rounds)
        if "reopen" in sections:
            res["reopen"] = bench_reopen(root, 200_000 if args.quick else 1_000_000)
        if "open" in sections:
            counts = [200_000] if args.quick else [int(x) for x in args.open_objects.split(",")]
            res["open"] = [bench_open(root, c, rounds, c >= args.synthetic_from) for c in counts]
        if "timeline" in sections:
            res["timeline"] = [bench_timeline(root, s, (64 if args.quick else 256) * MiB, rounds)
                               for s in (2 * MiB, 4 * MiB)]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{'figure':<40}{'tier':>14}{'baseline':>14}{'ratio':>8}  target   (tier pages: {args.pages})")
    for r in res.get("large", []):
        io = "O_DIRECT" if r["direct_io"] else "buffered"
        print(f"{'put ' + str(r['size_KiB']) + ' KiB (' + io + ')':<40}{r['put_GiBps']:>10.2f} GiB/s"
              f"{r['raw_write_GiBps']:>10.2f} GiB/s{r['put_ratio']:>8.2f}  vs raw pwrite"
              f" (rounds' middle half {r['put_ratio_quartiles'][0]:.2f}-{r['put_ratio_quartiles'][1]:.2f})")
        print(f"{'get ' + str(r['size_KiB']) + ' KiB (' + io + ')':<40}{r['get_GiBps']:>10.2f} GiB/s"
              f"{r['raw_read_GiBps']:>10.2f} GiB/s{r['get_ratio']:>8.2f}  vs raw pread"
              f" (rounds' middle half {r['get_ratio_quartiles'][0]:.2f}-{r['get_ratio_quartiles'][1]:.2f})")
        print(f"{'put ' + str(r['size_KiB']) + ' KiB from huge pages':<40}{r['put_staged_GiBps']:>10.2f} GiB/s"
              f"{r['raw_write_huge_GiBps']:>10.2f} GiB/s{r['put_staged_ratio']:>8.2f}  vs raw pwrite from huge pages"
              f" ({r['put_staged_direct_share']:.0%} written from where they are)")
        print(f"{'  (raw pread into huge pages)':<40}{'':>14}{r['raw_read_huge_GiBps']:>10.2f} GiB/s"
              "          reference, no target")
    for b in res.get("behind", []):
        print(f"{'put+flush ' + str(b['size_KiB']) + ' KiB, dram -> ssd':<40}{b['drain_GiBps']:>10.2f} GiB/s"
              f"{b['raw_write_huge_GiBps']:>10.2f} GiB/s{b['drain_ratio']:>8.2f}  vs raw pwrite from huge pages")
        print(f"{'  the same, staged copy (no views)':<40}{b['drain_staged_GiBps']:>10.2f} GiB/s"
              f"{'':>14}{b['drain_staged_ratio']:>8.2f}  (what the slab's views save)")
    for tl in res.get("timeline", []):
        a, b = tl["tier"], tl["raw"]
        print(f"{'device idle, put round ' + str(tl['size_KiB']) + ' KiB (ms)':<40}{a['idle_ms']:>14.2f}"
              f"{b['idle_ms']:>14.2f}{'':>8}  of {a['round_ms']:.1f} / {b['round_ms']:.1f} ms a round"
              f" ({a['idle_share']:.1%} / {b['idle_share']:.1%})")
        print(f"{'  writes a round, small on the caller':<40}{a['writes']:>10.0f}, {a['small_writes_on_caller']:<3.0f}"
              f"{b['writes']:>10.0f}, {b['small_writes_on_caller']:<3.0f}")
    if "small" in res:
        report_small(res["small"])
    if "reopen" in res:
        report_reopen(res["reopen"])
    for o in res.get("open", []):
        report_open(o)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


def report_small(s: dict) -> None:
    print(f"{'16 KiB puts/s (page cache)':<40}{s['puts_per_s']:>14,.0f}{s['raw_puts_per_s']:>14,.0f}"
          f"{s['put_ratio']:>8.2f}  >= 50,000/s")
    print(f"{'16 KiB gets/s (page cache)':<40}{s['gets_per_s']:>14,.0f}{s['raw_gets_per_s']:>14,.0f}"
          f"{s['get_ratio']:>8.2f}  >= 100,000/s")


def report_open(o: dict) -> None:
    what = f"open store, {o['objects']:,} objects" + (" (synth.)" if o["synthetic"] else "")
    print(f"{what + ' (s)':<40}{o['store_s']:>14.2f}{o['tier_s']:>14.2f}{o['tier_s'] / o['store_s']:>8.2f}"
          f"  store vs the tier's own recovery")
    print(f"{'  store extra per object (us)':<40}{o['extra_us_per_object']:>14.2f}{'':>14}{'':>8}  <= 1 us"
          f" (CPU time: {o['extra_cpu_us_per_object']:.2f} us; store {o['store_cpu_s']:.2f} s,"
          f" tier {o['tier_cpu_s']:.2f} s)")


def report_reopen(o: dict) -> None:
    print(f"{'reopen ' + format(o['objects'], ',') + ' objects, checkpoint (s)':<40}{o['reopen_checkpoint_s']:>14.2f}"
          f"{o['raw_checkpoint_read_s']:>14.2f}{o['raw_checkpoint_read_s'] / o['reopen_checkpoint_s']:>8.2f}  <= 1 s")
    print(f"{'reopen, summaries only (s)':<40}{o['reopen_summaries_s']:>14.2f}{o['raw_regions_read_s']:>14.2f}"
          f"{o['raw_regions_read_s'] / o['reopen_summaries_s']:>8.2f}  <= 10 s")
    print(f"{'index bytes per object':<40}{o['index_bytes_per_object']:>14.1f}{'':>14}{'':>8}  <= 64")


if __name__ == "__main__":
    sys.exit(main())
