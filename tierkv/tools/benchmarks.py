"""Benchmark suites of ``tierkv bench`` (and ``bench/bench_store.py``): every figure beside a baseline
measured in the same run, and only figures of work that was done.

* ``dram`` / ``hbm`` put and get vs a plain copy of the same bytes into preallocated tensors (a torch copy);
* ``ssd`` put and get vs raw file I/O (``os.writev`` / ``os.preadv``, one file per chunk) in the same directory
  and in the tier's own I/O mode (O_DIRECT where the directory takes it, as the tier does by default);
* ``dram_pool`` put and get vs raw Mooncake calls (``batch_put_from`` / ``batch_get_into`` on registered
  buffers) through the same master — only when a master is given;
* ``config``: each tier of a store config on its own (custom ``"package.module:Class"`` media included),
  against a torch copy (or raw file I/O for ``ssd``); a tier's ``path`` is replaced by a fresh directory;
* ``lookup`` of a 512-chunk prefix among many stored keys; ``keys``: ``chunk_keys`` throughput.

Baseline and tierkv run back to back in each round.  Every round checks what the store answered: a chunk a
``put`` did not store or a ``get`` did not find is a failure, and so is a byte that differs — the
destinations are overwritten with other bytes before each timed ``get``, so only the store's own output
can pass.  A failed benchmark has no figure (its row says why) and fails the run.  A row's ``value`` and
``baseline`` are the medians of the rounds' throughputs, ``ratio`` is ``value / baseline``, and
``value_rounds`` keeps every round's figure (``--compare`` weighs a change against their spread).
"""

from __future__ import annotations

import collections
import copy
import functools
import json
import math
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Any, Optional

import numpy as np
import torch

from tierkv import TieredStore, chunk_keys
from tierkv.durability import fault_counts, reason_of_failed_write
from tierkv.errors import ConfigError

BATCH = 32
#: idle time before each timed call (longer than OpenMP workers spin after a parallel region)
SETTLE_S = 0.02
SUITES = ("dram", "hbm", "ssd", "dram_pool", "config", "lookup", "keys")
#: suites of put / get figures (one pair of rows per chunk size)
MEDIA = ("dram", "hbm", "ssd", "dram_pool", "config")
ALIGN = 4096


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


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    time.sleep(SETTLE_S)
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def _row(bench: str, nbytes: int, base_s: list[float], tier_s: list[float], against: str,
         failures: list[str]) -> dict:
    """One put or get figure: medians of the rounds' throughputs (GiB/s); no figure when anything failed."""
    gib = nbytes / 2**30
    row: dict[str, Any] = {"bench": bench, "unit": "GiB/s", "against": against}
    if failures:
        return {**row, "value": None, "baseline": None, "ratio": None, "value_rounds": [], "failures": failures}
    values = [gib / t for t in tier_s]
    bases = [gib / t for t in base_s]
    value, baseline = statistics.median(values), statistics.median(bases)
    return {**row, "value": value, "baseline": baseline, "ratio": value / baseline, "value_rounds": values,
            "baseline_rounds": bases, "failures": []}


#: a put outcome that is not "stored", in words (an ``error`` is named by the tier's fault counters where they grew)
PUT_REASONS = {"present": "already present", "rejected": "refused by admission", "no_room": "no room",
               "error": "write failed", "disk_full": "disk full", "too_large": "too large for the tier"}


def fault_totals(store: TieredStore) -> dict[str, int]:
    """The fault counters (``enospc``, ``too_large``) of every tier of ``store``, summed."""
    out: collections.Counter = collections.Counter()
    for lvl in store.levels:
        extra = getattr(lvl.tier, "extra_stats", None)
        try:
            out.update(fault_counts(extra() if extra else None))
        except Exception:  # noqa: BLE001 - a tier that cannot say: its errors stay "write failed"
            pass
    return dict(out)


def _shortfall(op: str, bad: collections.Counter, asked: int, rounds: int) -> list[str]:
    """One line for what ``op`` failed to do over all rounds, by reason; none when it did everything."""
    if not bad:
        return []
    why = ", ".join(f"{PUT_REASONS.get(k, k)}: {v}" for k, v in sorted(bad.items()))
    what = "not stored" if op == "put" else "not read back"
    return [f"{op}: {sum(bad.values())} of {asked} chunks {what} over {rounds} round(s) ({why})"]


