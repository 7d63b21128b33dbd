"""The store engine as composed parts: each built alone, promotion off the caller's thread, one staging
mechanism, admission asked in one place, policies behind checked wrappers, the level order as an opt-in."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv import Level, PolicyError, TieredStore
from tierkv.engine.chain import Chain
from tierkv.engine.copier import Copier
from tierkv.engine.departures import Departures
from tierkv.engine.leases import LeaseBook
from tierkv.engine.placer import Placer
from tierkv.engine.reader import Reader
from tierkv.engine.tierio import TierIO
from tierkv.engine.writer import Writer
from tierkv.hooks import CheckedAdmission, CheckedEviction
from tierkv.hostmem import StagingPool
from tierkv.outcome import Admission, MissReason, PutOutcome
from tierkv.policies import AdmissionPolicy, EvictionPolicy, LRUPolicy, build_promotion
from tierkv.tiers.dram import DRAMTier
from tierkv.tiers.slab import ALIGN

C = 4 * ALIGN


def val(i: int) -> torch.Tensor:
    return torch.full((C,), i, dtype=torch.uint8)


def dram(name: str, chunks: int) -> DRAMTier:
    return DRAMTier(name, chunks * C, prefault=False)


def test_each_part_is_built_alone_and_a_put_and_get_run_through_them():
    # the parts a TieredStore holds, built by hand from one chain: no store, no mixin
    chain = Chain([Level(dram("top", 2)), Level(dram("low", 8))])
    departures, leases = Departures(), LeaseBook(chain.lock, chain.levels)
    io, stager = TierIO(chain, departures), StagingPool()
    placer = Placer(chain, io, stager, leases, departures)
    copier = Copier(chain, io, placer, stager, build_promotion("never"))
    writer, reader = Writer(chain, io, placer, copier, departures), Reader(chain, io, copier, leases)
    vals = [val(i) for i in range(4)]
    # put [k0, k1] then [k2, k3] into a 2-chunk top level -> k0, k1 are demoted to "low"
    for at in (0, 2):
        got = writer.put([f"k{i}" for i in range(at, at + 2)], [([v], C) for v in vals[at:at + 2]])
        assert got == [PutOutcome.STORED] * 2
    assert reader.locate(["k0", "k3"]) == ["low", "top"]
    assert reader.lookup(["k0", "k1", "k2", "k3", "nope"]) == 4
    outs = [torch.zeros(C, dtype=torch.uint8) for _ in range(4)]
    assert reader.get([f"k{i}" for i in range(4)], [([o], C) for o in outs]) == [True] * 4
    assert all(torch.equal(o, v) for o, v in zip(outs, vals))
    assert chain.levels[0].counters.demotions == 2
    copier.close()
    stager.release()
    for lvl in chain.levels:
        lvl.tier.close()


def _record_writes(store: TieredStore) -> list[tuple[str, str]]:
    """(tier, thread name) of every write the store's one choke point for tier I/O makes from now on."""
    seen: list[tuple[str, str]] = []
    write = store._io.write

    def recording(lvl, keys, parts, ptrs=None, **kw):
        seen.append((lvl.name, threading.current_thread().name))
        return write(lvl, keys, parts, ptrs, **kw)

    store._io.write = recording  # type: ignore[method-assign]
    return seen


def test_a_get_never_writes_on_the_callers_thread_promotion_runs_on_the_copier():
    # top full, so a promotion into it must make room by demoting into mid: the whole cascade is background
    store = TieredStore([Level(dram("top", 2)), Level(dram("mid", 2)), Level(dram("low", 8))],
                        promotion="on-hit")
    for i in range(6):
        store.put([f"k{i}"], [val(i)])
    assert store.locate(["k0"]) == ["low"]
    writes = _record_writes(store)
    out = torch.empty(C, dtype=torch.uint8)
    assert store.get(["k0"], [out]) == [True] and torch.equal(out, val(0))
    caller = threading.current_thread().name
    assert all(thread != caller for _, thread in writes), writes
    assert store.drain_write_behind(timeout=30)
    assert store.locate(["k0"]) == ["top"]  # promoted, on the copier's thread
    assert {thread for _, thread in writes} == {"tierkv-copier"}
    assert {"top", "mid"} <= {tier for tier, _ in writes}  # the copy up, and the demotion it made room by
    assert store.stats()["low"]["promotions"] == 1
    store.close()


