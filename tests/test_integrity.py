"""Integrity from put to load: each chunk's checksum, computed once at the put, travels with it and is checked on
reads (docs/architecture.md, "Invariants", 10).  The pooled cases, over a real ``mooncake_master``, are in
tests/test_mooncake_integrity.py."""

from __future__ import annotations

import logging

import pytest
import torch
from fake_media import FakeTier

from tierkv.checksum import (
    TRAILER_BYTES,
    ReadSums,
    Verify,
    chunk_sum,
    read_trailer,
    read_trailers,
    trailer_buffers,
    trailers,
)
from tierkv.errors import ConfigError
from tierkv.metrics import families, health, snapshot
from tierkv.outcome import MissReason
from tierkv.store import TieredStore

MiB = 1 << 20


def chunk(i: int, n: int = 64 << 10) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def flip(store: TieredStore, tier: str, key: str, at: int = 17) -> None:
    """Flip one bit of ``key``'s bytes in a slab tier's memory, behind the store's back."""
    lvl = next(lvl for lvl in store.levels if lvl.name == tier)
    with store._chain.lock:
        views = lvl.tier.views_at(lvl.codes([key]))
    assert views is not None
    views[0][0][at] ^= 1


def test_a_flipped_byte_in_dram_under_verify_always_is_a_miss_counted_and_dropped(caplog):
    with TieredStore.from_config({"tiers": [{"medium": "dram", "capacity": "8MiB", "verify": "always"}]}) as s:
        a, b = chunk(1), chunk(2)
        assert s.put(["a", "b"], [a, b]) == [True, True]
        flip(s, "dram", "a")
        out_a, out_b = torch.zeros_like(a), torch.zeros_like(b)
        with caplog.at_level(logging.WARNING, logger="tierkv"):
            assert s.get(["a", "b"], [out_a, out_b]) == [False, True]
        assert torch.equal(out_b, b)
        st = s.stats()["tiers"]["dram"]
        assert st["corrupt"] == 1
        assert st["entries"] == 1  # the bad copy left the tier
        assert s.lookup(["a"]) == 0
        assert s.why_missing(["a"]) == [MissReason.CORRUPT]
        assert s.departures(["a"])[0].tier == "dram"
        assert any("dram" in r.getMessage() and "'a'" not in r.getMessage() and " a " in r.getMessage()
                   for r in caplog.records), [r.getMessage() for r in caplog.records]
        # the next put of the chunk stores it again, and it reads back exact
        assert s.put(["a"], [a]) == [True]
        assert s.get(["a"], [out_a]) == [True] and torch.equal(out_a, a)


def test_a_corrupt_dram_copy_falls_through_to_the_ssd_copy(tmp_path):
    cfg = {"tiers": [{"medium": "dram", "capacity": "8MiB", "verify": "always"},
                     {"medium": "ssd", "path": str(tmp_path / "ssd"), "capacity": "64MiB",
                      "persist": "write_through"}]}
    with TieredStore.from_config(cfg) as s:
        a = chunk(3)
        assert s.put(["a"], [a]) == [True]
        flip(s, "dram", "a")
        out = torch.zeros_like(a)
        assert s.get(["a"], [out]) == [True]
        assert torch.equal(out, a)  # the ssd's copy, never the flipped one
        st = s.stats()
        assert st["tiers"]["dram"]["corrupt"] == 1
        assert st["tiers"]["ssd"]["hits"] == 1
        assert st["total"]["corrupt"] == 1


def test_verify_always_checks_hbm_too():
    with TieredStore.from_config({"verify": "always",
                                  "tiers": [{"medium": "hbm", "device": "cpu", "capacity": "8MiB"}]}) as s:
        a = chunk(4)
        s.put(["a"], [a])
        flip(s, "hbm", "a")
        assert s.get(["a"], [torch.zeros_like(a)]) == [False]
        assert s.stats()["tiers"]["hbm"]["corrupt"] == 1


