"""The built-in eviction policies against a frozen copy of their earlier implementations
(``reference_policies.py``): on any trace of hooks, the same victims in the same order.

The live policy is driven through its batch hooks as often as through the single ones
(the reference only has single hooks), so both paths are held to the same behaviour.
"""

from __future__ import annotations

import pytest
import reference_policies as ref
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv.policies import ARCPolicy, EvictionPolicy, FIFOPolicy, LFUPolicy, LRUPolicy, S3FIFOPolicy

PAIRS = [(LRUPolicy, ref.LRUPolicy), (FIFOPolicy, ref.FIFOPolicy), (LFUPolicy, ref.LFUPolicy),
         (S3FIFOPolicy, ref.S3FIFOPolicy), (ARCPolicy, ref.ARCPolicy)]

keys = st.integers(0, 9).map(lambda i: f"k{i}")  # few keys: reinserts, ghost hits, protected heads
# no zero sizes: the reference S3-FIFO failed on a zero-byte victim (see test_s3fifo_zero_byte_victims)
sizes = st.sampled_from([1, 7, 64, 100, 256, 300, 4096])
op = st.one_of(
    st.tuples(st.just("insert"), st.lists(st.tuples(keys, sizes), min_size=1, max_size=6), st.booleans()),
    st.tuples(st.just("access"), st.lists(keys, min_size=1, max_size=6), st.booleans()),
    st.tuples(st.just("remove"), st.lists(keys, min_size=1, max_size=3), st.booleans()),
    st.tuples(st.just("evict"), st.integers(0, 3000), st.sets(keys, max_size=5)),
    st.tuples(st.just("victims"), st.integers(0, 3000), st.sets(keys, max_size=5)),
)


def replay(new: EvictionPolicy, old, trace) -> list:
    seen = []
    for kind, arg, extra in trace:
        if kind == "insert":
            for k, n in arg:
                old.on_insert(k, n)
            if extra:
                new.on_insert_many([k for k, _ in arg], [n for _, n in arg])
            else:
                for k, n in arg:
                    new.on_insert(k, n)
        elif kind == "access":
            for k in arg:
                old.on_access(k)
            if extra:
                new.on_access_many(arg)
            else:
                for k in arg:
                    new.on_access(k)
        elif kind == "remove":
            for k in arg:
                old.on_remove(k)
            if extra:
                new.on_remove_many(arg)
            else:
                for k in arg:
                    new.on_remove(k)
        else:
            want, got = old.victims(arg, extra), new.victims(arg, extra)
            assert got == want, f"victims({arg}, {sorted(extra)}): {got} != reference {want}"
            seen.append(want)
            if kind == "evict" and want:  # the store removes what it evicts
                for k in want:
                    old.on_remove(k)
                new.on_remove_many(want)
        assert len(new) == len(old)
    return seen


@pytest.mark.parametrize("new_cls,old_cls", PAIRS, ids=[p[0].name for p in PAIRS])
@settings(max_examples=250, deadline=None)
@given(trace=st.lists(op, max_size=40), capacity=st.sampled_from([None, 500, 2000, 10_000]))
def test_same_victims_as_the_reference(new_cls, old_cls, trace, capacity):
    new, old = new_cls(), old_cls()
    new.capacity_bytes = old.capacity_bytes = capacity
    replay(new, old, trace)
    # and the whole remaining order agrees
    assert new.victims(10**9, ()) == old.victims(10**9, ())
    assert new.victims(1, ()) == old.victims(1, ())


def test_the_differential_test_can_fail():
    """A policy that differs (MRU instead of LRU) is caught on a short trace."""

    class MRU(LRUPolicy):
        def victims(self, nbytes, protected):
            out, freed = [], 0
            for k in reversed(self._od):
                out.append(k)
                freed += self._od[k]
                if freed >= nbytes:
                    return out
            return None

    trace = [("insert", [("a", 10), ("b", 10)], False), ("victims", 10, set())]
    with pytest.raises(AssertionError, match="reference"):
        replay(MRU(), ref.LRUPolicy(), trace)


