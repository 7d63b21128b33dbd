"""The lookup's probes in C loops (``indexqueries.FAST["leading"]``) answer what the per-key paths do.

Random key lists over levels whose slots are READY, RESERVED (a write in flight), doomed (dropped while
a reader holds them) or absent are asked both ways: ``leading_ready`` of one level, ``leading_in_any``
over several, and a store's ``lookup`` over a chain of two managed tiers.
"""

from __future__ import annotations

import random

import pytest
import torch
from fake_media import FakeTier

from tierkv import TieredStore
from tierkv.engine import indexqueries
from tierkv.engine.indexqueries import leading_in_any
from tierkv.store import Level
from tierkv.tiers.dram import DRAMTier
from tierkv.tiers.slab import ALIGN

C = 4 * ALIGN


def _level(medium: str, rng: random.Random, names: list[str], settled: bool) -> Level:
    """A level holding a random part of ``names``: READY, and unless ``settled`` also RESERVED and doomed."""
    tier = DRAMTier("t", 1 << 22, prefault=False) if medium == "dram" else FakeTier("t", 1 << 22)
    lvl = Level(tier, eviction="lru")
    mine = [k for k in names if rng.random() < 0.7]
    assert lvl.reserve_many(mine, [C] * len(mine)) == [0] * len(mine)
    ready = mine if settled else [k for k in mine if rng.random() < 0.8]
    lvl.commit_many(ready)
    if not settled:
        for k in rng.sample(ready, min(len(ready), 3)):
            lvl.pin_many([k])  # a reader holds it ...
            lvl.drop(k)  # ... so the drop leaves it doomed, not READY
    lvl.check()
    return lvl


def _key_lists(rng: random.Random, names: list[str], lvl_keys: list[str]) -> list[list[str]]:
    """Prefix-shaped lists (a run of held keys, then anything) and lists of random names."""
    out = []
    for _ in range(40):
        head = rng.sample(lvl_keys, rng.randint(0, min(len(lvl_keys), 30))) if lvl_keys else []
        out.append(head + [rng.choice(names) for _ in range(rng.randint(0, 20))])
    out.append([])
    out.append(list(lvl_keys))
    return out


def _both_ways(monkeypatch, fn):
    monkeypatch.setitem(indexqueries.FAST, "leading", True)
    fast = fn()
    monkeypatch.setitem(indexqueries.FAST, "leading", False)
    plain = fn()
    monkeypatch.setitem(indexqueries.FAST, "leading", True)
    return fast, plain


@pytest.mark.parametrize("medium", ["dram", "fake"])
@pytest.mark.parametrize("settled", [True, False])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_leading_ready_fast_and_plain_agree(monkeypatch, medium, settled, seed):
    rng = random.Random(seed)
    names = [f"k{i:03d}" for i in range(120)]
    lvl = _level(medium, rng, names, settled)
    ix = lvl.index
    # the fast path's two probes: presence alone (every slot READY) or the values
    assert (ix.ready_count == len(ix.keys())) is settled
    held = ix.ready_keys()
    lists = _key_lists(rng, names, held) + _key_lists(rng, names, ix.keys())
    fast, plain = _both_ways(monkeypatch, lambda: [lvl.leading_ready(ks) for ks in lists])
    assert fast == plain
    assert len(set(fast)) > 3  # (not every answer 0, nor every one the whole list)
    for ks, n in zip(lists, fast):  # and both are right
        assert all(ix.holds(k) for k in ks[:n]) and (n == len(ks) or not ix.holds(ks[n]))
    lvl.tier.close()


@pytest.mark.parametrize("seed", [4, 5, 6])
def test_leading_in_any_fast_and_plain_agree(monkeypatch, seed):
    rng = random.Random(seed)
    names = [f"k{i:03d}" for i in range(150)]
    levels = [_level(m, rng, names, settled) for m, settled in (("dram", False), ("fake", True), ("fake", False))]
    indexes = [lvl.index for lvl in levels]
    anywhere = [k for k in names if any(ix.holds(k) for ix in indexes)]
    lists = _key_lists(rng, names, anywhere)
    for group in (indexes, indexes[:1], indexes[1:], indexes[::-1]):
        fast, plain = _both_ways(monkeypatch, lambda g=group: [leading_in_any(g, ks) for ks in lists])
        assert fast == plain
        for ks, n in zip(lists, fast):
            assert all(any(ix.holds(k) for ix in group) for k in ks[:n])
            assert n == len(ks) or not any(ix.holds(ks[n]) for ix in group)
    for lvl in levels:
        lvl.tier.close()


def test_an_unhashable_key_met_raises_both_ways(monkeypatch):
    """An unhashable key before the first miss raises ``TypeError`` both ways (the store then names it)."""
    lvl = _level("fake", random.Random(7), ["a", "b", "c"], settled=True)
    present = lvl.index.ready_keys()
    for keys in ([*present, ["x"]], [["x"], *present]):
        for fast in (True, False):
            monkeypatch.setitem(indexqueries.FAST, "leading", fast)
            with pytest.raises(TypeError):
                lvl.leading_ready(keys)
    lvl.tier.close()


@pytest.mark.parametrize("seed", [8, 9])
def test_a_chain_lookup_fast_and_plain_agree(monkeypatch, seed):
    """A store over two managed tiers: every lookup, misses and their errors included, the same both ways."""
    rng = random.Random(seed)
    names = [f"c{i:03d}" for i in range(200)]
    store = TieredStore([DRAMTier("top", 40 * C, prefault=False), FakeTier("low", 1 << 22)], promotion="never")
    try:
        for i in range(0, 160, 8):
            assert all(store.put(names[i:i + 8], [torch.full((C,), i % 251, dtype=torch.uint8)] * 8))
        held = [k for k, where in zip(names, store.locate(names)) if where is not None]
        assert len(set(store.locate(held))) == 2  # (both tiers hold some)
        lists = [*_key_lists(rng, names, held), [*held[:50], "bad/key"], [*held[:5], 7], [*held[:3], ["x"]]]

        def ask() -> list:
            out = []
            for ks in lists:
                try:
                    out.append(store.lookup(ks))
                except (TypeError, ValueError) as e:
                    out.append(f"{type(e).__name__}: {e}")
            return out

        fast, plain = _both_ways(monkeypatch, ask)
        assert fast == plain
        assert any(isinstance(a, str) for a in fast) and len({a for a in fast if isinstance(a, int)}) > 3
    finally:
        store.close()
