"""A hit never slower than recomputing it: time to first token on vLLM (CPU) while a tier is slow, and after.

Three engines side by side on the same random-weight Llama, taking turns prompt by prompt (the order
rotating), vLLM's own prefix cache reset before every timed prompt:

    none        no connector: every prompt computed (the reference)
    tierkv      TierKVConnector with its defaults (``decline_slow_hits`` on)
    no-decline  the same with ``"decline_slow_hits": false``: every hit claimed, however slow its tier

The tierkv engines' store is one tier, ``slow`` (``tests/slow_media.py``: a DRAM tier whose every read sleeps
``--read-delay`` seconds while a file says so). Every prompt is computed and stored once (slow off), then:

* **slow**: the delay on; each prompt once on each engine. tierkv claims a tier's hits until it has three
  samples of its loads (no decline without evidence), then declines them but for its probes
  (``decline_probe_share``, 1 in 16);
* **recovered**: the delay off; each prompt once more. The first probe whose load runs fast brings the hits back.

Reported per phase and engine: median, mean and p90 TTFT, the ratio to ``none`` per prompt (median of the
paired ratios), prompts hit (tokens from the connector) and the connector's decline counters. Goals: while slow,
tierkv's median TTFT <= 1.05x ``none``'s (``no-decline`` pays the delay on every hit); recovered, tierkv's hits
back and its TTFT below ``none``'s.

    python bench/bench_decline.py [--tokens 1024] [--prompts 24] [--read-delay 0.5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

import vllm_util as U

ENGINES = ("none", "tierkv", "no-decline")
#: hits a tier is claimed for before the rule has the samples to judge it (adapters/vllm/decline.py)
EVIDENCE = 3


def _rotated(names: list[str], i: int) -> list[str]:
    k = i % len(names)
    return names[k:] + names[:k]


def _p90(xs: list[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(0.9 * len(s)))]


def summarise(times: dict[str, list[float]], cached: dict[str, list[int]], skip: int = 0) -> dict[str, Any]:
    """Per engine: median, mean and p90 TTFT (ms) over prompts ``skip:``, prompts hit, and the median of its
    per-prompt ratios to ``none``."""
    out: dict[str, Any] = {}
    base = times.get("none")
    for name, ts in times.items():
        t = ts[skip:]
        row: dict[str, Any] = {"n": len(t), "median_ms": 1000 * statistics.median(t),
                               "mean_ms": 1000 * statistics.fmean(t), "p90_ms": 1000 * _p90(t),
                               "hit_prompts": sum(1 for c in cached[name][skip:] if c > 0)}
        if base is not None and name != "none":
            row["vs_none_median"] = statistics.median(a / b for a, b in zip(t, base[skip:]))
            row["vs_none_mean"] = statistics.fmean(t) / statistics.fmean(base[skip:])
        out[name] = row
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1024, help="prompt length")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--read-delay", type=float, default=0.5, help="seconds every read of the slow tier sleeps")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--workdir", default=None, help="keep model and logs here (default: a temp dir)")
    ap.add_argument("--json", default=None, help="also write every number to this file")
    args = ap.parse_args(argv)
    if args.prompts < EVIDENCE + 2 or args.tokens < 2 * args.block_size or args.read_delay <= 0:
        ap.error(f"--prompts must be at least {EVIDENCE + 2}, --tokens at least two blocks, --read-delay > 0")

    work = Path(args.workdir or tempfile.mkdtemp(prefix="tierkv-bench-decline-"))
    work.mkdir(parents=True, exist_ok=True)
    on, off = work / "slow_on", work / "slow_off"
    on.unlink(missing_ok=True)
    off.unlink(missing_ok=True)
    model = U.make_tiny_model(work / f"model-{args.layers}x{args.hidden}", layers=args.layers, hidden=args.hidden,
                              heads=8, kv_heads=8, vocab=4096, max_positions=args.tokens + 256)
    rng = random.Random(0)
    prompts = [[rng.randrange(4096) for _ in range(args.tokens)] for _ in range(args.prompts)]
    max_len = args.tokens + 64
    kv_per_token = 2 * args.hidden * 4 * args.layers
    store = f"{(kv_per_token * args.tokens * args.prompts * 2 >> 20) + 64}MiB"
    tier = {"medium": "slow_media:SlowDRAM", "name": "slow", "capacity": store, "slow_on": str(on),
            "slow_off": str(off), "read_delay_s": args.read_delay}
    kv = {"none": None,
          "tierkv": U.connector_config({"tiers": [tier]}),
          "no-decline": U.connector_config({"tiers": [tier]}, extra={"decline_slow_hits": False})}
    spec = {"model": model, "block_size": args.block_size, "max_model_len": max_len,
            "max_num_batched_tokens": max_len, "kv_cache_memory_bytes": max(256 << 20, kv_per_token * max_len * 3)}
    servers: dict[str, U.EngineServer] = {}
    phases: dict[str, dict[str, Any]] = {}
    try:
        for name in ENGINES:
            print(f"[{name}] starting ...", file=sys.stderr, flush=True)
            servers[name] = U.EngineServer({**spec, "kv_transfer_config": kv[name]}, work / "cache", timeout=1800)
        # every prompt computed (and stored) once: the engines' first-request costs, and the store filled
        for name, srv in servers.items():
            srv.step({"op": "generate", "prompts": prompts, "max_tokens": 1, "one_by_one": True})
            srv.step({"op": "drain"})
        expected = None
        for phase in ("slow", "recovered"):
            (on if phase == "slow" else off).touch()
            times: dict[str, list[float]] = {n: [] for n in servers}
            cached: dict[str, list[int]] = {n: [] for n in servers}
            tokens: dict[str, list[list[int]]] = {n: [] for n in servers}
            for i, p in enumerate(prompts):
                print(f"{phase}: prompt {i + 1}/{len(prompts)}", file=sys.stderr, flush=True)
                for name in _rotated(list(servers), i):
                    srv = servers[name]
                    srv.step({"op": "reset"})  # vLLM forgets the prompt: computed, or served by the connector
                    time.sleep(0.05)  # (the engine that ran before stops its OpenMP workers spinning)
                    r = srv.step({"op": "ttft", "prompts": [p]})
                    times[name].append(r["times"][0])
                    cached[name].append(r["num_cached_tokens"][0])
                    tokens[name].append(r["tokens"][0])
            expected = expected or tokens["none"]
            recs = {n: servers[n].step({"op": "records"}) for n in servers if n != "none"}
            phases[phase] = {
                "all": summarise(times, cached),
                # while slow, the prompts after the evidence the rule waits for
                "after_evidence": summarise(times, cached, EVIDENCE) if phase == "slow" else None,
                "same_tokens": {n: tokens[n] == expected for n in servers},
                "scheduler": {n: {k: (rec.get("scheduler") or [{}])[0].get(k) for k in
                                  ("declined_slow", "declined_slow_tokens", "decline_probes", "hit_tokens_by_tier")}
                              for n, rec in recs.items()},
                "times": times, "cached": cached,
            }
    finally:
        for srv in servers.values():
            srv.close()
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)

    print(f"\nvLLM (CPU), {args.prompts} prompts of {args.tokens} tokens, a slow tier sleeping {args.read_delay} s "
          f"per read; vLLM's prefix cache reset before each prompt; engines taking turns")
    for phase, res in phases.items():
        for part in ("all", "after_evidence"):
            rows = res[part]
            if rows is None:
                continue
            label = phase if part == "all" else f"{phase}, after the first {EVIDENCE} prompts"
            print(f"\n{label}:")
            print(f"  {'engine':<11} {'median ms':>10} {'mean ms':>9} {'p90 ms':>8} {'hit':>5} "
                  f"{'vs none (median)':>17} {'vs none (mean)':>15}")
            for name, row in rows.items():
                vs = (f"{row['vs_none_median']:>17.2f} {row['vs_none_mean']:>15.2f}" if "vs_none_median" in row
                      else f"{'-':>17} {'-':>15}")
                print(f"  {name:<11} {row['median_ms']:>10.0f} {row['mean_ms']:>9.0f} {row['p90_ms']:>8.0f} "
                      f"{row['hit_prompts']:>2}/{row['n']:<2} {vs}")
        for name, sch in res["scheduler"].items():
            print(f"  {name}: declined {sch['declined_slow']}, probes {sch['decline_probes']}, "
                  f"hit tokens by tier {sch['hit_tokens_by_tier']} (totals since start)")
        print(f"  greedy tokens as without a connector: {res['same_tokens']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "phases": phases}, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