def test_a_demotion_never_stores_bytes_that_fail_the_sum_the_chunk_carries(tmp_path):
    # dram holds two chunks; a corrupt one demoted to the ssd would be summed again there from bad bytes
    cfg = {"tiers": [{"medium": "dram", "capacity": 3 * (64 << 10), "eviction": "lru"},
                     {"medium": "ssd", "path": str(tmp_path / "ssd"), "capacity": "64MiB", "persist": "on_evict"}]}
    with TieredStore.from_config(cfg) as s:
        a = chunk(5)
        s.put(["a"], [a])
        flip(s, "dram", "a")
        s.put(["b", "c", "d"], [chunk(6), chunk(7), chunk(8)])  # a is evicted, its demotion checked
        s.drain_write_behind()
        out = torch.zeros_like(a)
        assert s.get(["a"], [out]) == [False]
        st = s.stats()["tiers"]
        assert st["dram"]["corrupt"] == 1
        assert s.get(["b"], [out]) == [True] and torch.equal(out, chunk(6))


def test_every_tier_counts_corrupt_from_zero(tmp_path):
    cfg = {"tiers": [{"medium": "hbm", "device": "cpu", "capacity": "8MiB"},
                     {"medium": "dram", "capacity": "8MiB"},
                     {"medium": "ssd", "path": str(tmp_path / "ssd"), "capacity": "64MiB"}]}
    with TieredStore.from_config(cfg) as s:
        s.put(["a"], [chunk(9)])
        st = s.stats()
        for name in ("hbm", "dram", "ssd"):
            assert st["tiers"][name]["corrupt"] == 0
        assert st["total"]["corrupt"] == 0
        names = {f.name for f in families(snapshot(s))}
        assert "tierkv_tier_corrupt" in names and "tierkv_corrupt" in names


def test_the_exporter_shows_a_corrupt_copy():
    with TieredStore.from_config({"tiers": [{"medium": "dram", "capacity": "8MiB", "verify": "always"}]}) as s:
        s.put(["a"], [chunk(10)])
        flip(s, "dram", "a")
        s.get(["a"], [torch.zeros(64 << 10, dtype=torch.uint8)])
        fam = next(f for f in families(snapshot(s)) if f.name == "tierkv_tier_corrupt")
        assert fam.samples == [(("dram",), 1.0)]
        problems, warnings = health(snapshot(s))
        assert not problems and any("dram" in w and "checksum" in w for w in warnings), warnings


def test_verify_values_and_defaults():
    with TieredStore.from_config({"tiers": [{"medium": "dram", "capacity": "8MiB"}]}) as s:
        lvl = s.levels[0]
        # a store of one dram tier, unchecked: its sums would serve nothing, so none is kept (nor computed)
        assert lvl.verify is Verify.EXTERNAL and not lvl.checks_reads and not lvl.keeps_sums
        s.put(["a"], [chunk(1)])
        assert lvl.sums == {}
    with TieredStore.from_config({"tiers": [{"medium": "hbm", "device": "cpu", "capacity": "8MiB"},
                                            {"medium": "dram", "capacity": "8MiB"}]}) as s:
        # each keeps them: a demotion carries hbm's down, a promotion dram's up
        assert [lvl.keeps_sums for lvl in s.levels] == [True, True]
        s.put(["a"], [chunk(1)])
        assert s.levels[0].sums == {"a": chunk_sum([chunk(1)])}
    with TieredStore.from_config({"verify": "always", "tiers": [{"medium": "dram", "capacity": "8MiB"},
                                 {"medium": "dram", "name": "d2", "capacity": "8MiB", "verify": "external"}]}) as s:
        assert [lvl.checks_reads for lvl in s.levels] == [True, False]
    for cfg in ({"tiers": [{"medium": "dram", "capacity": "8MiB", "verify": "sometimes"}]},
                {"verify": True, "tiers": [{"medium": "dram", "capacity": "8MiB"}]}):
        with pytest.raises(ConfigError, match="'verify'"):
            TieredStore.from_config(cfg)


