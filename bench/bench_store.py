"""Store benchmarks, each figure a ratio to a baseline measured in the same run.

    python bench/bench_store.py [--quick] [--json out.json]

* dram put / get, 2 MiB and 32 MiB chunks, batches of 32, vs a plain torch copy
  of the same bytes into preallocated tensors (target ≥ 0.8×);
* ssd write / read, same sizes, vs raw sequential file I/O (os.writev / os.preadv
  of the same bytes, one file per chunk) on the same directory (target ≥ 0.8×);
* lookup of a 512-chunk prefix against 1M stored keys (target ≤ 100 µs);
* chunk_keys over 128K tokens (target ≥ 50M tokens/s).
Baseline and tierkv run back to back in each round; a ratio is the median of the
per-round ratios (robust to the drift of a shared machine).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

from tierkv import TieredStore, chunk_keys

BATCH = 32


def median_time(fn, rounds: int, setup=None, settle: bool = True) -> float:
    """Median wall time of ``fn`` over ``rounds`` calls.

    ``settle`` pauses before each call (for copies, after torch's OpenMP workers spin);
    CPU-bound lookups run back to back instead, as a scheduler calls them: after an
    idle pause the call would measure a cold cache (and a waking vCPU), not the lookup.
    """
    times = []
    for _ in range(rounds):
        if setup:
            setup()
        if settle:
            time.sleep(SETTLE_S)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


#: idle time before each timed call (longer than OpenMP workers spin after a parallel region)
SETTLE_S = 0.02


def paired(base, fn, rounds: int, base_setup=None, setup=None) -> tuple[float, float, float]:
    """Baseline and tierkv back to back, ``rounds`` times: (median base s, median tierkv s, median ratio).

    Pairing cancels most of the drift of a shared machine: each ratio compares two
    runs a few milliseconds apart.  Each timed call starts after a short pause:
    torch's OpenMP workers spin for a while after a parallel copy, and a call
    made at once would share the cores with them.
    """
    tb, tt, ratios = [], [], []
    for _ in range(rounds):
        if base_setup:
            base_setup()
        time.sleep(SETTLE_S)
        t0 = time.perf_counter()
        base()
        b = time.perf_counter() - t0
        if setup:
            setup()
        time.sleep(SETTLE_S)
        t0 = time.perf_counter()
        fn()
        t = time.perf_counter() - t0
        tb.append(b)
        tt.append(t)
        ratios.append(b / t)
    return statistics.median(tb), statistics.median(tt), statistics.median(ratios)


def bench_dram(chunk: int, rounds: int) -> dict:
    n = BATCH
    srcs = [torch.randint(0, 255, (chunk,), dtype=torch.uint8) for _ in range(n)]
    dsts = [torch.zeros(chunk, dtype=torch.uint8) for _ in range(n)]
    cap = n * chunk + (1 << 20)
    store = TieredStore.from_config({"tiers": [{"medium": "dram", "capacity": cap}]})
    keys = [f"d{chunk}-{i}" for i in range(n)]

    def raw_copy():
        for d, s in zip(dsts, srcs):
            d.copy_(s)

    raw, put, put_ratio = paired(raw_copy, lambda: store.put(keys, srcs), rounds, setup=lambda: store.remove(keys))
    store.put(keys, srcs)
    raw2, get, get_ratio = paired(raw_copy, lambda: store.get(keys, dsts), rounds)
    assert all(torch.equal(a, b) for a, b in zip(srcs, dsts))
    store.close()
    gb = n * chunk / 2**30
    return {"chunk_MiB": chunk >> 20, "copy_GiBps": gb / statistics.median([raw, raw2]), "put_GiBps": gb / put,
            "get_GiBps": gb / get, "put_ratio": put_ratio, "get_ratio": get_ratio}


def bench_ssd(chunk: int, rounds: int, root: str, direct: bool = False) -> dict:
    n = BATCH
    srcs = [torch.randint(0, 255, (chunk,), dtype=torch.uint8) for _ in range(n)]
    dsts = [torch.zeros(chunk, dtype=torch.uint8) for _ in range(n)]
    raw_dir = os.path.join(root, "raw")
    os.makedirs(raw_dir, exist_ok=True)
    views = [memoryview(s.numpy()) for s in srcs]
    dviews = [memoryview(d.numpy()) for d in dsts]

    def raw_write():
        for i, v in enumerate(views):
            fd = os.open(os.path.join(raw_dir, f"{i}"), os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
            os.writev(fd, [v])
            os.close(fd)

    def raw_read():
        for i, v in enumerate(dviews):
            fd = os.open(os.path.join(raw_dir, f"{i}"), os.O_RDONLY)
            os.preadv(fd, [v], 0)
            os.close(fd)

    def raw_unlink():
        for i in range(n):
            try:
                os.unlink(os.path.join(raw_dir, f"{i}"))
            except FileNotFoundError:
                pass

    cfg = {"tiers": [{"medium": "ssd", "path": os.path.join(root, "tier"), "capacity": 2 * n * chunk + (64 << 20),
                      "direct_io": direct}]}
    store = TieredStore.from_config(cfg)
    keys = [f"s{chunk}-{i}" for i in range(n)]
    raw_w, put, put_ratio = paired(raw_write, lambda: store.put(keys, srcs), rounds, base_setup=raw_unlink,
                                   setup=lambda: store.remove(keys))
    store.put(keys, srcs)
    raw_r, get, get_ratio = paired(raw_read, lambda: store.get(keys, dsts), rounds)
    assert all(torch.equal(a, b) for a, b in zip(srcs, dsts))
    store.close()
    raw_unlink()
    gb = n * chunk / 2**30
    return {"chunk_MiB": chunk >> 20, "raw_write_GiBps": gb / raw_w, "raw_read_GiBps": gb / raw_r,
            "put_GiBps": gb / put, "get_GiBps": gb / get, "put_ratio": put_ratio, "get_ratio": get_ratio}


def bench_lookup(n_stored: int, rounds: int) -> dict:
    store = TieredStore.from_config({"tiers": [{"medium": "dram", "capacity": n_stored * 256 + (1 << 20)}]})
    tokens = np.arange(512 * 256, dtype=np.uint32)
    prefix = chunk_keys(tokens, 256, "bench")
    one = torch.zeros(1, dtype=torch.uint8)
    filler = [f"f{i:07d}" for i in range(n_stored - len(prefix))]
    t0 = time.perf_counter()
    step = 8192
    for i in range(0, len(filler), step):
        part = filler[i:i + step]
        store.put(part, [one] * len(part))
    store.put(prefix, [one] * len(prefix))
    fill_s = time.perf_counter() - t0
    assert store.lookup(prefix) == 512
    t = median_time(lambda: store.lookup(prefix), max(rounds, 50), settle=False)
    stored = store.stats()["total"]["chunks_stored"]
    store.close()
    return {"stored_keys": stored, "lookup_us": t * 1e6, "fill_s": fill_s}


def bench_keys(rounds: int) -> dict:
    tokens = np.random.default_rng(0).integers(0, 128000, 128 * 1024, dtype=np.int64)
    as_list = tokens.tolist()
    t_arr = median_time(lambda: chunk_keys(tokens, 256, "bench"), max(rounds, 20), settle=False)
    t_u32 = median_time(lambda: chunk_keys(tokens.astype(np.uint32), 256, "bench"), max(rounds, 20), settle=False)
    t_list = median_time(lambda: chunk_keys(as_list, 256, "bench"), max(rounds, 20), settle=False)
    n = len(tokens)
    return {"tokens": n, "Mtok_per_s_int64_array": n / t_arr / 1e6, "Mtok_per_s_uint32_array": n / t_u32 / 1e6,
            "Mtok_per_s_list": n / t_list / 1e6}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds, 100K stored keys")
    ap.add_argument("--dir", help="directory for the ssd benchmarks (default: a temp dir)")
    ap.add_argument("--json", help="write all results here")
    args = ap.parse_args()
    rounds = 3 if args.quick else 7
    root = tempfile.mkdtemp(prefix="tierkv-bench-", dir=args.dir)
    results: dict = {}
    try:
        results["dram"] = [bench_dram(c << 20, rounds) for c in (2, 32)]
        results["ssd"] = [bench_ssd(c << 20, rounds, root) for c in (2, 32)]
        results["lookup"] = bench_lookup(100_000 if args.quick else 1_000_000, rounds)
        results["chunk_keys"] = bench_keys(rounds)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{'bench':<28}{'tierkv':>14}{'baseline':>14}{'ratio':>8}  target")
    for r in results["dram"]:
        print(f"{'dram put ' + str(r['chunk_MiB']) + ' MiB x32':<28}{r['put_GiBps']:>10.2f} GiB/s"
              f"{r['copy_GiBps']:>10.2f} GiB/s{r['put_ratio']:>8.2f}  ≥0.8 (torch copy)")
        print(f"{'dram get ' + str(r['chunk_MiB']) + ' MiB x32':<28}{r['get_GiBps']:>10.2f} GiB/s"
              f"{r['copy_GiBps']:>10.2f} GiB/s{r['get_ratio']:>8.2f}  ≥0.8 (torch copy)")
    for r in results["ssd"]:
        print(f"{'ssd put ' + str(r['chunk_MiB']) + ' MiB x32':<28}{r['put_GiBps']:>10.2f} GiB/s"
              f"{r['raw_write_GiBps']:>10.2f} GiB/s{r['put_ratio']:>8.2f}  ≥0.8 (raw writev)")
        print(f"{'ssd get ' + str(r['chunk_MiB']) + ' MiB x32':<28}{r['get_GiBps']:>10.2f} GiB/s"
              f"{r['raw_read_GiBps']:>10.2f} GiB/s{r['get_ratio']:>8.2f}  ≥0.8 (raw preadv)")
    lk = results["lookup"]
    print(f"{'lookup 512 of ' + str(lk['stored_keys']):<28}{lk['lookup_us']:>11.1f} µs{'':>14}{'':>8}  ≤100 µs")
    ck = results["chunk_keys"]
    print(f"{'chunk_keys 128K (int64 arr)':<28}{ck['Mtok_per_s_int64_array']:>9.1f} Mtok/s{'':>22}  ≥50 Mtok/s")
    print(f"{'chunk_keys 128K (uint32 arr)':<28}{ck['Mtok_per_s_uint32_array']:>9.1f} Mtok/s")
    print(f"{'chunk_keys 128K (list)':<28}{ck['Mtok_per_s_list']:>9.1f} Mtok/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
