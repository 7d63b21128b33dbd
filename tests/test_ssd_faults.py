"""Faults under the ssd tier: SIGKILL mid-write and mid-checkpoint, flipped bytes, a full disk, I/O errors."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from tier_conformance import blob, fail_nth, key

from tierkv import TieredStore
from tierkv.durability import TierFlushError
from tierkv.tiers.ssd import SSDTier

MiB = 1 << 20


def val(i: int, n: int = 256 << 10) -> torch.Tensor:
    return torch.full((n,), i % 251, dtype=torch.uint8)


def region_files(path):
    d = os.path.join(path, "regions")
    return sorted(os.path.join(d, f) for f in os.listdir(d))


def flip(path, offset, mask=0x5A):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))


def read_all(t, keys, n):
    outs = [torch.zeros(n, dtype=torch.uint8) for _ in keys]
    return t.read(keys, [[o] for o in outs]), outs


WRITER = textwrap.dedent("""
    import sys, torch
    from tierkv.tiers.ssd import SSDTier
    path, flushed_n, announce = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    t = SSDTier("ssd", 64 << 20, path, region_size="4MiB")
    t.recover()
    val = lambda i: torch.full((256 << 10,), i % 251, dtype=torch.uint8)
    t.write([f"c{i:05d}" for i in range(flushed_n)], [[val(i)] for i in range(flushed_n)])
    t.flush()
    print("flushed", flush=True)
    i, rounds = flushed_n, 0
    while True:  # regions fill, seal and are reclaimed until the kill
        if i >= flushed_n + 150:
            i = flushed_n
        names = [f"c{i:05d}", f"c{i + 1:05d}"]
        t.delete(names)
        t.write(names, [[val(i)], [val(i + 1)]])
        i += 2
        rounds += 1
        if rounds == announce:  # the parent kills from now on, while this goes on writing
            print("writing", flush=True)
