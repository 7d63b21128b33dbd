"""Invariants that need a medium we can hold still: in-flight chunks, shared tiers, faults."""

from __future__ import annotations

import threading

import pytest
import torch
from fake_media import FakeTier

from tierkv import PolicyError, TieredStore
from tierkv.policies import EvictionPolicy
from tierkv.store import Level
from tierkv.tiers.dram import DRAMTier
from tierkv.tiers.slab import ALIGN

C = 4 * ALIGN


def val(i: int) -> torch.Tensor:
    return torch.full((C,), i, dtype=torch.uint8)


def GatedDRAM(name: str, capacity: int) -> FakeTier:
    """A tier whose reads and writes can be held at a gate, to freeze a call mid-flight."""
    return FakeTier(name, capacity)


def SharedPool(name: str = "pool") -> FakeTier:
    """A stand-in for a pool shared with other processes: unmanaged, can go down, can lose objects."""
    return FakeTier(name, managed=False)


def test_a_chunk_being_read_is_not_evicted(tmp_path):
    top = GatedDRAM("top", 2 * C)
    store = TieredStore([top, DRAMTier("low", 8 * C)], promotion="never")
    store.put(["a", "b"], [val(1), val(2)])  # "a" is the LRU victim-to-be
    top.gate_writes = False  # only reads wait at the gate
    top.gate.clear()
    top.entered.clear()
    out = torch.zeros(C, dtype=torch.uint8)
    results: list = []
    reader = threading.Thread(target=lambda: results.append(store.get(["a"], [out])))
    reader.start()
    try:
        assert top.entered.wait(5)  # the read of "a" is in flight, "a" is pinned
        assert "a" in store.levels[0].pinned
        # a put that needs room while the read holds its pin: the victim must be "b", not "a"
        assert store.put(["c"], [val(3)]) == [True]
        assert store.locate(["a", "b", "c"]) == ["top", "low", "top"]
    finally:
        top.gate.set()
        reader.join()
    assert results == [[True]] and torch.equal(out, val(1))
    store.close()


def test_pinned_chunk_survives_a_put_that_needs_room():
    top = GatedDRAM("top", 2 * C)
    store = TieredStore([top, DRAMTier("low", 8 * C)], promotion="never")
    store.put(["a", "b"], [val(1), val(2)])
    lvl = store.levels[0]
    with store._chain.lock:
        lvl.pin("a")  # as a read in flight would
        lvl.pin("b")
    assert store.put(["c"], [val(3)]) == [True]
    assert store.locate(["a", "b", "c"]) == ["top", "top", "low"]  # no victim possible: c went lower
    with store._chain.lock:
        lvl.unpin("a")
    assert store.put(["d"], [val(4)]) == [True]
    assert store.locate(["a", "d"]) == ["low", "top"]  # a, unpinned, was demoted for d
    with store._chain.lock:
        lvl.unpin("b")
    store.close()


def test_removed_while_read_is_freed_after_the_read():
    top = GatedDRAM("top", 4 * C)
    store = TieredStore([top], promotion="never")
    store.put(["a"], [val(1)])
    top.gate.clear()
    top.entered.clear()
    out = torch.zeros(C, dtype=torch.uint8)
    res: list = []
    t = threading.Thread(target=lambda: res.append(store.get(["a"], [out])))
    t.start()
    assert top.entered.wait(5)
    store.remove(["a"])
    lvl = store.levels[0]
    assert store.lookup(["a"]) == 0
    assert lvl.used == lvl.tier.footprint(C)  # still accounted: a reader holds the bytes
    assert store.put(["a"], [val(1)]) == [False]  # cannot reuse the slot while it is read
    top.gate.set()
    t.join()
    assert lvl.used == 0 and not lvl.knows("a")
    lvl.check()
    assert torch.equal(out, val(1))
    store.close()


def test_a_write_in_flight_is_invisible_until_committed():
    top = GatedDRAM("top", 4 * C)
    store = TieredStore([top], promotion="never")
    top.gate.clear()
    top.entered.clear()
    t = threading.Thread(target=lambda: store.put(["a"], [val(1)]))
    t.start()
    assert top.entered.wait(5)
    assert store.lookup(["a"]) == 0
    assert store.get(["a"], [torch.zeros(C, dtype=torch.uint8)]) == [False]
    assert store.put(["a"], [val(1)]) == [True]  # dedup against the reservation
    top.gate.set()
    t.join()
    assert store.lookup(["a"]) == 1
    store.close()


