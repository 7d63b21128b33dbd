"""Real serving: vLLM's OpenAI server under vLLM's own serving benchmark, per KV back end.

Each back end gets its own ``python -m vllm.entrypoints.openai.api_server`` on a
free loopback port, over the same random-weight Llama (8 layers x hidden 512 by
default; no download) and a local WordLevel tokenizer, with a vLLM KV cache small
enough that vLLM's own prefix cache evicts: the connector has to serve prefixes
vLLM has dropped.  Back ends:

    none      no connector (vLLM recomputes what its prefix cache lost)
    mooncake  vLLM's MooncakeStoreConnector over a loopback mooncake_master
              (embedded by default, --mooncake-mode standalone for a mooncake_client pool);
              extra config {"load_async": true}
    tierkv    TierKVConnector, store dram -> ssd (SSD in a temp dir), default options (load_async "auto":
              a step's first memory-tier hit loads in the step, the others between steps)
    tierkv-sync   the same with {"load_async": false}: every hit loads in the step, the batch waits
    tierkv-async  the same with {"load_async": true}: every hit loads between steps, the request waits
    tierkv-auto   the same with {"load_async": "auto"} named (as tierkv)
    tierkv-noaudit  the same with {"audit_rate": 0}: no hit recomputed for an audit (the audit's cost is
              tierkv's figures against these, in the same run)
    tierkv-audit-all  the same with {"audit_rate": 1}: every hit recomputed and compared (the audit's
              whole cost; at a rate r it is about r times the difference to tierkv-noaudit)
    tierkv-dram   the same store without its ssd tier (dram only, as MooncakeStoreConnector's one pool):
              what the copies down to the SSD cost a step

--audit-rate sets ``audit_rate`` on every tierkv back end but those two (default: the
connector's own default), --audit-tolerance ``audit_tolerance`` on every tierkv back end; the audits
each run made and the time they spent reading back and
comparing are in the /metrics table (``audits``, ``audit_ms``).

The load is vLLM's ``vllm.benchmarks.serve`` (called in-process) with the
``prefix_repetition`` dataset: --num-prefixes shared prefixes, each followed by
a random suffix, shuffled, at a fixed concurrency.  Every server stays up; each
round runs every back end once (the order rotates) on a new dataset seed (fresh
prefixes: nothing stored in an earlier round hits), so all back ends see the same
machine conditions.  Reported per back end: request throughput, median and p99
TTFT, median TPOT (medians over rounds), and ratios to MooncakeStoreConnector's
figure in the same round (median over rounds); then the TTFT percentiles (p50, p90,
p99) of every request of every round pooled, and their ratios.  With --warm, each
run is preceded by one unmeasured request per prefix of its dataset (the first one,
one output token): a server that has seen these prefixes before, where every
measured request can hit and none waits behind a cold prefill of a new prefix.  Target: tierkv's
median and p99 TTFT <= 0.8x MooncakeStoreConnector's, with higher throughput.

    python bench/bench_serve.py [--backends none,mooncake,tierkv,tierkv-async] [--requests 120] [--concurrency 4]
                                [--rounds 2] [--json out.json] [--quick] [--profile]

--profile runs one more round per back end (not in the table: sampling slows what it
samples) under py-spy (``py-spy record --native --subprocesses``, raw folded stacks) and prints,
side by side, where each server's busy time goes: the connector's parts (probe, lease, load,
checksum, save, audit, metrics, per-step calls) and the engine's (forward, scheduler, IPC spin, API server),
as samples and busy ms per request (bench/profile_split.py).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))

import hybrid_models as H
import profile_split as P
import serve_util as S
import vllm_util as U

#: model families a run can serve (``--family``): a Llama, a Gemma-3-style model (three sliding-window layers to
#: one full-attention layer) and a Qwen3-Next-style one (three Gated DeltaNet layers to one full-attention layer)
FAMILIES = ("llama", "gemma3", "qwen3-next")
FAMILY_DTYPE = {"llama": "float32", "gemma3": "float32", "qwen3-next": "bfloat16"}


def make_model(args: argparse.Namespace, work: Path, max_positions: int) -> str:
    """The run's random-weight model of ``args.family`` (kept in ``work`` under a name that holds its shape)."""
    shape = f"{args.layers}x{args.hidden}h{args.heads}-v{args.vocab}-p{max_positions}"
    if args.family == "llama":
        return U.make_tiny_model(work / f"model-{shape}", layers=args.layers, hidden=args.hidden,
                                 heads=args.heads, kv_heads=args.heads, vocab=args.vocab, max_positions=max_positions)
    if args.family == "gemma3":
        types = [("full_attention" if i % 4 == 3 else "sliding_attention") for i in range(args.layers)]
        return H.make_gemma3_model(work / f"model-gemma3-{shape}-w{args.sliding_window}", hidden=args.hidden,
                                   heads=args.heads, kv_heads=args.heads, vocab=args.vocab,
                                   sliding_window=args.sliding_window, layer_types=types,
                                   max_positions=max_positions)
    types = [("full_attention" if i % 4 == 3 else "linear_attention") for i in range(args.layers)]
    return H.make_qwen3_next_model(work / f"model-qwen3next-{shape}", hidden=args.hidden, heads=args.heads,
                                   kv_heads=args.heads, vocab=args.vocab, layer_types=types,
                                   max_positions=max_positions)


