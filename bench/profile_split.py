"""Where a served request's time goes: py-spy on a vLLM server, its samples split by what they were doing.

``bench_serve.py --profile`` runs one extra round per back end under ``py-spy record --native --subprocesses
--threads --idle`` and hands the folded output here. Every sample of every thread is *waiting* (its leaf is a
poll, a lock or a sleep) or *busy*; a busy sample is counted once, in the first of these that its stack shows:

* a KV connector's work (tierkv's modules, or vLLM's ``kv_connector`` package, MooncakeStoreConnector's
  included), split into the parts a hit pays for: ``audit``, ``checksum``, ``lease``, ``metrics``, ``probe``,
  ``save`` (puts, and copies down the tiers behind them), ``load``, ``step`` (the per-step calls:
  ``build_connector_meta``, ``get_finished``, ...) and ``other``;
* else the engine's own work: ``model forward``, ``vLLM scheduler``, ``vLLM IPC spin`` (the engine core and
  the worker spinning on their shared-memory queues: busy, but waiting for each other), ``API server`` or
  ``other``.

A connector sample takes the first part whose marks appear in the connector's frames of its stack, in the
order above, so a checksum taken by an audit counts as audit, and a lease taken inside a load counts as lease.
"""

from __future__ import annotations

import collections
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

#: the parts of a connector's work, first match wins (marks are substrings of a py-spy frame)
CONNECTOR_PARTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("audit", ("audit.py",)),
    ("checksum", ("checksum.py", "xxh3.py", "engine/integrity.py", "xxh", "XXH")),
    ("lease", ("leases.py",)),
    ("metrics", ("metrics.py", "prom.py", "connector_stats.py", "tierkv/stats.py", "accounting.py",
                 "tierkv/trace.py", "get_kv_connector_stats", "build_kv_connector_stats")),
    ("probe", ("get_num_new_matched_tokens", "update_state_after_alloc", "probe.py", "vllm/lookup.py",
               "indexqueries.py", "decline.py", "LookupKey", "lookup (", "process_request (",
               "find_longest_cache_hit", "batch_is_exist", "is_exist")),
    ("save", ("save_kv_layer", "wait_for_save", "saving.py", "engine/writer.py", "writebehind", "placer.py",
              "copier.py", "SendingThread", "batch_put", "put_from")),
    ("load", ("start_load_kv", "wait_for_layer_load", "loading.py", "engine/reader.py", "tierkv/buffers.py",
              "RecvingThread", "batch_get", "get_into", "_copysum")),
    ("step", ("build_connector_meta", "get_finished", "request_finished", "update_connector_output",
              "build_connector_worker_meta", "get_block_ids_with_load_errors")),
)
#: a frame of a connector's code: tierkv's packages, vLLM's connectors, Mooncake's client
CONNECTOR_FRAMES = ("tierkv/", "adapters/vllm/", "tiers/", "policies/", "kv_connector/", "mooncake", "_copysum")
#: the engine's own work, for samples no connector frame is on
ENGINE_PARTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("model forward", ("execute_model", "_model_forward", "forward (")),
    ("vLLM scheduler", ("schedule (", "update_from_output")),
    ("vLLM IPC spin", ("shm_broadcast.py",)),
    ("API server", ("output_processor", "detokeniz", "serving", "uvicorn", "fastapi", "starlette",
                    "api_server")),
)
#: a sample whose leaf or innermost Python frame is one of these is waiting, not working
WAIT_LEAVES = ("poll (", "epoll_wait", "epoll_pwait", "select (", "accept", "read (libc", "recv", "nanosleep",
               "futex", "pthread_cond", "sem_wait", "sem_timedwait", "sched_yield")
WAIT_FRAMES = ("wait (threading.py", "_wait_for_tstate_lock", "get (queue.py", "select (selectors.py",
               "_recv_bytes (multiprocessing", "accept (multiprocessing", "_worker (concurrent/futures",
               "sleep (", "poll (multiprocessing", "recv_multipart", "_poll (")


def classify(frames: list[str]) -> str:
    """The part a busy sample's stack (outermost first, process and thread frames left out) belongs to:
    ``"connector: <part>"`` or ``"engine: <part>"``."""
    ours = [f for f in frames if any(m in f for m in CONNECTOR_FRAMES)]
    if ours:  # (marks are looked for in the connector's frames only: vLLM has a find_longest_cache_hit too)
        for part, marks in CONNECTOR_PARTS:
            if any(m in f for f in ours for m in marks):
                return f"connector: {part}"
        return "connector: other"
    for part, marks in ENGINE_PARTS:
        if any(m in f for f in frames for m in marks):
            return f"engine: {part}"
    return "engine: other"


