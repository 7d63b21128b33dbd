"""Payloads written to the ssd tier's device from where they are: huge-page memory, padded records.

With O_DIRECT, a payload of ``DIRECT_MIN`` bytes or more held in a registered huge-page buffer (the
store's staging arena) is written from there; its record carries a pad that gives the payload's file
offset the phase of its address.  These tests hold that path to what every write guarantees: exact
bytes or a miss, through the active region, a reopen (checkpoint and summaries), reclamation, a
failed write, a flipped byte and ``inspect_dir``; and the arena to its own invariants.
"""

from __future__ import annotations

import errno
import mmap
import os
import random

import pytest
import torch
from tier_conformance import blob, fail_nth, key

from tierkv import TieredStore, hostmem
from tierkv.errors import ConfigError
from tierkv.hostmem import StagingArena
from tierkv.tiers.ssd import SSDTier, inspect_dir
from tierkv.tiers.ssd import format as fmt

MiB = 1 << 20
KiB = 1 << 10

pytestmark = pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="needs transparent huge pages")


@pytest.fixture
def ssd_dir(tmp_path):
    d = tmp_path / "s"
    try:
        SSDTier("probe", MiB, str(tmp_path / "probe"), direct_io=True).close()
    except ConfigError:
        pytest.skip("no O_DIRECT on this file system")
    return str(d)


@pytest.fixture
def arena():
    a = StagingArena()
    yield a
    a.release()


def staged(arena: StagingArena, vals: list[torch.Tensor]) -> list[torch.Tensor]:
    """The values copied into the arena, one view each (what the store's write-behind hands a tier)."""
    views = arena.carve([v.numel() for v in vals])
    for v, s in zip(views, vals):
        v.copy_(s)
    return views


def read_all(t, keys, sizes):
    outs = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
    return t.read(keys, [[o] for o in outs]), outs


def pads(path: str) -> list[int]:
    """The pad of every record of every region file (scanned as an unsealed region is)."""
    from tierkv.tiers.ssd import region as R

    out = []
    rdir = os.path.join(path, "regions")
    for name in sorted(os.listdir(rdir)):
        with open(os.path.join(rdir, name), "rb") as f:
            data = f.read()
        h = fmt.parse_region_header(data)
        if h is None:
            continue
        pos = fmt.BLOCK
        while pos + fmt.REC_HDR <= len(data):
            rec = fmt.parse_record(memoryview(data)[pos:], h.seq)
            if rec is None:
                break
            out.append(rec.pad)
            pos = fmt.align_up(pos + rec.rec_len, fmt.ALIGN)
        assert R.parse_region_name(name) is not None
    return out


# -- the arena ------------------------------------------------------------------------------
def test_arena_views_are_aligned_registered_and_reused(arena):
    views = arena.carve([5000, 300 * KiB, 1])
    assert [v.numel() for v in views] == [5000, 300 * KiB, 1]
    assert all(v.data_ptr() % hostmem.CARVE_ALIGN == 0 for v in views)
    assert views[1].data_ptr() >= views[0].data_ptr() + 8192  # (each on its own 4 KiB boundary)
    a, n = views[1].data_ptr(), views[1].numel()
    assert hostmem.contiguous(a, n) and hostmem.contiguous(views[0].data_ptr(), 1)
    first = arena.nbytes
    again = arena.carve([300 * KiB])  # a batch that fits: the same buffer, not a new one
    assert arena.nbytes == first and again[0].data_ptr() == views[0].data_ptr()
    big = arena.carve([first + 1])  # one that does not: a larger buffer; the old range is no longer registered
    assert arena.nbytes > first and not hostmem.contiguous(a, n)
    assert hostmem.contiguous(big[0].data_ptr(), big[0].numel())
    assert not hostmem.contiguous(big[0].data_ptr(), arena.nbytes + 1)  # (not past its end)
    arena.release()
    assert not hostmem.contiguous(big[0].data_ptr(), 1)
    big[0][-1] = 7  # a view outliving the release still owns its memory
    assert int(big[0][-1]) == 7


def test_memory_of_4k_pages_is_never_registered(arena, monkeypatch):
    monkeypatch.setattr(hostmem, "HUGE_PAGES", False)
    v = arena.carve([4 * MiB])[0]
    assert not hostmem.contiguous(v.data_ptr(), v.numel())
    assert not hostmem.contiguous(torch.empty(4 * MiB, dtype=torch.uint8).data_ptr(), 1)


