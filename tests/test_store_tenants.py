"""Tenant quotas in a real store: a flood never takes a tenant below its share, a cap is never exceeded,
usage and hits per tenant are exact, and a store with no tenants is unchanged (``tierkv.tenants``)."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from tierkv import ConfigError, TieredStore, chunk_keys

CHUNK = 4096  # a multiple of the slab's alignment: footprints are exact, capacities count chunks
POLICIES = ["lru", "lfu", "fifo", "s3fifo", "arc"]


def chunk(i: int) -> torch.Tensor:
    return torch.full((CHUNK,), i % 251, dtype=torch.uint8)


def keys(n: int, ns: str) -> list[str]:
    return chunk_keys(list(range(n * 8)), chunk_tokens=8, namespace=ns)


def store(tenants, policy="lru", hbm=8, dram=8):
    return TieredStore.from_config({
        "tiers": [{"medium": "hbm", "device": "cpu", "capacity": hbm * CHUNK, "eviction": policy},
                  {"medium": "dram", "capacity": dram * CHUNK, "eviction": policy}],
        "promotion": {"policy": "never"},
        "tenants": tenants,
    })


def used(s, tenant, tier):
    return s.stats()["tenants"][tenant]["tiers"][tier]["used_bytes"]


@pytest.mark.parametrize("policy", POLICIES)
def test_a_flood_by_one_tenant_leaves_the_others_share_in_place(policy):
    # alice is guaranteed half of each tier; she stores 4 chunks, then bob puts 200 of his
    with store({"alice": {"hbm": {"share": 0.5}, "dram": {"share": 0.5}}}, policy) as s:
        mine = keys(4, "alice")
        assert all(s.put(mine, [chunk(i) for i in range(4)], tenant="alice"))
        flood = keys(200, "bob")
        for at in range(0, 200, 7):
            s.put(flood[at:at + 7], [chunk(i) for i in range(at, min(at + 7, 200))], tenant="bob")
        assert s.locate(mine) == ["hbm"] * 4  # -> alice's chunks never left the fast tier
        outs = [torch.empty(CHUNK, dtype=torch.uint8) for _ in mine]
        assert all(s.get(mine, outs)) and all(bool((o == i % 251).all()) for i, o in enumerate(outs))
        assert used(s, "alice", "hbm") == 4 * CHUNK
        assert used(s, "other", "hbm") == 4 * CHUNK  # (bob is no configured tenant: "other")
        assert s.stats()["hbm"]["evictions"] > 0


@pytest.mark.parametrize("policy", POLICIES)
def test_a_tenant_under_its_share_loses_chunks_to_its_own_puts(policy):
    # alice's share is 4 of 8 chunks of hbm; her own flood turns over her own chunks
    with store({"alice": {"hbm": {"share": 0.5}}}, policy) as s:
        bob = keys(4, "bob")
        s.put(bob, [chunk(i) for i in range(4)], tenant="bob")
        mine = keys(40, "alice")
        for at in range(0, 40, 3):
            s.put(mine[at:at + 3], [chunk(i) for i in range(at, min(at + 3, 40))], tenant="alice")
        assert used(s, "alice", "hbm") <= 8 * CHUNK
        assert s.stats()["hbm"]["used_bytes"] <= 8 * CHUNK


@pytest.mark.parametrize("policy", POLICIES)
def test_a_cap_is_never_exceeded_and_makes_room_among_the_tenants_own(policy):
    with store({"alice": {"hbm": {"cap_bytes": 2 * CHUNK}}}, policy) as s:
        bob = keys(6, "bob")
        s.put(bob, [chunk(i) for i in range(6)], tenant="bob")
        mine = keys(10, "alice")
        for i, k in enumerate(mine):
            assert s.put([k], [chunk(i)], tenant="alice") == [True]
            assert used(s, "alice", "hbm") <= 2 * CHUNK
        assert s.locate(bob) == ["hbm"] * 6  # -> alice at her cap took none of bob's room
        assert used(s, "alice", "hbm") == 2 * CHUNK
        assert used(s, "alice", "dram") == 8 * CHUNK  # (the rest were demoted: dram has no cap for her)


def test_aput_files_the_chunks_under_its_tenant():
    with store({"alice": {"hbm": {"share": 0.5}}}) as s:
        mine = keys(2, "alice")
        assert asyncio.run(s.aput(mine, [chunk(0), chunk(1)], tenant="alice")) == [True, True]
        assert used(s, "alice", "hbm") == 2 * CHUNK
        assert used(s, "other", "hbm") == 0


def test_a_chunk_larger_than_the_tenants_cap_is_refused_there():
    with store({"alice": {"hbm": {"cap_bytes": CHUNK // 2}}}) as s:
        k = keys(1, "alice")
        assert s.put(k, [chunk(0)], tenant="alice") == [True]
        assert s.locate(k) == ["dram"]
        assert s.stats()["hbm"]["rejected"] == 1


def test_usage_and_hits_per_tenant_are_exact():
    with store({"alice": {"hbm": {"share": 0.25}}, "bob": {"dram": {"cap_bytes": "16KiB"}}}) as s:
        a, b, c = keys(2, "a"), keys(3, "b"), keys(1, "c")
        s.put(a, [chunk(0)] * 2, tenant="alice")
        s.put(b, [chunk(0)] * 3, tenant="bob")
        s.put(c, [chunk(0)], tenant="carol")  # (not configured: "other")
        s.put(keys(1, "d"), [chunk(0)])  # (no tenant: "other")
        out = [torch.empty(CHUNK, dtype=torch.uint8)]
        for k in a + a + b[:1]:
            assert s.get([k], out) == [True]
        t = s.stats()["tenants"]
        assert list(t) == ["alice", "bob", "other"]
        assert t["alice"] == {"used_bytes": 2 * CHUNK, "hits": 4, "tiers": {
            "hbm": {"used_bytes": 2 * CHUNK, "hits": 4, "cap_bytes": None, "guaranteed_bytes": 2 * CHUNK},
            "dram": {"used_bytes": 0, "hits": 0, "cap_bytes": None, "guaranteed_bytes": None}}}
        assert t["bob"]["used_bytes"] == 3 * CHUNK and t["bob"]["hits"] == 1
        assert t["bob"]["tiers"]["dram"]["cap_bytes"] == 16 * 1024
        assert t["other"]["used_bytes"] == 2 * CHUNK
        s.remove(a)
        assert s.stats()["tenants"]["alice"]["used_bytes"] == 0


@pytest.mark.parametrize("seed", range(4))
def test_random_puts_by_three_tenants_keep_every_share_and_cap(seed):
    rng = random.Random(seed)
    policy = POLICIES[seed % len(POLICIES)]
    tenants = {"a": {"hbm": {"share": 0.25}, "dram": {"share": 0.5}},
               "b": {"hbm": {"share": 0.25}, "dram": {"cap_bytes": 3 * CHUNK}},
               "c": {"hbm": {"cap_bytes": 2 * CHUNK}}}
    guaranteed = {("a", "hbm"): 2 * CHUNK, ("b", "hbm"): 2 * CHUNK, ("a", "dram"): 4 * CHUNK}
    with store(tenants, policy) as s:
        pool = {t: keys(30, t) for t in ("a", "b", "c", "x")}
        for step in range(300):
            who = rng.choice(["a", "b", "c", "x"])
            batch = rng.sample(pool[who], rng.randint(1, 4))
            before = {(t, tier): used(s, t, tier) for t in ("a", "b") for tier in ("hbm", "dram")}
            s.put(batch, [chunk(step)] * len(batch), tenant=None if who == "x" else who)
            st = s.stats()
            for tier in ("hbm", "dram"):
                per = [st["tenants"][t]["tiers"][tier]["used_bytes"] for t in ("a", "b", "c", "other")]
                assert sum(per) == st[tier]["used_bytes"] <= 8 * CHUNK
            assert used(s, "c", "hbm") <= 2 * CHUNK and used(s, "b", "dram") <= 3 * CHUNK
            for (t, tier), floor in guaranteed.items():
                if t != who:  # another tenant's put never takes it below its share
                    assert used(s, t, tier) >= min(before[(t, tier)], floor), (step, who, t, tier)


def test_a_store_without_tenants_is_unchanged():
    with store(None) as s:
        k = keys(2, "n")
        assert s.put(k, [chunk(0)] * 2, tenant="alice") == [True, True]
        assert "tenants" not in s.stats()
        assert all(lvl.ledger is None for lvl in s.levels)


@pytest.mark.parametrize("tenants, words", [
    ({"alice": {"ssd": {"share": 0.5}}}, "unknown tier 'ssd'"),
    ({"alice": {"hbm": {"share": 0.7}}, "bob": {"hbm": {"share": 0.7}}}, "sum to 1.4"),
    ({"alice": {"hbm": {"cap_bytes": "big"}}}, "tenants.alice.hbm.cap_bytes"),
    ({"alice": {"hbm": {"limit": 1}}}, "unknown key(s) ['limit']"),
])
def test_bad_tenant_config_is_a_config_error_naming_it(tenants, words):
    with pytest.raises(ConfigError) as e:
        store(tenants)
    assert words in str(e.value)


def test_put_refuses_a_tenant_that_is_no_string():
    with store({"alice": {"hbm": {"share": 0.5}}}) as s, pytest.raises(TypeError, match="tenant"):
        s.put(keys(1, "a"), [chunk(0)], tenant=3)


def test_concurrent_floods_keep_each_share_and_exact_usage():
    import threading

    with store({"alice": {"hbm": {"share": 0.5}}, "bob": {"hbm": {"share": 0.25}}}, hbm=8, dram=4) as s:
        seed = {t: keys(2, t + "-seed") for t in ("alice", "bob")}
        for t, ks in seed.items():
            assert all(s.put(ks, [chunk(0)] * 2, tenant=t))
        errors = []

        def flood(tenant):
            try:
                for at, k in enumerate(keys(120, tenant)):
                    s.put([k], [chunk(at)], tenant=tenant)
            except Exception as e:  # (reported by the test)
                errors.append(e)

        threads = [threading.Thread(target=flood, args=(t,)) for t in ("carol", "dave", "alice")]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert not errors
        st = s.stats()
        assert s.locate(seed["bob"]) == ["hbm"] * 2  # -> bob, under his share, lost nothing to the others
        for tier in ("hbm", "dram"):
            assert sum(st["tenants"][t]["tiers"][tier]["used_bytes"] for t in ("alice", "bob", "other")) \
                == st[tier]["used_bytes"]
        assert used(s, "alice", "hbm") >= 4 * CHUNK