def test_demotion_skips_a_tier_that_refuses_and_lands_lower(tmp_path):
    from tierkv.policies import AdmissionPolicy

    class Never(AdmissionPolicy):
        def admit(self, key, nbytes, tier):
            return False

    store = TieredStore([
        DRAMTier("a", 2 * C),
        Level(DRAMTier("b", 8 * C), admission=Never()),
        DRAMTier("c", 8 * C),
    ], promotion="never")
    for i in range(4):
        store.put([f"k{i}"], [val(i)])
    assert store.locate([f"k{i}" for i in range(4)]) == ["c", "c", "a", "a"]
    store.close()


def test_shared_tier_is_asked_for_what_local_tiers_lack():
    pool = SharedPool()
    store = TieredStore([DRAMTier("local", 2 * C), pool], promotion="never")
    for i in range(4):
        store.put([f"k{i}"], [val(i)])
    assert store.locate([f"k{i}" for i in range(4)]) == ["pool", "pool", "local", "local"]
    assert store.lookup([f"k{i}" for i in range(4)]) == 4
    outs = [torch.zeros(C, dtype=torch.uint8) for _ in range(4)]
    assert store.get([f"k{i}" for i in range(4)], outs) == [True] * 4
    assert all(torch.equal(o, val(i)) for i, o in enumerate(outs))
    s = store.stats()["pool"]
    assert s["hits"] == 2 and s["available"] is True
    # another process' chunk appears in the pool: found, though no local index knows it
    pool.data["foreign"] = val(9).clone()
    assert store.lookup(["foreign"]) == 1
    # the pool goes down: misses, no exception, no calls
    pool.up = False
    calls = pool.calls
    assert store.lookup(["k0", "k1"]) == 0
    assert store.get(["k0"], [outs[0]]) == [False]
    assert pool.calls == calls, "an unavailable tier must not be called"
    assert store.stats()["pool"]["available"] is False
    assert store.put(["new"], [val(7)]) == [True]  # local still serves
    store.close()


def test_a_policy_that_breaks_its_contract_is_named():
    class Liar(EvictionPolicy):
        def on_insert(self, key, nbytes):
            pass

        def on_access(self, key):
            pass

        def on_remove(self, key):
            pass

        def victims(self, nbytes, protected):
            return ["not-there"]

    store = TieredStore([Level(DRAMTier("d", 2 * C), eviction=Liar())])
    store.put(["a", "b"], [val(1), val(2)])
    with pytest.raises(PolicyError, match="Liar.*not-there"):
        store.put(["c"], [val(3)])
    store.close()


def test_a_medium_that_raises_costs_a_miss_not_the_call():
    class Broken(DRAMTier):
        def read_at(self, codes, dsts):
            raise OSError("device fell off the bus")

    store = TieredStore([Broken("b", 4 * C), DRAMTier("ok", 4 * C)], promotion="never")
    store.put(["a"], [val(1)])
    below = store.levels[1]
    with store._chain.lock:  # a second copy below, as after a demotion
        assert below.reserve("a", C)
        below.tier.write_at(below.codes(["a"]), [[val(1)]])
        below.commit("a")  # READY below: indexed and known to its policy
    out = torch.zeros(C, dtype=torch.uint8)
    assert store.get(["a"], [out]) == [True] and torch.equal(out, val(1))  # fell through to the copy below
    assert store.stats()["b"]["errors"] == 1
    store.close()


def test_level_index_holds_ints_and_an_entry_only_for_a_doomed_chunk_still_read():
    lvl = Level(DRAMTier("d", 8 * C))
    assert lvl.reserve_many(["a", "b", "c"], [C, C, 8 * C]) == [0, 0, 2]  # "c" does not fit beside them
    assert lvl.reserve_many(["a"], [C]) == [1]  # reserved already
    assert lvl.entry("a").ready is False and lvl.reserved("a") and lvl.busy("a")
    assert not lvl.holds("a") and lvl.ready_nbytes("a") == -1
    lvl.tier.write_at(lvl.codes(["a", "b"]), [[val(1)], [val(2)]])
    lvl.commit_many(["a", "b"])
    assert lvl.codes(["a"]) != lvl.codes(["b"]) and lvl.ready_codes(["a"]) == lvl.codes(["a"])  # each its slab location
    lvl.check()
    assert lvl.tier.extra_stats()["objects"] == 2 and not lvl.tier._objects  # the slab keeps no entry
    assert lvl.holds("a") and lvl.ready_nbytes("a") == C and lvl.entries() == 2
    assert lvl.used == 2 * lvl.tier.footprint(C)
    lvl.pin_many(["a", "b"])
    lvl.pin("a")
    assert lvl.pinned == {"a": 2, "b": 1} and lvl.entry("a").pins == 2
    assert lvl.victims(C) is None or "a" not in lvl.victims(C)
    lvl.drop("a")  # read by two: doomed, still accounted
    e = lvl.entry("a")
    assert e.doomed and not e.ready and not lvl.holds("a") and lvl.entries() == 1
    assert lvl.used == 2 * lvl.tier.footprint(C)
    lvl.unpin_many(["a", "b"])
    assert lvl.pinned == {"a": 1} and lvl.knows("a")
    lvl.check()
    lvl.unpin("a")  # the last reader frees it
    assert not lvl.knows("a") and lvl.used == lvl.tier.footprint(C) and not lvl.pinned
    assert lvl.tier.contains(["a", "b"]) == [False, True]
    with pytest.raises(PolicyError, match="no reservation"):
        lvl.commit_many(["b"])  # READY, not reserved
    assert lvl.reserve("z", C) and lvl.reserved("z")
    lvl.abort("z")
    assert not lvl.knows("z") and lvl.used == lvl.tier.footprint(C)
    lvl.check()