def test_a_full_queue_drops_a_promotion_and_counts_it():
    store = TieredStore([Level(dram("top", 2)), Level(dram("low", 8))], promotion="on-hit", write_behind_queue=0)
    for i in range(4):
        store.put([f"k{i}"], [val(i)])
    out = torch.empty(C, dtype=torch.uint8)
    assert store.get(["k0"], [out]) == [True]
    assert store.drain_write_behind(timeout=30)
    assert store.locate(["k0"]) == ["low"]
    assert store.stats()["total"]["promotions_dropped"] == 1
    store.close()


def test_demotion_stages_through_the_staging_pool():
    store = TieredStore([Level(dram("top", 2)), Level(dram("low", 8))], promotion="never")
    carved: list[list[int]] = []
    carve = store._stager.carve

    def counting(sizes):
        carved.append(list(sizes))
        return carve(sizes)

    store._stager.carve = counting  # type: ignore[method-assign]
    for i in range(4):
        store.put([f"k{i}"], [val(i)])  # k0, k1 demoted
    assert carved and sum(len(s) for s in carved) == 2
    assert store._stager.lent == 0  # every arena given back
    out = torch.empty(C, dtype=torch.uint8)
    assert store.get(["k0"], [out]) == [True] and torch.equal(out, val(0))
    store.close()
    assert store._stager.nbytes == 0


class _SaysNo(AdmissionPolicy):
    def __init__(self) -> None:
        self.asked = 0

    def admit(self, key, nbytes, tier):
        self.asked += 1
        return False


def test_admission_is_asked_once_per_placement_and_every_no_is_counted():
    no = _SaysNo()
    store = TieredStore([Level(dram("top", 8)), Level(dram("low", 8), admission=no, persist="write_behind")],
                        promotion="never")
    store.put(["a", "b", "c"], [val(1), val(2), val(3)])
    assert store.drain_write_behind(timeout=30)
    # each chunk was asked about once for the write-behind copy, and refused: counted once each
    assert no.asked == 3
    low = store.stats()["low"]
    assert low["rejected"] == low["admission"]["rejected"] == 3 and low["admission"]["admitted"] == 0
    assert store.locate(["a", "b", "c"]) == ["top"] * 3
    store.close()


class _Busy(AdmissionPolicy):
    def admit(self, key, nbytes, tier):
        return Admission.THROTTLED if key == "b" else Admission.ADMIT


def test_a_throttled_chunk_goes_on_and_is_counted_apart_from_a_rejection():
    store = TieredStore([Level(dram("top", 8), admission=_Busy()), Level(dram("low", 8))], promotion="never")
    assert store.put(["a", "b"], [val(1), val(2)]) == [True, True]
    assert store.locate(["a", "b"]) == ["top", "low"]
    top = store.stats()["top"]
    assert top["admission"] == {"admitted": 1, "rejected": 0, "throttled": 1}
    assert top["rejected"] == 0
    store.close()


class _Exploding(AdmissionPolicy):
    def admit(self, key, nbytes, tier):
        raise RuntimeError("boom")


def test_the_checked_wrappers_name_policy_hook_and_tier():
    adm = CheckedAdmission(_Exploding(), "dram")
    with pytest.raises(PolicyError, match=r"_Exploding\.admit raised for tier 'dram': RuntimeError: boom"):
        adm.decide("k", 10)

    class NotAList(LRUPolicy):
        def victims(self, nbytes, protected):
            return 42

    ev = CheckedEviction(NotAList(), "hbm")
    with pytest.raises(PolicyError, match="NotAList of tier 'hbm' returned int"):
        ev.victims(10, ())


class _OrderedFIFO(EvictionPolicy):
    """A user policy that follows its level's order (the documented opt-in), evicting in that order."""

    follows_level_order = True

    def __init__(self) -> None:
        super().__init__()
        self.order = None
        self.own: dict = {}

    def follow_order(self, order) -> None:
        self.order = order

    def on_insert(self, key, nbytes):
        if self.order is None:
            self.own[key] = nbytes

    def on_access(self, key):
        pass

    def on_remove(self, key):
        self.own.pop(key, None)

    def victims(self, nbytes, protected):
        out, freed = [], 0
        items = iter(self.order) if self.order is not None else self.own.items()  # (key, footprint)
        for key, fp in items:
            if key in protected:
                continue
            out.append(key)
            freed += fp
            if freed >= nbytes:
                return out
        return None

    def __len__(self):
        return self.order.ready_count() if self.order is not None else len(self.own)


