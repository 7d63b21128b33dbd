"""The decline rule (adapters/vllm/decline.py): a hit that would load slower than computing it is declined."""

from __future__ import annotations

import pytest

from tierkv.adapters.vllm.decline import Decliner, Rate, Verdict

BS = 16


def _warm(d: Decliner, compute_s_per_token: float = 1e-3, **tiers: float) -> None:
    """Three steps at ``compute_s_per_token`` and three loads per tier at its seconds per token."""
    for n in (64, 128, 256):
        d.observe_step(n, n * compute_s_per_token)
        for tier, spt in tiers.items():
            d.observe_load(tier, n, n * spt)


def test_rate_fits_latency_and_per_unit():
    r = Rate()
    for n in (10, 100, 1000, 50, 500):
        r.add(n, 0.002 + n * 1e-5)
    lat, per = r.fit()
    assert lat == pytest.approx(0.002, rel=1e-6)
    assert per == pytest.approx(1e-5, rel=1e-6)
    assert r.seconds(200) == pytest.approx(0.004, rel=1e-6)


def test_rate_without_spread_is_seconds_over_units():
    r = Rate()
    for _ in range(4):
        r.add(100, 0.5)
    assert r.fit() == (0.0, pytest.approx(0.005))
    r2 = Rate()
    r2.add(100, 1.0, calls=4)  # four calls of 25 units
    assert r2.per_unit() == pytest.approx(0.01)


def test_rate_decays_old_samples():
    r = Rate(decay=0.5)
    r.add(100, 10.0)  # slow
    for _ in range(8):
        r.add(100, 0.1)
    assert r.per_unit() < 0.002  # the slow sample weighs 0.5**8 of a fresh one


def test_rate_ignores_empty_samples():
    r = Rate()
    r.add(0, 1.0)
    r.add(10, -1.0)
    r.add(10, 1.0, calls=0)
    assert r.samples == 0 and r.fit() == (0.0, 0.0)


def test_no_decline_without_evidence():
    d = Decliner(margin_s=0.0)
    assert d.decide(["ssd"] * 4, BS) == Verdict(4)
    # a slow tier, but no compute samples yet: claimed
    for _ in range(3):
        d.observe_load("ssd", 64, 10.0)
    assert d.decide(["ssd"] * 4, BS) == Verdict(4)
    # compute known, a tier with two samples only: claimed
    d2 = Decliner(margin_s=0.0)
    _warm(d2)
    d2.observe_load("ssd", 64, 10.0)
    d2.observe_load("ssd", 64, 10.0)
    assert d2.decide(["ssd"] * 4, BS) == Verdict(4)
    d2.observe_load("ssd", 64, 10.0)
    assert d2.decide(["ssd"] * 4, BS).declined == "ssd"


def test_slow_tier_declined_at_its_first_block_fast_tier_kept():
    d = Decliner(probe_share=0.0, margin_s=0.0)
    _warm(d, 1e-3, dram=1e-5, ssd=1e-2)
    v = d.decide(["dram", "dram", "ssd", "ssd", "dram"], BS)
    assert v == Verdict(2, "ssd", (), 3 * BS)
    assert d.decide(["dram"] * 5, BS) == Verdict(5)
    assert d.decide(["ssd", "dram"], BS) == Verdict(0, "ssd", (), 2 * BS)
    assert d.decide([None, "dram"], BS) == Verdict(2)  # an unknown tier is claimed


def test_bias_keeps_more_hits():
    d = Decliner(probe_share=0.0, margin_s=0.0)
    _warm(d, 1e-3, ssd=2e-3)  # loads at twice the compute time
    assert d.decide(["ssd"] * 4, BS).declined == "ssd"
    d.bias = 3.0
    assert d.decide(["ssd"] * 4, BS) == Verdict(4)


def test_latency_counts_against_short_hits():
    d = Decliner(probe_share=0.0, margin_s=0.0)
    for n in (64, 128, 256):
        d.observe_step(n, n * 1e-3)
        d.observe_load("remote", n, 0.05 + n * 1e-5)  # 50 ms a call, fast after that
    assert d.decide(["remote"] * 2, BS).declined == "remote"  # 32 tokens: 32 ms to compute, 50 to load
    assert d.decide(["remote"] * 16, BS) == Verdict(16)  # 256 tokens: 256 ms to compute, 53 to load


