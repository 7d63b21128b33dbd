"""The hit arithmetic of KV cache groups (adapters/vllm/groups.py) against a brute-force reference.

The reference walks tokens, not blocks: a hit of ``H`` tokens needs, per group kind, the tokens whose K/V (or
state) the first token after the hit reads (full / MLA: ``[0, H)``; sliding window ``w``: ``[H - w + 1, H)``;
recurrent state: the state written after token ``H - 1``), and each such token needs the block holding it.
"""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest

from tierkv.adapters.vllm.groups import (
    GroupGeometry,
    GroupKind,
    UnsupportedGroup,
    geometry_of_spec,
    hit_alignment,
    longest_hit,
    save_mask,
    servable,
)

FULL, MLA, SW, STATE = GroupKind.FULL, GroupKind.MLA, GroupKind.SLIDING_WINDOW, GroupKind.STATE


def _needed_blocks_ref(g: GroupGeometry, hit: int) -> set[int]:
    if hit == 0:
        return set()
    if g.kind is STATE:
        return {(hit - 1) // g.block_size}  # the state after token hit-1 sits in the block ending at hit
    first = max(0, hit - g.sliding_window + 1) if g.kind is SW else 0
    return {t // g.block_size for t in range(first, hit)}


def _servable_ref(g: GroupGeometry, present: list[bool], hit: int) -> bool:
    return all(b < len(present) and present[b] for b in _needed_blocks_ref(g, hit))


def _longest_ref(groups, present, hash_bs, max_tokens) -> int:
    best = 0
    for hit in range(1, max_tokens + 1):
        if hit % hash_bs or any(hit % g.block_size for g in groups):
            continue
        if all(_servable_ref(g, p, hit) for g, p in zip(groups, present)):
            best = hit
    return best


def _geom(kind: GroupKind, bs: int, w: int = 0) -> GroupGeometry:
    return GroupGeometry(kind, bs, sliding_window=w if kind is SW else 0)


@pytest.mark.parametrize("kind", [FULL, MLA, SW, STATE])
@pytest.mark.parametrize("bs", [1, 2, 3, 4])
def test_blocks_needed_and_servable_match_the_token_reference_for_every_mask(kind, bs):
    windows = [1, 2, 3, 5, 8, 13] if kind is SW else [0]
    for w in windows:
        g = _geom(kind, bs, w)
        for nblocks in range(0, 6):
            for hit_blocks in range(0, nblocks + 2):
                hit = hit_blocks * bs
                lo, hi = g.blocks_needed(hit)
                assert set(range(lo, hi)) == _needed_blocks_ref(g, hit), (g, hit)
            hits = np.arange(1, nblocks + 2) * bs
            for bits in itertools.product([False, True], repeat=nblocks):
                got = servable(g, list(bits), hits)
                want = [_servable_ref(g, list(bits), int(h)) for h in hits]
                assert got.tolist() == want, (g, bits)


def test_longest_hit_matches_brute_force_on_random_hybrid_layouts():
    rng = random.Random(34)
    for _ in range(3000):
        groups = []
        for _ in range(rng.randint(1, 4)):
            kind = rng.choice([FULL, MLA, SW, STATE])
            groups.append(_geom(kind, rng.choice([1, 2, 3, 4, 6]), rng.randint(1, 20)))
        hash_bs = rng.choice([1, 2, 3, 4])
        max_tokens = rng.randint(0, 40)
        density = rng.random()
        present = [[rng.random() < density for _ in range(rng.randint(0, 45 // g.block_size + 1))] for g in groups]
        got = longest_hit(groups, present, hash_bs, max_tokens)
        assert got == _longest_ref(groups, present, hash_bs, max_tokens), (groups, present, hash_bs, max_tokens)
        assert got % hit_alignment(groups, hash_bs) == 0


def test_a_hit_is_aligned_to_every_block_size_and_the_hash_block_size():
    groups = [_geom(FULL, 4), _geom(SW, 6, 10), _geom(STATE, 16)]
    assert hit_alignment(groups, 2) == 48
    assert hit_alignment(groups, 32) == 96
    everything = [[True] * 100 for _ in groups]
    assert longest_hit(groups, everything, 2, 200) == 192
    assert longest_hit(groups, everything, 2, 47) == 0  # shorter than one aligned unit: no hit


def test_every_group_must_serve_the_hit():
    full, sw, state = _geom(FULL, 4), _geom(SW, 4, 9), _geom(STATE, 4)
    n = 12  # blocks
    allp = [True] * n
    assert longest_hit([full, sw, state], [allp, allp, allp], 4, 48) == 48
    # the state group only has the states at tokens 16 and 32: the hit falls back to 32
    states = [False] * n
    states[3] = states[7] = True
    assert longest_hit([full, sw, state], [allp, allp, states], 4, 48) == 32
    # the sliding window lost block 5 (tokens 20..23): a hit at 32 reads tokens 24..31 only, still fine;
    # a hit at 24 would read tokens 16..23 (block 5): not needed here since 32 is longer
    sw_p = list(allp)
    sw_p[5] = False
    assert longest_hit([full, sw, state], [allp, sw_p, states], 4, 48) == 32
    # lose block 6 (tokens 24..27): the window of the hit at 32 is gone, and 16 is the longest left
    sw_p[6] = False
    assert longest_hit([full, sw, state], [allp, sw_p, states], 4, 48) == 16
    # full attention needs everything before the hit
    full_p = list(allp)
    full_p[0] = False
    assert longest_hit([full, sw, state], [full_p, allp, allp], 4, 48) == 0


def test_save_mask_keeps_what_some_aligned_hit_reads():
    rng = random.Random(5)
    for _ in range(500):
        kind = rng.choice([FULL, MLA, SW, STATE])
        g = _geom(kind, rng.choice([1, 2, 4]), rng.randint(1, 12))
        align = g.block_size * rng.choice([1, 2, 3])
        num_tokens = rng.randint(0, 60)
        want = np.zeros(num_tokens // g.block_size, dtype=bool)
        for hit in range(align, num_tokens + 1, align):
            for b in _needed_blocks_ref(g, hit):
                want[b] = True
        assert save_mask(g, num_tokens, align).tolist() == want.tolist(), (g, align, num_tokens)


def test_live_blocks_of_a_sliding_window_follow_vllms_skipped_tokens():
    g = _geom(SW, 4, 10)
    for computed in range(0, 40):
        skipped = max(0, computed - 10 + 1)  # vLLM: tokens before the window of the next token
        lo, hi = g.live_blocks(computed)
        assert hi == computed // 4
        assert lo == min(hi, skipped // 4)
    assert _geom(FULL, 4).live_blocks(17) == (0, 4)


def test_namespaces_of_different_groups_never_alias():
    geoms = [
        GroupGeometry(FULL, 32, shape=(1, 64), dtype="float32"),
        GroupGeometry(MLA, 32, shape=(1, 64), dtype="float32"),
        GroupGeometry(SW, 32, sliding_window=64, shape=(1, 64), dtype="float32"),
        GroupGeometry(SW, 32, sliding_window=128, shape=(1, 64), dtype="float32"),
        GroupGeometry(FULL, 16, shape=(1, 64), dtype="float32"),
        GroupGeometry(FULL, 32, shape=(2, 64), dtype="float32"),
        GroupGeometry(FULL, 32, shape=(1, 64), dtype="bfloat16"),
        GroupGeometry(STATE, 32, shape=(2, 4, 5), dtype="bfloat16"),
        GroupGeometry(STATE, 32, shape=(2, 5, 4), dtype="bfloat16"),
    ]
    names = [g.namespace() for g in geoms]
    assert len(set(names)) == len(names)
    assert all("/" not in n for n in names)


def test_bad_geometry_is_a_clear_error():
    with pytest.raises(ValueError, match="block_size"):
        GroupGeometry(FULL, 0)
    with pytest.raises(ValueError, match="sliding_window"):
        GroupGeometry(SW, 16)
    with pytest.raises(ValueError, match="sliding-window groups only"):
        GroupGeometry(FULL, 16, sliding_window=8)
    with pytest.raises(ValueError, match="whole number"):
        GroupGeometry(FULL, 16).blocks_needed(17)
    with pytest.raises(ValueError, match="presence masks"):
        longest_hit([GroupGeometry(FULL, 16)], [], 16, 64)
    assert longest_hit([], [], 16, 64) == 0
    assert math.lcm(16, 16) == hit_alignment([GroupGeometry(FULL, 16)], 16)


@pytest.mark.vllm
def test_geometry_of_vllms_own_specs():
    import torch
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    full = geometry_of_spec(FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.float32))
    assert (full.kind, full.block_size, full.shape, full.dtype) == (FULL, 32, (2, 64), "float32")
    mla = geometry_of_spec(MLAAttentionSpec(block_size=32, num_kv_heads=1, head_size=96, dtype=torch.bfloat16))
    assert mla.kind is MLA
    sw = geometry_of_spec(SlidingWindowSpec(block_size=32, num_kv_heads=1, head_size=64, dtype=torch.float32,
                                            sliding_window=64))
    assert (sw.kind, sw.sliding_window) == (SW, 64)
    mamba = MambaSpec(block_size=160, shapes=((3, 192), (2, 64, 64)), dtypes=(torch.bfloat16, torch.bfloat16),
                      mamba_cache_mode="align")
    st = geometry_of_spec(mamba)
    assert (st.kind, st.block_size, st.dtype) == (STATE, 160, "bfloat16+bfloat16")
    with pytest.raises(UnsupportedGroup, match="align"):
        geometry_of_spec(MambaSpec(block_size=160, shapes=((3, 192),), dtypes=(torch.bfloat16,)))
    with pytest.raises(UnsupportedGroup, match="ChunkedLocalAttentionSpec"):
        geometry_of_spec(ChunkedLocalAttentionSpec(block_size=32, num_kv_heads=1, head_size=64,
                                                   dtype=torch.float32, attention_chunk_size=64))


# ---- the scheduler with several KV cache groups (no engine) -------------------------------------------------
BS = 4


def _hybrid_scheduler(reach: int, load_async=False):
    from types import SimpleNamespace as NS

    from tierkv.adapters.vllm.config import ConnectorOptions, EngineInfo, kv_shard
    from tierkv.adapters.vllm.scheduler import TierKVScheduler
    from tierkv.adapters.vllm.service import ProbeAnswer

    def ask(rank, request):
        n = max(0, min(len(request.hashes), reach) - request.local)
        return ProbeAnswer(n, min(request.local, reach), [None] * n)

    info = EngineInfo(block_size=BS, layers=("sw", "full"), num_blocks=64, shard=kv_shard(0, 1, 1),
                      namespaces={0: "ns"}, layer_groups=(0, 1),
                      groups=(GroupGeometry(SW, BS, sliding_window=2 * BS), GroupGeometry(FULL, BS)))
    sched = TierKVScheduler(ConnectorOptions(chunk_tokens=BS, load_async=load_async), info, ask=ask)
    return sched, NS


def _hreq(NS, rid: str, blocks: int):
    return NS(request_id=rid, num_tokens=blocks * BS + 1, num_prompt_tokens=blocks * BS + 1,
              block_hashes=[bytes([i]) * 8 for i in range(blocks)], cache_salt=None)


def _out(NS, new=(), scheduled=None):
    cached = NS(req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[])
    return NS(scheduled_new_reqs=list(new), scheduled_cached_reqs=cached, num_scheduled_tokens=scheduled or {},
              preempted_req_ids=set())


@pytest.mark.vllm
def test_a_hybrid_hit_loads_between_steps_with_each_groups_block_ids_and_fails_per_request():
    s, NS = _hybrid_scheduler(reach=4, load_async=False)
    req = _hreq(NS, "r", 4)
    assert s.get_num_new_matched_tokens(req, 0) == (4 * BS, True)  # between steps, whatever load_async says
    ids = ([0, 0, 12, 13, 14], [20, 21, 22, 23, 24])  # the sliding-window group's first blocks are null
    s.update_state_after_alloc(req, NS(get_block_ids=lambda: ids), 4 * BS)
    (load,) = s.build_connector_meta(_out(NS)).async_loads
    assert load.block_ids == [0, 0, 12, 13] and load.group_block_ids == [[0, 0, 12, 13], [20, 21, 22, 23]]
    assert load.ids_of(1) == [20, 21, 22, 23]
    # the load failed: vLLM hands it back per request; the next lookup is a miss, the one after hits
    s.update_connector_output(NS(invalid_block_ids=set(), finished_recving={"r"}, failed_recving={"r"}))
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    assert s.get_num_new_matched_tokens(req, 0) == (4 * BS, True)


@pytest.mark.vllm
def test_hybrid_saves_carry_each_groups_ids_and_skip_chunks_a_group_has_freed():
    s, NS = _hybrid_scheduler(reach=0)
    # computed in one step from token 0: every block of both groups is live, every chunk saved
    a = _hreq(NS, "a", 4)
    assert s.get_num_new_matched_tokens(a, 0) == (0, False)
    s.update_state_after_alloc(a, NS(get_block_ids=lambda: ([], [])), 0)
    new = NS(req_id="a", block_ids=([1, 2, 3, 4, 5], [6, 7, 8, 9, 10]), num_computed_tokens=0)
    (save,) = s.build_connector_meta(_out(NS, [new], {"a": 4 * BS + 1})).saves
    assert save.chunks == [(0, 0), (1, 1), (2, 2), (3, 3)]
    assert save.group_block_ids == [[[1], [2], [3], [4]], [[6], [7], [8], [9]]]
    assert save.ids_of(0) == save.block_ids == [[1], [2], [3], [4]]
    # continued from vLLM's own cache at 3 blocks: the window (8 tokens) before token 12 starts in block 1, so
    # block 0 of the sliding-window group is gone (null) and chunks 0..2 were never saved by this request:
    # chunk 0 cannot be saved (counted), chunks 1 and 2 can
    b = _hreq(NS, "b", 4)
    s.get_num_new_matched_tokens(b, 3 * BS)
    s.update_state_after_alloc(b, NS(get_block_ids=lambda: ([], [])), 0)
    new = NS(req_id="b", block_ids=([0, 32, 33, 34, 35], [40, 41, 42, 43, 44]), num_computed_tokens=3 * BS)
    (save,) = s.build_connector_meta(_out(NS, [new], {"b": BS + 1})).saves
    assert save.chunks == [(1, 1), (2, 2), (3, 3)]
    assert save.group_block_ids == [[[32], [33], [34]], [[41], [42], [43]]]
    assert s.totals.chunks_unsavable == 1


@pytest.mark.vllm
def test_a_model_of_sliding_window_layers_alone_saves_only_blocks_its_group_still_holds():
    """One sliding-window group (every layer slides): served as one group, but a chunk whose block vLLM has freed
    (its id may already hold another request's KV) is never saved."""
    from types import SimpleNamespace as NS

    from tierkv.adapters.vllm.config import ConnectorOptions, EngineInfo, kv_shard
    from tierkv.adapters.vllm.scheduler import TierKVScheduler
    from tierkv.adapters.vllm.service import ProbeAnswer

    info = EngineInfo(block_size=BS, layers=("sw",), num_blocks=64, shard=kv_shard(0, 1, 1), namespaces={0: "ns"},
                      groups=(GroupGeometry(SW, BS, sliding_window=2 * BS),))
    assert info.num_groups == 1 and info.key_name(0) == "sw"  # keys as for any one-group model
    s = TierKVScheduler(ConnectorOptions(chunk_tokens=BS), info,
                        ask=lambda rank, r: ProbeAnswer(0, 0, []))
    b = _hreq(NS, "b", 4)
    s.get_num_new_matched_tokens(b, 3 * BS)
    s.update_state_after_alloc(b, NS(get_block_ids=lambda: ([],)), 0)
    new = NS(req_id="b", block_ids=([0, 32, 33, 34, 35],), num_computed_tokens=3 * BS)
    (save,) = s.build_connector_meta(_out(NS, [new], {"b": BS + 1})).saves
    assert save.chunks == [(1, 1), (2, 2), (3, 3)] and save.block_ids == [[32], [33], [34]]
    assert save.group_block_ids is None
    assert s.totals.chunks_unsavable == 1
