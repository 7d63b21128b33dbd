"""``tierkv inspect``: what an SSD tier's directory holds (or a Mooncake pool's view with --master)."""

from __future__ import annotations

import argparse
import os
import sys

from ._common import EXIT_FAIL, EXIT_OK, CommandError, dump_json, fmt_bytes, table

HELP = "objects, bytes and corrupt objects of an SSD tier's directory (or a Mooncake pool with --master)"
DESCRIPTION = """\
Describe an SSD tier's directory: objects, bytes, space per region (log-structured
layout) or per shard directory (one file per object), corrupt objects.  Read-only:
nothing is changed unless --repair is given (which deletes corrupt objects and
stray temporary files).  --verify reads every object and checks its checksum;
without it only headers are checked.  Exit 1 when corrupt objects were found.

With --master HOST:PORT (and no PATH): a Mooncake pool's view, as far as the
Mooncake client API allows: it has no listing call, so the master's HTTP endpoint
(its --metrics_port) is asked: tierkv's objects (under --namespace) and their bytes."""


def add_parser(sub) -> None:
    p = sub.add_parser("inspect", help=HELP, description=DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", nargs="?", metavar="PATH", help="the SSD tier's directory (its 'path' option)")
    p.add_argument("--verify", action="store_true", help="read every object and check its checksum")
    p.add_argument("--repair", action="store_true", help="delete corrupt objects and stray temporary files")
    p.add_argument("--json", nargs="?", const="-", metavar="FILE", help="JSON instead of a table (stdout: -)")
    p.add_argument("--master", metavar="HOST:PORT", help="inspect a Mooncake pool instead of a directory")
    p.add_argument("--metrics-port", type=int, default=9003,
                   help="the master's HTTP metrics port, which lists keys (default 9003)")
    p.add_argument("--namespace", default="tierkv", help="tierkv's key namespace in the pool (default tierkv)")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.master:
        if args.path:
            raise CommandError("give either PATH or --master, not both")
        from tierkv.inspect import inspect_pool

        info = inspect_pool(args.master, args.metrics_port, args.namespace)
        if args.json:
            dump_json(info, args.json)
            if args.json == "-":
                return EXIT_OK
        _print_pool(info)
        return EXIT_OK
    if not args.path:
        raise CommandError("give the SSD tier's directory (PATH), or --master HOST:PORT")
    if not os.path.isdir(args.path):
        raise CommandError(f"{args.path}: not a directory", code=EXIT_FAIL if os.path.exists(args.path) else 2)
    from tierkv.inspect import inspect_dir

    info = inspect_dir(args.path, verify=args.verify, repair=args.repair)
    if args.json:
        dump_json(info, args.json)
    if args.json != "-":
        _print_dir(info, args)
    return EXIT_FAIL if info["corrupt"] and not args.repair else EXIT_OK


def _print_dir(info: dict, args) -> None:
    print(f"{info['path']}  layout: {info['layout']}  objects: {info['objects']}  bytes: {fmt_bytes(info['bytes'])}"
          f"  ({info['bytes']} B)")
    regions = info.get("regions") or []
    if regions:
        label = "region" if info["layout"] != "files" else "shard"
        table([[r.get("name", r["index"]), r["objects"], fmt_bytes(r["live_bytes"]), fmt_bytes(r["size_bytes"])]
               for r in regions], [label, "objects", "live", "on disk"])
    if info.get("checkpoint") is not None:
        print(f"checkpoint: {info['checkpoint']}")
    checked = "checksums verified" if args.verify else "headers checked (--verify reads every checksum)"
    print(f"corrupt: {len(info['corrupt'])}  ({checked})")
    for c in info["corrupt"][:20]:
        print(f"  {c.get('file') or c.get('key')}: {c.get('reason')}")
    if len(info["corrupt"]) > 20:
        print(f"  ... and {len(info['corrupt']) - 20} more (--json lists all)")
    if info.get("temp_files"):
        print(f"stray temporary files: {info['temp_files']}")
    if args.repair:
        print(f"repaired: {info['repaired']} removed")
    elif info["corrupt"]:
        print("run with --repair to remove them", file=sys.stderr)


def _print_pool(info: dict) -> None:
    print(f"mooncake master {info['master']}  namespace {info['namespace']!r}")
    print(f"objects: {info['objects']}  bytes: {fmt_bytes(info['bytes'])}")
    if info.get("by_tag"):
        table([[tag, d["objects"], fmt_bytes(d["bytes"])] for tag, d in info["by_tag"].items()],
              ["medium", "objects", "bytes"])
    for note in info.get("notes", []):
        print(f"note: {note}")