BACKENDS = ("none", "mooncake", "tierkv", "tierkv-sync", "tierkv-async", "tierkv-auto", "tierkv-noaudit",
            "tierkv-audit-all", "tierkv-dram")
#: kv_connector_extra_config of each tierkv back end
TIERKV_EXTRA: dict[str, Any] = {"tierkv": None, "tierkv-sync": {"load_async": False},
                                "tierkv-async": {"load_async": True}, "tierkv-auto": {"load_async": "auto"},
                                "tierkv-noaudit": {"audit_rate": 0.0}, "tierkv-audit-all": {"audit_rate": 1.0},
                                "tierkv-dram": None}
#: the back ends of a run without --backends
DEFAULT_BACKENDS = ("none", "mooncake", "tierkv")
METRICS = ("request_throughput", "output_throughput", "median_ttft_ms", "p99_ttft_ms", "mean_ttft_ms",
           "median_tpot_ms", "p99_tpot_ms", "median_e2el_ms", "duration", "completed")
#: the table's columns: (result key, header, higher is better)
SHOWN = (("request_throughput", "req/s", True), ("median_ttft_ms", "TTFT p50 ms", False),
         ("p99_ttft_ms", "TTFT p99 ms", False), ("median_tpot_ms", "TPOT p50 ms", False))


def _tierkv_extra(name: str, audit_rate: float | None, audit_tolerance: float | None = None) -> dict[str, Any] | None:
    """A tierkv back end's kv_connector_extra_config, with ``--audit-rate`` and ``--audit-tolerance`` where they
    apply."""
    extra = dict(TIERKV_EXTRA[name] or {})
    if audit_rate is not None and "audit_rate" not in extra:
        extra["audit_rate"] = audit_rate
    if audit_tolerance is not None:
        extra["audit_tolerance"] = audit_tolerance
    return extra or None


def _rotated(names: list[str], i: int) -> list[str]:
    k = i % len(names)
    return names[k:] + names[:k]


def _server_args(args: argparse.Namespace, max_len: int, kv_bytes: int, kv: dict | None) -> list[str]:
    out = ["--served-model-name", "tiny", "--dtype", FAMILY_DTYPE[getattr(args, "family", "llama")], "--enforce-eager",
           "--block-size", str(args.block_size), "--max-model-len", str(max_len),
           "--max-num-batched-tokens", str(max(max_len, 2048)), "--max-num-seqs", str(max(8, args.concurrency * 2)),
           "--kv-cache-memory-bytes", str(kv_bytes), "--enable-prefix-caching", "--seed", "0",
           "--uvicorn-log-level", "warning"]
    if kv is not None:
        out += ["--kv-transfer-config", json.dumps(kv)]
    return out