def test_probe_share_paces_probes():
    d = Decliner(probe_share=0.25, margin_s=0.0)
    _warm(d, 1e-3, ssd=1e-2)
    got = [d.decide(["ssd"] * 2, BS) for _ in range(8)]
    assert [v.declined is None for v in got] == [False, False, False, True] * 2
    assert all(v.probed == ("ssd",) for v in got if v.declined is None)
    d0 = Decliner(probe_share=0.0, margin_s=0.0)
    _warm(d0, 1e-3, ssd=1e-2)
    assert all(d0.decide(["ssd"], BS).declined == "ssd" for _ in range(50))
    d1 = Decliner(probe_share=1.0, margin_s=0.0)
    _warm(d1, 1e-3, ssd=1e-2)
    assert d1.decide(["ssd"], BS) == Verdict(1, None, ("ssd",))


def test_slowdown_then_recovery_through_probes():
    d = Decliner(probe_share=0.5, margin_s=0.0)
    _warm(d, 1e-3, dram=1e-5, ssd=1e-4)
    assert d.decide(["ssd"] * 4, BS) == Verdict(4)  # fast: claimed
    d.observe_load("ssd", 64, 2.0)  # one slow load: the next hit is declined
    assert d.decide(["ssd"] * 4, BS).declined == "ssd"
    assert d.decide(["dram"] * 4, BS) == Verdict(4)  # the fast tier is kept
    # the tier recovers: only the probes load from it, and their samples bring it back
    back = None
    for i in range(40):
        v = d.decide(["ssd"] * 4, BS)
        if v.declined is None:
            assert v.probed == ("ssd",)
            d.observe_load("ssd", 64, 64 * 1e-4)
            if not d.slow("ssd", 64):
                back = i
                break
    assert back == 0  # the first probe: one fast load after the slow spell brings the tier back
    assert d.decide(["ssd"] * 4, BS) == Verdict(4)


def test_bad_parameters():
    with pytest.raises(ValueError, match="bias"):
        Decliner(bias=0.0)
    with pytest.raises(ValueError, match="probe_share"):
        Decliner(probe_share=1.5, margin_s=0.0)
    with pytest.raises(ValueError, match="decay"):
        Rate(decay=1.0)
    with pytest.raises(ValueError, match="margin_s"):
        Decliner(margin_s=-0.001)


def test_margin_keeps_a_hit_that_loses_little_and_declines_one_that_loses_more():
    """A part that loads slower than it computes is declined only where it loses more than the margin (50 ms by
    default): below it, timing noise decides and declining would recompute what was there to load."""
    d = Decliner(probe_share=0.0)
    assert d.margin_s == pytest.approx(0.05)
    _warm(d, 1e-4, ssd=3e-4)  # loads at three times the compute time: 0.2 ms a token lost
    assert d.decide(["ssd"] * 4, BS) == Verdict(4)  # 64 tokens: 12.8 ms lost, claimed
    assert d.decide(["ssd"] * 12, BS) == Verdict(12)  # 192 tokens: 38.4 ms lost, claimed
    assert d.decide(["ssd"] * 24, BS).declined == "ssd"  # 384 tokens: 76.8 ms lost: declined
    strict = Decliner(probe_share=0.0, margin_s=0.0)
    _warm(strict, 1e-4, ssd=3e-4)
    assert strict.decide(["ssd"] * 4, BS).declined == "ssd"


