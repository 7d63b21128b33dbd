"""The vLLM connector's own per-object work, beside the store calls it makes.

    .venv/bin/python bench/bench_connector.py [--layers 32] [--blocks 512] [--local 0] [--rounds 11]
        [--kv-head-shards 1] [--json out.json]

The connector stores one object per (chunk, layer).  Around each store call it does
work of its own: keys from block hashes, block views of the paged KV tensor, save
and load plans, bookkeeping per request and statistics.  This benchmark drives the
worker side (``TierKVWorker``) the way vLLM's worker does, without an engine:

* **save**: ``bind_metadata`` with one request of ``--blocks`` chunks (one block per
  chunk), ``save_kv_layer`` for every layer, ``wait_for_save``; against the baseline
  of ``store.put_detailed`` (the call the connector makes) of the same keys and the
  same block views, built beforehand, one call per layer;
* **load**: the same request as a load (``start_load_kv``, ``wait_for_layer_load``
  of every layer, ``wait_for_save``); against ``store.get`` of the same keys into
  the same blocks, in the calls the connector makes (one get of every layer:
  whole-step loads, the default on CPU);
* **lookup**: the scheduler's question, as a worker answers it (``worker.probe`` of a
  ``ProbeRequest`` with ``--local`` blocks already in vLLM: how far every layer holds
  the prefix from there, whether it holds those, and which tier holds each block hit),
  naming the request as the scheduler does, so the worker leases what it found, and
  letting go of that lease as a load's end does (``--no-lease``: the probe alone);
  against ``store.lookup`` of the last layer's keys plus ``store.contains`` of the
  others', the keys made beforehand.

Each round uses fresh block hashes (nothing is already stored); within a round
the connector's and the baseline's run of each operation follow one another, the
first of the two alternating between rounds.  The baseline hands the store
the cheapest buffers it takes (one flat uint8 view per object, made before the
clock starts) and precomputed keys.  Reported: µs per object of each side
(medians over rounds) and the connector's own cost per object: the median over
rounds of (connector - baseline) within the round, with its range, in wall-clock
time and in the process's CPU time (the save thread's included; on a shared
machine it moves less than wall time when the benchmark is descheduled).  Lookups are
per object of the question too (a question covers every layer's objects).
The objects alive once the rig is built are frozen out of the garbage collector
first, as vLLM freezes its heap once its engine has started.
``--kv-head-shards 2`` stores each layer's two KV heads as two objects (the option of the
same name, as an engine at TP 1 does in a fleet that also runs TP 2): twice the objects,
each half the size, the baseline's views each one head of a block.
Budget: <= 3 µs per object above the store's own calls.

``--verify-cost``: what checking each chunk's checksum costs the connector's
in-engine load instead (issue target: at most 10 % of the load's time).  Two rigs
hold the same request in a ``dram`` tier, one ``"verify": "external"`` (a local
tier's reads unchecked, the default), one ``"verify": "always"`` (every read hashed
and compared); each round loads the request through both (``start_load_kv`` ..
``wait_for_save``), the first alternating.  Reported: each side's median load time
and GB/s, and the median over rounds of the round's unchecked / checked time (1.0:
free; the target is >= 0.9).  ``--head 8192`` makes 2 MiB objects (a block of
``2*16*2*head`` float32).

``--bandwidth``: the connector's load bandwidth against a ``memcpy`` of the same bytes
(issue target: at least 0.8x).  The same two rigs as ``--verify-cost`` (``"always"``:
every read's checksum checked, the line that counts; ``"external"``: a ``dram`` read
unchecked, beside it); the baseline ``memcpy``s every object from a source laid out as
the slab lays objects out (back to back, in the load's order) into the same block
views of the paged cache, on as many threads as the store's host copies use
(``COPY_THREADS``: the caller and ``tierkv.buffers``' copy helper), each taking the
next object as ``tierkv.buffers.share_work`` hands them out.  Each round runs the
three, the order rotating between rounds; reported per side the median GiB/s over
rounds with its range, and the median (range) over rounds of the round's connector
/ memcpy bandwidth.  ``--layers 8 --blocks 32 --head 2048`` is a 4096-token prefix of
128 MiB in 512 KiB objects (the serving benchmark's, 16-token chunks instead of 128).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import hashlib
import json
import os
import statistics
import sys
import threading
import time

import torch

from tierkv import TieredStore
from tierkv.adapters.vllm.config import ConnectorOptions, EngineInfo, kv_shard
from tierkv.adapters.vllm.metadata import LoadSpec, SaveSpec, TierKVConnectorMetadata
from tierkv.adapters.vllm.service import ProbeRequest
from tierkv.adapters.vllm.worker import TierKVWorker
from tierkv.buffers import share_work

BLOCK = 16  # tokens per block, and per chunk: one object per block and layer
#: threads a large host read of the store copies on: the caller and tierkv.buffers' one copy helper
#: (``on_two_threads``, which ``copy_and_sum`` and ``memmove_many`` use)
COPY_THREADS = 2
GIB = 1 << 30


def clock() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def since(t0: tuple[float, float]) -> tuple[float, float]:
    """(wall, CPU) seconds since ``t0``; CPU is the whole process's (the save thread's included)."""
    return time.perf_counter() - t0[0], time.process_time() - t0[1]


def hashes(round_: int, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{round_}:{i}".encode()).digest() for i in range(n)]


class Rig:
    def __init__(self, layers: int, blocks: int, head: int, local: int = 0, lease: bool = True,
                 verify: str = "external", kv_head_shards: int = 1) -> None:
        self.n, self.local = blocks, local
        self.S = kv_head_shards
        self.L = layers * kv_head_shards  # objects per chunk (slices)
        self.rid = "r" if lease else None
        self.names = tuple(f"model.layers.{i}.self_attn.attn" for i in range(layers))
        # CPU paged layout [num_blocks, kv_heads, block_size, 2*head]
        self.caches = {nm: torch.randn(blocks, 2, BLOCK, 2 * head) for nm in self.names}
        per = self.caches[self.names[0]][0].numel() * 4 // kv_head_shards
        cap = 4 * self.L * blocks * per + (64 << 20)
        self.store = TieredStore.from_config({"tiers": [{"medium": "dram", "capacity": cap}], "verify": verify})
        info = EngineInfo(block_size=BLOCK, layers=self.names, num_blocks=blocks, shard=kv_shard(0, 1, 2),
                          namespaces={j: f"bench-ns-{j}-of-{kv_head_shards}" for j in range(kv_head_shards)},
                          kv_head_shards=kv_head_shards, rank_kv_heads=(2,))
        self.w = TierKVWorker(ConnectorOptions(chunk_tokens=BLOCK, save_wait=True, layerwise=False),
                              info, self.store, serve=False)
        self.w.register_kv_caches(self.caches)
        self.block_ids = list(range(blocks))
        self.object_bytes = per

    # -- the connector's side ------------------------------------------------------
    def conn_save(self, hs: list[bytes]) -> tuple[float, float]:
        spec = SaveSpec("r", [(i, i) for i in range(self.n)], [[b] for b in self.block_ids], hs, self.block_ids)
        t0 = clock()
        self.w.bind_metadata(TierKVConnectorMetadata(saves=[spec]))
        for nm in self.names:
            self.w.save_kv_layer(nm)
        self.w.wait_for_save()
        self.w.clear_metadata()
        t = since(t0)
        self.w.get_finished({"r"})
        return t

    def conn_load(self, hs: list[bytes]) -> tuple[float, float]:
        spec = LoadSpec("r", 0, list(self.block_ids), hs)
        t0 = clock()
        self.w.bind_metadata(TierKVConnectorMetadata(loads=[spec]))
        self.w.start_load_kv()
        for nm in self.names:
            self.w.wait_for_layer_load(nm)
        self.w.wait_for_save()
        self.w.clear_metadata()
        t = since(t0)
        bad = self.w.get_block_ids_with_load_errors()
        if bad:
            raise AssertionError(f"{len(bad)} blocks failed to load")
        return t

    def conn_lookup(self, hs: list[bytes]) -> tuple[float, float]:
        t0 = clock()
        got = self.w.probe(ProbeRequest(hs, self.local, None, self.rid))
        if self.rid is not None:
            self.w.leases.release([self.rid])  # (as the request's load does once it is over)
        t = since(t0)
        if (got.reach, got.held) != (self.n - self.local, self.local):
            raise AssertionError(f"the probe found {got.held} + {got.reach} of {self.n} blocks")
        if self.rid is not None and got.leased != (self.n - self.local) * self.L:
            raise AssertionError(f"the probe leased {got.leased} objects")
        return t

    # -- the baseline: the store calls alone ---------------------------------------
    def keys(self, hs: list[bytes]) -> list[list[str]]:
        return [self.w.keys.keys(layer, hs, None) for layer in range(self.L)]

    def views(self) -> list[list[torch.Tensor]]:
        # the cheapest buffers the store takes: one flat uint8 view of each block (of each of its head
        # shards), made beforehand
        out = []
        h = 2 // self.S
        for nm in self.names:
            for k in range(self.S):
                out.append([self.caches[nm][b, k * h:(k + 1) * h].reshape(-1).view(torch.uint8)
                            for b in self.block_ids])
        return out

    def base_save(self, keys, views) -> tuple[float, float]:
        put = self.store.put_detailed  # the call the connector makes
        t0 = clock()
        res = [put(ks, vs) for ks, vs in zip(keys, views)]
        t = since(t0)
        if not all(all(ok) for ok in res):
            raise AssertionError("baseline put refused")
        return t

    def base_load(self, keys, views) -> tuple[float, float]:
        # the calls the connector makes: one get of every layer (whole-step loads), or one per layer
        if self.w.layerwise:
            calls = list(zip(keys, views))
        else:
            calls = [([k for ks in keys for k in ks], [v for vs in views for v in vs])]
        get = self.store.get
        t0 = clock()
        res = [get(ks, vs) for ks, vs in calls]
        t = since(t0)
        if not all(all(ok) for ok in res):
            raise AssertionError("baseline get missed")
        return t

    def base_lookup(self, keys) -> tuple[float, float]:
        t0 = clock()
        n = self.store.lookup(keys[-1])
        rest = self.store.contains([k for ks in keys[:-1] for k in ks[:n]])
        t = since(t0)
        if n != self.n or not all(rest):
            raise AssertionError("baseline lookup missed")
        return t


def run(args) -> dict:
    rig = Rig(args.layers, args.blocks, args.head, args.local, lease=not args.no_lease,
              kv_head_shards=args.kv_head_shards)
    objs = rig.L * args.blocks
    res: dict[str, list[tuple[float, float]]] = {
        k: [] for k in ("conn_save", "base_save", "conn_load", "base_load", "conn_lookup", "base_lookup")}
    views = rig.views()
    # as vLLM's engine core and workers do once started (vllm.utils.gc_utils.freeze_gc_heap): without it
    # a full collection walks every object of the imports and the rig, about half a second here, and
    # lands in one side's timing or the other's at random
    gc.collect()
    gc.freeze()
    for r in range(args.rounds + 1):  # round 0 warms up
        hc, hb = hashes(2 * r, args.blocks), hashes(2 * r + 1, args.blocks)
        kb = rig.keys(hb)
        t = {}
        for op in ("save", "load", "lookup"):
            # the two sides of one operation back to back (the machine's load changes between
            # operations), the first of them alternating between rounds
            for side in (("conn", "base") if r % 2 else ("base", "conn")):
                if side == "conn":
                    t[f"conn_{op}"] = getattr(rig, f"conn_{op}")(hc)
                elif op == "lookup":
                    t["base_lookup"] = rig.base_lookup(kb)
                else:
                    t[f"base_{op}"] = getattr(rig, f"base_{op}")(kb, views)
        # both sides' objects go, so every round starts from the same store size
        for ks in rig.keys(hc) + kb:
            rig.store.remove(ks)
        if r:
            for k, v in t.items():
                res[k].append(v)
    rig.w.shutdown()
    out: dict = {"layers": args.layers, "blocks": args.blocks, "local": args.local, "objects": objs,
                 "kv_head_shards": args.kv_head_shards,
                 "lease": not args.no_lease,
                 "object_bytes": rig.object_bytes,
                 "rounds": args.rounds, "loadavg_1min": os.getloadavg()[0]}
    for op in ("save", "load", "lookup"):
        d: dict = {}
        for i, clk in enumerate(("", "cpu_")):
            conn = [v[i] / objs * 1e6 for v in res[f"conn_{op}"]]
            base = [v[i] / objs * 1e6 for v in res[f"base_{op}"]]
            # the connector's own cost: the median over rounds of (connector - baseline) in the same round
            own = sorted(c - b for c, b in zip(conn, base))
            d.update({f"connector_{clk}us": statistics.median(conn), f"store_{clk}us": statistics.median(base),
                      f"connector_own_{clk}us": statistics.median(own),
                      f"connector_own_{clk}range_us": [own[0], own[-1]]})
        out[op] = d
    return out


def saved_rigs(args, verifies: tuple[str, ...]) -> tuple[dict, list[bytes]]:
    """One rig per ``verify`` setting, each holding the request's chunks saved; and the request's hashes."""
    rigs = {v: Rig(args.layers, args.blocks, args.head, verify=v) for v in verifies}
    hs = hashes(0, args.blocks)
    for rig in rigs.values():
        rig.conn_save(hs)
    return rigs, hs


def run_verify_cost(args) -> dict:
    """The connector's load from a ``dram`` tier, reads unchecked beside reads checked (see the module doc)."""
    rigs, hs = saved_rigs(args, ("external", "always"))
    objs = rigs["external"].L * args.blocks
    before = rigs["always"].store.stats()["dram"]["corrupt"]
    gc.collect()
    gc.freeze()
    times: dict[str, list[float]] = {v: [] for v in rigs}
    for r in range(args.rounds + 1):  # round 0 warms up
        for v in (("external", "always") if r % 2 else ("always", "external")):
            wall, _ = rigs[v].conn_load(hs)
            if r:
                times[v].append(wall)
    if rigs["always"].store.stats()["dram"]["corrupt"] != before:
        raise AssertionError("a checked read found a corrupt chunk")
    nbytes = objs * rigs["external"].object_bytes
    ratios = sorted(u / c for u, c in zip(times["external"], times["always"]))
    out: dict = {"layers": args.layers, "blocks": args.blocks, "objects": objs,
                 "object_bytes": rigs["external"].object_bytes, "rounds": args.rounds,
                 "loadavg_1min": os.getloadavg()[0], "ratio": statistics.median(ratios),
                 "ratio_range": [ratios[0], ratios[-1]]}
    for v in rigs:
        med = statistics.median(times[v])
        out[v] = {"load_ms": med * 1e3, "gbps": nbytes / med / 1e9}
    for rig in rigs.values():
        rig.w.shutdown()
    return out