def test_a_chain_of_shared_pools_alone_serves_gets():
    pool = SharedPool()
    store = TieredStore([pool])
    assert store.put(["a", "b"], [val(1), val(2)]) == [True, True]
    out = [torch.zeros(C, dtype=torch.uint8) for _ in range(3)]
    assert store.get(["a", "b", "c"], out) == [True, True, False]
    assert torch.equal(out[1], val(2)) and store.stats()["total"]["hits"] == 2
    store.close()


@pytest.mark.parametrize("medium", ["dram", "fake"])
def test_chunks_too_large_for_an_index_int_field_keep_exact_sizes_and_accounting(medium):
    """Chunks of 16 MiB and more do not fit the nbytes field of an index int: their size comes from the
    tier (a located slab) or from the value itself (any other medium), and nothing else changes."""
    big = (1 << 24) + 3  # just past the field
    cap = 3 * (big + ALIGN)
    tier = DRAMTier("t", cap, prefault=False) if medium == "dram" else FakeTier("t", cap)
    store = TieredStore([Level(tier)], promotion="never")
    lvl = store.levels[0]
    assert lvl.located == (medium == "dram")
    # one of exactly the field's all-ones value (the marker), one just below, one past it
    vals = {f"b{i}": torch.randint(0, 256, (n,), dtype=torch.uint8)
            for i, n in enumerate([big, (1 << 24) - 1, (1 << 24) - 2])}
    small = torch.arange(100, dtype=torch.uint8)
    assert store.put(list(vals), list(vals.values())) == [True] * 3
    for k, v in vals.items():
        assert lvl.ready_nbytes(k) == v.numel() and lvl.entry(k).footprint == tier.footprint(v.numel())
        out = torch.empty(v.numel(), dtype=torch.uint8)
        assert store.get([k], [out]) == [True] and torch.equal(out, v)
    with pytest.raises(ValueError, match="holds"):  # a wrong-sized buffer is still refused by size
        store.get(["b0"], [torch.empty(big - 1, dtype=torch.uint8)])
    # also one of exactly the marker's size (what the field of b0's int reads): refused, b0 kept
    with pytest.raises(ValueError, match="holds"):
        store.get(["b0"], [torch.empty((1 << 24) - 1, dtype=torch.uint8)])
    assert store.lookup(["b0"]) == 1
    assert lvl.used == sum(tier.footprint(v.numel()) for v in vals.values())
    assert store.put(["s"], [small]) == [True]  # evicts the oldest big chunk
    assert store.lookup(["b0"]) == 0 and store.lookup(["b1", "b2", "s"]) == 3
    assert lvl.used == tier.footprint(small.numel()) + sum(tier.footprint(vals[k].numel()) for k in ("b1", "b2"))
    store.remove(["b1", "b2", "s"])
    assert lvl.used == 0 and not lvl.keys()
    lvl.check()
    if medium == "dram":
        assert tier.used_bytes == 0 and not tier._odd
    store.close()


