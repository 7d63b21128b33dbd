"""The cluster benchmark's own pieces: its workload, its router, and what its figures are made of.

The benchmark itself needs several vLLM servers and minutes; these parts decide what its figures mean.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import bench_cluster as C


def test_sessions_grow_turn_by_turn_over_a_shared_system_prompt() -> None:
    s = C.make_sessions(6, 3, 2, system_len=10, user_len=4, reply_len=5, vocab=100, seed=1)
    assert len(s) == 6 and all(len(x.turns) == 3 for x in s)
    for x in s:
        assert x.system == x.index % 2
        for t, p in enumerate(x.turns):
            assert len(p) == 10 + t * (4 + 5) + 4
            assert all(1 <= v < 100 for v in p)
        for a, b in zip(x.turns, x.turns[1:]):
            assert b[:len(a)] == a  # turn t+1 carries turn t and its reply
    assert s[0].turns[0][:10] == s[2].turns[0][:10] != s[1].turns[0][:10]
    assert s[0].turns[0][10:] != s[2].turns[0][10:]  # sessions differ after the system prompt
    assert C.make_sessions(6, 3, 2, 10, 4, 5, 100, seed=1)[4].turns == s[4].turns  # the same for every back end


def test_ideal_hit_rate_counts_whole_blocks_an_earlier_prompt_carried() -> None:
    a = C.Session(0, 0, [list(range(1, 9)), list(range(1, 13))])
    # block 4: turn 1 asks 8 tokens, hits nothing; turn 2 asks 12, its first 8 tokens (2 blocks) were carried
    assert C.ideal_hit_rate([a], 4) == pytest.approx(8 / 20)
    # a prompt that is all carried still computes its last token: 8 tokens again hit 1 block, not 2
    b = C.Session(0, 0, [list(range(1, 9)), list(range(1, 9))])
    assert C.ideal_hit_rate([b], 4) == pytest.approx(4 / 16)
    # a divergence inside a block loses that block
    c = C.Session(0, 0, [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 0, 7, 8, 9]])
    assert C.ideal_hit_rate([c], 4) == pytest.approx(4 / 17)


def test_round_robin_spreads_evenly_and_random_reaches_every_instance() -> None:
    r = C.Router(4, "rr")
    assert [r.pick() for _ in range(9)] == [0, 1, 2, 3, 0, 1, 2, 3, 0]
    assert r.sent == [3, 2, 2, 2]
    q = C.Router(3, "random", seed=5)
    picks = [q.pick() for _ in range(300)]
    assert set(picks) == {0, 1, 2} and sum(q.sent) == 300
    again = C.Router(3, "random", seed=5)
    assert [again.pick() for _ in range(300)] == picks  # a seed gives the same routes
    with pytest.raises(ValueError, match="route"):
        C.Router(2, "least-loaded")
    with pytest.raises(ValueError, match="at least one"):
        C.Router(0, "rr")


def _counters(queries: float, hits: float, ext: float = 0.0) -> dict[str, float]:
    out = dict.fromkeys(C.B.COUNTERS, 0.0)
    out.update({"vllm:prefix_cache_queries": queries, "vllm:prefix_cache_hits": hits,
                "vllm:external_prefix_cache_hits": ext})
    return out


def _ok(n: int, instance: int = 0) -> list[C.Result]:
    return [C.Result(i, 0, instance, 100, ok=True, ttft=0.01 * (i + 1), latency=0.1, output_tokens=4)
            for i in range(n)]


def test_hit_rate_sums_local_and_connector_hits_over_every_instance() -> None:
    before = [_counters(100, 10, 0), _counters(50, 0, 5)]
    after = [_counters(1100, 410, 100), _counters(1050, 100, 305)]
    got = C.summarise(_ok(3) + _ok(2, instance=1), 2.0, before, after)
    assert got["prompt_tokens_asked"] == 2000
    assert got["local_hit_rate"] == pytest.approx(500 / 2000)
    assert got["connector_hit_rate"] == pytest.approx(400 / 2000)
    assert got["hit_rate"] == pytest.approx(900 / 2000)
    assert got["req_per_s"] == pytest.approx(2.5)
    assert got["per_instance_requests"] == [3, 2]
    assert got["ttft_p50_ms"] == pytest.approx(20.0)


def test_a_failed_request_or_an_unread_instance_fails_the_figures() -> None:
    good = [_counters(0, 0)], [_counters(100, 50)]
    bad = [*_ok(3), C.Result(9, 1, 0, 100, ok=False, error="HTTP 500: boom")]
    with pytest.raises(RuntimeError, match="1 of 4 requests failed.*HTTP 500"):
        C.summarise(bad, 1.0, *good)
    with pytest.raises(RuntimeError, match="no request completed"):
        C.summarise([], 1.0, *good)
    with pytest.raises(RuntimeError, match="instance 1: /metrics"):
        C.summarise(_ok(2), 1.0, [_counters(0, 0), {}], [_counters(100, 50), _counters(1, 1)])
    with pytest.raises(RuntimeError, match="no prefix-cache queries"):
        C.summarise(_ok(2), 1.0, [_counters(5, 0)], [_counters(5, 0)])


def test_bad_options_are_refused_in_one_line(capsys) -> None:
    for argv, said in ((["--instances", "1"], "--instances must be at least 2"),
                       (["--backends", "none,foo"], "unknown back end 'foo'"),
                       (["--backends", "none,none"], "twice"),
                       (["--route", "hash"], "invalid choice"),
                       (["--pool", "lots"], "--pool: not a size"),
                       (["--sessions", "0"], "--sessions must be at least 1"),
                       (["--rounds", "0"], "--rounds must be at least 1")):
        with pytest.raises(SystemExit) as e:
            C.main(argv)
        assert e.value.code != 0
        err = capsys.readouterr().err
        assert said in err and "Traceback" not in err


class _FakeServer:
    """An OpenAI-style streaming completions endpoint on loopback (aiohttp), recording each prompt it serves;
    ``fail_on`` is a prompt length it answers with HTTP 500."""

    def __init__(self, fail_on: int | None = None) -> None:
        self.prompts: list[list[int]] = []
        self.fail_on = fail_on

    async def handle(self, request):
        import json

        from aiohttp import web

        body = await request.json()
        self.prompts.append(body["prompt"])
        if len(body["prompt"]) == self.fail_on:
            return web.Response(status=500, text="boom")
        resp = web.StreamResponse()
        await resp.prepare(request)
        for _ in range(body["max_tokens"]):
            await resp.write(b"data: " + json.dumps({"choices": [{"text": "ab"}]}).encode() + b"\n\n")
        usage = {"choices": [], "usage": {"completion_tokens": body["max_tokens"]}}
        await resp.write(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")
        return resp


def _serve_and_play(fakes: list[_FakeServer], sessions, route: str, concurrency: int):
    import asyncio

    from aiohttp import web

    async def go():
        runners, urls = [], []
        for f in fakes:
            app = web.Application()
            app.router.add_post("/v1/completions", f.handle)
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            runners.append(runner)
            urls.append(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}")
        try:
            return await C._play(urls, C.Router(len(fakes), route), sessions, concurrency, 3)
        finally:
            for r in runners:
                await r.cleanup()

    return asyncio.run(go())


def test_play_sends_each_turn_after_the_one_before_and_spreads_sessions_over_instances() -> None:
    pytest.importorskip("aiohttp")
    sessions = C.make_sessions(8, 3, 2, 16, 4, 4, 100)
    fakes = [_FakeServer(), _FakeServer()]
    results = _serve_and_play(fakes, sessions, "rr", 3)
    assert len(results) == 24 and all(r.ok and r.output_tokens == 3 and r.ttft is not None for r in results)
    assert sorted(len(f.prompts) for f in fakes) == [12, 12]  # round-robin
    served = [p for f in fakes for p in f.prompts]
    assert sorted(map(tuple, served)) == sorted(tuple(p) for s in sessions for p in s.turns)
    order = {(r.session, r.turn): k for k, r in enumerate(results)}
    assert all(order[(s, t)] > order[(s, t - 1)] for s, t in order if t > 0)  # turns in order
    assert C.moved(results) > 0  # later turns reached the other instance too


def test_a_failing_request_is_counted_and_ends_its_session() -> None:
    pytest.importorskip("aiohttp")
    sessions = C.make_sessions(2, 3, 1, 16, 4, 4, 100)
    bad_len = len(sessions[0].turns[1])  # turn 2 of both sessions
    results = _serve_and_play([_FakeServer(fail_on=bad_len)], sessions, "random", 2)
    failed = [r for r in results if not r.ok]
    assert len(results) == 4 and len(failed) == 2  # turns 1 served, turns 2 failed, no turn 3 sent
    assert all("HTTP 500" in (r.error or "") and r.turn == 1 for r in failed)
    with pytest.raises(RuntimeError, match="2 of 4 requests failed"):
        C.summarise(results, 1.0, [_counters(0, 0)], [_counters(10, 1)])


def test_tier_hits_reads_tierkvs_hit_tokens_per_tier() -> None:
    page = "\n".join([
        "# HELP tierkv_connector_hit_tokens_total Prompt tokens found in tierkv, by the tier serving them",
        'tierkv_connector_hit_tokens_total{engine="0",model_name="tiny",tier="dram"} 192.0',
        'tierkv_connector_hit_tokens_total{engine="0",model_name="tiny",tier="dram_pool"} 320.0',
        'tierkv_connector_hit_tokens_created{engine="0",model_name="tiny",tier="dram"} 1.79e+09',
        'vllm:external_prefix_cache_hits_total{engine="0",model_name="tiny"} 512.0'])
    assert C.tier_hits(page) == {"dram": 192.0, "dram_pool": 320.0}
    assert C.tier_hits("") == {}


def test_rounds_alternate_the_order_and_run_the_limit_once() -> None:
    given = ["none", "mooncake", "tierkv", "limit"]
    assert C.round_order(given, 0) == given
    assert C.round_order(given, 1) == ["tierkv", "mooncake", "none"]
    assert C.round_order(given, 2) == ["none", "mooncake", "tierkv"]
    assert C.round_order(given, 3) == ["tierkv", "mooncake", "none"]
    assert C.round_order(["limit", "tierkv", "none"], 1) == ["none", "tierkv"]
    # over an even number of rounds every cluster back end sums the same positions
    four = [C.round_order(given, r) for r in range(4)]
    places = {b: sum(o.index(b) for o in four) for b in ("none", "mooncake", "tierkv")}
    assert len(set(places.values())) == 1
    with pytest.raises(ValueError):
        C.round_order(given, -1)


def _run(p50: float, p90: float, p99: float, rps: float, *, requests: int = 10, ttfts: list[float] | None = None,
         asked: float = 100.0, local: float = 30.0, ext: float = 20.0) -> dict:
    wall = requests / rps
    return {"ttft_p50_ms": p50, "ttft_p90_ms": p90, "ttft_p99_ms": p99, "req_per_s": rps, "requests": requests,
            "wall_s": wall, "prompt_tokens_asked": asked, "local_hit_tokens": local, "connector_hit_tokens": ext,
            "ttfts_ms": ttfts if ttfts is not None else [p50] * requests, "instances": 2,
            "prompt_tok_per_s": asked / wall, "output_tok_per_s": 4 * requests / wall, "moved": 0.5,
            "tierkv_hit_tokens_by_tier": {}}


def test_ratios_per_round_their_median_and_the_pooled_ratio() -> None:
    rounds = [
        {"mooncake": _run(100, 200, 400, 2.0), "tierkv": _run(80, 180, 200, 2.4)},
        {"tierkv": _run(60, 90, 100, 3.0), "mooncake": _run(100, 100, 100, 2.0)},
        {"mooncake": _run(50, 100, 200, 1.0), "tierkv": _run(50, 100, 300, 1.5)},
    ]
    assert C.ratios(rounds[0]["tierkv"], rounds[0]["mooncake"]) == pytest.approx(
        {"ttft_p50_ms": 0.8, "ttft_p90_ms": 0.9, "ttft_p99_ms": 0.5, "req_per_s": 1.2})
    pooled = {n: C.pool_runs([rd[n] for rd in rounds]) for n in ("mooncake", "tierkv")}
    vs = C.compare(rounds)
    assert set(vs) == {"tierkv"}
    t = vs["tierkv"]
    assert [p["round"] for p in t["per_round"]] == [1, 2, 3]
    assert t["per_round"][1]["ttft_p50_ms"] == pytest.approx(0.6)
    # the median of (0.8, 0.6, 1.0), of (0.9, 0.9, 1.0), of (0.5, 1.0, 1.5), of (1.2, 1.5, 1.5)
    assert t["median"] == pytest.approx({"ttft_p50_ms": 0.8, "ttft_p90_ms": 0.9, "ttft_p99_ms": 1.0,
                                         "req_per_s": 1.5})
    # pooled: 30 requests each; mooncake's walls 5 + 5 + 10 s, tierkv's 10/2.4 + 10/3 + 10/1.5 s
    assert pooled["mooncake"]["req_per_s"] == pytest.approx(30 / 20)
    assert t["pooled"]["req_per_s"] == pytest.approx((30 / (10 / 2.4 + 10 / 3 + 10 / 1.5)) / 1.5)
    # every request's TTFT together: mooncake's are 10 x 100, 10 x 100, 10 x 50 ms
    assert pooled["mooncake"]["ttft_p50_ms"] == pytest.approx(100)
    assert t["pooled"]["ttft_p50_ms"] == pytest.approx(pooled["tierkv"]["ttft_p50_ms"] / 100)
    # a round the reference did not complete is left out of every ratio, the pooled one too
    partial = C.compare([rounds[0], {"tierkv": rounds[1]["tierkv"]}, rounds[2]])["tierkv"]
    assert [p["round"] for p in partial["per_round"]] == [1, 3]
    assert partial["pooled"]["req_per_s"] == pytest.approx((20 / (10 / 2.4 + 10 / 1.5)) / (20 / 15))
    assert partial["median"]["ttft_p50_ms"] == pytest.approx(0.9)
    # no completed round of the reference: no comparison
    assert C.compare([{"tierkv": rounds[0]["tierkv"]}]) == {}


def test_pooled_hit_rate_weighs_every_rounds_prompt_tokens() -> None:
    a = _run(10, 20, 30, 1.0, asked=100, local=50, ext=0, ttfts=[1.0] * 10)
    b = _run(10, 20, 30, 1.0, asked=300, local=0, ext=60, ttfts=[3.0] * 9 + [100.0])
    p = C.pool_runs([a, b])
    assert p["hit_rate"] == pytest.approx(110 / 400)
    assert p["local_hit_rate"] == pytest.approx(50 / 400) and p["connector_hit_rate"] == pytest.approx(60 / 400)
    assert p["requests"] == 20 and p["rounds"] == 2
    assert p["ttft_p50_ms"] == pytest.approx(2.0)  # between the 10 x 1 ms and the 9 x 3 ms
    assert p["ttft_p99_ms"] > 3.0
    assert p["prompt_tok_per_s"] == pytest.approx(400 / 20)
    with pytest.raises(ValueError):
        C.pool_runs([])