def is_waiting(frames: list[str]) -> bool:
    leaf = frames[-1] if frames else ""
    py = [f for f in frames if ".py:" in f]
    return any(w in leaf for w in WAIT_LEAVES) or bool(py and any(w in py[-1] for w in WAIT_FRAMES))


def _short_process(frame: str) -> str:
    cmd = frame.partition(":")[2].strip().strip('"')
    if cmd.startswith("VLLM::"):
        return cmd.split()[0]
    return "api_server" if "api_server" in cmd else (cmd.split() or ["?"])[0].rsplit("/", 1)[-1][:30]


def summarise(raw: Path, rate: int, requests: int, top: int = 15) -> dict[str, Any]:
    """Where the sampled time went: per process and thread (waiting, busy, and busy in which part), and per
    part over every thread, as samples and as a thread's busy milliseconds per request (``samples / rate / requests``).

    ``raw`` is py-spy's folded output, a ``frame;frame;...;leaf COUNT`` line per stack; with --subprocesses
    --threads a stack starts with its chain of processes (API server, engine core, worker), then its thread.
    """
    per: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    hot: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    parts: collections.Counter = collections.Counter()
    total = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        procs = [f for f in frames if f.startswith("process ")]
        thread = next((f for f in frames if f.startswith("thread (")), "thread (?): ?")
        key = f"{_short_process(procs[-1]) if procs else '?'} / {thread.partition(': ')[2]}"
        body = [f for f in frames if not f.startswith(("process ", "thread ("))]
        total += n
        per[key]["samples"] += n
        if is_waiting(body):
            per[key]["waiting"] += n
            continue
        part = classify(body)
        per[key]["busy"] += n
        per[key][part] += n
        parts[part] += n
        py = [f for f in body if ".py:" in f]
        if py:
            hot[key][py[-1]] += n  # the innermost Python frame: where the busy time is spent
    per_request = 1000.0 / max(rate, 1) / max(requests, 1)
    return {
        "samples": total, "rate": rate, "requests": requests,
        "parts": {p: {"samples": v, "busy_ms_per_request": round(v * per_request, 2)}
                  for p, v in sorted(parts.items(), key=lambda kv: -kv[1])},
        "threads": {k: {**dict(per[k]), "hot": dict(hot[k].most_common(top))}
                    for k in sorted(per, key=lambda k: -per[k]["busy"])},
    }


def print_summary(name: str, summary: dict[str, Any], threads: int = 8) -> None:
    busy = sum(v["samples"] for v in summary["parts"].values())
    print(f"\npy-spy, {name}: {summary['samples']} samples over all threads, {busy} busy, "
          f"{summary['requests']} requests at {summary['rate']} samples/s")
    print(f"  {'part':<26} {'samples':>8} {'share of busy':>15} {'busy ms / request':>18}")
    for part, v in summary["parts"].items():
        print(f"  {part:<26} {v['samples']:>8} {v['samples'] / max(busy, 1):>15.1%} "
              f"{v['busy_ms_per_request']:>18.2f}")
    print("  busiest threads (busy / total samples):")
    for k, info in list(summary["threads"].items())[:threads]:
        if not info.get("busy"):
            continue
        print(f"    {k}: {info['busy']} / {info['samples']}")
        for f, v in list(info["hot"].items())[:3]:
            print(f"      {v:>6}  at {f[:110]}")


def py_spy() -> str | None:
    exe = Path(sys.executable).with_name("py-spy")
    return str(exe) if exe.exists() else shutil.which("py-spy")


def start(pid: int, out: Path, rate: int) -> subprocess.Popen | None:
    """py-spy recording ``pid`` and its children into ``out`` (folded), or None (said on stderr) without it."""
    exe = py_spy()
    if exe is None:
        print("--profile: py-spy not found (python -m pip install py-spy)", file=sys.stderr)
        return None
    cmd = [exe, "record", "--native", "--subprocesses", "--threads", "--idle", "--format", "raw",
           "--rate", str(rate), "-o", str(out), "--pid", str(pid)]
    with open(out.with_suffix(".log"), "w") as log:  # the child keeps its own descriptor
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def stop(proc: subprocess.Popen | None) -> None:
    if proc is None:
        return
    proc.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
