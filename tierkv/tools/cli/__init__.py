"""``tierkv``: the operator's command.

    tierkv demo        store and reload KV chunks on embedded defaults (or a tiny vLLM model with --vllm)
    tierkv bench       benchmark suites: each medium against memcpy and raw file I/O
    tierkv inspect     an SSD tier's directory (or a Mooncake pool's view)
    tierkv simulate    replay a request trace through the real store over payload-free media
    tierkv trace       captured traces: show, convert
    tierkv pool start  a standalone Mooncake pool on this node that outlives the engines
    tierkv describe    a running store (its metrics endpoint) or pool (its master): contents, usage, health
    tierkv ping        does a running store's metrics endpoint, or a pool's master, answer?

Exit codes: 0 ok, 1 failure (a check failed, a run went wrong), 2 usage or configuration error.
"""

from __future__ import annotations

import argparse
import logging
import sys
import traceback
from typing import Optional

from tierkv.errors import ConfigError

from . import bench, demo, describe, inspect, ping, pool, simulate, trace
from ._common import EXIT_FAIL, EXIT_USAGE, CommandError

COMMANDS = {"demo": demo, "bench": bench, "inspect": inspect, "simulate": simulate, "trace": trace, "pool": pool}
COMMANDS.update(describe=describe, ping=ping)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="tierkv", description="tierkv: a tiered KV-cache store for LLM inference — operator tools.",
        epilog="Exit codes: 0 ok, 1 failure or failed check, 2 usage or configuration error. "
               "'tierkv COMMAND --help' describes each command.")
    from tierkv import __version__

    ap.add_argument("--version", action="version", version=f"tierkv {__version__}")
    ap.add_argument("-v", "--verbose", action="store_true", help="log tierkv's warnings and progress to stderr")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    for mod in COMMANDS.values():
        mod.add_parser(sub)
    return ap


def main(argv: Optional[list[str]] = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.command is None:
        ap.print_help(sys.stderr)
        return EXIT_USAGE
    logging.basicConfig(level=logging.INFO if args.verbose else logging.ERROR, format="%(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except (ConfigError, CommandError) as e:
        print(f"tierkv {args.command}: {_one_line(e)}", file=sys.stderr)
        return getattr(e, "code", EXIT_USAGE)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `tierkv ... | head`
        return 0
    except Exception as e:  # noqa: BLE001 - the last net: one line naming the fault, never a traceback
        if args.verbose:
            traceback.print_exc()
        print(f"tierkv {args.command}: failed: {type(e).__name__}: {_one_line(e)}"
              + ("" if args.verbose else f" (tierkv -v {args.command} ... prints the traceback)"), file=sys.stderr)
        return EXIT_FAIL


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__
