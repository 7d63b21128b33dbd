"""The Prometheus exporter, scraped over HTTP while a store works."""

from __future__ import annotations

import re
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tierkv import TieredStore
from tierkv.metrics import register, serve


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def tier(name: str, t: str) -> tuple[str, tuple]:
    return (name, (("tier", t),))


@pytest.fixture
def store(tmp_path):
    s = TieredStore.from_config({"tiers": [
        {"medium": "dram", "capacity": 256 * 1024},
        {"medium": "ssd", "path": str(tmp_path / "ssd"), "capacity": "8MiB"}], "shadow": {"rate": 1.0}})
    yield s
    s.close()


def test_scraped_while_the_store_works(store):
    exp = serve(store, 0)
    assert exp.port and exp.port > 0 and str(exp.port) in exp.url
    stop = threading.Event()
    x = torch.arange(8192, dtype=torch.int32).view(torch.uint8)[:16384]
    done = {"puts": 0, "gets": 0}

    def work():
        i = 0
        while not stop.is_set():
            keys = [f"k{(i + j) % 150}" for j in range(4)]
            store.put(keys, [x] * 4)
            store.get(keys[:2], [torch.empty_like(x) for _ in range(2)])
            done["puts"] += 1
            done["gets"] += 1
            i += 3

    t = threading.Thread(target=work)
    t.start()
    try:
        seen = []
        while len(seen) < 5 or done["puts"] < 60:
            seen.append(scrape(exp.url))
    finally:
        stop.set()
        t.join()
    assert store.drain_write_behind(timeout=60)  # (background copies settled: the two snapshots below agree)
    # counters never go down between scrapes taken while the store works
    for name in ("tierkv_tier_hits_total", "tierkv_tier_written_bytes_total", "tierkv_tier_evictions_total"):
        vals = [s[tier(name, "dram")] for s in seen]
        assert vals == sorted(vals) and vals[-1] > vals[0]
    final = scrape(exp.url)
    st = store.stats()
    for t_name in ("dram", "ssd"):
        d = st["tiers"][t_name]
        for metric, field in (("hits_total", "hits"), ("misses_total", "misses"), ("read_bytes_total", "bytes_read"),
                              ("written_bytes_total", "bytes_written"), ("evictions_total", "evictions"),
                              ("demotions_total", "demotions"), ("promotions_total", "promotions"),
                              ("rejected_total", "rejected"), ("errors_total", "errors"),
                              ("used_bytes", "used_bytes"), ("capacity_bytes", "capacity_bytes")):
            assert final[tier(f"tierkv_tier_{metric}", t_name)] == d[field], (t_name, metric)
        assert final[tier("tierkv_tier_available", t_name)] == 1.0
    assert st["tiers"]["dram"]["demotions"] > 0  # the chain was really exercised
    tot = st["total"]
    assert final[("tierkv_hits_total", ())] == tot["hits"]
    assert final[("tierkv_capacity_bytes", ())] == 256 * 1024 + 8 * 2**20
    assert final[("tierkv_calls_total", (("op", "put"),))] == tot["put_calls"]
    # one latency observation per batch
    assert final[("tierkv_get_seconds_count", ())] == tot["get_calls"]
    assert final[("tierkv_put_seconds_count", ())] == tot["put_calls"]
    assert final[("tierkv_put_seconds_sum", ())] > 0
    buckets = sorted((float(dict(k[1])["le"]), v) for k, v in final.items() if k[0] == "tierkv_get_seconds_bucket")
    assert [v for _, v in buckets] == sorted(v for _, v in buckets) and buckets[-1] == (float("inf"), tot["get_calls"])
    # what more capacity would buy, per tier and factor
    sh = st["tiers"]["dram"]["shadow"]["factors"]
    for f in ("0.5", "1", "2", "4"):
        key = ("tierkv_tier_shadow_hit_ratio", (("capacity_factor", f), ("tier", "dram")))
        assert final[key] == pytest.approx(sh[f]["hit_rate"])
        key = ("tierkv_tier_shadow_sampled_chunks", (("capacity_factor", f), ("tier", "dram")))
        assert final[key] == sh[f]["sampled_chunks"]
    assert final[tier("tierkv_tier_shadow_requests_total", "dram")] == st["tiers"]["dram"]["shadow"]["requests"] > 0
    assert final[("tierkv_tier_shadow_hit_ratio", (("capacity_factor", "4"), ("tier", "dram")))] >= \
        final[("tierkv_tier_shadow_hit_ratio", (("capacity_factor", "0.5"), ("tier", "dram")))]
    exp.stop()
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(exp.url, timeout=2)
    exp.close()  # idempotent
    calls = tot["get_calls"]
    assert store.get(["k0"], [torch.empty_like(x)]) in ([True], [False])  # the store goes on without it
    assert store.stats()["total"]["get_calls"] == calls + 1