# -- the tier ----------------------------------------------------------------------------------
def test_payloads_in_huge_page_memory_are_written_from_where_they_are_and_read_back_exact(ssd_dir, arena):
    sizes = [300 * KiB, 1 * MiB + 123, 2 * MiB, 200 * KiB - 1, 5000]  # (the last two: one large, one small)
    vals = [blob(i, n) for i, n in enumerate(sizes)]
    keys = [key(i) for i in range(len(sizes))]
    t = SSDTier("ssd", 64 * MiB, ssd_dir, direct_io=True)
    try:
        assert t.write(keys, [[v] for v in staged(arena, vals)]) == [True] * len(keys)
        assert t.extra_stats()["direct_writes"] == 4  # every payload of DIRECT_MIN bytes or more
        # the active region: its image lacks these payloads, so they are read from the file
        ok, outs = read_all(t, keys, sizes)
        assert ok == [True] * len(keys) and all(torch.equal(o, v) for o, v in zip(outs, vals))
        assert t.extra_stats()["corrupt"] == 0
        # a second batch behind the first in the same region, from torch memory (copied)
        more = [blob(10 + i, 256 * KiB) for i in range(3)]
        assert t.write([key(i, "m") for i in range(3)], [[v] for v in more]) == [True] * 3
        assert t.extra_stats()["direct_writes"] == 4
        t.flush()
        got = pads(ssd_dir)
        assert len(got) == 8 and sum(p > 0 for p in got) >= 3  # (a pad of 0 happens: a phase already right)
    finally:
        t.close()
    for drop_checkpoint in (False, True):
        if drop_checkpoint:
            os.unlink(os.path.join(ssd_dir, "checkpoint"))
        for direct in (True, False):  # (any option may change between opens)
            t = SSDTier("ssd", 64 * MiB, ssd_dir, direct_io=direct)
            try:
                ok, outs = read_all(t, keys, sizes)
                assert ok == [True] * len(keys) and all(torch.equal(o, v) for o, v in zip(outs, vals))
                ok, outs = read_all(t, [key(i, "m") for i in range(3)], [256 * KiB] * 3)
                assert all(ok) and all(torch.equal(o, v) for o, v in zip(outs, more))
                assert sorted(t.recover()) == sorted([(k, n) for k, n in zip(keys, sizes)]
                                                     + [(key(i, "m"), 256 * KiB) for i in range(3)])
            finally:
                t.close()
    report = inspect_dir(ssd_dir, verify=True)
    assert report["objects"] == 8 and report["corrupt"] == 0


def test_footprint_bounds_a_padded_record(ssd_dir, arena):
    t = SSDTier("ssd", 64 * MiB, ssd_dir, direct_io=True)
    try:
        for n in (fmt.DIRECT_MIN, 300 * KiB + 17, 2 * MiB):
            vals = [blob(n + i, n) for i in range(4)]
            keys = [key(i, f"f{n}x") + "y" * 100 for i in range(4)]  # (long keys: the pad is what is left)
            before = t.used_bytes
            assert t.write(keys, [[v] for v in staged(arena, vals)]) == [True] * 4
            assert t.used_bytes - before <= 4 * t.footprint(n)
    finally:
        t.close()