def test_the_sum_is_the_ssd_records_payload_sum(tmp_path):
    # the same value in every tier: xxh3-64 of the bytes, as an uncompressed ssd record carries it
    import xxhash

    a = chunk(11)
    assert chunk_sum([a]) == xxhash.xxh3_64_intdigest(a.numpy().tobytes())
    assert chunk_sum([a[:100], a[100:]]) == chunk_sum([a])
    t = trailers([chunk_sum([a])])[0]
    assert t.numel() == TRAILER_BYTES and read_trailer(t) == chunk_sum([a])
    t[0] ^= 1
    assert read_trailer(t) is None


def test_trailers_read_in_one_pass_give_what_each_read_alone_gives():
    sums = [chunk_sum([chunk(i)]) for i in range(5)]
    buf = trailer_buffers(5)  # consecutive views of one buffer: one pass
    for dst, src in zip(buf, trailers(sums)):
        dst.copy_(src)
    buf[3][4] ^= 1  # a wrong version
    assert read_trailers(buf) == [read_trailer(t) for t in buf] == [*sums[:3], None, sums[4]]
    apart = [t.clone() for t in buf]  # separate tensors: each read alone
    assert read_trailers(apart) == [*sums[:3], None, sums[4]]
    assert read_trailers(buf[1:4]) == [sums[1], sums[2], None] and read_trailers([]) == []


def test_a_put_sums_each_chunk_once_and_a_copy_carries_it(tmp_path, monkeypatch):
    import tierkv.checksum as C

    calls = []
    real = C.chunk_sum

    def counting(parts):
        calls.append(1)
        return real(parts)

    import tierkv.engine.integrity as integ
    import tierkv.engine.writer as w

    monkeypatch.setattr(w, "chunk_sum", counting)
    monkeypatch.setattr(integ, "chunk_sum", counting)
    cfg = {"tiers": [{"medium": "hbm", "device": "cpu", "capacity": 2 * (64 << 10)},
                     {"medium": "dram", "capacity": "8MiB", "verify": "always"}]}
    with TieredStore.from_config(cfg) as s:
        s.put(["a", "b"], [chunk(12), chunk(13)])
        s.put(["c"], [chunk(14)])  # c evicts a into dram: its sum is copied, not computed again
        s.drain_write_behind()
        assert s.locate(["a", "c"]) == ["dram", "hbm"]
        assert len(calls) == 3
        assert s.levels[1].sums["a"] == real([chunk(12)])


class SummingPool(FakeTier):
    """A shared pool that sums what it copies (``sums_copies``), with one answer per key a test can spoil."""

    sum_inside = True
    sums_copies = True

    def __init__(self) -> None:
        super().__init__("pool", managed=False)
        self.spoil: dict[str, str] = {}  # key -> "wrong" (a sum off by one bit) or "none" (no sum)
        self.summed: list[list[str]] = []

    def _read_summed(self, keys, dsts, sums):
        oks = self._read(keys, dsts)
        self.summed.append(list(keys))
        for i, (key, parts) in enumerate(zip(keys, dsts)):
            if oks[i] and self.spoil.get(key) != "none":
                s = chunk_sum([torch.cat(parts)[:sums.nbytes[i]]])
                sums.sums[i] = s ^ 1 if self.spoil.get(key) == "wrong" else s
        return oks


