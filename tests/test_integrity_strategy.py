"""Integrity strategies (``tierkv/engine/integrity.py``): which one each built-in medium and level config gets,
and that each catches a flipped byte (a read returns the stored bytes or a miss)."""

from __future__ import annotations

import pytest
import torch
from fake_media import FakeTier

from tierkv.checksum import TRAILER_BYTES, Verify, chunk_sum
from tierkv.engine.integrity import (
    Integrity,
    LevelSums,
    MediumVerified,
    Trailers,
    Unchecked,
    mismatched,
    select,
)
from tierkv.errors import ConfigError
from tierkv.store import TieredStore
from tierkv.tiers.base import Locality
from tierkv.tiers.dram import DRAMTier
from tierkv.tiers.null import NullTier
from tierkv.tiers.remote.media import DramPoolTier

N = 4096


def chunk(i: int, n: int = N) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def kinds(cfg: dict) -> list[tuple[str, bool]]:
    with TieredStore.from_config(cfg) as s:
        return [(lvl.integrity.kind, lvl.checks_reads) for lvl in s.levels]


# -- which strategy -------------------------------------------------------------------------
def test_each_builtin_store_config_gets_its_strategy(tmp_path):
    dram = {"medium": "dram", "capacity": "1MiB"}
    hbm = {"medium": "hbm", "device": "cpu", "capacity": "1MiB"}
    ssd = {"medium": "ssd", "path": str(tmp_path / "ssd"), "capacity": "16MiB"}
    null = {"medium": "null", "capacity": "1MiB"}
    # a level alone, read unchecked: no copy is ever made out of it, so it keeps no sums
    assert kinds({"tiers": [dram]}) == [("unchecked", False)]
    assert kinds({"tiers": [{**dram, "verify": "always"}]}) == [("level_sums", True)]
    assert kinds({"tiers": [hbm, dram]}) == [("level_sums", False), ("level_sums", False)]
    assert kinds({"verify": "always", "tiers": [hbm, {**dram, "verify": "external"}]}) == [
        ("level_sums", True), ("level_sums", False)]
    assert kinds({"tiers": [dram, ssd]}) == [("level_sums", False), ("medium_verified", False)]
    assert kinds({"tiers": [null, dram]}) == [("unchecked", False), ("level_sums", False)]


def test_selection_reads_the_medium_declarations_and_the_verify_option():
    ext, always = Verify.EXTERNAL, Verify.ALWAYS
    dram = DRAMTier("d", 1 << 20)
    try:
        assert type(select(dram, True, ext)) is LevelSums and not select(dram, True, ext).checks_reads
        assert select(dram, True, always).checks_reads and select(dram, True, always).medium_sums
        assert type(select(dram, True, ext, alone=True)) is Unchecked
        assert type(select(dram, True, always, alone=True)) is LevelSums
    finally:
        dram.close()
    assert type(select(NullTier("n", 1 << 20), True, always)) is Unchecked  # (no bytes to check)
    pool = DramPoolTier.__new__(DramPoolTier)  # (the class's declarations alone: no backend is reached)
    pool.name = "pool"
    assert not pool.managed and type(select(pool, False, ext)) is Trailers
    disk = FakeTier("disk")
    disk.locality = Locality.DISK  # type: ignore[misc]
    assert select(disk, True, ext).checks_reads  # (bytes that can change outside: always checked)
    assert type(select(FakeTier("shared", managed=False), False, always)) is Unchecked

    class Verifying(FakeTier):
        verifies_reads = True

    assert type(select(Verifying("v"), True, always)) is MediumVerified

    class Framing(FakeTier):
        sum_inside = True

    with pytest.raises(ConfigError, match="manage its own space"):
        select(Framing("f"), True, ext)