# -- the index's fast paths against its per-key paths -------------------------------------------------------
def _index_workload(lvl: Level, seed: int, steps: int = 400) -> list:
    """A random workload of the index's mutators on ``lvl`` (as the store drives them: reserve, commit, read
    pins, drops, evictions of pinned victims, aborts); every answer and the whole state after each step."""
    import random

    rng = random.Random(seed)
    sizes = [16, 100, C, 3 * C + 5, (1 << 24) + 3]  # (the last: past an index int's nbytes field)
    names = [f"k{i}" for i in range(40)]
    seen: list = []
    for _ in range(steps):
        op = rng.choice(["reserve", "reserve", "commit", "pin", "unpin", "drop", "evict", "abort"])
        ready = lvl.ready_keys()
        if op == "reserve":
            ks = rng.sample(names, rng.randint(1, 8))  # distinct: the fast path's case, when all are new
            got: object = lvl.reserve_many(ks, [rng.choice(sizes[:4]) if rng.random() < 0.95 else sizes[4]
                                                for _ in ks])
        elif op == "commit":
            ks = [k for k, e in lvl.items() if not e.ready and not e.doomed]
            ks = rng.sample(ks, min(len(ks), rng.randint(1, 6)))
            lvl.commit_many(ks)
            got = ks
        elif op == "pin":
            ks = [rng.choice(ready) for _ in range(rng.randint(1, 4))] if ready else []
            if rng.random() < 0.5:
                ks = list(dict.fromkeys(ks))
            lvl.pin_many(ks)
            got = ks
        elif op == "unpin":
            pinned = [k for k, n in lvl.pinned.items() for _ in range(n)]
            ks = rng.sample(pinned, min(len(pinned), rng.randint(1, 4)))
            if rng.random() < 0.3:
                ks = list(lvl.pinned)  # each once: all of them (the fast path's case)
            lvl.unpin_many(ks)
            got = ks
        elif op == "drop":
            k = rng.choice(names)
            lvl.drop(k)
            got = k
        elif op == "evict":
            got = lvl.victims(rng.choice([1, C, 4 * C, 9 * C]))
            if got is not None:
                lvl.pin_many(got)  # (the placer pins its victims, then evicts them)
                lvl.evict_many(got)
        else:
            ks = [k for k, e in lvl.items() if not e.ready and not e.doomed]
            got = ks[:1]
            for k in got:
                lvl.abort(k)
        lvl.check()
        seen.append((op, got, lvl.used, lvl.ready_count, lvl.ready_bytes, dict(lvl.pinned),
                     [(k, e.nbytes, e.footprint, e.ready, e.pins, e.doomed) for k, e in lvl.items()],
                     sorted(lvl.tier.contains(names)) if not lvl.located else lvl.tier.extra_stats()["objects"]))
    return seen


@pytest.mark.parametrize("medium", ["dram", "fake"])
@pytest.mark.parametrize("policy", ["lru", "s3fifo", "lfu", "arc"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_index_fast_paths_mean_what_the_per_key_paths_do(monkeypatch, medium, policy, seed):
    """Each batched mutator's fast path, switched off (``levelindex.FAST``), gives the same answers and
    leaves the same index, pins, counts, policy order and medium, step by step, on a random workload."""
    from tierkv.engine import levelindex

    def run() -> list:
        cap = 3 * (1 << 24) + 64 * C
        tier = DRAMTier("t", cap, prefault=False) if medium == "dram" else FakeTier("t", cap)
        lvl = Level(tier, eviction=policy)
        try:
            return _index_workload(lvl, seed)
        finally:
            tier.close()

    fast = run()
    for name in levelindex.FAST:
        monkeypatch.setitem(levelindex.FAST, name, False)
    slow = run()
    assert len(fast) == len(slow)
    for i, (a, b) in enumerate(zip(fast, slow)):
        assert a == b, f"step {i} ({a[0]}) differs with the fast paths off"
    assert {s[0] for s in fast} >= {"reserve", "commit", "pin", "unpin", "evict"}


def test_check_names_a_broken_invariant():
    """``check`` is no formality: an index whose counts drifted, or whose pinned key is gone, fails it."""
    from tierkv.engine.indexcheck import IndexInvariantError

    lvl = Level(FakeTier("t", 8 * C))
    assert lvl.reserve_many(["a", "b"], [C, C]) == [0, 0]
    lvl.commit_many(["a", "b"])
    lvl.check()
    lvl.index.used += 1  # (as a bug would)
    with pytest.raises(IndexInvariantError, match="used is"):
        lvl.check()
    lvl.index.used -= 1
    lvl.index._pins["zz"] = 1
    with pytest.raises(IndexInvariantError, match="'zz': pinned"):
        lvl.check()
    del lvl.index._pins["zz"]
    lvl.index._pins["a"] = 1
    lvl.index.ready_count -= 1
    with pytest.raises(IndexInvariantError, match="ready_count"):
        lvl.check()



def test_the_index_checks_itself():
    """``level.index.check()`` is the index's own check: quiet on a sound index, and it names a broken one."""
    from tierkv.engine.indexcheck import IndexInvariantError

    lvl = Level(FakeTier("t", 8 * C))
    assert lvl.reserve_many(["a"], [C]) == [0]
    lvl.commit_many(["a"])
    lvl.index.check()
    lvl.index.used += 1  # (as a bug would)
    with pytest.raises(IndexInvariantError, match="used is"):
        lvl.index.check()
