"""``tierkv trace``: captured request traces — show them, convert them."""

from __future__ import annotations

import argparse
import itertools
import json
import sys

from ._common import EXIT_OK, CommandError, dump_json, fmt_num, positive, table

HELP = "captured request traces: show, convert (capture with a store's trace_path or the connector's)"
DESCRIPTION = """\
Request traces are captured from live traffic, hash-only (no token ids leave the
process), in Mooncake's JSONL format plus a block_tokens field, in rotating files:

  store config:   "trace_path": "/var/log/tierkv/trace.jsonl",
                  "trace": {"max_bytes": "64MiB", "max_files": 8, "block_tokens": 256}
  vLLM connector: kv_connector_extra_config {"trace_path": ..., "trace_max_bytes": ...,
                  "trace_max_files": ...}

The live file is PATH; when it passes max_bytes it becomes PATH.1 (PATH.1 becomes
PATH.2, ...), and at most max_files files are kept.  Give the directory (or PATH
itself, or a glob) to read them all in order."""


def add_parser(sub) -> None:
    p = sub.add_parser("trace", help=HELP, description=DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    tsub = p.add_subparsers(dest="trace_command", metavar="SUBCOMMAND")
    show = tsub.add_parser("show", help="summary of a trace (requests, blocks, reuse) and its first records",
                           description="Summarise a trace: requests, blocks, distinct blocks, reuse, tokens, "
                                       "duration, sessions; then its first records.")
    show.add_argument("trace", metavar="TRACE", help="trace file, directory of rotated files, or glob")
    show.add_argument("--format", choices=("mooncake", "bailian", "tierkv"), help="trace format (default: detect)")
    show.add_argument("--head", type=int, default=5, help="records to print (default 5)")
    show.add_argument("--json", action="store_true", help="the summary as one JSON document on stdout, nothing else")
    show.add_argument("--request", metavar="ID",
                      help="why request ID recomputed what it did: the tokens the store did not serve at its "
                           "lookup, by reason (a vLLM connector capture records them)")
    show.set_defaults(func=run_show)
    conv = tsub.add_parser("convert", help="rewrite a trace (any format, rotated files) as one file",
                           description="Read a trace in any known format (rotated captures included) and write it "
                                       "as one file in tierkv's format (Mooncake's JSONL plus block_tokens) or "
                                       "in Mooncake's own (timestamp ms, input_length, output_length, hash_ids).")
    conv.add_argument("trace", metavar="TRACE")
    conv.add_argument("-o", "--output", required=True, help="output file (.gz to compress)")
    conv.add_argument("--format", choices=("mooncake", "bailian", "tierkv"), help="input format (default: detect)")
    conv.add_argument("--to", choices=("tierkv", "mooncake"), default="tierkv", help="output format (default tierkv)")
    conv.add_argument("--limit", type=int, help="only the first N requests")
    conv.add_argument("--rebase", action="store_true", help="shift timestamps so the first request is at 0")
    conv.set_defaults(func=run_convert)
    p.set_defaults(func=lambda args: _no_sub(p))


def _no_sub(p) -> int:
    p.print_help(sys.stderr)
    raise CommandError("give a subcommand: show or convert")


def run_show(args) -> int:
    from tierkv.tools.sim.traces import read_trace, summarize

    if args.head < 0:
        raise CommandError("--head must be 0 or more")
    reqs = list(read_trace(args.trace, args.format))
    if args.request is not None:
        return _show_request(args, reqs)
    s = summarize(reqs)
    if args.json:
        dump_json({"trace": args.trace, **s, "head": [r.to_mooncake() for r in reqs[:args.head]]})
        return EXIT_OK
    table([[k, _cell(v)] for k, v in s.items()], ["trace", args.trace])
    for r in reqs[:args.head]:
        ids = r.hash_ids if len(r.hash_ids) <= 8 else [*r.hash_ids[:8], "..."]
        print(f"  t={r.timestamp:.3f}s in={r.input_length} out={r.output_length} blocks={len(r.hash_ids)} "
              f"hash_ids={ids}" + (f" session={r.session}" if r.session else "")
              + (f" id={r.extra['request_id']}" if "request_id" in r.extra else "")
              + (f" missed={_cell(r.miss_reasons)}" if r.miss_reasons else ""))
    return EXIT_OK


def _cell(v) -> str:
    if isinstance(v, list):
        return ",".join(map(str, v))
    if isinstance(v, dict):
        return ", ".join(f"{k} {n}" for k, n in v.items()) or "-"
    return fmt_num(v, 3)


def _show_request(args, reqs) -> int:
    """``trace show --request ID``: the request's lookups, each with the tokens not served and why."""
    mine = [r for r in reqs if r.extra.get("request_id") == args.request]
    if not mine:
        said = any("request_id" in r.extra for r in reqs)
        raise CommandError(f"trace {args.trace!r} has no request {args.request!r}"
                           + ("" if said else " (it records no request ids: capture it with the vLLM "
                                              "connector's trace_path)"), code=1)
    docs = []
    for r in mine:
        reasons = r.miss_reasons
        docs.append({"request_id": args.request, "timestamp_s": r.timestamp, "input_tokens": r.input_length,
                     "miss_tokens": r.extra.get("miss_tokens"), "miss_reasons": reasons})
        if args.json:
            continue
        if reasons is None:
            print(f"request {args.request} (t={r.timestamp:.3f}s, {r.input_length} prompt tokens): the trace does "
                  "not say why blocks missed")
            continue
        n = r.extra.get("miss_tokens", sum(reasons.values()))
        print(f"request {args.request} (t={r.timestamp:.3f}s, {r.input_length} prompt tokens): "
              f"{n} tokens not served by the store")
        for reason, k in sorted(reasons.items(), key=lambda kv: -kv[1]):
            print(f"  {reason:<16} {k} tokens")
    if args.json:
        dump_json({"trace": args.trace, "requests": docs})
    return EXIT_OK


def run_convert(args) -> int:
    import os

    from tierkv.tools.sim.traces import BLOCK_TOKENS, open_output, read_trace, trace_files

    MOONCAKE_BLOCK_TOKENS = BLOCK_TOKENS["mooncake"]

    positive(args.limit, "--limit", integer=True)
    out = os.path.abspath(args.output)
    if os.path.isdir(out):
        raise CommandError(f"-o {args.output}: is a directory; give a file name")
    if os.path.exists(out) and any(os.path.exists(f) and os.path.samefile(f, out) for f in trace_files(args.trace)):
        raise CommandError(f"-o {args.output}: is the trace being read; give another file")
    reqs = read_trace(args.trace, args.format, limit=args.limit)
    first = next(reqs, None)
    if first is None:
        raise CommandError(f"trace {args.trace!r} holds no requests", code=1)
    t0 = first.timestamp if args.rebase else 0.0
    n = 0
    # written beside the output and renamed at the end: a trace that turns out bad halfway leaves no half file
    partial = f"{out}.{os.getpid()}.partial" + (".gz" if out.endswith(".gz") else "")
    try:
        with open_output(partial) as f:
            if args.to == "tierkv":
                f.write(json.dumps({"format": "tierkv-trace", "version": 1, "block_tokens": first.block_tokens})
                        + "\n")
            for r in itertools.chain([first], reqs):
                if args.to == "mooncake" and r.block_tokens != MOONCAKE_BLOCK_TOKENS:
                    raise CommandError(f"--to mooncake: request {n} has blocks of {r.block_tokens} tokens; "
                                       f"Mooncake's format has no such field (its blocks are "
                                       f"{MOONCAKE_BLOCK_TOKENS}): use --to tierkv")
                r.timestamp -= t0
                rec = r.to_mooncake()
                if args.to == "mooncake":
                    rec = {k: rec[k] for k in ("timestamp", "input_length", "output_length", "hash_ids")}
                f.write(json.dumps(rec, separators=(",", ":")) + "\n")
                n += 1
        os.replace(partial, out)
    except BaseException:
        if os.path.exists(partial):
            os.unlink(partial)
        raise
    print(f"wrote {n} requests to {args.output} ({args.to} format)")
    return EXIT_OK
