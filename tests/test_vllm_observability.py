"""The vLLM-side pieces: request traces at lookup time and tierkv's metrics through vLLM's Prometheus hooks."""

from __future__ import annotations

import types

import pytest
import torch

from tierkv import TieredStore
from tierkv.adapters.vllm.prom import attach_store_snapshot, merge_store_snapshots, watch_store
from tierkv.adapters.vllm.trace_hook import RequestTracer
from tierkv.errors import ConfigError
from tierkv.sim import read_trace


def fake_request(rid, hashes, n_prompt, max_tokens=16):
    return types.SimpleNamespace(request_id=rid, block_hashes=hashes, num_prompt_tokens=n_prompt,
                                 max_tokens=max_tokens)


def test_request_tracer_records_each_request_once(tmp_path):
    assert RequestTracer.from_extra_config({"tierkv": {}}, 16) is None
    with pytest.raises(ConfigError, match="trace_max_files"):
        RequestTracer.from_extra_config({"trace_path": str(tmp_path / "t"), "trace_max_files": "8"}, 16)
    tr = RequestTracer.from_extra_config({"trace_path": str(tmp_path / "t.jsonl"), "trace_max_bytes": "1MiB"}, 16)
    h = [bytes([i]) * 32 for i in range(5)]
    tr.on_lookup(fake_request("a", h[:3], 50))
    tr.on_lookup(fake_request("a", h[:3], 50))  # asked again while it waits: one record
    tr.on_lookup(fake_request("b", h, 80, 4))
    tr.on_lookup(fake_request("c", [object()], 10))  # an unreadable hash costs this record, nothing else
    tr.close()
    a, b = list(read_trace(str(tmp_path / "t.jsonl")))
    assert (a.input_length, a.output_length, a.block_tokens, len(a.hash_ids)) == (50, 16, 16, 3)
    assert b.hash_ids[:3] == a.hash_ids and b.output_length == 4
    text = (tmp_path / "t.jsonl").read_text()
    assert h[0].hex() not in text


@pytest.mark.vllm
def test_prom_metrics_through_vllms_hooks():
    pytest.importorskip("vllm")
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    from tierkv.adapters.vllm.prom import build_prom_metrics

    reg = CollectorRegistry()

    def bound(cls):  # vLLM passes its metric classes; these register into a registry of the test's
        class C(cls):
            def __init__(self, *a, **k):
                super().__init__(*a, registry=reg, **k)
        return C

    types_ = {Gauge: bound(Gauge), Counter: bound(Counter), Histogram: bound(Histogram)}
    cfg = types.SimpleNamespace(kv_transfer_config=None)
    prom = build_prom_metrics(cfg, types_, ["model_name", "engine"], {0: ["tiny", "0"]})
    stores = [TieredStore.from_config({"tiers": [{"medium": "dram", "capacity": 4096}]}) for _ in range(2)]
    for s in stores:
        watch_store(s)  # as the connector's worker does
    try:
        x = torch.zeros(1024, dtype=torch.uint8)
        for rank, s in enumerate(stores):
            s.put([f"r{rank}-{i}" for i in range(3)], [x] * 3)
            s.put([f"r{rank}-{i}" for i in range(3, 6)], [x] * 3)  # 4 fit: 2 evictions each
            s.get([f"r{rank}-5"], [x])
        # two workers' interval stats, aggregated as TierKVConnectorStats.aggregate would
        data = {"load_tokens": 64, "load_bytes": 1024, "hit_tokens": {"dram": 64}}
        attach_store_snapshot(data, stores[0], rank=0)
        other = {"load_tokens": 32, "hit_tokens": {"dram": 32}}
        attach_store_snapshot(other, stores[1], rank=1)
        merge_store_snapshots(data, other)
        data["load_tokens"] += other["load_tokens"]
        data["hit_tokens"]["dram"] += other["hit_tokens"]["dram"]
        prom.observe(data, 0)
        text = generate_latest(reg).decode()
        labels = 'engine="0",model_name="tiny"'
        assert f'tierkv_connector_loaded_tokens_total{{{labels}}} 96.0' in text
        assert f'tierkv_connector_hit_tokens_total{{{labels},tier="dram"}} 96.0' in text
        assert f'tierkv_tier_evictions_total{{{labels},tier="dram"}} 4.0' in text
        assert f'tierkv_tier_hits_total{{{labels},tier="dram"}} 2.0' in text
        assert f'tierkv_tier_capacity_bytes{{{labels},tier="dram"}} 8192.0' in text
        # the next interval: counters grow by what the stores did since, gauges stay sums over ranks
        stores[0].get(["r0-5"], [x])
        nxt = {}
        attach_store_snapshot(nxt, stores[0], rank=0)
        prom.observe(nxt, 0)
        text = generate_latest(reg).decode()
        assert f'tierkv_tier_hits_total{{{labels},tier="dram"}} 3.0' in text
        assert f'tierkv_tier_capacity_bytes{{{labels},tier="dram"}} 8192.0' in text
        # every store family rides along: chunks by op and outcome, the store's state, latency per batch
        assert f'tierkv_chunks_total{{{labels},op="put",outcome="stored"}} 12.0' in text
        assert f'tierkv_chunks_total{{{labels},op="get",outcome="hit"}} 3.0' in text
        assert f'tierkv_open{{{labels}}} 1.0' in text
        assert f'tierkv_tier_available{{{labels},tier="dram"}} 1.0' in text
        assert f'tierkv_get_seconds_count{{{labels}}} 3.0' in text  # 2 + 1 gets, timed in the workers
        assert f'tierkv_put_seconds_count{{{labels}}} 4.0' in text
        # a rank whose tier is down makes the engine's tier unavailable (the minimum over ranks)
        snap = {}
        attach_store_snapshot(snap, stores[1], rank=1)
        snap["tierkv_store"]["1"]["tiers"]["dram"]["values"]["available"] = 0.0
        prom.observe(snap, 0)
        text = generate_latest(reg).decode()
        assert f'tierkv_tier_available{{{labels},tier="dram"}} 0.0' in text
        assert f'tierkv_get_seconds_count{{{labels}}} 3.0' in text  # nothing new: nothing added twice
    finally:
        for s in stores:
            s.close()
