"""Benchmark suites of ``tierkv bench`` (and ``bench/bench_store.py``): every figure a ratio to a baseline
measured in the same run.

* ``dram`` / ``hbm`` put and get vs a plain copy of the same bytes into preallocated tensors (memcpy);
* ``ssd`` put and get vs raw file I/O (``os.writev`` / ``os.preadv``, one file per chunk) in the same directory;
* ``dram_pool`` put and get vs raw Mooncake calls (``batch_put_from`` / ``batch_get_into`` on registered
  buffers) through the same master — only when a master is given;
* ``lookup`` of a 512-chunk prefix among many stored keys; ``keys``: ``chunk_keys`` throughput.

Baseline and tierkv run back to back in each round; a ratio is the median of the
per-round ratios (robust to the drift of a shared machine).  ``rows(results)``
flattens a run into the table ``tierkv bench`` prints and ``--compare`` matches.
"""

from __future__ import annotations

import json
import os
import statistics
import time
import uuid
from collections.abc import Callable
from typing import Any, Optional

import numpy as np
import torch

from tierkv import TieredStore, chunk_keys
from tierkv.errors import ConfigError

BATCH = 32
#: idle time before each timed call (longer than OpenMP workers spin after a parallel region)
SETTLE_S = 0.02
SUITES = ("dram", "hbm", "ssd", "dram_pool", "lookup", "keys")


def median_time(fn: Callable[[], Any], rounds: int, setup=None, settle: bool = True) -> float:
    """Median wall time of ``fn`` over ``rounds`` calls (``settle``: pause before each, for copies)."""
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


def paired(base, fn, rounds: int, base_setup=None, setup=None) -> tuple[float, float, float]:
    """Baseline and tierkv back to back, ``rounds`` times: (median base s, median tierkv s, median ratio)."""
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


