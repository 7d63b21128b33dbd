"""Engine-free parts of the vLLM connector: paged layouts, shards, namespaces, config."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch

from tierkv import TieredStore, keys_from_block_hashes
from tierkv.adapters.vllm.config import (
    DEFAULT_STORE_CONFIG,
    ConnectorOptions,
    base_namespace,
    block_hash_bytes,
    kv_shard,
    layer_namespace,
    parse_options,
    shard_from_replicas,
    store_config_from_extra,
)
from tierkv.adapters.vllm.paged import Cuts, PagedLayer, find_block_dim
from tierkv.errors import ConfigError
from tierkv.stores import StoreRegistry


# ---------------------------------------------------------------- paged layouts
def test_cpu_layout_block_is_one_contiguous_part():
    nb, heads, bs, hd = 6, 2, 32, 16
    t = torch.arange(nb * heads * bs * 2 * hd, dtype=torch.float32).reshape(nb, heads, bs, 2 * hd)
    p = PagedLayer.wrap(t, nb, bs)
    assert (p.block_dim, p.kernel_blocks_per_block) == (0, 1)
    (part,) = p.parts(4)
    assert part.is_contiguous() and part.data_ptr() == t[4].data_ptr()
    assert p.block_nbytes == heads * bs * 2 * hd * 4
    assert p.is_direct()


def test_kv_first_layout_moves_k_and_v_pages():
    nb, bs, heads, hd = 5, 16, 2, 8
    t = torch.randn(2, nb, bs, heads, hd)
    p = PagedLayer.wrap(t, nb, bs)
    assert p.block_dim == 1 and p.num_parts == 2
    k, v = p.parts(3)
    assert torch.equal(k[0], t[0, 3]) and torch.equal(v[0], t[1, 3])
    assert p.block_nbytes == 2 * bs * heads * hd * 4


def test_kernel_block_split_and_roundtrip_between_layouts():
    nb, r, kbs, heads, hd = 4, 2, 16, 2, 8  # engine block of 32 tokens = 2 kernel blocks of 16
    src = torch.randn(2, nb * r, kbs, heads, hd)
    p = PagedLayer.wrap(src, nb, 32)
    assert (p.block_dim, p.kernel_blocks_per_block) == (1, 2)
    dst = torch.zeros_like(src)
    q = PagedLayer.wrap(dst, nb, 32)
    bufs, pending = q.write_targets(2)
    for b, s in zip(bufs, p.read_parts(2)):
        b.copy_(s)
    for stage, d in pending:
        d.copy_(stage)
    assert torch.equal(dst[:, 4:6], src[:, 4:6])
    assert dst[:, :4].abs().sum() == 0 and dst[:, 6:].abs().sum() == 0


def test_strided_layer_view_is_staged_not_lost():
    # several layers interleaved per block: a layer's view is strided over blocks
    nb, layers, page = 3, 2, 64
    base = torch.zeros(nb, layers, page)
    view = base[:, 1]
    p = PagedLayer.wrap(view, nb)
    bufs, pending = p.write_targets(1)
    for b in bufs:
        b.fill_(7.0)
    for stage, d in pending:
        d.copy_(stage)
    assert torch.all(base[1, 1] == 7.0) and base[1, 0].abs().sum() == 0 and base[0].abs().sum() == 0


def test_find_block_dim():
    assert find_block_dim((6, 2, 32, 32), 6) == (0, 1)  # CPU layout: blocks outermost
    assert find_block_dim((2, 6, 32, 2, 16), 6) == (1, 1)  # K/V first: past the leading 2
    assert find_block_dim((2, 12, 16, 2, 8), 6, 32) == (1, 2)  # 2 kernel blocks per engine block
    with pytest.raises(ValueError, match="num_blocks=4"):
        find_block_dim((7, 3, 5), 4)


# ---------------------------------------------------------------- shards
def test_kv_shards():
    # each rank its own heads
    assert [kv_shard(r, 4, 8).shard for r in range(4)] == [0, 1, 2, 3]
    assert {kv_shard(r, 4, 8).replicas for r in range(4)} == {1}
    # more ranks than KV heads: consecutive ranks hold the same head and split the writes
    s = [kv_shard(r, 8, 2) for r in range(8)]
    assert [x.shard for x in s] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [x.replica for x in s] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert {x.num_shards for x in s} == {2}
    # MLA: every rank holds the same latent KV
    m = [kv_shard(r, 4, 1, use_mla=True) for r in range(4)]
    assert {x.shard for x in m} == {0} and [x.replica for x in m] == [0, 1, 2, 3]
    assert shard_from_replicas(5, 8, 4) == kv_shard(5, 8, 2)
    with pytest.raises(ValueError):
        kv_shard(4, 4, 8)


# ---------------------------------------------------------------- namespaces and keys
def test_namespaces_separate_what_must_not_share():
    hashes = [bytes([i]) * 32 for i in range(4)]
    base = base_namespace("m", "float32", "cpu:vec", 32, 0, 1, "sha256")
    k = keys_from_block_hashes(hashes, layer_namespace(base, "model.layers.0.attn"))
    assert k == keys_from_block_hashes(hashes, layer_namespace(base, "model.layers.0.attn"))
    others = [
        layer_namespace(base, "model.layers.1.attn"),
        layer_namespace(base, "model.layers.0.attn", "salt-a"),
        layer_namespace(base_namespace("m", "bfloat16", "cpu:vec", 32, 0, 1, "sha256"), "model.layers.0.attn"),
        layer_namespace(base_namespace("m", "float32", "cpu:vec", 32, 1, 2, "sha256"), "model.layers.0.attn"),
        layer_namespace(base_namespace("m", "float32", "cpu:amx", 32, 0, 1, "sha256"), "model.layers.0.attn"),
        layer_namespace(base_namespace("m/x", "float32", "cpu:vec", 32, 0, 1, "sha256"), "model.layers.0.attn"),
    ]
    for ns in others:
        assert not set(k) & set(keys_from_block_hashes(hashes, ns)), ns
    assert len({*k}) == 4 and all("/" not in x for x in k)


def test_block_hash_keys_keep_their_format():
    # objects persisted by earlier versions (an SSD tier, a standalone pool) are found again only
    # while this stays: hex SHA-256 of SHA-256(domain + namespace) followed by the hash's bytes
    import hashlib

    from tierkv.keys import block_hash_root, keys_from_root

    ns = "m/-/layer.0"
    assert keys_from_block_hashes([b"\x01" * 32, "s", 7], ns) == [
        "1b9b839aaca212aa46f4a9aa1a4ffea93296e3f6f729e4489432dc05a4e22497",
        "f7f3c1e07de5d901ce79453bf653011ad817421b41031da3370c89783076555e",
        "d3955204fa6b9102a187b0226bc969d1860b4a2f1cf5e57d515bfa2ab0caeead",
    ]
    root = hashlib.sha256(b"tierkv/blockhash/v1\x00" + ns.encode()).digest()
    assert block_hash_root(ns) == root
    hs = [bytes([i]) * 32 for i in range(5)]
    assert keys_from_root(root, hs) == [hashlib.sha256(root + h).hexdigest() for h in hs]
    # bytes-like hashes name the same key as their bytes; mixed lists take the slow path alike
    assert keys_from_root(root, [bytearray(hs[0]), memoryview(hs[1]), 5]) == \
        [keys_from_root(root, [hs[0]])[0], keys_from_root(root, [hs[1]])[0], keys_from_block_hashes([5], ns)[0]]
    with pytest.raises(TypeError):
        block_hash_root(b"ns")  # type: ignore[arg-type]


def test_block_hash_bytes():
    assert block_hash_bytes(b"\x01\x02") == b"\x01\x02"
    assert block_hash_bytes(5) == block_hash_bytes(5) != block_hash_bytes(6)
    with pytest.raises(TypeError):
        block_hash_bytes(1.5)


# ---------------------------------------------------------------- config
def test_store_config_from_extra(tmp_path):
    inline = {"tiers": [{"medium": "dram", "capacity": "1MiB"}]}
    assert store_config_from_extra({"tierkv": inline}) == inline
    assert store_config_from_extra({"tierkv": json.dumps(inline)}) == inline
    f = tmp_path / "s.json"
    f.write_text(json.dumps(inline))
    assert store_config_from_extra({"tierkv_config_file": str(f)}) == str(f)
    assert store_config_from_extra({}) is DEFAULT_STORE_CONFIG
    with pytest.raises(ConfigError):
        store_config_from_extra({"tierkv": inline, "tierkv_config_file": str(f)})
    with pytest.raises(ConfigError):
        store_config_from_extra({"tierkv_config_file": str(tmp_path / "missing.json")})
    with pytest.raises(ConfigError):
        store_config_from_extra({"tierkv": "{not json"})


def test_default_store_config_builds_and_stores():
    with TieredStore.from_config(DEFAULT_STORE_CONFIG) as s:
        info = s.tier_info()
        assert [(t["medium"], t["capacity_bytes"]) for t in info] == [("hbm", 256 << 20), ("dram", 2 << 30)]
        x = torch.arange(64, dtype=torch.float32)
        assert s.put(["k"], [x]) == [True]
        out = torch.zeros_like(x)
        assert s.get(["k"], [out]) == [True] and torch.equal(out, x)


def test_connector_options_are_checked_by_type():
    opts = parse_options({"load": False, "chunk_tokens": 64, "layerwise": True, "save_wait": False,
                          "full_hit_recompute": "token", "model_id": "m", "shutdown_timeout_s": 2})
    assert (opts.load, opts.save, opts.chunk_tokens, opts.layerwise, opts.save_wait) == (False, True, 64, True, False)
    assert (opts.full_hit_recompute, opts.model_id, opts.shutdown_timeout_s) == ("token", "m", 2.0)
    assert parse_options({}) == ConnectorOptions()
    assert parse_options({"layerwise": "auto"}).layerwise is None
    assert parse_options({"namespace": "team-a"}).namespace == "team-a"
    assert parse_options(None).store_config is DEFAULT_STORE_CONFIG
    inline = {"tiers": [{"medium": "dram", "capacity": "1MiB"}]}
    assert parse_options({"tierkv": inline}).store_config == inline


@pytest.mark.parametrize("extra,name", [
    ({"load": "false"}, "'load'"),  # a string is never a bool
    ({"save": 0}, "'save'"),
    ({"save_wait": "no"}, "'save_wait'"),
    ({"chunk_tokens": 0}, "'chunk_tokens'"),
    ({"chunk_tokens": "256"}, "'chunk_tokens'"),
    ({"layerwise": "yes"}, "'layerwise'"),
    ({"full_hit_recompute": "half"}, "'full_hit_recompute'"),
    ({"load_failure_policy": "fail"}, "'load_failure_policy'"),
    ({"shutdown_timeout_s": -1}, "'shutdown_timeout_s'"),
    ({"model_id": 3}, "'model_id'"),
    ({"namespace": 3}, "'namespace'"),
    ({"namespace": " "}, "'namespace'"),
    ({"chunk_token": 256}, "chunk_token"),  # a typo is named, never ignored
])
def test_bad_connector_options_are_named(extra, name):
    with pytest.raises(ConfigError, match=name):
        parse_options(extra)


def test_one_store_per_process_and_config():
    reg = StoreRegistry()
    cfg = {"tiers": [{"medium": "dram", "capacity": "1MiB"}]}
    a = reg.acquire(cfg)
    b = reg.acquire(json.loads(json.dumps(cfg)))
    c = reg.acquire({"tiers": [{"medium": "dram", "capacity": "2MiB"}]})
    try:
        assert a.store is b.store and a.store is not c.store
        assert reg.open_stores() == 2
        x = torch.arange(16, dtype=torch.float32)
        assert a.store.put(["k1"], [x]) == [True]
        a.release()
        a.release()  # idempotent: b's lease still holds the store
        assert a.released and not b.released
        assert b.store.lookup(["k1"]) == 1  # still open: one lease left
    finally:
        b.release()
        c.release()
    assert a.store.closed and c.store.closed and reg.open_stores() == 0


def test_a_lease_dropped_without_release_still_closes_its_store():
    """Released on every path: a lease collected unreleased gives its store back (as the interpreter's
    exit does with the leases still alive), and a store that fails to build leaves nothing behind."""
    import gc

    reg = StoreRegistry()
    lease = reg.acquire({"tiers": [{"medium": "dram", "capacity": "1MiB"}]})
    store = lease.store
    del lease
    gc.collect()
    assert store.closed and reg.open_stores() == 0
    with pytest.raises(ConfigError):
        reg.acquire({"tiers": [{"medium": "dram", "capacity": "1MiB", "no_such_key": 1}]})
    assert reg.open_stores() == 0


@pytest.mark.vllm
def test_a_worker_gives_back_the_store_it_was_handed_even_when_wrapped():
    """The worker releases the store it was built with, once, at shutdown, even after a caller wrapped
    ``worker.store`` (as the tests' fault injection does): the registry's lease ends and the store closes."""
    from tierkv.adapters.vllm.config import EngineInfo
    from tierkv.adapters.vllm.worker import TierKVWorker

    reg = StoreRegistry()
    info = EngineInfo(block_size=16, layers=("l0",), num_blocks=4, shard=kv_shard(0, 1, 1), namespaces={0: "ns"})
    lease = reg.acquire({"tiers": [{"medium": "dram", "capacity": "1MiB"}]})
    released = []
    w = TierKVWorker(ConnectorOptions(), info, lease.store, release=lambda s: (released.append(s), lease.release()),
                     serve=False)

    class Wrapped:
        def __init__(self, store):
            self._store = store

        def __getattr__(self, name):
            return getattr(self._store, name)

    w.store = Wrapped(w.store)
    w.shutdown()
    w.shutdown()  # idempotent
    assert released == [lease.store] and lease.released and lease.store.closed and reg.open_stores() == 0


@pytest.mark.vllm
def test_connector_stats_aggregate_and_reduce():
    from tierkv.adapters.vllm import TierKVConnector, TierKVConnectorStats

    a = TierKVConnectorStats()
    assert a.is_empty()
    a.data["load_tokens"] = 64
    a.data["load_bytes"] = 2 << 20
    a.data["hit_tokens"] = {"dram": 64}
    b = TierKVConnector.build_kv_connector_stats({"load_tokens": 32, "load_errors": 1, "hit_tokens": {"ssd": 32}})
    src_hits = {"dram": 1}
    c = TierKVConnector.build_kv_connector_stats({"hit_tokens": src_hits})
    a.aggregate(b).aggregate(c)
    assert src_hits == {"dram": 1}  # aggregation never writes into the payload it was built from
    r = a.reduce()
    assert r["loaded_tokens"] == 96 and r["load_errors"] == 1 and r["load_MiB"] == 2.0
    assert r["hit_tokens[dram]"] == 65 and r["hit_tokens[ssd]"] == 32
    assert not a.is_empty()
    a.reset()
    assert a.is_empty()


@pytest.mark.parametrize("shape", [(12, 2, 4, 8), (2, 12, 4, 2, 4)], ids=["cpu-layout", "kv-first"])
def test_byte_runs_match_block_by_block(shape):
    import random

    t = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    paged = PagedLayer.wrap(t, 12, 4)
    paged.prepare()
    rng = random.Random(5)
    for _ in range(50):
        ids = [rng.choice([None, rng.randrange(12)]) if rng.random() < 0.3 else rng.randrange(12) for _ in range(6)]
        if rng.random() < 0.5:  # ascending runs, as a fresh allocation often gives
            start = rng.randrange(7)
            ids = [start + i for i in range(6)]
        filler = [torch.full((paged.block_nbytes,), 7, dtype=torch.uint8)]
        parts, pending = paged.byte_runs(ids, lambda: filler)
        expect = []
        for b in ids:
            expect += filler if b is None else [p.reshape(-1).view(torch.uint8) for p in paged.read_parts(b)]
        assert torch.equal(torch.cat([p.reshape(-1).view(torch.uint8) for p in parts]), torch.cat(expect))
        if paged.is_direct() and paged.block_dim == 0:
            # runs of consecutive blocks come as one part each
            runs = 1 + sum(1 for a, b in itertools.pairwise(ids) if a is None or b is None or b != a + 1)
            assert len(parts) == runs and not pending
        real = [b for b in ids if b is not None]
        got = torch.cat([p.reshape(-1).view(torch.uint8) for p in paged.read_runs(real)]) if real else None
        if real:
            assert torch.equal(got, torch.cat([p.reshape(-1).view(torch.uint8) for b in real for p in paged.read_parts(b)]))


@pytest.mark.parametrize("shape", [(16, 2, 4, 8), (2, 16, 4, 2, 4)], ids=["cpu-layout", "kv-first"])
# same set-up as test_byte_runs_match_block_by_block: a paged layer of each layout, a seeded draw of block ids
def test_cuts_give_each_object_its_blocks_bytes(shape):
    import random

    t = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    paged = PagedLayer.wrap(t, 16, 4)
    paged.prepare()
    rng = random.Random(7)

    def block_bytes(b):
        return torch.cat([p.reshape(-1).view(torch.uint8) for p in paged.read_parts(b)])

    for _ in range(60):
        objects = []
        nxt = rng.randrange(16)
        for _ in range(rng.randrange(1, 7)):
            size = rng.choice([1, 1, 2, 3])
            kind = rng.random()
            if kind < 0.5:  # follows the previous object in the cache
                ids = [nxt + i for i in range(size)]
            elif kind < 0.8:
                s0 = rng.randrange(16)
                ids = [s0 + i for i in range(size)]
            else:  # holes and disorder
                ids = [rng.choice([None, rng.randrange(16)]) for _ in range(size)]
            ids = [b if b is None or b < 16 else None for b in ids]
            nxt = (ids[-1] + 1) if ids[-1] is not None else 0
            objects.append(ids)
        cuts = Cuts(objects)
        assert len(cuts) == len(objects)
        assert cuts.blocks == sum(b is not None for ids in objects for b in ids)
        filler = [torch.full((paged.block_nbytes,), 9, dtype=torch.uint8)]
        values, pending = paged.cut(cuts, lambda: filler)
        assert len(values) == len(objects)
        for ids, v in zip(objects, values):
            parts = [v] if isinstance(v, torch.Tensor) else v
            got = torch.cat([p.reshape(-1).view(torch.uint8) for p in parts])
            assert torch.equal(got, torch.cat([filler[0] if b is None else block_bytes(b) for b in ids]))
            if isinstance(v, torch.Tensor):  # one flat view straight into the cache
                assert v.dtype == torch.uint8 and v.dim() == 1 and v.is_contiguous()
                assert v.data_ptr() == paged.read_parts(ids[0])[0].data_ptr()
        assert pending is None  # these layouts are direct: nothing staged
        if all(None not in ids for ids in objects):
            read = paged.read_cut(cuts)
            for ids, v in zip(objects, read):
                parts = [v] if isinstance(v, torch.Tensor) else v
                got = torch.cat([p.reshape(-1).view(torch.uint8) for p in parts])
                assert torch.equal(got, torch.cat([block_bytes(b) for b in ids]))


def test_cuts_group_objects_that_follow_one_another():
    cuts = Cuts([[4], [5], [6], [9], [10, 11], [12, 13], [14, 15, 16], [1, None], [2], [3]])
    assert cuts.groups == [(0, 3, 4, 1), (3, 1, 9, 1), (4, 2, 10, 2), (6, 1, 14, 3), (7, 0, -1, 0),
                           (8, 2, 2, 1)]
    assert cuts.blocks == 14


def test_cut_past_the_cache_end_is_a_short_buffer_not_an_error():
    paged = PagedLayer.wrap(torch.zeros(4, 2, 4, 8), 4, 4)
    paged.prepare()
    values, _ = paged.cut(Cuts([[2], [3], [4]]), list)  # block 4 does not exist
    assert [v.numel() for v in values] == [paged.block_nbytes, paged.block_nbytes, 0]


@pytest.mark.vllm
def test_save_tally_counts_each_answer_of_a_put():
    from tierkv.adapters.vllm.connector_stats import SaveTally
    from tierkv.outcome import PutOutcome as P

    chunks = [(0, 3), (4, 7), (8, 9), (10, 10)]
    t = SaveTally.of([P.STORED, P.PRESENT, P.STORED, P.PRESENT], chunks, 100)
    assert (t.blocks, t.nbytes, t.refused, t.errors) == (11, 1100, 0, 0)
    t = SaveTally.of([P.STORED, P.NO_ROOM, P.ERROR, P.REJECTED], chunks, 100)
    assert (t.blocks, t.nbytes, t.refused, t.errors) == (4, 400, 2, 1)
    # a refused save is not an error; only PutOutcome answers are taken
    t = SaveTally.of([P.REJECTED, P.NO_ROOM, P.STORED, P.PRESENT], chunks, 10)
    assert (t.blocks, t.nbytes, t.refused, t.errors) == (3, 30, 2, 0)
    assert SaveTally.of([], [], 10).blocks == 0
    with pytest.raises(TypeError, match="not a PutOutcome"):
        SaveTally.of([True, False, True, True], chunks, 10)
    with pytest.raises(ValueError, match="4 chunks"):
        SaveTally.of([P.STORED], chunks, 10)