def test_padded_records_survive_reclamation(ssd_dir, arena):
    """Regions of 4 MiB, objects of 150-400 KiB from huge-page memory, a third removed again and again: the
    emptiest region's live records are re-appended (their pad moves with them) and every read stays exact."""
    rng = random.Random(5)
    t = SSDTier("ssd", 12 * MiB, ssd_dir, direct_io=True, region_size="4MiB")
    model: dict[str, torch.Tensor] = {}
    try:
        for step in range(30):
            n = 10
            vals = [blob(step * 100 + i, rng.randrange(150 * KiB, 400 * KiB)) for i in range(n)]
            keys = [key(step * 100 + i) for i in range(n)]
            oks = t.write(keys, [[v] for v in staged(arena, vals)])
            for k, v, ok in zip(keys, vals, oks):
                if ok:
                    model[k] = v
            gone = rng.sample(sorted(model), len(model) // 3)
            t.delete(gone)
            for k in gone:
                del model[k]
            ks = sorted(model)
            ok, outs = read_all(t, ks, [model[k].numel() for k in ks])
            assert all(ok) and all(torch.equal(o, model[k]) for k, o in zip(ks, outs))
        assert t.extra_stats()["gc_runs"] > 0 and t.extra_stats()["gc_relocated"] > 0
        assert t.extra_stats()["corrupt"] == 0
    finally:
        t.close()
    t = SSDTier("ssd", 12 * MiB, ssd_dir, direct_io=True, region_size="4MiB")
    try:
        ks = sorted(model)
        ok, outs = read_all(t, ks, [model[k].numel() for k in ks])
        assert all(ok) and all(torch.equal(o, model[k]) for k, o in zip(ks, outs))
    finally:
        t.close()


def test_a_failed_write_of_a_padded_batch_indexes_none_of_it(ssd_dir, arena, monkeypatch):
    t = SSDTier("ssd", 64 * MiB, ssd_dir, direct_io=True)
    try:
        assert t.write([key(0)], [[blob(0, 1000)]]) == [True]
        real = os.pwritev
        calls = []

        def broken(fd, bufs, off):
            calls.append(off)
            raise OSError(errno.EIO, "Input/output error")

        monkeypatch.setattr(os, "pwritev", broken)
        vals = [blob(i, 700 * KiB) for i in range(1, 5)]
        keys = [key(i) for i in range(1, 5)]
        assert t.write(keys, [[v] for v in staged(arena, vals)]) == [False] * 4  # (never raises)
        assert calls and t.extra_stats()["io_errors"] >= 1
        assert t.contains(keys) == [False] * 4
        monkeypatch.setattr(os, "pwritev", real)
        assert t.write(keys, [[v] for v in staged(arena, vals)]) == [True] * 4  # (their bytes take the place)
        ok, outs = read_all(t, [key(0), *keys], [1000] + [700 * KiB] * 4)
        assert all(ok) and all(torch.equal(o, v) for o, v in zip(outs, [blob(0, 1000), *vals]))
    finally:
        t.close()


def test_a_flipped_byte_in_a_padded_payload_is_a_miss(ssd_dir, arena):
    vals = [blob(i, 512 * KiB) for i in range(3)]
    keys = [key(i) for i in range(3)]
    t = SSDTier("ssd", 64 * MiB, ssd_dir, direct_io=True)
    assert t.write(keys, [[v] for v in staged(arena, vals)]) == [True] * 3
    t.close()
    rfile = os.path.join(ssd_dir, "regions", sorted(os.listdir(os.path.join(ssd_dir, "regions")))[0])
    with open(rfile, "r+b") as f:
        data = bytearray(f.read())
        at = data.find(bytes(vals[1][100_000:100_064]))  # a byte deep in the second payload's middle
        assert at > 0
        data[at] ^= 0x40
        f.seek(0)
        f.write(data)
    t = SSDTier("ssd", 64 * MiB, ssd_dir, direct_io=True)
    try:
        ok, outs = read_all(t, keys, [512 * KiB] * 3)
        assert ok == [True, False, True]
        assert torch.equal(outs[0], vals[0]) and torch.equal(outs[2], vals[2])
        assert t.extra_stats()["corrupt"] == 1
    finally:
        t.close()


def test_a_region_file_removed_behind_the_tier_is_recreated_with_its_padded_records(ssd_dir, arena):
    """The active region's file is recreated from the removed file, still open, not from the image: the
    image never held these payloads."""
    import shutil

    vals = [blob(i, 600 * KiB) for i in range(4)]
    keys = [key(i) for i in range(4)]
    t = SSDTier("ssd", 64 * MiB, ssd_dir, direct_io=True)
    try:
        assert t.write(keys, [[v] for v in staged(arena, vals)]) == [True] * 4
        shutil.rmtree(os.path.join(ssd_dir, "regions"))  # a tmp cleaner
        t.flush()
        assert t.extra_stats()["io_errors"] == 0
    finally:
        t.close()
    t = SSDTier("ssd", 64 * MiB, ssd_dir, direct_io=True)
    try:
        ok, outs = read_all(t, keys, [600 * KiB] * 4)
        assert ok == [True] * 4 and all(torch.equal(o, v) for o, v in zip(outs, vals))
    finally:
        t.close()


# -- through the store ---------------------------------------------------------------------------
def _direct_ok(tmp_path) -> None:
    try:
        SSDTier("probe", MiB, str(tmp_path / "probe"), direct_io=True).close()
    except ConfigError:
        pytest.skip("no O_DIRECT on this file system")


def test_write_behind_writes_from_the_dram_slab_and_a_restart_finds_every_chunk(tmp_path):
    """A host slab's whole 2 MiB pages are huge pages: the pinned chunks in them go to the SSD from there
    (no staging copy, no copy into the region image); the rest take the copy path; all come back exact."""
    _direct_ok(tmp_path)
    cfg = {"tiers": [{"medium": "dram", "capacity": "64MiB"},
                     {"medium": "ssd", "path": str(tmp_path / "s"), "capacity": "256MiB"}]}
    vals = [blob(i, 256 * KiB + 64 * i) for i in range(40)]
    keys = [key(i) for i in range(40)]
    st = TieredStore.from_config(cfg)
    try:
        dram = st.levels[0]
        assert dram.tier._huge is not None  # (the slab's interior, registered)
        assert st.put(keys, vals) == [True] * 40
        with st._chain.lock:
            views = dram.tier.views_at(dram.codes(keys))
        assert all(torch.equal(torch.cat(v), x) for v, x in zip(views, vals))  # the chunks' own bytes
        expect = sum(len(v) == 1 and hostmem.contiguous(v[0].data_ptr(), v[0].numel()) for v in views)
        assert expect >= 30  # (all but those in the slab's first and last partial 2 MiB)
        assert st.flush()
        assert st.levels[1].tier.extra_stats()["direct_writes"] == expect
        assert st._stager.nbytes == 0  # (nothing was staged)
    finally:
        st.close()
    assert not hostmem.contiguous(views[0][0].data_ptr(), 1)  # (closed: no longer registered)
    st = TieredStore.from_config(cfg)
    try:
        assert st.lookup(keys) == 40 and st.locate(keys) == ["ssd"] * 40
        outs = [torch.zeros_like(v) for v in vals]
        assert st.get(keys, outs) == [True] * 40
        assert all(torch.equal(o, v) for o, v in zip(outs, vals))
    finally:
        st.close()


def test_write_behind_from_a_tier_without_views_stages_in_the_arena_and_writes_from_there(tmp_path):
    from fake_media import FakeTier

    _direct_ok(tmp_path)
    top = FakeTier("fast", 64 * MiB)  # (not located: it only copies)
    ssd = SSDTier("ssd", 256 * MiB, str(tmp_path / "s"), direct_io=True)
    st = TieredStore([top, ssd])
    vals = [blob(i, 300 * KiB) for i in range(12)]
    keys = [key(i) for i in range(12)]
    try:
        assert st.put(keys, vals) == [True] * 12
        assert st.flush()
        assert ssd.extra_stats()["direct_writes"] == 12 and st._stager.nbytes >= 12 * 300 * KiB
        outs = [torch.zeros_like(v) for v in vals]
        assert ssd.read(keys, [[o] for o in outs]) == [True] * 12
        assert all(torch.equal(o, v) for o, v in zip(outs, vals))
    finally:
        st.close()
    assert st._stager.nbytes == 0  # (released at close)


def test_a_source_whose_views_fail_is_copied_instead(tmp_path, monkeypatch):
    from tierkv.tiers.slab import SlabTier

    def broken(self, codes):
        raise RuntimeError("views broke")

    monkeypatch.setattr(SlabTier, "views_at", broken)
    cfg = {"tiers": [{"medium": "dram", "capacity": "16MiB"},
                     {"medium": "ssd", "path": str(tmp_path / "s"), "capacity": "64MiB"}]}
    vals = [blob(i, 200 * KiB) for i in range(8)]
    keys = [key(i) for i in range(8)]
    st = TieredStore.from_config(cfg)
    try:
        assert st.put(keys, vals) == [True] * 8
        assert st.flush()
        assert st.levels[0].pinned == {}  # (every pin given back)
        ssd = st.levels[1].tier
        outs = [torch.zeros_like(v) for v in vals]
        assert ssd.read(keys, [[o] for o in outs]) == [True] * 8
        assert all(torch.equal(o, v) for o, v in zip(outs, vals))
    finally:
        st.close()


# -- large payloads copied in steps ------------------------------------------------------------
STREAMED = [1 * MiB, 1 * MiB + 1, 3 * MiB + 4097, 4 * MiB, 2 * MiB - 3, 1 * MiB + 512 * KiB + 7]


@pytest.mark.parametrize("snapshot", [False, True])
def test_large_payloads_from_ordinary_memory_are_copied_in_steps_and_read_back_exact(ssd_dir, monkeypatch,
                                                                                     snapshot):
    """With O_DIRECT, a payload of ``_STREAM_MIN`` bytes or more in ordinary memory is summed first and
    copied into the image in steps, the writer taking finished steps as they come: batches across region
    changes read back exact from the active image, the file, and after reopen (checkpoint and summaries).
    ``snapshot``: each piece's bytes are taken the moment it is handed to the writer (as a device that
    reads at once would), and the bytes offered to the writer's pump are written on the spot, so a piece
    handed over or offered before its bytes are final fails the test."""
    from tierkv.tiers.ssd import segment, segmentwriter

    if snapshot:
        real = segment._handoff

        def copy(b):  # (page aligned, as O_DIRECT wants)
            v = memoryview(b).cast("B")
            m = mmap.mmap(-1, max(len(v), 1))
            m[:len(v)] = v
            return memoryview(m)[:len(v)]

        def snap(x):  # (fd and offsets as they are; lists and (offset, buffers) runs item by item)
            if isinstance(x, int):
                return x
            if isinstance(x, (list, tuple)):
                return type(x)(snap(y) for y in x)
            return copy(x)

        def at_once(pool, wait, fn, *args):
            return real(pool, wait, fn, *[snap(a) for a in args])

        monkeypatch.setattr(segment, "_handoff", at_once)

        def offer_at_once(self, pool, r, upto, least):
            with self.lock:
                self.ready = max(self.ready, upto)
                self.pumping += 1
            self._pump(r)  # (on the caller's thread, now)

        monkeypatch.setattr(segment.Segment, "offer", offer_at_once)

    assert min(STREAMED) >= segmentwriter._STREAM_MIN and max(STREAMED) > 4 * segmentwriter._STREAM_STEP
    vals = [blob(i, STREAMED[i % len(STREAMED)]) for i in range(54)]
    keys = [key(i, "s") for i in range(len(vals))]
    sizes = [v.numel() for v in vals]
    t = SSDTier("ssd", 256 * MiB, ssd_dir, direct_io=True, region_size="40MiB")
    try:
        for i in range(0, len(vals), 6):  # (40 MiB regions: every third batch or so crosses a region change)
            assert t.write(keys[i:i + 6], [[v] for v in vals[i:i + 6]]) == [True] * 6
        assert t.extra_stats()["direct_writes"] == 0  # (copied, not written from where they are)
        assert t.extra_stats()["regions"] >= 3
        ok, outs = read_all(t, keys, sizes)
        assert all(ok) and all(torch.equal(o, v) for o, v in zip(outs, vals))
        t.flush()
    finally:
        t.close()
    for drop_checkpoint in (False, True):
        if drop_checkpoint:
            os.unlink(os.path.join(ssd_dir, "checkpoint"))
        t = SSDTier("ssd", 256 * MiB, ssd_dir, direct_io=True)
        try:
            ok, outs = read_all(t, keys, sizes)
            assert all(ok) and all(torch.equal(o, v) for o, v in zip(outs, vals))
            assert t.extra_stats()["corrupt"] == 0
        finally:
            t.close()
    assert inspect_dir(ssd_dir, verify=True)["corrupt"] == 0


@pytest.mark.parametrize(("fail_at", "sticky"), [(0, False), (1, False), (1, True)])
def test_a_step_write_that_fails_mid_copy_indexes_none_of_its_batch(ssd_dir, monkeypatch, fail_at, sticky):
    """The writer's pieces of a streamed batch fail (its first write, its second, or every write from the
    second on; a batch makes two writes at least - its first step, handed over at once, and the commit's -
    and more as the writer keeps up): the batch is refused whole and never raises, earlier objects stay
    exact, and the same keys written again read back exact."""
    t = SSDTier("ssd", 64 * MiB, ssd_dir, direct_io=True, region_size="32MiB")
    try:
        assert t.write([key(0)], [[blob(0, 3000)]]) == [True]
        real, real_v = os.pwrite, os.pwritev
        calls: list[int] = []  # (the writes of both kinds, counted together)
        vals = [blob(i, 3 * MiB + 5) for i in range(1, 4)]
        keys = [key(i) for i in range(1, 4)]
        monkeypatch.setattr(os, "pwrite", fail_nth(real, fail_at, calls, sticky))
        monkeypatch.setattr(os, "pwritev", fail_nth(real_v, fail_at, calls, sticky))
        assert t.write(keys, [[v] for v in vals]) == [False] * 3
        assert len(calls) > fail_at and t.extra_stats()["io_errors"] >= 1 and t.extra_stats()["too_large"] == 0
        monkeypatch.setattr(os, "pwrite", real)
        monkeypatch.setattr(os, "pwritev", real_v)
        assert t.contains(keys) == [False] * 3
        assert t.write(keys, [[v] for v in vals]) == [True] * 3
        ok, outs = read_all(t, [key(0), *keys], [3000] + [3 * MiB + 5] * 3)
        assert all(ok) and all(torch.equal(o, v) for o, v in zip(outs, [blob(0, 3000), *vals]))
    finally:
        t.close()
    t = SSDTier("ssd", 64 * MiB, ssd_dir, direct_io=True, region_size="32MiB")
    try:
        ok, outs = read_all(t, [key(0), *keys], [3000] + [3 * MiB + 5] * 3)
        assert all(ok) and all(torch.equal(o, v) for o, v in zip(outs, [blob(0, 3000), *vals]))
    finally:
        t.close()
