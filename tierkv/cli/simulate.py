"""``tierkv simulate``: replay a request trace through the real store over payload-free media."""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Optional

from tierkv.errors import ConfigError

from ._common import (
    EXIT_OK,
    CommandError,
    dump_json,
    fmt_bytes,
    fmt_num,
    load_store_config,
    parse_kv_sizes,
    progress,
    table,
)

HELP = "replay a request trace through the real store (payload-free media)"
DESCRIPTION = """\
Replay TRACE through the real TieredStore built from --config, with every medium
swapped for a payload-free one at the same capacity and footprint rule (eviction,
admission and promotion policies kept).  Reports per tier hits, bytes moved and
evictions, the token hit rate (a block counts only if every block before it hit)
and prefill tokens saved; with bandwidths (--bench-json or --bandwidth) and
--prefill-tokens-per-s, the load time against the recompute time it replaces.

Trace formats (auto-detected): mooncake (timestamp ms, input_length, output_length,
hash_ids of 512-token blocks), bailian (chat_id, parent_chat_id, timestamp s, ...,
hash_ids of 16-token blocks), tierkv (captures of 'tierkv trace' / TraceWriter).
TRACE may be a file, a .gz file, a directory of rotated captures, or a glob."""

EPILOG = """\
examples:
  tierkv simulate --generate chat --requests 20000 -o chat.jsonl
  tierkv simulate chat.jsonl --config store.yaml --bench-json bench.json --prefill-tokens-per-s 8000
  tierkv simulate chat.jsonl --config store.yaml --sweep dram=1GiB..64GiB:8 --policies lru,s3fifo,arc --out sweep/
"""

#: a tier's medium -> the bench suite whose read bandwidth stands for it
BENCH_MEDIUM = {"hbm": "dram", "dram": "dram", "ssd": "ssd", "dram_pool": "dram_pool", "remote_npu": "dram_pool"}