class _OwnOrderedFIFO(_OrderedFIFO):
    follows_level_order = False  # (the mode is inherited: a subclass that keeps its own dict says so)


def test_a_user_policy_opts_into_the_level_order_and_evicts_as_one_with_its_own_dict():
    a_pol, b_pol = _OrderedFIFO(), _OwnOrderedFIFO()
    a = TieredStore([Level(dram("d", 4), eviction=a_pol)], promotion="never")
    b = TieredStore([Level(dram("d", 4), eviction=b_pol)], promotion="never")
    assert a_pol.order is not None and b_pol.order is None
    out = torch.empty(C, dtype=torch.uint8)
    for step in range(12):
        keys = [f"k{step}", f"k{(step * 7) % 10}"]
        for s in (a, b):
            s.put(keys, [val(step), val(step)])
            s.get([keys[0]], [out])
        assert a.levels[0].ready_keys() == b.levels[0].ready_keys()
        assert len(a_pol) == len(b_pol) == a.levels[0].entries()
    a.close()
    b.close()


# -- each fast path beside its general loop: the same trace through a store whose fast paths are switched
# off (the level's batched probes answer "ask one by one", the batch reservation on top is never tried, the
# victims are checked key by key) must give the same answers, counters and level order.
def _general_only(store: TieredStore) -> TieredStore:
    for lvl in store.levels:
        for asked in (lvl, lvl.index):  # (the level hands out its index's questions; the index asks itself)
            asked.probe_sized = lambda keys, sizes: None  # type: ignore[method-assign]
            asked.all_ready = lambda keys: False  # type: ignore[method-assign]
        lvl.index.evictable_footprint = lambda keys: None  # type: ignore[method-assign]
    store._writer._all_on_top_possible = lambda: False  # type: ignore[method-assign]
    return store


def _locate_one_by_one(store: TieredStore, keys: list[str]) -> list:
    """``locate`` as its definition says: the fastest level holding each key READY, asked key by key."""
    return [next((lvl.name for lvl in store.levels if lvl.holds(k)), None) for k in keys]


_trace_op = st.one_of(
    st.tuples(st.just("put"), st.lists(st.tuples(st.integers(0, 24), st.sampled_from([1, 2])), min_size=1,
                                       max_size=10)),
    st.tuples(st.just("get"), st.lists(st.integers(0, 24), min_size=1, max_size=10)),
    st.tuples(st.just("lookup"), st.lists(st.integers(0, 24), min_size=1, max_size=10)),
    st.tuples(st.just("remove"), st.lists(st.integers(0, 24), min_size=1, max_size=3)),
)


@pytest.mark.parametrize("chain", [1, 2], ids=["one-level", "two-levels"])
@pytest.mark.parametrize("policy", ["lru", "fifo", "lfu", "s3fifo", "arc"])
@settings(max_examples=30, deadline=None)
@given(trace=st.lists(_trace_op, max_size=30))
def test_fast_paths_answer_as_their_general_loops(policy, chain, trace):
    def build():
        levels = [Level(dram("top", 6), eviction=policy)]
        if chain == 2:
            levels.append(Level(dram("low", 10), eviction=policy))
        return TieredStore(levels, promotion="never")

    fast, slow = build(), _general_only(build())
    sizes: dict[int, int] = {}
    try:
        for kind, arg in trace:
            if kind == "put":
                keys = [f"k{i}" for i, _ in arg]
                for i, m in arg:
                    sizes.setdefault(i, m)
                vals = [torch.full((sizes[i] * C,), i, dtype=torch.uint8) for i, _ in arg]
                assert fast.put_detailed(keys, vals) == slow.put_detailed(keys, vals)
            elif kind == "get":
                keys = [f"k{i}" for i in arg]
                outs_f = [torch.zeros(sizes.get(i, 1) * C, dtype=torch.uint8) for i in arg]
                outs_s = [torch.zeros(sizes.get(i, 1) * C, dtype=torch.uint8) for i in arg]
                got = fast.get(keys, outs_f)
                assert got == slow.get(keys, outs_s)
                assert all(torch.equal(a, b) for a, b, ok in zip(outs_f, outs_s, got) if ok)
            elif kind == "lookup":
                keys = [f"k{i}" for i in arg]
                assert fast.lookup(keys) == slow.lookup(keys)
                assert fast.locate(keys) == slow.locate(keys) == _locate_one_by_one(fast, keys)
            else:
                fast.remove([f"k{i}" for i in arg])
                slow.remove([f"k{i}" for i in arg])
            for a, b in zip(fast.levels, slow.levels):
                assert a.ready_keys() == b.ready_keys() and a.used == b.used
        sf, ss = fast.stats(), slow.stats()
        for name in ("top", "low")[:chain]:
            for field in ("hits", "misses", "evictions", "demotions", "rejected", "entries", "used_bytes"):
                assert sf[name][field] == ss[name][field], (name, field)
    finally:
        fast.close()
        slow.close()


