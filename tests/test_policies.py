"""One suite over every eviction policy, plus promotion and admission behaviour."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv.errors import ConfigError, PolicyError
from tierkv.policies import (
    ADMISSION_POLICIES,
    EVICTION_POLICIES,
    PROMOTION_POLICIES,
    Admission,
    AdmissionCounts,
    AdmissionPolicy,
    AdmitAll,
    AdmitNone,
    AllOf,
    AnyOf,
    ARCPolicy,
    EvictionPolicy,
    FIFOPolicy,
    FrequencyAdmission,
    LFUPolicy,
    LRUPolicy,
    PromoteOnHit,
    PromotionPolicy,
    RateLimitAdmission,
    S3FIFOPolicy,
    SizeAdmission,
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


# -- admission: typed answers, a checked call, composition, throttling -------------------------------------
class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Answering(AdmissionPolicy):
    """Answers what it is given, and remembers what it was asked."""

    def __init__(self, answer) -> None:
        self.answer = answer
        self.asked: list[str] = []

    def admit(self, key, nbytes, tier):
        self.asked.append(key)
        return self.answer


def test_admission_answers_are_an_enum_true_only_for_admit():
    assert [a.value for a in Admission] == ["admit", "reject", "throttled"]
    assert Admission("throttled") is Admission.THROTTLED
    assert bool(Admission.ADMIT) and not Admission.REJECT and not Admission.THROTTLED


@pytest.mark.parametrize("answer,expected", [
    (True, Admission.ADMIT), (False, Admission.REJECT),
    (Admission.ADMIT, Admission.ADMIT), (Admission.REJECT, Admission.REJECT),
    (Admission.THROTTLED, Admission.THROTTLED),
])
def test_decide_turns_the_hook_answer_into_an_admission(answer, expected):
    assert Answering(answer).decide("k", 10, "ssd") is expected


@pytest.mark.parametrize("answer", [None, 1, 0, "yes", "admit"])
def test_decide_refuses_an_answer_of_another_type_naming_the_policy(answer):
    with pytest.raises(PolicyError, match=r"Answering\.admit answered .* for tier 'ssd'"):
        Answering(answer).decide("k", 10, "ssd")


def test_decide_names_the_policy_when_the_hook_raises():
    class Broken(AdmissionPolicy):
        def admit(self, key, nbytes, tier):
            raise KeyError(key)

    with pytest.raises(PolicyError, match=r"Broken\.admit raised for tier 'dram': KeyError"):
        Broken().decide("k", 1, "dram")


def test_every_built_in_decides_through_the_base():
    built = [build_admission(name) for name in ("always", "never", "frequency")]
    built += [build_admission({"policy": "size", "max_bytes": 64}),
              build_admission({"policy": "rate-limit", "bytes_per_s": "1MiB"}),
              build_admission({"policy": "all-of", "policies": ["always"]}),
              build_admission({"policy": "any-of", "policies": ["never"]})]
    assert {type(p).name for p in built} == set(ADMISSION_POLICIES)
    for p in built:
        assert isinstance(p.decide("k", 8, "t"), Admission)


def test_all_of_and_any_of_are_registered_and_built_from_config():
    assert ADMISSION_POLICIES["all-of"] is AllOf and ADMISSION_POLICIES["any-of"] is AnyOf
    a = build_admission({"policy": "all-of",
                         "policies": [{"policy": "frequency", "min_accesses": 2}, {"policy": "size", "max_bytes": 100}]})
    assert isinstance(a, AllOf)
    assert [type(p) for p in a.policies] == [FrequencyAdmission, SizeAdmission]
    a.on_access("k")
    assert a.decide("k", 10, "ssd") is Admission.REJECT  # accessed once, two needed
    a.on_access("k")  # demand reaches the members
    assert a.decide("k", 10, "ssd") is Admission.ADMIT
    assert a.decide("k", 101, "ssd") is Admission.REJECT  # too large
    o = build_admission({"policy": "any-of", "policies": ["never", {"policy": "size", "max_bytes": 100}]})
    assert isinstance(o, AnyOf)
    assert o.decide("k", 10, "ssd") is Admission.ADMIT
    assert o.decide("k", 101, "ssd") is Admission.REJECT


def test_all_of_answers_the_first_refusal_and_asks_no_further():
    admit, throttle, reject = Answering(True), Answering(Admission.THROTTLED), Answering(False)
    assert AllOf(admit, throttle, reject).decide("k", 1, "t") is Admission.THROTTLED
    assert reject.asked == []  # a member after the first refusal is not asked (spends nothing)
    assert AllOf(Answering(True), Answering(False), Answering(Admission.THROTTLED)).decide("k", 1, "t") \
        is Admission.REJECT
    assert AllOf(Answering(True), Answering(Admission.ADMIT)).decide("k", 1, "t") is Admission.ADMIT


def test_any_of_admits_on_the_first_yes_and_otherwise_says_throttled_over_reject():
    first, second = Answering(Admission.ADMIT), Answering(True)
    assert AnyOf(first, second).decide("k", 1, "t") is Admission.ADMIT
    assert second.asked == []
    assert AnyOf(Answering(False), Answering(Admission.THROTTLED)).decide("k", 1, "t") is Admission.THROTTLED
    assert AnyOf(Answering(False), Answering(False)).decide("k", 1, "t") is Admission.REJECT


def test_a_member_that_breaks_its_contract_is_named_inside_a_composite():
    with pytest.raises(PolicyError, match=r"Answering\.admit answered None"):
        AllOf(Answering(True), Answering(None)).decide("k", 1, "t")


@pytest.mark.parametrize("spec,match", [
    ({"policy": "all-of"}, "'all-of' needs 'policies'"),
    ({"policy": "any-of", "policies": []}, "'any-of' needs 'policies'"),
    ({"policy": "all-of", "policies": "frequency"}, "'all-of' needs 'policies'"),
    ({"policy": "all-of", "policies": ["nope"]}, "unknown admission policy 'nope'"),
    ({"policy": "all-of", "policies": [{"policy": "size", "max_bytes": "huge"}]}, "max_bytes"),
    ({"policy": "rate-limit"}, "bad parameters"),
    ({"policy": "rate-limit", "bytes_per_s": "fast"}, "bytes_per_s"),
    ({"policy": "rate-limit", "bytes_per_s": 10, "burst": 0}, "burst"),
])
def test_bad_admission_specs_are_named(spec, match):
    with pytest.raises(ConfigError, match=match):
        build_admission(spec)


def test_composites_take_policy_instances_only():
    with pytest.raises(ConfigError, match="members must be AdmissionPolicy instances"):
        AllOf("frequency")
    with pytest.raises(ConfigError, match="at least one member"):
        AnyOf()


def test_rate_limit_throttles_past_its_budget_and_recovers_with_time():
    clock = FakeClock()
    r = RateLimitAdmission(bytes_per_s=1024, burst=300, clock=clock)
    assert build_admission({"policy": "rate-limit", "bytes_per_s": "1KiB"}).burst == 1024  # burst: one second
    assert [r.decide(f"k{i}", 100, "ssd") for i in range(4)] == [Admission.ADMIT] * 3 + [Admission.THROTTLED]
    clock.now += 1 / 16  # 64 bytes back: not enough for 100
    assert r.decide("k", 100, "ssd") is Admission.THROTTLED
    clock.now += 1 / 16
    assert r.decide("k", 100, "ssd") is Admission.ADMIT
    clock.now += 60  # the bucket refills to its burst, no further
    assert [r.decide(f"k{i}", 100, "ssd") for i in range(4)] == [Admission.ADMIT] * 3 + [Admission.THROTTLED]
    assert r.decide("huge", 301, "ssd") is Admission.REJECT  # could never fit in a burst


def test_admission_counts_record_each_answer_in_one_place():
    counts = AdmissionCounts()
    for answer in (Admission.ADMIT, Admission.ADMIT, Admission.REJECT, Admission.THROTTLED):
        assert counts.record(answer) is answer
    counts.record(Admission.THROTTLED, 3)
    assert counts.as_dict() == {"admitted": 2, "rejected": 1, "throttled": 4}
    with pytest.raises(TypeError):
        counts.record(True)


def test_admits_everything_says_when_the_store_may_skip_asking():
    class Picky(AdmitAll):
        def admit(self, key, nbytes, tier):
            return nbytes < 10

    class Watching(AdmitAll):
        def on_access(self, key):
            pass

    assert AdmitAll().admits_everything and build_admission(None).admits_everything
    assert Watching().admits_everything  # observing demand does not change the answer
    assert not Picky().admits_everything  # overriding admit does
    for p in (AdmitNone(), FrequencyAdmission(), SizeAdmission(10), RateLimitAdmission(10), Answering(True)):
        assert not p.admits_everything
    assert AllOf(AdmitAll(), AdmitAll()).admits_everything
    assert not AllOf(AdmitAll(), SizeAdmission(10)).admits_everything
    assert AnyOf(SizeAdmission(10), AdmitAll()).admits_everything
    assert not AnyOf(SizeAdmission(10), Picky()).admits_everything


# -- one spelling per concept: removed names are refused, naming the one to use ----------------------------
@pytest.mark.parametrize("build,spec,match", [
    (build_eviction, "s3-fifo", "eviction policy 's3-fifo' is no longer a name: use 's3fifo'"),
    (build_eviction, {"policy": "S3-FIFO", "small_ratio": 0.2}, "use 's3fifo'"),
    (build_promotion, "on_hit", "promotion policy 'on_hit' is no longer a name: use 'on-hit'"),
    (build_promotion, {"policy": "on_hit", "min_hits": 2}, "use 'on-hit'"),
    (build_admission, {"policy": "frequency", "threshold": 2},
     "admission policy 'frequency': parameter 'threshold' is no longer accepted: use 'min_accesses'"),
])
def test_removed_spellings_are_refused_naming_the_one_to_use(build, spec, match):
    with pytest.raises(ConfigError, match=match):
        build(spec)


def test_removed_spellings_are_absent_from_the_registries():
    assert "s3-fifo" not in EVICTION_POLICIES and "s3fifo" in EVICTION_POLICIES
    assert "on_hit" not in PROMOTION_POLICIES and "on-hit" in PROMOTION_POLICIES
    with pytest.raises(TypeError):
        FrequencyAdmission(threshold=2)  # type: ignore[call-arg]


def test_observes_demand_says_whether_on_access_needs_calling():
    assert FrequencyAdmission().observes_demand
    for p in (AdmitAll(), AdmitNone(), SizeAdmission(10), RateLimitAdmission(10), Answering(True)):
        assert not p.observes_demand
    assert AllOf(SizeAdmission(10), FrequencyAdmission()).observes_demand
    assert not AnyOf(SizeAdmission(10), AdmitAll()).observes_demand


# -- promotion: the checked call -------------------------------------------------------------------------
class Promoting(PromotionPolicy):
    def __init__(self, answer) -> None:
        self.answer = answer

    def should_promote(self, key, src, dst):
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


def test_promotion_decide_passes_a_bool_through():
    assert Promoting(True).decide("k", "ssd", "hbm") is True
    assert Promoting(False).decide("k", "ssd", "hbm") is False
    assert build_promotion({"policy": "on-hit", "min_hits": 2}).decide("k", "ssd", "hbm") is False


@pytest.mark.parametrize("answer,match", [
    (None, r"Promoting\.should_promote answered None for tier 'ssd'"),
    (1, r"Promoting\.should_promote answered 1"),
    (Admission.ADMIT, r"a promotion answer is True or False"),
    (ValueError("boom"), r"Promoting\.should_promote raised for tier 'ssd': ValueError: boom"),
])
def test_promotion_decide_names_the_policy_on_a_bad_answer(answer, match):
    with pytest.raises(PolicyError, match=match):
        Promoting(answer).decide("k", "ssd", "hbm")


# -- what a policy reports: its own memory and counters (outside a store, and per tier in a store's stats) --
@pytest.mark.parametrize("name", ["lru", "fifo", "lfu", "s3fifo", "arc"])
def test_a_policy_reports_its_memory_and_counters(name):
    from tierkv.policies import build_eviction

    p = build_eviction(name)
    p.capacity_bytes = 10_000
    empty = p.memory_bytes()
    p.on_insert_many([f"k{i}" for i in range(200)], [100] * 200)
    p.on_access_many([f"k{i}" for i in range(0, 200, 3)])
    assert p.memory_bytes() > empty  # (its own containers grew: outside a store it keeps its own metadata)
    c = p.counters()
    assert c["tracked"] == len(p) == 200 and c["follows_level_order"] == 0
    assert all(type(v) is int for v in c.values())
    if name == "s3fifo":
        assert c["small"] + c["main"] == 200 and c["small_bytes"] + c["main_bytes"] == 20_000
    if name == "arc":
        assert c["t1"] + c["t2"] == 200 and c["t2"] > 0


@pytest.mark.parametrize("name", ["lru", "lfu", "s3fifo", "arc"])
def test_the_store_stats_show_each_tiers_policy_report(name):
    import torch

    from tierkv import Level, TieredStore
    from tierkv.tiers.dram import DRAMTier

    store = TieredStore([Level(DRAMTier("d", 1 << 20, prefault=False), eviction=name)], promotion="never")
    try:
        keys = [f"k{i}" for i in range(50)]
        store.put(keys, [torch.full((256,), i, dtype=torch.uint8) for i in range(50)])
        store.get(keys[:10], [torch.empty(256, dtype=torch.uint8) for _ in range(10)])
        rep = store.stats()["d"]["eviction_policy"]
        assert rep["counters"]["tracked"] == 50 and rep["counters"]["follows_level_order"] == 1
        assert type(rep["memory_bytes"]) is int and rep["memory_bytes"] > 0
    finally:
        store.close()


def test_a_policy_whose_report_is_wrong_shows_an_error_and_stats_still_answer():
    from tierkv import Level, TieredStore
    from tierkv.tiers.dram import DRAMTier

    class BadCounters(LRUPolicy):
        def counters(self):
            return {"tracked": "many"}

    store = TieredStore([Level(DRAMTier("d", 1 << 20, prefault=False), eviction=BadCounters())])
    try:
        rep = store.stats()["d"]["eviction_policy"]
        assert "dict of str -> int" in rep["error"]
    finally:
        store.close()
