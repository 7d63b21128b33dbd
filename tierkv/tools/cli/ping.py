"""``tierkv ping``: does a store's metrics endpoint, or a pool's master, answer?"""

from __future__ import annotations

import argparse

from ._common import EXIT_FAIL, EXIT_OK, dump_json, note
from .describe import add_target_options, pick_target

HELP = "does a store's metrics endpoint (URL) or a Mooncake master (--master) answer? exit 0 only if it did"
DESCRIPTION = """\
tierkv ping URL
    GET the store's metrics endpoint (HOST:PORT, http://HOST:PORT/metrics or /status):
    answered when it replies with tierkv's metrics (or the exporter's /status).

tierkv ping --master HOST:PORT [--metrics-port P]
    Connect to the mooncake_master's RPC port and GET its HTTP endpoint (the master's
    --metrics_port, default 9003): answered when both reply, the second with the
    master's metrics.

Prints the round trip; says nothing of health ('tierkv describe' does).
Exit 0 answered, 1 no answer or not the expected service (one line on stderr says
why), 2 bad input."""


def add_parser(sub) -> None:
    p = sub.add_parser("ping", help=HELP, description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_target_options(p)
    p.add_argument("--json", action="store_true",
                   help="the answer as one JSON document on stdout, nothing else (a failure's reason goes to stderr)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tierkv.tools import live

    if pick_target(args) == "pool":
        res = live.ping_master(args.master, args.metrics_port if args.metrics_port is not None
                               else live.DEFAULT_MASTER_METRICS_PORT, args.timeout)
        what = f"mooncake master {res['master']}"
    else:
        res = live.ping_store(args.url, args.timeout)
        what = f"store {res['url']}"
    if args.json:
        dump_json(res)
    elif res["answered"]:
        print(f"{what}: answered in {res['ms']:.1f} ms")
    if not res["answered"]:
        note("ping", f"{what}: no answer: {res['why']}")
        return EXIT_FAIL
    return EXIT_OK
