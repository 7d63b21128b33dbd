"""dram_pool / remote_npu over a real Mooncake Store (a ``mooncake_master`` on 127.0.0.1)."""

from __future__ import annotations

import uuid

import pytest
import torch
from mooncake_util import MooncakeMaster, missing_reason, shared_mooncake_master  # noqa: F401 (fixture)
from tier_conformance import TierConformance, blob, key

from tierkv.errors import ConfigError, StoreClosedError
from tierkv.store import TieredStore
from tierkv.tiers import medium_class
from tierkv.tiers.base import CORRUPT
from tierkv.tiers.remote.media import DramPoolTier, RemoteNPUTier

pytestmark = [pytest.mark.mooncake, pytest.mark.skipif(missing_reason() is not None, reason=str(missing_reason()))]


def tier_options(cfg: dict) -> dict:
    opts = dict(cfg)
    opts.pop("medium")
    return opts


@pytest.fixture(scope="class")
def class_tiers():
    """Tiers shared by one conformance class: closing a Mooncake client takes ~2 s, so each class makes one
    tier per capacity (the suite's tests use disjoint keys)."""
    made: dict = {}
    yield made
    for t in made.values():
        t.close()


class TestDramPoolConformance(TierConformance):
    @pytest.fixture
    def make_tier(self, class_tiers, shared_mooncake_master):
        def make(cap):
            if cap not in class_tiers:
                cfg = shared_mooncake_master.tier_config(segment="32MiB", capacity=cap, namespace=uuid.uuid4().hex)
                class_tiers[cap] = DramPoolTier.from_config("pool", tier_options(cfg))
            return class_tiers[cap]
        return make


class TestRemoteNPUConformance(TierConformance):
    @pytest.fixture
    def make_tier(self, class_tiers, shared_mooncake_master):
        def make(cap):
            if cap not in class_tiers:
                cfg = shared_mooncake_master.tier_config("remote_npu", segment="32MiB", capacity=cap,
                                                         namespace=uuid.uuid4().hex)
                class_tiers[cap] = RemoteNPUTier.from_config("rnpu", tier_options(cfg))
            return class_tiers[cap]
        return make


@pytest.fixture
def pool(factory, shared_mooncake_master):
    def make(**extra):
        cfg = shared_mooncake_master.tier_config(segment="32MiB", namespace=uuid.uuid4().hex)
        cfg.update(extra)
        return factory(DramPoolTier.from_config("pool", tier_options(cfg)))
    return make


# -- configuration ------------------------------------------------------------------
def test_registry_resolves_the_remote_media():
    assert medium_class("dram_pool") is DramPoolTier
    assert medium_class("remote_npu") is RemoteNPUTier
    assert DramPoolTier.managed is False and RemoteNPUTier.managed is False


@pytest.mark.parametrize("opts, match", [
    ({"master": "127.0.0.1:1", "metadata_server": "http://x/metadata", "bogus": 1}, "unknown option"),
    ({"metadata_server": "http://x/metadata"}, "'master' is required"),
    ({"master": "nohost", "metadata_server": "http://x/metadata"}, "host:port"),
    ({"master": "127.0.0.1:1", "metadata_server": "http://x/metadata", "protocol": "udp"}, "protocol"),
    ({"master": "127.0.0.1:1", "metadata_server": "http://x/metadata", "segment": "1MiB"}, "at least 16MiB"),
    ({"master": "127.0.0.1:1", "metadata_server": "http://x/metadata", "segment": "lots"}, "cannot parse size"),
    ({"master": "127.0.0.1:1", "metadata_server": "http://x/metadata", "timeout": -1}, "timeout"),
    ({"master": "127.0.0.1:1", "metadata_server": "http://x/metadata", "backend": "redis"}, "unknown backend"),
])
def test_bad_config_names_the_problem(opts, match):
    with pytest.raises(ConfigError, match=match):
        DramPoolTier.from_config("pool", dict(opts))


def test_remote_npu_ascend_needs_an_npu_device():
    with pytest.raises(ConfigError, match="npu:N"):
        RemoteNPUTier.from_config("r", {"master": "127.0.0.1:1", "metadata_server": "http://x/metadata",
                                        "protocol": "ascend"})


def test_environment_overrides_the_master(monkeypatch):
    monkeypatch.setenv("TIERKV_MOONCAKE_MASTER", "not-an-address")
    with pytest.raises(ConfigError, match="host:port"):
        DramPoolTier.from_config("pool", {"master": "127.0.0.1:1", "metadata_server": "http://x/metadata"})


