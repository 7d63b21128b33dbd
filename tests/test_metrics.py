"""The Prometheus exporter, scraped over HTTP while a store works."""

from __future__ import annotations

import threading
import urllib.error
import urllib.request

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
