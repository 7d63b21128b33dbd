"""The vLLM connector's own per-object work, beside the store calls it makes.

    .venv/bin/python bench/bench_connector.py [--layers 32] [--blocks 512] [--rounds 5] [--json out.json]

The connector stores one object per (chunk, layer).  Around each store call it does
work of its own: keys from block hashes, block views of the paged KV tensor, save
and load plans, bookkeeping per request and statistics.  This benchmark drives the
worker side (``TierKVWorker``) the way vLLM's worker does, without an engine:

* **save**: ``bind_metadata`` with one request of ``--blocks`` chunks (one block per
  chunk), ``save_kv_layer`` for every layer, ``wait_for_save``; against the baseline
  of ``store.put`` of the same keys and the same block views, built beforehand;
* **load**: the same request as a load (``start_load_kv``, ``wait_for_layer_load``
  of every layer, ``wait_for_save``); against ``store.get`` of the same keys into
  the same blocks;
* **lookup**: the scheduler's question (``answer("lookup", ...)``: how many leading
  blocks every layer holds); against ``store.lookup`` of the last layer's keys plus
  ``store.contains`` of the others'.

Each round uses fresh block hashes (nothing is already stored), and the order of
connector and baseline alternates between rounds.  The baseline hands the store
the cheapest buffers it takes (one flat uint8 view per object, made before the
clock starts) and precomputed keys.  Reported: µs per object of each side
(medians over rounds) and the connector's own cost per object: the median over
rounds of (connector - baseline) within the round, with its range.  Lookups are
per object of the question too (a question covers every layer's objects).
Budget: <= 3 µs per object above the store's own calls.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time

import torch

from tierkv import TieredStore
from tierkv.adapters.vllm.config import ConnectorOptions, EngineInfo, kv_shard
from tierkv.adapters.vllm.metadata import LoadSpec, SaveSpec, TierKVConnectorMetadata
from tierkv.adapters.vllm.worker import TierKVWorker

BLOCK = 16  # tokens per block, and per chunk: one object per block and layer


def hashes(round_: int, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{round_}:{i}".encode()).digest() for i in range(n)]


class Rig:
    def __init__(self, layers: int, blocks: int, head: int) -> None:
        self.L, self.n = layers, blocks
        self.names = tuple(f"model.layers.{i}.self_attn.attn" for i in range(layers))
        # CPU paged layout [num_blocks, kv_heads, block_size, 2*head]
        self.caches = {nm: torch.randn(blocks, 2, BLOCK, 2 * head) for nm in self.names}
        per = self.caches[self.names[0]][0].numel() * 4
        cap = 4 * layers * blocks * per + (64 << 20)
        self.store = TieredStore.from_config({"tiers": [{"medium": "dram", "capacity": cap}]})
        info = EngineInfo(block_size=BLOCK, layers=self.names, num_blocks=blocks,
                          shard=kv_shard(0, 1, 2), namespaces={0: "bench-ns"})
        self.w = TierKVWorker(ConnectorOptions(chunk_tokens=BLOCK, save_wait=True, layerwise=False),
                              info, self.store, serve=False)
        self.w.register_kv_caches(self.caches)
        self.block_ids = list(range(blocks))
        self.object_bytes = per

    # -- the connector's side ------------------------------------------------------
    def conn_save(self, hs: list[bytes]) -> float:
        spec = SaveSpec("r", [(i, i) for i in range(self.n)], [[b] for b in self.block_ids], hs, self.block_ids)
        t0 = time.perf_counter()
        self.w.bind_metadata(TierKVConnectorMetadata(saves=[spec]))
        for nm in self.names:
            self.w.save_kv_layer(nm)
        self.w.wait_for_save()
        self.w.clear_metadata()
        t = time.perf_counter() - t0
        self.w.get_finished({"r"})
        return t

    def conn_load(self, hs: list[bytes]) -> float:
        spec = LoadSpec("r", 0, list(self.block_ids), hs)
        t0 = time.perf_counter()
        self.w.bind_metadata(TierKVConnectorMetadata(loads=[spec]))
        self.w.start_load_kv()
        for nm in self.names:
            self.w.wait_for_layer_load(nm)
        self.w.wait_for_save()
        self.w.clear_metadata()
        t = time.perf_counter() - t0
        bad = self.w.get_block_ids_with_load_errors()
        if bad:
            raise AssertionError(f"{len(bad)} blocks failed to load")
        return t

    def conn_lookup(self, hs: list[bytes]) -> float:
        t0 = time.perf_counter()
        got = self.w.answer("lookup", hs, 0, 0, self.n, None)
        t = time.perf_counter() - t0
        if got != self.n:
            raise AssertionError(f"lookup found {got} of {self.n} blocks")
        return t

    # -- the baseline: the store calls alone ---------------------------------------
    def keys(self, hs: list[bytes]) -> list[list[str]]:
        return [self.w.layer_keys(layer, hs, None) for layer in range(self.L)]

    def views(self) -> list[list[torch.Tensor]]:
        # the cheapest buffers the store takes: one flat uint8 view of each block, made beforehand
        out = []
        for nm in self.names:
            flat = self.caches[nm].reshape(-1).view(torch.uint8)
            nb = flat.numel() // self.n
            out.append([flat[b * nb:(b + 1) * nb] for b in self.block_ids])
        return out

    def base_save(self, keys, views) -> float:
        t0 = time.perf_counter()
        for ks, vs in zip(keys, views):
            ok = self.store.put(ks, vs)
            if not all(ok):
                raise AssertionError("baseline put refused")
        return time.perf_counter() - t0

    def base_load(self, keys, views) -> float:
        t0 = time.perf_counter()
        for ks, vs in zip(keys, views):
            ok = self.store.get(ks, vs)
            if not all(ok):
                raise AssertionError("baseline get missed")
        return time.perf_counter() - t0

    def base_lookup(self, keys) -> float:
        t0 = time.perf_counter()
        n = self.store.lookup(keys[-1])
        rest = self.store.contains([k for ks in keys[:-1] for k in ks[:n]])
        t = time.perf_counter() - t0
        if n != self.n or not all(rest):
            raise AssertionError("baseline lookup missed")
        return t


def run(args) -> dict:
    rig = Rig(args.layers, args.blocks, args.head)
    objs = args.layers * args.blocks
    res: dict[str, list[float]] = {k: [] for k in ("conn_save", "base_save", "conn_load", "base_load",
                                                     "conn_lookup", "base_lookup")}
    views = rig.views()
    for r in range(args.rounds + 1):  # round 0 warms up
        hc, hb = hashes(2 * r, args.blocks), hashes(2 * r + 1, args.blocks)
        kb = rig.keys(hb)
        sides = [("conn", hc), ("base", hb)] if r % 2 else [("base", hb), ("conn", hc)]
        t = {}
        for side, hs in sides:
            if side == "conn":
                t["conn_save"] = rig.conn_save(hs)
                t["conn_load"] = rig.conn_load(hs)
                t["conn_lookup"] = rig.conn_lookup(hs)
            else:
                t["base_save"] = rig.base_save(kb, views)
                t["base_load"] = rig.base_load(kb, views)
                t["base_lookup"] = rig.base_lookup(kb)
        # both sides' objects go, so every round starts from the same store size
        for ks in rig.keys(hc) + kb:
            rig.store.remove(ks)
        if r:
            for k, v in t.items():
                res[k].append(v)
    rig.w.shutdown()
    med = {k: statistics.median(v) for k, v in res.items()}
    out = {"layers": args.layers, "blocks": args.blocks, "objects": objs, "object_bytes": rig.object_bytes,
           "rounds": args.rounds}
    for op in ("save", "load", "lookup"):
        # the connector's own cost: the median over rounds of (connector - baseline) in the same round
        own = sorted((c - b) / objs * 1e6 for c, b in zip(res[f"conn_{op}"], res[f"base_{op}"]))
        out[op] = {"connector_us": med[f"conn_{op}"] / objs * 1e6, "store_us": med[f"base_{op}"] / objs * 1e6,
                   "connector_own_us": statistics.median(own), "connector_own_range_us": [own[0], own[-1]]}
    out["lookup"]["connector_call_us"] = med["conn_lookup"] * 1e6
    out["lookup"]["store_call_us"] = med["base_lookup"] * 1e6
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=512, help="chunks of the request (one block each)")
    ap.add_argument("--head", type=int, default=8, help="head size (a block of one layer is 2*16*2*head floats)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    for name in ("layers", "blocks", "head", "rounds"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name} must be positive")
    out = run(args)
    print(f"{out['objects']:,} objects ({args.layers} layers x {args.blocks} chunks) of {out['object_bytes']} B, "
          f"median of {args.rounds} rounds")
    print(f"{'':<12}{'connector':>12}{'store alone':>14}{'connector own':>16}{'(range)':>18}{'budget':>8}")
    for op in ("save", "load", "lookup"):
        d = out[op]
        lo, hi = d["connector_own_range_us"]
        print(f"{op + ' /obj':<12}{d['connector_us']:>9.2f} µs{d['store_us']:>11.2f} µs"
              f"{d['connector_own_us']:>13.2f} µs{f'{lo:.2f} .. {hi:.2f}':>18}{'<= 3':>8}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
