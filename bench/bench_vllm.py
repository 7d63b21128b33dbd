"""Time to first token on vLLM (CPU): cold prefill vs warm from tierkv tiers.

A random-weight Llama (8 layers, hidden 512 by default; no download) gets long
prompts (4096 tokens by default).  For each back end one engine process runs
every prompt cold (computed, and saved by the connector), resets vLLM's prefix
cache, and runs them again warm (loaded from the back end).  Back ends:

    none      no connector (the cold reference)
    dram      TierKVConnector over a host-memory tier
    ssd       TierKVConnector over an SSD tier only
    dram_pool TierKVConnector over Mooncake's pooled DRAM (needs mooncake_master)
    example   vLLM's own ExampleConnector (safetensors files), for comparison

Reported: median TTFT cold and warm, warm/cold ratios (against the engine's own
cold run and against the connector-free cold run), and whether greedy first
tokens match.  Target: warm <= 0.3x cold, and ahead of ExampleConnector.

    python bench/bench_vllm.py [--tokens 4096] [--prompts 3] [--backends dram,ssd,dram_pool,example]
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
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

import vllm_util as U  # noqa: E402


def _engine_spec(model: str, kv: dict | None, prompts: list[list[int]], warm_prompt: list[int], max_len: int,
                 kv_bytes: int, block_size: int) -> dict:
    return {
        "model": model,
        "block_size": block_size,
        "kv_transfer_config": kv,
        "max_model_len": max_len,
        "max_num_batched_tokens": max_len,
        "kv_cache_memory_bytes": kv_bytes,
        "steps": [
            # first-request overheads of both paths (cold prefill, warm load), not measured
            {"op": "ttft", "prompts": [warm_prompt]},
            {"op": "reset"},
            {"op": "ttft", "prompts": [warm_prompt]},
            {"op": "ttft", "prompts": prompts},  # cold
            {"op": "reset"},
            {"op": "ttft", "prompts": prompts},  # warm
            {"op": "records"},
        ],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=128, help="vLLM block size (128 is vLLM's CPU default)")
    ap.add_argument("--backends", default="none,dram,ssd,dram_pool,example")
    ap.add_argument("--layerwise", default="auto", choices=["auto", "true", "false"],
                    help="TierKVConnector's layerwise loading (auto: the connector's default, layer by layer)")
    ap.add_argument("--chunk-tokens", type=int, default=None,
                    help="TierKVConnector's chunk_tokens (tokens per stored object; default: the connector's)")
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
    conn_extra = {"layerwise": lw}
    if args.chunk_tokens is not None:
        conn_extra["chunk_tokens"] = args.chunk_tokens
    results: dict[str, dict] = {}
    master = None
    try:
        for backend in [b.strip() for b in args.backends.split(",") if b.strip()]:
            if backend == "none":
                kv = None
            elif backend == "dram":
                kv = U.connector_config({"tiers": [{"medium": "dram", "capacity": store_bytes}]}, extra=conn_extra)
            elif backend == "ssd":
                path = work / "ssd"
                shutil.rmtree(path, ignore_errors=True)
                kv = U.connector_config({"tiers": [{"medium": "ssd", "path": str(path), "capacity": store_bytes}]},
                                        extra=conn_extra)
            elif backend == "dram_pool":
                import mooncake_util

                reason = mooncake_util.missing_reason()
                if reason:
                    print(f"skipping dram_pool: {reason}", file=sys.stderr)
                    continue
                if master is None:
                    master = mooncake_util.MooncakeMaster().start()
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
            print(f"[{backend}] running ...", file=sys.stderr, flush=True)
            spec = _engine_spec(model, kv, prompts, warm_prompt, max_len, kv_bytes, args.block_size)
            r = U.run_engine(spec, work / "cache", timeout=1800)
            _, _, _, cold, _, warm, rec = r["steps"]
            res = {
                "cold_s": statistics.median(cold["times"]),
                "warm_s": statistics.median(warm["times"]),
                "cold_times": cold["times"],
                "warm_times": warm["times"],
                "warm_cached_tokens": warm["num_cached_tokens"],
                "same_tokens": cold["tokens"] == warm["tokens"],
            }
            if rec.get("workers"):
                res["connector_totals"] = rec["workers"][0]["totals"]
            results[backend] = res
    finally:
        if master is not None:
            master.stop()

    ref = results.get("none", {}).get("cold_s")
    ex = results.get("example", {}).get("warm_s")
    print(f"\nvLLM-CPU TTFT, {args.layers} layers x hidden {args.hidden}, {args.tokens}-token prompts, "
          f"block size {args.block_size}, layerwise={args.layerwise}, chunk_tokens={args.chunk_tokens or 'default'}, median of {args.prompts}")
    print(f"{'backend':<10} {'cold s':>8} {'warm s':>8} {'warm/cold':>10} {'warm/cold(none)':>16} "
          f"{'vs example':>11} {'cached':>7} {'same':>5}")
    for name, r in results.items():
        ratio = r["warm_s"] / r["cold_s"]
        r["warm_over_cold"] = ratio
        r["warm_over_cold_none"] = r["warm_s"] / ref if ref else None
        r["warm_over_example_warm"] = r["warm_s"] / ex if ex else None
        print(f"{name:<10} {r['cold_s']:>8.3f} {r['warm_s']:>8.3f} {ratio:>10.3f} "
              f"{(r['warm_over_cold_none'] or float('nan')):>16.3f} "
              f"{(r['warm_over_example_warm'] or float('nan')):>11.3f} "
              f"{min(r['warm_cached_tokens']):>7} {str(r['same_tokens']):>5}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