def test_a_pool_that_sums_its_copies_is_checked_by_those_sums_and_the_rest_summed_by_the_store():
    pool = SummingPool()
    with TieredStore([pool]) as s:
        keys = ["a", "b", "c", "d"]
        vals = [chunk(20 + i) for i in range(4)]
        assert s.put(keys, vals) == [True] * 4
        assert all(v.numel() == 64 * 1024 + TRAILER_BYTES for v in pool.data.values())
        # b: the medium's sum of the bytes it copied disagrees with the trailer; c: no sum (the store sums the
        # bytes itself), and a bit of c flipped in the pool; d: no sum, bytes intact
        pool.spoil = {"b": "wrong", "c": "none", "d": "none"}
        pool.data["c"][5] ^= 1
        outs = [torch.zeros_like(v) for v in vals]
        assert s.get(keys, outs) == [True, False, False, True]
        assert pool.summed == [keys]  # (one read, asked to sum)
        assert torch.equal(outs[0], vals[0]) and torch.equal(outs[3], vals[3])
        assert s.stats()["tiers"]["pool"]["corrupt"] == 2
        assert s.why_missing(["b", "c"]) == [MissReason.CORRUPT] * 2
        assert sorted(pool.data) == ["a", "d"]  # the bad copies were deleted from the pool


def test_a_medium_that_does_not_sum_its_copies_leaves_the_sums_unanswered():
    t = FakeTier("plain", managed=False)
    assert t.write(["a"], [[chunk(1)]]) == [True]
    asked = ReadSums([100])
    out = torch.zeros(64 << 10, dtype=torch.uint8)
    assert t.read(["a"], [[out]], asked) == [True] and asked.sums == [None]
    with pytest.raises(ValueError, match="sums"):
        SummingPool().read(["a", "b"], [[out], [out]], ReadSums([1]))


def test_a_flipped_byte_amid_a_large_summed_dram_read_is_a_miss_and_its_neighbours_hits(monkeypatch):
    import tierkv.tiers.slab as slab

    calls = []
    real = slab.copy_and_sum

    def spy(jobs, sum_bytes):
        calls.append(len(jobs))
        return real(jobs, sum_bytes)

    monkeypatch.setattr(slab, "copy_and_sum", spy)
    n, size = 8, 2 * MiB  # (16 MiB: the copy and its sums on two threads)
    with TieredStore.from_config({"tiers": [{"medium": "dram", "capacity": "32MiB", "verify": "always"}]}) as s:
        keys = [f"c{i}" for i in range(n)]
        vals = [chunk(30 + i, size) for i in range(n)]
        assert s.put(keys, vals) == [True] * n
        flip(s, "dram", keys[5], at=size - 1)
        outs = [torch.zeros(size, dtype=torch.uint8) for _ in keys]
        assert s.get(keys, outs) == [True] * 5 + [False] + [True] * 2
        assert calls == [n]  # one summed copy of the whole batch
        assert all(torch.equal(outs[i], vals[i]) for i in range(n) if i != 5)
        st = s.stats()["tiers"]["dram"]
        assert st["corrupt"] == 1 and st["entries"] == n - 1
        assert s.why_missing([keys[5]]) == [MissReason.CORRUPT]


@pytest.mark.parametrize("medium", ["hbm", "dram"])
def test_a_flipped_byte_amid_a_large_read_summed_after_its_copy_is_a_miss_and_its_neighbours_hits(medium):
    # hbm sums nothing as it copies, and a dram read of parts the store could not vouch for (two parts each) is not
    # summed by the slab either: the store hashes each group of about 2 MiB right after its copy, on two threads
    n, size = 8, 2 * MiB
    cfg = {"verify": "always", "tiers": [{"medium": medium, "capacity": "32MiB"}]}
    if medium == "hbm":
        cfg["tiers"][0]["device"] = "cpu"
    with TieredStore.from_config(cfg) as s:
        keys = [f"g{i}" for i in range(n)]
        vals = [chunk(60 + i, size) for i in range(n)]
        assert s.put(keys, vals) == [True] * n
        flip(s, medium, keys[2], at=5)
        outs = [torch.zeros(size, dtype=torch.uint8) for _ in keys]
        parts = [[o[:1000], o[1000:]] for o in outs]
        assert s.get(keys, parts) == [True] * 2 + [False] + [True] * 5
        assert all(torch.equal(outs[i], vals[i]) for i in range(n) if i != 2)
        assert s.stats()["tiers"][medium]["corrupt"] == 1
        assert s.lookup(keys[2:3]) == 0
