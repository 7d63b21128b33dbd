"""KV written at one tensor-parallel size, read at another (``kv_head_shards``), without an engine.

A rank holding several stored KV-head shards of a layer keeps each as a slice: a view of the layer's
cache narrowed to that shard's heads.  What is checked: a slice's blocks are exactly the heads it names
(views of the cache, no copy), the stored objects hold those bytes, a rank at TP 2 loads what a rank at
TP 1 stored and the reverse, the default keeps the keys of an engine without the option (pinned digests),
and the option's errors name it and the numbers.
"""

from __future__ import annotations

import threading
import time

import pytest

pytestmark = pytest.mark.vllm  # (the worker's metadata types come from vLLM)

import torch

from tierkv import TieredStore
from tierkv.adapters.vllm.config import (
    ConnectorOptions,
    EngineInfo,
    base_namespace,
    kv_shard,
    parse_options,
    stored_kv_head_shards,
)
from tierkv.adapters.vllm.layer_keys import LayerKeys
from tierkv.adapters.vllm.metadata import LoadSpec, SaveSpec, TierKVConnectorMetadata
from tierkv.adapters.vllm.paged import Cuts, PagedLayer, head_dim, split_heads
from tierkv.adapters.vllm.worker import TierKVWorker
from tierkv.buffers import HostViews
from tierkv.errors import ConfigError

BS, NB, HD = 16, 10, 8
LAYERS = ("l0", "l1", "l2")
HEADS = 4  # the model's KV heads


# ---------------------------------------------------------------- the split
def test_cpu_layout_split_is_views_of_each_heads_slice():
    # CPU [num_blocks, heads, block_size, 2*head]: each part's block is one contiguous view of the cache
    t = torch.randn(NB, HEADS, BS, 2 * HD)
    parts = split_heads(PagedLayer.wrap(t, NB, BS), HEADS, 2)
    assert len(parts) == 2
    for k, p in enumerate(parts):
        assert p.block_nbytes == 2 * BS * 2 * HD * 4
        assert p.is_direct() and p.is_flat()  # zero-copy: one view of the cache per block, never staged
        for b in (0, 3, NB - 1):
            (view,) = p.read_parts(b)
            assert view.is_contiguous() and view.data_ptr() == t[b, 2 * k].data_ptr()  # a view, not a copy
            assert torch.equal(view[0], t[b, 2 * k:2 * k + 2])
        # objects of one block: one view each, with their addresses; longer ones: a view per block
        views, pending = p.cut(Cuts([[3], [NB - 1]]), list)
        assert pending is None and type(views) is HostViews
        for view, b in zip(views, (3, NB - 1)):
            assert view.data_ptr() == t[b, 2 * k].data_ptr()
            assert torch.equal(view, t[b, 2 * k:2 * k + 2].reshape(-1).view(torch.uint8))
        (obj,) = p.read_cut(Cuts([[1, 2, 5]]))
        assert [v.data_ptr() for v in obj] == [t[b, 2 * k].data_ptr() for b in (1, 2, 5)]
        assert all(torch.equal(v, t[b, 2 * k:2 * k + 2].reshape(-1).view(torch.uint8)) for v, b in zip(obj, (1, 2, 5)))
        # a block read and dropped takes the filler's buffers; a block id past the cache, a short view
        spare = torch.empty(p.block_nbytes, dtype=torch.uint8)
        (obj,), _ = p.cut(Cuts([[None, 4, NB]]), lambda: [spare])
        assert obj[0] is spare and obj[1].data_ptr() == t[4, 2 * k].data_ptr() and obj[2].numel() < p.block_nbytes


def test_kv_first_layout_split_is_staged_and_writes_back_its_heads_only():
    # [2, num_blocks, block_size, heads, head]: a block's heads are strided, so a part is staged
    t = torch.randn(2, NB, BS, HEADS, HD)
    parts = split_heads(PagedLayer.wrap(t, NB, BS), HEADS, 4)
    k, v = parts[3].read_parts(5)
    assert torch.equal(k[0], t[0, 5, :, 3:4]) and torch.equal(v[0], t[1, 5, :, 3:4])
    dst = torch.zeros_like(t)
    bufs, pending = split_heads(PagedLayer.wrap(dst, NB, BS), HEADS, 4)[1].write_targets(2)
    for buf, src in zip(bufs, parts[1].read_parts(2)):
        buf.copy_(src)
    for stage, d in pending:
        d.copy_(stage)
    assert torch.equal(dst[:, 2, :, 1], t[:, 2, :, 1])
    dst[:, 2, :, 1] = 0
    assert dst.abs().sum() == 0  # nothing else written


