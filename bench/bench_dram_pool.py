"""dram_pool over Mooncake vs raw Mooncake calls, in one run.

    .venv/bin/python bench/bench_dram_pool.py [--reps 5] [--sizes 2,16] [--batch 32] \
        [--modes same,same-te,cross,standalone,ipc]

Starts its own ``mooncake_master`` on free loopback ports and measures, for
chunks of each size in batches of ``--batch``:

* same-process: the objects land in this process's own segment;
* cross-process: a second process owns the segment the objects land in, so
  every byte crosses the Transfer Engine (``tcp`` here);
* standalone: the tier attaches to a standalone pool (``"mode": "standalone"``,
  segment 0) whose memory a ``mooncake_client`` process owns; "raw" is the same
  segment-0 client, so the ratio compares like with like.  The summary also
  gives standalone throughput as a fraction of the embedded same-process case
  (what giving up the local segment costs: no local-segment copies);
* ipc: attached to the same kind of standalone pool over IPC
  (``standalone_address``: shared memory with the ``mooncake_client``); "raw"
  is a separate IPC client moving the same data from its own shared memory
  (the tier adds one copy between callers' buffers and the shared memory).

* same-te: embedded like "same", with ``local_reads`` off: gets of objects in
  the own segment go through the Transfer Engine instead of a plain copy out of
  it (what the local-segment read path is worth).

"raw" is ``batch_put_from`` / ``batch_get_into`` on the very client the tier
uses, from buffers registered beforehand (zero-copy: the client moves bytes
straight between the caller's memory and the segment); "tier" is
``DramPoolTier.write`` / ``read`` from ordinary (unregistered) tensors,
everything included.  The ratio is tier throughput / raw throughput (target ≥
0.9).  "copy" is Mooncake's copying calls on the same client (``put_batch`` of
the tensors' bytes, ``get_batch`` into ``bytes`` then copied into the
destination tensors; both go through the client's local buffer, so the batch is
cut to fit it): the zero-copy path's gain is raw / copy (not measured over IPC,
where the tier itself is the copy path).  Then it kills the master and reports
the latency callers see: the detecting call, and the misses after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import uuid

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

from mooncake_util import MooncakeMaster, client_env, missing_reason

from tierkv.tiers.remote.media import DramPoolTier

MiB = 1 << 20

PROVIDER = r"""
import sys
from mooncake.store import MooncakeDistributedStore
master, metadata, segment = sys.argv[1], sys.argv[2], int(sys.argv[3])
s = MooncakeDistributedStore()
rc = s.setup("127.0.0.1", metadata, segment, 16 << 20, "tcp", "", master)
print(rc, flush=True)
sys.stdin.read()
s.close()
"""


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class Buffers:
    """Chunk buffers for both sides, allocated and registered once (an engine's long-lived KV memory).

    The same data for both sides, in separate buffers: a region registered by the raw side is not the
    tier's; the tier registers its own storages on first use, as it would for an engine's buffers.
    """

    def __init__(self, raw, size: int, batch: int) -> None:
        self.raw = raw
        self.srcs = [torch.randint(0, 256, (size,), dtype=torch.uint8) for _ in range(batch)]
        self.srcs_t = [s.clone() for s in self.srcs]
        self.dsts = [torch.zeros(size, dtype=torch.uint8) for _ in range(batch)]  # zero-filled: pages touched
        self.dsts_t = [torch.zeros(size, dtype=torch.uint8) for _ in range(batch)]
        for t in self.srcs + self.dsts:
            rc = raw.register_buffer(t.data_ptr(), size)
            assert rc == 0, f"register_buffer failed: {rc}"


class IpcBuffers(Buffers):
    """Buffers for a raw IPC client: only memory from its shared pool can move."""

    def __init__(self, raw, size: int, batch: int) -> None:
        import ctypes

        self.raw = raw

        def shared(n: int) -> torch.Tensor:
            base = raw.alloc_from_mem_pool(n)
            assert base, "alloc_from_mem_pool failed"
            return torch.frombuffer((ctypes.c_uint8 * n).from_address(base), dtype=torch.uint8)

        region = shared(2 * size * batch)
        assert raw.register_buffer(region.data_ptr(), region.numel()) == 0
        self.srcs = [region[i * size:(i + 1) * size] for i in range(batch)]
        for s in self.srcs:
            s.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8))
        self.dsts = [region[(batch + i) * size:(batch + i + 1) * size] for i in range(batch)]
        for d in self.dsts:
            d.zero_()
        self.srcs_t = [s.clone() for s in self.srcs]
        self.dsts_t = [torch.zeros(size, dtype=torch.uint8) for _ in range(batch)]


def ipc_client(pool, nbytes: int):
    from mooncake.store import MooncakeDistributedStore

    raw = MooncakeDistributedStore()
    rc = raw.setup_dummy(nbytes, 16 * MiB, f"{pool.host}:{pool.port}")
    assert rc == 0, f"setup_dummy failed: {rc}"
    return raw


#: bytes of the local buffer the tier's client gets, through which Mooncake's copying calls go
COPY_BUFFER = 64 * MiB


def bench_size(tier: DramPoolTier, bufs: Buffers, size: int, batch: int, reps: int,
               copy: bool = True) -> dict[str, float]:
    """Median seconds of raw, copy and tier put/get for one batch of ``batch`` chunks of ``size`` bytes."""
    raw = bufs.raw
    srcs = [t[:size] for t in bufs.srcs]
    dsts = [t[:size] for t in bufs.dsts]
    srcs_t = [t[:size] for t in bufs.srcs_t]
    dsts_t = [t[:size] for t in bufs.dsts_t]
    sptr = [t.data_ptr() for t in srcs]
    dptr = [t.data_ptr() for t in dsts]
    sizes = [size] * batch
    times: dict[str, list[float]] = {"raw_put": [], "raw_get": [], "tier_put": [], "tier_get": [],
                                     "copy_put": [], "copy_get": []}
    # the copying calls stage through the client's local buffer: sub-batches that fit half of it
    per_call = max(1, (COPY_BUFFER // 2) // size)
    subs = [range(i, min(batch, i + per_call)) for i in range(0, batch, per_call)]
    copy = copy and size <= COPY_BUFFER // 2

    def raw_round() -> None:
        keys = [f"bench/raw/{uuid.uuid4().hex}" for _ in range(batch)]
        codes: list = []
        times["raw_put"].append(timed(lambda: codes.append(raw.batch_put_from(keys, sptr, sizes))))
        assert all(c == 0 for c in codes[0]), codes
        times["raw_get"].append(timed(lambda: codes.append(raw.batch_get_into(keys, dptr, sizes))))
        assert all(c == size for c in codes[1]), codes[1][:4]
        raw.batch_remove(keys, True)

    def tier_round() -> None:
        keys = [uuid.uuid4().hex * 2 for _ in range(batch)]
        res: list = []
        times["tier_put"].append(timed(lambda: res.append(tier.write(keys, [[s] for s in srcs_t]))))
        assert all(res[0]), tier.extra_stats()
        times["tier_get"].append(timed(lambda: res.append(tier.read(keys, [[d] for d in dsts_t]))))
        assert all(res[1]), tier.extra_stats()
        raw.batch_remove([tier._prefix + k for k in keys], True)  # bench cleanup, not timed

    def copy_round() -> None:
        keys = [f"bench/copy/{uuid.uuid4().hex}" for _ in range(batch)]
        views = [t.numpy() for t in srcs_t]

        def put() -> None:
            for sub in subs:
                rc = raw.put_batch([keys[i] for i in sub], [views[i] for i in sub])
                assert rc == 0, f"put_batch failed: {rc}"

        def get() -> None:
            for sub in subs:
                got = raw.get_batch([keys[i] for i in sub])
                for i, b in zip(sub, got):
                    assert len(b) == size, f"get_batch: {len(b)} bytes, wanted {size}"
                    dsts_t[i].numpy()[:] = np.frombuffer(b, dtype=np.uint8)

        times["copy_put"].append(timed(put))
        times["copy_get"].append(timed(get))
        raw.batch_remove(keys, True)

    sides = [raw_round, tier_round] + ([copy_round] if copy else [])
    # warm-up (registration caches, connections), then rotate so no side always gets the warmer cache
    for fn in sides:
        fn()
    for t in times.values():
        t.clear()
    for r in range(reps):
        for fn in sides[r % len(sides):] + sides[:r % len(sides)]:
            fn()
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs)), "raw: bytes differ"
    assert all(torch.equal(d, s) for d, s in zip(dsts_t, srcs)), "tier (or copy): bytes differ"
    out = {k: statistics.median(v) for k, v in times.items() if v}
    # each round runs every side back to back: the ratio within a round cancels the machine's drift
    for op in ("put", "get"):
        out[f"ratio_{op}"] = statistics.median(r / t for r, t in zip(times[f"raw_{op}"], times[f"tier_{op}"]))
        if copy:  # the zero-copy call's gain over the copying one
            out[f"zc_gain_{op}"] = statistics.median(c / r for r, c in zip(times[f"raw_{op}"], times[f"copy_{op}"]))
    return out


def fill_own_segment(tier: DramPoolTier) -> torch.Tensor:
    """Fill this client's own segment so every further object lands in another process's segment."""
    from mooncake.store import ReplicateConfig

    raw = tier._session.client._store
    cfg = ReplicateConfig()
    cfg.preferred_segment = raw.get_hostname()
    ballast = torch.zeros(MiB, dtype=torch.uint8)
    raw.register_buffer(ballast.data_ptr(), MiB)
    for i in range(64):
        if raw.put_from(f"bench/ballast/{i}", ballast.data_ptr(), MiB, cfg) != 0:
            break
    return ballast  # registered: must outlive the client


def wait_unlisted(pool, timeout: float = 15.0) -> None:
    """Wait until the master no longer lists a stopped pool's segment (puts would pick it and fail, -800)."""
    end = time.monotonic() + timeout
    while pool.segment and time.monotonic() < end:
        listed = pool._segments()
        if listed is None or pool.segment not in listed:
            return
        time.sleep(0.1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="2,16", help="chunk sizes in MiB, comma-separated")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--modes", default="same,same-te,cross,standalone,ipc")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    reason = missing_reason()
    if reason:
        sys.exit(f"cannot run: {reason}")
    for k, v in client_env().items():
        os.environ.setdefault(k, v)
    sizes = [int(s) * MiB for s in args.sizes.split(",")]
    need = max(sizes) * args.batch * 2 + 64 * MiB
    rows = []
    with MooncakeMaster() as m:
        for mode in args.modes.split(","):
            provider = pool = None
            if mode in ("standalone", "ipc"):
                pool = m.standalone_pool(f"{need}").start()
            if mode == "cross":
                provider = subprocess.Popen([sys.executable, "-c", PROVIDER, m.master, m.metadata_server, str(need)],
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                assert provider.stdout.readline().strip() == "0", "segment provider failed to start"
            # a loaded machine must not look like a dead peer: a low min_bandwidth
            if pool is not None:
                ipc = {"ipc": True, "ipc_buffer": max(sizes) * args.batch + MiB} if mode == "ipc" else {}
                opts = pool.tier_config(namespace=f"bench-{mode}", min_bandwidth="20MB",
                                        **(ipc or {"buffer": COPY_BUFFER}))
            else:
                own = mode in ("same", "same-te")
                opts = m.tier_config(segment=f"{need if own else 16 * MiB}", namespace=f"bench-{mode}",
                                     min_bandwidth="20MB", buffer=COPY_BUFFER,
                                     **({"local_reads": False} if mode == "same-te" else {}))
            opts.pop("medium")
            tier = DramPoolTier.from_config("pool", opts)
            try:
                ballast = fill_own_segment(tier) if mode == "cross" else None  # noqa: F841 (kept alive)
                if mode == "ipc":
                    raw_ipc = ipc_client(pool, 2 * max(sizes) * args.batch + 16 * MiB)
                    bufs = IpcBuffers(raw_ipc, max(sizes), args.batch)
                else:
                    bufs = Buffers(tier._session.client._store, max(sizes), args.batch)
                for size in sizes:
                    r = bench_size(tier, bufs, size, args.batch, args.reps, copy=mode != "ipc")
                    nbytes = size * args.batch
                    for op in ("put", "get"):
                        raw_gbs = nbytes / r[f"raw_{op}"] / 1e9
                        tier_gbs = nbytes / r[f"tier_{op}"] / 1e9
                        copy_gbs = nbytes / r[f"copy_{op}"] / 1e9 if f"copy_{op}" in r else None
                        rows.append({"mode": mode, "op": op, "chunk_mib": size // MiB, "batch": args.batch,
                                     "raw_gbs": raw_gbs, "tier_gbs": tier_gbs, "ratio": r[f"ratio_{op}"],
                                     "copy_gbs": copy_gbs, "zc_gain": r.get(f"zc_gain_{op}")})
            finally:
                tier.close()
                if provider is not None:
                    provider.stdin.close()
                    provider.wait(30)
                if pool is not None:
                    pool.stop()
                    wait_unlisted(pool)

        # the latency a caller sees while the master is down
        opts = m.tier_config(segment="32MiB", namespace="bench-down", timeout=0.5)
        opts.pop("medium")
        tier = DramPoolTier.from_config("pool", opts)
        keys = [uuid.uuid4().hex * 2 for _ in range(32)]
        bufs = [[torch.zeros(2 * MiB, dtype=torch.uint8)] for _ in keys]
        tier.write(keys, bufs)
        m.kill()
        first = timed(lambda: tier.read(keys, bufs))
        lat = sorted(timed(lambda: tier.read(keys, bufs)) for _ in range(2000))
        lat_c = sorted(timed(lambda: tier.contains(keys)) for _ in range(2000))
        down = {"detect_s": first, "read_miss_median_us": lat[len(lat) // 2] * 1e6,
                "read_miss_p99_us": lat[int(len(lat) * 0.99)] * 1e6,
                "contains_median_us": lat_c[len(lat_c) // 2] * 1e6,
                "contains_p99_us": lat_c[int(len(lat_c) * 0.99)] * 1e6,
                "available": tier.available}
        tier.close()

    print(f"\ndram_pool (mooncake, tcp) vs raw Mooncake, batch {args.batch}, median of {args.reps} rounds "
          "(ratio: median over rounds of raw time / tier time, each pair back to back)")
    print(f"{'mode':<10} {'op':<4} {'chunk':>6} {'raw GB/s':>9} {'tier GB/s':>10} {'ratio':>6} "
          f"{'copy GB/s':>10} {'raw/copy':>9}")
    for r in rows:
        flag = "" if r["ratio"] >= 0.9 else "  < 0.9"
        cp = (f"{r['copy_gbs']:>10.2f} {r['zc_gain']:>9.2f}" if r["copy_gbs"] is not None
              else f"{'-':>10} {'-':>9}")
        print(f"{r['mode']:<10} {r['op']:<4} {r['chunk_mib']:>4}Mi {r['raw_gbs']:>9.2f} {r['tier_gbs']:>10.2f} "
              f"{r['ratio']:>6.2f} {cp}{flag}")
    print("copy: Mooncake's copying calls (put_batch / get_batch + a copy into the destination) on the same client; "
          "raw/copy: the zero-copy calls' gain, median over rounds")
    by = {(r["mode"], r["op"], r["chunk_mib"]): r for r in rows}
    for att in ("same-te", "standalone", "ipc"):
        pairs = [(op, c) for (mo, op, c) in by if mo == att and ("same", op, c) in by]
        if pairs:
            print(f"\n{att} vs embedded (same-process): tier GB/s {att} / tier GB/s embedded")
            for op, c in pairs:
                s, e = by[(att, op, c)], by[("same", op, c)]
                print(f"  {op:<4} {c:>4}Mi  {s['tier_gbs']:.2f} / {e['tier_gbs']:.2f} = "
                      f"{s['tier_gbs'] / e['tier_gbs']:.2f}")
    print("\nmaster down (32 keys per call):")
    print(f"  detecting call {down['detect_s'] * 1e3:.1f} ms; then read miss median {down['read_miss_median_us']:.1f} us "
          f"(p99 {down['read_miss_p99_us']:.1f} us), contains median {down['contains_median_us']:.1f} us "
          f"(p99 {down['contains_p99_us']:.1f} us); available={down['available']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "master_down": down}, f, indent=1)


if __name__ == "__main__":
    main()
