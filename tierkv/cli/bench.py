"""``tierkv bench``: benchmark suites, each medium against memcpy and raw file I/O (``tierkv.benchmarks``)."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile

from ._common import EXIT_FAIL, EXIT_OK, CommandError, dump_json, progress, table

HELP = "benchmark each medium against memcpy, raw file I/O (and raw Mooncake with --master)"
DESCRIPTION = """\
Run the benchmark suites; every throughput is shown with its baseline, measured
back to back in the same run, and the ratio tierkv / baseline (median of the
per-round ratios).  Suites: dram and hbm (on cpu) vs a torch copy, ssd vs raw
writev/preadv in the same directory, dram_pool vs raw Mooncake calls (needs
--master), lookup of a 512-chunk prefix, chunk_keys throughput.
Exit 1 when a benchmark read back bytes that differ from those written."""

EPILOG = """\
examples:
  tierkv bench --quick --json bench.json
  tierkv bench --compare bench.json            # the change against an earlier run
  tierkv bench --suite dram_pool --master 10.0.0.5:50051 --metadata-server http://10.0.0.5:8080/metadata
"""


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help=HELP, description=DESCRIPTION, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", default=None,
                   help="comma-separated: dram,hbm,ssd,dram_pool,lookup,keys (default: all; dram_pool with --master)")
    p.add_argument("--quick", action="store_true", help="3 rounds instead of 7, 100K keys for lookup")
    p.add_argument("--rounds", type=int, help="rounds per benchmark (default 7, --quick 3)")
    p.add_argument("--sizes", default="2,32", help="chunk sizes in MiB, comma-separated (default 2,32)")
    p.add_argument("--batch", type=int, default=32, help="chunks per batch (default 32)")
    p.add_argument("--dir", help="directory for the ssd suite (default: a temporary one)")
    p.add_argument("--master", metavar="HOST:PORT", help="a Mooncake master: adds the dram_pool suite")
    p.add_argument("--metadata-server", help="Mooncake metadata server URL (default http://HOST:8080/metadata)")
    p.add_argument("--json", metavar="FILE", help="write the results here ('-' for stdout)")
    p.add_argument("--compare", metavar="OLD.json", help="show the change of each figure against an earlier --json")
    p.set_defaults(func=run)


def _load_old(path: str) -> dict:
    try:
        with open(path) as f:
            old = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CommandError(f"--compare {path}: cannot read: {e}") from e
    if not isinstance(old, dict) or "rows" not in old:
        raise CommandError(f"--compare {path}: not a 'tierkv bench --json' file")
    return {r["bench"]: r for r in old["rows"]}


def run(args) -> int:
    from tierkv.benchmarks import SUITES, bandwidths, rows, run_suites

    if args.suite:
        suites = [s.strip() for s in args.suite.split(",") if s.strip()]
        bad = [s for s in suites if s not in SUITES]
        if bad:
            raise CommandError(f"--suite: unknown suite(s) {bad}; known: {', '.join(SUITES)}")
    else:
        suites = [s for s in SUITES if s != "dram_pool" or args.master]
    try:
        sizes = [float(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError:
        raise CommandError(f"--sizes {args.sizes!r}: expected MiB numbers, e.g. 2,32") from None
    if not sizes or any(s <= 0 for s in sizes) or args.batch < 1:
        raise CommandError("--sizes and --batch must be positive")
    old = _load_old(args.compare) if args.compare else None
    rounds = args.rounds or (3 if args.quick else 7)
    if rounds < 1:
        raise CommandError("--rounds must be positive")
    metadata = args.metadata_server
    if args.master and not metadata:
        metadata = f"http://{args.master.rsplit(':', 1)[0]}:8080/metadata"
    root = tempfile.mkdtemp(prefix="tierkv-bench-", dir=args.dir)
    n_bench = sum(len(sizes) for s in suites if s in ("dram", "hbm", "ssd", "dram_pool")) + \
        sum(1 for s in suites if s in ("lookup", "keys"))
    try:
        with progress(n_bench, "bench", "bench") as bar:
            results = run_suites(suites, sizes, rounds, root, batch=args.batch,
                                 lookup_keys=100_000 if args.quick else 1_000_000, master=args.master,
                                 metadata=metadata, progress=bar.update)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    flat = rows(results)
    doc = {"version": 1, "rounds": rounds, "suites": suites, "results": results, "rows": flat,
           "bandwidth_Bps": bandwidths(results)}
    if args.json:
        dump_json(doc, args.json)
    if args.json != "-":
        _print(flat, old)
    bad = [m for m in ("dram", "hbm", "ssd", "dram_pool") for r in results.get(m, []) if not r.get("exact", True)]
    if bad:
        print(f"tierkv bench: bytes read back differ from those written in {sorted(set(bad))}", file=sys.stderr)
        return EXIT_FAIL
    return EXIT_OK


def _print(flat: list[dict], old) -> None:
    header = ["bench", "tierkv", "baseline", "ratio", "against"]
    if old is not None:
        header += ["old", "change"]
    out = []
    for r in flat:
        unit = r["unit"]
        line = [r["bench"], f"{r['value']:.2f} {unit}", "-" if r["baseline"] is None else f"{r['baseline']:.2f} {unit}",
                "-" if r["ratio"] is None else f"{r['ratio']:.2f}", r["against"]]
        if old is not None:
            o = old.get(r["bench"])
            key = "ratio" if r["ratio"] is not None else "value"
            if o is None or o.get(key) in (None, 0):
                line += ["-", "new"]
            else:
                line += [f"{o[key]:.2f}", f"{(r[key] - o[key]) / o[key] * 100:+.1f}%"]
        out.append(line)
    table(out, header)
    if old is not None:
        print("change: of the ratio where there is one (else of the figure); for lookup µs lower is better")
