"""Time to first token on vLLM (CPU): cold prefill vs warm from tierkv tiers.

A random-weight Llama (8 layers, hidden 512 by default; no download) gets long
prompts (4096 tokens by default).  Each back end has its own engine process,
which runs every prompt cold (computed, and saved by the connector), resets
vLLM's prefix cache, and runs them again warm (loaded from the back end).  Back ends:

    none      no connector (the cold reference)
    dram      TierKVConnector over a host-memory tier
    ssd       TierKVConnector over an SSD tier only
    dram_pool TierKVConnector over Mooncake's pooled DRAM (needs mooncake_master)
    example   vLLM's own ExampleConnector (safetensors files), for comparison

All engines stay up side by side and take turns: each round runs one prompt on
every engine in turn (rotating the order; each prompt runs warm --repeats times, vLLM's
prefix cache reset before each), and a ratio is the median over rounds
of the per-round ratio, so every back end is compared under the same machine
conditions (this shared machine's speed drifts by tens of percent over minutes).

Reported: median TTFT cold and warm, warm/cold ratios (against the engine's own
cold run and against the connector-free cold run), warm against
ExampleConnector's warm, and whether greedy first tokens match (cold vs warm,
and against the connector-free engine).  Target: warm <= 0.3x cold, and ahead of ExampleConnector.

    python bench/bench_vllm.py [--tokens 4096] [--prompts 3] [--repeats 3] [--backends dram,ssd,dram_pool,example]
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
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

import vllm_util as U


def _engine_spec(model: str, kv: dict | None, max_len: int, kv_bytes: int, block_size: int) -> dict:
    return {
        "model": model,
        "block_size": block_size,
        "kv_transfer_config": kv,
        "max_model_len": max_len,
        "max_num_batched_tokens": max_len,
        "kv_cache_memory_bytes": kv_bytes,
        "time_loads": True,  # the time the engine spends in the connector's load hooks, per prompt
    }


#: seconds to pause before each timed run: the engine that ran just before leaves its OpenMP
#: workers spinning for several milliseconds, and a run started at once would share the cores
#: with another process's spinning threads (engines side by side are a benchmark's artifact;
#: a deployment runs one).  ``--settle 0`` turns it off.
SETTLE_S = 0.05


def _rotated(names: list[str], i: int) -> list[str]:
    k = i % len(names)
    return names[k:] + names[:k]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3,
                    help="warm runs per prompt and engine (vLLM's prefix cache is reset before each)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=128, help="vLLM block size (128 is vLLM's CPU default)")
    ap.add_argument("--backends", default="none,dram,ssd,dram_pool,example",
                    help="comma-separated; NAME/whole or NAME/layer forces that load mode for one back end, "
                         "NAME/token sets full_hit_recompute=token, NAME/nowait save_wait=false "
                         "(modes join with +, e.g. ssd/layer+token)")
    ap.add_argument("--layerwise", default="auto", choices=["auto", "true", "false"],
                    help="TierKVConnector's layerwise loading (auto: the connector's default, whole-step on CPU)")
    ap.add_argument("--chunk-tokens", type=int, default=None,
                    help="TierKVConnector's chunk_tokens (tokens per stored object; default: the connector's)")
    ap.add_argument("--full-hit-recompute", default=None, choices=["block", "token"],
                    help="TierKVConnector's full_hit_recompute for every back end (default: the connector's, "
                         "block); a back end named like ssd/token sets it for that one")
    ap.add_argument("--settle", type=float, default=SETTLE_S,
                    help="seconds to pause before each timed run (other engines' OpenMP workers stop spinning)")
    ap.add_argument("--workdir", default=None, help="keep model and stores here (default: a temp dir)")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    args = ap.parse_args(argv)

    work = Path(args.workdir or tempfile.mkdtemp(prefix="tierkv-bench-vllm-"))
    work.mkdir(parents=True, exist_ok=True)
    model = U.make_tiny_model(work / f"model-{args.layers}x{args.hidden}", layers=args.layers, hidden=args.hidden,
                              heads=args.heads, kv_heads=args.heads, vocab=4096, max_positions=args.tokens + 256)
    rng = random.Random(0)
    prompts = [[rng.randrange(4096) for _ in range(args.tokens)] for _ in range(args.prompts)]
    warm_prompt = [rng.randrange(4096) for _ in range(args.tokens)]
    max_len = args.tokens + 64
    kv_per_token = 2 * args.hidden * 4 * args.layers
    kv_bytes = max(256 << 20, int(kv_per_token * max_len * 2.5))
    store_bytes = f"{max(512, kv_per_token * args.tokens * (args.prompts + 1) * 2 >> 20)}MiB"

    lw = {"auto": "auto", "true": True, "false": False}[args.layerwise]
    base_extra = {"layerwise": lw}
    if args.chunk_tokens is not None:
        base_extra["chunk_tokens"] = args.chunk_tokens
    if args.full_hit_recompute is not None:
        base_extra["full_hit_recompute"] = args.full_hit_recompute
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    results: dict[str, dict] = {}
    servers: dict[str, U.EngineServer] = {}
    masters: list = []
    try:
        for name in backends:
            # "ssd/whole" or "dram/layer": that back end with whole-step or layer-by-layer loads;
            # "ssd/token" (or "ssd/layer+token"): full_hit_recompute="token"
            backend, _, modes = name.partition("/")
            conn_extra = dict(base_extra)
            for mode in filter(None, modes.split("+")):
                if mode in ("whole", "layer"):
                    conn_extra["layerwise"] = mode == "layer"
                elif mode in ("token", "block"):
                    conn_extra["full_hit_recompute"] = mode
                elif mode == "nowait":  # saves run on past the step instead of ending with it
                    conn_extra["save_wait"] = False
                else:
                    raise SystemExit(f"unknown mode {mode!r} in {name!r} (whole, layer, token, block or nowait)")
            if backend == "none":
                kv = None
            elif backend == "dram":
                kv = U.connector_config({"tiers": [{"medium": "dram", "capacity": store_bytes}]}, extra=conn_extra)
            elif backend == "ssd":
                path = work / name.replace("/", "-")
                shutil.rmtree(path, ignore_errors=True)
                kv = U.connector_config({"tiers": [{"medium": "ssd", "path": str(path), "capacity": store_bytes}]},
                                        extra=conn_extra)
            elif backend == "dram_pool":
                import mooncake_util

                reason = mooncake_util.missing_reason()
                if reason:
                    print(f"skipping dram_pool: {reason}", file=sys.stderr)
                    continue
                # a pool of its own: engines sharing one would hit each other's chunks when cold
                master = mooncake_util.MooncakeMaster().start()
                masters.append(master)
                for k, v in mooncake_util.client_env().items():
                    os.environ.setdefault(k, v)
                kv = U.connector_config({"tiers": [master.tier_config(segment=store_bytes)]}, extra=conn_extra)
            elif backend == "example":
                path = work / "example"
                shutil.rmtree(path, ignore_errors=True)
                path.mkdir()
                kv = U.connector_config(None, name="ExampleConnector", extra={"shared_storage_path": str(path)})
            else:
                raise SystemExit(f"unknown backend {backend!r}")
            print(f"[{name}] starting ...", file=sys.stderr, flush=True)
            servers[name] = srv = U.EngineServer(
                _engine_spec(model, kv, max_len, kv_bytes, args.block_size), work / "cache", timeout=1800)
            # first-request overheads of both paths (cold prefill, warm load), not measured
            srv.step({"op": "ttft", "prompts": [warm_prompt]})
            srv.step({"op": "reset"})
            srv.step({"op": "ttft", "prompts": [warm_prompt]})
        names = list(servers)
        # every engine is up and idle; each round runs one prompt on each of them in turn
        # (the order rotates), so all back ends see the same machine conditions
        runs: dict[str, dict[str, list]] = {n: {"cold": [], "warm": [], "cold_tok": [], "warm_tok": [],
                                                "warm_cached": [], "local": [], "blocked": []} for n in names}
        for phase in ("cold", "warm"):
            if phase == "warm":
                for n in names:
                    servers[n].step({"op": "reset"})  # saves done, vLLM's own prefix cache emptied
            rounds = [(i, p, rep) for i, p in enumerate(prompts) for rep in range(args.repeats if phase == "warm" else 1)]
            for k, (i, p, rep) in enumerate(rounds):
                print(f"{phase} round {k + 1}/{len(rounds)}", file=sys.stderr, flush=True)
                for n in _rotated(names, k):
                    if rep:
                        servers[n].step({"op": "reset"})  # vLLM forgets the prompt: it loads again
                    time.sleep(args.settle)
                    r = servers[n].step({"op": "ttft", "prompts": [p]})
                    servers[n].step({"op": "drain"})  # its saves finish before the next engine runs
                    runs[n][phase].append(r["times"][0])
                    if not rep:
                        runs[n][f"{phase}_tok"].append(r["tokens"][0])
                    if phase == "warm":
                        runs[n]["warm_cached"].append(r["num_cached_tokens"][0])
                        runs[n]["blocked"].append(r.get("load_blocked", [0.0])[0])
                        # the same prompt once more: vLLM's own prefix cache hit, the floor
                        # under any connector (it still computes the last block)
                        time.sleep(args.settle)
                        runs[n]["local"].append(servers[n].step({"op": "ttft", "prompts": [p]})["times"][0])
        for n in names:
            rec = servers[n].step({"op": "records"})
            r = runs[n]
            res = {
                "cold_s": statistics.median(r["cold"]),
                "warm_s": statistics.median(r["warm"]),
                "cold_times": r["cold"],
                # each warm run's prompt, cold: warm runs pair with it
                "cold_per_warm": [c for c in r["cold"] for _ in range(args.repeats)],
                "warm_times": r["warm"],
                "local_s": statistics.median(r["local"]),
                "local_times": r["local"],
                # what the load adds above vLLM's own local hit, round by round
                "load_cost_times": [w - lo for w, lo in zip(r["warm"], r["local"])],
                # time the engine's thread spent in the connector's load hooks, per warm run
                "load_blocked_times": r["blocked"],
                "warm_cached_tokens": r["warm_cached"],
                "same_tokens": r["cold_tok"] == r["warm_tok"],
                "tokens": r["warm_tok"],
            }
            if rec.get("workers"):
                res["connector_totals"] = rec["workers"][0]["totals"]
            results[n] = res
    finally:
        for srv in servers.values():
            srv.close()
        for master in masters:
            master.stop()
        if not args.workdir:  # a temp dir holds GBs of stores and files: never leave it behind
            shutil.rmtree(work, ignore_errors=True)

    def paired(name: str, other: str | None, key_a: str = "warm_times", key_b: str = "warm_times"):
        """Median over rounds of this back end's time over another's in the same round."""
        if other is None or other not in results or name not in results:
            return None
        a, b = results[name][key_a], results[other][key_b]
        return statistics.median(x / y for x, y in zip(a, b))

    ref_tokens = results.get("none", {}).get("tokens")

    def f(x, w=11):
        return f"{x:>{w}.3f}" if x is not None else f"{'-':>{w}}"

    print(f"\nvLLM-CPU TTFT, {args.layers} layers x hidden {args.hidden}, {args.tokens}-token prompts, "
          f"block size {args.block_size}, layerwise={args.layerwise}, chunk_tokens={args.chunk_tokens or 'default'}; "
          f"{args.prompts} prompts x {args.repeats} warm runs, engines interleaved; ratios are medians of "
          f"per-round ratios")
    print(f"{'backend':<14} {'cold s':>7} {'warm s':>7} {'local s':>8} {'warm/cold':>10} {'warm/cold(none)':>16} "
          f"{'vs example':>11} {'load cost':>10} {'vs example':>11} {'in hooks':>9} {'vs example':>11} "
          f"{'cached':>7} {'same':>5}")
    for name, r in results.items():
        r["warm_over_cold"] = paired(name, name, "warm_times", "cold_per_warm")
        r["warm_over_cold_none"] = paired(name, "none", "warm_times", "cold_per_warm")
        r["warm_over_example_warm"] = paired(name, "example")
        r["load_cost_s"] = statistics.median(r["load_cost_times"])
        ex_cost = results.get("example", {}).get("load_cost_times")
        r["load_cost_over_example"] = (
            statistics.median(x / y for x, y in zip(r["load_cost_times"], ex_cost) if y > 0) if ex_cost else None)
        r["load_blocked_s"] = statistics.median(r["load_blocked_times"]) if r["load_blocked_times"] else None
        ex_blocked = results.get("example", {}).get("load_blocked_times")
        r["load_blocked_over_example"] = (
            statistics.median(x / y for x, y in zip(r["load_blocked_times"], ex_blocked) if y > 0)
            if ex_blocked and r["load_blocked_times"] else None)
        same = r["same_tokens"] and (ref_tokens is None or r["tokens"] == ref_tokens)

        print(f"{name:<14} {r['cold_s']:>7.3f} {r['warm_s']:>7.3f} {r['local_s']:>8.3f} {f(r['warm_over_cold'], 10)} "
              f"{f(r['warm_over_cold_none'], 16)} {f(r['warm_over_example_warm'])} {r['load_cost_s'] * 1e3:>8.1f}ms "
              f"{f(r['load_cost_over_example'])} {(r['load_blocked_s'] or 0) * 1e3:>7.1f}ms "
              f"{f(r['load_blocked_over_example'])} {min(r['warm_cached_tokens']):>7} {same!s:>5}")
    if args.repeats > 1 and "example" in results:
        # a prompt's first warm run comes after the whole cold phase (minutes: files and pages have gone
        # cold, as for a prefix that returns later); repeats follow it at once (everything hot)
        R = args.repeats
        print(f"\n{'vs example':<14} {'first warm: TTFT':>17} {'in hooks':>9} {'repeats: TTFT':>14} {'in hooks':>9}")
        for name, r in results.items():
            if name in ("example", "none"):
                continue
            ex = results["example"]
            row = []
            for sl in (slice(0, None, R), [j for j in range(len(r["warm_times"])) if j % R]):
                def pick(xs, sl=sl):
                    return xs[sl] if isinstance(sl, slice) else [xs[j] for j in sl]
                w = [a / b for a, b in zip(pick(r["warm_times"]), pick(ex["warm_times"]))]
                h = [a / b for a, b in zip(pick(r["load_blocked_times"]), pick(ex["load_blocked_times"])) if b > 0]
                row += [statistics.median(w) if w else None, statistics.median(h) if h else None]
            r["first_warm_over_example"], r["first_hooks_over_example"] = row[0], row[1]
            r["repeat_warm_over_example"], r["repeat_hooks_over_example"] = row[2], row[3]
            print(f"{name:<14} {f(row[0], 17)} {f(row[1], 9)} {f(row[2], 14)} {f(row[3], 9)}")
    print("local: the prompt again at once (vLLM's own prefix cache, the floor under any connector); "
          "load cost: warm - local, per round;\nin hooks: time the engine's thread spent in the connector's "
          "load hooks (start_load_kv, wait_for_layer_load), per warm run")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
