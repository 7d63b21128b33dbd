"""``tierkv pool start``: run a standalone Mooncake pool (a node-local ``mooncake_client``) in the foreground.

Engines whose ``dram_pool`` tier is in ``"mode": "standalone"`` attach to it and
contribute no memory, so the pool outlives every engine process.  The work is
done by ``tierkv.tiers.remote.standalone`` (its ``main`` takes the arguments
after ``pool start``).
"""

from __future__ import annotations

import argparse

HELP = "a standalone Mooncake pool on this node that outlives the engines (pool start --segment 8GiB ...)"
DESCRIPTION = """\
Start a node-local mooncake_client that owns the pool memory; engines attach with
{"medium": "dram_pool", "mode": "standalone", ...} and contribute none, so a
restarted engine finds its KV in the pool.  Runs until SIGINT / SIGTERM and takes
the client down with it.  'tierkv pool start --help' lists the options."""


def add_parser(sub) -> None:
    p = sub.add_parser("pool", help=HELP, description=DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", choices=["start"], help="start: run a standalone pool in the foreground")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="options of 'tierkv pool start' (see its --help)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tierkv.tiers.remote.standalone import main

    return main(args.rest)
