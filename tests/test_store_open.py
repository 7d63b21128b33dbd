"""Opening a store over a persistent tier: the index is loaded in bulk, and equals what a per-object
reference computes.

The reference walks the recovered list one object at a time, as the store once did: newest entry of each
key, then the newest keys whose footprints fit.  The store must reach the same index (keys, order, sizes,
accounting) and tell the eviction policy about every key, without reserving or committing one at a time.
"""

from __future__ import annotations

import random

import pytest
import torch
from fake_media import FakeTier

from tierkv import Level, TieredStore
from tierkv.engine.recovery import plan_recovery
from tierkv.errors import PolicyError
from tierkv.policies import EvictionPolicy
from tierkv.tiers.ssd import SSDTier

BUILT_INS = ["lru", "fifo", "lfu", "s3fifo", "arc"]


class RecoveringTier(FakeTier):
    """A persistent fake whose ``recover`` lists what a test says (repeats included), oldest first."""

    def __init__(self, found: list[tuple[str, int]], capacity: int, overhead: int = 0) -> None:
        super().__init__("disk", capacity, persistent=True, overhead=overhead)
        self.found = found
        self.deleted: list[str] = []

    def recover(self):
        return list(self.found)

    def _delete(self, keys):
        self.deleted.extend(keys)
        super()._delete(keys)


def reference(found: list[tuple[str, int]], footprint, room: int) -> list[tuple[str, int]]:
    """Per object, newest first: the newest entry of each key, then the newest keys that fit."""
    seen: set[str] = set()
    newest: list[tuple[str, int]] = []
    for key, nbytes in reversed(found):
        if key not in seen:
            seen.add(key)
            newest.append((key, nbytes))
    kept: list[tuple[str, int]] = []
    used = 0
    for key, nbytes in newest:
        fp = footprint(nbytes)
        if used + fp > room:
            break
        used += fp
        kept.append((key, nbytes))
    kept.reverse()
    return kept


def random_listing(rng: random.Random, n: int, repeat_share: float, sizes: list[int]) -> list[tuple[str, int]]:
    found: list[tuple[str, int]] = []
    for i in range(n):
        # a key listed again (written again): the newest entry counts
        key = rng.choice(found)[0] if found and rng.random() < repeat_share else f"k{i:06d}"
        found.append((key, rng.choice(sizes)))
    return found


def check_level(lvl: Level, want: list[tuple[str, int]]) -> None:
    held = lvl.keys()
    assert held == [k for k, _ in want], "keys or their order differ from the reference"
    assert [lvl.ready_nbytes(k) for k in held] == [nb for _, nb in want]
    lvl.check()  # (each value the shared one of its size, the counts, the policy's)
    fps = sum(lvl.footprint(nb) for _, nb in want)
    assert (lvl.used, lvl.ready_bytes, lvl.ready_count) == (fps, fps, len(want))
    assert not lvl.pinned


@pytest.mark.parametrize("seed", range(12))
def test_open_index_equals_the_per_object_reference(seed):
    rng = random.Random(seed)
    sizes = rng.choice([[4096], [100, 5000, 70000], list(range(1, 40))])
    found = random_listing(rng, rng.randint(0, 600), rng.choice([0.0, 0.1, 0.5]), sizes)
    overhead = rng.choice([0, 64])
    total = sum(nb + overhead for _, nb in dict(found).items())
    cap = max(1, int(total * rng.choice([0.3, 0.8, 1.0, 2.0])))  # a capacity that shrank, or room to spare
    tier = RecoveringTier(found, cap, overhead)
    want = reference(found, tier.footprint, cap)
    store = TieredStore([Level(tier, eviction=rng.choice(BUILT_INS))])
    try:
        check_level(store.levels[0], want)
        kept = {k for k, _ in want}
        assert set(tier.deleted) == {k for k, _ in found} - kept  # what does not fit is deleted, nothing else
        assert store.lookup([k for k, _ in want]) == len(want)
        assert len(store.levels[0].eviction) == len(want)
    finally:
        store.close()