def test_unreachable_master_gives_an_unavailable_tier_not_a_hang():
    import time

    t0 = time.monotonic()
    tier = DramPoolTier.from_config("pool", {"master": "127.0.0.1:9", "metadata_server": "http://127.0.0.1:9/m",
                                             "connect_wait": 0.3})
    try:
        assert time.monotonic() - t0 < 3
        assert not tier.available
        assert tier.write([key(1)], [[blob(1, 100)]]) == [False]
        assert tier.read([key(1)], [[torch.zeros(100, dtype=torch.uint8)]]) == [False]
        assert tier.contains([key(1)]) == [False]
        st = tier.extra_stats()
        assert st["available"] is False and st["refused_unavailable"] == 1 and "not reachable" in st["last_error"]
    finally:
        tier.close()


# -- behaviour on a live pool ---------------------------------------------------------
def test_existing_key_counts_as_stored_across_instances(pool):
    a, b = pool(namespace="dedup-ns"), pool(namespace="dedup-ns")
    v = blob(11, 5000)
    assert a.write([key(1, "d")], [[v]]) == [True]
    other = blob(12, 5000)  # same key, other bytes: the pool keeps the first (content-addressed keys)
    assert b.write([key(1, "d")], [[other]]) == [True]
    out = torch.zeros(5000, dtype=torch.uint8)
    assert b.read([key(1, "d")], [[out]]) == [True]
    assert torch.equal(out, v)
    assert a.write([key(2, "d"), key(2, "d")], [[v], [v]]) == [True, True]


def test_two_media_on_one_master_do_not_alias(factory, shared_mooncake_master):
    ns = uuid.uuid4().hex
    dp = factory(DramPoolTier.from_config("p", tier_options(shared_mooncake_master.tier_config(namespace=ns))))
    rn = factory(RemoteNPUTier.from_config("r", tier_options(
        shared_mooncake_master.tier_config("remote_npu", namespace=ns))))
    assert dp.write([key(1, "a")], [[blob(1, 64)]]) == [True]
    assert rn.contains([key(1, "a")]) == [False]


def test_multi_part_write_single_part_read_and_back(pool):
    t = pool()
    layers = [blob(i, 4096) for i in range(8)]  # one part per layer
    assert t.write([key(1, "L")], [layers]) == [True]
    whole = torch.zeros(8 * 4096, dtype=torch.uint8)
    assert t.read([key(1, "L")], [[whole]]) == [True]
    assert torch.equal(whole, torch.cat(layers))
    assert t.write([key(2, "L")], [[whole]]) == [True]
    outs = [torch.zeros(4096, dtype=torch.uint8) for _ in range(8)]
    assert t.read([key(2, "L")], [outs]) == [True]
    assert all(torch.equal(o, v) for o, v in zip(outs, layers))


def test_reads_into_a_larger_buffer_are_misses(pool):
    t = pool()
    t.write([key(1, "g")], [[blob(1, 1000)]])
    got = t.read([key(1, "g")], [[torch.zeros(1001, dtype=torch.uint8)]])
    assert got == [CORRUPT]  # in this node's own segment with another size: not the object asked for


def test_non_uint8_and_strided_views_round_trip(pool):
    t = pool()
    src = torch.randn(64, 33, dtype=torch.float32)
    part = src.reshape(-1).view(torch.uint8)
    assert t.write([key(1, "f")], [[part]]) == [True]
    out = torch.zeros(64 * 33 * 4, dtype=torch.uint8)
    assert t.read([key(1, "f")], [[out]]) == [True]
    assert torch.equal(out.view(torch.float32).reshape(64, 33), src)
    # a part that is a slice in the middle of a larger storage
    big = blob(3, 10_000)
    assert t.write([key(2, "f")], [[big[1234:5678]]]) == [True]
    out2 = torch.zeros(10_000, dtype=torch.uint8)
    assert t.read([key(2, "f")], [[out2[100:100 + 4444]]]) == [True]
    assert torch.equal(out2[100:4544], big[1234:5678])


def test_registrations_are_cached_per_storage_and_bounded(pool):
    t = pool(register_limit="1MiB")
    kv = torch.zeros(4 << 20, dtype=torch.uint8)  # an engine's KV pool: registered once
    assert t.register(kv)
    kv[:4096] = blob(1, 4096)
    for i in range(5):
        assert t.write([key(i, "r")], [[kv[i * 4096:(i + 1) * 4096]]]) == [True]
    after_pool = t.extra_stats()["registered_bytes"]
    assert after_pool >= 4 << 20
    for i in range(10):  # transient buffers: the cache stays under its limit (plus the pinned pool)
        t.write([key(100 + i, "r")], [[blob(i, 300_000)]])
    assert t.extra_stats()["registered_bytes"] <= after_pool + (1 << 20) + 300_000
    out = torch.zeros(4096, dtype=torch.uint8)
    assert t.read([key(0, "r")], [[out]]) == [True] and torch.equal(out, kv[:4096])