def test_register_into_an_engines_registry(store):
    reg = CollectorRegistry()
    exp = register(store, reg)
    store.put(["a"], [torch.zeros(100, dtype=torch.uint8)])
    text = generate_latest(reg).decode()
    assert 'tierkv_tier_written_bytes_total{tier="dram"} 100.0' in text
    assert "tierkv_put_seconds_count 1.0" in text
    exp.stop()
    left = generate_latest(reg).decode()
    assert "tierkv_tier_hits_total" not in left and "tierkv_put_seconds" not in left


# ---------------------------------------------------------------------------------------------------------
# the catalogue: every name docs/metrics.md lists, and nothing it does not
# ---------------------------------------------------------------------------------------------------------
DOCS = Path(__file__).resolve().parent.parent / "docs" / "metrics.md"


def documented_metrics() -> dict[str, str]:
    """``{name: type}`` of every row of docs/metrics.md's metric tables."""
    out = {}
    for line in DOCS.read_text().splitlines():
        m = re.match(r"\| `(tierkv_[a-z_]+)` \| (counter|gauge|histogram) \|", line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def sample_names(name: str, kind: str) -> set[str]:
    """The sample names one documented metric shows as (a histogram: its buckets, count and sum)."""
    return {f"{name}_bucket", f"{name}_count", f"{name}_sum"} if kind == "histogram" else {name}


def exported_families(text: str) -> dict[str, str]:
    return {f.name: f.type for f in text_string_to_metric_families(text)}


def busy_store(tmp_path, **extra):
    """A DRAM tier over a small-region SSD tier, with a shadow, after some work of every kind."""
    s = TieredStore.from_config({"tiers": [
        {"medium": "dram", "capacity": 64 * 1024},
        {"medium": "ssd", "path": str(tmp_path / "ssd"), "capacity": "8MiB", "region_size": "1MiB"}],
        "shadow": {"rate": 1.0}, **extra})
    x = torch.ones(16 * 1024, dtype=torch.uint8)
    for i in range(12):
        s.put([f"k{i}", f"k{i + 1}"], [x, x])
        s.get([f"k{i // 2}"], [torch.empty_like(x)])
    s.lookup(["k1", "k2", "nope"])
    s.flush()
    return s


def test_every_documented_metric_is_exported_and_nothing_else(tmp_path):
    docs = documented_metrics()
    assert len(docs) > 40 and docs["tierkv_chunks_total"] == "counter"
    # (with a tenant configured, so the per-tenant families are exported too)
    store = busy_store(tmp_path, tenants={"alice": {"dram": {"share": 0.5}}})
    try:
        with serve(store, 0) as exp:
            text = urllib.request.urlopen(exp.url, timeout=10).read().decode()
    finally:
        store.close()
    seen = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    standalone = {n: k for n, k in docs.items() if not n.startswith("tierkv_connector_")}
    for name, kind in standalone.items():
        assert sample_names(name, kind) <= seen, name
    # and the other way round: no tierkv series the docs do not list
    for fam, kind in exported_families(text).items():
        shown = fam + "_total" if kind == "counter" else fam
        assert shown in standalone and standalone[shown] == kind, fam


def test_chunks_total_counts_each_operation_by_outcome(tmp_path):
    store = TieredStore.from_config({"tiers": [
        {"medium": "ssd", "path": str(tmp_path / "ssd"), "capacity": "8MiB", "region_size": "1MiB"}]})
    small, huge = torch.ones(4096, dtype=torch.uint8), torch.ones(9 << 20, dtype=torch.uint8)
    try:
        exp = register(store, CollectorRegistry())
        # put a, b, c (stored), a again (deduped), one larger than the whole SSD tier (rejected: too large)
        assert store.put(["a", "b", "c"], [small] * 3) == [True] * 3
        assert store.put(["a", "big"], [small, huge]) == [True, False]
        # get: two hits, one miss
        assert store.get(["a", "b", "zz"], [torch.empty_like(small) for _ in range(3)]) == [True, True, False]
        got = {}
        for fam in text_string_to_metric_families(exp.text()):
            for s in fam.samples:
                if s.name == "tierkv_chunks_total":
                    got[(s.labels["op"], s.labels["outcome"])] = s.value
                elif s.name == "tierkv_tier_medium_errors_total" and s.labels["reason"] == "too_large":
                    got["too_large"] = s.value
        assert got == {("put", "stored"): 3, ("put", "deduped"): 1, ("put", "rejected"): 1,
                       ("get", "hit"): 2, ("get", "miss"): 1, "too_large": 1}
        # the outcomes of an operation add up to its chunks
        tot = store.stats()["total"]
        assert sum(v for k, v in got.items() if k[0] == "put") == tot["chunks_put"] == 5
        exp.stop()
    finally:
        store.close()


def test_series_keep_their_final_values_after_close(tmp_path):
    store = busy_store(tmp_path)
    exp = serve(store, 0)
    try:
        before = scrape(exp.url)
        store.get(["k3"], [torch.empty(16 * 1024, dtype=torch.uint8)])
        store.close()  # drains the write-behind queue: the final figures are read after it
        after = scrape(exp.url)
        again = scrape(exp.url)
    finally:
        exp.stop()
    assert before[("tierkv_open", ())] == 1.0 and after[("tierkv_open", ())] == 0.0
    for t in ("dram", "ssd"):
        assert before[tier("tierkv_tier_available", t)] == 1.0
        assert after[tier("tierkv_tier_available", t)] == 0.0
    assert after[("tierkv_calls_total", (("op", "get"),))] == before[("tierkv_calls_total", (("op", "get"),))] + 1
    assert after[("tierkv_get_seconds_count", ())] == before[("tierkv_get_seconds_count", ())] + 1
    assert after[tier("tierkv_tier_capacity_bytes", "ssd")] == 8 * 2**20
    # every series of the open store is still there, and stays put
    assert set(before) <= set(after) and after == again


def test_a_busy_port_leaves_the_store_as_it_was(store):
    import socket

    from tierkv.metrics import LatencyRecorder

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        with pytest.raises(OSError, match=f"127.0.0.1:{port}"):
            serve(store, port)
    assert LatencyRecorder.find(store) is None  # nothing left attached
    with serve(store, 0) as exp:
        assert LatencyRecorder.find(store) is not None
        assert ("tierkv_open", ()) in scrape(exp.url)
    assert LatencyRecorder.find(store) is None


@pytest.mark.parametrize("port, addr", [(-1, "127.0.0.1"), (70000, "127.0.0.1"), ("abc", "127.0.0.1"),
                                        (1.5, "127.0.0.1"), (None, "127.0.0.1"), (True, "127.0.0.1"),
                                        (0, None)])
def test_a_bad_port_or_address_is_a_clear_error_that_leaves_the_store_as_it_was(store, port, addr):
    from tierkv.errors import ConfigError
    from tierkv.metrics import LatencyRecorder

    with pytest.raises(ConfigError, match="tierkv.metrics: (port|addr)"):
        serve(store, port, addr)
    assert LatencyRecorder.find(store) is None


def test_write_behind_queue_depth_and_drops_are_exported(tmp_path):
    store = busy_store(tmp_path)
    try:
        exp = register(store, CollectorRegistry())
        text = exp.text()
        tot = store.stats()["total"]
        assert tot["write_behind_queued"] > 0
        assert f"tierkv_write_behind_queued_total {float(tot['write_behind_queued'])}" in text
        assert 'tierkv_write_behind_dropped_total{reason="queue_full"} 0.0' in text
        assert "tierkv_write_behind_pending 0.0" in text  # flushed
        exp.stop()
    finally:
        store.close()
