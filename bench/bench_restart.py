"""Warm time to first token after an engine restart, served from a standalone Mooncake pool.

For each back end a round starts a fresh pool on 127.0.0.1 (``mooncake_master``
plus a ``mooncake_client`` process that owns the pool memory), then:

1. engine 1 (a process of its own) runs every prompt once, cold: computed and
   stored by its connector into the empty pool (its TTFT is the back end's cold
   figure), generates a few greedy tokens of each prompt, waits until its saves
   are done, and exits;
2. engine 2 (a new process, same pool) runs the same prompts: each one's TTFT
   (``max_tokens=1``) is the warm-after-restart figure, with the tokens the
   connector served (``num_cached_tokens``); then it generates the same greedy
   tokens, which must equal engine 1's; ``--repeats`` more runs of each prompt
   follow, vLLM's prefix cache reset before each (a second load in the same
   process).

Back ends:

    none       no connector: one engine per round, every prompt cold (the cold reference)
    tierkv     TierKVConnector over a ``dram_pool`` attached to the standalone client over IPC
               (``standalone_address``: shared memory with the node's mooncake_client)
    tierkv-te  the same tier attached through the Transfer Engine (segment 0, tcp over loopback)
    mooncake   vLLM's own MooncakeStoreConnector, ``mode: standalone-store`` (segment 0, tcp), load_async

Before the timed prompts each engine runs one prompt of its own (engine 2 also
loads engine 1's), so first-request costs (kernels, threads, connections) stay
out of the figures.  Rounds rotate the order of the back ends; each ratio is
the median over rounds of the per-round ratio, so back ends are compared under
the same machine conditions (this shared machine drifts by tens of percent).

Reported per back end: median TTFT cold (engine 1) and warm after restart
(engine 2), warm / cold (its own and the connector-free engine's), warm against
MooncakeStoreConnector's warm (the target: below 1), tokens served from the
pool, and whether greedy tokens match between engine 1, engine 2 and the
connector-free engine.

    python bench/bench_restart.py [--rounds 3] [--lengths 2048,3072,4096] [--backends none,tierkv,tierkv-te,mooncake]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))

import mooncake_util
import serve_util as S
import vllm_util as U

BACKENDS = ("none", "tierkv", "tierkv-te", "mooncake")
MiB = 1 << 20


class Pool:
    """One fresh standalone pool for one back end and round; ``stop()`` ends every process it started."""

    def __init__(self, backend: str, work: Path, segment_bytes: int, ipc_buffer: int) -> None:
        self.backend = backend
        self.env: dict[str, str] = dict(mooncake_util.client_env())
        self._mc: S.MooncakePool | None = None
        self._master: mooncake_util.MooncakeMaster | None = None
        self._pool: Any = None
        if backend == "mooncake":
            self._mc = S.MooncakePool(work, "standalone", f"{segment_bytes >> 20}MB")
            self.env.update(self._mc.env())
            self.kv = {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both",
                       "kv_connector_extra_config": {"load_async": True}}
            return
        self._master = mooncake_util.MooncakeMaster().start()
        try:
            self._pool = self._master.standalone_pool(segment_bytes).start()
            ipc = {"ipc_buffer": ipc_buffer} if backend == "tierkv" else {}
            # a loaded machine must not look like a dead peer: a low min_bandwidth
            tier = self._pool.tier_config(ipc=backend == "tierkv", namespace=f"restart-{uuid.uuid4().hex[:8]}",
                                          min_bandwidth="20MB", **ipc)
            self.kv = U.connector_config({"tiers": [tier]})
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        if self._pool is not None:
            self._pool.stop()
            self._pool = None
        if self._master is not None:
            self._master.stop()
            self._master = None
        if self._mc is not None:
            self._mc.stop()
            self._mc = None


def _rotated(names: list[str], i: int) -> list[str]:
    k = i % len(names)
    return names[k:] + names[:k]


def _ttft(srv: U.EngineServer, prompt: list[int], settle: float) -> dict[str, Any]:
    time.sleep(settle)  # the previous run's OpenMP workers stop spinning
    r = srv.step({"op": "ttft", "prompts": [prompt]})
    return {"s": r["times"][0], "token": r["tokens"][0], "cached": r["num_cached_tokens"][0],
            "in_hooks": r.get("load_blocked", [0.0])[0]}


def run_round(backend: str, spec: dict[str, Any], work: Path, prompts: list[list[int]],
              warm_ups: tuple[list[int], list[int]], args: argparse.Namespace,
              segment_bytes: int) -> dict[str, Any]:
    """Engine 1 stores, exits; engine 2 (a new process) is timed.  One fresh pool."""
    pool = Pool(backend, work, segment_bytes, args.ipc_buffer) if backend != "none" else None
    cache = work / "cache"
    out: dict[str, Any] = {"cold": [], "warm": [], "again": [], "local": [], "cached": [], "in_hooks": []}
    try:
        spec = dict(spec, kv_transfer_config=pool.kv if pool else None, env=pool.env if pool else {})
        one = U.EngineServer(spec, cache, timeout=1800)
        try:
            out["startup_1_s"] = one.startup_s
            one.step({"op": "ttft", "prompts": [warm_ups[0]]})
            for p in prompts:
                r = _ttft(one, p, args.settle)
                out["cold"].append(r["s"])
                out.setdefault("first_1", []).append(r["token"])
            out["tokens_1"] = one.step({"op": "generate", "prompts": prompts, "max_tokens": args.gen_tokens,
                                        "one_by_one": True})["tokens"]
            one.step({"op": "reset"})  # every save done: vLLM frees a request's blocks only after its save
            if backend.startswith("tierkv"):
                one.step({"op": "drain"})
        finally:
            one.close()  # engine 1 exits; its process contributed no memory to the pool
        if pool is None:
            return out
        two = U.EngineServer(spec, cache, timeout=1800)
        try:
            out["startup_2_s"] = two.startup_s
            two.step({"op": "ttft", "prompts": [warm_ups[1]]})  # cold: compute path warmed up
            two.step({"op": "ttft", "prompts": [warm_ups[0]]})  # engine 1 stored it: load path warmed up
            for p in prompts:
                r = _ttft(two, p, args.settle)
                out["warm"].append(r["s"])
                out["cached"].append(r["cached"])
                out["in_hooks"].append(r["in_hooks"])
                out.setdefault("first_2", []).append(r["token"])
            out["tokens_2"] = two.step({"op": "generate", "prompts": prompts, "max_tokens": args.gen_tokens,
                                        "one_by_one": True})["tokens"]
            for p in prompts:  # vLLM's own prefix cache holds them now: the floor under any load
                out["local"].append(_ttft(two, p, args.settle)["s"])
            for _ in range(args.repeats):
                for p in prompts:
                    two.step({"op": "reset"})  # vLLM forgets the prompt: it loads from the pool again
                    out["again"].append(_ttft(two, p, args.settle)["s"])
            if backend.startswith("tierkv"):
                rec = two.step({"op": "records"})
                if rec.get("workers"):
                    t = rec["workers"][0]["totals"]
                    out["connector"] = {k: t.get(k) for k in ("hit_tokens", "load_tokens", "load_errors")}
        finally:
            two.close()
    finally:
        if pool is not None:
            pool.stop()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--lengths", default="2048,3072,4096", help="prompt lengths in tokens, comma-separated")
    ap.add_argument("--repeats", type=int, default=1,
                    help="more warm runs of each prompt in engine 2 (vLLM's prefix cache reset before each)")
    ap.add_argument("--gen-tokens", type=int, default=8, help="greedy tokens compared between the engines")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=128, help="vLLM block size (128 is vLLM's CPU default)")
    ap.add_argument("--ipc-buffer", type=int, default=256 * MiB,
                    help="tierkv over IPC: bytes of shared memory chunks are staged through")
    ap.add_argument("--settle", type=float, default=0.05, help="seconds to pause before each timed run")
    ap.add_argument("--workdir", default=None, help="keep the model and logs here (default: a temp dir)")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    args = ap.parse_args(argv)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    for b in backends:
        if b not in BACKENDS:
            raise SystemExit(f"unknown backend {b!r} (one of {', '.join(BACKENDS)})")
    reason = mooncake_util.missing_reason()
    if reason and any(b != "none" for b in backends):
        raise SystemExit(f"cannot run: {reason}")
    lengths = [int(x) for x in args.lengths.split(",")]
    for k, v in mooncake_util.client_env().items():
        os.environ.setdefault(k, v)

    work = Path(args.workdir or tempfile.mkdtemp(prefix="tierkv-bench-restart-"))
    work.mkdir(parents=True, exist_ok=True)
    longest = max(lengths)
    model = U.make_tiny_model(work / f"model-{args.layers}x{args.hidden}", layers=args.layers, hidden=args.hidden,
                              heads=args.heads, kv_heads=args.heads, vocab=4096, max_positions=longest + 256)
    rng = random.Random(0)
    prompts = [[rng.randrange(4096) for _ in range(n)] for n in lengths]
    warm_ups = ([rng.randrange(4096) for _ in range(longest)], [rng.randrange(4096) for _ in range(longest)])
    max_len = longest + 64
    kv_per_token = 2 * args.hidden * 4 * args.layers
    kv_bytes = max(256 << 20, int(kv_per_token * max_len * 2.5))
    # room for every prompt and the warm-up twice over (keys of both connectors), whole MiB
    segment_bytes = max(512 * MiB, (kv_per_token * (sum(lengths) + longest) * 2 // MiB + 64) * MiB)
    spec = {"model": model, "block_size": args.block_size, "max_model_len": max_len,
            "max_num_batched_tokens": max_len, "kv_cache_memory_bytes": kv_bytes, "time_loads": True}

    rounds: dict[str, list[dict[str, Any]]] = {b: [] for b in backends}
    try:
        for r in range(args.rounds):
            for b in _rotated(backends, r):
                t0 = time.monotonic()
                res = run_round(b, spec, work, prompts, warm_ups, args, segment_bytes)
                rounds[b].append(res)
                warm = f", warm {statistics.median(res['warm']):.3f}s cached {res['cached']}" if res["warm"] else ""
                print(f"round {r + 1}/{args.rounds} {b}: cold {statistics.median(res['cold']):.3f}s{warm} "
                      f"({time.monotonic() - t0:.0f}s)", file=sys.stderr, flush=True)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)

    def per_round(b: str, key: str) -> list[float]:
        """Each round's median over prompts."""
        return [statistics.median(x[key]) for x in rounds[b] if x[key]]

    def paired(a: str, key_a: str, b: str, key_b: str) -> float | None:
        """Median over rounds of (a's key_a / b's key_b), prompt by prompt within each round."""
        if a not in rounds or b not in rounds:
            return None
        ratios = [x / y for ra, rb in zip(rounds[a], rounds[b]) for x, y in zip(ra[key_a], rb[key_b])]
        return statistics.median(ratios) if ratios else None

    ref = rounds.get("none", [{}])[0].get("tokens_1") if "none" in rounds else None
    results: dict[str, Any] = {"conditions": {"lengths": lengths, "rounds": args.rounds, "layers": args.layers,
                                              "hidden": args.hidden, "block_size": args.block_size,
                                              "repeats": args.repeats, "segment_bytes": segment_bytes},
                               "backends": {}}
    print(f"\nWarm TTFT after an engine restart (standalone Mooncake pool), {args.layers} layers x hidden "
          f"{args.hidden} fp32, prompts of {lengths} tokens, block size {args.block_size}, {args.rounds} rounds; "
          f"ratios are medians over rounds and prompts of per-prompt ratios")
    print(f"{'backend':<10} {'cold s':>7} {'warm s':>7} {'again s':>8} {'local s':>8} {'warm/cold':>10} "
          f"{'warm/cold(none)':>16} {'vs mooncake':>12} {'load cost':>10} {'vs mooncake':>12} {'in hooks':>9} "
          f"{'served tokens':>22} {'same tokens':>12}")
    for b in backends:
        rs = rounds[b]
        same = all(x["tokens_1"] == x.get("tokens_2", x["tokens_1"]) and x["first_1"] == x.get("first_2", x["first_1"])
                   for x in rs)
        same_ref = ref is None or all(x["tokens_1"] == ref for x in rs)
        row = {
            "cold_s": statistics.median(per_round(b, "cold")),
            "warm_s": statistics.median(per_round(b, "warm")) if b != "none" else None,
            "again_s": statistics.median(per_round(b, "again")) if b != "none" and args.repeats else None,
            "local_s": statistics.median(per_round(b, "local")) if b != "none" else None,
            "in_hooks_s": statistics.median(per_round(b, "in_hooks")) if b != "none" else None,
            # what loading adds above vLLM's own prefix-cache hit, prompt by prompt
            "load_cost_s": (statistics.median(w - lo for x in rs for w, lo in zip(x["warm"], x["local"]))
                            if b != "none" else None),
            "warm_over_cold": paired(b, "warm", b, "cold") if b != "none" else None,
            "warm_over_cold_none": paired(b, "warm", "none", "cold") if b != "none" else None,
            "warm_over_mooncake": paired(b, "warm", "mooncake", "warm") if b != "none" else None,
            "load_cost_over_mooncake": (statistics.median(
                (w - lo) / (mw - mlo) for x, m in zip(rs, rounds.get("mooncake", []))
                for w, lo, mw, mlo in zip(x["warm"], x["local"], m["warm"], m["local"]) if mw > mlo)
                if b != "none" and "mooncake" in rounds else None),
            "again_over_mooncake": (paired(b, "again", "mooncake", "again")
                                    if b != "none" and args.repeats else None),
            "cached_tokens": [x["cached"] for x in rs],
            "same_tokens_1_vs_2": same,
            "same_tokens_vs_none": same_ref,
            "rounds": rs,
        }
        results["backends"][b] = row

        def f(x: float | None, w: int) -> str:
            return f"{x:>{w}.3f}" if x is not None else f"{'-':>{w}}"

        served = str(rs[0]["cached"]) if rs and rs[0]["cached"] else "-"
        print(f"{b:<10} {row['cold_s']:>7.3f} {f(row['warm_s'], 7)} {f(row['again_s'], 8)} {f(row['local_s'], 8)} "
              f"{f(row['warm_over_cold'], 10)} {f(row['warm_over_cold_none'], 16)} {f(row['warm_over_mooncake'], 12)} "
              f"{f(row['load_cost_s'], 10)} {f(row['load_cost_over_mooncake'], 12)} {f(row['in_hooks_s'], 9)} "
              f"{served:>22} {same and same_ref!s:>12}")
    print(f"served tokens: num_cached_tokens of engine 2's first run of each prompt (round 1), of {lengths}; "
          "again: the prompts once more in engine 2, reloaded from the pool;\nlocal: once more with vLLM's own "
          "prefix cache holding them (the floor under any connector); load cost: warm - local, prompt by prompt; "
          "in hooks: seconds the engine's thread spent in the connector's load hooks")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
