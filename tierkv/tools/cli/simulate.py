"""``tierkv simulate``: replay a request trace through the real store over payload-free media."""

from __future__ import annotations

import argparse
import collections
import math
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
    note,
    parse_kv_sizes,
    positive,
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
--prefill-tokens-per-s, the load time against the recompute time it replaces, and
the vLLM connector's decline rule: a hit's part on a tier that reads slower than
the prefill computes, by more than --decline-margin-ms, is not read (declined, by
tier; --no-decline reads it).

Trace formats (auto-detected): mooncake (timestamp ms, input_length, output_length,
hash_ids of 512-token blocks), bailian (chat_id, parent_chat_id, timestamp s, ...,
hash_ids of 16-token blocks), tierkv (captures of 'tierkv trace' / TraceWriter).
TRACE may be a file, a .gz file, a directory of rotated captures, or a glob.

A block's bytes come from --bytes-per-token, else from the trace (captures carry
block_bytes), else a Llama-3-8B in fp16 is assumed (131072 bytes per token) and
said so on stderr.  --json prints one JSON document to stdout and nothing else;
progress and warnings go to stderr."""

EPILOG = """\
examples:
  tierkv simulate --generate chat --requests 20000 -o chat.jsonl
  tierkv simulate chat.jsonl --config store.yaml --bench-json bench.json --prefill-tokens-per-s 8000
  tierkv simulate chat.jsonl --config store.yaml --sweep dram=1GiB..64GiB:8 --policies lru,s3fifo,arc --out sweep/

