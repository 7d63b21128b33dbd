"""Many small objects: per-object time and bytes of the store, each beside a baseline of the same run.

    python bench/bench_scale.py --objects 1000000 [--objects 10000000] \
        [--policies lru,fifo,s3fifo,lfu,arc] [--json out.json]

For each object count N and each eviction policy (each in a fresh subprocess, so
its RSS is its own):

* **store**: one ``dram`` tier sized to the footprints of N objects of 64-256 B
  (64-hex keys, as ``chunk_keys`` makes them), filled through ``TieredStore.put``
  in batches of 512; then ``get`` of a sample of batches and ``lookup`` of
  512-key prefixes (``lookup512_us``: fresh key strings of random batches, every probe a
  cache miss; ``lookup512_hot_us``: the same key list asked again, as a scheduler asks about
  a waiting request each step; ``lookup512_half_us``: the same, of lists whose first 256 keys are
  stored and the rest not, a prefix cached in part; ``lookup512_hot_ratio``, ``lookup512_half_ratio``,
  ``lookup512_ratio``: each over the baseline's, with ``--sections baseline,store``).  Reported: µs per
  object of put and get, µs per lookup, and RSS bytes per object beyond the payload (keys, indexes, policy metadata,
  allocator, alignment slack: everything the process holds for the objects,
  the caller having dropped its keys).
* **baseline** (its own subprocess): a plain dict insert / lookup of the same keys
  plus the same ``memmove`` of each object into / out of one buffer.
* **policy alone**: bytes per tracked key (keys excluded) and µs per hook call.
* **churn** (``--sections churn``): the tier sized for N / 4 objects, then N put, so three
  puts in four evict (a full cache, its normal state): µs per object of the evicting puts.
* **hooks** (``--sections hooks``): the time spent inside the policy's hooks in a store,
  each call timed on its own (fill, get of every object, then churn), µs per object.
* **allocator alone**: the ``dram`` tier's ``write`` / ``read`` / ``delete`` of the
  same objects, µs per object and bytes per object beyond payload.
* **big objects**: ``dram`` put / get of 2 MiB × 32 vs a plain torch copy of the
  same bytes into the same already-touched buffers: the ratio of the best round of
  each (the copy timed with torch's threads and with one, the faster kept), and
  the median of paired rounds beside it.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import random
import statistics
import subprocess
import sys
import time

import torch

BATCH = 512
_PAGE = os.sysconf("SC_PAGE_SIZE")
_memmove = ctypes.memmove


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def key(i: int) -> str:
    return hashlib.sha256(i.to_bytes(8, "little")).hexdigest()


def batch_keys(b: int, n: int) -> list[str]:
    return [key(i) for i in range(b * BATCH, min(n, (b + 1) * BATCH))]


def sizes_table() -> list[int]:
    rng = random.Random(7)
    return [rng.randint(64, 256) for _ in range(BATCH)]


def views(total: list[int], fill: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One buffer cut into one view per batch position (objects i and i + 512 have the same size)."""
    buf = torch.randint(0, 256, (sum(total),), dtype=torch.uint8) if fill else torch.zeros(sum(total), dtype=torch.uint8)
    out, off = [], 0
    for s in total:
        out.append(buf[off:off + s])
        off += s
    return buf, out


def payload(n: int, sizes: list[int]) -> int:
    full, rest = divmod(n, BATCH)
    return full * sum(sizes) + sum(sizes[:rest])