def bench_store_io(store: TieredStore, name: str, srcs: list[torch.Tensor], dsts: list[torch.Tensor],
                   rounds: int, raw_put: Callable[[], Any], raw_get: Callable[[], Any], against: str,
                   raw_put_setup: Optional[Callable[[], Any]] = None, fresh_keys: bool = False,
                   reopen: Optional[Callable[[], TieredStore]] = None) -> list[dict]:
    """Put and get rows of ``store`` against ``raw_put`` / ``raw_get``, with every answer checked.

    One untimed warm-up put (and raw write) comes first, so that no round times the creation of a
    region or file.  Each put round stores every chunk anew (removed first, or fresh keys for a
    shared pool where a removal is not immediate).  ``reopen``: called between the put and get
    phases, it closes the store and answers it reopened (a persistent tier: the gets then read the
    device, not an image of the region just written).  Before each get round the destinations are
    overwritten with the complement of the expected bytes, then compared with the sources: a get that
    answered True without writing them fails.
    """
    n, chunk = len(srcs), srcs[0].numel()
    rnd = iter(range(1 << 30))
    keys: list[str] = []

    def new_keys() -> list[str]:
        tag = f"{next(rnd)}-" if fresh_keys else ""
        return [f"bench-{name}-{chunk}-{tag}{i}" for i in range(n)]

    put_bad: collections.Counter = collections.Counter()
    base_put, tier_put = [], []

    def put_round(timed: bool) -> None:
        nonlocal keys
        if raw_put_setup:
            raw_put_setup()
        base_s = _timed(raw_put)[0]
        if keys and not fresh_keys:
            store.remove(keys)
        keys = new_keys()
        before = fault_totals(store)
        t, outcomes = _timed(functools.partial(store.put_detailed, keys, srcs))
        values = [getattr(o, "value", str(o)) for o in outcomes]
        if "error" in values:  # (named by the counter that grew: disk full, too large)
            why = reason_of_failed_write(before, fault_totals(store)).value
            values = [why if v == "error" else v for v in values]
        if timed:
            base_put.append(base_s)
            tier_put.append(t)
            put_bad.update(v for v in values if v != "stored")

    put_round(timed=False)  # warm-up: region and file creation, first-touch, not timed
    for _ in range(rounds):
        put_round(timed=True)
    if reopen is not None:
        store = reopen()
    get_bad: collections.Counter = collections.Counter()
    base_get, tier_get = [], []
    expected = [s.bitwise_not() for s in srcs]  # what the destinations hold before each timed get
    for _ in range(rounds):
        base_get.append(_timed(raw_get)[0])
        for d, e in zip(dsts, expected):
            d.copy_(e)
        t, found = _timed(lambda: store.get(keys, dsts))
        tier_get.append(t)
        get_bad["missed"] += sum(1 for ok in found if not ok)
        get_bad["bytes differ"] += sum(1 for ok, d, s in zip(found, dsts, srcs) if ok and not torch.equal(d, s))
    if fresh_keys:
        store.remove(keys)
    size = f"{chunk / 2**20:g} MiB x{n}"
    get_bad = +get_bad  # (drops the zero counts)
    return [_row(f"{name} put {size}", n * chunk, base_put, tier_put, against,
                 _shortfall("put", put_bad, n * rounds, rounds)),
            _row(f"{name} get {size}", n * chunk, base_get, tier_get, against,
                 _shortfall("get", get_bad, n * rounds, rounds))]