""")


# 8 rounds (16 objects of 256 KiB) fill a 4 MiB region: killed in the first unflushed region, after several
# were sealed, and once the ring of 150 keys has wrapped and regions are being reclaimed
@pytest.mark.parametrize("rounds", [5, 37, 110])
def test_sigkill_mid_region_write_keeps_flushed_objects_and_serves_no_torn_one(tmp_path, rounds):
    path = str(tmp_path / "ssd")
    proc = subprocess.Popen([sys.executable, "-c", WRITER, path, "40", str(rounds)], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "flushed"
        assert proc.stdout.readline().strip() == "writing"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    t = SSDTier("ssd", 64 * MiB, path, region_size="4MiB")
    found = dict(t.recover())
    assert {f"c{i:05d}" for i in range(40)} <= set(found), "a flushed object was lost"
    names = sorted(found)
    ok, outs = read_all(t, names, 256 << 10)
    for name, f, o in zip(names, ok, outs):
        if f:
            assert torch.equal(o, val(int(name[1:]))), f"torn object {name}"
    assert all(f for name, f in zip(names, ok) if int(name[1:]) < 40)
    t.close()


CHECKPOINTER = textwrap.dedent("""
    import os, sys, time, torch
    from tierkv.tiers.ssd import SSDTier
    from tierkv.tiers.ssd import checkpoint as C
    path = sys.argv[1]
    t = SSDTier("ssd", 64 << 20, path, region_size="1MiB")
    t.write([f"a{i:04d}" for i in range(100)], [[torch.full((9000,), i, dtype=torch.uint8)] for i in range(100)])
    t.checkpoint()  # a good checkpoint
    real = C.write
    def slow_write(dirpath, bufs, fsync):
        data = b"".join(bytes(b) for b in bufs)
        fd = os.open(os.path.join(dirpath, C.NAME + ".tmp"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.write(fd, data[: len(data) // 2])
        print("mid-checkpoint", flush=True)
        time.sleep(60)  # parked here until the parent's SIGKILL (the sleep only bounds an orphan's life)
    C.write = slow_write
    t.delete([f"a{i:04d}" for i in range(0, 100, 3)])
    t.write([f"b{i:04d}" for i in range(50)], [[torch.full((9000,), i, dtype=torch.uint8)] for i in range(50)])
    t.checkpoint()
""")


def test_sigkill_mid_checkpoint_keeps_everything_flushed(tmp_path):
    path = str(tmp_path / "ssd")
    proc = subprocess.Popen([sys.executable, "-c", CHECKPOINTER, path], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "mid-checkpoint"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert os.path.exists(os.path.join(path, "checkpoint.tmp"))
    t = SSDTier("ssd", 64 * MiB, path, region_size="1MiB")
    found = dict(t.recover())
    # the removals and puts reached the region files before the checkpoint began: all of them count
    want = {f"a{i:04d}" for i in range(100) if i % 3} | {f"b{i:04d}" for i in range(50)}
    assert set(found) == want
    ok, outs = read_all(t, sorted(want), 9000)
    assert all(ok)
    assert all(torch.equal(o, torch.full((9000,), int(k[1:]), dtype=torch.uint8)) for k, o in zip(sorted(want), outs))
    t.close()


# -- flipped bytes -------------------------------------------------------------------------------
def _filled(tmp_path, n=30, size=5000):
    d = str(tmp_path / "s")
    t = SSDTier("ssd", 16 * MiB, d, region_size="1MiB")
    t.write([key(i) for i in range(n)], [[blob(i, size)] for i in range(n)])
    t.close()
    return d


def _check_exact_or_miss(d, n=30, size=5000):
    t = SSDTier("ssd", 16 * MiB, d, region_size="1MiB")
    found = {k for k, _ in t.recover()}
    keys = [key(i) for i in range(n)]
    ok, outs = read_all(t, keys, size)
    for i, (f, o) in enumerate(zip(ok, outs)):
        if f:
            assert torch.equal(o, blob(i, size)), f"wrong bytes for {keys[i]}"
    stats = t.extra_stats()
    t.close()
    return found, ok, stats


@pytest.mark.parametrize("where", ["header", "key", "payload"])
def test_a_flipped_record_byte_is_a_counted_miss(tmp_path, where):
    d = _filled(tmp_path)
    (f,) = region_files(d)
    at = open(f, "rb").read().find(key(7).encode()) - 64
    flip(f, at + {"header": 20, "key": 64 + 3, "payload": 64 + len(key(7)) + 1234}[where])
    found, ok, stats = _check_exact_or_miss(d)
    assert ok[7] is False and sum(ok) == 29
    assert stats["corrupt"] == 1


def test_a_flipped_summary_byte_falls_back_to_reading_the_region(tmp_path):
    d = _filled(tmp_path)
    os.unlink(os.path.join(d, "checkpoint"))
    (f,) = region_files(d)
    flip(f, os.path.getsize(f) - 64 - 100)  # inside the summary body (keys)
    found, ok, stats = _check_exact_or_miss(d)
    assert all(ok)  # the records themselves are sound: the region was scanned instead


def test_a_flipped_footer_byte_falls_back_to_reading_the_region(tmp_path):
    d = _filled(tmp_path)
    os.unlink(os.path.join(d, "checkpoint"))
    (f,) = region_files(d)
    flip(f, os.path.getsize(f) - 30)
    found, ok, stats = _check_exact_or_miss(d)
    assert all(ok)


def test_a_flipped_checkpoint_byte_falls_back_to_the_summaries(tmp_path):
    d = _filled(tmp_path)
    for off in (10, 70, os.path.getsize(os.path.join(d, "checkpoint")) - 3):
        flip(os.path.join(d, "checkpoint"), off)
        found, ok, stats = _check_exact_or_miss(d)
        assert all(ok) and stats["recovered_from"] == "summaries"


def test_a_flipped_region_header_loses_that_region_only(tmp_path):
    d = str(tmp_path / "s")
    t = SSDTier("ssd", 16 * MiB, d, region_size="1MiB")
    for i in range(60):
        t.write([key(i)], [[blob(i, 40000)]])
    t.close()
    files = region_files(d)
    assert len(files) >= 2
    os.unlink(os.path.join(d, "checkpoint"))
    flip(files[0], 12)  # region 0's seq
    found, ok, stats = _check_exact_or_miss(d, 60, 40000)
    assert 0 < sum(ok) < 60 and not ok[0] and ok[59]


# -- a full disk and I/O errors -------------------------------------------------------------------
def _small_fs(tmp_path, size_mib: int):
    """A tmpfs of ``size_mib`` MiB mounted at tmp_path/fs (None if mounting is not permitted)."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(mnt)],
                       capture_output=True)
    return str(mnt) if r.returncode == 0 else None


def test_disk_full_refuses_writes_counts_them_and_never_raises(tmp_path):
    mnt = _small_fs(tmp_path, 3)
    if mnt is None:
        pytest.skip("mounting a small tmpfs is not permitted here (see the RLIMIT_FSIZE test)")
    try:
        t = SSDTier("ssd", 64 * MiB, os.path.join(mnt, "s"), region_size="1MiB")
        oks = [t.write([key(i)], [[blob(i, 60000)]])[0] for i in range(80)]
        assert oks[0] and not all(oks)
        assert t.extra_stats()["enospc"] > 0
        good = [key(i) for i, f in enumerate(oks) if f]
        got, outs = read_all(t, good, 60000)
        assert all(got)
        assert all(torch.equal(o, blob(int(k[1:5]), 60000)) for k, o in zip(good, outs))
        t.flush()
        t.close()  # no exception, even if the checkpoint finds no room
        t = SSDTier("ssd", 64 * MiB, os.path.join(mnt, "s"), region_size="1MiB")
        assert {k for k, _ in t.recover()} <= set(good)
        t.close()
    finally:
        subprocess.run(["umount", "-l", mnt])


FSIZE = textwrap.dedent("""
    import os, resource, signal, sys, torch
    from tierkv.tiers.ssd import SSDTier
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # over the limit: EFBIG, not death
    path = sys.argv[1]
    t = SSDTier("ssd", 64 << 20, path, region_size="1MiB")
    resource.setrlimit(resource.RLIMIT_FSIZE, (512 << 10, 512 << 10))  # no file may reach a region's size
    oks = t.write(["a", "b"], [[torch.ones(1000, dtype=torch.uint8)]] * 2)
    t.flush()
    t.close()
    print(oks, t.extra_stats()["enospc"] + t.extra_stats()["checkpoint_errors"], flush=True)
""")


def test_file_size_limit_refuses_writes_and_never_raises(tmp_path):
    out = subprocess.run([sys.executable, "-c", FSIZE, str(tmp_path / "s")], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("]")[0] + "]" == "[False, False]"
    assert int(out.stdout.split("]")[1]) >= 1


def test_io_errors_on_write_out_refuse_the_write_and_never_raise(tmp_path, monkeypatch):
    t = SSDTier("ssd", 64 * MiB, str(tmp_path / "s"))
    assert t.write([key(0)], [[blob(0, 1000)]]) == [True]
    real = os.pwrite

    def broken(fd, data, off):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "pwrite", broken)
    big = [key(i) for i in range(1, 4)]
    assert t.write(big, [[blob(i, 3 * MiB)] for i in range(1, 4)]) == [False, False, False]
    assert t.extra_stats()["io_errors"] >= 1
    with pytest.raises(TierFlushError):  # counted, and reported to the store (its flush is false)
        t.flush()
    monkeypatch.setattr(os, "pwrite", real)
    assert t.contains(big) == [False] * 3
    assert t.write(big[:1], [[blob(1, 3 * MiB)]]) == [True]
    got, outs = read_all(t, [key(0)], 1000)
    assert got == [True] and torch.equal(outs[0], blob(0, 1000))
    t.close()
    t = SSDTier("ssd", 64 * MiB, str(tmp_path / "s"))
    assert sorted(k for k, _ in t.recover()) == [key(0), key(1)]
    t.close()


@pytest.mark.parametrize("fail_call", [0, 1])
def test_buffered_batch_written_from_the_callers_parts_indexes_none_when_a_write_fails(tmp_path, monkeypatch,
                                                                                          fail_call):
    """Buffered, a batch's payloads go to the file straight from the caller's parts, in pieces (the first
    on the writer thread while the rest are summed): a failed piece, the first or a later one, leaves
    none of the batch's objects found, and the next batch's bytes take their place."""
    d = str(tmp_path / "s")
    t = SSDTier("ssd", 64 * MiB, d, direct_io=False, region_size="8MiB")
    assert t.write([key(0)], [[blob(0, 20000)]]) == [True]
    real = os.pwritev
    calls: list[int] = []
    flaky = fail_nth(real, fail_call, calls)
    monkeypatch.setattr(os, "pwritev", flaky)
    keys = [key(i) for i in range(1, 41)]
    vals = [blob(i, 20000 if i % 3 else 700) for i in range(1, 41)]  # (and some small ones, copied)
    assert t.write(keys, [[v] for v in vals]) == [False] * 40
    assert len(calls) > fail_call and t.extra_stats()["io_errors"] >= 1
    assert t.contains(keys) == [False] * 40
    monkeypatch.setattr(os, "pwritev", real)
    assert t.write(keys[:5], [[v[:100], v[100:]] for v in vals[:5]]) == [True] * 5  # (parts: one object each)
    want = [blob(0, 20000), *vals[:5]]

    def exact() -> bool:
        outs = [torch.zeros(len(v), dtype=torch.uint8) for v in want]
        return t.read([key(0), *keys[:5]], [[o] for o in outs]) == [True] * 6 and all(
            torch.equal(o, v) for o, v in zip(outs, want))

    assert exact()  # (from the active region)
    t.close()
    t = SSDTier("ssd", 64 * MiB, d, direct_io=False, region_size="8MiB")
    assert sorted(k for k, _ in t.recover()) == sorted([key(0), *keys[:5]])
    assert exact()
    t.close()


# -- the store on top -----------------------------------------------------------------------------
def test_store_dram_over_ssd_restarts_and_finds_everything(tmp_path):
    cfg = {"tiers": [{"medium": "dram", "capacity": "1MiB"},
                     {"medium": "ssd", "path": str(tmp_path / "ssd"), "capacity": "64MiB", "region_size": "4MiB",
                      "persist": "write_through"}]}
    keys = [f"{i:064x}" for i in range(200)]
    with TieredStore.from_config(cfg) as store:
        assert store.put(keys, [val(i, 50000) for i in range(200)]) == [True] * 200
        store.remove(keys[:10])
    with TieredStore.from_config(cfg) as store:
        assert store.locate(keys) == [None] * 10 + ["ssd"] * 190
        outs = [torch.zeros(50000, dtype=torch.uint8) for _ in keys[10:]]
        assert store.get(keys[10:], outs) == [True] * 190
        assert all(torch.equal(o, val(i + 10, 50000)) for i, o in enumerate(outs))
        store.drain_write_behind()  # (promotion runs in the background: the ones those hits queued have landed)
        assert store.locate(keys[10:20]) == ["dram"] * 10  # promoted on the hit


def test_an_acknowledged_write_survives_sigkill_without_flush(tmp_path):
    """What a write batch acknowledged is in the region file when write returns: a kill right after keeps it."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(f"""
        import os, torch
        from tierkv.tiers.ssd import SSDTier
        t = SSDTier("ssd", 8 << 20, {str(tmp_path / "d")!r}, region_size=1 << 20)
        vals = [torch.full((3000,), i, dtype=torch.uint8) for i in range(5)]
        assert t.write([f"k{{i}}" for i in range(5)], [[v] for v in vals]) == [True] * 5
        print("written", flush=True)
        os.kill(os.getpid(), 9)
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "written" in p.stdout, p.stderr[-2000:]
    from tierkv.tiers.ssd import SSDTier

    t = SSDTier("ssd", 8 << 20, str(tmp_path / "d"), region_size=1 << 20)
    try:
        assert sorted(k for k, _ in t.recover()) == [f"k{i}" for i in range(5)]
        for i in range(5):
            out = torch.empty(3000, dtype=torch.uint8)
            assert t.read([f"k{i}"], [[out]]) == [True] and torch.equal(out, torch.full((3000,), i, dtype=torch.uint8))
    finally:
        t.close()


# -- batched reads and writes -----------------------------------------------------------------------
def _record_at(f, k: str) -> int:
    return open(f, "rb").read().find(k.encode()) - 64


@pytest.mark.parametrize("direct", [False, None])
def test_a_batch_of_present_absent_corrupt_and_missized_keys(tmp_path, direct):
    """Neighbouring records are read together; each is still checked on its own: the corrupt ones are
    counted misses (and dropped), the others exact, absent and mis-sized keys misses."""
    d = str(tmp_path / "s")
    t = SSDTier("ssd", 16 * MiB, d, region_size="1MiB", direct_io=direct)
    n, size = 40, 3000
    assert t.write([key(i) for i in range(n)], [[blob(i, size)] for i in range(n)]) == [True] * n
    t.close()
    (f,) = region_files(d)
    flip(f, _record_at(f, key(10)) + 64 + len(key(10)) + 1500)  # payload
    flip(f, _record_at(f, key(25)) + 20)  # header
    t = SSDTier("ssd", 16 * MiB, d, region_size="1MiB", direct_io=direct)
    t.recover()
    keys = [key(i) for i in range(n)] + [key(1000), key(1001)]
    outs = [torch.zeros(size, dtype=torch.uint8) for _ in keys]
    outs[5] = torch.zeros(size + 1, dtype=torch.uint8)  # not the stored size
    ok = t.read(keys, [[o] for o in outs])
    bad = {5, 10, 25, n, n + 1}
    assert [i for i, g in enumerate(ok) if not g] == sorted(bad)
    assert all(torch.equal(outs[i], blob(i, size)) for i in range(n) if i not in bad)
    assert t.extra_stats()["corrupt"] == 2 and t.extra_stats()["collisions"] == 0  # (absent: no record read)
    assert t.contains([key(10), key(25), key(5)]) == [False, False, True]
    ok2, outs2 = read_all(t, keys[:n], size)
    assert [i for i, g in enumerate(ok2) if not g] == [10, 25] and t.extra_stats()["corrupt"] == 2
    t.close()


def test_every_byte_of_a_record_read_in_a_buffered_run_is_checked(tmp_path):
    """A buffered run has its headers checked with numpy and its sums one call a record: a byte flipped
    anywhere (magic, flags, key length, seq, lengths, payload sum, the check itself, the zero padding,
    the key, the payload) makes that record a counted miss, its neighbours in the run exact."""
    d = str(tmp_path / "s")
    n, size = 48, 2000
    t = SSDTier("ssd", 16 * MiB, d, region_size="1MiB", direct_io=False)
    assert t.write([key(i) for i in range(n)], [[blob(i, size)] for i in range(n)]) == [True] * n
    t.close()
    (f,) = region_files(d)
    klen = len(key(0))
    spots = {3: 1, 6: 5, 9: 7, 12: 9, 15: 17, 18: 21, 21: 26, 24: 35, 27: 50, 30: 64 + 5, 33: 64 + klen + 700,
             36: 64 + klen + size - 1}
    for i, off in spots.items():
        flip(f, _record_at(f, key(i)) + off)
    t = SSDTier("ssd", 16 * MiB, d, region_size="1MiB", direct_io=False)
    t.recover()
    ok, outs = read_all(t, [key(i) for i in range(n)], size)
    assert [i for i, g in enumerate(ok) if not g] == sorted(spots)
    assert all(torch.equal(outs[i], blob(i, size)) for i in range(n) if i not in spots)
    assert t.extra_stats()["corrupt"] == len(spots) and t.extra_stats()["collisions"] == 0
    ok, outs = read_all(t, [key(i) for i in range(n) if i not in spots], size)  # the rest, again exact
    assert all(ok) and all(torch.equal(o, blob(i, size)) for o, i in zip(outs, [i for i in range(n) if i not in spots]))
    t.close()


@pytest.mark.parametrize(("size", "region"), [(256 << 10, "8MiB"), (2 * MiB, "32MiB")])
def test_a_flipped_byte_in_the_middle_record_of_a_large_run_is_a_miss(tmp_path, size, region):
    """Large records read in one span (O_DIRECT where the file system allows it; a payload of 1 MiB or more
    is copied out and summed piece by piece): a flipped byte in the middle one is a counted miss, its
    neighbours exact."""
    d = str(tmp_path / "s")
    n = 8
    t = SSDTier("ssd", 64 * MiB, d, region_size=region)
    assert t.write([key(i) for i in range(n)], [[blob(i, size)] for i in range(n)]) == [True] * n
    t.close()
    (f,) = region_files(d)
    flip(f, _record_at(f, key(3)) + 64 + len(key(3)) + size // 2)
    t = SSDTier("ssd", 64 * MiB, d, region_size=region)
    t.recover()
    ok, outs = read_all(t, [key(i) for i in range(n)], size)
    assert ok == [i != 3 for i in range(n)]
    assert all(torch.equal(outs[i], blob(i, size)) for i in range(n) if i != 3)
    assert t.extra_stats()["corrupt"] == 1
    t.close()


def test_a_key_twice_in_one_write_batch_keeps_the_later_value(tmp_path):
    d = str(tmp_path / "s")
    t = SSDTier("ssd", 16 * MiB, d, region_size="1MiB")
    assert t.write([key(1), key(2), key(1)], [[blob(1, 900)], [blob(2, 900)], [blob(3, 900)]]) == [True] * 3
    ok, outs = read_all(t, [key(1), key(2)], 900)
    assert ok == [True, True] and torch.equal(outs[0], blob(3, 900)) and torch.equal(outs[1], blob(2, 900))
    one = SSDTier("ssd", 16 * MiB, str(tmp_path / "ref"), region_size="1MiB")
    one.write([key(2), key(1)], [[blob(2, 900)], [blob(3, 900)]])
    assert t.used_bytes == one.used_bytes  # the earlier copy is not accounted as live
    one.close()
    t.close()
    os.unlink(os.path.join(d, "checkpoint"))  # from the summaries and the dead log alone
    t = SSDTier("ssd", 16 * MiB, d, region_size="1MiB")
    assert sorted(k for k, _ in t.recover()) == [key(1), key(2)]
    ok, outs = read_all(t, [key(1)], 900)
    assert ok == [True] and torch.equal(outs[0], blob(3, 900))
    t.close()


@pytest.mark.parametrize("direct", [False, None])
def test_a_write_batch_spanning_regions_is_exact_before_and_after_reopen(tmp_path, direct):
    d = str(tmp_path / "s")
    n, size = 90, 30000
    t = SSDTier("ssd", 16 * MiB, d, region_size="1MiB", direct_io=direct)
    keys = [key(i) for i in range(n)]
    assert t.write(keys, [[blob(i, size)] for i in range(n)]) == [True] * n  # about three regions
    assert len(region_files(d)) >= 3
    ok, outs = read_all(t, keys, size)
    assert all(ok) and all(torch.equal(o, blob(i, size)) for i, o in enumerate(outs))
    t.close()
    t = SSDTier("ssd", 16 * MiB, d, region_size="1MiB", direct_io=direct)
    assert len(t.recover()) == n
    ok, outs = read_all(t, keys, size)
    assert all(ok) and all(torch.equal(o, blob(i, size)) for i, o in enumerate(outs))
    t.close()


def test_a_batch_whose_write_out_fails_indexes_none_of_its_objects(tmp_path, monkeypatch):
    """The batch's bytes are written out before its digests enter the index: a failed write-out leaves
    none of them found, and the next batch overwrites their bytes."""
    from tierkv.tiers.ssd import region as R

    t = SSDTier("ssd", 16 * MiB, str(tmp_path / "s"), region_size="1MiB")
    assert t.write([key(0)], [[blob(0, 500)]]) == [True]
    real = R.pwrite_all

    def broken(fd, view, off):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(R, "pwrite_all", broken)
    assert t.write([key(i) for i in range(1, 6)], [[blob(i, 500)] for i in range(1, 6)]) == [False] * 5
    assert t.contains([key(i) for i in range(6)]) == [True] + [False] * 5 and t.extra_stats()["enospc"] >= 1
    monkeypatch.setattr(R, "pwrite_all", real)
    assert t.write([key(7), key(8)], [[blob(7, 500)], [blob(8, 500)]]) == [True, True]
    ok, outs = read_all(t, [key(0), key(7), key(8)], 500)
    assert ok == [True] * 3 and all(torch.equal(o, blob(i, 500)) for i, o in zip((0, 7, 8), outs))
    t.close()
    t = SSDTier("ssd", 16 * MiB, str(tmp_path / "s"), region_size="1MiB")
    assert sorted(k for k, _ in t.recover()) == [key(0), key(7), key(8)]
    t.close()


# -- region changes: the new header leaves with the first write-out, the summary behind the seal ----------
def _churn(t, n: int, flush_every: int = 7, hook=None):
    """Write key i and delete key i-5, flushing every ``flush_every``: regions fill, seal, empty and are
    reused.  Returns (live, deleted) as of each flush, in a list, and calls ``hook(i)`` after each step."""
    states = []
    live, deleted = set(), set()
    for i in range(n):
        assert t.write([key(i)], [[blob(i, 30000)]]) == [True]
        live.add(key(i))
        if i >= 5:
            t.delete([key(i - 5)])
            live.discard(key(i - 5))
            deleted.add(key(i - 5))
        if i % flush_every == flush_every - 1:
            t.flush()
            states.append((set(live), set(deleted)))
        if hook:
            hook(i)
    return states


def test_a_checkpoint_never_names_a_region_whose_new_header_is_not_in_its_file(tmp_path, monkeypatch):
    from tierkv.tiers.ssd import checkpoint as C
    from tierkv.tiers.ssd import region as R

    t = SSDTier("ssd", 12 * MiB, str(tmp_path / "s"), region_size="1MiB")
    real = C.write
    seen = []

    def check(dirpath, bufs, fsync):
        r = t._state.table.active
        if r is not None:
            h, _ = R.read_header(r.fd, t.direct_io)
            seen.append((r.seq, h.seq if h is not None else None))
        return real(dirpath, bufs, fsync)

    monkeypatch.setattr(C, "write", check)
    _churn(t, 900, flush_every=10**9)  # (no flush: the checkpoints are the writer's own, at region changes)
    assert len(seen) >= 3
    assert all(a == b for a, b in seen), seen
    t.close()


def test_a_crash_before_a_reused_regions_first_write_out_loses_nothing_flushed(tmp_path, monkeypatch):
    """What a SIGKILL leaves right after a region change into a reused file, before its new header is in
    the file: copies of the directory taken at that moment open with every object of the last flush exact,
    and none of the objects deleted before it."""
    import shutil

    from tierkv.tiers.ssd.regionchange import RegionChanger

    d = tmp_path / "s"
    t = SSDTier("ssd", 8 * MiB, str(d), region_size="1MiB")
    real = RegionChanger.begin
    snaps = []

    def begin(self, idx):
        regions = self._table.regions
        reused = idx in regions and regions[idx].fd >= 0
        r = real(self, idx)
        if reused and r.written == 0 and len(snaps) < 4:
            snap = tmp_path / f"snap{len(snaps)}"
            shutil.copytree(d, snap)
            snaps.append((snap, len(states)))
        return r

    monkeypatch.setattr(RegionChanger, "begin", begin)
    states: list = []
    states += _churn(t, 400)
    t.close()
    assert len(snaps) == 4
    for snap, n_states in snaps:
        live, deleted = states[n_states - 1] if n_states else (set(), set())
        s = SSDTier("ssd", 8 * MiB, str(snap), region_size="1MiB")
        found = dict(s.recover())
        assert live <= set(found), "a flushed object was lost"
        assert not (deleted - live) & set(found), "an object deleted before the flush came back"
        names = sorted(found)
        ok, outs = read_all(s, names, 30000)
        for name, f, o in zip(names, ok, outs):
            assert f == (name in live) or not f or torch.equal(o, blob(int(name[1:5]), 30000))
            if f:
                assert torch.equal(o, blob(int(name[1:5]), 30000))
        assert all(f for name, f in zip(names, ok) if name in live)
        s.close()


@pytest.mark.parametrize("sticky", [False, True])
def test_a_summary_that_fails_behind_the_seal_is_retried_and_never_costs_an_object(tmp_path, monkeypatch, sticky):
    from tierkv.tiers.ssd import region as R

    d = str(tmp_path / "s")
    t = SSDTier("ssd", 16 * MiB, d, region_size="1MiB")
    real = R.pwrite_all
    failed = []

    def broken(fd, view, offset):  # the summaries and footers: the writes that end where a region ends
        if offset + len(memoryview(view)) == 1 << 20 and (sticky or not failed):
            failed.append(offset)
            raise OSError(errno.EIO, "injected")
        return real(fd, view, offset)

    monkeypatch.setattr(R, "pwrite_all", broken)
    for i in range(100):  # three regions and a bit
        assert t.write([key(i)], [[blob(i, 30000)]]) == [True]
    t.flush()
    assert failed and t.extra_stats()["io_errors"] >= 1
    ok, outs = read_all(t, [key(i) for i in range(100)], 30000)
    assert all(ok) and all(torch.equal(o, blob(i, 30000)) for i, o in enumerate(outs))
    t.checkpoint()
    if sticky:  # a checkpoint would cover the region without a summary: it waits
        assert t.extra_stats()["checkpoint_errors"] >= 1
    monkeypatch.setattr(R, "pwrite_all", real)
    t.close()
    t = SSDTier("ssd", 16 * MiB, d, region_size="1MiB")
    assert {k for k, _ in t.recover()} == {key(i) for i in range(100)}
    ok, outs = read_all(t, [key(i) for i in range(100)], 30000)
    assert all(ok) and all(torch.equal(o, blob(i, 30000)) for i, o in enumerate(outs))
    t.close()


def test_a_region_change_does_not_wait_for_the_old_regions_summary(tmp_path, monkeypatch):
    """The summary goes behind the caller: a write that seals a region and begins a reused one returns while
    the summary is still being written, and a flush waits for it (the next open finds everything)."""
    import threading

    from tierkv.tiers.ssd import region as R

    d = str(tmp_path / "s")
    t = SSDTier("ssd", 16 * MiB, d, region_size="1MiB")
    for i in range(40):  # region 0 full, region 1 begun
        assert t.write([key(i)], [[blob(i, 30000)]]) == [True]
    t.delete([key(i) for i in range(40)])  # region 0 free: the next region change reuses it
    t.flush()
    real = R.pwrite_all
    gate = threading.Event()
    held = []

    def slow_summary(fd, view, offset):
        if offset + len(memoryview(view)) == 1 << 20 and threading.current_thread() is not threading.main_thread():
            held.append(offset)
            assert gate.wait(5), "the summary was never let through"
        return real(fd, view, offset)

    monkeypatch.setattr(R, "pwrite_all", slow_summary)
    begun = t.extra_stats()["regions"]
    try:
        for i in range(100, 140):  # region 1 full, a reused region begun
            assert t.write([key(i)], [[blob(i, 30000)]]) == [True]
        assert held and not gate.is_set()  # the caller went on while the summary waited
        assert t.extra_stats()["regions"] == begun  # (no new file: a reused one)
        ok, outs = read_all(t, [key(i) for i in range(100, 140)], 30000)
        assert all(ok) and all(torch.equal(o, blob(i, 30000)) for i, o in zip(range(100, 140), outs))
    finally:
        gate.set()
    t.flush()
    assert t.extra_stats()["io_errors"] == 0
    t.close()
    t = SSDTier("ssd", 16 * MiB, d, region_size="1MiB")
    assert {k for k, _ in t.recover()} == {key(i) for i in range(100, 140)}
    t.close()