def test_plan_recovery_matches_the_reference_on_repeats_and_trims():
    rng = random.Random(7)
    for _ in range(200):
        found = random_listing(rng, rng.randint(0, 80), 0.3, [1, 2, 3, 10])
        room = rng.randint(0, 120)
        keys = [k for k, _ in found]
        got, sizes, trimmed = plan_recovery(keys, [nb for _, nb in found], lambda nb: nb * 2, room)
        if len(set(got)) != len(got):  # everything fitted as listed: repeats are left to ``Level.adopt``
            got, sizes, trimmed = plan_recovery(keys, [nb for _, nb in found], lambda nb: nb * 2, room,
                                                distinct=True)
        want = reference(found, lambda nb: nb * 2, room)
        assert list(zip(got, sizes.tolist())) == want
        assert set(trimmed) | set(got) == set(keys) and not set(trimmed) & set(got)


def test_open_is_no_per_object_reserve_or_commit(monkeypatch):
    found = [(f"k{i:05d}", 1000) for i in range(500)]

    def refuse(*a, **k):
        raise AssertionError("the open path reserved or committed one object at a time")

    for name in ("reserve", "reserve_many", "commit", "commit_many"):
        monkeypatch.setattr(Level, name, refuse)
    for cls in EvictionPolicy.__subclasses__():  # the built-ins: told in one call, never per key
        monkeypatch.setattr(cls, "on_insert", refuse, raising=False)
    store = TieredStore([Level(RecoveringTier(found, 1 << 30), eviction="lru")])
    try:
        check_level(store.levels[0], found)
    finally:
        store.close()


class CountingPolicy(EvictionPolicy):
    """A user's policy implementing only the four single hooks (FIFO by a dict of its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.order: dict[str, int] = {}

    def on_insert(self, key, nbytes):
        self.order[key] = nbytes

    def on_access(self, key):
        pass

    def on_remove(self, key):
        self.order.pop(key, None)

    def victims(self, nbytes, protected):
        out, freed = [], 0
        for k, n in self.order.items():
            if k not in protected:
                out.append(k)
                freed += n
                if freed >= nbytes:
                    return out
        return None

    def __len__(self):
        return len(self.order)


def test_a_user_policy_is_told_every_recovered_chunk_in_order():
    found = [(f"k{i:03d}", 100 + i % 3) for i in range(300)] + [("k005", 7)]
    pol = CountingPolicy()
    tier = RecoveringTier(found, 1 << 20)
    store = TieredStore([Level(tier, eviction=pol)])
    try:
        want = reference(found, tier.footprint, 1 << 20)
        check_level(store.levels[0], want)
        assert list(pol.order.items()) == [(k, tier.footprint(nb)) for k, nb in want]
    finally:
        store.close()


def test_a_policy_that_raises_on_adopt_leaves_nothing_indexed():
    class Broken(CountingPolicy):
        def on_adopt(self, keys, sizes):
            raise RuntimeError("no")

    tier = RecoveringTier([("a", 10), ("b", 10)], 1 << 20)
    with pytest.raises(PolicyError, match="on_adopt"):
        TieredStore([Level(tier, eviction=Broken())])


@pytest.mark.parametrize("policy", BUILT_INS)
def test_reopen_of_an_ssd_directory_with_removed_and_rewritten_keys(tmp_path, policy):
    rng = random.Random(policy)
    path = str(tmp_path / "ssd")
    t = SSDTier("ssd", 64 << 20, path, direct_io=False)
    live: dict[str, int] = {}
    for step in range(400):
        k = f"key-{rng.randint(0, 150):04d}"
        r = rng.random()
        if r < 0.2:
            t.delete([k])
            live.pop(k, None)
        else:
            nb = rng.choice([64, 300, 4096])
            assert t.write([k], [[torch.full((nb,), step % 251, dtype=torch.uint8)]]) == [True]
            live[k] = nb
    t.close()
    listing = SSDTier("ssd", 64 << 20, path, direct_io=False)
    found = listing.recover()
    listing.close()
    assert dict(found) == live
    cap = sum(SSDTier.footprint(listing, nb) for nb in live.values()) * 2 // 3  # a capacity that shrank
    tier = SSDTier("ssd", 64 << 20, path, direct_io=False)
    tier.capacity_bytes = cap  # (the store sees less room than the directory holds)
    store = TieredStore([Level(tier, eviction=policy)])
    try:
        want = reference(found, tier.footprint, cap)
        check_level(store.levels[0], want)
        assert store.lookup([k for k, _ in want]) == len(want)
        victims = store.levels[0].victims(1)
        assert victims and victims[0] == want[0][0], "the oldest recovered chunk is not the first victim"
    finally:
        store.close()