def test_one_part_is_the_layer_itself_and_bad_splits_are_refused():
    layer = PagedLayer.wrap(torch.zeros(NB, HEADS, BS, 2 * HD), NB, BS)
    assert split_heads(layer, HEADS, 1) == [layer]
    with pytest.raises(ValueError, match="4 KV heads cannot be split into 3"):
        split_heads(layer, HEADS, 3)
    assert head_dim((2, NB, BS, HEADS, HD), 1, HEADS) == 3
    # as many heads as tokens in a block: vLLM's CPU layout has its heads right after the blocks
    assert head_dim((NB, BS, BS, 2 * HD), 0, BS, cpu=True) == 1
    with pytest.raises(ValueError, match="cannot tell the KV-head dimension"):
        head_dim((2, NB, BS, BS, HD), 1, BS)


# ---------------------------------------------------------------- the option
def test_stored_shards_default_to_the_engines_own():
    assert stored_kv_head_shards(None, kv_shard(0, 1, 8), 8) == 1
    assert stored_kv_head_shards(None, kv_shard(1, 2, 8), 8, 2) == 2
    assert stored_kv_head_shards(4, kv_shard(0, 1, 8), 8) == 4
    assert stored_kv_head_shards(4, kv_shard(3, 4, 8), 8, 4) == 4
    assert stored_kv_head_shards(8, kv_shard(0, 2, 8), 8, 2) == 8
    # MLA: one latent shared by every rank, one copy whatever the option
    assert stored_kv_head_shards(4, kv_shard(1, 4, 1, use_mla=True), 1, 4, mla=True) == 1
    # ranks replicating heads (TP 4 over 2 heads): the 2 shards, the only value that divides the heads
    assert stored_kv_head_shards(2, kv_shard(3, 4, 2), 2, 4) == 2
    # recurrent-state layers: only the engine's own shards
    assert stored_kv_head_shards(2, kv_shard(0, 2, 2), 2, 2, state_layers=True) == 2


