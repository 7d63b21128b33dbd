"""SGLang HiCache's storage tier, side by side: no L3, SGLang's `file` and `mooncake` backends, and tierkv.

A prefix-heavy workload on a real SGLang 0.5.23 server (CPU, the tiny random-weight Llama of the tests, in
.venv-sglang): ``--prefixes`` long prefixes, each sent ``--passes`` times with a new suffix, in turn, so that
SGLang's own device and host caches (``--max-total-tokens``, ``--hicache-ratio 2``) are too small to keep them
and a repeated prefix comes back from the L3 backend or is recomputed.  Each back end gets a server of its own
per round, with empty storage (a fresh directory, a fresh Mooncake master and pool of ``--pool`` bytes), and the
rounds alternate the order of the back ends.  Reported per back end: the storage hit rate (the prompt tokens SGLang
says came from storage, ``cached_tokens_details``), TTFT p50 / p99 (the first streamed chunk), throughput
(requests per second of the whole workload), and their ratios to the `file` and `mooncake` backends.  A request
that fails fails the run; a back end that cannot start here is reported with the reason.

    python bench/bench_sglang.py [--rounds 2] [--passes 3] [--prefixes 6] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

import mooncake_util
from sglang_util import SGLANG_MISSING, TIERKV_BACKEND, SGLangServer, make_tiny_model, prompt_ids

from tierkv.units import parse_size

BACKENDS = ("none", "file", "mooncake", "tierkv-ssd", "tierkv-pool")


def ttft_generate(server: SGLangServer, ids: list[int], max_new_tokens: int) -> tuple[float, dict[str, Any]]:
    """One streamed greedy request: (seconds to the first chunk, the last chunk)."""
    body = json.dumps({"input_ids": ids, "stream": True, "sampling_params": {
        "max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}}).encode()
    req = urllib.request.Request(server.url + "/generate", data=body, headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first = None
    last: dict[str, Any] = {}
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            if first is None:
                first = time.perf_counter() - t0
            last = json.loads(line[5:])
    if first is None or not last.get("output_ids"):
        raise RuntimeError(f"a request failed on {server.url}: {last}")
    return first, last


def play(server: SGLangServer, args: argparse.Namespace) -> dict[str, Any]:
    prefixes = [prompt_ids(args.prefix_tokens, seed=100 + i) for i in range(args.prefixes)]
    ttfts: list[float] = []
    storage = prompt = 0
    n = 0
    t0 = time.perf_counter()
    for p in range(args.passes):
        for i, prefix in enumerate(prefixes):
            ids = prefix + prompt_ids(args.suffix_tokens, seed=10_000 + p * 1000 + i)
            ttft, out = ttft_generate(server, ids, args.max_new_tokens)
            n += 1
            if p == 0:
                continue  # (the cold pass computes everything: hits and TTFT are counted on the repeats)
            ttfts.append(ttft)
            details = out.get("meta_info", {}).get("cached_tokens_details") or {}
            storage += int(details.get("storage", 0) or 0)
            prompt += len(ids)
    wall = time.perf_counter() - t0
    return {"ttfts": ttfts, "storage_tokens": storage, "prompt_tokens": prompt, "requests": n, "wall_s": wall}


def start(backend: str, model: str, work: Path, pool_bytes: str, args: argparse.Namespace,
          stack: list[Any]) -> SGLangServer:
    log = work / f"{backend}.log"
    common = {"max_total_tokens": args.max_total_tokens}
    if backend == "none":
        return SGLangServer(model, log, backend=None, **common)
    if backend == "file":
        return SGLangServer(model, log, backend="file", env={"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(work / "file")},
                            **common)
    if backend == "tierkv-ssd":
        store = {"tiers": [{"medium": "dram", "capacity": args.dram, "eviction": "lru"},
                           {"medium": "ssd", "path": str(work / "ssd"), "capacity": "1GiB"}]}
        return SGLangServer(model, log, extra_config={**TIERKV_BACKEND, "tierkv": store, "model_id": "bench"}, **common)
    master = mooncake_util.MooncakeMaster().start()
    stack.append(master)
    if backend == "mooncake":
        cfg = {"master_server_address": master.master, "metadata_server": master.metadata_server, "protocol": "tcp",
               "global_segment_size": parse_size(pool_bytes, "--pool"), "local_hostname": "127.0.0.1", "interface_v1": 1}
        return SGLangServer(model, log, backend="mooncake", extra_config=cfg, **common)
    pool = master.standalone_pool(pool_bytes)
    pool.__enter__()
    stack.append(pool)
    store = {"tiers": [{"medium": "dram", "capacity": args.dram, "eviction": "lru"}, pool.tier_config()]}
    return SGLangServer(model, log, extra_config={**TIERKV_BACKEND, "tierkv": store, "model_id": "bench"}, **common)


def log_error(log: Path, e: BaseException) -> str:
    """The last line of a server's log that names an error (else ``e``'s first line)."""
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    errors = [ln.strip() for ln in lines if "Error" in ln or "error" in ln]
    return (errors[-1] if errors else str(e).splitlines()[0])[:240]


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ttfts = sorted(t for r in runs for t in r["ttfts"])
    storage = sum(r["storage_tokens"] for r in runs)
    prompt = sum(r["prompt_tokens"] for r in runs)
    return {
        "storage_hit_rate": storage / prompt if prompt else 0.0,
        "ttft_p50_ms": 1000 * statistics.median(ttfts),
        "ttft_p99_ms": 1000 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        "req_per_s": sum(r["requests"] for r in runs) / sum(r["wall_s"] for r in runs),
        "requests": sum(r["requests"] for r in runs),
    }


def table(results: dict[str, Any], failed: dict[str, str]) -> str:
    lines = ["| back end | storage hit rate | TTFT p50 (ms) | TTFT p99 (ms) | req/s | p50 vs file | p50 vs mooncake "
             "| req/s vs file | req/s vs mooncake |", "|---|---|---|---|---|---|---|---|---|"]

    def ratio(b: str, key: str, base: str) -> str:
        if base not in results:
            return "n/a"
        return f"{results[b][key] / results[base][key]:.2f}x"

    for b in BACKENDS:
        if b in failed:
            lines.append(f"| {b} | did not run here: {failed[b]} | | | | | | | |")
            continue
        if b not in results:
            continue
        s = results[b]
        lines.append(f"| {b} | {s['storage_hit_rate']:.3f} | {s['ttft_p50_ms']:.0f} | {s['ttft_p99_ms']:.0f} | "
                     f"{s['req_per_s']:.2f} | {ratio(b, 'ttft_p50_ms', 'file')} | {ratio(b, 'ttft_p50_ms', 'mooncake')} | "
                     f"{ratio(b, 'req_per_s', 'file')} | {ratio(b, 'req_per_s', 'mooncake')} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--prefixes", type=int, default=6)
    ap.add_argument("--prefix-tokens", type=int, default=768)
    ap.add_argument("--suffix-tokens", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--max-total-tokens", type=int, default=2048)
    ap.add_argument("--pool", default="256MiB", help="the Mooncake pool's size (both pool back ends)")
    ap.add_argument("--dram", default="32MiB", help="tierkv's own DRAM tier above the SSD or the pool")
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if SGLANG_MISSING:
        sys.exit(SGLANG_MISSING)
    backends = [b for b in args.backends.split(",") if b]
    unknown = set(backends) - set(BACKENDS)
    if unknown:
        sys.exit(f"unknown back end(s) {sorted(unknown)}; known: {', '.join(BACKENDS)}")
    with tempfile.TemporaryDirectory(prefix="bench-sglang-") as tmp:
        model = make_tiny_model(Path(tmp) / "model")
        runs: dict[str, list[dict[str, Any]]] = {b: [] for b in backends}
        failed: dict[str, str] = {}
        for r in range(args.rounds):
            order = backends[r % len(backends):] + backends[: r % len(backends)]  # (alternate who goes first)
            for b in order:
                if b in failed:
                    continue
                work = Path(tmp) / f"r{r}-{b}"
                work.mkdir()
                stack: list[Any] = []
                try:
                    try:
                        server = start(b, model, work, args.pool, args, stack)
                    except Exception as e:
                        failed[b] = log_error(work / f"{b}.log", e)
                        print(f"round {r}: {b} did not start: {failed[b]}", file=sys.stderr)
                        continue
                    try:
                        with server:
                            runs[b].append(play(server, args))
                    except Exception as e:
                        if b.startswith("tierkv"):
                            raise  # (tierkv's own requests must all succeed)
                        failed[b] = "failed under load: " + log_error(work / f"{b}.log", e)
                        print(f"round {r}: {b} {failed[b]}", file=sys.stderr)
                        runs[b] = []
                        continue
                    print(f"round {r}: {b} done", file=sys.stderr)
                finally:
                    for x in reversed(stack):
                        x.__exit__(None, None, None)
        results = {b: summarize(rs) for b, rs in runs.items() if rs}
    print(table(results, failed))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results, "failed": failed}, indent=1))


if __name__ == "__main__":
    main()