class Memcpy:
    """The baseline: ``memmove`` of (dst, src, n) moves on ``threads`` threads (the caller and a pool).

    Each thread takes the next move until none is left, as the store's copies do; the
    pool is started once, so no round pays for starting a thread.
    """

    def __init__(self, threads: int) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.helpers = threads - 1
        self.pool = ThreadPoolExecutor(max(1, self.helpers), thread_name_prefix="bench-memcpy")
        self.pool.submit(threading.get_ident).result()  # started before the first round

    def run(self, moves: list[tuple[int, int, int]]) -> float:
        def one(i: int) -> None:
            ctypes.memmove(*moves[i])  # (ctypes lets go of the GIL for the call)

        t0 = time.perf_counter()
        share_work(one, len(moves), self.pool, self.helpers)
        return time.perf_counter() - t0

    def close(self) -> None:
        self.pool.shutdown()


def baseline_moves(rig: Rig, src: torch.Tensor) -> list[tuple[int, int, int]]:
    """Every object of the load (layer-major, as the load's one get orders them) into its block view."""
    per, base = rig.object_bytes, src.data_ptr()
    moves = []
    for i, dst in enumerate(v for vs in rig.views() for v in vs):
        if dst.numel() != per or not dst.is_contiguous():
            raise AssertionError("a block view is not one contiguous object")
        moves.append((dst.data_ptr(), base + i * per, per))
    return moves