def test_empty_object_is_misuse(pool):
    t = pool()
    with pytest.raises(ValueError, match="empty object"):
        t.write([key(1, "e")], [[torch.zeros(0, dtype=torch.uint8)]])


def test_use_after_close_raises_and_close_is_idempotent(pool):
    t = pool()
    t.close()
    t.close()
    with pytest.raises(StoreClosedError):
        t.write([key(1)], [[blob(1, 10)]])
    with pytest.raises(StoreClosedError):
        t.contains([key(1)])


def test_in_a_tiered_store(shared_mooncake_master):
    cfg = {"tiers": [
        {"medium": "hbm", "device": "cpu", "capacity": "1MiB"},
        shared_mooncake_master.tier_config(segment="32MiB", namespace=uuid.uuid4().hex),
    ]}
    with TieredStore.from_config(cfg) as store:
        keys = [f"{i:064x}" for i in range(1, 9)]
        vals = [blob(i, 256 << 10) for i in range(8)]  # 2 MiB total: most go to the pool
        assert store.put(keys, vals) == [True] * 8
        assert store.lookup(keys) == 8
        outs = [torch.zeros(256 << 10, dtype=torch.uint8) for _ in range(8)]
        assert store.get(keys, outs) == [True] * 8
        assert all(torch.equal(o, v) for o, v in zip(outs, vals))
        st = store.stats()["dram_pool"]
        assert st["available"] is True and st["medium"] == "dram_pool" and st["refused"] == 0


# -- reads out of this node's own segment ---------------------------------------------------
def test_objects_in_the_own_segment_are_copied_out_directly(pool):
    t = pool()
    layers = [blob(i, 64 << 10) for i in range(4)]
    assert t.write([key(1, "loc")], [layers]) == [True]
    outs = [torch.zeros(64 << 10, dtype=torch.uint8) for _ in range(4)]  # a multi-part destination
    assert t.read([key(1, "loc")], [outs]) == [True]
    assert all(torch.equal(o, v) for o, v in zip(outs, layers))
    assert t.extra_stats()["local_reads"] == 1
    # a size other than the stored one is still a miss, and is not served locally
    assert t.read([key(1, "loc")], [[torch.zeros(4 * (64 << 10) + 1, dtype=torch.uint8)]]) == [CORRUPT]
    assert t.extra_stats()["local_reads"] == 1


def test_each_object_is_local_to_exactly_one_client(pool):
    """Two clients, two segments: a key read by both is copied locally by the one holding it, and
    fetched through the transfer engine by the other, with the same bytes either way."""
    ns = uuid.uuid4().hex
    a, b = pool(namespace=ns), pool(namespace=ns)
    keys = [key(i, "two") for i in range(12)]
    vals = [blob(100 + i, 40_000 + i) for i in range(12)]
    half = len(keys) // 2
    assert a.write(keys[:half], [[v] for v in vals[:half]]) == [True] * half
    assert b.write(keys[half:], [[v] for v in vals[half:]]) == [True] * half
    for t in (a, b):
        outs = [torch.zeros(v.numel(), dtype=torch.uint8) for v in vals]
        assert t.read(keys, [[o] for o in outs]) == [True] * len(keys)
        assert all(torch.equal(o, v) for o, v in zip(outs, vals))
    assert a.extra_stats()["local_reads"] + b.extra_stats()["local_reads"] == len(keys)


def test_local_reads_can_be_turned_off(pool):
    t = pool(local_reads=False)
    v = blob(5, 100_000)
    assert t.write([key(1, "off")], [[v]]) == [True]
    out = torch.zeros(100_000, dtype=torch.uint8)
    assert t.read([key(1, "off")], [[out]]) == [True] and torch.equal(out, v)
    assert t.extra_stats()["local_reads"] == 0


def test_a_local_copy_past_its_lease_guard_counts_for_nothing(pool):
    t = pool()
    v = blob(6, 10_000)
    assert t.write([key(1, "late")], [[v]]) == [True]
    client = t._session.client
    out = torch.zeros(10_000, dtype=torch.uint8)
    fk = t._full_keys([key(1, "late")])
    assert client.read_local(fk, [[out.data_ptr()]], [[10_000]], 1.0) == [10_000] and torch.equal(out, v)
    assert client.read_local(fk, [[out.data_ptr()]], [[10_000]], -1.0) == [0]  # already too late: a get redoes it


def test_local_reads_option_must_be_a_bool():
    with pytest.raises(ConfigError, match="local_reads"):
        DramPoolTier.from_config("pool", {"master": "127.0.0.1:1", "metadata_server": "http://x/metadata",
                                          "local_reads": "yes"})
