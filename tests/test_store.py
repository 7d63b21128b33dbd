"""The public contract of TieredStore, as scenarios that read like stories."""

from __future__ import annotations

import asyncio
import inspect
import json
import os

import pytest
import torch

from tierkv import BufferSizeError, ConfigError, StoreClosedError, TieredStore, chunk_keys
from tierkv.keys import keys_from_block_hashes
from tierkv.policies import AdmissionPolicy, PromotionPolicy
from tierkv.tiers.slab import ALIGN
from tierkv.tiers.ssd.tier import footprint_of

CHUNK = 4096  # 4 KiB chunks, a multiple of ALIGN: footprints are exact, so capacities count chunks
assert CHUNK % ALIGN == 0
SSD_FP = int(footprint_of(CHUNK))  # what one chunk takes in the ssd tier's regions


def record_at(path, key: str) -> tuple[str, int]:
    """(region file, offset of the record) holding ``key`` in an ssd tier's directory."""
    for r, _, fs in os.walk(path):
        for f in fs:
            if f.endswith(".region"):
                data = open(os.path.join(r, f), "rb").read()
                at = data.find(key.encode())
                if at >= 0:
                    return os.path.join(r, f), at - 64
    raise AssertionError(f"no record of {key}")


def chunk(i: int, n: int = CHUNK) -> torch.Tensor:
    return torch.full((n,), i % 251, dtype=torch.uint8)


def three_tier(tmp_path, hbm=4, dram=4, ssd=64, ssd_persist="on_evict", **extra):
    # the demotion stories below give the SSD only what falls out of DRAM ("on_evict");
    # tests/test_persistence.py covers the default, write-behind
    cfg = {
        "tiers": [
            {"medium": "hbm", "device": "cpu", "capacity": hbm * CHUNK},
            {"medium": "dram", "capacity": dram * CHUNK, "eviction": "lru"},
            {"medium": "ssd", "path": str(tmp_path / "ssd"), "capacity": ssd * SSD_FP,
             "persist": ssd_persist},
        ],
        "promotion": {"policy": "never"},
    }
    cfg.update(extra)
    return TieredStore.from_config(cfg)


def keys_for(n, ns="t"):
    return chunk_keys(list(range(n * 8)), chunk_tokens=8, namespace=ns)


# -- keys -------------------------------------------------------------------------------------
def test_chunk_keys_chain_over_the_prefix():
    a = chunk_keys(list(range(1000)), 256, "m")
    assert len(a) == 3  # only full chunks
    b = chunk_keys(list(range(1000)), 256, "m")
    assert a == b
    c = chunk_keys([5, *list(range(1, 1000))], 256, "m")  # change the first token
    assert all(x != y for x, y in zip(a, c))
    d = chunk_keys([*list(range(512)), 0, *list(range(513, 1000))], 256, "m")  # change in chunk 3
    assert d[:2] == a[:2] and d[2] != a[2]
    assert chunk_keys(list(range(1000)), 256, "other")[0] != a[0]  # namespace separates tenants
    assert chunk_keys(torch.arange(1000), 256, "m") == a
    assert all(len(k) == 64 for k in a)


@pytest.mark.parametrize("bad,match", [([[1, 2]], "one-dimensional"), ([-1], "2\\*\\*32"), ([1.5], "integers")])
def test_chunk_keys_rejects_bad_tokens(bad, match):
    with pytest.raises(ValueError, match=match):
        chunk_keys(bad, 1, "m")


def test_chunk_keys_rejects_bad_chunk_size():
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunk_keys([1, 2], 0)


def test_block_hash_keys_fold_in_namespace():
    h = [bytes([i]) * 32 for i in range(3)]
    assert keys_from_block_hashes(h, "a") == keys_from_block_hashes(h, "a")
    assert keys_from_block_hashes(h, "a") != keys_from_block_hashes(h, "b")


