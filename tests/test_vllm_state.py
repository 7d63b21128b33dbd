"""Recurrent-state groups (Mamba / Gated DeltaNet / short convolution in vLLM's ``align`` mode), no engine.

The two sides are built directly over a real store, with a KV cache laid out as vLLM lays out a hybrid model
on CPU: an attention layer of whole pages, and a state layer whose page holds one state (conv + SSM bytes)
followed by padding, so its block rows are strided.  The story: a prompt is prefilled in chunks that end on
block boundaries (vLLM's ``align`` mode), each chunk's end is the only boundary whose state is offered, and
it is saved in that step; a later prompt hits the longest prefix whose last boundary has a saved state, and
its load writes that one state block and every attention block of the prefix.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace as NS

import pytest

pytestmark = pytest.mark.vllm

import torch

from tierkv import TieredStore
from tierkv.adapters.vllm.config import ConnectorOptions, EngineInfo, kv_shard
from tierkv.adapters.vllm.groups import GroupGeometry, GroupKind
from tierkv.adapters.vllm.scheduler import TierKVScheduler
from tierkv.adapters.vllm.worker import TierKVWorker

BS = 16
NB = 40
LAYERS = ("model.layers.0.linear_attn", "model.layers.1.self_attn.attn")
STATE_BYTES, PAGE = 96, 128  # one state, and the page it sits in (padded to the attention page)
GROUPS = (GroupGeometry(GroupKind.STATE, BS, shape=(2, 3, 16), dtype="bfloat16"),
          GroupGeometry(GroupKind.FULL, BS, shape=(2, 8), dtype="float32"))


def _request(rid: str, blocks: int, over: int = 3, first: int = 0):
    return NS(request_id=rid, num_tokens=blocks * BS + over, num_prompt_tokens=blocks * BS + over,
              block_hashes=[bytes([first + i, 7]) * 16 for i in range(blocks)], cache_salt=None)


def _output(rid: str, ids: tuple[list[int], list[int]], computed: int, scheduled: int, new: bool):
    if new:
        cached = NS(req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[])
        return NS(scheduled_new_reqs=[NS(req_id=rid, block_ids=ids, num_computed_tokens=computed)],
                  scheduled_cached_reqs=cached, num_scheduled_tokens={rid: scheduled}, preempted_req_ids=set())
    cached = NS(req_ids=[rid], new_block_ids=[ids], resumed_req_ids=set(), num_computed_tokens=[computed])
    return NS(scheduled_new_reqs=[], scheduled_cached_reqs=cached, num_scheduled_tokens={rid: scheduled},
              preempted_req_ids=set())


class _GatedPuts:
    """A store whose puts wait for ``gate`` (the engine's next step may run meanwhile)."""

    def __init__(self, store):
        self._store, self.gate = store, threading.Event()

    def __getattr__(self, name):
        return getattr(self._store, name)

    def put_detailed(self, keys, values, tenant=None):
        self.gate.wait(30)
        return self._store.put_detailed(keys, values, tenant=tenant)


@pytest.fixture
def sides():
    store = TieredStore.from_config({"tiers": [{"medium": "dram", "capacity": "64MiB"}]})
    gated = _GatedPuts(store)
    info = EngineInfo(block_size=BS, layers=LAYERS, num_blocks=NB, shard=kv_shard(0, 1, 1), namespaces={0: "ns"},
                      layer_groups=(0, 1), groups=GROUPS, engine_id="test-state")
    pages = torch.zeros(NB, PAGE, dtype=torch.int8)
    state = pages[:, :STATE_BYTES].view(NB, 1, 1, STATE_BYTES)  # strided rows, as vLLM's view of a state page
    caches = {LAYERS[0]: state, LAYERS[1]: torch.zeros(NB, 2, BS, 8)}
    opts = ConnectorOptions(chunk_tokens=BS, save_wait=False)  # (the step does not wait for its puts)
    worker = TierKVWorker(opts, info, gated, release=lambda _: None, serve=False)
    worker.register_kv_caches(caches)
    sched = TierKVScheduler(opts, info, ask=lambda rank, request: worker.probe(request))
    yield NS(store=store, gated=gated, worker=worker, sched=sched, state=state, attn=caches[LAYERS[1]],
             pages=pages)
    gated.gate.set()
    worker.shutdown()
    store.close()


def _step(sides, meta) -> None:
    """One engine step: the worker's hooks, in vLLM's order (no per-layer hook for a state layer)."""
    w = sides.worker
    w.bind_metadata(meta)
    w.start_load_kv()
    w.wait_for_layer_load(LAYERS[1])
    w.save_kv_layer(LAYERS[1])
    w.wait_for_save()
    w.clear_metadata()


def _state_key(sides, block_hash: bytes) -> str:
    return sides.worker.keys.keys(0, [block_hash], None)[0]


def test_states_are_saved_at_the_boundaries_steps_end_on_copied_within_the_step(sides):
    s, w = sides.sched, sides.worker
    a = _request("a", 4)  # 4 blocks + 3 tokens: prefilled as [0, 32), [32, 64), then the rest
    assert s.get_num_new_matched_tokens(a, 0) == (0, False)
    s.update_state_after_alloc(a, NS(get_block_ids=lambda: ([], [])), 0)
    attn = [10, 11, 12, 13, 14]
    torch.manual_seed(0)
    sides.attn[10:15] = torch.randn(5, 2, BS, 8)
    # step 1 computes [0, 32): the state at boundary 32 is written in state block 1 (block 0 is vLLM's null)
    sides.state[21] = 11
    meta = s.build_connector_meta(_output("a", ([0, 21], attn[:2]), 0, 2 * BS, new=True))
    (save,) = meta.saves
    assert save.chunks == [(0, 0), (1, 1)] and save.state_chunks == [1]
    _step(sides, meta)
    # the next step overwrites that state block before the put ran: the saved state is the one of the step
    sides.state[21] = 99
    # step 2 computes [32, 64): its state goes to block 3, block 1 is given back (null)
    sides.state[23] = 33
    meta = s.build_connector_meta(_output("a", ([0, 23], attn[2:4]), 2 * BS, 2 * BS, new=False))
    (save,) = meta.saves
    assert save.chunks == [(2, 2), (3, 3)] and save.state_chunks == [1]
    _step(sides, meta)
    # step 3 computes the last 3 tokens: it ends inside block 4, offers no boundary state, and saves nothing
    meta = s.build_connector_meta(_output("a", ([24], [14]), 4 * BS, 3, new=False))
    assert meta.saves == []
    _step(sides, meta)
    sides.gated.gate.set()
    assert w.wait_for_all_saves(30)
    h = a.block_hashes
    assert sides.store.contains([_state_key(sides, x) for x in h]) == [False, True, False, True]
    got = torch.empty(STATE_BYTES, dtype=torch.int8)
    assert sides.store.get([_state_key(sides, h[1])], [got]) == [True]
    assert bool((got == 11).all())  # copied in its step, not read after the next one overwrote it
    # every attention block was saved
    attn_keys = w.keys.keys(1, list(h), None)
    assert sides.store.contains(attn_keys) == [True] * 4


def _serve_a(sides):
    s = sides.sched
    a = _request("a", 4)
    s.get_num_new_matched_tokens(a, 0)
    s.update_state_after_alloc(a, NS(get_block_ids=lambda: ([], [])), 0)
    sides.attn[10:14] = torch.randn(4, 2, BS, 8)
    sides.state[21], sides.state[23] = 11, 33
    _step(sides, s.build_connector_meta(_output("a", ([0, 21], [10, 11]), 0, 2 * BS, new=True)))
    _step(sides, s.build_connector_meta(_output("a", ([0, 23], [12, 13]), 2 * BS, 2 * BS, new=False)))
    sides.gated.gate.set()
    assert sides.worker.wait_for_all_saves(30)
    s.request_finished(a)
    sides.worker.get_finished({"a"})


def _load(sides, rid: str, req, ids: tuple[list[int], list[int]], ext: int):
    s, w = sides.sched, sides.worker
    s.update_state_after_alloc(req, NS(get_block_ids=lambda: ids), ext)
    meta = s.build_connector_meta(_output("x", ([], []), 0, 0, new=True))
    (load,) = meta.async_loads
    _step(sides, meta)
    assert w._async.wait_idle(30)
    _, recving = w.get_finished(set())
    assert recving == {rid}
    return load


def test_a_hit_ends_on_the_last_saved_state_and_loads_that_state_alone(sides):
    _serve_a(sides)
    s = sides.sched
    # the same prompt: every attention block and the state at 64 are stored: a hit of 4 blocks
    b = _request("b", 4)
    assert s.get_num_new_matched_tokens(b, 0) == (4 * BS, True)
    # vLLM allocates the state group's blocks of the hit; only the last holds a state to continue from
    load = _load(sides, "b", b, ([30, 31, 32, 33], [1, 2, 3, 4]), 4 * BS)
    assert load.group_block_ids == [[0, 0, 0, 33], [1, 2, 3, 4]]
    assert bool((sides.state[33] == 33).all())
    assert torch.equal(sides.attn[1:5], sides.attn[10:14])
    assert not bool(sides.state[30:33].any())  # the blocks before the boundary are not written
    assert bool((sides.pages[33, STATE_BYTES:] == 0).all())  # nor the page's padding
    # a prompt of 3 blocks + 1 token may hit 3 blocks, but no state was saved at 48: the hit is 2 blocks
    c = _request("c", 3, over=1)
    assert s.get_num_new_matched_tokens(c, 0) == (2 * BS, True)
    assert s.last_missed[1] == {"never_stored": BS}
    load = _load(sides, "c", c, ([35, 36], [5, 6]), 2 * BS)
    assert load.group_block_ids == [[0, 36], [5, 6]]
    assert bool((sides.state[36] == 11).all())
    # from vLLM's own cache of 1 block: the hit extends to the next saved state, at 32 (one block loaded)
    d = _request("d", 3, over=1)
    assert s.get_num_new_matched_tokens(d, BS) == (BS, True)


def test_a_state_gone_from_the_store_fails_the_load_never_loads_another(sides):
    _serve_a(sides)
    s = sides.sched
    b = _request("b", 4)
    assert s.get_num_new_matched_tokens(b, 0) == (4 * BS, True)
    sides.store.remove([_state_key(sides, b.block_hashes[3])])  # gone between lookup and load
    s.update_state_after_alloc(b, NS(get_block_ids=lambda: ([30, 31, 32, 33], [1, 2, 3, 4])), 4 * BS)
    meta = s.build_connector_meta(_output("x", ([], []), 0, 0, new=True))
    _step(sides, meta)
    w = sides.worker
    assert w._async.wait_idle(30)
    w.get_finished(set())
    assert w.take_failed_recving() == {"b"}  # vLLM recomputes the request
    assert not bool(sides.state[33].any())


def test_a_hit_whose_boundary_has_no_state_block_fails_never_loads_attention_alone(sides):
    _serve_a(sides)
    s, w = sides.sched, sides.worker
    b = _request("b", 4)
    assert s.get_num_new_matched_tokens(b, 0) == (4 * BS, True)
    # the state group's block at the boundary is vLLM's null block: nothing could hold the state
    s.update_state_after_alloc(b, NS(get_block_ids=lambda: ([30, 31, 32, 0], [1, 2, 3, 4])), 4 * BS)
    _step(sides, s.build_connector_meta(_output("x", ([], []), 0, 0, new=True)))
    assert w._async.wait_idle(30)
    w.get_finished(set())
    assert w.take_failed_recving() == {"b"}
    assert not bool(sides.attn[1:5].any())  # no attention block written either