@pytest.mark.vllm
def test_book_counts_verdicts_and_reads_the_workers_stats():
    from tierkv.adapters.vllm.connector_stats import TierKVConnectorStats, add_tier_load
    from tierkv.adapters.vllm.decline import DeclineBook

    totals: dict[str, dict[str, int]] = {"declined_slow": {}, "declined_slow_tokens": {}, "decline_probes": {}}
    book = DeclineBook(Decliner(probe_share=0.5, margin_s=0.0), totals)
    for n in (64, 128, 256):
        stats = TierKVConnectorStats()
        stats.data.update(steps=1, step_tokens=n, step_s=n * 1e-3)
        add_tier_load(stats.data, "ssd", n, n * 1e-2, 1)
        # two workers' stats of one step, aggregated as vLLM does: the rates are unchanged
        book.observe(stats.aggregate(TierKVConnectorStats.from_payload(dict(stats.data))))
    assert book.decliner.tiers["ssd"].samples == 3 and book.decliner.compute.samples == 3
    v1 = book.decliner.decide(["ssd"] * 2, BS)
    v2 = book.decliner.decide(["ssd"] * 2, BS)
    assert v1 == Verdict(0, "ssd", (), 2 * BS) and v2 == Verdict(2, None, ("ssd",))
    book.count(v1)
    book.count(v2)
    assert totals == {"declined_slow": {"ssd": 1}, "declined_slow_tokens": {"ssd": 2 * BS},
                      "decline_probes": {"ssd": 1}}
    interval = book.take()
    assert interval == totals and book.take() == {}
    # as connector stats: aggregated by tier, reduced under their tier's name
    s = TierKVConnectorStats()
    s.data.update(interval)
    assert not s.is_empty()
    s.aggregate(TierKVConnectorStats.from_payload(interval))
    red = s.reduce()
    assert red["declined_slow[ssd]"] == 2 and red["declined_slow_tokens[ssd]"] == 4 * BS
    assert red["decline_probes[ssd]"] == 2
    book.observe(None)  # nothing from the workers this step
    book.observe({"tier_loads": {}})


def test_decline_options_are_checked():
    from tierkv.adapters.vllm.config import parse_options
    from tierkv.errors import ConfigError

    o = parse_options({})
    assert (o.decline_slow_hits, o.decline_bias, o.decline_probe_share, o.decline_margin_ms) == (True, 1.0, 1.0 / 16,
                                                                                                50.0)
    o = parse_options({"decline_slow_hits": False, "decline_bias": 2, "decline_probe_share": 0,
                       "decline_margin_ms": 0})
    assert (o.decline_slow_hits, o.decline_bias, o.decline_probe_share, o.decline_margin_ms) == (False, 2.0, 0.0, 0.0)
    for extra, name in (({"decline_slow_hits": "yes"}, "decline_slow_hits"),
                        ({"decline_bias": 0}, "decline_bias"), ({"decline_bias": -1.0}, "decline_bias"),
                        ({"decline_bias": "2"}, "decline_bias"),
                        ({"decline_probe_share": 1.5}, "decline_probe_share"),
                        ({"decline_margin_ms": -1}, "decline_margin_ms"),
                        ({"decline_margin_ms": "50"}, "decline_margin_ms"),
                        ({"decline_probe_share": True}, "decline_probe_share"),
                        ({"decline_probe_share": -0.1}, "decline_probe_share")):
        with pytest.raises(ConfigError, match=name):
            parse_options(extra)


@pytest.mark.vllm
def test_worker_counters_report_steps_and_loads_by_tier():
    from tierkv.adapters.vllm.accounting import WorkerCounters
    from tierkv.adapters.vllm.load_mode import LoadMode
    from tierkv.adapters.vllm.loading import LoadJob

    c = WorkerCounters()
    c.add_step(100, 0.5)
    alone = c.take_interval(False)  # a step's timing goes every step, but alone is no news (no snapshot)
    assert alone is not None and alone.data["steps"] == 1 and alone.is_empty()
    assert c.take_interval(False) is None
    c.add_step(100, 0.5)
    job = LoadJob.new(1)
    job.end[0] = job.submit_t + 0.3
    job.per_req["r"] = {"tokens": 48, "bytes": 0, "hit_tokens": {}}
    job.count_hits("r", "dram", 16)
    job.count_hits("r", "ssd", 32)
    c.add_load(job, LoadMode.ASYNC)
    d = c.take_interval(False).data
    assert (d["steps"], d["step_tokens"], d["step_s"]) == (1, 100, 0.5)
    assert d["tier_loads"]["dram"] == [16, pytest.approx(0.1), 1]
    assert d["tier_loads"]["ssd"] == [32, pytest.approx(0.2), 1]
    # a job with a failed block says nothing about its tiers' speed
    bad = LoadJob.new(1)
    bad.end[0] = bad.submit_t + 0.3
    bad.per_req["r"] = {"tokens": 16, "bytes": 0, "hit_tokens": {}}
    bad.count_hits("r", "ssd", 16)
    bad.failed_blocks.add(7)
    c.add_load(bad, LoadMode.ASYNC)
    assert "tier_loads" not in c.take_interval(False).data


