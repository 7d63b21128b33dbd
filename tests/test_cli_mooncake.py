"""``tierkv inspect --master`` and ``tierkv bench --suite dram_pool`` against a real mooncake_master."""

from __future__ import annotations

import json

import pytest
import torch
from mooncake_util import mooncake_master  # noqa: F401  (fixture)
from test_cli import tierkv

from tierkv import TieredStore
from tierkv.checksum import TRAILER_BYTES

pytestmark = pytest.mark.mooncake


def test_inspect_a_pool_and_bench_dram_pool(mooncake_master):
    m = mooncake_master
    store = TieredStore.from_config({"tiers": [m.tier_config(segment="64MiB")]})
    try:
        vals = [torch.full((3000 + i,), i, dtype=torch.uint8) for i in range(5)]
        assert all(store.put([f"obj{i}" for i in range(5)], vals))
        r = tierkv("inspect", "--master", m.master, "--metrics-port", m.metrics_port, "--json")
        assert r.returncode == 0, r.stderr
        info = json.loads(r.stdout)
        # (each object: the chunk's bytes and its checksum trailer)
        assert info["objects"] == 5 and info["bytes"] == sum(v.numel() + TRAILER_BYTES for v in vals)
        assert info["by_tag"] == {"dram_pool": {"objects": 5, "bytes": info["bytes"]}}
        r = tierkv("inspect", "--master", m.master, "--metrics-port", m.metrics_port)
        assert r.returncode == 0 and "objects: 5" in r.stdout
    finally:
        store.close()
    r = tierkv("bench", "--suite", "dram_pool", "--master", m.master, "--metadata-server", m.metadata_server,
               "--sizes", "1", "--batch", "4", "--rounds", "2", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    assert not doc["failures"]
    assert all(x["value"] > 0 and x["baseline"] > 0 and x["ratio"] > 0 for x in doc["rows"])
    assert {x["bench"] for x in doc["rows"]} == {"dram_pool put 1 MiB x4", "dram_pool get 1 MiB x4"}
    r = tierkv("inspect", "--master", "127.0.0.1:1", "--metrics-port", "1")
    assert r.returncode == 2 and "cannot list keys" in r.stderr
