"""One suite over every eviction policy, plus promotion and admission behaviour."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv.errors import ConfigError
from tierkv.policies import (
    EVICTION_POLICIES,
    ARCPolicy,
    EvictionPolicy,
    FIFOPolicy,
    FrequencyAdmission,
    LFUPolicy,
    LRUPolicy,
    PromoteOnHit,
    S3FIFOPolicy,
    build_admission,
    build_eviction,
    build_promotion,
)

ALL = [LRUPolicy, LFUPolicy, FIFOPolicy, S3FIFOPolicy, ARCPolicy]


@pytest.fixture(params=ALL, ids=lambda c: c.name)
def policy(request) -> EvictionPolicy:
    p = request.param()
    p.capacity_bytes = 1000
    return p


def test_victims_free_enough_and_respect_protected(policy):
    for i in range(10):
        policy.on_insert(i, 10)
    v = policy.victims(35, protected={0, 1})
    assert v is not None
    assert not {0, 1} & set(v)
    assert len(v) == len(set(v)) and sum(10 for _ in v) >= 35


def test_victims_none_when_impossible(policy):
    for i in range(3):
        policy.on_insert(i, 10)
    assert policy.victims(25, protected={0, 1}) is None
    assert policy.victims(31, protected=set()) is None


def test_zero_need_names_nobody(policy):
    policy.on_insert("a", 10)
    assert policy.victims(0, set()) == []


def test_removed_keys_are_never_victims(policy):
    for i in range(5):
        policy.on_insert(i, 10)
    policy.on_remove(2)
    policy.on_remove(99)  # unknown: ignored
    v = policy.victims(40, set())
    assert v is not None and 2 not in v


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["ins", "acc", "rem", "evict"]), st.integers(0, 15),
                              st.integers(1, 50)), max_size=80),
       which=st.sampled_from(ALL))
def test_policy_tracks_exactly_the_live_set(ops, which):
    """Against a model set: victims are always live, distinct, unprotected and sufficient."""
    p = which()
    p.capacity_bytes = 400
    live: dict[int, int] = {}
    for op, k, n in ops:
        if op == "ins" and k not in live:
            p.on_insert(k, n)
            live[k] = n
        elif op == "acc" and k in live:
            p.on_access(k)
        elif op == "rem" and k in live:
            p.on_remove(k)
            del live[k]
        elif op == "evict":
            protected = {x for x in live if x % 3 == 0}
            v = p.victims(n, protected)
            avail = sum(s for x, s in live.items() if x not in protected)
            if v is None:
                assert avail < n
                continue
            assert len(v) == len(set(v))
            assert all(x in live and x not in protected for x in v)
            assert sum(live[x] for x in v) >= n
            for x in v:
                p.on_remove(x)
                del live[x]


def test_lru_order():
    p = LRUPolicy()
    for k in "abc":
        p.on_insert(k, 1)
    p.on_access("a")
    assert p.victims(2, set()) == ["b", "c"]


def test_fifo_ignores_access():
    p = FIFOPolicy()
    for k in "abc":
        p.on_insert(k, 1)
    p.on_access("a")
    assert p.victims(1, set()) == ["a"]


def test_lfu_prefers_rarely_used():
    p = LFUPolicy()
    for k in "abc":
        p.on_insert(k, 1)
    for _ in range(3):
        p.on_access("a")
    p.on_access("c")
    assert p.victims(2, set()) == ["b", "c"]


def test_s3fifo_one_hit_wonders_leave_first_and_ghosts_return_to_main():
    p = S3FIFOPolicy()
    p.capacity_bytes = 10
    p.on_insert("hot", 1)
    p.on_access("hot")
    for k in "wxyz":
        p.on_insert(k, 1)
    v = p.victims(2, set())
    assert "hot" not in v  # read while on probation: graduates
    p.on_remove(v[0])
    p.on_insert(v[0], 1)  # back from the ghost queue: straight to main
    assert v[0] in p._main


def test_arc_adapts_towards_recency_on_ghost_hits():
    p = ARCPolicy()
    p.capacity_bytes = 4
    for k in "abcd":
        p.on_insert(k, 1)
    v = p.victims(1, set())
    p.on_remove(v[0])
    before = p.p
    p.on_insert(v[0], 1)  # a hit in B1
    assert p.p > before


def test_custom_policy_by_subclass_and_by_path():
    class MRU(EvictionPolicy):
        def __init__(self):
            super().__init__()
            self.order = []

        def on_insert(self, key, nbytes):
            self.order.append((key, nbytes))

        def on_access(self, key):
            pass

        def on_remove(self, key):
            self.order = [(k, n) for k, n in self.order if k != key]

        def victims(self, nbytes, protected):
            out, got = [], 0
            for k, n in reversed(self.order):
                if k not in protected and got < nbytes:
                    out.append(k)
                    got += n
            return out if got >= nbytes else None

    assert isinstance(build_eviction(MRU()), MRU)
    assert isinstance(build_eviction("tierkv.policies.eviction:LFUPolicy"), LFUPolicy)
    assert isinstance(build_eviction({"policy": "s3fifo", "small_ratio": 0.2}), S3FIFOPolicy)


@pytest.mark.parametrize("spec,match", [
    ("nope", "unknown eviction policy 'nope'"),
    ("os.path:join", "not a subclass of EvictionPolicy"),
    ("no.such.module:X", "cannot load"),
    ({"policy": "s3fifo", "bad": 1}, "bad parameters"),
])
def test_bad_policy_specs_are_named(spec, match):
    with pytest.raises(ConfigError, match=match):
        build_eviction(spec)


def test_promotion_on_hit_counts_per_key():
    p = build_promotion({"policy": "on-hit", "min_hits": 2})
    assert isinstance(p, PromoteOnHit)
    assert not p.should_promote("a", "ssd", "hbm")
    assert not p.should_promote("b", "ssd", "hbm")
    assert p.should_promote("a", "ssd", "hbm")
    assert not build_promotion("never").should_promote("a", "ssd", "hbm")
    with pytest.raises(ConfigError):
        build_promotion({"policy": "on-hit", "min_hits": 0})


def test_frequency_admission_needs_k_accesses():
    a = build_admission({"policy": "frequency", "min_accesses": 3})
    assert isinstance(a, FrequencyAdmission)
    for _ in range(2):
        a.on_access("k")
    assert not a.admit("k", 10, "ssd")
    a.on_access("k")
    assert a.admit("k", 10, "ssd")
    assert build_admission(None).admit("x", 1, "t")


def test_every_named_policy_builds():
    for name in EVICTION_POLICIES:
        assert isinstance(build_eviction(name), EvictionPolicy)