A sweep of one tier of a chain plots that tier's own hit rate by default (the tiers
below it catch its misses, so the chain's token hit rate hardly moves).
"""

#: a tier's medium -> the bench suite whose read bandwidth stands for it
BENCH_MEDIUM = {"hbm": "dram", "dram": "dram", "ssd": "ssd", "dram_pool": "dram_pool", "remote_npu": "dram_pool"}

#: read bandwidth above which no device of the medium exists today (bytes/s): HBM3e stacks give ~5 TB/s per
#: accelerator, a socket's DRAM ~0.6 TB/s, an NVMe array behind one host ~100 GB/s, a node's NICs ~0.4 TB/s
PLAUSIBLE_BPS = {"hbm": 16 * 2**40, "dram": 2 * 2**40, "ssd": 128 * 2**30, "dram_pool": 1 * 2**40,
                 "remote_npu": 1 * 2**40}
#: for a medium not listed (a custom one): the fastest of any
PLAUSIBLE_ANY_BPS = max(PLAUSIBLE_BPS.values())


def add_parser(sub) -> None:
    p = sub.add_parser("simulate", help=HELP, description=DESCRIPTION, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", nargs="?", metavar="TRACE", help="trace file, directory of rotated files, or glob")
    p.add_argument("--config", "-c", help="store config (.json, .yaml, .toml) whose tiers and policies to simulate")
    p.add_argument("--format", choices=("mooncake", "bailian", "tierkv"), help="trace format (default: detect)")
    p.add_argument("--block-tokens", type=int, help="tokens per hash id (default: 512, 16, or the file's)")
    p.add_argument("--bytes-per-token", type=int, default=None,
                   help="KV bytes per token (default: the trace's block_bytes, else 131072: a Llama-3-8B, K+V, "
                        "32 layers, 8 KV heads, head dim 128, fp16)")
    p.add_argument("--limit", type=int, help="replay only the first N requests")
    p.add_argument("--capacity", action="append", default=[], metavar="TIER=SIZE",
                   help="override a tier's capacity (repeatable), e.g. --capacity dram=64GiB")
    p.add_argument("--eviction", action="append", default=[], metavar="TIER=POLICY",
                   help="override a tier's eviction policy (repeatable), e.g. --eviction ssd=s3fifo")
    p.add_argument("--bench-json", help="a 'tierkv bench --json' file: read bandwidth per tier from it")
    p.add_argument("--bandwidth", action="append", default=[], metavar="TIER=BYTES_PER_S",
                   help="read bandwidth of a tier, e.g. --bandwidth ssd=2GiB (per second); overrides --bench-json")
    p.add_argument("--prefill-tokens-per-s", type=float, help="the engine's prefill throughput, to price recompute")
    p.add_argument("--no-decline", action="store_true",
                   help="read every hit, even from a tier slower than the prefill (the connector's decline_slow_hits "
                        "false)")
    p.add_argument("--decline-margin-ms", type=float, default=50.0, metavar="MS",
                   help="decline a tier's part of a hit only where reading it loses more than MS milliseconds against "
                        "computing it (the connector's decline_margin_ms; default 50)")
    p.add_argument("--json", action="store_true", help="print the results as one JSON document on stdout, nothing else")
    g = p.add_argument_group("sweep")
    g.add_argument("--sweep", metavar="TIER=LO..HI[:N]", help="vary TIER's capacity over N geometric points")
    g.add_argument("--policies", default=None, help="eviction policies to sweep, comma-separated (default: the "
                   "tier's own); names or package.module:Class")
    g.add_argument("--out", default="tierkv-sweep", help="where sweep.csv and sweep.png go (default ./tierkv-sweep)")
    g.add_argument("--metric", choices=("token_hit_rate", "chunk_hit_rate", "tier_hit_rate"), default=None,
                   help="what the plot shows (all are in the CSV); default: token_hit_rate for a one-tier config, "
                        "tier_hit_rate (the swept tier's own hits over all blocks) for a chain")
    gen = p.add_argument_group("generate")
    gen.add_argument("--generate", metavar="KIND",
                     help="write a synthetic trace: chat, system-prompt, rag, agent or mix (then TRACE is not read)")
    gen.add_argument("--requests", type=int, default=10000, help="requests to generate (default 10000)")
    gen.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    gen.add_argument("--rate", type=float, default=2.0, help="arrivals per second (default 2)")
    gen.add_argument("-o", "--output", help="where --generate writes (default: stdout)")
    p.set_defaults(func=run)


def bandwidths_from(args, cfg: Optional[dict], warnings: Optional[list[str]] = None) -> Optional[dict[str, float]]:
    """Read bandwidth per tier name, bytes/s: from --bench-json by medium, then --bandwidth overrides.

    A bandwidth no device of the tier's medium has is kept but appended to ``warnings``.
    """
    if not args.bench_json and not args.bandwidth:
        return None
    out: dict[str, float] = {}
    where: dict[str, str] = {}
    media = {(t.get("name") or str(t.get("medium"))): str(t.get("medium")) for t in (cfg or {}).get("tiers", [])
             if isinstance(t, dict)}
    if args.bench_json:
        from tierkv.tools.benchmarks import read_bandwidths

        by_medium = read_bandwidths(args.bench_json)
        for name, medium in media.items():
            bw = by_medium.get(BENCH_MEDIUM.get(medium, medium))
            if bw:
                out[name] = bw
                where[name] = f"--bench-json {args.bench_json}"
    given = parse_kv_sizes(args.bandwidth, "--bandwidth")
    unknown = sorted(set(given) - set(media)) if media else []
    if unknown:
        raise CommandError(f"--bandwidth: no tier named {unknown} in the config; tiers: {list(media)}")
    for k, v in given.items():
        out[k] = float(v)
        where[k] = "--bandwidth"
    if warnings is not None:
        for name, bw in out.items():
            medium = media.get(name, "")
            limit = PLAUSIBLE_BPS.get(medium, PLAUSIBLE_ANY_BPS)
            if bw > limit:
                warnings.append(f"tier {name!r} ({medium or 'unknown medium'}): read bandwidth {fmt_bytes(bw)}/s "
                                f"(from {where[name]}) is more than any {medium or ''} device gives (at most "
                                f"{fmt_bytes(limit)}/s); its load times are not to be trusted")
    return out


def _generate(args) -> Optional[list]:
    from tierkv.tools.sim.generate import generate
    from tierkv.tools.sim.traces import write_trace

    positive(args.requests, "--requests", integer=True)
    positive(args.rate, "--rate")
    bt = args.block_tokens or 512
    if args.output in (None, "-"):
        if args.config or args.json:
            raise CommandError(f"--generate with {'--config' if args.config else '--json'} needs -o FILE "
                               "(stdout would mix the trace and the report)")
    elif os.path.isdir(args.output):
        raise CommandError(f"-o {args.output}: is a directory; give a file name")
    reqs = list(generate(args.generate, args.requests, bt, seed=args.seed, rate=args.rate))
    header = {"version": 1, "block_tokens": bt, "generated": args.generate, "seed": args.seed}
    if args.output in (None, "-"):
        import json

        for r in reqs:
            sys.stdout.write(json.dumps(r.to_mooncake(), separators=(",", ":")) + "\n")
        return None
    write_trace(reqs, args.output, header=header)
    blocks = sum(len(r.hash_ids) for r in reqs)
    if args.json and not args.config:
        dump_json({"generated": args.generate, "requests": len(reqs), "blocks": blocks, "block_tokens": bt,
                   "seed": args.seed, "output": args.output})
    else:
        print(f"wrote {len(reqs)} {args.generate} requests ({blocks} blocks of {bt} tokens) to {args.output}",
              file=sys.stderr if args.json else sys.stdout)
    return reqs


def run(args) -> int:
    from tierkv.tools.sim.replay import tune_allocator
    from tierkv.tools.sim.traces import read_trace

    tune_allocator()
    positive(args.block_tokens, "--block-tokens", integer=True)
    positive(args.bytes_per_token, "--bytes-per-token", integer=True)
    positive(args.prefill_tokens_per_s, "--prefill-tokens-per-s")
    if not (math.isfinite(args.decline_margin_ms) and args.decline_margin_ms >= 0):
        raise CommandError(f"--decline-margin-ms must be 0 or more milliseconds, got {args.decline_margin_ms!r}")
    positive(args.limit, "--limit", integer=True)
    if args.generate:
        if args.trace:
            raise CommandError(f"--generate writes a trace; it reads none (got TRACE {args.trace!r})")
        reqs = _generate(args)
        if reqs is None or not args.config:
            return EXIT_OK
    else:
        if not args.trace:
            raise CommandError("give a TRACE to replay, or --generate KIND to write one")
        reqs = None
    cfg = load_store_config(args.config)
    if reqs is None:
        t0 = time.perf_counter()
        reqs = []
        with progress(None, "reading the trace", "requests", command="simulate") as bar:
            for r in read_trace(args.trace, args.format, args.block_tokens, args.limit):
                reqs.append(r)
                if len(reqs) % 10000 == 0:
                    bar.update(10000)
        read_s = time.perf_counter() - t0
    else:
        read_s = 0.0
    if not reqs:
        raise CommandError(f"trace {args.trace!r} holds no requests", code=1)
    warnings: list[str] = []
    bpt, bpt_source = _bytes_per_token(args, reqs, warnings)
    bws = bandwidths_from(args, cfg, warnings)
    for w in warnings:
        note("simulate", f"warning: {w}")
    capacities = parse_kv_sizes(args.capacity, "--capacity")
    evictions = {}
    for it in args.eviction:
        name, sep, pol = it.partition("=")
        if not sep:
            raise CommandError(f"--eviction {it!r}: expected TIER=POLICY")
        evictions[name] = pol
    if args.sweep:
        return _run_sweep(args, reqs, cfg, bpt, bws, capacities, evictions, warnings)
    from tierkv.tools.sim.replay import simulate

    with progress(len(reqs), "replay", "requests", command="simulate") as bar:
        res = simulate(reqs, cfg, bytes_per_token=bpt, bandwidths=bws,
                       prefill_tokens_per_s=args.prefill_tokens_per_s, capacities=capacities, evictions=evictions,
                       progress=bar.update, decline=not args.no_decline,
                       decline_margin_s=args.decline_margin_ms / 1000.0)
    out = res.as_dict()
    if bws is not None:
        unpriced = [n for n, t in out["tiers"].items() if t["hits"] and not bws.get(n)]
        if unpriced:
            warnings.append(f"no read bandwidth for tier(s) {unpriced}, which served hits: the load time is not "
                            "computed (give --bandwidth TIER=SIZE)")
            note("simulate", f"warning: {warnings[-1]}")
    out["trace"] = args.trace or args.output
    out["read_s"] = read_s
    out["bytes_per_token"] = bpt
    out["bytes_per_token_from"] = bpt_source
    out["warnings"] = warnings
    if args.json:
        dump_json(out)
        return EXIT_OK
    _print_result(out)
    return EXIT_OK


def _bytes_per_token(args, reqs: list, warnings: list[str]) -> tuple[Optional[int], str]:
    """The KV bytes per token to price blocks at, and where it came from: ``option``, ``trace`` or ``assumed``.

    None with ``trace``: every request carries its own ``block_bytes``.  With --bytes-per-token the
    trace's sizes are overridden; a trace without sizes gets the default model, said in ``warnings``.
    """
    from tierkv.tools.sim import DEFAULT_BYTES_PER_TOKEN

    if args.bytes_per_token:
        for r in reqs:
            r.block_bytes = None
        return args.bytes_per_token, "option"
    unsized = [r for r in reqs if r.block_bytes is None]
    if not unsized:
        return None, "trace"
    sized = collections.Counter((r.block_tokens, r.block_bytes) for r in reqs if r.block_bytes is not None)
    if sized:  # a capture's first requests may precede the first put that taught the writer the size
        common: dict[int, int] = {}
        for (bt, bb), _n in sized.most_common():
            common.setdefault(bt, bb)
        some = sized.most_common(1)[0][0]
        for r in unsized:
            r.block_bytes = common.get(r.block_tokens) or some[1] * r.block_tokens // some[0]
        return None, "trace"
    unsized_n = len(unsized)
    warnings.append(f"{unsized_n} of {len(reqs)} requests carry no chunk size: assuming {DEFAULT_BYTES_PER_TOKEN} "
                    "KV bytes per token (a Llama-3-8B in fp16); give --bytes-per-token for your model")
    return DEFAULT_BYTES_PER_TOKEN, "assumed"


def _print_result(out: dict[str, Any]) -> None:
    block = fmt_bytes(out["block_bytes"]) + (" (assumed: a Llama-3-8B)" if out["bytes_per_token_from"] == "assumed"
                                             else "")
    print(f"trace: {out['trace']}  requests: {out['requests']}  blocks: {out['blocks']}  block: {block}")
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
    if out.get("declined_hits"):
        print("declined (tier slower than the prefill): " + ", ".join(
            f"{t} {n} hits ({out['declined_tokens'].get(t, 0)} tokens)" for t, n in sorted(out["declined_hits"].items())))
    rps = out.get("requests_per_s")
    print(f"replayed in {out['wall_s']:.2f} s ({fmt_num(rps, 0)} requests/s; {out['cpu_s']:.2f} s of CPU)")


def _run_sweep(args, reqs, cfg, bpt, bws, capacities, evictions, warnings) -> int:
    from tierkv.tools.sim.sweep import parse_sweep, plot, sweep, write_csv

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
    metric = args.metric or ("token_hit_rate" if len(names) == 1 else "tier_hit_rate")
    try:
        os.makedirs(args.out, exist_ok=True)
    except OSError as e:
        raise CommandError(f"--out {args.out}: cannot create: {e.strerror or e}") from None
    runs = len(caps) * len(policies)
    note("simulate", f"sweep: {runs} replays of {len(reqs)} requests ({len(policies)} policies x {len(caps)} {tier} "
                  f"capacities); progress below")
    with progress(runs * len(reqs), f"sweep of {tier}", "requests replayed", command="simulate") as bar:
        rows = sweep(reqs, cfg, tier, caps, policies, progress=bar.update, bytes_per_token=bpt, bandwidths=bws,
                     prefill_tokens_per_s=args.prefill_tokens_per_s, other_capacities=capacities,
                     other_evictions=evictions, decline=not args.no_decline,
                     decline_margin_s=args.decline_margin_ms / 1000.0)
    csv_path = os.path.join(args.out, "sweep.csv")
    png_path = os.path.join(args.out, "sweep.png")
    try:
        write_csv(rows, csv_path)
        label = f"{tier} hit rate" if metric == "tier_hit_rate" else metric.replace("_", " ")
        plot(rows, png_path, title=f"{label} vs {tier} capacity ({os.path.basename(str(args.trace or args.output))})",
             metric=metric)
    except OSError as e:
        raise CommandError(f"--out {args.out}: cannot write: {e.strerror or e}") from None
    values = [r[metric] for r in rows]
    if len(rows) > 1 and max(values) - min(values) < 1e-9:
        other = "tier_hit_rate" if metric != "tier_hit_rate" else "token_hit_rate"
        warnings.append(f"{metric} is {values[0]:.4f} at every point of the sweep: the plot is flat lines "
                        f"(--metric {other} may show what varies)")
        note("simulate", f"warning: {warnings[-1]}")
    if args.json:
        dump_json({"tier": tier, "metric": metric, "rows": rows, "csv": csv_path, "png": png_path,
                   "bytes_per_token": bpt, "warnings": warnings})
        return EXIT_OK
    table([[r["policy"], fmt_bytes(r["capacity_bytes"]), f"{r['tier_hit_rate']:.4f}", f"{r['token_hit_rate']:.4f}",
            f"{r['chunk_hit_rate']:.4f}", r["evictions"]] for r in rows],
          ["policy", f"{tier} capacity", f"{tier} hit", "token hit", "chunk hit", "evictions"])
    print(f"wrote {csv_path} and {png_path} (plotted: {metric})")
    return EXIT_OK
