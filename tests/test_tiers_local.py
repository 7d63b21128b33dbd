"""The conformance suite over the local media, plus what is particular to each."""

from __future__ import annotations

import os

import pytest
import torch
from tier_conformance import TierConformance, blob, key

from tierkv.errors import ConfigError
from tierkv.tiers import medium_class
from tierkv.tiers.dram import DRAMTier
from tierkv.tiers.hbm import HBMTier
from tierkv.tiers.slab import ALIGN, ExtentAllocator
from tierkv.tiers.ssd import SSDTier


class TestHBM(TierConformance):
    @pytest.fixture
    def make_tier(self, factory):
        return lambda cap: factory(HBMTier("hbm", cap, device="cpu"))


class TestDRAM(TierConformance):
    @pytest.fixture
    def make_tier(self, factory):
        return lambda cap: factory(DRAMTier("dram", cap))


class TestSSD(TierConformance):
    @pytest.fixture
    def make_tier(self, factory, tmp_path):
        return lambda cap: factory(SSDTier("ssd", cap, str(tmp_path / "ssd")))


class TestSSDCompressed(TierConformance):
    @pytest.fixture
    def make_tier(self, factory, tmp_path):
        return lambda cap: factory(SSDTier("ssd", cap, str(tmp_path / "ssdz"), compression="lz4"))


def _direct_ok(path) -> bool:
    try:
        SSDTier("probe", 1 << 20, str(path), direct_io=True).close()
        return True
    except ConfigError:
        return False


class TestSSDSmallRegions(TierConformance):
    """1 MiB regions: the conformance suite crosses regions and reclaims them."""

    @pytest.fixture
    def make_tier(self, factory, tmp_path):
        return lambda cap: factory(SSDTier("ssd", cap, str(tmp_path / "ssdr"), region_size="1MiB"))


class TestSSDDirect(TierConformance):
    @pytest.fixture
    def make_tier(self, factory, tmp_path):
        if not _direct_ok(tmp_path / "probe"):
            pytest.skip("O_DIRECT is not supported on this filesystem")
        return lambda cap: factory(SSDTier("ssd", cap, str(tmp_path / "ssdd"), direct_io=True))


# -- the extent allocator: never fails for fragmentation --------------------------------
def test_allocator_gathers_fragments_and_coalesces():
    a = ExtentAllocator(10 * ALIGN)
    xs = [a.allocate(ALIGN) for _ in range(10)]
    assert a.allocate(ALIGN) is None
    for x in xs[::2]:  # free every other extent: 5 holes of one unit
        a.free(x)
    got = a.allocate(5 * ALIGN)  # no single hole fits: gathered
    assert got is not None and sum(n for _, n in got) == 5 * ALIGN
    a.free(got)
    for x in xs[1::2]:
        a.free(x)
    assert a.free_bytes == 10 * ALIGN
    assert a.allocate(10 * ALIGN) == [(0, 10 * ALIGN)]  # fully coalesced again


def test_slab_tier_fills_to_capacity_despite_fragmentation():
    t = DRAMTier("d", 16 * ALIGN)
    keys = [key(i) for i in range(16)]
    assert t.write(keys, [[blob(i, ALIGN)] for i in range(16)]) == [True] * 16
    t.delete(keys[::2])
    big = blob(99, 8 * ALIGN)
    assert t.write(["big"], [[big]]) == [True]
    out = torch.zeros(8 * ALIGN, dtype=torch.uint8)
    assert t.read(["big"], [[out]]) == [True] and torch.equal(out, big)
    for i in range(1, 16, 2):
        o = torch.zeros(ALIGN, dtype=torch.uint8)
        assert t.read([keys[i]], [[o]]) == [True] and torch.equal(o, blob(i, ALIGN))


# -- slab and SSD specifics ----------------------------------------------------------------------
def test_slab_batch_with_a_key_twice_keeps_the_last_value_and_leaks_nothing():
    t = DRAMTier("d", 64 << 20)
    a, b = blob(1, 5 << 20), blob(2, 5 << 20)  # a batch large enough to copy on two threads
    assert t.write([key(1), key(2), key(1)], [[a], [b], [b]]) == [True, True, True]
    out = torch.zeros(5 << 20, dtype=torch.uint8)
    assert t.read([key(1)], [[out]]) == [True] and torch.equal(out, b)
    assert t.used_bytes == 2 * (5 << 20)
    t.delete([key(1), key(2)])
    assert t.used_bytes == 0 and t.write([key(3)], [[torch.zeros(60 << 20, dtype=torch.uint8)]]) == [True]
    t.close()