def test_a_hit_in_a_shared_pool_is_promoted_into_the_managed_level_above():
    from fake_media import FakeTier

    pool = FakeTier("pool", managed=False)
    store = TieredStore([Level(dram("top", 4)), pool], promotion="on-hit")
    pool.write(["p"], [[val(7)]])  # (another process put it into the pool)
    out = torch.empty(C, dtype=torch.uint8)
    assert store.get(["p"], [out]) == [True] and torch.equal(out, val(7))
    assert store.drain_write_behind(timeout=30)
    assert store.locate(["p"]) == ["top"]
    assert store.stats()["pool"]["promotions"] == 1
    out.zero_()
    assert store.get(["p"], [out]) == [True] and torch.equal(out, val(7))
    store.close()


class _CountingPool:
    """A shared pool (FakeTier, unmanaged) that records the keys every write carried."""

    def __init__(self, fail_contains: bool = False):
        from fake_media import FakeTier

        self.tier = FakeTier("pool", managed=False)
        self.tier.gate_writes = False
        self.written: list[str] = []
        inner_write, inner_contains = self.tier._write, self.tier._contains

        def write(keys, srcs):
            self.written += list(keys)
            return inner_write(keys, srcs)

        def contains(keys):
            if fail_contains:
                raise OSError("pool: contains failed")
            return inner_contains(keys)

        self.tier._write, self.tier._contains = write, contains  # type: ignore[method-assign]


def _evict_top(store: TieredStore, n: int, first: int = 100) -> None:
    assert store.put([f"x{i}" for i in range(first, first + n)], [[val(i)] for i in range(first, first + n)]) \
        == [True] * n
    assert store.drain_write_behind(timeout=30)


def test_a_chunk_the_shared_pool_holds_is_not_copied_into_it_again_when_evicted_above():
    # the chunk came from the pool (another instance's put): evicting it from the level above drops
    # it there, the pool is asked once and keeps its copy, nothing is written again
    pool = _CountingPool()
    store = TieredStore([Level(dram("top", 2)), pool.tier], promotion="on-hit")
    pool.tier.write(["p"], [[val(7)]])
    pool.written.clear()
    out = torch.empty(C, dtype=torch.uint8)
    assert store.get(["p"], [out]) == [True] and torch.equal(out, val(7))
    assert store.drain_write_behind(timeout=30) and store.locate(["p"]) == ["top"]
    _evict_top(store, 2)  # two more chunks into a level of two: "p" leaves it
    assert store.locate(["p"]) == ["pool"]
    assert "p" not in pool.written  # (the two new chunks' own demotions may follow; "p" is not rewritten)
    out.zero_()
    assert store.get(["p"], [out]) == [True] and torch.equal(out, val(7))
    store.close()


def test_a_chunk_the_shared_pool_lost_or_cannot_answer_for_is_copied_into_it_when_evicted_above():
    for fail in (False, True):
        pool = _CountingPool(fail_contains=fail)
        store = TieredStore([Level(dram("top", 2)), pool.tier], promotion="on-hit")
        pool.tier.write(["p"], [[val(7)]])
        out = torch.empty(C, dtype=torch.uint8)
        assert store.get(["p"], [out]) == [True]
        assert store.drain_write_behind(timeout=30) and store.locate(["p"]) == ["top"]
        if not fail:
            pool.tier.data.pop("p")  # (the pool evicted it on its own)
        pool.written.clear()
        _evict_top(store, 2)
        assert "p" in pool.written, fail  # demoted: the store keeps the chunk
        if not fail:  # (locate asks the pool too)
            assert store.locate(["p"]) == ["pool"]
        out.zero_()
        assert store.get(["p"], [out]) == [True] and torch.equal(out, val(7))
        store.close()