def _bench_args(args: argparse.Namespace, srv: S.ApiServer, model: str, seed: int, num_requests: int):
    """The ``vllm bench serve`` namespace for one run against ``srv``."""
    from vllm.benchmarks import serve as vbs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    p = FlexibleArgumentParser()
    vbs.add_cli_args(p)
    argv = ["--backend", "openai", "--base-url", srv.base_url, "--endpoint", "/v1/completions",
            "--model", model, "--served-model-name", "tiny", "--tokenizer", model,
            "--dataset-name", "prefix_repetition", "--num-prompts", str(num_requests),
            "--prefix-repetition-prefix-len", str(args.prefix_len),
            "--prefix-repetition-suffix-len", str(args.suffix_len),
            "--prefix-repetition-num-prefixes", str(args.num_prefixes),
            "--prefix-repetition-output-len", str(args.output_len),
            "--max-concurrency", str(args.concurrency), "--request-rate", "inf",
            "--ignore-eos", "--temperature", "0", "--seed", str(seed), "--disable-tqdm",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
            "--ready-check-timeout-sec", "0",
            "--save-detailed"]  # (keeps each request's TTFT in the result; nothing is written without --save-result)
    return p.parse_args(argv)


def run_load(args: argparse.Namespace, srv: S.ApiServer, model: str, seed: int, num_requests: int,
             log: io.TextIOBase) -> dict[str, Any]:
    """One benchmark run; vLLM's printed report goes to ``log``."""
    from vllm.benchmarks import serve as vbs

    ns = _bench_args(args, srv, model, seed, num_requests)
    with contextlib.redirect_stdout(log):
        res = vbs.main(ns)
    log.flush()
    if not res.get("completed"):
        raise RuntimeError(f"{srv.name}: no request completed (failed={res.get('failed')}); "
                           f"server log tail:\n{srv.log_tail()}")
    return res


def round_prefixes(args: argparse.Namespace, srv: S.ApiServer, model: str, seed: int, num_requests: int,
                   log: io.TextIOBase) -> list[str]:
    """The first prompt of each shared prefix in the dataset a run with ``seed`` sends (vLLM's own sampler,
    the same arguments: the same prompts)."""
    from vllm.benchmarks.datasets import get_samples
    from vllm.tokenizers import get_tokenizer

    ns = _bench_args(args, srv, model, seed, num_requests)
    tok = get_tokenizer(model)
    with contextlib.redirect_stdout(log):
        samples = get_samples(ns, tok)
    first: dict[tuple[int, ...], str] = {}
    for req in samples:
        ids = tok.encode(req.prompt, add_special_tokens=False)
        first.setdefault(tuple(ids[:args.prefix_len]), req.prompt)
    return list(first.values())


