"""``tierkv bench``: benchmark suites, each medium against memcpy and raw file I/O (``tierkv.tools.benchmarks``)."""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import tempfile
from typing import Any, Optional

from ._common import EXIT_FAIL, EXIT_OK, CommandError, dump_json, load_store_config, note, progress, table

HELP = "benchmark each medium against memcpy, raw file I/O (and raw Mooncake with --master)"
DESCRIPTION = """\
Run the benchmark suites; every throughput is shown with its baseline, measured
back to back in the same run, and the ratio tierkv / baseline of those two
figures (each the median of the rounds).  Suites: dram and hbm (on cpu) vs a
torch copy, ssd vs raw writev/preadv in the same directory and I/O mode (the
tier's default: O_DIRECT where the filesystem takes it), dram_pool vs raw
Mooncake calls (needs --master), config (each tier of --config FILE on its own,
custom media included), lookup of a 512-chunk prefix, chunk_keys throughput.

Every answer of the store is checked: a chunk a put did not store, a get did not
find, or read back with other bytes (the destinations are overwritten before each
timed get) fails that benchmark: it gets no figure, and the run exits 1.

--json prints one JSON document to stdout and nothing else (save it with
'> bench.json'); the table, notes and progress go elsewhere (stderr or nowhere)."""

EPILOG = """\
examples:
  tierkv bench --quick --json > bench.json
  tierkv bench --compare bench.json            # the change against an earlier run, weighed against its spread
  tierkv bench --suite ssd --dir /mnt/nvme0    # the ssd suite on that device (default: a temporary directory)
  tierkv bench --config store.yaml             # each configured tier alone (paths replaced by fresh directories)
  tierkv bench --suite dram_pool --master 10.0.0.5:50051 --metadata-server http://10.0.0.5:8080/metadata
"""


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help=HELP, description=DESCRIPTION, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", default=None,
                   help="comma-separated: dram,hbm,ssd,dram_pool,config,lookup,keys (default: all but dram_pool "
                        "and config; dram_pool with --master; only config with --config, which always adds it)")
    p.add_argument("--quick", action="store_true", help="3 rounds instead of 7, 100K keys for lookup")
    p.add_argument("--rounds", type=int, help="rounds per benchmark (default 7, --quick 3)")
    p.add_argument("--sizes", default="2,32", help="chunk sizes in MiB, comma-separated (default 2,32)")
    p.add_argument("--batch", type=int, default=32, help="chunks per batch (default 32)")
    p.add_argument("--dir", help="an existing directory for the ssd suite and path-bearing tiers of --config "
                                 "(default: the system's temporary directory); a fresh directory is made in it "
                                 "and removed afterwards")
    p.add_argument("--config", help="a store config: the config suite benches each of its tiers alone "
                                    "(nothing under the configured paths is touched)")
    p.add_argument("--master", metavar="HOST:PORT", help="a Mooncake master: adds the dram_pool suite")
    p.add_argument("--metadata-server", help="Mooncake metadata server URL (default http://HOST:8080/metadata)")
    p.add_argument("--json", action="store_true", help="print the results as one JSON document on stdout, nothing else")
    p.add_argument("--compare", metavar="OLD.json", help="show the change of each figure against an earlier --json")
    p.set_defaults(func=run)


def _number(v: Any) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)


def load_old(path: str) -> dict[str, dict]:
    """The rows of an earlier ``tierkv bench --json`` document, by bench name; anything malformed is an error."""
    from tierkv.tools.benchmarks import read_bench_json

    old = read_bench_json(path, "--compare", "rows", list, "no list of rows", CommandError)
    out = {}
    for i, r in enumerate(old["rows"]):
        if not isinstance(r, dict) or not isinstance(r.get("bench"), str):
            raise CommandError(f"--compare {path}: row {i} is not a bench row (no 'bench' name): {str(r)[:80]}")
        v = r.get("value")
        if v is not None and not _number(v):
            raise CommandError(f"--compare {path}: row {i} ({r['bench']}): value {v!r} is not a number")
        rounds = r.get("value_rounds", [])
        if not isinstance(rounds, list) or not all(_number(x) for x in rounds):
            raise CommandError(f"--compare {path}: row {i} ({r['bench']}): value_rounds is not a list of numbers")
        out[r["bench"]] = r
    return out


def _suites(args, known: tuple) -> list[str]:
    if args.suite:
        suites = [s.strip() for s in args.suite.split(",") if s.strip()]
        bad = [s for s in suites if s not in known]
        if bad or not suites:
            raise CommandError(f"--suite: unknown suite(s) {bad}; known: {', '.join(known)}")
        if "config" in suites and not args.config:
            raise CommandError("--suite config needs --config FILE")
        if args.config and "config" not in suites:  # the tiers given are benched, whatever else is asked
            suites.append("config")
        return suites
    if args.config:
        return ["config"]
    return [s for s in known if s not in ("dram_pool", "config") or (s == "dram_pool" and args.master)]


