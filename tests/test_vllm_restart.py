"""A restarted engine is warm: vLLM on ``dram -> ssd`` (SSD write-behind), engine 2 in a new process.

Engine 1 stores every block through the connector; everything fits in DRAM, so
nothing is ever evicted: the SSD holds the prefix only because a persistent tier
receives every chunk it admits (write-behind) and the engine's shutdown drains
that queue.  Engine 2, a new process over the same SSD directory, hits the whole
stored prefix with identical greedy outputs.
"""

from __future__ import annotations

import random

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

import vllm_util as U

BS = 32


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    head = [rng.randrange(1024) for _ in range(130)]
    return [head + [rng.randrange(1024) for _ in range(n)] for n in (40, 75)] + \
        [[rng.randrange(1024) for _ in range(99)]]


def _store(path) -> dict:
    return {"tiers": [{"medium": "dram", "capacity": "64MiB"},
                      {"medium": "ssd", "path": str(path), "capacity": "512MiB"}]}


def test_restarted_engine_hits_the_prefix_its_predecessor_stored(tmp_path):
    model = U.make_tiny_model(tmp_path / "model", layers=2)
    prompts = _prompts()
    cache = tmp_path / "cache"
    base = U.run_engine({"model": model, "kv_transfer_config": None,
                         "steps": [{"op": "generate", "prompts": prompts, "one_by_one": True}]}, cache)
    expected = base["steps"][0]["tokens"]
    ssd = tmp_path / "ssd"
    one = U.run_engine({"model": model, "kv_transfer_config": U.connector_config(_store(ssd)),
                        "steps": [{"op": "generate", "prompts": prompts, "one_by_one": True}]}, cache)
    assert one["steps"][0]["tokens"] == expected
    two = U.run_engine({"model": model, "kv_transfer_config": U.connector_config(_store(ssd)),
                        "steps": [{"op": "generate", "prompts": prompts, "one_by_one": True}]}, cache)
    gen = two["steps"][0]
    assert gen["tokens"] == expected
    # every full block of every prompt (less the block holding the last token) came from the SSD
    assert gen["num_cached_tokens"] == [(len(p) - 1) // BS * BS for p in prompts]


def test_connector_trace_path_captures_hash_only_request_traces(tmp_path):
    """Option trace_path: one record per request in Mooncake's format, replayable by the simulator."""
    import json

    from tierkv.tools.sim.traces import read_trace

    model = U.make_tiny_model(tmp_path / "model", layers=2)
    prompts = _prompts()
    trace = tmp_path / "trace" / "requests.jsonl"
    cfg = U.connector_config({"tiers": [{"medium": "dram", "capacity": "64MiB"}]},
                             extra={"trace_path": str(trace), "trace_max_files": 3})
    U.run_engine({"model": model, "kv_transfer_config": cfg,
                  "steps": [{"op": "generate", "prompts": prompts, "one_by_one": True}]}, tmp_path / "cache")
    lines = [json.loads(x) for x in trace.read_text().splitlines() if x.strip()]
    records = [r for r in lines if "hash_ids" in r]
    assert len(records) == len(prompts)
    assert [len(r["hash_ids"]) for r in records] == [len(p) // BS for p in prompts]
    assert records[0]["hash_ids"][:4] == records[1]["hash_ids"][:4]  # the shared 130-token head
    text = trace.read_text()
    assert all(str(t) not in text.split() for t in prompts[2][:5])  # no token ids in the file
    assert len(list(read_trace(str(trace)))) == len(prompts)