def prewarm(srv: S.ApiServer, prompts: list[str], settle: float = 1.0) -> float:
    """Serve each prompt once, one at a time, one output token (not measured): the round's prefixes have been
    seen before, as on a server that has run for a while.  Returns the seconds it took, ``settle`` included
    (time for the connectors' background saves to land)."""
    import urllib.request

    t0 = time.monotonic()
    for prompt in prompts:
        body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0}).encode()
        req = urllib.request.Request(srv.base_url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            if r.status != 200:
                raise RuntimeError(f"{srv.name}: warming request answered {r.status}")
            r.read()
    time.sleep(settle)
    return time.monotonic() - t0


def _cpu_busy() -> tuple[int, int]:
    """(busy, total) jiffies of every CPU since boot, from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + (v[4] if len(v) > 4 else 0)  # idle + iowait
    return sum(v) - idle, sum(v)


def settle(least: float, quiet: float = 0.15, window: float = 0.25, most: float = 20.0) -> float:
    """Wait until the machine is quiet before a measured run; returns the seconds waited.

    Sleeps ``least`` seconds, then until one ``window`` in which the CPUs were busy less than ``quiet`` of the
    time (``most`` seconds at the latest).  Every server stays up between runs, and a server that has just run
    keeps working for a while: vLLM's shared-memory readers (the worker waiting for the next step, the engine
    core waiting for the worker's answer) spin with ``sched_yield`` for a second after their last message
    (``SpinCondition.busy_loop_s``), and a connector may still be writing behind.  On a small machine the
    next back end's first prefill would share the cores with that tail.
    """
    t0 = time.monotonic()
    time.sleep(least)
    if not os.path.exists("/proc/stat"):
        return time.monotonic() - t0
    while time.monotonic() - t0 < most:
        b0, t_0 = _cpu_busy()
        time.sleep(window)
        b1, t_1 = _cpu_busy()
        if t_1 > t_0 and (b1 - b0) / (t_1 - t_0) < quiet:
            break
    return time.monotonic() - t0


#: vLLM's counters read from each server's /metrics before and after a run (summed over label sets)
COUNTERS = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:external_prefix_cache_queries",
            "vllm:external_prefix_cache_hits", "vllm:request_queue_time_seconds_sum",
            "vllm:request_queue_time_seconds_count", "vllm:request_prefill_time_seconds_sum",
            "vllm:request_prefill_time_seconds_count", "vllm:iteration_tokens_total_count",
            "vllm:iteration_tokens_total_sum", "vllm:time_to_first_token_seconds_sum",
            "vllm:time_to_first_token_seconds_count", "tierkv_connector_load_seconds",
            "tierkv_connector_loaded_bytes", "tierkv_connector_audits", "tierkv_connector_audit_mismatches",
            "tierkv_connector_audit_seconds")


def scrape(srv: S.ApiServer) -> dict[str, float]:
    """The ``COUNTERS`` of ``srv``'s Prometheus endpoint (``_total`` suffixes folded); {} when it cannot be read."""
    import urllib.request

    try:
        with urllib.request.urlopen(srv.base_url + "/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name = line.split(" ", 1)[0].split("{", 1)[0]
        if not name.endswith(("_total_count", "_total_sum")):
            name = name.removesuffix("_total")
        if name in COUNTERS:
            try:
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
            except ValueError:
                continue
    return out


def served_from(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Where a run's prompt tokens came from and where its requests waited, from two ``scrape``s: the shares of
    queried tokens hit in vLLM's own prefix cache and in the connector's store, and the mean queue and
    prefill time per request (ms), and the server's own mean TTFT (``server_ttft_ms``: from the request's
    arrival in the API server to its first token leaving vLLM's output processor)."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in COUNTERS}
    out: dict[str, float] = {}
    if d["vllm:prefix_cache_queries"] > 0:
        out["local_hit"] = d["vllm:prefix_cache_hits"] / d["vllm:prefix_cache_queries"]
    if d["vllm:external_prefix_cache_queries"] > 0:
        out["connector_hit"] = d["vllm:external_prefix_cache_hits"] / d["vllm:external_prefix_cache_queries"]
    for what in ("queue", "prefill"):
        n = d[f"vllm:request_{what}_time_seconds_count"]
        if n > 0:
            out[f"{what}_ms"] = 1000 * d[f"vllm:request_{what}_time_seconds_sum"] / n
    if d["vllm:time_to_first_token_seconds_count"] > 0:  # the server's own TTFT: arrival to first token out
        out["server_ttft_ms"] = 1000 * d["vllm:time_to_first_token_seconds_sum"] / d[
            "vllm:time_to_first_token_seconds_count"]
    if d["vllm:iteration_tokens_total_count"] > 0:  # engine steps, and tokens computed per step
        out["steps"] = d["vllm:iteration_tokens_total_count"]
        out["tokens_per_step"] = d["vllm:iteration_tokens_total_sum"] / d["vllm:iteration_tokens_total_count"]
    if d["tierkv_connector_load_seconds"] > 0:  # tierkv's own: time in loads, and their speed
        n = d["vllm:request_prefill_time_seconds_count"]
        if n > 0:
            out["load_ms"] = 1000 * d["tierkv_connector_load_seconds"] / n
        out["load_GiBps"] = d["tierkv_connector_loaded_bytes"] / d["tierkv_connector_load_seconds"] / 2**30
    if d["tierkv_connector_audits"] > 0 or d["tierkv_connector_audit_seconds"] > 0:
        # stored chunks (one layer each) compared with KV computed afresh, and the time that took in all
        out["audits"] = d["tierkv_connector_audits"]
        out["audit_mismatches"] = d["tierkv_connector_audit_mismatches"]
        out["audit_ms"] = 1000 * d["tierkv_connector_audit_seconds"]
    return out


PCTS = ("50", "90", "99")


def pooled_ttfts(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """Per back end, the TTFT percentiles (ms) of all its rounds' requests together, with their count ``n``;
    back ends whose results carry no per-request TTFTs are left out."""
    import numpy as np

    out: dict[str, dict[str, float]] = {}
    for name, rs in runs.items():
        t = [x for r in rs for x in (r.get("ttfts") or []) if x is not None and x > 0]
        if t:
            out[name] = {q: float(np.percentile(t, float(q))) * 1000 for q in PCTS} | {"n": float(len(t))}
    return out


def _profile_round(args: argparse.Namespace, srv: S.ApiServer, name: str, model: Path, work: Path,
                   log: Any) -> dict[str, Any] | None:
    """One more round of ``name``'s workload under py-spy: where its processes' time went (profile_split)."""
    raw = work / f"{name}-profile.txt"
    seed = 1000 + args.rounds
    if args.warm:  # (before the profiler attaches: only the measured requests are sampled)
        prewarm(srv, round_prefixes(args, srv, model, seed, args.requests, log))
    if args.settle > 0:
        settle(args.settle)
    prof = P.start(srv.proc.pid, raw, args.profile_rate)
    if prof is None:
        return None
    time.sleep(2.0)  # py-spy attaches to each process
    try:
        res = run_load(args, srv, model, seed, args.requests, log)
    finally:
        P.stop(prof)
    if not raw.exists():
        print(f"--profile: py-spy wrote nothing for {name}; see {raw.with_suffix('.log')}", file=sys.stderr)
        return None
    out = P.summarise(raw, args.profile_rate, args.requests)
    out["run"] = {k: res.get(k) for k in METRICS}
    print(f"profile {name}: {res['request_throughput']:.3f} req/s, TTFT p50 {res['median_ttft_ms']:.0f} ms "
          "(sampled: not in the table)", file=sys.stderr, flush=True)
    return out


# -- main --------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default=",".join(DEFAULT_BACKENDS), help=f"from {', '.join(BACKENDS)}")
    ap.add_argument("--requests", type=int, default=120)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--suffix-len", type=int, default=64)
    ap.add_argument("--num-prefixes", type=int, default=10)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--family", default="llama", choices=FAMILIES,
                    help="the model's family: llama, or a hybrid one (gemma3: sliding window + full attention; "
                         "qwen3-next: Gated DeltaNet + full attention, bfloat16; vLLM may raise its block size)")
    ap.add_argument("--sliding-window", type=int, default=256, help="gemma3's sliding window, in tokens")
    ap.add_argument("--kv-cache-prompts", type=float, default=1.5,
                    help="vLLM's KV cache size in units of (concurrency x request length): small, so its "
                         "own prefix cache evicts")
    ap.add_argument("--audit-rate", type=float, default=None,
                    help="audit_rate of the tierkv back ends but tierkv-noaudit and tierkv-audit-all "
                         "(default: the connector's)")
    ap.add_argument("--audit-tolerance", type=float, default=None,
                    help="audit_tolerance of the tierkv back ends (default: the connector's, 0: bitwise)")
    ap.add_argument("--dram", default="1GiB", help="tierkv's DRAM tier capacity (SSD below it)")
    ap.add_argument("--ssd", default="8GiB", help="tierkv's SSD tier capacity")
    ap.add_argument("--mooncake-mode", default="embedded", choices=["embedded", "standalone"])
    ap.add_argument("--mooncake-segment", default="1GB", help="the Mooncake pool size")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: 12 requests, 3 prefixes, short prompts, 1 round")
    ap.add_argument("--profile", action="store_true", help="one extra round per back end under py-spy (not in the table)")
    ap.add_argument("--profile-rate", type=int, default=20, help="py-spy samples per second")
    ap.add_argument("--warmup", type=int, default=None, help="requests per server before round 1 (not measured)")
    ap.add_argument("--warm", action="store_true",
                    help="before each measured run, serve the first request of each of its prefixes once "
                         "(not measured): every request hits, no cold prefill in the figures")
    ap.add_argument("--settle", type=float, default=2.0,
                    help="seconds to wait before each measured run, then until the CPUs are quiet (0: not at all)")
    ap.add_argument("--start-timeout", type=float, default=900)
    ap.add_argument("--workdir", default=None, help="keep model, stores and logs here (default: a temp dir)")
    ap.add_argument("--json", default=None, help="write every number to this file")
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.num_prefixes, args.rounds = 12, 3, 1
        args.prefix_len, args.suffix_len, args.output_len = 256, 32, 4
        args.block_size = 64
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    for b in backends:
        if b not in BACKENDS:
            raise SystemExit(f"unknown back end {b!r} (choose from {', '.join(BACKENDS)})")
    if args.requests < args.num_prefixes:
        raise SystemExit(f"--requests {args.requests} must be at least --num-prefixes {args.num_prefixes}")
    if args.audit_rate is not None and not 0.0 <= args.audit_rate <= 1.0:
        raise SystemExit(f"--audit-rate {args.audit_rate} must be between 0 and 1")
    if args.audit_tolerance is not None and not 0.0 <= args.audit_tolerance < float("inf"):
        raise SystemExit(f"--audit-tolerance {args.audit_tolerance} must be a finite number, 0 or more")
    if args.settle < 0:
        raise SystemExit(f"--settle {args.settle} must be 0 or more seconds")
    if args.family != "llama" and (args.layers < 4 or args.layers % 4):
        raise SystemExit(f"--layers {args.layers}: a {args.family} model has a multiple of 4 layers "
                         "(three hybrid layers to one full-attention layer)")
    if args.sliding_window < 1:
        raise SystemExit(f"--sliding-window {args.sliding_window} must be 1 token or more")
    if args.warmup is not None and args.warmup < args.num_prefixes:
        raise SystemExit(f"--warmup {args.warmup} must be at least --num-prefixes {args.num_prefixes}")

    keep = args.workdir is not None
    work = Path(args.workdir or tempfile.mkdtemp(prefix="tierkv-bench-serve-"))
    work.mkdir(parents=True, exist_ok=True)
    prompt_len = args.prefix_len + args.suffix_len
    max_len = -(-(prompt_len + args.output_len + 16) // args.block_size) * args.block_size
    # float32 K and V, every layer (an upper bound for the hybrid families, whose recurrent layers keep a state)
    kv_per_token = 2 * args.hidden * 4 * args.layers
    kv_bytes = int(kv_per_token * args.concurrency * (prompt_len + args.output_len) * args.kv_cache_prompts)
    kv_bytes = max(kv_bytes, kv_per_token * max_len * 2)  # two longest requests fit, at least
    # every shape in the name: a kept --workdir reuses a model only when it fits this run
    model = make_model(args, work, max_len + 64)
    S.make_word_tokenizer(model, args.vocab)

    base_env = U.engine_env(work / "cache")
    base_env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server runs its engine core in a child
    base_env.update({"VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
                     "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    # vLLM's CPU executor keeps cores off the worker's OpenMP threads for its scheduler process: one per
    # worker, and one more per worker when a KV connector is configured - unless the cores are too few, and
    # then none.  On a 2-core machine the server without a connector would run its forward on one core and
    # every connector's server on two; no reservation for any of them keeps the back ends comparable.
    base_env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    servers: dict[str, S.ApiServer] = {}
    pools: list[S.MooncakePool] = []
    runs: dict[str, list[dict[str, Any]]] = {b: [] for b in backends}
    startup: dict[str, float] = {}
    profile: dict[str, Any] | None = None
    bench_log = open(work / "bench-serve-client.log", "a")
    try:
        for name in backends:  # started one after another: two cold starts at once would crawl here
            env = dict(base_env)
            if name == "none":
                kv = None
            elif name == "mooncake":
                pool = S.MooncakePool(work, args.mooncake_mode, args.mooncake_segment)
                pools.append(pool)
                env.update(pool.env())
                kv = {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both",
                      "kv_connector_extra_config": {"load_async": True}}
            else:
                ssd = work / f"{name}-ssd"
                shutil.rmtree(ssd, ignore_errors=True)
                tiers: list[dict[str, Any]] = [{"medium": "dram", "capacity": args.dram}]
                if name != "tierkv-dram":
                    tiers.append({"medium": "ssd", "path": str(ssd), "capacity": args.ssd})
                kv = U.connector_config({"tiers": tiers},
                                        extra=_tierkv_extra(name, args.audit_rate, args.audit_tolerance))
            print(f"[{name}] starting server ...", file=sys.stderr, flush=True)
            srv = servers[name] = S.ApiServer(name, model, _server_args(args, max_len, kv_bytes, kv), env, work)
            startup[name] = srv.wait_ready(args.start_timeout)
            print(f"[{name}] healthy after {startup[name]:.0f}s on port {srv.port}", file=sys.stderr, flush=True)
            # first-request costs (compilation of kernels, connector threads, pool setup): not measured
            run_load(args, srv, model, 10_000, args.warmup or max(args.num_prefixes, args.concurrency), bench_log)
        names = list(servers)
        for r in range(args.rounds):
            warm = (round_prefixes(args, servers[names[0]], model, 1000 + r, args.requests, bench_log)
                    if args.warm else [])
            for name in _rotated(names, r):
                if warm:
                    took = prewarm(servers[name], warm)
                    print(f"round {r + 1}/{args.rounds} {name}: {len(warm)} prefixes served once ({took:.0f}s)",
                          file=sys.stderr, flush=True)
                waited = settle(args.settle) if args.settle > 0 else 0.0
                t0 = time.monotonic()
                before = scrape(servers[name])
                res = run_load(args, servers[name], model, 1000 + r, args.requests, bench_log)
                src = served_from(before, scrape(servers[name]))
                print(f"round {r + 1}/{args.rounds} {name}: {res['request_throughput']:.3f} req/s, "
                      f"TTFT p50 {res['median_ttft_ms']:.0f} ms p99 {res['p99_ttft_ms']:.0f} ms "
                      f"({time.monotonic() - t0:.0f}s, settled {waited:.1f}s); "
                      + ", ".join(f"{k} {v:.2f}" for k, v in src.items()),
                      file=sys.stderr, flush=True)
                runs[name].append({k: res.get(k) for k in METRICS}
                                  | {"ttfts": res.get("ttfts"), "round": r, "served_from": src, "settled_s": waited})
        if args.profile:
            # a round of its own per back end, not in the table: sampling slows what it samples
            profile = {}
            for name in names:
                got = _profile_round(args, servers[name], name, model, work, bench_log)
                if got is not None:
                    profile[name] = got | ({"raw": str(work / f"{name}-profile.txt")} if keep else {})
    finally:
        bench_log.close()
        for srv in servers.values():
            srv.stop()
        for pool in pools:
            pool.stop()
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
        else:  # a kept workdir keeps model, logs and profile; the stores' files are gigabytes of scratch
            for name in servers:
                shutil.rmtree(work / f"{name}-ssd", ignore_errors=True)

    # -- report ---------------------------------------------------------------------------
    summary: dict[str, dict[str, Any]] = {}
    for name, rs in runs.items():
        if not rs:
            continue
        s: dict[str, Any] = {"startup_s": startup.get(name), "rounds": rs}
        for key in METRICS:
            vals = [x[key] for x in rs if x.get(key) is not None]
            s[key] = statistics.median(vals) if vals else None
        for key, _, _ in SHOWN:
            for ref in ("mooncake", "none"):
                if ref in runs and ref != name and runs[ref]:
                    ratios = [a[key] / b[key] for a, b in zip(rs, runs[ref]) if a.get(key) and b.get(key)]
                    s[f"{key}_vs_{ref}"] = statistics.median(ratios) if ratios else None
        summary[name] = s

    print(f"\nvLLM OpenAI server, prefix_repetition: {args.requests} requests, {args.num_prefixes} prefixes of "
          f"{args.prefix_len} + {args.suffix_len}-token suffixes, {args.output_len} output tokens, concurrency "
          f"{args.concurrency}; model {args.family} {args.layers} layers x hidden {args.hidden} "
          f"({FAMILY_DTYPE[args.family]}), block "
          f"{args.block_size}, vLLM KV cache {kv_bytes >> 20} MiB ({kv_bytes // kv_per_token} tokens); "
          f"{'warm (every prefix served once before each run); ' if args.warm else ''}"
          f"{args.rounds} round(s), medians over rounds; 'vs mc' = ratio to MooncakeStoreConnector in the "
          f"same round (median over rounds)")
    head = f"{'backend':<17}" + "".join(f"{h:>13}{'vs mc':>7}" for _, h, _ in SHOWN)
    print(head)
    for name, s in summary.items():
        row = f"{name:<17}"
        for key, _, _ in SHOWN:
            v = s.get(key)
            ratio = s.get(f"{key}_vs_mooncake")
            row += f"{v:>13.3f}" if key == "request_throughput" else f"{v:>13.0f}"
            row += f"{ratio:>7.2f}" if ratio is not None else f"{'-':>7}"
        print(row)
    src_keys = ("local_hit", "connector_hit", "queue_ms", "prefill_ms", "server_ttft_ms", "steps", "tokens_per_step",
                "load_ms", "load_GiBps", "audits", "audit_mismatches", "audit_ms")
    print("\nFrom vLLM's /metrics, medians over rounds: shares of queried prompt tokens hit in vLLM's own prefix "
          "cache and in the connector's store; mean time per request queued and in prefill, and the server's mean "
          "TTFT (arrival in the API server to first token out); engine steps and tokens "
          "computed per step; tierkv's time in loads per request and their speed; the audits the run made (stored "
          "chunk-layers compared) and the time they took in all")
    print(f"{'backend':<17}" + "".join(f"{k:>16}" for k in src_keys))
    for name, rs in runs.items():
        med = {}
        for k in src_keys:
            vals = [x["served_from"][k] for x in rs if k in x.get("served_from", {})]
            if vals:
                med[k] = statistics.median(vals)
        if name in summary:
            summary[name]["served_from"] = med
        print(f"{name:<17}" + "".join(f"{med[k]:>16.2f}" if k in med else f"{'-':>16}" for k in src_keys))
    pooled = pooled_ttfts(runs)
    if pooled:
        for name, pc in pooled.items():
            summary[name]["pooled_ttft_ms"] = pc
            if "mooncake" in pooled and name != "mooncake":
                summary[name]["pooled_ttft_vs_mooncake"] = {q: pc[q] / pooled["mooncake"][q] for q in pc}
        print(f"\nTTFT of every request of every round together (the p99 of {args.requests} requests is their "
              f"second slowest: pooled rounds give it more to stand on)")
        print(f"{'backend':<17}{'requests':>9}" + "".join(f"{'p' + q + ' ms':>10}{'vs mc':>7}" for q in PCTS))
        for name, pc in pooled.items():
            vs = summary[name].get("pooled_ttft_vs_mooncake")
            print(f"{name:<17}{pc['n']:>9.0f}" + "".join(
                f"{pc[q]:>10.0f}" + (f"{vs[q]:>7.2f}" if vs else f"{'-':>7}") for q in PCTS))
    for name, prof in (profile or {}).items():
        P.print_summary(name, prof)
    if args.json:
        out = {"args": vars(args), "kv_cache_bytes": kv_bytes, "max_model_len": max_len,
               "results": summary, "profile": profile}
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