def add_parser(sub) -> None:
    p = sub.add_parser("simulate", help=HELP, description=DESCRIPTION, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", nargs="?", metavar="TRACE", help="trace file, directory of rotated files, or glob")
    p.add_argument("--config", "-c", help="store config (.json, .yaml, .toml) whose tiers and policies to simulate")
    p.add_argument("--format", choices=("mooncake", "bailian", "tierkv"), help="trace format (default: detect)")
    p.add_argument("--block-tokens", type=int, help="tokens per hash id (default: 512, 16, or the file's)")
    p.add_argument("--bytes-per-token", type=int, default=None,
                   help="KV bytes per token (default 131072: K+V, 32 layers, 8 KV heads, head dim 128, fp16)")
    p.add_argument("--limit", type=int, help="replay only the first N requests")
    p.add_argument("--capacity", action="append", default=[], metavar="TIER=SIZE",
                   help="override a tier's capacity (repeatable), e.g. --capacity dram=64GiB")
    p.add_argument("--eviction", action="append", default=[], metavar="TIER=POLICY",
                   help="override a tier's eviction policy (repeatable), e.g. --eviction ssd=s3fifo")
    p.add_argument("--bench-json", help="a 'tierkv bench --json' file: read bandwidth per tier from it")
    p.add_argument("--bandwidth", action="append", default=[], metavar="TIER=BYTES_PER_S",
                   help="read bandwidth of a tier, e.g. --bandwidth ssd=2GiB (per second); overrides --bench-json")
    p.add_argument("--prefill-tokens-per-s", type=float, help="the engine's prefill throughput, to price recompute")
    p.add_argument("--json", nargs="?", const="-", metavar="FILE", help="write the results as JSON (stdout: -)")
    g = p.add_argument_group("sweep")
    g.add_argument("--sweep", metavar="TIER=LO..HI[:N]", help="vary TIER's capacity over N geometric points")
    g.add_argument("--policies", default=None, help="eviction policies to sweep, comma-separated (default: the "
                   "tier's own); names or package.module:Class")
    g.add_argument("--out", default="tierkv-sweep", help="where sweep.csv and sweep.png go (default ./tierkv-sweep)")
    g.add_argument("--metric", choices=("token_hit_rate", "chunk_hit_rate"), default="token_hit_rate",
                   help="what the plot shows (both are in the CSV)")
    gen = p.add_argument_group("generate")
    gen.add_argument("--generate", metavar="KIND",
                     help="write a synthetic trace: chat, system-prompt, rag, agent or mix (then TRACE is not read)")
    gen.add_argument("--requests", type=int, default=10000, help="requests to generate (default 10000)")
    gen.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    gen.add_argument("--rate", type=float, default=2.0, help="arrivals per second (default 2)")
    gen.add_argument("-o", "--output", help="where --generate writes (default: stdout)")
    p.set_defaults(func=run)


def bandwidths_from(args, cfg: Optional[dict]) -> Optional[dict[str, float]]:
    """Read bandwidth per tier name, bytes/s: from --bench-json by medium, then --bandwidth overrides."""
    if not args.bench_json and not args.bandwidth:
        return None
    out: dict[str, float] = {}
    if args.bench_json:
        from tierkv.benchmarks import read_bandwidths

        by_medium = read_bandwidths(args.bench_json)
        for t in (cfg or {}).get("tiers", []):
            medium = str(t.get("medium"))
            name = t.get("name") or medium
            bw = by_medium.get(BENCH_MEDIUM.get(medium, medium))
            if bw:
                out[name] = bw
    out.update({k: float(v) for k, v in parse_kv_sizes(args.bandwidth, "--bandwidth").items()})
    return out


def _generate(args) -> Optional[list]:
    from tierkv.sim.generate import generate
    from tierkv.sim.traces import write_trace

    bt = args.block_tokens or 512
    reqs = list(generate(args.generate, args.requests, bt, seed=args.seed, rate=args.rate))
    header = {"version": 1, "block_tokens": bt, "generated": args.generate, "seed": args.seed}
    if args.output in (None, "-"):
        if args.config:
            raise CommandError("--generate with --config needs -o FILE (stdout would mix trace and report)")
        import json

        for r in reqs:
            sys.stdout.write(json.dumps(r.to_mooncake(), separators=(",", ":")) + "\n")
        return None
    write_trace(reqs, args.output, header=header)
    print(f"wrote {len(reqs)} {args.generate} requests ({sum(len(r.hash_ids) for r in reqs)} blocks of {bt} tokens)"
          f" to {args.output}", file=sys.stderr if args.json == "-" else sys.stdout)
    return reqs


def run(args) -> int:
    from tierkv.sim import DEFAULT_BYTES_PER_TOKEN
    from tierkv.sim.replay import tune_allocator
    from tierkv.sim.traces import read_trace

    tune_allocator()
    if args.generate:
        reqs = _generate(args)
        if reqs is None or not args.config:
            return EXIT_OK
    else:
        if not args.trace:
            raise CommandError("give a TRACE to replay, or --generate KIND to write one")
        if args.limit is not None and args.limit < 1:
            raise CommandError("--limit must be positive")
        reqs = None
    cfg = load_store_config(args.config)
    if args.bytes_per_token is not None and args.bytes_per_token < 1:
        raise CommandError("--bytes-per-token must be positive")
    if args.prefill_tokens_per_s is not None and args.prefill_tokens_per_s <= 0:
        raise CommandError("--prefill-tokens-per-s must be positive")
    bpt = args.bytes_per_token or DEFAULT_BYTES_PER_TOKEN
    if reqs is None:
        t0 = time.perf_counter()
        reqs = list(read_trace(args.trace, args.format, args.block_tokens, args.limit))
        read_s = time.perf_counter() - t0
    else:
        read_s = 0.0
    if not reqs:
        raise CommandError(f"trace {args.trace!r} holds no requests", code=1)
    bws = bandwidths_from(args, cfg)
    capacities = parse_kv_sizes(args.capacity, "--capacity")
    evictions = {}
    for it in args.eviction:
        name, sep, pol = it.partition("=")
        if not sep:
            raise CommandError(f"--eviction {it!r}: expected TIER=POLICY")
        evictions[name] = pol
    if args.sweep:
        return _run_sweep(args, reqs, cfg, bpt, bws, capacities, evictions)
    from tierkv.sim.replay import simulate

    with progress(len(reqs), "replay", "req") as bar:
        res = simulate(reqs, cfg, bytes_per_token=bpt, bandwidths=bws,
                       prefill_tokens_per_s=args.prefill_tokens_per_s, capacities=capacities, evictions=evictions,
                       progress=bar.update)
    out = res.as_dict()
    out["trace"] = args.trace or args.output
    out["read_s"] = read_s
    if args.json:
        dump_json(out, args.json)
        if args.json == "-":
            return EXIT_OK
    _print_result(out)
    return EXIT_OK


def _print_result(out: dict[str, Any]) -> None:
    print(f"trace: {out['trace']}  requests: {out['requests']}  blocks: {out['blocks']}  "
          f"block: {fmt_bytes(out['block_bytes'])}")
    rows = []
    for name, t in out["tiers"].items():
        rows.append([name, t.get("eviction") or "-", fmt_bytes(t["capacity_bytes"]), t["hits"],
                     fmt_bytes(t["bytes_read"]), fmt_bytes(t["bytes_written"]), t["evictions"], t["demotions"],
                     t["promotions"], fmt_num(t.get("load_s"), 1)])
    table(rows, ["tier", "eviction", "capacity", "hits", "read", "written", "evictions", "demotions", "promotions",
                 "load s"])
    print(f"token hit rate: {out['token_hit_rate']:.4f}  (prefix rule)   chunk hit rate: {out['chunk_hit_rate']:.4f}")
    print(f"prefill tokens saved: {out['prefill_tokens_saved']} of {out['prompt_tokens']}")
    if out.get("load_s") is not None and out.get("recompute_s") is not None:
        gain = out["recompute_s"] / out["load_s"] if out["load_s"] else float("inf")
        print(f"load time: {out['load_s']:.1f} s  vs recompute: {out['recompute_s']:.1f} s  "
              f"(loading is {gain:.1f}x faster than recomputing)")
    elif out.get("recompute_s") is not None:
        print(f"recompute time saved: {out['recompute_s']:.1f} s (give bandwidths to compare load time)")
    elif out.get("load_s") is not None:
        print(f"load time: {out['load_s']:.1f} s (give --prefill-tokens-per-s to compare with recompute)")
    rps = out.get("requests_per_s")
    print(f"replayed in {out['wall_s']:.2f} s ({fmt_num(rps, 0)} requests/s; {out['cpu_s']:.2f} s of CPU)")


def _run_sweep(args, reqs, cfg, bpt, bws, capacities, evictions) -> int:
    from tierkv.sim.sweep import parse_sweep, plot, sweep, write_csv

    tier, caps = parse_sweep(args.sweep)
    names = [t.get("name") or t.get("medium") for t in cfg["tiers"]]
    if tier not in names:
        raise ConfigError(f"--sweep: no tier named {tier!r}; tiers: {names}")
    if args.policies:
        policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    else:
        own = cfg["tiers"][names.index(tier)].get("eviction") or "lru"
        policies = [own if isinstance(own, str) else "lru"]
    if not policies:
        raise CommandError("--policies: no policy given")
    os.makedirs(args.out, exist_ok=True)
    with progress(len(caps) * len(policies), "sweep", "run") as bar:
        rows = sweep(reqs, cfg, tier, caps, policies, progress=bar.update, bytes_per_token=bpt, bandwidths=bws,
                     prefill_tokens_per_s=args.prefill_tokens_per_s)
    csv_path = os.path.join(args.out, "sweep.csv")
    png_path = os.path.join(args.out, "sweep.png")
    write_csv(rows, csv_path)
    plot(rows, png_path, title=f"{args.metric.replace('_', ' ')} vs {tier} capacity "
                               f"({os.path.basename(str(args.trace or args.output))})", metric=args.metric)
    if args.json:
        dump_json({"tier": tier, "rows": rows, "csv": csv_path, "png": png_path}, args.json)
        if args.json == "-":
            return EXIT_OK
    table([[r["policy"], fmt_bytes(r["capacity_bytes"]), f"{r['token_hit_rate']:.4f}", f"{r['chunk_hit_rate']:.4f}",
            r["evictions"]] for r in rows], ["policy", f"{tier} capacity", "token hit", "chunk hit", "evictions"])
    print(f"wrote {csv_path} and {png_path}")
    return EXIT_OK
