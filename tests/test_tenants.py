"""Tenant quotas: the config and the per-tier ledger's rules (``tierkv.tenants``)."""

import random

import pytest

from tierkv.errors import ConfigError
from tierkv.tenants import OTHER, TenantLedger, TierQuota, parse_tenants

TIERS = ("hbm", "dram", "pool")
MANAGED = ("hbm", "dram")


def parse(raw):
    return parse_tenants(raw, TIERS, MANAGED)


def test_config_reads_caps_with_units_and_shares():
    t = parse({"alice": {"dram": {"cap_bytes": "1KiB"}}, "bob": {"dram": {"share": 0.5}, "hbm": {"share": 1}}})
    assert t.names == ("alice", "bob")
    assert t.labels() == ("alice", "bob", OTHER)
    assert t.of_tier("dram") == {"alice": TierQuota(cap_bytes=1024), "bob": TierQuota(share=0.5)}
    assert t.of_tier("hbm") == {"bob": TierQuota(share=1.0)}
    assert t.label("alice") == "alice" and t.label("carol") == OTHER and t.label(None) == OTHER


@pytest.mark.parametrize("raw, words", [
    ([], "tenants"),
    ({}, "tenants"),
    ({"other": {"dram": {"share": 0.1}}}, "reserved"),
    ({"a": {"ssd": {"share": 0.1}}}, "unknown tier 'ssd'"),
    ({"a": {"pool": {"share": 0.1}}}, "shared pool"),
    ({"a": {"dram": {"cap": 5}}}, "unknown key(s) ['cap']"),
    ({"a": {"dram": {"cap_bytes": 5, "share": 0.5}}}, "exactly one"),
    ({"a": {"dram": {"cap_bytes": "lots"}}}, "tenants.a.dram.cap_bytes"),
    ({"a": {"dram": {"cap_bytes": 0}}}, "positive"),
    ({"a": {"dram": {"share": 0}}}, "tenants.a.dram.share"),
    ({"a": {"dram": {"share": 1.5}}}, "at most 1"),
    ({"a": {"dram": {"share": "half"}}}, "expected a number"),
    ({"a": {"dram": {"share": 0.6}}, "b": {"dram": {"share": 0.6}}}, "sum to 1.2"),
    ({"a": {}}, "tenants.a"),
])
def test_config_errors_name_the_problem(raw, words):
    with pytest.raises(ConfigError, match=None) as e:
        parse(raw)
    assert words in str(e.value)


def test_usage_follows_charges_and_credits_exactly():
    ledger = TenantLedger("dram", 1000, parse({"alice": {"dram": {"share": 0.5}}}))
    ledger.charge("k1", "alice", 100)
    ledger.charge("k2", OTHER, 30)
    ledger.count_hits(["k1", "k1", "k2", "unknown"])
    snap = ledger.snapshot()
    assert snap["alice"] == {"used_bytes": 100, "hits": 2, "cap_bytes": None, "guaranteed_bytes": 500}
    assert snap[OTHER]["used_bytes"] == 30 and snap[OTHER]["hits"] == 2
    ledger.credit("k1", 100)
    ledger.credit("k2", 30)
    assert ledger.usage == {"alice": 0, OTHER: 0}


def test_cap_says_how_much_the_tenant_must_free_of_its_own():
    ledger = TenantLedger("dram", 1000, parse({"alice": {"dram": {"cap_bytes": 250}}}))
    ledger.charge("a1", "alice", 100)
    ledger.charge("a2", "alice", 100)
    assert ledger.over_cap("alice", 50) == 0
    assert ledger.over_cap("alice", 100) == 50
    assert ledger.over_cap(OTHER, 10_000) == 0  # no cap: only the tier's capacity bounds it
    assert ledger.exceeds_cap("alice", 251) and not ledger.exceeds_cap("alice", 250)
    # over its cap, a put may take only its own chunks
    ledger.charge("o1", OTHER, 100)
    assert not ledger.victim_ok("o1", "alice", {}, 100, own_only=True)
    assert ledger.victim_ok("a1", "alice", {}, 100, own_only=True)


def test_a_flood_never_takes_a_tenant_below_its_share():
    # alice holds 6 chunks of 100 in a 1000-byte tier with a 0.4 share: another tenant's put
    # may take 2 of them (down to 400), never a third; alice's own put may take all
    ledger = TenantLedger("dram", 1000, parse({"alice": {"dram": {"share": 0.4}}}))
    for i in range(6):
        ledger.charge(f"a{i}", "alice", 100)
    taken: dict = {}
    ok = [ledger.victim_ok(f"a{i}", OTHER, taken, 100, own_only=False) for i in range(6)]
    assert ok == [True, True, False, False, False, False] and taken == {"alice": 200}
    taken = {}
    assert all(ledger.victim_ok(f"a{i}", "alice", taken, 100, own_only=False) for i in range(6))


def test_random_floods_keep_every_share_and_cap():
    # a model of a tier: random puts by three tenants, LRU order, victims asked of the ledger
    rng = random.Random(7)
    tenants = parse({"a": {"dram": {"share": 0.3}}, "b": {"dram": {"share": 0.3}}, "c": {"dram": {"cap_bytes": 200}}})
    cap = 1000
    ledger = TenantLedger("dram", cap, tenants)
    order: list = []  # (key, label, fp), oldest first
    used = 0
    for n in range(3000):
        label = rng.choice(["a", "b", "c", OTHER, OTHER])
        fp = rng.choice([50, 100])
        own_only = ledger.over_cap(label, fp) > 0
        need_own = ledger.over_cap(label, fp)
        need = max(used + fp - cap, 0)
        taken: dict = {}
        victims, freed, freed_own = [], 0, 0
        for key, lab, f in order:
            if freed >= need and freed_own >= need_own:
                break
            if ledger.victim_ok(key, label, taken, f, own_only=own_only or (freed >= need and lab != label)):
                victims.append((key, lab, f))
                freed += f
                freed_own += f if lab == label else 0
        if freed < need or freed_own < need_own:
            continue  # refused: nothing changes
        for v in victims:
            order.remove(v)
            ledger.credit(v[0], v[2])
            used -= v[2]
        below = {t: ledger.usage[t] < g for t, g in ledger.guaranteed.items()}
        ledger.charge(f"k{n}", label, fp)
        order.append((f"k{n}", label, fp))
        used += fp
        assert used <= cap
        assert ledger.usage["c"] <= 200
        assert sum(ledger.usage.values()) == used
        for t, g in ledger.guaranteed.items():
            if t != label and below[t] is False:
                assert ledger.usage[t] >= g  # another tenant's put never took it below its share
