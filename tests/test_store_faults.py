"""Misuse, faults and misbehaving plug-ins: never a wrong byte, never a leaked reservation or pin.

Stories first (one defect class each), then a Hypothesis stateful model that injects
policy and medium exceptions mid-batch and checks, after every step, that every
level's ``used`` equals the sum of its live footprints and that no pin or
reservation outlived its call.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from fake_media import FakeTier
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from tierkv import ConfigError, Level, PolicyError, PutOutcome, StoreClosedError, TieredStore
from tierkv.policies import AdmissionPolicy, LRUPolicy
from tierkv.tiers.dram import DRAMTier
from tierkv.tiers.slab import ALIGN

C = 4 * ALIGN


def val(i: int, n: int = C) -> torch.Tensor:
    return torch.full((n,), i % 251, dtype=torch.uint8)


def dram(name: str, slots: int) -> DRAMTier:
    return DRAMTier(name, slots * C, prefault=False)


def assert_clean(store: TieredStore) -> None:
    """What every call must leave behind: exact accounting, no pin, no reservation."""
    store.drain_write_behind()
    with store._chain.lock:
        for lvl in store.levels:
            if not lvl.managed:
                continue
            assert not lvl.pinned, f"{lvl.name}: a pin outlived its call"
            assert all(e.ready and not e.doomed and e.pins == 0 for _, e in lvl.items()), \
                f"{lvl.name}: a reservation outlived its call"
            assert lvl.used == sum(e.footprint for _, e in lvl.items()), f"{lvl.name}: used drifted"
            ready = [e for _, e in lvl.items() if e.ready and not e.doomed]
            assert lvl.ready_count == len(ready), f"{lvl.name}: ready count drifted"
            assert lvl.ready_bytes == sum(e.footprint for e in ready), f"{lvl.name}: ready bytes drifted"
            assert lvl.used <= lvl.capacity
            assert len(lvl.eviction) == len(lvl.keys()), f"{lvl.name}: policy and index disagree"
            lvl.check()


# -- 1. promotion copies only bytes verified for that key ---------------------------------------
def test_one_buffer_for_two_keys_never_poisons_the_upper_tier():
    store = TieredStore([Level(dram("top", 4)), Level(dram("low", 8))], promotion="on-hit")
    store.put(["a", "b"], [val(1), val(2)])
    store.put(["c", "d", "e", "f"], [val(i) for i in range(3, 7)])  # a and b are demoted
    assert store.locate(["a", "b"]) == ["low", "low"]
    shared = torch.empty(C, dtype=torch.uint8)
    store.get(["a", "b"], [shared, shared])  # misuse: one buffer for both keys
    out = torch.empty(C, dtype=torch.uint8)
    for k, i in (("a", 1), ("b", 2)):
        assert store.get([k], [out]) == [True]
        assert torch.equal(out, val(i)), f"{k} served another key's bytes after promotion"
    # overlapping halves of one tensor are caught the same way
    big = torch.empty(C + C // 2, dtype=torch.uint8)
    store.put(["g", "h", "i", "j"], [val(i) for i in range(7, 11)])  # push them down again
    assert store.locate(["a", "b"]) == ["low", "low"]
    store.get(["a", "b"], [big[:C], big[C // 2:]])
    for k, i in (("a", 1), ("b", 2)):
        assert store.get([k], [out]) == [True] and torch.equal(out, val(i))
    assert_clean(store)
    store.close()


def test_distinct_buffers_are_still_promoted():
    store = TieredStore([Level(dram("top", 2)), Level(dram("low", 8))], promotion="on-hit")
    store.put(["a"], [val(1)])
    store.put(["b", "c"], [val(2), val(3)])
    assert store.locate(["a"]) == ["low"]
    out = torch.empty(C, dtype=torch.uint8)
    assert store.get(["a"], [out]) == [True]
    assert store.drain_write_behind(timeout=30)  # (promotion runs on the background queue)
    assert store.locate(["a"]) == ["top"]
    store.close()


# -- 7. a policy that raises in the middle of a batch -------------------------------------------
class RaiseOn(AdmissionPolicy):
    def __init__(self, bad: str):
        self.bad = bad

    def admit(self, key, nbytes, tier):
        if key == self.bad:
            raise RuntimeError("admission exploded")
        return True


def test_admission_raising_mid_batch_releases_every_reservation():
    store = TieredStore([Level(dram("d", 8), admission=RaiseOn("c"))])
    with pytest.raises(PolicyError, match="RaiseOn.admit"):
        store.put(["a", "b", "c"], [val(1), val(2), val(3)])
    assert_clean(store)
    assert store.stats()["d"]["used_bytes"] == 0
    # "a" and "b" are not stuck as busy: a later put stores them and a get finds them
    assert store.put(["a", "b"], [val(1), val(2)]) == [True, True]
    out = torch.empty(C, dtype=torch.uint8)
    assert store.get(["a"], [out]) == [True] and torch.equal(out, val(1))
    assert store.lookup(["a", "b"]) == 2
    store.close()


class BadVictims(LRUPolicy):
    """Names a key the tier does not hold once ``armed``."""

    armed = False

    def victims(self, nbytes, protected):
        if self.armed:
            return ["nope"]
        return super().victims(nbytes, protected)


def test_eviction_naming_bad_victims_releases_the_batch():
    pol = BadVictims()
    store = TieredStore([Level(dram("d", 2), eviction=pol)])
    store.put(["a", "b"], [val(1), val(2)])
    pol.armed = True
    with pytest.raises(PolicyError, match="does not hold"):
        store.put(["c", "d"], [val(3), val(4)])
    assert_clean(store)
    pol.armed = False
    assert store.put(["c"], [val(3)]) == [True]  # the store stays usable
    assert_clean(store)
    store.close()


class RaisingInsert(LRUPolicy):
    armed = False

    def on_insert(self, key, nbytes):
        if self.armed:
            raise ValueError("on_insert exploded")
        super().on_insert(key, nbytes)


def test_on_insert_raising_leaves_no_unevictable_chunk():
    pol = RaisingInsert()
    store = TieredStore([Level(dram("d", 4), eviction=pol)])
    pol.armed = True
    with pytest.raises(PolicyError):
        store.put(["a", "b"], [val(1), val(2)])
    assert_clean(store)
    assert store.stats()["d"]["used_bytes"] == 0 and store.lookup(["a"]) == 0
    pol.armed = False
    assert store.put(["a", "b"], [val(1), val(2)]) == [True, True]
    store.close()


# -- 8. an exception during demotion leaves no victim pinned ------------------------------------
def test_exception_during_demotion_unpins_victims():
    low_adm = RaiseOn("a")
    store = TieredStore([Level(dram("top", 2)), Level(dram("low", 8), admission=low_adm)], promotion="never")
    store.put(["a"], [val(1)])
    store.put(["b"], [val(2)])
    with pytest.raises(PolicyError):
        store.put(["c"], [val(3)])  # evicting "a" asks the lower tier's admission, which raises
    assert_clean(store)
    low_adm.bad = None
    assert store.put(["c"], [val(3)]) == [True]
    assert store.locate(["a", "c"]) == ["low", "top"]
    store.close()


# -- 9. one unit for eviction: footprints ---------------------------------------------------------
def test_full_tier_of_small_chunks_makes_room_for_a_large_one():
    tier = FakeTier("ssdlike", 1 << 20, overhead=4096)  # objects cost more than their bytes (headers, rounding)
    sizes = {}

    class Recording(LRUPolicy):
        def on_insert(self, key, nbytes):
            sizes[key] = nbytes
            super().on_insert(key, nbytes)

    store = TieredStore([Level(tier, eviction=Recording())])
    small = [f"s{i}" for i in range(200)]
    store.put(small, [val(i, 4096) for i in range(200)])
    assert store.stats()["ssdlike"]["used_bytes"] > (1 << 20) - 8192  # full
    assert set(sizes.values()) == {tier.footprint(4096)}  # the policy counts footprints
    assert store.put(["big"], [val(7, 640 << 10)]) == [True]
    assert_clean(store)
    store.close()


# -- 11. options are validated by type ----------------------------------------------------------
@pytest.mark.parametrize("tier,match", [
    ({"medium": "dram", "capacity": "1MiB", "prefault": "no"}, "prefault"),
    ({"medium": "dram", "capacity": "1MiB", "pin_memory": "false"}, "pin_memory"),
    ({"medium": "hbm", "device": "cpu", "capacity": "1MiB", "prefault": 1}, "prefault"),
    ({"medium": "hbm", "device": 0, "capacity": "1MiB"}, "device"),
    ({"medium": "dram", "capacity": "1MiB", "write_through": "false"}, "write_through"),
    ({"medium": "dram", "capacity": "1MiB", "persist": "sometimes"}, "persist"),
    ({"medium": "dram", "capacity": "lots"}, "capacity"),
    ({"medium": "dram", "capacity": True}, "capacity"),
    ({"medium": "dram", "capacity": "1MiB", "name": 5}, "name"),
    ({"medium": "dram", "capacity": "1MiB", "admission": {"policy": "frequency", "min_accesses": "2"}},
     "min_accesses"),
    ({"medium": "dram", "capacity": "1MiB", "admission": {"policy": "size", "max_bytes": "huge"}}, "max_bytes"),
    ({"medium": "dram", "capacity": "1MiB", "eviction": {"policy": "s3fifo", "small_ratio": "0.1"}}, "s3fifo"),
])
def test_bad_option_values_are_config_errors_naming_them(tier, match):
    with pytest.raises(ConfigError, match=match):
        TieredStore.from_config({"tiers": [tier]})


@pytest.mark.parametrize("top,match", [
    ({"io_workers": "4"}, "io_workers"),
    ({"io_workers": 0}, "io_workers"),
    ({"promotion": {"policy": "on-hit", "min_hits": "2"}}, "min_hits"),
    ({"write_behind_queue": -1}, "write_behind_queue"),
])
def test_bad_top_level_values_are_config_errors(top, match):
    with pytest.raises(ConfigError, match=match):
        TieredStore.from_config({"tiers": [{"medium": "dram", "capacity": "1MiB"}], **top})


@pytest.mark.parametrize("extra", [{"write_through": True}, {"write_through": False},
                                   {"write_through": True, "persist": "write_through"}])
def test_the_removed_write_through_option_is_refused_naming_persist(extra):
    with pytest.raises(ConfigError, match="'write_through' is no longer accepted: use \"persist\": \"write_through\""):
        TieredStore.from_config({"tiers": [{"medium": "dram", "capacity": "1MiB", **extra}]})


# -- 12. keys are an ordered sequence of strings, everywhere ------------------------------------
@pytest.fixture
def small_store():
    store = TieredStore([Level(dram("d", 8))])
    store.put(["a", "b", "ab"], [val(1), val(2), val(3)])
    yield store
    store.close()


@pytest.mark.parametrize("method", ["lookup", "locate", "contains", "remove"])
def test_a_bare_string_is_not_a_list_of_keys(small_store, method):
    with pytest.raises(TypeError, match="single string"):
        getattr(small_store, method)("ab")
    assert small_store.contains(["a", "b", "ab"]) == [True, True, True]  # nothing was removed


@pytest.mark.parametrize("method", ["lookup", "locate", "contains", "remove"])
def test_an_unordered_collection_is_refused(small_store, method):
    with pytest.raises(TypeError, match="ordered sequence"):
        getattr(small_store, method)({"a", "b"})


def test_put_and_get_refuse_sets_and_strings(small_store):
    with pytest.raises(TypeError, match="ordered"):
        small_store.put({"x", "y"}, [val(1), val(2)])
    with pytest.raises(TypeError, match="ordered"):
        small_store.get(["a", "b"], {val(1), val(2)})
    with pytest.raises(TypeError, match="single string"):
        small_store.get("a", [val(1)])


@pytest.mark.parametrize("method", ["lookup", "locate", "contains", "get"])
def test_malformed_keys_are_named_on_reads_too(small_store, method):
    args = ([5],) if method != "get" else ([5], [val(0)])
    with pytest.raises(ValueError, match="invalid key"):
        getattr(small_store, method)(*args)


@pytest.mark.parametrize("method", ["lookup", "locate", "contains", "get"])
@pytest.mark.parametrize("bad", [["x"], 5, b"k"], ids=["unhashable", "int", "bytes"])
def test_a_malformed_key_anywhere_in_a_read_is_named(small_store, method, bad):
    """After stored keys, after a miss, or unhashable: every read names the bad key, and holds nothing after."""
    for keys in (["a", bad], ["a", "never-stored", bad], [bad, "a"]):
        args = (keys,) if method != "get" else (keys, [val(0) for _ in keys])
        with pytest.raises(ValueError, match="invalid key"):
            getattr(small_store, method)(*args)
    for lvl in small_store.levels:
        assert not getattr(lvl, "pinned", {})  # nothing left pinned by a refused get
    assert small_store.lookup(["a", "b"]) == 2


def test_errors_never_embed_a_huge_key(small_store):
    with pytest.raises(ValueError) as info:
        small_store.put(["k" * 10_000], [val(1)])
    assert len(str(info.value)) < 300


# -- 13. the async twins after close -----------------------------------------------------------
@pytest.mark.parametrize("method,args", [("aput", (["z"], [val(1)])), ("aget", (["a"], [val(1)])),
                                         ("alookup", (["a"],)), ("aremove", (["a"],))])
def test_async_twins_after_close_raise_store_closed(method, args):
    store = TieredStore([Level(dram("d", 4))])
    store.close()
    with pytest.raises(StoreClosedError):
        asyncio.run(getattr(store, method)(*args))


# -- put says why -------------------------------------------------------------------------------
class Never(AdmissionPolicy):
    def admit(self, key, nbytes, tier):
        return False


def test_put_detailed_says_why():
    store = TieredStore([Level(dram("d", 2))])
    out = store.put_detailed(["a", "a", "big"], [val(1), val(1), val(9, 3 * C)])
    assert out[0] is PutOutcome.STORED and out[1] is PutOutcome.STORED
    assert out[2] is PutOutcome.REJECTED  # larger than the whole tier: refused, never "no room" or an error
    assert store.stats()["tiers"]["d"]["too_large"] == 1
    assert store.put_detailed(["a"], [val(1)]) == [PutOutcome.PRESENT]
    store.close()
    store = TieredStore([Level(dram("d", 2), admission=Never())])
    assert store.put_detailed(["a"], [val(1)]) == [PutOutcome.REJECTED]
    assert store.put(["a"], [val(1)]) == [False]
    store.close()
    failing = FakeTier("d", 2 * C)
    failing.fail_writes = True
    store = TieredStore([Level(failing)])
    assert store.put_detailed(["a"], [val(1)]) == [PutOutcome.ERROR]
    assert_clean(store)
    store.close()


# -- the tier's own contract ---------------------------------------------------------------------
def test_tier_checks_its_contract_before_the_medium_runs():
    t = dram("d", 4)
    with pytest.raises(ValueError, match="2 keys but 1"):
        t.write(["a", "b"], [[val(1)]])
    with pytest.raises(TypeError, match="sequence of strings"):
        t.contains("ab")
    t.close()
    with pytest.raises(StoreClosedError):
        t.read(["a"], [[val(1)]])


# -- the stateful model, with faults ----------------------------------------------------------
class Switch:
    on = False


class FlakyLRU(LRUPolicy):
    def __init__(self, switch):
        super().__init__()
        self.switch = switch

    def victims(self, nbytes, protected):
        if self.switch.on:
            raise RuntimeError("victims exploded")
        return super().victims(nbytes, protected)

    def on_access(self, key):
        if self.switch.on:
            raise RuntimeError("on_access exploded")
        super().on_access(key)


class FlakyAdmission(AdmissionPolicy):
    def __init__(self, switch):
        self.switch = switch

    def admit(self, key, nbytes, tier):
        if self.switch.on and key.endswith("3"):
            raise RuntimeError("admit exploded")
        return True


KEYS = [f"k{i}" for i in range(16)]


def content(key: str) -> torch.Tensor:
    n = C * (1 + int(key[1:]) % 3)
    return torch.full((n,), int(key[1:]) + 1, dtype=torch.uint8)


class FaultMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.pol, self.adm = Switch(), Switch()
        self.mid = FakeTier("mid", 6 * C)  # a medium whose reads and writes can raise
        self.store = TieredStore([
            Level(dram("top", 4), eviction=FlakyLRU(self.pol)),
            Level(self.mid, admission=FlakyAdmission(self.adm)),
            Level(dram("low", 8), eviction="s3fifo"),
        ], promotion="on-hit")

    def teardown(self):
        self.store.close()

    @rule(which=st.sampled_from(["pol", "adm", "med"]), on=st.booleans())
    def toggle(self, which, on):
        if which == "med":
            self.mid.fail_writes = self.mid.fail_reads = on
        else:
            getattr(self, which).on = on

    @rule(ks=st.lists(st.sampled_from(KEYS), min_size=1, max_size=5))
    def put(self, ks):
        try:
            self.store.put(ks, [content(k) for k in ks])
        except PolicyError:
            pass

    @rule(ks=st.lists(st.sampled_from(KEYS), min_size=1, max_size=5))
    def get(self, ks):
        outs = [torch.zeros_like(content(k)) for k in ks]
        try:
            found = self.store.get(ks, outs)
        except PolicyError:
            return
        for k, f, o in zip(ks, found, outs):
            if f:
                assert torch.equal(o, content(k)), "wrong bytes"

    @rule(ks=st.lists(st.sampled_from(KEYS), min_size=1, max_size=3))
    def remove(self, ks):
        self.store.remove(ks)
        assert self.store.contains(ks) == [False] * len(ks)

    @invariant()
    def nothing_outlives_its_call(self):
        assert_clean(self.store)


FaultMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestFaultModel = FaultMachine.TestCase


def test_a_subclass_overriding_a_single_hook_is_still_called():
    seen = []

    class Counting(LRUPolicy):  # overrides on_insert and on_access only, not the batch hooks
        def on_insert(self, key, nbytes):
            seen.append(("insert", key))
            super().on_insert(key, nbytes)

        def on_access(self, key):
            seen.append(("access", key))
            super().on_access(key)

    store = TieredStore([Level(dram("d", 8), eviction=Counting())])
    store.put(["a", "b"], [val(1), val(2)])
    store.get(["a"], [torch.empty(C, dtype=torch.uint8)])
    assert seen == [("insert", "a"), ("insert", "b"), ("access", "a")]
    store.close()