class CountingSingle(EvictionPolicy):
    """A custom policy with only the single hooks: the base batch hooks call them in order."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def on_insert(self, key, nbytes):
        self.calls.append(("insert", key, nbytes))

    def on_access(self, key):
        self.calls.append(("access", key))

    def on_remove(self, key):
        self.calls.append(("remove", key))

    def victims(self, nbytes, protected):
        return None


def test_base_batch_hooks_loop_over_the_single_hooks():
    p = CountingSingle()
    p.on_insert_many(["a", "b"], [1, 2])
    p.on_access_many(["b", "a"])
    p.on_remove_many(["a"])
    assert p.calls == [("insert", "a", 1), ("insert", "b", 2), ("access", "b"), ("access", "a"), ("remove", "a")]


def test_s3fifo_zero_byte_victims():
    """A zero-byte chunk can be a victim and is remembered as a ghost (the reference raised here)."""
    p = S3FIFOPolicy()
    p.capacity_bytes = 100
    p.on_insert("z", 0)
    p.on_insert("a", 10)
    assert p.victims(10, ()) == ["z", "a"]
    assert "z" in p._ghost


# -- through a store: a built-in LRU / FIFO orders its level's entries (no dict of its own); a subclass
# that says ``follows_level_order = False`` keeps its own dict.  The same trace of puts, gets and removes
# must leave the same chunks.
class _OwnLRU(LRUPolicy):
    follows_level_order = False  # (a subclass follows its parent's mode unless it says so)


class _OwnFIFO(FIFOPolicy):
    follows_level_order = False


store_op = st.one_of(
    st.tuples(st.just("put"), st.lists(st.tuples(st.integers(0, 30), st.sampled_from([16, 100, 512, 1500])),
                                       min_size=1, max_size=8)),
    st.tuples(st.just("get"), st.lists(st.integers(0, 30), min_size=1, max_size=8)),
    st.tuples(st.just("remove"), st.lists(st.integers(0, 30), min_size=1, max_size=3)),
)


@pytest.mark.parametrize("shared_cls,own_cls", [(LRUPolicy, _OwnLRU), (FIFOPolicy, _OwnFIFO)],
                         ids=["lru", "fifo"])
@settings(max_examples=120, deadline=None)
@given(trace=st.lists(store_op, max_size=40))
def test_a_policy_ordering_the_level_index_evicts_as_one_with_its_own_dict(shared_cls, own_cls, trace):

    from tierkv import Level, TieredStore
    from tierkv.tiers.dram import DRAMTier

    a_pol, b_pol = shared_cls(), own_cls()
    a = TieredStore([Level(DRAMTier("d", 4096, prefault=False), eviction=a_pol)], promotion="never")
    b = TieredStore([Level(DRAMTier("d", 4096, prefault=False), eviction=b_pol)], promotion="never")
    assert a_pol._order is not None and b_pol._order is None
    sizes: dict[str, int] = {}
    try:
        for kind, arg in trace:
            _step_both(a, b, kind, arg, sizes)
            held_a = a.levels[0].ready_keys()
            a.levels[0].check()
            held_b = set(b_pol._od)
            assert set(held_a) == held_b
            assert held_a == list(b_pol._od)  # the same order: the next victims are the same
            assert len(a_pol) == len(b_pol)
    finally:
        a.close()
        b.close()


# -- through a store: a built-in S3-FIFO, LFU or ARC takes its level's index as its queue of keys not read
# since they entered (S3-FIFO's small, LFU's frequency 1, ARC's T1) and keeps only the rest; a subclass that
# says ``follows_level_order = False`` keeps its own dicts.  The same trace of puts, gets and removes must
# leave the same queues, in the same order.
class _OwnS3FIFO(S3FIFOPolicy):
    follows_level_order = False


class _OwnLFU(LFUPolicy):
    follows_level_order = False


class _OwnARC(ARCPolicy):
    follows_level_order = False


def _ready_not_in(level, others) -> list:
    return [k for k in level.ready_keys() if k not in others]


def _s3fifo_state(level, p):
    if p._order is None:
        small, small_bytes = list(p._small), p._small_bytes
    else:
        small, small_bytes = _ready_not_in(level, p._main), level.ready_bytes - p._main_bytes
    return (small, small_bytes, list(p._main.items()), p._main_bytes, p._freq, list(p._ghost.items()),
            p._ghost_bytes)


def _lfu_state(level, p):
    order = [] if p._order is None else _ready_not_in(level, p._freq)
    order += [k for f in sorted(p._buckets) for k in p._buckets[f]]
    return order, {k: f for k, f in p._freq.items() if f > 1}


def _arc_state(level, p):
    if p._order is None:
        t1, t1_bytes = list(p._t1), p._t1_bytes
    else:
        t1, t1_bytes = _ready_not_in(level, p._t2), level.ready_bytes - p._t2_bytes
    return (t1, t1_bytes, list(p._t2.items()), p._t2_bytes, list(p._b1.items()), list(p._b2.items()),
            p._b1_bytes, p._b2_bytes, p.p)


SHARED = [(S3FIFOPolicy, _OwnS3FIFO, _s3fifo_state), (LFUPolicy, _OwnLFU, _lfu_state),
          (ARCPolicy, _OwnARC, _arc_state)]

queue_store_op = st.one_of(
    st.tuples(st.just("put"), st.lists(st.tuples(st.integers(0, 40), st.sampled_from([16, 100, 512, 1500])),
                                       min_size=1, max_size=8)),
    st.tuples(st.just("get"), st.lists(st.integers(0, 40), min_size=1, max_size=8)),
    st.tuples(st.just("remove"), st.lists(st.integers(0, 40), min_size=1, max_size=3)),
)


@pytest.mark.parametrize("shared_cls,own_cls,state", SHARED, ids=[c[0].name for c in SHARED])
@settings(max_examples=150, deadline=None)
@given(trace=st.lists(queue_store_op, max_size=60), capacity=st.sampled_from([4096, 12288]))
def test_a_policy_queueing_on_the_level_index_evicts_as_one_with_its_own_dicts(shared_cls, own_cls, state,
                                                                                trace, capacity):

    from tierkv import Level, TieredStore
    from tierkv.tiers.dram import DRAMTier

    a_pol, b_pol = shared_cls(), own_cls()
    a = TieredStore([Level(DRAMTier("d", capacity, prefault=False), eviction=a_pol)], promotion="never")
    b = TieredStore([Level(DRAMTier("d", capacity, prefault=False), eviction=b_pol)], promotion="never")
    assert a_pol._order is not None and b_pol._order is None
    sizes: dict[str, int] = {}
    try:
        for kind, arg in trace:
            _step_both(a, b, kind, arg, sizes)
            assert state(a.levels[0], a_pol) == state(b.levels[0], b_pol)  # so the next victims are the same
            assert len(a_pol) == len(b_pol)
        assert a.stats()["total"]["evictions"] == b.stats()["total"]["evictions"]
    finally:
        a.close()
        b.close()


def test_the_store_differential_test_can_fail():
    """A shared S3-FIFO that put its small queue in the wrong order is caught on a short trace."""
    from tierkv import Level
    from tierkv.tiers.dram import DRAMTier

    a = Level(DRAMTier("d", 4096, prefault=False), eviction=S3FIFOPolicy())
    b = Level(DRAMTier("d", 4096, prefault=False), eviction=_OwnS3FIFO())
    try:
        for lvl in (a, b):
            for k in ("x", "y"):
                assert lvl.reserve(k, 16)
                lvl.commit(k)  # (no bytes needed: the index and the policy are what is compared)
        a.index.order().move_to_end(["x"])  # small is now y, x in the level-ordered one
        assert _s3fifo_state(a, a.eviction) != _s3fifo_state(b, b.eviction)
    finally:
        a.tier.close()
        b.tier.close()


def _step_both(a, b, kind: str, arg, sizes: dict[str, int]) -> None:
    """One trace step on two stores, which must answer alike (``sizes``: every key's size so far)."""
    import torch

    if kind == "put":
        ks = [f"k{i}" for i, _ in arg]
        vals = [torch.full((sizes.setdefault(k, n),), i % 251, dtype=torch.uint8) for k, (i, n) in zip(ks, arg)]
        assert a.put(ks, vals) == b.put(ks, vals)
    elif kind == "get":
        ks = [f"k{i}" for i in arg if f"k{i}" in sizes]
        outs = [torch.empty(sizes[k], dtype=torch.uint8) for k in ks]
        outs2 = [torch.empty(sizes[k], dtype=torch.uint8) for k in ks]
        assert a.get(ks, outs) == b.get(ks, outs2)
    else:
        a.remove([f"k{i}" for i in arg])
        b.remove([f"k{i}" for i in arg])


class _CountingLRU(LRUPolicy):
    """A user subclass overriding one hook (and calling its parent's), saying nothing about its mode."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def on_access(self, key):
        self.reads += 1
        super().on_access(key)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_subclass_overriding_a_hook_keeps_its_parents_mode_and_answers(seed):
    """The mode is an ordinary class attribute: a subclass of LRU follows the level as LRU does and evicts
    the same chunks; one that wants its own dict says ``follows_level_order = False`` and gets it."""
    import random

    from tierkv import Level, TieredStore
    from tierkv.tiers.dram import DRAMTier

    rng = random.Random(seed)
    pols = [LRUPolicy(), _CountingLRU(), _OwnLRU()]
    stores = [TieredStore([Level(DRAMTier("d", 4096, prefault=False), eviction=p)], promotion="never")
              for p in pols]
    assert _CountingLRU.follows_level_order and not _OwnLRU.follows_level_order
    assert pols[0]._order is not None and pols[1]._order is not None and pols[2]._order is None
    sizes: dict[str, int] = {}
    try:
        for _ in range(60):
            kind = rng.choice(["put", "put", "get", "remove"])
            arg = ([(rng.randint(0, 30), rng.choice([16, 100, 512, 1500])) for _ in range(rng.randint(1, 6))]
                   if kind == "put" else [rng.randint(0, 30) for _ in range(rng.randint(1, 4))])
            _step_all(stores, kind, arg, sizes)
            held = [s.levels[0].ready_keys() for s in stores]
            assert held[0] == held[1] == list(pols[2]._od), "a subclass changed what is evicted"
            for s in stores:
                s.levels[0].check()
        assert pols[1].reads > 0 and not pols[1]._od and pols[2]._od
    finally:
        for s in stores:
            s.close()


def _step_all(stores: list, kind: str, arg, sizes: dict[str, int]) -> None:
    """One trace step on each store, which must all answer alike."""
    import torch

    if kind == "put":
        ks = [f"k{i}" for i, _ in arg]
        vals = [torch.full((sizes.setdefault(k, n),), i % 251, dtype=torch.uint8) for k, (i, n) in zip(ks, arg)]
        answers = [s.put(ks, vals) for s in stores]
    elif kind == "get":
        ks = [f"k{i}" for i in arg if f"k{i}" in sizes]
        answers = [s.get(ks, [torch.empty(sizes[k], dtype=torch.uint8) for k in ks]) for s in stores]
    else:
        answers = [s.remove([f"k{i}" for i in arg]) for s in stores]
    assert all(x == answers[0] for x in answers)