def test_ssd_files_are_private_and_index_survives_reopen(tmp_path):
    d = tmp_path / "ssd"
    t = SSDTier("ssd", 1 << 20, str(d))
    t.write([key(1)], [[blob(1, 1000)]])
    t.close()
    assert (os.stat(d).st_mode & 0o777) == 0o700
    files = [os.path.join(r, f) for r, _, fs in os.walk(d) for f in fs]
    assert files and all((os.stat(f).st_mode & 0o777) == 0o600 for f in files)
    t2 = SSDTier("ssd", 1 << 20, str(d))
    assert t2.recover() == [(key(1), 1000)]
    out = torch.zeros(1000, dtype=torch.uint8)
    assert t2.read([key(1)], [[out]]) == [True] and torch.equal(out, blob(1, 1000))
    t2.close()


def test_ssd_keys_with_odd_characters_get_hashed_names(tmp_path):
    t = SSDTier("ssd", 1 << 20, str(tmp_path / "s"))
    odd = "model:llama|..|etc passwd"
    assert t.write([odd], [[blob(1, 10)]]) == [True]
    t.close()
    t2 = SSDTier("ssd", 1 << 20, str(tmp_path / "s"))
    assert t2.recover() == [(odd, 10)]
    t2.close()


def test_ssd_compression_shrinks_compressible_data(tmp_path):
    t = SSDTier("ssd", 64 << 20, str(tmp_path / "z"), compression="lz4")
    zeros = torch.zeros(1 << 20, dtype=torch.uint8)
    t.write(["z"], [[zeros]])
    assert t.used_bytes < 64 << 10
    out = torch.ones(1 << 20, dtype=torch.uint8)
    assert t.read(["z"], [[out]]) == [True] and not out.any()
    t.close()


def test_ssd_refuses_a_directory_owned_by_another_user(tmp_path, monkeypatch):
    real_stat = os.stat

    class Fake:
        def __init__(self, st):
            self.st_uid = st.st_uid + 1
            self.st_mode = st.st_mode

    monkeypatch.setattr(os, "stat", lambda p, *a, **k: Fake(real_stat(p)))
    with pytest.raises(ConfigError, match="owned by uid"):
        SSDTier("ssd", 1 << 20, str(tmp_path))


@pytest.mark.parametrize("medium", ["hbm", "dram", "ssd"])
def test_unknown_option_is_named(medium, tmp_path):
    opts = {"capacity": "1MiB", "bogus_option": 1}
    if medium == "ssd":
        opts["path"] = str(tmp_path)
    with pytest.raises(ConfigError, match="bogus_option"):
        medium_class(medium).from_config(medium, opts)


def test_hbm_on_unavailable_device_is_a_config_error():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.raises(ConfigError, match="cuda"):
        HBMTier.from_config("hbm", {"capacity": "1MiB", "device": "cuda"})
    with pytest.raises(ConfigError, match="torch_npu"):
        HBMTier.from_config("hbm", {"capacity": "1MiB", "device": "npu"})


@pytest.mark.parametrize("medium", ["hbm", "dram"])
def test_slab_without_prefault_still_round_trips(medium):
    opts = {"capacity": "1MiB", "prefault": False}
    if medium == "hbm":
        opts["device"] = "cpu"
    t = medium_class(medium).from_config(medium, opts)
    assert t.write([key(1)], [[blob(1, 5000)]]) == [True]
    out = torch.zeros(5000, dtype=torch.uint8)
    assert t.read([key(1)], [[out]]) == [True] and torch.equal(out, blob(1, 5000))
    t.close()


@pytest.mark.parametrize("opts", [{}, {"direct_io": True}], ids=["buffered", "o_direct"])
def test_ssd_read_into_overlapping_buffers_keeps_a_good_object(tmp_path, opts):
    """A caller whose parts overlap (one scratch buffer twice) sees a failed sum in its own
    buffers; the object on disk is sound, so it must not be dropped as corrupt."""
    t = SSDTier("ssd", 1 << 22, str(tmp_path / "ssd"), **opts)
    data = blob(7, 8192)
    assert t.write([key(7)], [[data]]) == [True]
    scratch = torch.zeros(4096, dtype=torch.uint8)
    assert t.read([key(7)], [[scratch, scratch]]) == [True]
    assert torch.equal(scratch, data[4096:])  # parts are filled in order
    assert t.contains([key(7)]) == [True]
    out = torch.zeros(8192, dtype=torch.uint8)
    assert t.read([key(7)], [[out]]) == [True] and torch.equal(out, data)
    st = t.extra_stats()
    assert st["corrupt"] == 0
    t.close()