@pytest.mark.vllm
def test_declines_on_prometheus():
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    from tierkv.adapters.vllm.prom import build_prom_metrics

    reg = CollectorRegistry()

    def bound(cls):
        class C(cls):
            def __init__(self, *a, **k):
                super().__init__(*a, registry=reg, **k)
        return C

    import types

    prom = build_prom_metrics(types.SimpleNamespace(kv_transfer_config=None),
                              {Gauge: bound(Gauge), Counter: bound(Counter), Histogram: bound(Histogram)},
                              ["model_name", "engine"], {0: ["tiny", "0"]})
    prom.observe({"declined_slow": {"ssd": 2}, "declined_slow_tokens": {"ssd": 512}, "decline_probes": {"ssd": 1}})
    prom.observe({"declined_slow": {"ssd": 1}})
    text = generate_latest(reg).decode()
    labels = 'engine="0",model_name="tiny",tier="ssd"'
    assert f"tierkv_connector_declined_slow_total{{{labels}}} 3.0" in text
    assert f"tierkv_connector_declined_slow_tokens_total{{{labels}}} 512.0" in text
    assert f"tierkv_connector_decline_probes_total{{{labels}}} 1.0" in text

    # tierkv describe on that endpoint: the declines by tier, beside the store
    from tierkv import TieredStore
    from tierkv.adapters.vllm.prom import attach_store_snapshot
    from tierkv.tools.cli.describe import render
    from tierkv.tools.live import describe_store, snapshot_from_text

    store = TieredStore.from_config({"tiers": [{"medium": "dram", "capacity": 4096}]})
    try:
        data = {"hit_tokens": {"dram": 64}}
        attach_store_snapshot(data, store, 0)
        prom.observe(data)
    finally:
        store.close()
    text = generate_latest(reg).decode()
    # every tier of the store shows its series from its first snapshot on, at 0 too
    assert 'tierkv_connector_declined_slow_total{engine="0",model_name="tiny",tier="dram"} 0.0' in text
    snap, extras = snapshot_from_text(text)
    assert extras["connector"]["declined_slow"] == {"ssd": 3.0, "dram": 0.0}
    assert extras["connector"]["hit_tokens"] == {"dram": 64.0}
    doc = describe_store(snap, "http://x/metrics", extras)
    out = render(doc)
    assert "declined (tier slower than computing): ssd 3 hits (512 tokens), 1 probes\n" in out, out


def test_decode_steps_are_no_compute_samples():
    d = Decliner(margin_s=0.0)
    for _ in range(10):
        d.observe_step(4, 0.5)  # decodes: fixed costs, no prefill rate
    assert d.compute.samples == 0 and d.compute_seconds(512) is None
    d.observe_step(2 * 64, 2 * 0.064, steps=2)  # two steps of 64 tokens (tensor-parallel ranks, aggregated)
    assert d.compute.samples == 1


def test_one_fast_sample_among_slow_ones_does_not_hide_a_slow_fit_forever():
    d = Decliner(probe_share=0.0, margin_s=0.0)
    _warm(d, 1e-3, ssd=1e-2)
    d.observe_load("ssd", 64, 64 * 1e-5)  # one fast load: the tier is claimed again
    assert d.decide(["ssd"] * 4, BS) == Verdict(4)
    d.observe_load("ssd", 64, 64 * 1e-2)  # and the next slow one declines it again
    assert d.decide(["ssd"] * 4, BS).declined == "ssd"
