"""Every answer of the store is true: a yes only for what was done, a clear error for what is refused.

The put stories check the rule a key found present by a ``put`` follows: it counts as used (its
tier's eviction policy hears of an access) and the room the same call makes never takes it.  The
differential tests drive the store, over real media and over the simulator's null media, beside
an LRU written here from that rule alone (nothing of the store's policy code is imported).
"""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest
import torch

from tierkv import TieredStore
from tierkv.policies import EvictionPolicy
from tierkv.tiers.slab import ALIGN
from tierkv.tools.sim import Request, null_store, simulate

CHUNK = 4096
assert CHUNK % ALIGN == 0


def chunk(i: int) -> torch.Tensor:
    return torch.full((CHUNK,), i % 251, dtype=torch.uint8)


def dram_store(blocks: int, eviction: str = "lru") -> TieredStore:
    return TieredStore.from_config({"tiers": [{"medium": "dram", "capacity": blocks * CHUNK,
                                               "eviction": eviction}]})


class PlainLRU:
    """An LRU cache of equal-sized blocks, written from the store's contract alone.

    ``get``: each key present is refreshed, in order.  ``put``: the distinct keys
    present are refreshed in order of first appearance and protected; each missing
    key in turn takes a free slot, or the least recent unprotected block's slot (the
    blocks this put inserts are in flight: they hold slots but are never victims), or
    is refused.  ``lookup``: the leading keys present, no side effect.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[str, None] = OrderedDict()

    def lookup(self, keys: list[str]) -> int:
        n = 0
        for k in keys:
            if k not in self.blocks:
                break
            n += 1
        return n

    def get(self, keys: list[str]) -> list[bool]:
        out = []
        for k in keys:
            out.append(k in self.blocks)
            if k in self.blocks:
                self.blocks.move_to_end(k)
        return out

    def put(self, keys: list[str]) -> list[bool]:
        answer: dict[str, bool] = {}
        protected: set[str] = set()
        for k in keys:
            if k in self.blocks and k not in answer:
                self.blocks.move_to_end(k)
                protected.add(k)
                answer[k] = True
        new: list[str] = []
        for k in keys:
            if k in answer:
                continue
            if len(self.blocks) + len(new) >= self.capacity:
                victim = next((b for b in self.blocks if b not in protected), None)
                if victim is None:
                    answer[k] = False
                    continue
                del self.blocks[victim]
            new.append(k)
            answer[k] = True
        for k in new:
            self.blocks[k] = None
        return [answer[k] for k in keys]


# -- a put never evicts what it reported present -------------------------------------------
def test_a_put_refreshes_the_keys_it_finds_present():
    # [a b c d] fill four slots; a is the least recent when [a e f] comes: a is present,
    # so it is used now, and the room for e and f comes from b and c
    with dram_store(4) as store:
        a, b, c, d, e, f = "abcdef"
        assert store.put([a, b, c, d], [chunk(i) for i in range(4)]) == [True] * 4
        assert store.put([a, e, f], [chunk(0), chunk(4), chunk(5)]) == [True] * 3
        assert store.locate([a, b, c, d, e, f]) == ["dram", None, None, "dram", "dram", "dram"]
        out = torch.empty(CHUNK, dtype=torch.uint8)
        assert store.get([a], [out]) == [True] and torch.equal(out, chunk(0))


@pytest.mark.parametrize("eviction", ["fifo", "lru", "s3fifo", "lfu", "arc"])
def test_a_put_never_evicts_a_key_it_reported_present(eviction):
    # FIFO does not reorder on access: a, the oldest insert, would be its first victim;
    # it is protected while the put that found it present makes room
    with dram_store(4, eviction) as store:
        keys = [f"k{i}" for i in range(4)]
        assert store.put(keys, [chunk(i) for i in range(4)]) == [True] * 4
        assert store.put(["k0", "n0", "n1"], [chunk(0), chunk(7), chunk(8)]) == [True] * 3
        assert store.contains(["k0", "n0", "n1"]) == [True, True, True]
        assert store.stats()["dram"]["entries"] == 4


def test_a_put_whose_present_keys_fill_the_tier_refuses_the_rest():
    # only the present keys could make room: the new one is refused, the present ones stay
    with dram_store(2) as store:
        assert store.put(["a", "b"], [chunk(0), chunk(1)]) == [True, True]
        assert store.put(["a", "b", "c"], [chunk(0), chunk(1), chunk(2)]) == [True, True, False]
        assert store.put_detailed(["b", "a", "c"], [chunk(1), chunk(0), chunk(2)])[2].name == "NO_ROOM"
        assert store.lookup(["a", "b"]) == 2 and store.contains(["c"]) == [False]


def test_a_put_protects_present_keys_in_every_tier_it_demotes_into(tmp_path):
    # hbm holds [x y], dram holds [p q] (x was demoted there before): a put of [p x n0 n1] ...
    cfg = {"tiers": [{"medium": "hbm", "device": "cpu", "capacity": 2 * CHUNK},
                     {"medium": "dram", "capacity": 2 * CHUNK, "eviction": "fifo"}],
           "promotion": {"policy": "never"}}
    with TieredStore.from_config(cfg) as store:
        assert store.put(["p", "q"], [chunk(0), chunk(1)]) == [True, True]
        assert store.put(["x", "y"], [chunk(2), chunk(3)]) == [True, True]
        assert store.locate(["p", "q", "x", "y"]) == ["dram", "dram", "hbm", "hbm"]
        # new chunks push x and y out of hbm into dram, where p is the oldest: p is present
        # in this very put, so the demotions take q and not p
        assert store.put(["p", "n0", "n1"], [chunk(0), chunk(4), chunk(5)]) == [True, True, True]
        assert store.locate(["p", "n0", "n1"]) == ["dram", "hbm", "hbm"]


def test_a_put_tells_the_policy_of_the_present_keys_once_each_in_order():

    class Recorder(EvictionPolicy):
        def __init__(self):
            super().__init__()
            self.order: list[str] = []
            self.accesses: list[str] = []

        def on_insert(self, key, nbytes):
            self.order.append(key)

        def on_access(self, key):
            self.accesses.append(key)

        def on_remove(self, key):
            self.order.remove(key)

        def victims(self, nbytes, protected):
            return [k for k in self.order if k not in protected][: -(-nbytes // CHUNK)] or None

    policy = Recorder()
    from tierkv import Level
    from tierkv.tiers import medium_class

    tier = medium_class("dram").from_config("dram", {"capacity": 8 * CHUNK})
    with TieredStore([Level(tier, eviction=policy)]) as store:
        store.put(["a", "b", "c"], [chunk(0), chunk(1), chunk(2)])
        assert store.put(["c", "x", "a", "c"], [chunk(2), chunk(9), chunk(0), chunk(2)]) == [True] * 4
        assert policy.accesses == ["c", "a"]


# -- the store and the simulator beside an independent LRU -------------------------------
def workload(seed: int, steps: int = 400, universe: int = 24):
    rng = random.Random(seed)
    ops = []
    for _ in range(steps):
        kind = rng.choices(["put", "get", "lookup"], [5, 3, 2])[0]
        keys = [f"k{rng.randrange(universe)}" for _ in range(rng.randint(1, 7))]
        ops.append((kind, keys))
    return ops


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("media", ["real", "null"])
def test_store_matches_an_independent_lru_answer_for_answer(seed, media):
    cap = random.Random(seed).choice([3, 5, 8])
    ref = PlainLRU(cap)
    if media == "real":
        store = dram_store(cap)
    else:
        store = null_store({"tiers": [{"medium": "dram", "capacity": cap * CHUNK, "eviction": "lru"}]})
    out = torch.empty(CHUNK, dtype=torch.uint8)
    evicting_puts_with_present = 0
    try:
        for step, (kind, keys) in enumerate(workload(seed)):
            ids = [int(k[1:]) for k in keys]
            if kind == "put":
                before = len(ref.blocks)
                want = ref.put(keys)
                if any(k in ref.blocks for k in keys) and before + len(set(keys)) > cap:
                    evicting_puts_with_present += 1
                got = store.put(keys, [chunk(i) for i in ids])
            elif kind == "get":
                want = ref.get(keys)
                got = []
                for k, i in zip(keys, ids):  # one at a time: a buffer per key, checked
                    ok = store.get([k], [out])[0]
                    got.append(ok)
                    if ok and media == "real":
                        assert torch.equal(out, chunk(i)), (step, k)
            else:
                want, got = ref.lookup(keys), store.lookup(keys)
            assert got == want, (step, kind, keys)
        assert sorted(k for k in ref.blocks) == sorted(
            k for k in {f"k{i}" for i in range(24)} if store.contains([k])[0])
        assert evicting_puts_with_present > 0  # the workload exercises the rule
    finally:
        store.close()


def test_simulator_matches_an_independent_lru_on_puts_that_find_their_own_keys():
    # requests whose tails hold blocks already cached behind a missing one: the put of the tail
    # finds them present while it makes room for the missing ones
    rng = random.Random(5)
    reqs = []
    for i in range(300):
        ids = [rng.randrange(30) for _ in range(rng.randint(1, 6))]
        reqs.append(Request(float(i), len(ids) * 16, 1, ids, 16))
    for cap in (4, 7, 12):
        ref = PlainLRU(cap)
        hit_tokens = present = 0
        for r in reqs:
            keys = [f"b{h}" for h in r.hash_ids]
            lead = ref.lookup(keys)
            ref.get(keys[:lead])
            hit_tokens += min(lead * r.block_tokens, r.input_length)
            present += lead
            rest = keys[lead:]
            seen: set[str] = set(keys[:lead])
            for k in rest:
                present += k in seen or k in ref.blocks
                seen.add(k)
            ref.put(rest)
        res = simulate(reqs, {"tiers": [{"medium": "dram", "capacity": cap * 16 * 256, "eviction": "lru"}]},
                       bytes_per_token=256)
        assert (res.hit_tokens, res.present_blocks) == (hit_tokens, present), cap


# -- a tensor that holds no bytes is refused ------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float16])
def test_get_and_put_refuse_a_meta_tensor(dtype):
    with dram_store(4) as store:
        assert store.put(["a"], [chunk(1)]) == [True]
        meta = torch.empty(CHUNK // dtype.itemsize if dtype.is_floating_point else CHUNK, dtype=dtype,
                           device="meta")
        with pytest.raises(ValueError, match="meta"):
            store.get(["a"], [meta])
        with pytest.raises(ValueError, match="meta"):
            store.put(["b"], [meta])
        with pytest.raises(ValueError, match="meta"):
            store.put(["b"], [[chunk(2)[: CHUNK // 2], meta[: CHUNK // 2]]])
        assert store.contains(["b"]) == [False]


def test_an_hbm_tier_on_the_meta_device_is_refused():
    from tierkv.errors import ConfigError

    with pytest.raises(ConfigError, match="meta"):
        TieredStore.from_config({"tiers": [{"medium": "hbm", "device": "meta", "capacity": 4 * CHUNK}]})


# -- a policy can never evict a pinned chunk --------------------------------------------------
class Unpinning(EvictionPolicy):
    """An eviction policy (oldest first) whose ``victims`` tries to empty the ``protected`` it is given."""

    name = "unpinning"

    def __init__(self):
        super().__init__()
        self.order: list[str] = []
        self.tried = 0

    def on_insert(self, key, nbytes):
        self.order.append(key)

    def on_access(self, key):
        pass

    def on_remove(self, key):
        self.order.remove(key)

    def victims(self, nbytes, protected):
        self.tried += 1
        for change in (lambda: protected.clear(), lambda: protected.pop(self.order[0]),
                       lambda: protected.discard(self.order[0])):
            try:
                change()
            except (AttributeError, TypeError, KeyError):
                pass
        return self.order[: -(-nbytes // CHUNK)]

    def __len__(self):
        return len(self.order)


def test_a_policy_changing_its_protected_argument_cannot_evict_a_chunk_being_read():
    import threading

    from tierkv import Level
    from tierkv.errors import PolicyError
    from tierkv.tiers.dram import DRAMTier

    class Gated(DRAMTier):
        reading, go = threading.Event(), threading.Event()

        def read_at(self, codes, dsts, ptrs=None):
            self.reading.set()
            assert self.go.wait(10)
            return super().read_at(codes, dsts, ptrs)

    policy = Unpinning()
    tier = Gated("dram", 2 * CHUNK, prefault=False)
    store = TieredStore([Level(tier, eviction=policy)], promotion="never")
    try:
        assert store.put(["a", "b"], [chunk(1), chunk(2)]) == [True, True]
        out = torch.zeros(CHUNK, dtype=torch.uint8)
        got: list = []
        reader = threading.Thread(target=lambda: got.append(store.get(["a"], [out])))
        reader.start()
        assert tier.reading.wait(10)  # a is pinned by the reader, mid-read
        # the policy names a (its oldest) after trying to unpin it: refused, a stays
        with pytest.raises(PolicyError):
            store.put(["c"], [chunk(3)])
        assert policy.tried >= 1
        tier.go.set()
        reader.join(10)
        assert got == [[True]] and torch.equal(out, chunk(1))
        assert store.levels[0].pinned == {} and store.contains(["a", "b", "c"]) == [True, True, False]
    finally:
        tier.go.set()
        store.close()


def test_a_victims_generator_that_raises_is_a_policy_error():
    from tierkv import Level
    from tierkv.errors import PolicyError
    from tierkv.tiers.dram import DRAMTier

    class Exploding(Unpinning):
        def victims(self, nbytes, protected):
            yield self.order[0]
            raise RuntimeError("boom")

    store = TieredStore([Level(DRAMTier("dram", 2 * CHUNK, prefault=False), eviction=Exploding())])
    try:
        store.put(["a", "b"], [chunk(1), chunk(2)])
        with pytest.raises(PolicyError, match="Exploding.*RuntimeError: boom"):
            store.put(["c"], [chunk(3)])
        assert store.lookup(["a", "b"]) == 2 and store.levels[0].pinned == {}
        assert store.stats()["dram"]["used_bytes"] == 2 * CHUNK
    finally:
        store.close()


def test_one_policy_object_for_two_tiers_is_refused():
    from tierkv import Level
    from tierkv.errors import ConfigError
    from tierkv.policies.eviction import LRUPolicy
    from tierkv.tiers.dram import DRAMTier

    shared = LRUPolicy()
    first = Level(DRAMTier("a", 4 * CHUNK, prefault=False), eviction=shared)
    second = DRAMTier("b", 4 * CHUNK, prefault=False)
    with pytest.raises(ConfigError, match="already serves tier 'a'; give tier 'b' its own instance"):
        Level(second, eviction=shared)
    with pytest.raises(ConfigError, match="already serves tier 'a'"):  # in another store too
        TieredStore([Level(second, eviction=shared)])
    store = TieredStore([first])
    assert store.put(["k"], [chunk(1)]) == [True]
    store.close()
    # once the tier it served is closed, the object may serve another (a fresh one is the clear way)
    with TieredStore([Level(second, eviction=LRUPolicy())]) as other:
        assert other.put(["k"], [chunk(1)]) == [True]


def test_a_chain_naming_one_policy_object_twice_is_refused():
    from tierkv import Level
    from tierkv.errors import ConfigError
    from tierkv.policies.eviction import LRUPolicy
    from tierkv.tiers.dram import DRAMTier

    a, b = Level(DRAMTier("a", 4 * CHUNK, prefault=False), eviction=LRUPolicy()), \
        Level(DRAMTier("b", 4 * CHUNK, prefault=False), eviction="lru")
    b.eviction = a.eviction  # (a chain assembled by hand)
    with pytest.raises(ConfigError, match="'a' and 'b' share one eviction policy"):
        TieredStore([a, b])
    a.tier.close()
    b.tier.close()
    pol = LRUPolicy()
    with pytest.raises(ConfigError, match="already serves tier 'dram'"):
        TieredStore.from_config({"tiers": [{"medium": "dram", "capacity": 4 * CHUNK, "eviction": pol},
                                           {"medium": "dram", "name": "d2", "capacity": 4 * CHUNK, "eviction": pol}]})
    with TieredStore.from_config({"tiers": [{"medium": "dram", "capacity": 4 * CHUNK, "eviction": pol}]}) as store:
        assert store.put(["k"], [chunk(1)]) == [True]  # the refused chain's tiers were closed


# -- one bad key, one bad chunk --------------------------------------------------------------
@pytest.mark.parametrize("bad", ["b\udc80", "\ud800" * 60])
def test_a_key_that_is_not_utf8_is_refused_at_the_door(tmp_path, bad):
    cfg = {"tiers": [{"medium": "dram", "capacity": 8 * CHUNK},
                     {"medium": "ssd", "path": str(tmp_path / "ssd"), "capacity": "16MiB"}]}
    with TieredStore.from_config(cfg) as store:
        with pytest.raises(ValueError, match="UTF-8"):
            store.put(["good", bad], [chunk(1), chunk(2)])
        for call in (lambda: store.get([bad], [torch.empty(CHUNK, dtype=torch.uint8)]),
                     lambda: store.lookup(["good", bad]), lambda: store.locate([bad]),
                     lambda: store.remove([bad])):
            with pytest.raises(ValueError, match="UTF-8"):
                call()
        assert store.put(["good"], [chunk(1)]) == [True]
        assert store.flush()


def poison_writes(tier, poison: str):
    """Make ``tier`` raise on any write batch that holds ``poison`` (the rest of it written as usual)."""
    real = tier._write

    def write(keys, srcs):
        if poison in keys:
            raise OSError(f"cannot write {poison}")
        return real(keys, srcs)

    tier._write = write


def ssd_cfg(tmp_path, persist=None, top=64):
    ssd = {"medium": "ssd", "path": str(tmp_path / "ssd"), "capacity": "16MiB"}
    if persist:
        ssd["persist"] = persist
    return {"tiers": [{"medium": "dram", "capacity": top * CHUNK}, ssd], "promotion": {"policy": "never"}}


def test_a_chunk_the_medium_fails_to_write_takes_no_other_with_it(tmp_path):
    cfg = {"tiers": [{"medium": "ssd", "path": str(tmp_path / "ssd"), "capacity": "16MiB"}]}
    with TieredStore.from_config(cfg) as store:
        poison_writes(store.levels[0].tier, "k1")
        got = store.put_detailed(["k0", "k1", "k2"], [chunk(0), chunk(1), chunk(2)])
        assert [o.name for o in got] == ["STORED", "ERROR", "STORED"]
    with TieredStore.from_config(cfg) as store:
        assert store.contains(["k0", "k1", "k2"]) == [True, False, True]


def test_write_behind_loses_only_the_chunk_that_failed(tmp_path):
    keys = [f"k{i}" for i in range(41)]
    with TieredStore.from_config(ssd_cfg(tmp_path)) as store:
        poison_writes(store.levels[1].tier, "k20")
        assert store.put(keys, [chunk(i) for i in range(41)]) == [True] * 41
        res = store.flush()
        assert not res and res.not_durable == 1 and res.keys == ("k20",)  # the one chunk lost, named
        assert store.stats()["ssd"]["errors"] == 1
    with TieredStore.from_config(ssd_cfg(tmp_path)) as store:
        assert store.locate(keys) == ["ssd"] * 20 + [None] + ["ssd"] * 20
        out = torch.empty(CHUNK, dtype=torch.uint8)
        assert store.get(["k40"], [out]) == [True] and torch.equal(out, chunk(40))


def test_demotion_loses_only_the_chunk_that_failed(tmp_path):
    with TieredStore.from_config(ssd_cfg(tmp_path, persist="on_evict", top=8)) as store:
        poison_writes(store.levels[1].tier, "k3")
        keys = [f"k{i}" for i in range(16)]
        for i in range(0, 16, 4):  # the last batches push the first eight down to the ssd
            assert store.put(keys[i:i + 4], [chunk(j) for j in range(i, i + 4)]) == [True] * 4
        where = store.locate(keys)
        assert where[:8] == ["ssd"] * 3 + [None] + ["ssd"] * 4 and where[8:] == ["dram"] * 8


@pytest.mark.parametrize("cap, match", [
    ("1.5", "not a whole number of bytes"), ("1.9", "not a whole number of bytes"),
    ("1.5B", "not a whole number of bytes"), ("1" * 400, "larger than"), ("x" * 5000, "cannot parse"),
    (10 ** 400, "larger than"),
])
def test_a_capacity_that_is_no_whole_size_is_refused_briefly(cap, match):
    from tierkv.errors import ConfigError

    with pytest.raises(ConfigError, match=match) as err:
        TieredStore.from_config({"tiers": [{"medium": "dram", "capacity": cap}]})
    assert len(str(err.value)) < 200


def test_a_fractional_size_of_a_larger_unit_is_exact():
    from tierkv.units import parse_size

    assert parse_size("1.5KiB") == 1536 and parse_size("0.5MiB") == 1 << 19 and parse_size("2.25GB") == 2_250_000_000


def test_serve_on_a_busy_port_leaves_nothing_attached():
    import socket

    from tierkv import metrics

    with dram_store(4) as store, socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        with pytest.raises(OSError):
            metrics.serve(store, busy.getsockname()[1])
        assert store.observers() == ()
        ok = metrics.serve(store, 0)  # a free port still works: nothing was left registered
        try:
            assert len(store.observers()) == 1
        finally:
            ok.stop()
        assert store.observers() == ()


# -- the rest of the family: answers that said more than was done ------------------------------
def test_a_put_of_a_present_key_with_other_bytes_than_stored_is_refused():
    # a key names its bytes: the same key with a chunk of another size is not "present", it is misuse
    from tierkv import BufferSizeError

    with dram_store(4) as store:
        assert store.put(["a", "b"], [chunk(1), chunk(2)]) == [True, True]
        for batch in (["a"], ["c", "a"], ["c", "a", "a"]):
            with pytest.raises(BufferSizeError, match="holds 100 bytes but the stored chunk has 4096"):
                store.put(batch, [torch.zeros(100, dtype=torch.uint8) if k == "a" else chunk(3) for k in batch])
        lvl = store.levels[0]
        assert lvl.pinned == {} and store.contains(["c"]) == [False]
        assert store.stats()["dram"]["used_bytes"] == 2 * CHUNK


def test_a_delete_the_medium_fails_is_counted(tmp_path):
    cfg = {"tiers": [{"medium": "ssd", "path": str(tmp_path / "ssd"), "capacity": "16MiB"}]}
    with TieredStore.from_config(cfg) as store:
        assert store.put(["a", "b"], [chunk(1), chunk(2)]) == [True, True]
        tier = store.levels[0].tier

        def broken(keys):
            raise OSError("cannot delete")

        tier.delete = broken
        store.remove(["a"])
        assert store.contains(["a", "b"]) == [False, True]
        assert store.stats()["ssd"]["errors"] == 1


@pytest.mark.parametrize("cfg, match", [
    ({"io_workers": 10 ** 400}, "io_workers.*at most 256"),
    ({"shadow": {"rate": 10 ** 400}}, "shadow rate.*finite"),
    ({"write_behind_queue": -10 ** 400}, "write_behind_queue.*at least 0"),
])
def test_a_huge_number_in_the_config_is_a_short_config_error(cfg, match):
    from tierkv.errors import ConfigError

    with pytest.raises(ConfigError, match=match) as err:
        TieredStore.from_config({"tiers": [{"medium": "dram", "capacity": 4 * CHUNK}], **cfg})
    assert len(str(err.value)) < 200


class Watching:
    """An admission policy that takes everything and signals each put's arrival (its ``on_access`` runs in the
    same lock hold in which a put sorts its keys into present and new)."""

    def __init__(self):
        import threading

        self.seen = 0
        self.second = threading.Event()

    def admit(self, key, nbytes, tier):
        return True

    def on_access(self, key):
        self.seen += 1
        if self.seen == 2:
            self.second.set()


@pytest.mark.parametrize("first_write_fails", [True, False])
def test_a_put_of_a_key_another_put_is_writing_answers_what_became_of_it(first_write_fails):
    import threading

    from fake_media import FakeTier

    from tierkv import Level
    from tierkv.policies import AdmissionPolicy

    class FirstWrite(FakeTier):
        def _write(self, keys, srcs):
            self.fail_writes = first_write_fails and self.calls == 0
            return super()._write(keys, srcs)

    class Admit(Watching, AdmissionPolicy):
        pass

    tier = FirstWrite("fake", 8 * CHUNK)
    adm = Admit()
    store = TieredStore([Level(tier, admission=adm)])
    try:
        tier.gate.clear()  # the first put stops inside its write of k
        got: dict[str, list] = {}
        a = threading.Thread(target=lambda: got.setdefault("a", store.put_detailed(["k"], [chunk(1)])))
        a.start()
        assert tier.entered.wait(10)
        b = threading.Thread(target=lambda: got.setdefault("b", store.put_detailed(["k"], [chunk(1)])))
        b.start()
        assert adm.second.wait(10)  # b found k being written
        tier.gate.set()
        a.join(10)
        b.join(10)
        assert [o.name for o in got["a"]] == (["ERROR"] if first_write_fails else ["STORED"])
        # b's answer is what it left: stored by itself when a's write failed, else present
        assert [o.name for o in got["b"]] == (["STORED"] if first_write_fails else ["PRESENT"])
        assert store.contains(["k"]) == [True]
        assert tier.calls == 2 if first_write_fails else tier.calls == 1
        t = store.stats()["total"]
        assert (t["put_calls"], t["chunks_put"], t["chunks_stored"], t["chunks_deduped"]) == \
            ((2, 2, 1, 0) if first_write_fails else (2, 2, 1, 1))
    finally:
        tier.gate.set()
        store.close()


def test_a_namespace_or_block_hash_that_is_not_utf8_is_named():
    from tierkv import chunk_keys
    from tierkv.keys import keys_from_block_hashes

    with pytest.raises(ValueError, match="namespace .* cannot be encoded as UTF-8"):
        chunk_keys([1, 2, 3, 4], chunk_tokens=2, namespace="m\udc80")
    with pytest.raises(ValueError, match="namespace .* cannot be encoded as UTF-8"):
        keys_from_block_hashes([b"x"], namespace="\ud800")
    with pytest.raises(ValueError, match="block hash .* cannot be encoded as UTF-8"):
        keys_from_block_hashes(["ok", "b\udc80"])
    assert len(keys_from_block_hashes(["ok", 7, b"x"], namespace="é")) == 3