def test_ssd_checksum_option_is_checked(tmp_path, monkeypatch):
    import tierkv.tiers.ssd.format as fmt

    with pytest.raises(ConfigError, match="checksum"):
        SSDTier("ssd", 1 << 20, str(tmp_path / "a"), checksum="md5")
    with pytest.raises(ConfigError, match="checksum"):
        SSDTier.from_config("ssd", {"capacity": "1MiB", "path": str(tmp_path / "b"), "checksum": 7})
    monkeypatch.setattr(fmt, "crc32c_sum", None)
    with pytest.raises(ConfigError, match="needs the crc32c package"):
        SSDTier("ssd", 1 << 20, str(tmp_path / "c"), checksum="crc32c")


@pytest.mark.parametrize("opts", [{}, {"compression": "lz4"}], ids=["plain", "lz4"])
def test_ssd_object_summed_with_an_unavailable_algorithm_is_a_miss_and_kept(tmp_path, monkeypatch, opts):
    import tierkv.tiers.ssd.format as fmt

    d = tmp_path / "ssd"
    t = SSDTier("ssd", 1 << 24, str(d), checksum="crc32c", **opts)
    data = blob(5, 8192)
    assert t.write([key(5)], [[data]]) == [True]
    t.flush()
    monkeypatch.setattr(fmt, "crc32c_sum", None)
    out = torch.zeros(8192, dtype=torch.uint8)
    assert t.read([key(5)], [[out]]) == [False]
    assert t.contains([key(5)]) == [True] and t.extra_stats()["corrupt"] == 0
    monkeypatch.undo()
    assert t.read([key(5)], [[out]]) == [True] and torch.equal(out, data)
    t.close()


@pytest.mark.parametrize("opts", [{}, {"compression": "lz4"}, {"direct_io": True}], ids=["plain", "lz4", "o_direct"])
def test_ssd_payload_sums_xxh3_by_default_crc32c_on_request_and_both_verify(tmp_path, opts):
    """Records carry an xxh3-64 sum unless the tier asks for CRC32C; a tier of either setting reads both."""
    if opts.get("direct_io") and not _direct_ok(tmp_path / "probe"):
        pytest.skip("O_DIRECT is not supported here")
    d = tmp_path / "ssd"
    data = blob(11, 65536)
    t = SSDTier("ssd", 1 << 24, str(d), region_size="1MiB", **opts)
    assert t.checksum == "xxh3" and t.extra_stats()["checksum"] == "xxh3"
    assert t.write([key(1)], [[data]]) == [True]
    t.close()
    t = SSDTier("ssd", 1 << 24, str(d), checksum="crc32c", **opts)
    t.recover()
    assert t.write([key(2)], [[data]]) == [True]
    t.close()
    for setting in ("xxh3", "crc32c"):
        t = SSDTier("ssd", 1 << 24, str(d), checksum=setting, **opts)
        assert sorted(k for k, _ in t.recover()) == [key(1), key(2)]
        for k in (key(1), key(2)):
            out = torch.zeros(65536, dtype=torch.uint8)
            assert t.read([k], [[out]]) == [True] and torch.equal(out, data)
        t.close()


def test_ssd_batch_runs_on_the_caller_and_the_pool_and_stays_exact(tmp_path, monkeypatch):
    """A large batch is spread over the calling thread and the I/O threads, every object exact."""
    import threading

    t = SSDTier("ssd", 1 << 28, str(tmp_path / "ssd"), io_threads=2)
    keys = [key(i) for i in range(16)]
    vals = [blob(i, 256 << 10) for i in range(16)]
    assert t.write(keys, [[v] for v in vals]) == [True] * 16
    t.close()
    t = SSDTier("ssd", 1 << 28, str(tmp_path / "ssd"), io_threads=2)  # reads from the files now
    t.recover()
    seen: list[tuple[int, int]] = []  # (thread, objects) of each run read
    inner = t._reader._read_run
    second = threading.Event()  # a second run started: the first run waits for it (a handshake, not a sleep)

    def spy(run, keys, dsts, out):
        seen.append((threading.get_ident(), len(run[1])))
        if len(seen) == 1:  # (the thread that took the first run holds it: the other must take the next)
            assert second.wait(30), "no second thread took a run"
        else:
            second.set()
        return inner(run, keys, dsts, out)

    monkeypatch.setattr(t._reader, "_read_run", spy)
    outs = [torch.zeros(256 << 10, dtype=torch.uint8) for _ in keys]
    assert t.read(keys, [[o] for o in outs]) == [True] * 16
    assert all(torch.equal(o, v) for o, v in zip(outs, vals))
    assert sum(n for _, n in seen) == 16 and len(seen) > 1 and threading.get_ident() in {th for th, _ in seen}
    assert t.read([key(99), *keys[:3]], [[torch.zeros(256 << 10, dtype=torch.uint8)] for _ in range(4)]) == \
        [False, True, True, True]
    t.close()
