"""``tierkv inspect``: what an SSD tier's directory holds (or a Mooncake pool's view with --master)."""

from __future__ import annotations

import argparse
import os

from ._common import EXIT_FAIL, EXIT_OK, CommandError, dump_json, fmt_bytes, note, progress, table

HELP = "objects, bytes and corrupt objects of an SSD tier's directory (or a Mooncake pool with --master)"
DESCRIPTION = """\
Describe an SSD tier's directory: objects, bytes, space per region, corrupt objects
(each named by its key, or a region file by its name, with the reason).  A directory
that holds no tier's data (empty, or a mistyped path) is refused, exit 2, before
anything is read or written.

Plain: reads the region headers, summaries, checkpoint and dead log, never a sealed
region's records; it takes no lock and writes nothing, so it may run beside a live
writer (then nothing is judged corrupt: the directory changes as it is read).
--verify: also reads every object's record and checks its header, key, length and
payload sum, holding a shared lock on DIR/LOCK (a directory in use by a writer is
refused, exit 2, naming its pid).  A large object (pieces and a manifest) is judged
whole and named by the key it was stored under.  --repair: under the writer lock,
verifies and removes exactly the corrupt objects (a large object with all its pieces;
nothing else: no capacity applies), lists them and reports the directory afterwards.
Exit 1 while corruption remains (after --repair: when some remains).

With --master HOST:PORT (and no PATH): a Mooncake pool's view, as far as the
Mooncake client API allows: it has no listing call, so the master's HTTP endpoint
(its --metrics_port) is asked: tierkv's objects (under --namespace) and their bytes."""


def add_parser(sub) -> None:
    p = sub.add_parser("inspect", help=HELP, description=DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", nargs="?", metavar="PATH", help="the SSD tier's directory (its 'path' option)")
    p.add_argument("--verify", action="store_true", help="read every object and check its checksum")
    p.add_argument("--repair", action="store_true", help="remove corrupt objects (implies --verify; takes the writer lock)")
    p.add_argument("--json", action="store_true",
                   help="the report as one JSON document on stdout, nothing else (notes go to stderr)")
    p.add_argument("--master", metavar="HOST:PORT", help="inspect a Mooncake pool instead of a directory")
    p.add_argument("--metrics-port", type=int, default=9003,
                   help="the master's HTTP metrics port, which lists keys (default 9003)")
    p.add_argument("--namespace", default="tierkv", help="tierkv's key namespace in the pool (default tierkv)")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.master:
        if args.path:
            raise CommandError("give either PATH or --master, not both")
        if args.verify or args.repair:
            raise CommandError("--verify and --repair apply to an SSD tier's directory (PATH), not --master")
        from tierkv.tools.inspect import inspect_pool

        info = inspect_pool(args.master, args.metrics_port, args.namespace)
        if args.json:
            dump_json(info)
            return EXIT_OK
        _print_pool(info)
        return EXIT_OK
    if not args.path:
        raise CommandError("give the SSD tier's directory (PATH), or --master HOST:PORT")
    if not os.path.isdir(args.path):
        raise CommandError(f"{args.path}: not a directory" if os.path.exists(args.path)
                           else f"{args.path}: not a directory (no such path)")
    from tierkv.tools.inspect import inspect_dir

    bar = None

    def verifying(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            bar = progress(total, "verifying", "objects", command="inspect")
        bar.update(done - bar.done)

    try:
        info = inspect_dir(args.path, verify=args.verify or args.repair, repair=args.repair, progress=verifying)
    except OSError as e:
        raise CommandError(f"{e.filename or args.path}: {e.strerror or e}", code=EXIT_FAIL) from None
    finally:
        if bar is not None:
            bar.close()
    if args.json:
        dump_json(info)
    else:
        _print_dir(info, args)
    _notes(info, args)
    return EXIT_FAIL if info["corrupt"] else EXIT_OK


def _print_dir(info: dict, args) -> None:
    print(f"{info['path']}  layout: {info['layout']}  objects: {info['objects']}  bytes: {fmt_bytes(info['bytes'])}"
          f"  ({info['bytes']} B)")
    regions = info.get("regions") or []
    if regions:
        table([[r.get("name", r["index"]), r["objects"], fmt_bytes(r["live_bytes"]), fmt_bytes(r["size_bytes"])]
               for r in regions], ["region", "objects", "live", "on disk"])
    ck = info.get("checkpoint")
    if isinstance(ck, dict):
        if not ck.get("present"):
            print("checkpoint: none (the regions' summaries are read)")
        elif ck.get("valid"):
            print(f"checkpoint: valid, lists {ck['objects']} objects, covers regions of seq below {ck['covered_seq']}")
        else:
            print("checkpoint: fails its check, ignored (the regions' summaries are read)")
    for s in info.get("skipped_files") or []:
        print(f"skipped: {s['file']}: {s['reason']}" if isinstance(s, dict) else f"skipped: {s}")
    if info.get("torn_regions"):
        print(f"torn regions: {info['torn_regions']} (records end at a bad record before the region's end)")
    print(f"checked: {'; '.join(info.get('checked') or [])}")
    if not info.get("verified"):
        print("not checked: the objects' records (--verify reads every one)")
    if info.get("unverified"):
        print(f"unverified: {info['unverified']} objects (their payload sum cannot be computed here)")
    if args.repair:
        print(f"repaired: {info['repaired']} removed")
        for c in info.get("removed") or []:
            print(f"  removed {c.get('key') or c.get('file')}: {c.get('reason')}")
    if info.get("live_writer") is not None:
        print("corrupt: not judged (a live writer; stop it, then --verify)")
        return
    print(f"corrupt: {len(info['corrupt'])}" + ("  (remaining after the repair)" if args.repair else ""))
    for c in info["corrupt"][:20]:
        extra = f" ({c['objects_lost']} objects listed there lost)" if c.get("objects_lost") else ""
        print(f"  {c.get('key') or c.get('file')}: {c.get('reason')}{extra}")
    if len(info["corrupt"]) > 20:
        print(f"  ... and {len(info['corrupt']) - 20} more (--json lists all)")


def _notes(info: dict, args) -> None:
    """What the operator should know beside the report: stderr, with or without --json."""
    if info.get("live_writer") is not None:
        pid = info["live_writer"]
        note("inspect", f"{info['path']} is in use by {f'process {pid}' if pid else 'another process'}: read "
                        "without a lock while it changes, nothing judged (--verify and --repair refuse it)")
    if info["corrupt"] and args.json:  # (the table says it on stdout)
        note("inspect", f"corrupt: {len(info['corrupt'])}" + (" remain after the repair" if args.repair else ""))
    if not args.repair and any("key" in c for c in info["corrupt"]):
        note("inspect", "run with --repair to remove the corrupt objects")
    if any(c.get("reason") == "bad region header" for c in info["corrupt"]):
        note("inspect", "a region file that fails its header check is left in place (the tier skips it and never "
                        "reuses it): move it away by hand to reclaim its space")


def _print_pool(info: dict) -> None:
    print(f"mooncake master {info['master']}  namespace {info['namespace']!r}")
    print(f"objects: {info['objects']}  bytes: {fmt_bytes(info['bytes'])}")
    if info.get("by_tag"):
        table([[tag, d["objects"], fmt_bytes(d["bytes"])] for tag, d in info["by_tag"].items()],
              ["medium", "objects", "bytes"])
    for line in info.get("notes", []):
        print(f"note: {line}")