def _chunks(chunk: int, n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    srcs = [torch.randint(0, 255, (chunk,), dtype=torch.uint8) for _ in range(n)]
    return srcs, [torch.zeros(chunk, dtype=torch.uint8) for _ in range(n)]


def bench_memory(medium: str, chunk: int, rounds: int, batch: int = BATCH) -> dict:
    """``dram`` or ``hbm`` (on cpu) put / get vs a torch copy of the same bytes."""
    n = batch
    srcs, dsts = _chunks(chunk, n)
    tier = {"medium": medium, "capacity": n * chunk + (1 << 20)}
    if medium == "hbm":
        tier["device"] = "cpu"
    store = TieredStore.from_config({"tiers": [tier]})
    keys = [f"{medium[0]}{chunk}-{i}" for i in range(n)]

    def raw_copy():
        for d, s in zip(dsts, srcs):
            d.copy_(s)

    try:
        raw, put, put_ratio = paired(raw_copy, lambda: store.put(keys, srcs), rounds, setup=lambda: store.remove(keys))
        store.put(keys, srcs)
        raw2, get, get_ratio = paired(raw_copy, lambda: store.get(keys, dsts), rounds)
        exact = all(torch.equal(a, b) for a, b in zip(srcs, dsts))
    finally:
        store.close()
    gb = n * chunk / 2**30
    return {"chunk_MiB": chunk / 2**20, "batch": n, "copy_GiBps": gb / statistics.median([raw, raw2]),
            "put_GiBps": gb / put, "get_GiBps": gb / get, "put_ratio": put_ratio, "get_ratio": get_ratio,
            "exact": exact}


def bench_dram(chunk: int, rounds: int, batch: int = BATCH) -> dict:
    return bench_memory("dram", chunk, rounds, batch)


def bench_ssd(chunk: int, rounds: int, root: str, direct: bool = False, batch: int = BATCH) -> dict:
    """``ssd`` put / get vs raw one-file-per-chunk writev / preadv in the same directory."""
    n = batch
    srcs, dsts = _chunks(chunk, n)
    raw_dir = os.path.join(root, "raw")
    os.makedirs(raw_dir, exist_ok=True)
    views = [memoryview(s.numpy()) for s in srcs]  # type: ignore[arg-type]  # ndarray exports a buffer
    dviews = [memoryview(d.numpy()) for d in dsts]  # type: ignore[arg-type]

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
    try:
        raw_w, put, put_ratio = paired(raw_write, lambda: store.put(keys, srcs), rounds, base_setup=raw_unlink,
                                       setup=lambda: store.remove(keys))
        store.put(keys, srcs)
        raw_r, get, get_ratio = paired(raw_read, lambda: store.get(keys, dsts), rounds)
        exact = all(torch.equal(a, b) for a, b in zip(srcs, dsts))
    finally:
        store.close()
        raw_unlink()
    gb = n * chunk / 2**30
    return {"chunk_MiB": chunk / 2**20, "batch": n, "raw_write_GiBps": gb / raw_w, "raw_read_GiBps": gb / raw_r,
            "put_GiBps": gb / put, "get_GiBps": gb / get, "put_ratio": put_ratio, "get_ratio": get_ratio,
            "exact": exact}


def bench_dram_pool(master: str, metadata: Optional[str], chunk: int, rounds: int, batch: int = BATCH) -> dict:
    """``dram_pool`` put / get vs raw ``batch_put_from`` / ``batch_get_into`` of a client through the same master."""
    from tierkv.tiers._mooncake import import_mooncake

    mstore = import_mooncake()
    n = batch
    srcs, dsts = _chunks(chunk, n)
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    segment = max(64 << 20, 4 * n * chunk)
    raw = mstore.MooncakeDistributedStore()
    rc = raw.setup("127.0.0.1", metadata, segment, 16 << 20, "tcp", "", master)
    if rc != 0:
        raise ConfigError(f"cannot reach the Mooncake master {master} (metadata {metadata}): setup returned {rc}")
    tag = uuid.uuid4().hex[:8]
    store = None
    try:
        for t in (*srcs, *dsts):
            raw.register_buffer(t.data_ptr(), t.numel())
        store = TieredStore.from_config({"tiers": [{"medium": "dram_pool", "master": master,
                                                    "metadata_server": metadata, "segment": segment,
                                                    "capacity": segment}]})
        rnd = iter(range(1 << 30))
        cfg = mstore.ReplicateConfig()
        state: dict[str, list[str]] = {}

        def raw_keys():
            state["raw"] = [f"tierkv-bench/{tag}/raw/{next(rnd)}/{i}" for i in range(n)]

        def tier_keys():
            state["tier"] = [f"bench-{tag}-{next(rnd)}-{i}" for i in range(n)]

        raw_put = lambda: raw.batch_put_from(state["raw"], [s.data_ptr() for s in srcs], [chunk] * n, cfg)  # noqa: E731
        tier_put = lambda: store.put(state["tier"], srcs)  # noqa: E731
        rw, put, put_ratio = paired(raw_put, tier_put, rounds, base_setup=raw_keys, setup=tier_keys)
        raw_get = lambda: raw.batch_get_into(state["raw"], [d.data_ptr() for d in dsts], [chunk] * n)  # noqa: E731
        rr, get, get_ratio = paired(raw_get, lambda: store.get(state["tier"], dsts), rounds)
        exact = all(torch.equal(a, b) for a, b in zip(srcs, dsts))
    finally:
        if store is not None:
            store.close()
        raw.close()
    gb = n * chunk / 2**30
    return {"chunk_MiB": chunk / 2**20, "batch": n, "raw_put_GiBps": gb / rw, "raw_get_GiBps": gb / rr,
            "put_GiBps": gb / put, "get_GiBps": gb / get, "put_ratio": put_ratio, "get_ratio": get_ratio,
            "exact": exact}


def bench_lookup(n_stored: int, rounds: int) -> dict:
    """Lookup of a 512-chunk prefix among ``n_stored`` keys."""
    store = TieredStore.from_config({"tiers": [{"medium": "dram", "capacity": n_stored * 256 + (1 << 20)}]})
    try:
        tokens = np.arange(512 * 256, dtype=np.uint32)
        prefix = chunk_keys(tokens, 256, "bench")
        one = torch.zeros(1, dtype=torch.uint8)
        filler = [f"f{i:07d}" for i in range(n_stored - len(prefix))]
        t0 = time.perf_counter()
        for i in range(0, len(filler), 8192):
            part = filler[i:i + 8192]
            store.put(part, [one] * len(part))
        store.put(prefix, [one] * len(prefix))
        fill_s = time.perf_counter() - t0
        found = store.lookup(prefix)
        t = median_time(lambda: store.lookup(prefix), max(rounds, 50), settle=False)
        stored = store.stats()["total"]["chunks_stored"]
    finally:
        store.close()
    return {"stored_keys": stored, "lookup_us": t * 1e6, "fill_s": fill_s, "found": found}


def bench_keys(rounds: int, tokens: int = 128 * 1024) -> dict:
    arr = np.random.default_rng(0).integers(0, 128000, tokens, dtype=np.int64)
    as_list = arr.tolist()
    t_arr = median_time(lambda: chunk_keys(arr, 256, "bench"), max(rounds, 20), settle=False)
    t_u32 = median_time(lambda: chunk_keys(arr.astype(np.uint32), 256, "bench"), max(rounds, 20), settle=False)
    t_list = median_time(lambda: chunk_keys(as_list, 256, "bench"), max(rounds, 20), settle=False)
    return {"tokens": tokens, "Mtok_per_s_int64_array": tokens / t_arr / 1e6,
            "Mtok_per_s_uint32_array": tokens / t_u32 / 1e6, "Mtok_per_s_list": tokens / t_list / 1e6}


def run_suites(suites, sizes_mib, rounds: int, root: str, batch: int = BATCH, lookup_keys: int = 1_000_000,
               master: Optional[str] = None, metadata: Optional[str] = None, progress=None) -> dict:
    """Every selected suite; ``progress(1)`` after each benchmark."""
    results: dict[str, Any] = {}
    tick = progress or (lambda n: None)
    sizes = [int(s * 2**20) for s in sizes_mib]
    for medium in ("dram", "hbm"):
        if medium in suites:
            results[medium] = []
            for c in sizes:
                results[medium].append(bench_memory(medium, c, rounds, batch))
                tick(1)
    if "ssd" in suites:
        results["ssd"] = []
        for c in sizes:
            results["ssd"].append(bench_ssd(c, rounds, root, batch=batch))
            tick(1)
    if "dram_pool" in suites:
        if not master:
            raise ConfigError("the dram_pool suite needs --master HOST:PORT")
        results["dram_pool"] = []
        for c in sizes:
            results["dram_pool"].append(bench_dram_pool(master, metadata, c, rounds, batch))
            tick(1)
    if "lookup" in suites:
        results["lookup"] = bench_lookup(lookup_keys, rounds)
        tick(1)
    if "keys" in suites:
        results["chunk_keys"] = bench_keys(rounds)
        tick(1)
    return results


_BASE = {"dram": ("copy_GiBps", "copy_GiBps", "torch copy"), "hbm": ("copy_GiBps", "copy_GiBps", "torch copy"),
         "ssd": ("raw_write_GiBps", "raw_read_GiBps", "raw writev / preadv"),
         "dram_pool": ("raw_put_GiBps", "raw_get_GiBps", "raw batch_put_from / batch_get_into")}


def rows(results: dict) -> list[dict]:
    """One row per figure: ``bench`` (a stable name), ``value``, ``unit``, ``baseline``, ``ratio``, ``against``."""
    out = []
    for medium, (bput, bget, against) in _BASE.items():
        for r in results.get(medium, []):
            size = f"{r['chunk_MiB']:g} MiB x{r['batch']}"
            out.append({"bench": f"{medium} put {size}", "value": r["put_GiBps"], "unit": "GiB/s",
                        "baseline": r[bput], "ratio": r["put_ratio"], "against": against})
            out.append({"bench": f"{medium} get {size}", "value": r["get_GiBps"], "unit": "GiB/s",
                        "baseline": r[bget], "ratio": r["get_ratio"], "against": against})
    lk = results.get("lookup")
    if lk:
        out.append({"bench": f"lookup 512 of {lk['stored_keys']}", "value": lk["lookup_us"], "unit": "us",
                    "baseline": None, "ratio": None, "against": "target <= 100 us"})
    ck = results.get("chunk_keys")
    if ck:
        for k, label in (("Mtok_per_s_int64_array", "int64 array"), ("Mtok_per_s_uint32_array", "uint32 array"),
                         ("Mtok_per_s_list", "list")):
            out.append({"bench": f"chunk_keys {ck['tokens'] // 1024}K ({label})", "value": ck[k], "unit": "Mtok/s",
                        "baseline": None, "ratio": None, "against": "target >= 50 Mtok/s"})
    return out


def bandwidths(results: dict) -> dict[str, float]:
    """Read bandwidth per medium in bytes/s: the get figure of the largest chunk size benched."""
    out = {}
    for medium in ("dram", "hbm", "ssd", "dram_pool"):
        runs = results.get(medium) or []
        if runs:
            best = max(runs, key=lambda r: r["chunk_MiB"])
            out[medium] = best["get_GiBps"] * 2**30
    return out


def read_bandwidths(path: str) -> dict[str, float]:
    """Bandwidth per medium (bytes/s) from a ``tierkv bench --json`` file."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"--bench-json {path}: cannot read: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"--bench-json {path}: not a tierkv bench result")
    bw = data.get("bandwidth_Bps")
    if bw is None:
        bw = bandwidths(data.get("results", data))
    if not bw:
        raise ConfigError(f"--bench-json {path}: no dram, hbm, ssd or dram_pool results in it")
    return {k: float(v) for k, v in bw.items()}