@pytest.mark.parametrize(("option", "shard", "heads", "tp", "state", "message"), [
    (3, kv_shard(0, 2, 8), 8, 2, False,
     "option 'kv_head_shards': 3 is not a multiple of this engine's 2 KV-head shards (tensor-parallel size 2)"),
    (2, kv_shard(0, 4, 8), 8, 4, False, "2 is not a multiple of this engine's 4 KV-head shards"),
    (4, kv_shard(0, 1, 2), 2, 1, False, "option 'kv_head_shards': 4 does not divide the model's 2 KV heads"),
    (4, kv_shard(0, 4, 2), 2, 4, False, "4 does not divide the model's 2 KV heads"),
    (2, kv_shard(0, 1, 0), 0, 1, False, "needs the model's number of KV heads"),
    (2, kv_shard(0, 1, 2), 2, 1, True, "recurrent-state layers"),
])
def test_stored_shards_errors_name_the_option_and_the_numbers(option, shard, heads, tp, state, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        stored_kv_head_shards(option, shard, heads, tp, state_layers=state)


def test_option_is_checked():
    assert parse_options({}).kv_head_shards is None
    assert parse_options({"kv_head_shards": 2}).kv_head_shards == 2
    for bad in (0, -1, "2", 1.5, True):
        with pytest.raises(ConfigError, match="kv_head_shards"):
            parse_options({"kv_head_shards": bad})


# ---------------------------------------------------------------- keys
def _info(tp_rank: int, tp_size: int, stored: int = 0, heads: int = HEADS, layers=LAYERS) -> EngineInfo:
    shard = kv_shard(tp_rank, tp_size, heads)
    n = stored or shard.num_shards
    ns = {j: base_namespace("m", "float32", f"cpu:x:h{heads // n}x{HD}", BS, j, n, "sha256", 1) for j in range(n)}
    return EngineInfo(block_size=BS, layers=layers, num_blocks=NB, shard=shard, namespaces=ns, tp_rank=tp_rank,
                      tp_size=tp_size, kv_head_shards=stored, rank_kv_heads=(heads // tp_size,))


def test_default_keys_are_unchanged():
    # digests made before kv_head_shards existed (the same namespaces, layers and hashes): a store written
    # then keeps hitting
    for tp, rank, want in ((1, 0, ("a9bf33de3984d6298baea20be638094e821ca8f4178216da4c0d22f4566e0138",
                                   "8922ae1b26b0c6fe2f9c67f9938bc287d6407ac8e76f8298278e742a64bb3075")),
                           (2, 1, ("35e416a5837fb3ae1cf96f1b3225b8833ace5cfccd25b53792fa66f19ecd85c7",
                                   "e1c5702abb94b0213648da891ae0361363e084d25ee8a6f0f98cd66dd1b88925"))):
        sh = kv_shard(rank, tp, 2)
        ns = {s: base_namespace("m", "float32", "cpu:x:h1x64", 32, s, sh.num_shards, "sha256", 8)
              for s in range(sh.num_shards)}
        for stored in (0, sh.num_shards):  # unset, or set to the engine's own shards
            info = EngineInfo(block_size=32, layers=("l0", "l1"), num_blocks=4, shard=sh, namespaces=ns,
                              kv_head_shards=stored)
            keys = LayerKeys(info)
            assert info.slice_names == ("l0", "l1")
            assert (keys.keys(1, [bytes(range(32))], None)[0], keys.keys(0, [bytes(32)], "s")[0]) == want


def test_tp1_slices_share_the_keys_of_tp2_ranks():
    one = _info(0, 1, stored=2)
    assert one.slices_per_layer == 2
    assert one.slice_names[:2] == ("l0#kvshard0", "l0#kvshard1")
    hs = [bytes([i]) * 32 for i in range(3)]
    k1 = LayerKeys(one)
    for rank in (0, 1):
        two = _info(rank, 2, stored=2)
        assert two.slice_names == LAYERS
        k2 = LayerKeys(two)
        for layer in range(len(LAYERS)):
            assert k2.keys(layer, hs, "salt") == k1.keys(2 * layer + rank, hs, "salt")
    # the TP-1 engine's own keys (one object per layer) are none of them
    plain = LayerKeys(_info(0, 1))
    assert not set(plain.keys(0, hs, None)) & {k for s in range(6) for k in k1.keys(s, hs, None)}


# ---------------------------------------------------------------- workers across TP sizes
def _worker(info: EngineInfo, store, cache_heads: int, fill: bool, layerwise: bool = False,
            load_async: bool = False):
    w = TierKVWorker(ConnectorOptions(chunk_tokens=2 * BS, layerwise=layerwise, load_async=load_async), info,
                     store, release=lambda s: None, serve=False)
    make = torch.randn if fill else torch.zeros
    caches = {n: make(NB, cache_heads, BS, 2 * HD) for n in LAYERS}
    w.register_kv_caches(caches)
    return w, caches


HASHES = [bytes([7, i]) * 16 for i in range(4)]
WRITE_IDS = [2, 3, 6, 7]  # two chunks of two blocks
READ_IDS = [1, 4, 5, 9]


def _save(w, ids=WRITE_IDS) -> None:
    spec = SaveSpec("w", [(0, 1), (2, 3)], [ids[:2], ids[2:]], [HASHES[1], HASHES[3]], list(ids))
    w.bind_metadata(TierKVConnectorMetadata(saves=[spec]))
    for name in LAYERS:
        w.save_kv_layer(name)
    w.wait_for_save()
    w.clear_metadata()
    assert w.get_finished({"w"})[0] == {"w"}


def _load(w, ids=READ_IDS, failed: set[int] = frozenset()) -> None:
    w.bind_metadata(TierKVConnectorMetadata(loads=[LoadSpec("r", 0, list(ids), list(HASHES))]))
    w.start_load_kv()
    for name in LAYERS:
        w.wait_for_layer_load(name)
    w.wait_for_save()
    w.clear_metadata()
    assert w.get_block_ids_with_load_errors() == failed


@pytest.fixture
def store():
    s = TieredStore.from_config({"tiers": [{"medium": "dram", "capacity": "64MiB"}]})
    yield s
    s.close()


def test_tp1_writes_tp2_ranks_read_their_heads(store):
    writer, src = _worker(_info(0, 1, stored=2), store, HEADS, fill=True)
    _save(writer)
    t = writer.totals.data
    assert t["save_errors"] == 0 and t["save_bytes"] == 4 * len(LAYERS) * HEADS * BS * 2 * HD * 4
    # each object holds one stored shard's heads of its chunk's blocks, nothing else
    keys = LayerKeys(writer.info)
    for s, name in enumerate(writer.info.slice_names):
        layer, shard = LAYERS[s // 2], s % 2
        want = torch.cat([src[layer][b, 2 * shard:2 * shard + 2].reshape(-1) for b in WRITE_IDS[2:]])
        buf = torch.empty_like(want)
        assert store.get(keys.keys(s, [HASHES[3]], None), [buf]) == [True], name
        assert torch.equal(buf, want), name
    writer.shutdown()
    for rank in (0, 1):
        reader, dst = _worker(_info(rank, 2, stored=2), store, HEADS // 2, fill=False)
        _load(reader)
        for name in LAYERS:
            for r, w in zip(READ_IDS, WRITE_IDS):
                assert torch.equal(dst[name][r], src[name][w, 2 * rank:2 * rank + 2]), (rank, name)
        assert reader.totals.data["load_errors"] == 0
        reader.shutdown()


def _write_tp2(store) -> list:
    """Both ranks of a TP=2 engine (half the heads each) save the step into ``store``; their source caches."""
    srcs = []
    for rank in (0, 1):
        writer, src = _worker(_info(rank, 2, stored=2), store, HEADS // 2, fill=True)
        _save(writer)
        srcs.append(src)
        writer.shutdown()
    return srcs


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole-step", "layerwise"])
def test_tp2_ranks_write_tp1_reads_every_head(store, layerwise):
    srcs = _write_tp2(store)
    reader, dst = _worker(_info(0, 1, stored=2), store, HEADS, fill=False, layerwise=layerwise)
    assert reader.layerwise is layerwise
    _load(reader)
    for name in LAYERS:
        for r, w in zip(READ_IDS, WRITE_IDS):
            assert torch.equal(dst[name][r], torch.cat([srcs[0][name][w], srcs[1][name][w]])), name
    # the load read both shards of every layer: every hit token, every byte
    t = reader.totals.data
    assert t["load_errors"] == 0 and t["load_tokens"] == 4 * BS
    assert t["load_bytes"] == 4 * len(LAYERS) * HEADS * BS * 2 * HD * 4
    # the probe asks both shards of every layer
    from tierkv.adapters.vllm.service import ProbeRequest

    assert reader.probe(ProbeRequest([bytes(h) for h in HASHES], 0, None, None)).reach == 4
    store.remove(LayerKeys(reader.info).keys(1, [HASHES[3]], None))  # one shard of one layer's second chunk
    assert reader.probe(ProbeRequest([bytes(h) for h in HASHES], 0, None, None)).reach == 2
    reader.shutdown()


def test_a_missing_head_shard_fails_its_blocks_for_recompute(store):
    """One head's object of one layer's second chunk gone between the lookup and the load: that chunk's
    blocks are reported failed (vLLM recomputes them), the first chunk's are loaded."""
    srcs = _write_tp2(store)
    reader, dst = _worker(_info(0, 1, stored=2), store, HEADS, fill=False)
    keys = LayerKeys(reader.info)
    store.remove(keys.keys(3, [HASHES[3]], None))  # layer 1, head shard 1, blocks 2..3
    _load(reader, failed=set(READ_IDS[2:]))
    for name in LAYERS:
        for r, w in zip(READ_IDS[:2], WRITE_IDS[:2]):
            assert torch.equal(dst[name][r], torch.cat([srcs[0][name][w], srcs[1][name][w]])), name
    assert reader.totals.data["load_errors"] == 2
    reader.shutdown()


def test_tp2_rank_loads_between_steps_what_tp1_stored(store):
    """``load_async``: a TP-2 rank's load of its head from a TP-1 engine's objects runs between steps and is
    reported in ``finished_recving`` with no failed block."""
    writer, src = _worker(_info(0, 1, stored=2), store, HEADS, fill=True)
    _save(writer)
    writer.shutdown()
    reader, dst = _worker(_info(1, 2, stored=2), store, HEADS // 2, fill=False, load_async=True)
    reader.bind_metadata(TierKVConnectorMetadata(async_loads=[LoadSpec("r", 0, list(READ_IDS), list(HASHES))]))
    reader.start_load_kv()
    reader.wait_for_save()
    reader.clear_metadata()
    # (vLLM asks every step; the request is reported once, with any failed block)
    deadline = time.monotonic() + 30
    while not reader.get_finished(set())[1]:
        assert time.monotonic() < deadline, "the load was never reported"
        threading.Event().wait(0.005)
    assert reader.get_block_ids_with_load_errors() == set()
    for name in LAYERS:
        for r, w in zip(READ_IDS, WRITE_IDS):
            assert torch.equal(dst[name][r], src[name][w, 2:4]), name
    reader.shutdown()