def test_no_module_outside_chain_assigns_chain_state():
    # the chain's state is changed by its own methods only: no `chain.x = ...`, `chain.x += ...` or
    # `chain.x[k] = ...` anywhere else in the library
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[1]
    pattern = re.compile(r"\b_?chain\.[a-z_]+(\[[^\]]*\])?\s*(=|\+=|-=)[^=]")
    found = []
    for top in ("tierkv", "tiers", "policies", "adapters"):
        for path in sorted((root / top).rglob("*.py")):
            if path.name == "chain.py" and path.parent.name == "engine":
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if pattern.search(line):
                    found.append(f"{path.relative_to(root)}:{n}: {line.strip()}")
    assert pattern.search("self.chain.closed = True") and pattern.search("chain.seen[k] += 1")
    assert not found, "\n".join(found)


def test_the_chain_keeps_no_leases_nor_departures_and_each_part_gets_the_stores():
    # the leases and the miss memory are the store's: built by it, handed to the parts that use them, and
    # never reached through the chain (no attribute, no `chain.leases` / `chain.departures` in the library)
    import pathlib
    import re

    store = TieredStore([Level(dram("top", 2)), Level(dram("low", 3))], miss_memory=7)
    try:
        chain = store._chain
        for name in ("leases", "departures", "departed"):
            assert not hasattr(chain, name), name
        leases, departures = store._leases, store._departures
        assert type(leases) is LeaseBook and type(departures) is Departures and departures.capacity == 7
        assert store._placer.leases is leases and store._reader.leases is leases
        assert store._placer.departures is departures and store._writer.departures is departures
        assert store._io._departures is departures
        # the book pins in the chain's managed levels, fastest first, under the chain's lock
        assert leases._levels == tuple(chain.levels) and leases._lock is chain.lock
        # and each owner is the one at work: a lease the store grants is the book's, an eviction its memory's
        keys = [f"k{i}" for i in range(8)]
        for i, key in enumerate(keys):
            assert store.put([key], [val(i)]) == [True]
        gone = [k for k, where in zip(keys, store.locate(keys)) if where is None]
        assert gone and [d.reason for d in departures.recall(gone)] == [MissReason.EVICTED] * len(gone)
        assert store.why_missing(gone) == [MissReason.EVICTED] * len(gone)
        held = store.locate(keys).index("top")
        lease = store.lease([keys[held]], 30.0)
        assert lease.held == 1 and leases.active == store.stats()["total"]["leases_active"] == 1
        assert leases.leased(chain.levels[0], keys) == {keys[held]}
        assert lease.release() and leases.active == 0
    finally:
        store.close()
    root = pathlib.Path(__file__).resolve().parents[1]
    reach = re.compile(r"\b_?chain\.(leases|departures|departed)\b")
    found = [f"{path.relative_to(root)}:{n}" for top in ("tierkv", "tiers", "policies", "adapters", "bench")
             for path in sorted((root / top).rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1) if reach.search(line)]
    assert reach.search("self._chain.departed(keys, r)") and not reach.search("chain.levels")
    assert not found, found


def test_store_counters_are_gathered_from_their_owners_each_field_once():
    from dataclasses import fields

    from tierkv.stats import CopyCounters, GetCounters, LeaseCounters, PutCounters, StoreCounters

    parts = (PutCounters, GetCounters, CopyCounters, LeaseCounters)
    owned = [f.name for part in parts for f in fields(part)]
    assert sorted(owned) == sorted(f.name for f in fields(StoreCounters))  # each field one owner, none left out
    put, got = PutCounters(put_calls=2, bytes_put=5), GetCounters(hits=3)
    snap = StoreCounters.of(put, got, CopyCounters(), LeaseCounters(leases=1)).as_dict()
    assert list(snap) == [f.name for f in fields(StoreCounters)]  # stats()' order, whoever owns the field
    assert (snap["put_calls"], snap["bytes_put"], snap["hits"], snap["leases"], snap["misses"]) == (2, 5, 3, 1, 0)
