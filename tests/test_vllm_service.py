"""The connector's two sides built directly, talking over their typed channels: no engine, a real store.

The scheduler side (``TierKVScheduler``) and the worker side (``TierKVWorker``) are built
from their constructors, as the connector builds them; vLLM's requests and scheduler
outputs are plain objects.  One request is saved, a second with the same prompt hits,
is loaded into other blocks with the same bytes, and the scheduler's shutdown request
reaches the worker on its lifecycle channel.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.vllm

import torch
from vllm_fakes import fake_request, new_request_output, worker_step

from tierkv import TieredStore
from tierkv.adapters.vllm.config import ConnectorOptions, EngineInfo, kv_shard
from tierkv.adapters.vllm.lookup import ChannelClient, endpoint
from tierkv.adapters.vllm.scheduler import TierKVScheduler
from tierkv.adapters.vllm.service import Channel, ProbeAnswer, ProbeRequest, ShutdownRequest, TierPlace
from tierkv.adapters.vllm.worker import TierKVWorker

BS = 16
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
NB = 16


def _request(rid: str, blocks: int, tokens_over: int = 3):
    return fake_request(rid, blocks, BS, tokens_over)


_output = new_request_output


def _step(worker: TierKVWorker, meta) -> set[int]:
    """One engine step on the worker side as vLLM runs it; the blocks that failed to load."""
    worker_step(worker, meta, LAYERS)
    return worker.get_block_ids_with_load_errors()


@pytest.fixture
def sides():
    store = TieredStore.from_config({"tiers": [{"medium": "dram", "capacity": "64MiB"}]})
    info = EngineInfo(block_size=BS, layers=LAYERS, num_blocks=NB, shard=kv_shard(0, 1, 2), namespaces={0: "ns"},
                      engine_id=f"test-service-{os.getpid()}")
    opts = ConnectorOptions(chunk_tokens=BS, load_async=False)
    released = []
    worker = TierKVWorker(opts, info, store, release=released.append)
    caches = {n: torch.randn(NB, 2, BS, 8) for n in LAYERS}
    worker.register_kv_caches(caches)
    scheduler = TierKVScheduler(opts, info)  # asks on the worker's lookup channel
    yield SimpleNamespace(store=store, worker=worker, scheduler=scheduler, caches=caches, released=released)
    worker.shutdown()
    scheduler.shutdown()
    store.close()


def test_a_saved_prompt_is_found_and_loaded_through_the_two_sides(sides):
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    s, w = sides.scheduler, sides.worker
    a = _request("a", 4)
    # nothing stored: a miss, and the whole prompt is planned for saving
    assert s.get_num_new_matched_tokens(a, 0) == (0, False)
    s.update_state_after_alloc(a, SimpleNamespace(get_block_ids=lambda: ([0, 1, 2, 3, 4],)), 0)
    meta = s.build_connector_meta(_output("a", [0, 1, 2, 3, 4], 0, a.num_tokens))
    assert [(spec.req_id, spec.chunks) for spec in meta.saves] == [("a", [(0, 0), (1, 1), (2, 2), (3, 3)])]
    assert _step(w, meta) == set()
    assert s.request_finished(a) == (True, None)  # its blocks wait for the worker's word
    assert w.get_finished({"a"}) == ({"a"}, None)
    assert w.totals.data["save_blocks"] == 4 * len(LAYERS)

    # the same prompt again: its four full blocks are a hit, from the dram tier (locality host)
    b = _request("b", 4)
    assert s.get_num_new_matched_tokens(b, 0) == (4 * BS, False)
    s.update_state_after_alloc(b, SimpleNamespace(get_block_ids=lambda: ([8, 9, 10, 11, 12],)), 4 * BS)
    assert s.get_external_cache_hit_sources(b, 4 * BS) == {CacheHitSource.HOST: 4 * BS}
    assert s.totals.hit_tokens_by_tier == {"dram": 4 * BS}
    meta = s.build_connector_meta(_output("b", [8, 9, 10, 11, 12], 4 * BS, 3))
    assert [(spec.req_id, spec.start, spec.block_ids) for spec in meta.loads] == [("b", 0, [8, 9, 10, 11])]
    assert meta.saves == []  # the store holds it already
    assert _step(w, meta) == set()
    for name in LAYERS:
        assert torch.equal(sides.caches[name][8:12], sides.caches[name][0:4])
    assert w.totals.data["load_blocks"] == 4 and w.totals.data["hit_tokens"] == {"dram": 4 * BS}
    # b's lookup held its chunks, over the lookup channel, until its load was over
    t = sides.store.stats()["total"]
    assert (t["leases"], t["leased_chunks"], t["leases_released"], t["leases_active"]) == (1, 4 * len(LAYERS), 1, 0)

    # the engine goes down: the scheduler's request reaches the worker on the lifecycle channel
    s.ask_workers_to_shut_down()
    assert w.closed and sides.released == [sides.store]
    # ... and its lookups are a miss from then on (never a crash)
    assert s.get_num_new_matched_tokens(_request("c", 4), 0) == (0, False)


def test_each_channel_takes_its_one_request_type(sides):
    w = sides.worker
    lookup, life = w.socket_paths
    info = w.info
    assert (lookup, life) == (endpoint(info.engine_id, 0, 0, Channel.LOOKUP)[0],
                              endpoint(info.engine_id, 0, 0, Channel.LIFECYCLE)[0])
    key = endpoint(info.engine_id, 0, 0)[1]
    c = ChannelClient(lookup, key)
    try:
        assert c.call(ProbeRequest([b"x" * 32] * 3, 1)) == ProbeAnswer(0, 0, [], missed={"never_stored": 2})
        with pytest.raises(TypeError, match="lookup channel takes a ProbeRequest, got ShutdownRequest"):
            c.call(ShutdownRequest())
        with pytest.raises(TypeError, match="got tuple"):
            c.call(("probe", ()))  # the old string-named op: refused by type
    finally:
        c.close()
    assert not w.closed
    ChannelClient(life, key).post(ShutdownRequest())
    assert w.closed and w.socket_paths == []


def test_a_probe_names_the_tier_and_locality_of_each_block_it_reaches(sides):
    w = sides.worker
    hashes = [bytes([i, 9]) * 16 for i in range(6)]
    one = torch.zeros(1, dtype=torch.uint8)
    for layer in range(len(LAYERS)):
        sides.store.put(w.keys.keys(layer, hashes[:4], None), [one] * 4)
    got = w.probe(ProbeRequest(hashes, 1))
    assert got == ProbeAnswer(3, 1, [TierPlace("dram", "host")] * 3, missed={"never_stored": 2})
    with pytest.raises(ValueError, match="ProbeRequest.local"):
        ProbeRequest(hashes, True)  # type: ignore[arg-type]


def test_a_lookup_says_why_the_blocks_past_its_hit_missed_and_a_trace_records_it(sides, tmp_path):
    from tierkv import MissReason
    from tierkv.adapters.vllm.trace_hook import RequestTracer
    from tierkv.tools.sim import read_trace

    s, w, store = sides.scheduler, sides.worker, sides.store
    hashes = [bytes([i, 5]) * 16 for i in range(6)]
    one = torch.zeros(1, dtype=torch.uint8)
    for layer in range(len(LAYERS)):
        store.put(w.keys.keys(layer, hashes[:4], None), [one] * 4)
    # block 2's objects are evicted by the store (recorded as the dram tier's), block 3's refused at a put
    evicted = [w.keys.keys(layer, hashes[2:3], None)[0] for layer in range(len(LAYERS))]
    store.remove(evicted)
    store._departures.record(evicted, MissReason.EVICTED, store.levels[0].name, "lru")
    r = SimpleNamespace(request_id="x", num_tokens=6 * BS + 3, num_prompt_tokens=6 * BS + 3, block_hashes=hashes,
                        cache_salt=None, max_tokens=1)
    assert s.get_num_new_matched_tokens(r, 0) == (2 * BS, False)
    # blocks 2..5 are not served: block 2 evicted (the break), and 3 (stored, past the break) with it; 4, 5 never
    assert s.last_missed == ("x", {"evicted": 2 * BS, "never_stored": 2 * BS})
    by_reason = store.stats()["total"]["misses_by_reason"]
    assert (by_reason["evicted"], by_reason["never_stored"]) == (1, 2)
    s.get_num_new_matched_tokens(r, 0)  # asked again while it waits: counted once
    assert store.stats()["total"]["misses_by_reason"] == by_reason

    path = tmp_path / "t.jsonl"
    tracer = RequestTracer.from_extra_config({"trace_path": str(path)}, BS)
    tracer.on_lookup(r, s.last_missed[1])
    tracer.close()
    (req,) = read_trace(str(path))
    assert req.extra["request_id"] == "x" and req.extra["miss_tokens"] == 4 * BS
    assert req.miss_reasons == {"evicted": 2 * BS, "never_stored": 2 * BS}


def test_a_salted_request_whose_break_is_stored_unsalted_misses_as_other_namespace(sides):
    w, store = sides.worker, sides.store
    hashes = [bytes([i, 3]) * 16 for i in range(4)]
    one = torch.zeros(1, dtype=torch.uint8)
    for layer in range(len(LAYERS)):
        store.put(w.keys.keys(layer, hashes, None), [one] * 4)  # stored without a salt
    got = w.probe(ProbeRequest(hashes, 0, "tenant-b", "y"))
    # the break (block 0) is held under the unsalted namespace; the rest are not asked about: never_stored
    assert (got.reach, got.missed) == (0, {"other_namespace": 1, "never_stored": 3})
    by_reason = store.stats()["total"]["misses_by_reason"]
    assert (by_reason["other_namespace"], by_reason["never_stored"]) == (1, 3)
    assert w.probe(ProbeRequest(hashes, 0, None, "z")).reach == 4  # (unsalted: a hit)