def _chunks(chunk: int, n: int, aligned: bool = False) -> tuple[list[torch.Tensor], list[torch.Tensor], list]:
    """Sources (random bytes), destinations, and the buffers that keep page-aligned ones alive."""
    keep: list = []

    def buf() -> torch.Tensor:
        if not aligned:
            return torch.zeros(chunk, dtype=torch.uint8).fill_(1)  # (faulted in: no first-touch cost timed)
        from tierkv.hostmem import page_buffer

        m = page_buffer(-(-chunk // ALIGN) * ALIGN, populate=True)
        keep.append(m)
        return torch.frombuffer(m, dtype=torch.uint8)[:chunk]

    g = torch.Generator().manual_seed(chunk)
    srcs = [buf() for _ in range(n)]
    for s in srcs:
        s.copy_(torch.randint(0, 256, (chunk,), dtype=torch.uint8, generator=g))
    return srcs, [buf() for _ in range(n)], keep


def _copier(srcs, dsts) -> Callable[[], None]:
    def raw_copy() -> None:
        for d, s in zip(dsts, srcs):
            d.copy_(s)
    return raw_copy


def bench_memory(medium: str, chunk: int, rounds: int, batch: int = BATCH) -> list[dict]:
    """``dram`` or ``hbm`` (on cpu) put / get vs a torch copy of the same bytes."""
    tier: dict[str, Any] = {"medium": medium, "capacity": 2 * batch * chunk + (1 << 20)}
    if medium == "hbm":
        tier["device"] = "cpu"
    return bench_tier(tier, chunk, rounds, batch=batch)


def fs_type(path: str) -> str:
    """The filesystem type holding ``path`` (from /proc/mounts; "unknown" elsewhere)."""
    best, fstype = "", "unknown"
    real = os.path.realpath(path)
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3:
                    mnt = parts[1].replace("\\040", " ")
                    if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                        best, fstype = mnt, parts[2]
    except OSError:
        pass
    return fstype


#: filesystems that keep files in memory: an "ssd" benchmark there measures memory, not a device
MEMORY_FS = ("tmpfs", "ramfs", "devtmpfs", "hugetlbfs")


def bench_ssd(chunk: int, rounds: int, root: str, direct: Optional[bool] = None, batch: int = BATCH,
              tier_options: Optional[dict] = None) -> tuple[list[dict], dict]:
    """``ssd`` put / get vs raw one-file-per-chunk writev / preadv in the same directory and I/O mode.

    ``direct``: the tier's ``direct_io`` (None: its default, O_DIRECT where the directory takes it).
    Returns the rows and where they were measured: ``dir``, ``fs``, ``io_mode``.
    """
    cfg = {"medium": "ssd", **(tier_options or {}), "path": tempfile.mkdtemp(prefix="ssd-", dir=root)}
    if direct is not None:
        cfg["direct_io"] = direct
    rows, where = _bench_config_tier(cfg, chunk, rounds, root, batch)
    return rows, where


def _raw_files(raw_dir: str, srcs, dsts, keep: list, direct: bool):
    """Raw writev / preadv of one file per chunk (O_DIRECT: whole 4 KiB blocks of the page-aligned buffers)."""
    os.makedirs(raw_dir, exist_ok=True)
    n = len(srcs)
    if direct:  # the whole aligned buffers (the chunk rounded up to 4 KiB), as O_DIRECT requires
        views, dviews = [memoryview(m) for m in keep[:n]], [memoryview(m) for m in keep[n:]]
    else:
        views = [memoryview(s.numpy()) for s in srcs]  # type: ignore[arg-type]  # ndarray exports a buffer
        dviews = [memoryview(d.numpy()) for d in dsts]  # type: ignore[arg-type]
    flag = os.O_DIRECT if direct else 0
    raw_fail: list[str] = []

    def raw_write() -> None:
        for i, v in enumerate(views):
            fd = os.open(os.path.join(raw_dir, f"{i}"), os.O_CREAT | os.O_WRONLY | os.O_TRUNC | flag, 0o600)
            try:
                done = os.writev(fd, [v])
            finally:
                os.close(fd)
            if done != len(v):  # (a short write: the baseline did not do the work it is timed for)
                raw_fail.append(f"raw writev wrote {done} of {len(v)} bytes")

    def raw_read() -> None:
        for i, v in enumerate(dviews):
            fd = os.open(os.path.join(raw_dir, f"{i}"), os.O_RDONLY | flag)
            try:
                done = os.preadv(fd, [v], 0)
            finally:
                os.close(fd)
            if done != len(v):
                raw_fail.append(f"raw preadv read {done} of {len(v)} bytes")

    def raw_unlink() -> None:
        for i in range(len(srcs)):
            try:
                os.unlink(os.path.join(raw_dir, f"{i}"))
            except FileNotFoundError:
                pass

    return raw_write, raw_read, raw_unlink, raw_fail


def _fail_baseline(rows: list[dict], raw_fail: list[str]) -> None:
    """A baseline that did not do all its work has no figure to compare with: its rows fail."""
    if raw_fail:
        for r in rows:
            r.update(value=None, baseline=None, ratio=None, value_rounds=[], baseline_rounds=[],
                     failures=r["failures"] + raw_fail[:1])


#: media whose capacity is the pool's, not ours to size
POOL_MEDIA = ("dram_pool", "remote_npu")


def bench_tier(tier: dict, chunk: int, rounds: int, root: Optional[str] = None, batch: int = BATCH) -> list[dict]:
    """One tier of a config on its own: put / get rows (see ``bench_config``)."""
    return _bench_config_tier(tier, chunk, rounds, root, batch)[0]


def _bench_config_tier(tier: dict, chunk: int, rounds: int, root: Optional[str], batch: int) -> tuple[list, dict]:
    cfg = copy.deepcopy(tier)
    medium = str(cfg.get("medium"))
    name = cfg.get("name") or medium
    if medium not in POOL_MEDIA:
        cfg["capacity"] = 2 * batch * chunk + (64 << 20)
    if "path" in cfg and root is not None and not str(cfg["path"]).startswith(root):
        cfg["path"] = tempfile.mkdtemp(prefix=f"{name}-", dir=root)
    box = {"store": TieredStore.from_config({"tiers": [cfg]})}
    where: dict[str, Any] = {}
    keep: list = []

    def reopen() -> TieredStore:
        """The store closed and opened again: a reopened ssd tier holds no image of a region, every get
        reads the device."""
        box["store"].close()
        box["store"] = TieredStore.from_config({"tiers": [cfg]})
        return box["store"]

    try:
        store = box["store"]
        obj = store.levels[0].tier
        if medium == "ssd":
            direct = bool(getattr(obj, "direct_io", False))
            path = str(getattr(obj, "path", cfg.get("path")))
            where = {"dir": path, "fs": fs_type(path), "io_mode": "O_DIRECT" if direct else "page cache"}
            srcs, dsts, keep = _chunks(chunk, batch, aligned=direct)
            raw_put, raw_get, raw_unlink, raw_fail = _raw_files(os.path.join(os.path.dirname(path), f"{name}-raw-{chunk}"),
                                                      srcs, dsts, keep, direct)
            against = f"raw writev / preadv ({where['io_mode']})"
            try:
                rows = bench_store_io(store, name, srcs, dsts, rounds, raw_put, raw_get, against,
                                      raw_put_setup=raw_unlink, reopen=reopen)
                _fail_baseline(rows, raw_fail)
            finally:
                raw_unlink()
        else:
            srcs, dsts, keep = _chunks(chunk, batch)
            copy_ = _copier(srcs, dsts)
            rows = bench_store_io(store, name, srcs, dsts, rounds, copy_, copy_, "torch copy",
                                  fresh_keys=medium in POOL_MEDIA)
    finally:
        box["store"].close()
        del keep
    for r in rows:
        r.update(where)
    return rows, where


def bench_config(config: dict, chunk: int, rounds: int, root: str, batch: int = BATCH) -> list[dict]:
    """Every tier of ``config`` on its own, each in a one-tier store of just that tier's options.

    Nothing of the operator's is touched: a ``path`` becomes a fresh directory under ``root``, a
    capacity is sized to the benchmark (a pool's is kept, and the keys written there are removed).
    """
    out = []
    for t in config.get("tiers", []):
        out += _bench_config_tier(t, chunk, rounds, root, batch)[0]
    return out


def bench_dram_pool(master: str, metadata: Optional[str], chunk: int, rounds: int, batch: int = BATCH) -> list[dict]:
    """``dram_pool`` put / get vs raw ``batch_put_from`` / ``batch_get_into`` of a client through the same master."""
    from tierkv.tiers.remote.mooncake import import_mooncake

    mstore = import_mooncake()
    n = batch
    srcs, dsts, _keep = _chunks(chunk, n)
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
        raw_fail: list[str] = []

        def raw_put() -> None:
            state["raw"] = [f"tierkv-bench/{tag}/raw/{next(rnd)}/{i}" for i in range(n)]
            rcs = raw.batch_put_from(state["raw"], [s.data_ptr() for s in srcs], [chunk] * n, cfg)
            if any(int(x) != 0 for x in rcs or []):
                raw_fail.append(f"raw batch_put_from failed: {rcs}")

        def raw_get() -> None:
            got = raw.batch_get_into(state["raw"], [d.data_ptr() for d in dsts], [chunk] * n)
            if any(int(x) != chunk for x in got or []) or len(got or []) != n:
                raw_fail.append(f"raw batch_get_into read {sum(int(x) == chunk for x in got or [])} of {n} objects")

        rows = bench_store_io(store, "dram_pool", srcs, dsts, rounds, raw_put, raw_get,
                              "raw batch_put_from / batch_get_into", fresh_keys=True)
        _fail_baseline(rows, raw_fail)
    finally:
        if store is not None:
            store.close()
        raw.close()
    return rows


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
        times = []
        for _ in range(max(rounds, 50)):
            t0 = time.perf_counter()
            store.lookup(prefix)
            times.append(time.perf_counter() - t0)
        stored = store.stats()["total"]["chunks_stored"]
    finally:
        store.close()
    return {"stored_keys": stored, "lookup_us": statistics.median(times) * 1e6, "rounds_us": [t * 1e6 for t in times],
            "fill_s": fill_s, "found": found, "prefix": len(prefix)}


def bench_keys(rounds: int, tokens: int = 128 * 1024) -> dict:
    arr = np.random.default_rng(0).integers(0, 128000, tokens, dtype=np.int64)
    as_list = arr.tolist()
    t_arr = median_time(lambda: chunk_keys(arr, 256, "bench"), max(rounds, 20), settle=False)
    t_u32 = median_time(lambda: chunk_keys(arr.astype(np.uint32), 256, "bench"), max(rounds, 20), settle=False)
    t_list = median_time(lambda: chunk_keys(as_list, 256, "bench"), max(rounds, 20), settle=False)
    return {"tokens": tokens, "Mtok_per_s_int64_array": tokens / t_arr / 1e6,
            "Mtok_per_s_uint32_array": tokens / t_u32 / 1e6, "Mtok_per_s_list": tokens / t_list / 1e6}


def run_suites(suites, sizes_mib, rounds: int, root: str, batch: int = BATCH, lookup_keys: int = 1_000_000,
               master: Optional[str] = None, metadata: Optional[str] = None, progress=None,
               config: Optional[dict] = None) -> dict:
    """Every selected suite; ``progress(1)`` after each benchmark.

    The put / get suites (``MEDIA``) give a list of rows each; ``lookup`` and ``chunk_keys`` a dict.
    """
    results: dict[str, Any] = {}
    tick = progress or (lambda n: None)
    sizes = [max(1, int(s * 2**20)) for s in sizes_mib]

    def per_size(suite: str, bench: Callable[[int], list[dict]]) -> None:
        """Run ``bench(chunk_bytes)`` for each size, its rows gathered under ``suite``."""
        results[suite] = []
        for c in sizes:
            results[suite] += bench(c)
            tick(1)

    for medium in ("dram", "hbm"):
        if medium in suites:
            per_size(medium, functools.partial(bench_memory, medium, rounds=rounds, batch=batch))
    if "ssd" in suites:
        per_size("ssd", lambda c: bench_ssd(c, rounds, root, batch=batch)[0])
    if "dram_pool" in suites:
        if not master:
            raise ConfigError("the dram_pool suite needs --master HOST:PORT")
        per_size("dram_pool", lambda c: bench_dram_pool(master, metadata, c, rounds, batch))
    if "config" in suites:
        if config is None:
            raise ConfigError("the config suite needs --config FILE")
        per_size("config", lambda c: bench_config(config, c, rounds, root, batch))
    if "lookup" in suites:
        results["lookup"] = bench_lookup(lookup_keys, rounds)
        tick(1)
    if "keys" in suites:
        results["chunk_keys"] = bench_keys(rounds)
        tick(1)
    return results


def rows(results: dict) -> list[dict]:
    """One row per figure: ``bench`` (a stable name), ``value``, ``unit``, ``baseline``, ``ratio``, ``against``,
    ``failures`` (a failed benchmark has ``value`` None), ``value_rounds`` where there are rounds."""
    out = []
    for medium in MEDIA:
        out += results.get(medium, [])
    lk = results.get("lookup")
    if lk:
        fail = [] if lk["found"] == lk["prefix"] else [f"lookup found {lk['found']} of the {lk['prefix']} chunks "
                                                         "of the prefix stored"]
        out.append({"bench": f"lookup {lk['prefix']} of {lk['stored_keys']}",
                    "value": None if fail else lk["lookup_us"], "unit": "us", "baseline": None, "ratio": None,
                    "against": "target <= 100 us", "value_rounds": [] if fail else lk["rounds_us"],
                    "failures": fail})
    ck = results.get("chunk_keys")
    if ck:
        for k, label in (("Mtok_per_s_int64_array", "int64 array"), ("Mtok_per_s_uint32_array", "uint32 array"),
                         ("Mtok_per_s_list", "list")):
            out.append({"bench": f"chunk_keys {ck['tokens'] // 1024}K ({label})", "value": ck[k], "unit": "Mtok/s",
                        "baseline": None, "ratio": None, "against": "target >= 50 Mtok/s",
                        "value_rounds": ck.get(k + "_rounds", []), "failures": []})
    return out


def failures(results: dict) -> list[str]:
    """Every failure of a run, each prefixed with its benchmark."""
    return [f"{r['bench']}: {f}" for r in rows(results) for f in r.get("failures") or []]


def bandwidths(results: dict) -> dict[str, float]:
    """Read bandwidth per medium in bytes/s: the get figure of the largest chunk size that passed."""
    out: dict[str, float] = {}
    for medium in ("dram", "hbm", "ssd", "dram_pool"):
        best = None
        for r in results.get(medium) or []:
            if " get " in r["bench"] and r.get("value") is not None:
                size = float(r["bench"].split(" get ")[1].split(" MiB")[0])
                if best is None or size > best[0]:
                    best = (size, r["value"] * 2**30)
        if best is not None:
            out[medium] = best[1]
    return out


def read_bench_json(path: str, option: str, field: str, kind: type, lacks: str,
                    error: type[Exception] = ConfigError) -> dict[str, Any]:
    """The ``tierkv bench --json`` document at ``path`` (given as ``option``), whose ``field`` must be a ``kind``.

    A file that cannot be read, or that is no such document (``lacks`` says what is missing), raises ``error``
    naming the option and the path.  The one reader of those documents (``--bench-json``: ``read_bandwidths``;
    ``tierkv bench --compare``: ``load_old``); each then checks its own field's contents."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise error(f"{option} {path}: cannot read: {e}") from e
    if not isinstance(data, dict) or not isinstance(data.get(field), kind):
        raise error(f"{option} {path}: not a 'tierkv bench --json' document ({lacks})")
    return data


def read_bandwidths(path: str) -> dict[str, float]:
    """Bandwidth per medium (bytes/s) from a ``tierkv bench --json`` document; a run that failed is refused."""
    data = read_bench_json(path, "--bench-json", "bandwidth_Bps", dict, "no bandwidth_Bps")
    if data.get("failures"):
        raise ConfigError(f"--bench-json {path}: that run failed ({data['failures'][0]}); its figures are not "
                          "measurements")
    bw = data["bandwidth_Bps"]
    if not bw:
        raise ConfigError(f"--bench-json {path}: no dram, hbm, ssd or dram_pool figure in it")
    out = {}
    for k, v in bw.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ConfigError(f"--bench-json {path}: bandwidth of {k!r} is {v!r}, not a positive number")
        out[str(k)] = float(v)
    return out