def sample_batches(n: int, want: int, seed: int = 3) -> list[int]:
    nb = (n + BATCH - 1) // BATCH
    rng = random.Random(seed)
    return rng.sample(range(nb), min(nb, max(1, want // BATCH)))


# ---------------------------------------------------------------------- children (one per subprocess)
def child_store(n: int, policy: str, get_objects: int) -> dict:
    from tierkv import TieredStore
    from tierkv.tiers.dram import DRAMTier

    sizes = sizes_table()
    _, srcs = views(sizes, True)
    _, outs = views(sizes, False)
    probe = DRAMTier("probe", 1 << 20, prefault=False)
    fp = [probe.footprint(s) for s in sizes]
    probe.close()
    full, rest = divmod(n, BATCH)
    capacity = full * sum(fp) + sum(fp[:rest])
    r0 = rss()
    store = TieredStore([_level(DRAMTier("dram", capacity), policy)])
    put_s = put_c = 0.0
    nb = (n + BATCH - 1) // BATCH
    for b in range(nb):
        keys = batch_keys(b, n)
        vals = srcs[:len(keys)]
        t0, c0 = time.perf_counter(), time.process_time()
        oks = store.put(keys, vals)
        put_s += time.perf_counter() - t0
        put_c += time.process_time() - c0
        if not all(oks):
            raise SystemExit(f"put failed at batch {b}")
    del keys, vals
    r1 = rss()
    got_s, got_c, got_n = 0.0, 0.0, 0
    batches = sample_batches(n, get_objects)
    for b in batches:
        keys = batch_keys(b, n)
        t0, c0 = time.perf_counter(), time.process_time()
        oks = store.get(keys, outs[:len(keys)])
        got_s += time.perf_counter() - t0
        got_c += time.process_time() - c0
        got_n += len(keys)
        if not all(oks):
            raise SystemExit(f"get missed in batch {b}")
    if not torch.equal(outs[0], srcs[0]):
        raise SystemExit("get returned wrong bytes")
    lookups = []
    for b in batches[:400]:
        keys = batch_keys(b, n)
        if len(keys) < BATCH:
            continue
        t0 = time.perf_counter()
        hit = store.lookup(keys)
        lookups.append(time.perf_counter() - t0)
        if hit != len(keys):
            raise SystemExit("lookup missed")
    hot = hot_lookups(store.lookup, [batch_keys(b, n) for b in batches[:50]])
    half = hot_lookups(store.lookup, half_lists(batches[:50], n), BATCH // 2)
    evicted = store.stats()["total"]["evictions"]
    store.close()
    return {"section": "store", "policy": policy, "objects": n,
            "put_us": put_s / n * 1e6, "get_us": got_s / got_n * 1e6,
            "put_cpu_us": put_c / n * 1e6, "get_cpu_us": got_c / got_n * 1e6,
            "lookup512_us": statistics.median(lookups) * 1e6, "lookup512_hot_us": hot, "lookup512_half_us": half,
            "bytes_per_object": (r1 - r0 - payload(n, sizes)) / n, "evictions": evicted}


def half_lists(batches: list[int], n: int) -> list[list[str]]:
    """512-key lists of a prefix cached in part: a stored batch's first 256 keys, then 256 never stored."""
    half = BATCH // 2
    return [batch_keys(b, n)[:half] + [key(n + i * half + j) for j in range(half)] for i, b in enumerate(batches)]


def hot_lookups(lookup, key_lists: list[list[str]], hit: int = BATCH) -> float:
    """Median µs of ``lookup`` of a 512-key prefix asked again, as a scheduler asks about a waiting
    request each step: the same key strings (their hashes cached), the second and later asks.  Each
    answer must be ``hit`` (the whole list, or the stored half of a ``half_lists`` list)."""
    times = []
    for keys in key_lists:
        if len(keys) < BATCH:
            continue
        if lookup(keys) != hit:
            raise SystemExit(f"lookup answered {lookup(keys)}, not {hit}")
        for _ in range(10):
            t0 = time.perf_counter()
            lookup(keys)
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def child_churn(n: int, policy: str) -> dict:
    """A full tier, its normal state: sized for n / 4 objects, then n put, so three in four puts evict.

    Reported: µs per object of the puts that evicted (after the tier first filled).
    """
    from tierkv import TieredStore
    from tierkv.tiers.dram import DRAMTier

    sizes = sizes_table()
    _, srcs = views(sizes, True)
    probe = DRAMTier("probe", 1 << 20, prefault=False)
    fp = [probe.footprint(s) for s in sizes]
    probe.close()
    cap_objects = max(BATCH, n // 4)
    full, rest = divmod(cap_objects, BATCH)
    store = TieredStore([_level(DRAMTier("dram", full * sum(fp) + sum(fp[:rest])), policy)])
    put_s, timed = 0.0, 0
    nb = (n + BATCH - 1) // BATCH
    for b in range(nb):
        keys = batch_keys(b, n)
        t0 = time.perf_counter()
        oks = store.put(keys, srcs[:len(keys)])
        dt = time.perf_counter() - t0
        if not all(oks):
            raise SystemExit(f"put failed at batch {b}")
        if b * BATCH >= cap_objects:
            put_s += dt
            timed += len(keys)
    evicted = store.stats()["total"]["evictions"]
    store.close()
    return {"section": "churn", "policy": policy, "objects": n, "capacity_objects": cap_objects,
            "put_us": put_s / max(1, timed) * 1e6, "evictions": evicted}


def child_hooks(n: int, policy: str) -> dict:
    """The time a store spends inside its eviction policy's hooks, µs per object: a fill of n
    objects (inserts), a get of all of them (first reads), then a churn run (tier sized for n / 4,
    n puts: inserts, removes and victims).  Each hook call is timed on its own, so the figure
    leaves out the store's work and most of the machine's noise."""
    from collections import defaultdict

    from tierkv import TieredStore
    from tierkv.hooks import Checked
    from tierkv.tiers.dram import DRAMTier

    spent: dict[str, float] = defaultdict(float)
    call = Checked._call
    clock = time.perf_counter

    def timed(self, hook, fn, *args):
        t0 = clock()
        try:
            return call(self, hook, fn, *args)
        finally:
            spent[hook.replace("_many", "")] += clock() - t0

    Checked._call = timed  # (the one place a policy hook is called)
    sizes = sizes_table()
    _, srcs = views(sizes, True)
    _, outs = views(sizes, False)
    probe = DRAMTier("probe", 1 << 20, prefault=False)
    fp = [probe.footprint(s) for s in sizes]
    probe.close()

    def cap(m: int) -> int:
        full, rest = divmod(m, BATCH)
        return full * sum(fp) + sum(fp[:rest])

    nb = (n + BATCH - 1) // BATCH
    out: dict = {"section": "hooks", "policy": policy, "objects": n}
    store = TieredStore([_level(DRAMTier("dram", cap(n)), policy)])
    for b in range(nb):
        keys = batch_keys(b, n)
        if not all(store.put(keys, srcs[:len(keys)])):
            raise SystemExit(f"put failed at batch {b}")
    out["fill_insert_us"] = spent.pop("on_insert", 0.0) / n * 1e6
    for b in range(nb):
        keys = batch_keys(b, n)
        if not all(store.get(keys, outs[:len(keys)])):
            raise SystemExit(f"get missed in batch {b}")
    out["get_access_us"] = spent.pop("on_access", 0.0) / n * 1e6
    store.close()
    spent.clear()
    store = TieredStore([_level(DRAMTier("dram", cap(max(BATCH, n // 4))), policy)])
    for b in range(nb):
        keys = batch_keys(b, n)
        if not all(store.put(keys, srcs[:len(keys)])):
            raise SystemExit(f"churn put failed at batch {b}")
    for hook in ("on_insert", "on_remove", "victims"):
        out["churn_" + hook.replace("on_", "") + "_us"] = spent.get(hook, 0.0) / n * 1e6
    out["churn_policy_us"] = sum(spent.values()) / n * 1e6
    out["evictions"] = store.stats()["total"]["evictions"]
    store.close()
    Checked._call = call
    return out


def _level(tier, policy):
    from tierkv.store import Level
    return Level(tier, eviction=policy)


def child_baseline(n: int, get_objects: int) -> dict:
    sizes = sizes_table()
    _, srcs = views(sizes, True)
    _, outs = views(sizes, False)
    r0 = rss()
    buf = torch.zeros(payload(n, sizes), dtype=torch.uint8)  # touched now, like the prefaulted slab
    base = buf.data_ptr()
    index: dict[str, int] = {}
    off, put_s, put_c = 0, 0.0, 0.0
    nb = (n + BATCH - 1) // BATCH
    for b in range(nb):
        keys = batch_keys(b, n)
        vals = srcs[:len(keys)]
        t0, c0 = time.perf_counter(), time.process_time()
        for k, v in zip(keys, vals):
            m = v.numel()
            index[k] = off
            _memmove(base + off, v.data_ptr(), m)
            off += m
        put_s += time.perf_counter() - t0
        put_c += time.process_time() - c0
    del keys, vals
    r1 = rss()
    got_s, got_c, got_n = 0.0, 0.0, 0
    batches = sample_batches(n, get_objects)
    for b in batches:
        keys = batch_keys(b, n)
        t0, c0 = time.perf_counter(), time.process_time()
        for k, o in zip(keys, outs):
            _memmove(o.data_ptr(), base + index[k], o.numel())
        got_s += time.perf_counter() - t0
        got_c += time.process_time() - c0
        got_n += len(keys)
    lookups = []
    for b in batches[:400]:
        keys = batch_keys(b, n)
        t0 = time.perf_counter()
        hit = 0
        for k in keys:
            if k not in index:
                break
            hit += 1  # noqa: SIM113 - the counter is not the loop index
        lookups.append(time.perf_counter() - t0)

    def dict_lookup(keys: list[str]) -> int:
        hit = 0
        for k in keys:
            if k not in index:
                break
            hit += 1
        return hit

    hot = hot_lookups(dict_lookup, [batch_keys(b, n) for b in batches[:50]])
    half = hot_lookups(dict_lookup, half_lists(batches[:50], n), BATCH // 2)
    return {"section": "baseline", "objects": n, "put_us": put_s / n * 1e6, "get_us": got_s / got_n * 1e6,
            "put_cpu_us": put_c / n * 1e6, "get_cpu_us": got_c / got_n * 1e6,
            "lookup512_us": statistics.median(lookups) * 1e6, "lookup512_hot_us": hot, "lookup512_half_us": half,
            "bytes_per_object": (r1 - r0 - payload(n, sizes)) / n}


def child_policy(n: int, policy: str) -> dict:
    from tierkv.policies import build_eviction

    sizes = sizes_table()
    keys = [key(i) for i in range(n)]
    pol = build_eviction(policy)
    pol.capacity_bytes = payload(n, sizes)
    r0 = rss()
    t0 = time.perf_counter()
    for i, k in enumerate(keys):
        pol.on_insert(k, sizes[i % BATCH])
    ins = time.perf_counter() - t0
    r1 = rss()
    rng = random.Random(5)
    sample = [keys[rng.randrange(n)] for _ in range(min(n, 200_000))]
    t0 = time.perf_counter()
    for k in sample:
        pol.on_access(k)
    acc = time.perf_counter() - t0
    vic = []
    for _ in range(50):
        t0 = time.perf_counter()
        pol.victims(BATCH * 160, ())
        vic.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    for k in keys[:len(sample)]:
        pol.on_remove(k)
    rem = time.perf_counter() - t0
    out = {"section": "policy", "policy": policy, "objects": n, "bytes_per_key": (r1 - r0) / n,
           "insert_us": ins / n * 1e6, "access_us": acc / len(sample) * 1e6,
           "remove_us": rem / len(sample) * 1e6, "victims512_us": statistics.median(vic) * 1e6}
    if hasattr(pol, "on_insert_many"):
        pol2 = build_eviction(policy)
        pol2.capacity_bytes = pol.capacity_bytes
        sz = sizes * (BATCH // len(sizes))
        t0 = time.perf_counter()
        for b in range(0, n, BATCH):
            pol2.on_insert_many(keys[b:b + BATCH], sz[:len(keys[b:b + BATCH])])
        out["insert_many_us"] = (time.perf_counter() - t0) / n * 1e6
        t0 = time.perf_counter()
        for b in range(0, len(sample), BATCH):
            pol2.on_access_many(sample[b:b + BATCH])
        out["access_many_us"] = (time.perf_counter() - t0) / len(sample) * 1e6
    return out


def child_alloc(n: int) -> dict:
    from tierkv.tiers.dram import DRAMTier

    sizes = sizes_table()
    _, srcs = views(sizes, True)
    _, outs = views(sizes, False)
    probe = DRAMTier("probe", 1 << 20, prefault=False)
    fp = [probe.footprint(s) for s in sizes]
    probe.close()
    full, rest = divmod(n, BATCH)
    r0 = rss()
    tier = DRAMTier("dram", full * sum(fp) + sum(fp[:rest]))
    nb = (n + BATCH - 1) // BATCH
    allkeys = []  # the tier's caller keeps the keys (the store would): not charged to the tier
    put_s = 0.0
    for b in range(nb):
        keys = batch_keys(b, n)
        allkeys.append(keys)
        t0 = time.perf_counter()
        oks = tier.write(keys, [[v] for v in srcs[:len(keys)]])
        put_s += time.perf_counter() - t0
        if not all(oks):
            raise SystemExit(f"tier write failed at batch {b}")
    r1 = rss()
    key_bytes = sum(sys.getsizeof(k) for k in allkeys[0]) / len(allkeys[0])
    key_bytes = (int(key_bytes) + 15) // 16 * 16 + 8  # pymalloc rounding, plus the caller's list slot
    batches = sample_batches(n, 200_000)
    get_s = del_s = 0.0
    m = 0
    for b in batches:
        keys = allkeys[b]
        t0 = time.perf_counter()
        oks = tier.read(keys, [[o] for o in outs[:len(keys)]])
        get_s += time.perf_counter() - t0
        m += len(keys)
        if not all(oks):
            raise SystemExit("tier read missed")
    for b in batches:
        keys = allkeys[b]
        t0 = time.perf_counter()
        tier.delete(keys)
        del_s += time.perf_counter() - t0
    tier.close()
    return {"section": "alloc", "objects": n, "write_us": put_s / n * 1e6, "read_us": get_s / m * 1e6,
            "delete_us": del_s / m * 1e6,
            "bytes_per_object": (r1 - r0 - payload(n, sizes)) / n - key_bytes}


def _torch_copy(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Seconds of the best plain torch copy of ``(dst, src)`` pairs: torch's own threads, then one thread.

    On shared cores torch's parallel copy waits for its slowest OpenMP worker, and a
    worker descheduled by another process made it 10-20x slower than one thread; the
    baseline is the faster of the two, so a contended thread team never flatters the store.
    """
    best = float("inf")
    threads = torch.get_num_threads()
    for n in (threads, 1):
        torch.set_num_threads(n)
        try:
            t0 = time.perf_counter()
            for d, s in pairs:
                d.copy_(s)
            best = min(best, time.perf_counter() - t0)
        finally:
            torch.set_num_threads(threads)
        if threads == 1:
            break
    return best


def child_big(rounds: int) -> dict:
    from tierkv import TieredStore
    from tierkv.tiers.dram import DRAMTier

    mib2, count = 2 << 20, 32
    srcs = [torch.randint(0, 256, (mib2,), dtype=torch.uint8) for _ in range(count)]
    outs = [torch.zeros(mib2, dtype=torch.uint8) for _ in range(count)]
    dsts = [torch.zeros(mib2, dtype=torch.uint8) for _ in range(count)]
    store = TieredStore([DRAMTier("dram", mib2 * count + (1 << 20))])
    keys = [key(10**9 + i) for i in range(count)]
    base_put, base_get, put_t, get_t = [], [], [], []
    for _ in range(rounds):
        store.remove(keys)
        time.sleep(0.02)
        base_put.append(_torch_copy(list(zip(dsts, srcs))))
        time.sleep(0.02)
        t0 = time.perf_counter()
        assert all(store.put(keys, srcs))
        put_t.append(time.perf_counter() - t0)
        time.sleep(0.02)
        base_get.append(_torch_copy(list(zip(outs, dsts))))
        time.sleep(0.02)
        t0 = time.perf_counter()
        assert all(store.get(keys, outs))
        get_t.append(time.perf_counter() - t0)
    if not all(torch.equal(o, s) for o, s in zip(outs, srcs)):
        raise SystemExit("big get returned wrong bytes")
    store.close()
    # best of the rounds on each side: the least disturbed run of each (2 shared cores)
    return {"section": "big", "put_ratio": min(base_put) / min(put_t), "get_ratio": min(base_get) / min(get_t),
            "put_ratio_median": statistics.median(b / t for b, t in zip(base_put, put_t)),
            "get_ratio_median": statistics.median(b / t for b, t in zip(base_get, get_t)),
            "base_put_ms": min(base_put) * 1e3, "put_ms": min(put_t) * 1e3,
            "base_get_ms": min(base_get) * 1e3, "get_ms": min(get_t) * 1e3}


# ---------------------------------------------------------------------- driver
def run_child(args: list[str]) -> dict:
    # small-object children on one OpenMP thread (no spinning workers beside the timed loops);
    # the big-object baseline is torch's copy with its own default threads
    env = os.environ if args[0] == "big" else {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", *args],
                         capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(f"child {args} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--objects", type=int, action="append", help="object count (repeatable; default 1000000)")
    ap.add_argument("--policies", default="lru,fifo,s3fifo,lfu,arc")
    ap.add_argument("--get-objects", type=int, default=1_000_000, help="objects read back in the get phase")
    ap.add_argument("--sections", default="baseline,store,churn,policy,alloc,big")
    ap.add_argument("--json", help="write every figure to this file")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        kind, *rest = a.child
        fn = {"store": lambda: child_store(int(rest[0]), rest[1], int(rest[2])),
              "baseline": lambda: child_baseline(int(rest[0]), int(rest[1])),
              "policy": lambda: child_policy(int(rest[0]), rest[1]),
              "alloc": lambda: child_alloc(int(rest[0])),
              "churn": lambda: child_churn(int(rest[0]), rest[1]),
              "hooks": lambda: child_hooks(int(rest[0]), rest[1]),
              "big": lambda: child_big(int(rest[0]))}[kind]
        print(json.dumps(fn()))
        return
    counts = a.objects or [1_000_000]
    policies = [p for p in a.policies.split(",") if p]
    sections = set(a.sections.split(","))
    results = []

    def show(r: dict) -> None:
        results.append(r)
        print(" ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()), flush=True)

    for n in counts:
        base = None
        if "baseline" in sections:
            base = run_child(["baseline", str(n), str(a.get_objects)])
            show(base)
        if "store" in sections:
            for p in policies:
                r = run_child(["store", str(n), p, str(a.get_objects)])
                if base:
                    r["put_over_base_us"] = r["put_us"] - base["put_us"]
                    r["get_over_base_us"] = r["get_us"] - base["get_us"]
                    # the same in the process's CPU time: less moved by other work on the machine
                    r["put_cpu_over_base_us"] = r["put_cpu_us"] - base["put_cpu_us"]
                    r["get_cpu_over_base_us"] = r["get_cpu_us"] - base["get_cpu_us"]
                    # a lookup's time over the dict's, both of the same key lists in the same run
                    r["lookup512_hot_ratio"] = r["lookup512_hot_us"] / base["lookup512_hot_us"]
                    r["lookup512_half_ratio"] = r["lookup512_half_us"] / base["lookup512_half_us"]
                    r["lookup512_ratio"] = r["lookup512_us"] / base["lookup512_us"]
                show(r)
        if "churn" in sections:
            for p in policies:
                r = run_child(["churn", str(n), p])
                if base:
                    r["put_over_base_us"] = r["put_us"] - base["put_us"]
                show(r)
        if "hooks" in sections:
            for p in policies:
                show(run_child(["hooks", str(n), p]))
        if "policy" in sections:
            for p in policies:
                show(run_child(["policy", str(n), p]))
        if "alloc" in sections:
            show(run_child(["alloc", str(n)]))
    if "big" in sections:
        show(run_child(["big", "15"]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