def run_bandwidth(args) -> dict:
    """The connector's load (checked and unchecked) against a ``memcpy`` of the same bytes (see the module doc)."""
    rigs, hs = saved_rigs(args, ("always", "external"))
    saved = {v: rig.caches[rig.names[-1]].clone() for v, rig in rigs.items()}
    ref = rigs["always"]
    objs, per = ref.L * args.blocks, ref.object_bytes
    nbytes = objs * per
    src = torch.empty(nbytes, dtype=torch.uint8)
    src.random_(0, 256)  # (every page touched before the clock starts, as the slab's are)
    moves = baseline_moves(ref, src)
    mc = Memcpy(COPY_THREADS)
    before = ref.store.stats()["dram"]["corrupt"]
    gc.collect()
    gc.freeze()
    sides = ("always", "external", "memcpy")
    times: dict[str, list[float]] = {s: [] for s in sides}
    for r in range(args.rounds + 1):  # round 0 warms up
        k = r % 3
        for side in sides[k:] + sides[:k]:
            t = mc.run(moves) if side == "memcpy" else rigs[side].conn_load(hs)[0]
            if r:
                times[side].append(t)
    mc.close()
    if ref.store.stats()["dram"]["corrupt"] != before:
        raise AssertionError("a checked read found a corrupt chunk")
    for v, rig in rigs.items():  # the baseline wrote over the "always" rig's cache: a last load puts it back
        rig.conn_load(hs)
        if not torch.equal(rig.caches[rig.names[-1]], saved[v]):
            raise AssertionError(f"the load (verify {v}) did not write what was saved")
    out: dict = {"layers": args.layers, "blocks": args.blocks, "objects": objs, "object_bytes": per,
                 "bytes": nbytes, "threads": COPY_THREADS, "rounds": args.rounds}
    bw = {s: sorted(nbytes / GIB / t for t in times[s]) for s in sides}
    for s in sides:
        out[s] = {"gib_s": statistics.median(bw[s]), "gib_s_range": [bw[s][0], bw[s][-1]],
                  "ms": statistics.median(times[s]) * 1e3}
    for v in ("always", "external"):
        ratios = sorted(m / c for c, m in zip(times[v], times["memcpy"]))  # bandwidth ratio, per round
        out[v].update({"ratio": statistics.median(ratios), "ratio_range": [ratios[0], ratios[-1]]})
    out["loadavg"] = list(os.getloadavg())
    for rig in rigs.values():
        rig.w.shutdown()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=512, help="chunks of the request (one block each)")
    ap.add_argument("--head", type=int, default=8, help="head size (a block of one layer is 2*16*2*head floats)")
    ap.add_argument("--local", type=int, default=0, help="blocks the lookup's request already has in vLLM")
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--no-lease", action="store_true", help="the lookup does not lease what it finds")
    ap.add_argument("--verify-cost", action="store_true",
                    help="measure the load with every chunk's checksum checked against the load unchecked")
    ap.add_argument("--bandwidth", action="store_true",
                    help="the connector's load bandwidth against a memcpy of the same bytes on the same threads")
    ap.add_argument("--kv-head-shards", type=int, default=1, choices=(1, 2),
                    help="objects per chunk and layer (the cache has 2 KV heads): 2 splits them by head")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    for name in ("layers", "blocks", "head", "rounds"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name} must be positive")
    if not 0 <= args.local <= args.blocks:
        ap.error(f"--local must be between 0 and --blocks ({args.blocks})")
    if args.bandwidth and args.verify_cost:
        ap.error("--bandwidth and --verify-cost are separate runs: give one of them")
    if args.bandwidth:
        out = run_bandwidth(args)
        print(f"connector load of {out['objects']:,} objects ({args.layers} layers x {args.blocks} chunks) of "
              f"{out['object_bytes']:,} B ({out['bytes'] / GIB * 1024:.0f} MiB) from dram against a memcpy on "
              f"{out['threads']} threads, median (range) of {args.rounds} rounds")
        m = out["memcpy"]
        print(f"  {'memcpy':<22}{m['ms']:8.2f} ms {m['gib_s']:6.2f} GiB/s ({m['gib_s_range'][0]:.2f} .. "
              f"{m['gib_s_range'][1]:.2f})")
        for v, what in (("always", "checksums checked"), ("external", "verify off")):
            d = out[v]
            print(f"  {what:<22}{d['ms']:8.2f} ms {d['gib_s']:6.2f} GiB/s ({d['gib_s_range'][0]:.2f} .. "
                  f"{d['gib_s_range'][1]:.2f})  / memcpy {d['ratio']:.2f} ({d['ratio_range'][0]:.2f} .. "
                  f"{d['ratio_range'][1]:.2f}; target >= 0.8)")
        print("(load average 1/5/15 min at the end: {:.2f} {:.2f} {:.2f})".format(*out["loadavg"]))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
        return 0
    if args.verify_cost:
        out = run_verify_cost(args)
        print(f"connector load of {out['objects']:,} objects ({args.layers} layers x {args.blocks} chunks) of "
              f"{out['object_bytes']} B from dram, median of {args.rounds} rounds")
        for v in ("external", "always"):
            print(f"  verify {v:<9} {out[v]['load_ms']:9.2f} ms  {out[v]['gbps']:6.2f} GB/s")
        lo, hi = out["ratio_range"]
        print(f"  unchecked / checked time: {out['ratio']:.3f} (range {lo:.3f} .. {hi:.3f}; target >= 0.9)")
        print(f"(1-minute load average at the end: {out['loadavg_1min']:.2f})")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
        return 0
    out = run(args)
    print(f"{out['objects']:,} objects ({args.layers} layers x {args.kv_head_shards} KV-head shard(s) x "
          f"{args.blocks} chunks) of {out['object_bytes']} B, "
          f"median of {args.rounds} rounds")
    print(f"{'µs per object':<14}{'connector':>10}{'store alone':>12}{'own':>7}{'(range)':>16}"
          f"{'own CPU':>9}{'(range)':>16}{'budget':>8}")
    for op in ("save", "load", "lookup"):
        d = out[op]
        lo, hi = d["connector_own_range_us"]
        clo, chi = d["connector_own_cpu_range_us"]
        print(f"{op:<14}{d['connector_us']:>10.2f}{d['store_us']:>12.2f}{d['connector_own_us']:>7.2f}"
              f"{f'{lo:.2f} .. {hi:.2f}':>16}{d['connector_own_cpu_us']:>9.2f}{f'{clo:.2f} .. {chi:.2f}':>16}"
              f"{'<= 3':>8}")
    print(f"(1-minute load average at the end: {out['loadavg_1min']:.2f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