def _sizes(text: str) -> list[float]:
    try:
        sizes = [float(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise CommandError(f"--sizes {text!r}: expected MiB numbers, e.g. 2,32") from None
    if not sizes or any(not math.isfinite(s) or s <= 0 for s in sizes):
        raise CommandError(f"--sizes {text!r}: every size must be a finite number of MiB above 0")
    if any(s * 2**20 < 1 for s in sizes):
        raise CommandError(f"--sizes {text!r}: a chunk is at least one byte")
    return sizes


def run(args) -> int:
    from tierkv.tools.benchmarks import MEDIA, MEMORY_FS, SUITES, bandwidths, failures, rows, run_suites

    suites = _suites(args, SUITES)
    sizes = _sizes(args.sizes)
    if args.batch < 1:
        raise CommandError(f"--batch must be a positive integer, got {args.batch}")
    if args.rounds is not None and args.rounds < 1:
        raise CommandError(f"--rounds must be a positive integer, got {args.rounds}")
    rounds = args.rounds if args.rounds is not None else (3 if args.quick else 7)
    if args.dir is not None and not os.path.isdir(args.dir):
        raise CommandError(f"--dir {args.dir}: " + ("not a directory" if os.path.exists(args.dir)
                                                    else "no such directory"))
    old = load_old(args.compare) if args.compare else None
    config = load_store_config(args.config) if args.config else None
    if "dram_pool" in suites and not args.master:
        raise CommandError("the dram_pool suite needs --master HOST:PORT")
    metadata = args.metadata_server
    if args.master and not metadata:
        metadata = f"http://{args.master.rsplit(':', 1)[0]}:8080/metadata"
    try:
        root = tempfile.mkdtemp(prefix="tierkv-bench-", dir=args.dir)
    except OSError as e:
        raise CommandError(f"--dir {args.dir or tempfile.gettempdir()}: cannot make a directory in it: "
                           f"{e.strerror or e}") from None
    n_bench = sum(len(sizes) for s in suites if s in MEDIA) + sum(1 for s in suites if s in ("lookup", "keys"))
    try:
        with progress(n_bench, "bench", "benchmarks", command="bench") as bar:
            results = run_suites(suites, sizes, rounds, root, batch=args.batch,
                                 lookup_keys=100_000 if args.quick else 1_000_000, master=args.master,
                                 metadata=metadata, progress=bar.update, config=config)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    flat = rows(results)
    failed = failures(results)
    where = {}
    for r in flat:
        if r.get("dir"):
            where[r["bench"].split(" ")[0]] = {"dir": r["dir"], "fs": r["fs"], "io_mode": r["io_mode"]}
    doc = {"version": 2, "ok": not failed, "rounds": rounds, "suites": suites, "sizes_MiB": sizes,
           "batch": args.batch, "where": where, "rows": flat, "failures": failed,
           "bandwidth_Bps": bandwidths(results)}
    for name, w in where.items():
        if w["fs"] in MEMORY_FS:
            note("bench", f"warning: {name} was measured on {w['fs']} ({w['dir']}): memory, not a disk; "
                          "give --dir on the device to measure")
    if args.json:
        dump_json(doc)
    else:
        _print(flat, old)
        for name, w in where.items():
            print(f"{name}: measured in {w['dir']} ({w['fs']}, {w['io_mode']}; removed afterwards)")
    if failed:
        for f in failed:
            note("bench", f"FAILED {f}")
        note("bench", f"{len(failed)} failure(s): the figures of those benchmarks are not reported")
        return EXIT_FAIL
    return EXIT_OK


def compare(new: dict, old: Optional[dict]) -> tuple[str, str, str]:
    """(old figure, change, verdict) of one row: the verdict weighs the change against both runs' spread.

    A change counts only when each median lies outside the other run's range of rounds; with fewer
    than two rounds on either side there is no spread to weigh it against, and the verdict says so.
    """
    if old is None or old.get("value") in (None, 0) or new.get("value") is None:
        return "-", "-", "new" if old is None else "-"
    nv, ov = new["value"], old["value"]
    change = f"{(nv - ov) / ov * 100:+.1f}%"
    nr, orr = new.get("value_rounds") or [], old.get("value_rounds") or []
    if len(nr) < 2 or len(orr) < 2:
        return f"{ov:.2f}", change, "no spread (1 round)"
    if min(orr) <= nv <= max(orr) or min(nr) <= ov <= max(nr):
        return f"{ov:.2f}", change, "within spread"
    lower_better = new.get("unit") == "us"
    better = (nv < ov) if lower_better else (nv > ov)
    return f"{ov:.2f}", change, "better" if better else "worse"


def _print(flat: list[dict], old) -> None:
    header = ["bench", "tierkv", "baseline", "ratio", "against"]
    if old is not None:
        header += ["old", "change", "verdict"]
    out = []
    for r in flat:
        unit = r["unit"]
        if r.get("failures"):
            line = [r["bench"], "FAILED", "-", "-", r["against"]]
        else:
            line = [r["bench"], f"{r['value']:.2f} {unit}",
                    "-" if r["baseline"] is None else f"{r['baseline']:.2f} {unit}",
                    "-" if r["ratio"] is None else f"{r['ratio']:.2f}", r["against"]]
        if old is not None:
            line += list(compare(r, old.get(r["bench"])))
        out.append(line)
    table(out, header)
    print("ratio: tierkv / baseline, of the two figures beside it (each the median of the rounds)")
    if old is not None:
        print("change: of the tierkv figure (for lookup µs lower is better); verdict: within spread unless each "
              "run's median lies outside the other's range of rounds")
    sys.stdout.flush()
