"""Tenants on the exporter and in ``tierkv describe``: per-tenant usage and hits with a ``tenant`` label, bounded
to the configured tenants and ``other``, read back from a real exporter."""

from __future__ import annotations

import pytest
import torch

from tierkv import TieredStore, chunk_keys, metrics
from tierkv.tools import live
from tierkv.tools.cli import describe

CHUNK = 64 << 10


@pytest.fixture
def served():
    store = TieredStore.from_config({
        "tiers": [{"medium": "hbm", "device": "cpu", "capacity": 4 * CHUNK}, {"medium": "dram", "capacity": "4MiB"}],
        "tenants": {"alice": {"hbm": {"share": 0.5}}, "bob": {"dram": {"cap_bytes": "1MiB"}}}})
    vals = [torch.full((CHUNK,), i, dtype=torch.uint8) for i in range(3)]
    a = chunk_keys(list(range(64 * 2)), chunk_tokens=64, namespace="a")
    b = chunk_keys(list(range(64 * 3)), chunk_tokens=64, namespace="b")
    assert all(store.put(a, vals[:2], tenant="alice"))
    assert all(store.put(b, vals, tenant="bob"))
    for n, salt in enumerate(("s1", "s2", "s3")):  # three names not configured: one label, "other"
        assert all(store.put(chunk_keys(list(range(64)), chunk_tokens=64, namespace=salt), vals[:1], tenant=salt))
    assert all(store.get(a, [torch.empty_like(v) for v in vals[:2]]))
    exporter = metrics.serve(store, 0)
    try:
        yield store, exporter
    finally:
        exporter.stop()
        store.close()


def test_the_exporter_has_one_series_per_configured_tenant_and_other(served):
    store, exporter = served
    text = exporter.text()
    used = sorted(line for line in text.splitlines() if line.startswith("tierkv_tenant_used_bytes{"))
    assert len(used) == 6  # 3 labels x 2 tiers, however many names the puts carried
    assert {line.split('tenant="')[1].split('"')[0] for line in used} == {"alice", "bob", "other"}
    st = store.stats()["tenants"]
    assert f'tierkv_tenant_hits_total{{tenant="alice",tier="hbm"}} {float(st["alice"]["tiers"]["hbm"]["hits"])}' \
        in text
    assert st["alice"]["hits"] == 2


def test_describe_shows_each_tenants_usage_and_hits(served):
    store, exporter = served
    st = store.stats()["tenants"]
    for url in (exporter.url, exporter.status_url):
        doc = live.read_store(url)
        rows = {r["tenant"]: r for r in doc["tenants"]}
        assert list(rows) == ["alice", "bob", "other"]
        for label, r in rows.items():
            assert r["used_bytes"] == st[label]["used_bytes"] and r["hits"] == st[label]["hits"]
            assert r["tiers"]["hbm"]["used_bytes"] == st[label]["tiers"]["hbm"]["used_bytes"]
    text = describe.render(live.read_store(exporter.url))
    assert any(line.split()[:1] == ["alice"] for line in text.splitlines())


def test_the_scrape_gives_back_the_tenants_of_the_snapshot(served):
    _, exporter = served
    snap = exporter.collector.current()
    back, _ = live.snapshot_from_text(exporter.text())
    assert back["tenants"] == snap["tenants"]