# -- the contract as written ------------------------------------------------------------------
def test_contract_put_lookup_get_remove(tmp_path):
    with three_tier(tmp_path) as store:
        keys = keys_for(6)
        vals = [torch.randn(CHUNK // 4) for _ in keys]  # float32, any shape
        assert store.put(keys, vals) == [True] * 6
        assert store.lookup(keys) == 6
        outs = [torch.empty(CHUNK // 8, 2) for _ in keys]  # another view of the same nbytes
        assert store.get(keys[:4], outs[:4]) == [True] * 4
        for v, o in zip(vals[:4], outs[:4]):
            assert torch.equal(v.view(-1), o.view(-1))
        store.remove(keys[2:3])
        assert store.lookup(keys) == 2
        assert store.get([keys[2]], [outs[2]]) == [False]
        s = store.stats()
        for name in ("hbm", "dram", "ssd"):
            for field in ("capacity_bytes", "used_bytes", "hits", "misses", "bytes_read", "bytes_written",
                          "evictions", "promotions", "demotions", "errors"):
                assert field in s["tiers"][name] and field in s[name]
        assert s["total"]["hits"] == 4


def test_put_is_deduplicated(tmp_path):
    with three_tier(tmp_path) as store:
        keys = keys_for(2)
        assert store.put(keys, [chunk(1), chunk(2)]) == [True, True]
        assert store.put(keys, [chunk(1), chunk(2)]) == [True, True]
        assert store.put([keys[0], keys[0]], [chunk(1), chunk(1)]) == [True, True]
        s = store.stats()
        assert s["tiers"]["hbm"]["puts"] + s["tiers"]["dram"]["puts"] + s["tiers"]["ssd"]["puts"] == 2
        assert s["total"]["chunks_deduped"] == 4


def test_eviction_demotes_down_the_chain(tmp_path):
    # put [0..11] one at a time into a 4-slot hbm over a 4-slot dram -> 0..3 in ssd, 4..7 in dram, 8..11 in hbm
    with three_tier(tmp_path) as store:
        keys = keys_for(12)
        for i, k in enumerate(keys):
            assert store.put([k], [chunk(i)]) == [True]
        where = store.locate(keys)
        assert where == ["ssd"] * 4 + ["dram"] * 4 + ["hbm"] * 4
        outs = [torch.empty(CHUNK, dtype=torch.uint8) for _ in keys]
        assert store.get(keys, outs) == [True] * 12
        assert all(torch.equal(o, chunk(i)) for i, o in enumerate(outs))
        s = store.stats()["tiers"]
        assert s["hbm"]["demotions"] == 8 and s["dram"]["demotions"] == 4
        for t in s.values():
            assert t["used_bytes"] <= t["capacity_bytes"]


def test_last_tier_drops_what_nobody_takes(tmp_path):
    with three_tier(tmp_path, hbm=2, dram=2, ssd=2) as store:
        keys = keys_for(8)
        for i, k in enumerate(keys):
            store.put([k], [chunk(i)])
        assert store.lookup(keys) == 0  # the oldest fell off the end
        assert sum(x is not None for x in store.locate(keys)) == 6
        assert store.stats()["ssd"]["evictions"] == 2


def test_promotion_on_hit(tmp_path):
    cfg = {"promotion": {"policy": "on-hit", "min_hits": 2}}
    with three_tier(tmp_path, **cfg) as store:
        keys = keys_for(12)
        for i, k in enumerate(keys):
            store.put([k], [chunk(i)])
        out = torch.empty(CHUNK, dtype=torch.uint8)
        assert store.locate([keys[0]]) == ["ssd"]
        store.get([keys[0]], [out])
        assert store.drain_write_behind(timeout=30)  # (promotion runs on the background queue)
        assert store.locate([keys[0]]) == ["ssd"]  # one hit: not yet
        store.get([keys[0]], [out])
        assert store.drain_write_behind(timeout=30)
        assert store.locate([keys[0]]) == ["hbm"]  # second hit: promoted to the top
        assert store.stats()["ssd"]["promotions"] == 1
        assert torch.equal(out, chunk(0))


def test_custom_promotion_and_admission(tmp_path):
    class OnlyToDram(PromotionPolicy):
        def should_promote(self, key, src, dst):
            return dst == "dram"

    class NoSsd(AdmissionPolicy):
        def admit(self, key, nbytes, tier):
            return tier != "ssd"

    levels_cfg = {
        "tiers": [
            {"medium": "hbm", "device": "cpu", "capacity": 2 * CHUNK, "admission": NoSsd()},
            {"medium": "dram", "capacity": 2 * CHUNK},
            {"medium": "ssd", "path": str(tmp_path / "s"), "capacity": "1MiB", "admission": NoSsd()},
        ],
        "promotion": OnlyToDram(),
    }
    with TieredStore.from_config(levels_cfg) as store:
        keys = keys_for(6)
        for i, k in enumerate(keys):
            store.put([k], [chunk(i)])
        assert store.locate(keys) == [None, None, "dram", "dram", "hbm", "hbm"]


def test_frequency_admission_spares_the_ssd(tmp_path):
    cfg = {"tiers": [
        {"medium": "dram", "capacity": 2 * CHUNK},
        {"medium": "ssd", "path": str(tmp_path / "s"), "capacity": "1MiB", "persist": "on_evict",
         "admission": {"policy": "frequency", "min_accesses": 2}},
    ]}
    with TieredStore.from_config(cfg) as store:  # the demotion path (write-behind: tests/test_persistence.py)
        keys = keys_for(4)
        store.put(keys[:1], [chunk(0)])
        store.put(keys[:1], [chunk(0)])  # a second access
        for i in (1, 2, 3):
            store.put([keys[i]], [chunk(i)])
        # keys[0] was seen twice: demoted to ssd; keys[1] only once: dropped
        assert store.locate(keys) == ["ssd", None, "dram", "dram"]


def test_write_through_copies_into_lower_tier(tmp_path):
    cfg = {"tiers": [
        {"medium": "dram", "capacity": 8 * CHUNK},
        {"medium": "ssd", "path": str(tmp_path / "s"), "capacity": "1MiB", "persist": "write_through"},
    ]}
    keys = keys_for(3)
    with TieredStore.from_config(cfg) as store:
        store.put(keys, [chunk(i) for i in range(3)])
        assert store.locate(keys) == ["dram"] * 3
        assert store.stats()["ssd"]["puts"] == 3
    with TieredStore.from_config(cfg) as store:  # a restart finds them on ssd
        assert store.lookup(keys) == 3


def test_lookup_of_one_level_stops_at_a_reservation_a_doomed_chunk_or_a_miss():
    """One managed level: ``lookup`` counts READY chunks only, whatever stands in the index after them."""
    store = TieredStore.from_config({"tiers": [{"name": "dram", "medium": "dram", "capacity": 64 * CHUNK}]})
    try:
        keys = keys_for(6)
        assert store.put(keys[:4], [chunk(i) for i in range(4)]) == [True] * 4
        lvl = store.levels[0]
        assert store.lookup(keys[:4]) == 4 and store.lookup(keys[:1]) == 1 and store.lookup([]) == 0
        assert store.lookup(keys) == 4  # a miss after them
        assert store.lookup(keys[4:]) == 0
        assert lvl.reserve(keys[4], CHUNK)  # being written: not there yet
        assert store.lookup(keys) == 4 and store.lookup(keys[4:5]) == 0
        lvl.abort(keys[4])
        lvl.pin(keys[1])  # a reader holds it while it is dropped: doomed, still in the index
        store.remove(keys[1:2])
        assert store.lookup(keys[:4]) == 1 and store.lookup(keys[1:2]) == 0
        lvl.unpin(keys[1])
        assert store.lookup(keys[:4]) == 1 and store.lookup(keys[2:4]) == 2
    finally:
        store.close()
    with pytest.raises(StoreClosedError):
        store.lookup(keys)


def test_lookup_counts_a_prefix_spread_over_every_level(tmp_path):
    with three_tier(tmp_path, hbm=2, dram=2, ssd=64) as store:
        keys = keys_for(7)
        assert store.put(keys[:6], [chunk(i) for i in range(6)]) == [True] * 6
        where = store.locate(keys[:6])
        assert set(where) == {"hbm", "dram", "ssd"}  # the older ones demoted, level by level
        assert store.lookup(keys) == 6 and store.lookup(keys[:6]) == 6
        for i, name in enumerate(where):  # each level's chunk ends the prefix where it is removed
            rest = [k for j, k in enumerate(keys[:6]) if j != i]
            store.remove([keys[i]])
            assert store.lookup(keys[:6]) == i
            assert store.lookup(rest) == 5, name
            assert store.put([keys[i]], [chunk(i)]) == [True]
            assert store.lookup(keys[:6]) == 6


def test_lookup_has_no_side_effects(tmp_path):
    with three_tier(tmp_path, hbm=2, dram=2, ssd=2) as store:
        keys = keys_for(2)
        store.put(keys, [chunk(0), chunk(1)])
        before = store.stats()
        for _ in range(5):  # only the older key: had lookup refreshed it, keys[1] would be the victim
            assert store.lookup(keys[:1]) == 1
            assert store.contains(keys[:1]) == [True] and store.locate(keys[:1]) == ["hbm"]
        after = store.stats()
        for name in ("hbm", "dram", "ssd"):
            for f in ("hits", "misses", "promotions"):
                assert before[name][f] == after[name][f]
        store.put(keys_for(3)[2:], [chunk(2)])
        assert store.locate(keys) == ["dram", "hbm"]  # keys[0] was still the LRU victim


def test_multi_part_values_and_outs(tmp_path):
    with three_tier(tmp_path) as store:
        layers = [torch.randn(256) for _ in range(4)]
        k = keys_for(1)
        assert store.put(k, [layers]) == [True]
        outs = [torch.empty(256) for _ in range(4)]
        assert store.get(k, [outs]) == [True]
        assert all(torch.equal(a, b) for a, b in zip(layers, outs))
        whole = torch.empty(1024)
        assert store.get(k, [whole]) == [True]
        assert torch.equal(whole, torch.cat(layers))


def test_async_twins(tmp_path):
    async def main(store):
        keys = keys_for(3)
        vals = [chunk(i) for i in range(3)]
        assert await store.aput(keys, vals) == [True] * 3
        assert await store.alookup(keys) == 3
        outs = [torch.empty(CHUNK, dtype=torch.uint8) for _ in keys]
        res = await asyncio.gather(store.aget(keys[:2], outs[:2]), store.aget(keys[2:], outs[2:]))
        assert res == [[True, True], [True]]
        assert all(torch.equal(o, v) for o, v in zip(outs, vals))

    with three_tier(tmp_path) as store:
        asyncio.run(main(store))


@pytest.mark.parametrize("twin", ["aput", "aget", "alookup", "aremove"])
def test_each_async_twin_takes_every_argument_its_twin_takes(twin):
    sync = inspect.signature(getattr(TieredStore, twin[1:]))
    awaitable = inspect.signature(getattr(TieredStore, twin))
    assert list(awaitable.parameters.values()) == list(sync.parameters.values())


# -- misuse gets clear errors ------------------------------------------------------------------
def test_misuse_errors_name_the_problem(tmp_path):
    store = three_tier(tmp_path)
    k = keys_for(2)
    with pytest.raises(ValueError, match="2 keys but 1 values"):
        store.put(k, [chunk(0)])
    with pytest.raises(TypeError, match="single string"):
        store.put(k[0], [chunk(0)])
    with pytest.raises(ValueError, match="contiguous"):
        store.put(k[:1], [torch.zeros(8, 8).t()])
    store.put(k[:1], [chunk(0)])
    with pytest.raises(BufferSizeError, match="holds 100 bytes but the stored chunk has 4096"):
        store.get(k[:1], [torch.empty(100, dtype=torch.uint8)])
    with pytest.raises(ValueError, match="invalid key"):
        store.put([""], [chunk(0)])
    store.close()
    store.close()  # idempotent
    for call in (lambda: store.put(k[:1], [chunk(0)]), lambda: store.lookup(k),
                 lambda: store.get(k[:1], [chunk(0)])):
        with pytest.raises(StoreClosedError, match="closed"):
            call()


@pytest.mark.parametrize("cfg,match", [
    ({"tiers": [{"medium": "floppy", "capacity": "1MiB"}]}, "unknown medium 'floppy'"),
    ({"tiers": [{"medium": "dram", "capacity": "1MiB", "eviction": "random-ish"}]}, "unknown eviction policy"),
    ({"tiers": [{"medium": "dram", "capacity": "lots"}]}, "cannot parse size 'lots'"),
    ({"tiers": [{"medium": "dram"}]}, "'capacity' is required"),
    ({"tiers": []}, "non-empty list"),
    ({"tiers": [{"medium": "dram", "capacity": 1}], "color": "red"}, "unknown config key"),
    ({"tiers": [{"medium": "dram", "capacity": 1}, {"medium": "dram", "capacity": 1}]}, "used twice"),
    ({"tiers": [{"medium": "dram", "capacity": "1MiB"}], "promotion": "sometimes"}, "unknown promotion policy"),
    ({"tiers": [{"medium": "ssd", "capacity": "1MiB"}]}, "'path' is required"),
])
def test_bad_configs_are_named(cfg, match):
    with pytest.raises(ConfigError, match=match):
        TieredStore.from_config(cfg)


@pytest.mark.parametrize("ext", [".json", ".yaml", ".toml"])
def test_config_files(tmp_path, ext):
    path = tmp_path / f"store{ext}"
    ssd = str(tmp_path / "ssd")
    if ext == ".json":
        path.write_text(json.dumps({"tiers": [{"medium": "dram", "capacity": "1MiB"},
                                              {"medium": "ssd", "path": ssd, "capacity": "4MiB"}]}))
    elif ext == ".yaml":
        path.write_text(f"tiers:\n  - medium: dram\n    capacity: 1MiB\n  - medium: ssd\n    path: {ssd}\n"
                        "    capacity: 4MiB\n")
    else:
        path.write_text(f'[[tiers]]\nmedium = "dram"\ncapacity = "1MiB"\n[[tiers]]\nmedium = "ssd"\n'
                        f'path = "{ssd}"\ncapacity = "4MiB"\n')
    with TieredStore.from_config(str(path)) as store:
        assert store.tier_names() == ["dram", "ssd"]


def test_corrupt_ssd_object_is_a_miss_then_dropped(tmp_path):
    cfg = {"tiers": [{"medium": "ssd", "path": str(tmp_path / "s"), "capacity": "1MiB"}]}
    keys = keys_for(3)
    vals = [torch.randint(0, 255, (CHUNK,), dtype=torch.uint8) for _ in keys]
    with TieredStore.from_config(cfg) as store:
        store.put(keys, vals)
    victim, at = record_at(tmp_path / "s", keys[1])
    with open(victim, "r+b") as f:  # flip bytes in the middle of the payload
        f.seek(at + 64 + len(keys[1]) + 2000)
        b = f.read(4)
        f.seek(-4, 1)
        f.write(bytes(x ^ 0xFF for x in b))
    with TieredStore.from_config(cfg) as store:
        outs = [torch.zeros(CHUNK, dtype=torch.uint8) for _ in keys]
        assert store.get(keys, outs) == [True, False, True]
        assert torch.equal(outs[0], vals[0]) and torch.equal(outs[2], vals[2])
        s = store.stats()["ssd"]
        assert s["errors"] == 1 and s["corrupt"] == 1
        assert store.locate(keys) == ["ssd", None, "ssd"]  # dropped from the index
    with TieredStore.from_config(cfg) as store:  # and it stays dropped
        assert store.locate(keys) == ["ssd", None, "ssd"]


def test_torn_ssd_region_tail_is_skipped_on_open(tmp_path):
    """A process killed mid-write leaves a torn tail: the records before it stay, the torn one is gone."""
    cfg = {"tiers": [{"medium": "ssd", "path": str(tmp_path / "s"), "capacity": "1MiB"}]}
    keys = keys_for(2)
    store = TieredStore.from_config(cfg)
    store.put(keys, [chunk(0), chunk(1)])
    store.flush()  # on disk, but the region is not sealed (no summary): as after a crash
    victim, at = record_at(tmp_path / "s", keys[1])
    with open(victim, "r+b") as f:
        f.seek(at + 64 + len(keys[1]) + 100)
        f.write(bytes(CHUNK - 200))  # the second record's payload never fully landed
    for lvl in store.levels:  # abandon the store without closing it (no seal, no checkpoint)
        lvl.tier._health.lock_file.release()
    ckpt = os.path.join(tmp_path / "s", "checkpoint")
    if os.path.exists(ckpt):  # (a flush writes one only when it is due)
        os.unlink(ckpt)
    with TieredStore.from_config(cfg) as store2:
        assert store2.locate(keys) == ["ssd", None]
        assert store2.stats()["ssd"]["torn_regions"] == 1
        out = torch.zeros(CHUNK, dtype=torch.uint8)
        assert store2.get(keys[:1], [out]) == [True] and torch.equal(out, chunk(0))


def test_recovered_ssd_respects_a_smaller_capacity(tmp_path):
    path = str(tmp_path / "s")
    keys = keys_for(8)
    with TieredStore.from_config({"tiers": [{"medium": "ssd", "path": path, "capacity": "1MiB"}]}) as store:
        for i, k in enumerate(keys):
            store.put([k], [chunk(i)])
    small = {"tiers": [{"medium": "ssd", "path": path, "capacity": 4 * SSD_FP}]}
    with TieredStore.from_config(small) as store:
        s = store.stats()["ssd"]
        assert s["used_bytes"] <= s["capacity_bytes"]
        # the newest four are kept
        assert [x is not None for x in store.locate(keys)] == [False] * 4 + [True] * 4
    with TieredStore.from_config({"tiers": [{"medium": "ssd", "path": path, "capacity": "1MiB"}]}) as store:
        assert [x is not None for x in store.locate(keys)] == [False] * 4 + [True] * 4  # dropped for good


@pytest.mark.parametrize("compression", ["none", "lz4"])
def test_any_flipped_byte_is_a_miss_never_wrong_bytes(tmp_path, compression):
    """Flip one byte at many offsets of a record (header, key, payload): each read is exact or a counted miss."""
    path = str(tmp_path / "s")
    cfg = {"tiers": [{"medium": "ssd", "path": path, "capacity": "8MiB", "compression": compression}]}
    val = torch.arange(CHUNK, dtype=torch.int32).to(torch.uint8)  # compressible but not trivial
    k = keys_for(1)
    with TieredStore.from_config(cfg) as store:
        store.put(k, [val])
    fpath, at = record_at(path, k[0])
    pristine = open(fpath, "rb").read()
    end = pristine.find(b"\0" * 64, at + 64 + len(k[0]))  # the record ends before the zeros
    offsets = sorted({0, 4, 6, 8, 16, 24, 32, 34, 40, 63, 64, 100, (end - at) // 2, end - at - 1})
    for off in offsets:
        bad = bytearray(pristine)
        bad[at + off] ^= 0x5A
        with open(fpath, "wb") as f:
            f.write(bad)
        os.unlink(os.path.join(path, "checkpoint"))  # a fresh look at the region each time
        with TieredStore.from_config(cfg) as store:
            out = torch.zeros(CHUNK, dtype=torch.uint8)
            found = store.get(k, [out])  # never raises, whichever field was hit
            assert found == [False], f"flip at {off} was served"
            s = store.stats()["ssd"]
            assert s["errors"] + s["corrupt"] + s["torn_regions"] >= 1 or store.stats()["ssd"]["entries"] == 0, \
                f"flip at {off} was not noticed"
            assert store.lookup(k) == 0
        with open(fpath, "wb") as f:
            f.write(pristine)


def test_hits_and_misses_are_counted_per_tier(tmp_path):
    with three_tier(tmp_path, hbm=1, dram=1) as store:
        keys = keys_for(3)
        for i, k in enumerate(keys):
            store.put([k], [chunk(i)])
        assert store.locate(keys) == ["ssd", "dram", "hbm"]
        before = store.stats()
        outs = [torch.empty(CHUNK, dtype=torch.uint8) for _ in range(4)]
        found = store.get([*keys, keys_for(4)[3]], outs)  # one in each tier, and one absent
        assert found == [True, True, True, False]
        after = store.stats()
        delta = {t: (after[t]["hits"] - before[t]["hits"], after[t]["misses"] - before[t]["misses"])
                 for t in ("hbm", "dram", "ssd")}
        # hbm missed the ssd, dram and absent keys; dram missed ssd's and the absent one; ssd missed the absent one
        assert delta == {"hbm": (1, 3), "dram": (1, 2), "ssd": (1, 1)}
        assert after["total"]["hits"] - before["total"]["hits"] == 3
        assert after["total"]["misses"] - before["total"]["misses"] == 1


def test_removal_listener_hears_chunks_that_left_every_tier():
    # a 2-chunk hbm over a 2-chunk dram: the first two puts are demoted, not gone; the fifth put evicts the
    # first chunk from dram, its last copy; remove() is heard too
    cfg = {"tiers": [{"medium": "hbm", "device": "cpu", "capacity": 2 * CHUNK},
                     {"medium": "dram", "capacity": 2 * CHUNK, "eviction": "lru"}],
           "promotion": {"policy": "never"}}
    heard: list[str] = []
    with TieredStore.from_config(cfg) as store:
        store.add_removal_listener(heard.extend)
        keys = keys_for(6)
        for i, k in enumerate(keys[:4]):
            store.put([k], [chunk(i)])
        assert heard == []
        store.put([keys[4]], [chunk(4)])
        assert heard == [keys[0]] and store.locate([keys[0]]) == [None]
        store.remove([keys[4]])
        assert heard == [keys[0], keys[4]]
        store.remove_removal_listener(heard.extend)  # (an equal bound method is the same listener)
        store.put(keys[5:], [chunk(5)])
        store.put(keys[:3], [chunk(0), chunk(1), chunk(2)])  # evicts again, unheard
        assert heard == [keys[0], keys[4]] and None in store.locate(keys[1:4])
