"""``tierkv simulate`` applies the vLLM connector's decline rule where it has bandwidths and a prefill rate."""

from __future__ import annotations

import json

from tierkv.tools.sim import generate, simulate

BT = 16
BPT = 1024  # bytes per token


def _cfg():
    return {"tiers": [{"medium": "dram", "capacity": 20 * BT * BPT},
                      {"medium": "ssd", "path": "/nonexistent/never-created", "capacity": 400 * BT * BPT}],
            "promotion": "never"}


def test_a_tier_slower_than_the_prefill_is_declined_and_a_fast_one_kept():
    reqs = list(generate("chat", 400, BT, seed=5))
    # prefill 10,000 tokens/s: 100 us a token; dram reads a token in 0.1 us, ssd (1 MB/s) in 1 ms: declined
    slow = simulate(reqs, _cfg(), bytes_per_token=BPT, bandwidths={"dram": 1e10, "ssd": 1e6},
                    prefill_tokens_per_s=1e4, decline_margin_s=0.0)
    read_all = simulate(reqs, _cfg(), bytes_per_token=BPT, bandwidths={"dram": 1e10, "ssd": 1e6},
                        prefill_tokens_per_s=1e4, decline=False)
    assert read_all.tiers["ssd"]["hits"] > 0 and read_all.declined_hits == {}
    assert slow.tiers["ssd"]["hits"] == 0 and slow.tiers["dram"]["hits"] > 0
    assert slow.declined_hits["ssd"] > 0 and set(slow.declined_hits) == {"ssd"}
    assert slow.declined_tokens["ssd"] >= slow.declined_hits["ssd"] * BT
    # what was declined is computed: fewer tokens saved, and no load time spent on the slow tier
    assert slow.hit_tokens < read_all.hit_tokens
    assert slow.tiers["ssd"]["load_s"] == 0 and read_all.tiers["ssd"]["load_s"] > slow.load_s
    # a fast ssd (10 GB/s) is kept; without a prefill rate nothing is judged
    fast = simulate(reqs, _cfg(), bytes_per_token=BPT, bandwidths={"dram": 1e10, "ssd": 1e10},
                    prefill_tokens_per_s=1e4)
    assert fast.declined_hits == {} and fast.hit_tokens == read_all.hit_tokens
    unjudged = simulate(reqs, _cfg(), bytes_per_token=BPT, bandwidths={"dram": 1e10, "ssd": 1e6})
    assert unjudged.declined_hits == {} and unjudged.hit_tokens == read_all.hit_tokens
    assert json.loads(json.dumps(slow.as_dict()))["declined_hits"] == slow.declined_hits


def test_the_margin_claims_what_loses_little():
    """A hit part that loses less than the margin against its prefill is read: with ssd losing 0.9 ms a token, a
    margin of 50 ms claims parts up to 54 tokens (3 blocks) and declines longer ones."""
    reqs = list(generate("chat", 400, BT, seed=5))
    kw = {"bytes_per_token": BPT, "bandwidths": {"dram": 1e10, "ssd": 1e6}, "prefill_tokens_per_s": 1e4}
    strict = simulate(reqs, _cfg(), decline_margin_s=0.0, **kw)
    default = simulate(reqs, _cfg(), **kw)
    wide = simulate(reqs, _cfg(), decline_margin_s=1e3, **kw)
    assert strict.tiers["ssd"]["hits"] == 0 and strict.declined_hits["ssd"] > 0
    assert wide.declined_hits == {} and wide.tiers["ssd"]["hits"] > 0
    # the default (50 ms) sits between: what it declined lost more than 50 ms each, so over 3 blocks
    assert sum(default.declined_hits.values()) < sum(strict.declined_hits.values())
    assert default.declined_tokens.get("ssd", 0) >= default.declined_hits.get("ssd", 0) * 4 * BT


def test_cli_says_what_it_declined_and_no_decline_reads_every_hit(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    from tierkv.tools.sim import write_trace

    trace = tmp_path / "chat.jsonl"
    write_trace(generate("chat", 300, BT, seed=5), str(trace))
    cfg = tmp_path / "store.json"
    cfg.write_text(json.dumps(_cfg()))
    exe = Path(sys.executable).parent / "tierkv"
    args = [str(exe), "simulate", str(trace), "--config", str(cfg), "--bytes-per-token", str(BPT), "--bandwidth",
            "dram=10GiB", "--bandwidth", "ssd=1MiB", "--prefill-tokens-per-s", "10000", "--decline-margin-ms", "0"]
    r = subprocess.run([*args, "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["declined_hits"]["ssd"] > 0 and out["tiers"]["ssd"]["hits"] == 0
    r = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert (f"declined (tier slower than the prefill): ssd {out['declined_hits']['ssd']} hits "
            f"({out['declined_tokens']['ssd']} tokens)") in r.stdout
    r = subprocess.run([*args, "--json", "--no-decline"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    every = json.loads(r.stdout)
    assert every["declined_hits"] == {} and every["tiers"]["ssd"]["hits"] > 0
    r = subprocess.run([*args[:-2], "--decline-margin-ms", "-5"], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "--decline-margin-ms must be 0 or more" in r.stderr and "Traceback" not in r.stderr