# -- each strategy catches a flipped byte ------------------------------------------------------
def test_level_sums_catch_a_flipped_byte_when_they_check():
    a, b = chunk(1), chunk(2)
    checking = LevelSums(FakeTier("x"), checks=True)
    checking.recorded(["a", "b"], [chunk_sum([a]), chunk_sum([b])], [True, True])
    assert checking.kept(["a", "b", "c"]) == [chunk_sum([a]), chunk_sum([b]), None]
    bad = b.clone()
    bad[100] ^= 1
    verdict = checking.check_read(["a", "b"], [[a], [bad]], [True, True], None)
    assert verdict.bad == [1] and verdict.sums == [chunk_sum([a]), chunk_sum([b])]
    # a sum already hashed during the copy is used as it is
    assert checking.check_read(["a"], [[a]], [True], [chunk_sum([bad])]).bad == [0]
    # an unchecked level keeps the sums (a copy carries them) but does not check
    plain = LevelSums(FakeTier("y"), checks=False)
    plain.recorded(["b"], [chunk_sum([b])], [True])
    assert plain.check_read(["b"], [[bad]], [True], None).bad == []
    checking.forget(["a", "b"])
    assert dict(checking.sums) == {}


def test_trailers_catch_a_flipped_byte_in_the_chunk_or_in_its_trailer():
    pool = FakeTier("pool", managed=False)
    pool.sum_inside = True  # type: ignore[misc]
    strategy = Trailers(pool)
    vals = [chunk(10 + i) for i in range(3)]
    sums = strategy.sums_for_write([[v] for v in vals], None)
    assert sums == [chunk_sum([v]) for v in vals]
    framed = strategy.frame_write([[v] for v in vals], sums)
    stored = [torch.cat(objs).clone() for objs in framed.objs]  # what the medium keeps: bytes, then trailer
    strategy.write_done(framed.note)
    assert all(s.numel() == N + TRAILER_BYTES for s in stored)
    stored[1][7] ^= 1  # a chunk byte
    stored[2][N + 3] ^= 1  # a trailer byte
    outs = [torch.zeros(N, dtype=torch.uint8) for _ in vals]
    reading = strategy.frame_read([[o] for o in outs])
    for objs, s in zip(reading.objs, stored):  # (each framed destination: the chunk's part, then its trailer)
        objs[0].copy_(s[:N])
        objs[1].copy_(s[N:])
    verdict = strategy.check_pooled([[o] for o in outs], [True, True, True], reading)
    assert verdict.bad == [1, 2] and verdict.sums == [sums[0], None, None]


def test_medium_verified_sums_the_bytes_it_hands_on_and_vets_an_unchecked_copy_in():
    strategy = MediumVerified(FakeTier("v"))
    a = chunk(3)
    assert strategy.check_read(["a", "b"], [[a], [a]], [True, False], None).sums == [chunk_sum([a]), None]
    assert strategy.vets_copy_from(LevelSums(FakeTier("x"), checks=False))
    assert not strategy.vets_copy_from(LevelSums(FakeTier("x"), checks=True))
    assert not strategy.vets_copy_from(Unchecked(FakeTier("x")))
    bad = a.clone()
    bad[0] ^= 1
    assert mismatched([[a], [bad], [bad]], [chunk_sum([a]), chunk_sum([a]), None]) == [1]


def test_a_flipped_byte_in_an_unchecked_level_never_reaches_the_ssd_below(tmp_path):
    # hbm keeps sums but does not check its reads; the ssd vouches for whatever it stores, so a demotion into it
    # is checked against the sum the chunk travelled with: the bad copy is counted at hbm, never stored
    cfg = {"tiers": [{"medium": "hbm", "device": "cpu", "capacity": 2 * N},
                     {"medium": "ssd", "path": str(tmp_path / "ssd"), "capacity": "16MiB", "persist": "on_evict"}]}
    with TieredStore.from_config(cfg) as s:
        assert s.put(["a"], [chunk(1)]) == [True]
        hbm = s.levels[0]
        with s._chain.lock:
            views = hbm.tier.views_at(hbm.codes(["a"]))
        assert views is not None
        views[0][0][9] ^= 1
        assert s.put(["b", "c"], [chunk(2), chunk(3)]) == [True, True]  # evicts a: a demotion to the ssd
        s.drain_write_behind()
        assert s.locate(["a"]) == [None]
        assert s.stats()["tiers"]["hbm"]["corrupt"] == 1


def test_every_strategy_states_what_it_guarantees():
    names = set()
    for cls in (Unchecked, LevelSums, Trailers, MediumVerified):
        assert issubclass(cls, Integrity) and cls.kind and cls.__doc__ and "Guarantees" in cls.__doc__
        names.add(cls.kind)
    assert len(names) == 4
