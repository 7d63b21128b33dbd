"""The ssd tier's log engine: regions, reclamation, the index, restarts, options, the lock, inspect."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from tier_conformance import blob, key

from tierkv.errors import ConfigError
from tierkv.tiers.ssd import SSDTier, inspect_dir
from tierkv.tiers.ssd import format as fmt
from tierkv.tiers.ssd.index import DigestIndex

MiB = 1 << 20


def direct_ok(path) -> bool:
    try:
        SSDTier("probe", MiB, str(path), direct_io=True).close()
        return True
    except ConfigError:
        return False


def region_files(path):
    d = os.path.join(path, "regions")
    return sorted(os.path.join(d, f) for f in os.listdir(d)) if os.path.isdir(d) else []


def read_all(t, keys, sizes):
    outs = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
    return t.read(keys, [[o] for o in outs]), outs


# -- layout --------------------------------------------------------------------------------
def test_objects_go_into_a_few_preallocated_region_files(tmp_path):
    t = SSDTier("ssd", 8 * MiB, str(tmp_path / "s"), region_size="1MiB")
    keys = [key(i) for i in range(300)]
    assert t.write(keys, [[blob(i, 4000)] for i in range(300)]) == [True] * 300
    t.flush()
    files = region_files(tmp_path / "s")
    assert 1 <= len(files) <= t.regions_needed()  # regions, not one file per object
    assert all(os.path.getsize(f) == MiB for f in files)
    assert (os.stat(tmp_path / "s" / "regions").st_mode & 0o777) == 0o700
    assert all((os.stat(f).st_mode & 0o777) == 0o600 for f in files)
    ok, outs = read_all(t, keys, [4000] * 300)
    assert all(ok) and all(torch.equal(o, blob(i, 4000)) for i, o in enumerate(outs))
    t.close()


def test_a_write_is_in_the_region_file_when_it_returns(tmp_path):
    t = SSDTier("ssd", 8 * MiB, str(tmp_path / "s"), region_size="1MiB", direct_io=False)
    assert t.write([key(1)], [[blob(1, 5000)]]) == [True]  # far below one write unit, yet in the file
    (f,) = region_files(tmp_path / "s")
    assert key(1).encode() in open(f, "rb").read()  # a process killed now loses nothing acknowledged
    assert t.write([key(2)], [[blob(2, 700)]]) == [True]  # the partial last block is written again
    data = open(f, "rb").read()
    assert key(1).encode() in data and key(2).encode() in data
    ok, (out,) = read_all(t, [key(1)], [5000])
    assert ok == [True] and torch.equal(out, blob(1, 5000))
    t.flush()
    assert key(1).encode() in open(f, "rb").read()
    t.close()


def test_footprint_bounds_the_space_an_object_takes(tmp_path):
    t = SSDTier("ssd", 64 * MiB, str(tmp_path / "s"), region_size="1MiB")
    for n in (1, 100, 4096, 65536):
        assert n < t.footprint(n) <= n + 1024
    sizes = [1, 777, 4096, 60000]
    t.write([key(i) for i in range(4)], [[blob(i, n)] for i, n in enumerate(sizes)])
    assert t.used_bytes <= sum(t.footprint(n) for n in sizes)
    big = t.max_slot  # more than one record holds: pieces and a manifest, its footprint theirs
    assert t.write(["big"], [[blob(9, big)]]) == [True]
    assert t.used_bytes <= sum(t.footprint(n) for n in sizes) + t.footprint(big)
    ok, (out,) = read_all(t, ["big"], [big])
    assert ok == [True] and torch.equal(out, blob(9, big))
    too_big = 64 * MiB  # more than the whole tier: refused, counted
    assert t.footprint(too_big) > t.capacity_bytes
    assert t.write(["huge"], [[torch.zeros(too_big, dtype=torch.uint8)]]) == [False]
    assert t.extra_stats()["too_large"] == 1
    t.close()


# -- capacity and reclamation ----------------------------------------------------------------
@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "o_direct"])
def test_any_set_within_capacity_can_be_written_while_regions_are_reclaimed(tmp_path, direct):
    """Random sizes, random removals, always within capacity by footprint: every write succeeds."""
    if direct and not direct_ok(tmp_path / "probe"):
        pytest.skip("O_DIRECT is not supported here")
    cap = 3 * MiB
    t = SSDTier("ssd", cap, str(tmp_path / "s"), region_size="1MiB", direct_io=direct)
    rnd = random.Random(7)
    live: dict[str, int] = {}
    used = 0
    for i in range(1500):
        n = rnd.choice([100, 3000, 20000, 60000, t.max_slot - 1024])
        while used + t.footprint(n) > cap:  # the store's part: make room first
            victim = rnd.choice(sorted(live))
            used -= t.footprint(live.pop(victim))
            t.delete([victim])
        k = key(i)
        assert t.write([k], [[blob(i, n)]]) == [True], f"write {i} of {n} bytes refused at {used} of {cap}"
        live[k] = n
        used += t.footprint(n)
        assert t.used_bytes <= used
    st_ = t.extra_stats()
    assert st_["gc_runs"] > 0 and st_["regions"] <= t.regions_needed()
    ks = sorted(live)
    ok, outs = read_all(t, ks, [live[k] for k in ks])
    assert all(ok)
    assert all(torch.equal(o, blob(int(k[1:5]), live[k])) for k, o in zip(ks, outs))
    t.close()
    t = SSDTier("ssd", cap, str(tmp_path / "s"), region_size="1MiB", direct_io=direct)
    assert sorted(k for k, _ in t.recover()) == ks
    ok, outs = read_all(t, ks, [live[k] for k in ks])
    assert all(ok) and all(torch.equal(o, blob(int(k[1:5]), live[k])) for k, o in zip(ks, outs))
    t.close()


def test_a_sealed_region_whose_objects_are_all_removed_is_reused_before_a_new_file(tmp_path):
    """Rounds of put-then-remove cycle through the region files the first round made (a file written once
    is cheaper to write again than fresh preallocated blocks), and what the last round put is exact,
    before and after a reopen."""
    d = str(tmp_path / "s")
    t = SSDTier("ssd", 64 * MiB, d, region_size="1MiB")
    for rnd in range(6):
        ks = [key(i, f"r{rnd}") for i in range(60)]  # ~2.4 MiB a round: 3 regions
        assert t.write(ks, [[blob(rnd * 100 + i, 40000)] for i in range(60)]) == [True] * 60
        if rnd == 0:
            first = len(region_files(d))
        if rnd < 5:
            t.delete(ks)
    assert t.regions_needed() > 20 and len(region_files(d)) <= first + 1  # (without reuse: ~15 files)
    ok, outs = read_all(t, ks, [40000] * 60)
    assert all(ok) and all(torch.equal(o, blob(500 + i, 40000)) for i, o in enumerate(outs))
    t.close()
    t = SSDTier("ssd", 64 * MiB, d, region_size="1MiB")
    assert sorted(k for k, _ in t.recover()) == sorted(ks)
    ok, outs = read_all(t, ks, [40000] * 60)
    assert all(ok) and all(torch.equal(o, blob(500 + i, 40000)) for i, o in enumerate(outs))
    t.close()


def test_reclamation_moves_live_objects_and_keeps_reads_exact(tmp_path):
    t = SSDTier("ssd", 2 * MiB, str(tmp_path / "s"), region_size="1MiB")
    keep = [key(i, "keep") for i in range(20)]
    t.write(keep, [[blob(i, 10000)] for i in range(20)])
    for rnd in range(30):  # churn: write and remove most, so every region holds a little live data
        ks = [key(i, f"c{rnd}") for i in range(20)]
        assert t.write(ks, [[blob(i, 20000)] for i in range(20)]) == [True] * 20
        t.delete(ks[1:])
        keep.append(ks[0])
    assert t.extra_stats()["gc_relocated"] > 0
    sizes = [10000] * 20 + [20000] * 30
    ok, outs = read_all(t, keep, sizes)
    assert all(ok) and all(torch.equal(o, blob(i if i < 20 else 0, n)) for i, (o, n) in enumerate(zip(outs, sizes)))
    t.close()


# -- restarts ---------------------------------------------------------------------------------
def test_checkpoints_between_flushes_wait_for_no_fsync_and_the_flush_makes_them_durable(tmp_path, monkeypatch):
    """A put that rotates a region may checkpoint, but never waits for the device to take every byte
    written since the last flush; the next flush syncs those regions and the checkpoint file (without
    writing it again), and a reopen from it finds everything."""
    from tierkv.tiers.ssd import checkpoint as C

    d = str(tmp_path / "s")
    t = SSDTier("ssd", 64 * MiB, d, region_size="1MiB", direct_io=False)
    synced: list[int] = []
    real, real_data = os.fsync, os.fdatasync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd))[1])
    monkeypatch.setattr(os, "fdatasync", lambda fd: (synced.append(fd), real_data(fd))[1])
    ckpt_syncs: list[str] = []
    real_sync = C.sync
    monkeypatch.setattr(C, "sync", lambda p: (ckpt_syncs.append(p), real_sync(p))[1])
    n = 3000  # ~12 MiB: more than the 8 sealed regions after which a writer checkpoints on its own
    keys = [key(i) for i in range(n)]
    for i in range(0, n, 100):
        assert t.write(keys[i:i + 100], [[blob(j, 4000)] for j in range(i, i + 100)]) == [True] * 100
    written = t.extra_stats()["checkpoints"]
    assert written >= 1
    assert synced == []
    t.flush()
    assert len(synced) > 8  # the regions written since, and the checkpoint file
    assert ckpt_syncs == [d] and t.extra_stats()["checkpoints"] == written  # synced, not written again
    t.flush()
    assert ckpt_syncs == [d]  # once
    t.close()
    monkeypatch.setattr(os, "fsync", real)
    monkeypatch.setattr(os, "fdatasync", real_data)
    t = SSDTier("ssd", 64 * MiB, d, region_size="1MiB", direct_io=False)
    assert t.extra_stats()["recovered_from"] == "checkpoint"
    ok, outs = read_all(t, keys, [4000] * n)
    assert all(ok) and all(torch.equal(o, blob(i, 4000)) for i, o in enumerate(outs))
    t.close()


FLUSH_THEN_KILL = """
import sys, torch
from tierkv.tiers.ssd import SSDTier
path = sys.argv[1]
t = SSDTier("ssd", 64 << 20, path, region_size="1MiB")
t.write([f"k{i:04d}" for i in range(300)], [[torch.full((20000,), i % 251, dtype=torch.uint8)] for i in range(300)])
t.delete([f"k{i:04d}" for i in range(0, 300, 7)])
t.write(["k0001"], [[torch.full((20000,), 77, dtype=torch.uint8)]])  # replaced
t.flush()
print(t.extra_stats()["checkpoints"], flush=True)
import os, signal
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_flush_writes_no_checkpoint_yet_everything_flushed_survives_sigkill(tmp_path):
    """``flush()`` costs what was written since the last one, not O(objects): below the checkpoint interval it
    writes no checkpoint, and a process killed right after it reopens with every flushed write and removal
    (the regions sealed since from their summaries, the active one from its records)."""
    import subprocess
    import sys

    d = str(tmp_path / "s")
    p = subprocess.run([sys.executable, "-c", FLUSH_THEN_KILL, d], capture_output=True, text=True, timeout=120)
    assert p.returncode == -9, p.stderr
    assert p.stdout.split() == ["0"]  # (6 MiB in 1 MiB regions: fewer seals than a checkpoint waits for)
    assert not os.path.exists(os.path.join(d, "checkpoint"))
    t = SSDTier("ssd", 64 * MiB, d, region_size="1MiB")
    want = {f"k{i:04d}" for i in range(300) if i % 7}
    assert {k for k, _ in t.recover()} == want and t.extra_stats()["recovered_from"] == "summaries"
    names = sorted(want)
    ok, outs = read_all(t, names, [20000] * len(names))
    assert all(ok)
    for k, o in zip(names, outs):
        i = int(k[1:])
        assert torch.equal(o, torch.full((20000,), 77 if i == 1 else i % 251, dtype=torch.uint8)), k
    t.close()


def test_checkpoint_writes_a_durable_checkpoint_now(tmp_path):
    d = str(tmp_path / "s")
    t = SSDTier("ssd", 16 * MiB, d, region_size="1MiB")
    t.write([key(i) for i in range(20)], [[blob(i, 3000)] for i in range(20)])
    t.flush()
    assert t.extra_stats()["checkpoints"] == 0
    t.checkpoint()
    assert t.extra_stats()["checkpoints"] == 1 and os.path.exists(os.path.join(d, "checkpoint"))
    t.checkpoint()  # nothing changed since: nothing written
    assert t.extra_stats()["checkpoints"] == 1
    t.close()


def test_removals_survive_restart_and_the_newest_value_wins(tmp_path):
    d = str(tmp_path / "s")
    t = SSDTier("ssd", 8 * MiB, d, region_size="1MiB")
    t.write([key(1), key(2), key(3)], [[blob(1, 500)], [blob(2, 500)], [blob(3, 500)]])
    t.flush()
    t.delete([key(2)])
    t.delete([key(3)])
    t.write([key(3)], [[blob(33, 700)]])  # removed and put again: the new value
    t.close()
    for drop_checkpoint in (False, True):  # from the checkpoint, and from the summaries alone
        if drop_checkpoint:
            os.unlink(os.path.join(d, "checkpoint"))
        t = SSDTier("ssd", 8 * MiB, d, region_size="1MiB")
        assert t.extra_stats()["recovered_from"] == ("summaries" if drop_checkpoint else "checkpoint")
        assert t.recover() == [(key(1), 500), (key(3), 700)]
        ok, outs = read_all(t, [key(1), key(3)], [500, 700])
        assert ok == [True, True] and torch.equal(outs[1], blob(33, 700))
        assert t.contains([key(2)]) == [False]
        t.close()


def test_a_replaced_value_never_comes_back_even_without_the_checkpoint(tmp_path):
    d = str(tmp_path / "s")
    t = SSDTier("ssd", 8 * MiB, d, region_size="1MiB")
    t.write([key(1), key(2)], [[blob(1, 500)], [blob(2, 500)]])
    t.close()
    t = SSDTier("ssd", 8 * MiB, d, region_size="1MiB")
    t.recover()
    t.write([key(1), key(2)], [[blob(11, 500)], [blob(22, 500)]])  # replaced in place, no removal first
    t.delete([key(2)])  # and the newer version of key 2 removed: the older must not return
    t.close()
    os.unlink(os.path.join(d, "checkpoint"))
    t = SSDTier("ssd", 8 * MiB, d, region_size="1MiB")
    assert t.recover() == [(key(1), 500)]
    ok, (out,) = read_all(t, [key(1)], [500])
    assert ok == [True] and torch.equal(out, blob(11, 500))
    t.close()


# same opening as the checkpoint test above: each test writes the objects its check needs, sizes included
def test_a_flipped_dead_log_entry_is_ignored_never_misread(tmp_path):
    d = str(tmp_path / "s")
    t = SSDTier("ssd", 8 * MiB, d, region_size="1MiB")
    t.write([key(i) for i in range(4)], [[blob(i, 500)] for i in range(4)])
    t.flush()
    t.delete([key(0), key(1)])
    t.close()
    os.unlink(os.path.join(d, "checkpoint"))
    with open(os.path.join(d, "dead"), "r+b") as f:  # the first entry's key
        b = f.read(1)
        f.seek(0)
        f.write(bytes([b[0] ^ 1]))
    t = SSDTier("ssd", 8 * MiB, d, region_size="1MiB")
    found = [k for k, _ in t.recover()]
    assert key(1) not in found and {key(2), key(3)} <= set(found)  # one entry lost, nothing else disturbed
    ok, outs = read_all(t, found, [500] * len(found))
    assert all(ok) and all(torch.equal(o, blob(int(k[1:5]), 500)) for k, o in zip(found, outs))
    t.close()


def test_removals_survive_restart_after_the_region_was_reclaimed(tmp_path):
    d = str(tmp_path / "s")
    t = SSDTier("ssd", 2 * MiB, d, region_size="1MiB")
    t.write([key(1, "x")], [[blob(1, 1000)]])
    t.delete([key(1, "x")])
    for rnd in range(40):
        ks = [key(i, f"c{rnd}") for i in range(10)]
        t.write(ks, [[blob(i, 30000)] for i in range(10)])
        t.delete(ks[:9])
        if rnd % 10 == 0:
            t.flush()
    assert t.extra_stats()["gc_runs"] > 2
    t.close()
    os.unlink(os.path.join(d, "checkpoint"))
    t = SSDTier("ssd", 2 * MiB, d, region_size="1MiB")
    found = {k for k, _ in t.recover()}
    assert key(1, "x") not in found
    assert all(key(9, f"c{rnd}") in found for rnd in range(30, 40))
    t.close()


# same opening as test_ssd_faults' flipped-header test: a tier filled for the check that follows
def test_smaller_capacity_on_reopen_keeps_the_newest(tmp_path):
    d = str(tmp_path / "s")
    t = SSDTier("ssd", 8 * MiB, d, region_size="1MiB")
    for i in range(20):
        t.write([key(i)], [[blob(i, 10000)]])
    t.close()
    small = 5 * SSDTier.footprint(t, 10000)
    t = SSDTier("ssd", small, d, region_size="1MiB")
    got = t.recover()
    assert [k for k, _ in got] == [key(i) for i in range(15, 20)]  # oldest first, the newest five
    assert t.extra_stats()["trimmed"] == 15
    t.close()
    t = SSDTier("ssd", 8 * MiB, d, region_size="1MiB")
    assert [k for k, _ in t.recover()] == [key(i) for i in range(15, 20)]  # the trimmed stay gone
    t.close()


def test_reopen_reads_the_checkpoint_and_only_later_regions(tmp_path, monkeypatch):
    from tierkv.tiers.ssd import region as R

    d = str(tmp_path / "s")
    t = SSDTier("ssd", 16 * MiB, d, region_size="1MiB")
    keys = [key(i) for i in range(600)]
    t.write(keys, [[blob(i, 3000)] for i in range(600)])
    t.close()
    calls = []
    real = R.read_summary
    monkeypatch.setattr(R, "read_summary", lambda *a: calls.append(a) or real(*a))
    t = SSDTier("ssd", 16 * MiB, d, region_size="1MiB")
    assert t.extra_stats()["recovered_from"] == "checkpoint" and calls == []
    assert len(t.recover()) == 600
    t.write([key(1000)], [[blob(1, 100)]])
    t.close()
    os.unlink(os.path.join(d, "checkpoint"))
    calls.clear()
    t = SSDTier("ssd", 16 * MiB, d, region_size="1MiB")
    assert t.extra_stats()["recovered_from"] == "summaries"
    assert len(calls) == len(region_files(d))  # one summary read per region, none per object
    assert len(t.recover()) == 601
    t.close()


# -- options on reopen ------------------------------------------------------------------------
def test_toggling_options_on_reopen_keeps_the_data(tmp_path):
    d = str(tmp_path / "s")
    settings_ = [{}, {"compression": "lz4"}, {"checksum": "crc32c"}, {"direct_io": False},
                 {"region_size": "2MiB"}, {"fsync": "never"}]
    if direct_ok(tmp_path / "probe"):
        settings_ += [{"direct_io": True}, {"direct_io": True, "compression": "lz4"}]
    written = {}
    for i, opts in enumerate(settings_):
        t = SSDTier("ssd", 16 * MiB, d, region_size=opts.pop("region_size", "1MiB"), **opts)
        assert sorted(k for k, _ in t.recover()) == sorted(written)
        ks = sorted(written)
        ok, outs = read_all(t, ks, [written[k] for k in ks])
        assert all(ok) and all(torch.equal(o, torch.arange(written[k]).to(torch.uint8)) for k, o in zip(ks, outs))
        k = key(i)
        t.write([k], [[torch.arange(5000 + i).to(torch.uint8)]])
        written[k] = 5000 + i
        t.close()
    assert len(written) == len(settings_)


@pytest.mark.parametrize("opts, match", [
    ({"direct_io": "false"}, "direct_io"), ({"compression": "zstd"}, "compression"),
    ({"checksum": "md5"}, "checksum"), ({"fsync": True}, "fsync"), ({"io_threads": "4"}, "io_threads"),
    ({"region_size": "3KiB"}, "region_size"), ({"region_size": "4GiB"}, "region_size"),
    ({"region_size": -1}, "region_size"), ({"path": 5}, "path")])
def test_every_option_is_checked_by_type(tmp_path, opts, match):
    cfg = {"capacity": "4MiB", "path": str(tmp_path / "s"), **opts}
    with pytest.raises(ConfigError, match=match):
        SSDTier.from_config("ssd", cfg)


def test_direct_io_auto_probes(tmp_path):
    t = SSDTier("ssd", MiB, str(tmp_path / "s"))
    assert t.direct_io == direct_ok(tmp_path / "p")
    t.close()


# -- the directory -------------------------------------------------------------------------
def test_a_second_writer_in_this_process_is_refused_naming_the_pid(tmp_path):
    d = str(tmp_path / "s")
    t = SSDTier("ssd", MiB, d)
    with pytest.raises(ConfigError, match=rf"{d}.*process {os.getpid()}"):
        SSDTier("ssd2", MiB, d)
    t.close()
    SSDTier("ssd3", MiB, d).close()  # free again once closed


def test_a_second_writer_process_is_refused_naming_its_pid(tmp_path):
    d = str(tmp_path / "s")
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from tierkv.tiers.ssd import SSDTier
        t = SSDTier("ssd", 1 << 20, {d!r})
        print("ready", flush=True)
        sys.stdin.readline()
        t.close()
    """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        with pytest.raises(ConfigError, match=rf"{d}.*process {child.pid}"):
            SSDTier("ssd", MiB, d)
        info = inspect_dir(d)  # read-only inspection works while the writer holds the lock
        assert info["layout"] == "regions"
        with pytest.raises(ConfigError, match=f"process {child.pid}"):
            inspect_dir(d, repair=True)
    finally:
        child.stdin.write("\n")
        child.stdin.flush()
        child.wait(30)
    SSDTier("ssd", MiB, d).close()


def test_the_old_one_file_per_object_layout_is_refused(tmp_path):
    d = tmp_path / "old"
    (d / "a7").mkdir(parents=True)
    (d / "a7" / ("k" * 64 + ".kv")).write_bytes(b"TKV1" + bytes(100))
    with pytest.raises(ConfigError, match="old one-file-per-object layout"):
        SSDTier("ssd", MiB, str(d))
    assert (d / "a7" / ("k" * 64 + ".kv")).exists()  # refused, not deleted


def test_removed_directories_are_recreated_and_caching_goes_on(tmp_path):
    d = str(tmp_path / "s")
    t = SSDTier("ssd", 4 * MiB, d, region_size="1MiB")
    t.write([key(1)], [[blob(1, 3000)]])
    t.flush()
    shutil.rmtree(os.path.join(d, "regions"))  # a tmp cleaner
    assert t.write([key(2)], [[blob(2, 3000)]]) == [True]
    ok, outs = read_all(t, [key(2)], [3000])
    assert ok == [True] and torch.equal(outs[0], blob(2, 3000))
    t.flush()
    assert region_files(d)
    for i in range(3, 200):  # on into new regions
        assert t.write([key(i)], [[blob(i, 30000)]]) == [True]
        t.delete([key(i - 1)]) if i > 3 else None
    shutil.rmtree(d, ignore_errors=True)  # the whole directory (the lock's watcher may make it again meanwhile)
    assert t.write([key(500)], [[blob(5, 3000)]]) == [True]
    t.close()
    t = SSDTier("ssd", 4 * MiB, d, region_size="1MiB")
    assert key(500) in {k for k, _ in t.recover()}
    ok, outs = read_all(t, [key(500)], [3000])
    assert ok == [True] and torch.equal(outs[0], blob(5, 3000))
    t.close()


def test_a_file_the_tier_cannot_interpret_is_skipped_and_kept(tmp_path):
    d = tmp_path / "s"
    t = SSDTier("ssd", 4 * MiB, str(d), region_size="1MiB")
    t.write([key(1)], [[blob(1, 100)]])
    t.close()
    alien = d / "regions" / "r000007.region"
    alien.write_bytes(b"not ours" * 100)
    t = SSDTier("ssd", 4 * MiB, str(d), region_size="1MiB")
    assert [k for k, _ in t.recover()] == [key(1)]
    assert t.extra_stats()["skipped_files"] == 1
    for i in range(100):
        t.write([key(i, "n")], [[blob(i, 30000)]])
    t.close()
    assert alien.read_bytes() == b"not ours" * 100


# -- keys and the index -------------------------------------------------------------------------
@pytest.mark.parametrize("keys", [
    [f"{i:064x}" for i in range(50)],  # one length, ASCII (the store's content addresses)
    [f"{i:03d}\n{i:03d}" for i in range(50)],  # one length, a newline inside each
    ["é" * 3 + f"{i:02d}" for i in range(50)],  # one length in bytes, not ASCII
    [f"k{i}" + "x" * (i % 7) for i in range(50)],  # lengths that differ
])
@pytest.mark.parametrize("source", ["checkpoint", "summaries"])
def test_recovered_keys_are_the_strings_written(tmp_path, keys, source):
    d = str(tmp_path / "s")
    t = SSDTier("ssd", 8 * MiB, d, region_size="1MiB")
    assert t.write(keys, [[blob(i, 100 + i)] for i in range(len(keys))]) == [True] * len(keys)
    t.close()
    if source == "summaries":
        os.unlink(os.path.join(d, "checkpoint"))
    t = SSDTier("ssd", 8 * MiB, d, region_size="1MiB")
    assert t.extra_stats()["recovered_from"] == source
    assert t.recover() == [(k, 100 + i) for i, k in enumerate(keys)]
    ok, outs = read_all(t, keys, [100 + i for i in range(len(keys))])
    assert all(ok) and all(torch.equal(o, blob(i, 100 + i)) for i, o in enumerate(outs))
    t.close()


def test_two_keys_of_one_digest_never_serve_each_other(tmp_path, monkeypatch):
    t = SSDTier("ssd", 4 * MiB, str(tmp_path / "s"), region_size="1MiB")
    monkeypatch.setattr(fmt, "key_digest", lambda kb: 12345)  # every key collides
    assert t.write(["alpha"], [[blob(1, 1000)]]) == [True]
    t.flush()
    ok, _ = read_all(t, ["beta"], [1000])
    assert ok == [False] and t.extra_stats()["collisions"] == 1
    ok, (out,) = read_all(t, ["alpha"], [1000])
    assert ok == [True] and torch.equal(out, blob(1, 1000))
    t.close()


def test_keys_that_look_like_file_names_are_just_keys(tmp_path):
    t = SSDTier("ssd", 4 * MiB, str(tmp_path / "s"), region_size="1MiB")
    odd = ["r000000.region", "checkpoint", "..", "LOCK", "a\\b c:d|e"]
    assert t.write(odd, [[blob(i, 200)] for i in range(len(odd))]) == [True] * len(odd)
    t.close()
    t = SSDTier("ssd", 4 * MiB, str(tmp_path / "s"), region_size="1MiB")
    assert sorted(k for k, _ in t.recover()) == sorted(odd)
    ok, outs = read_all(t, odd, [200] * len(odd))
    assert all(ok) and all(torch.equal(o, blob(i, 200)) for i, o in enumerate(outs))
    t.close()


def test_index_holds_a_million_objects_in_under_64_bytes_each():
    n = 1_000_000
    rng = np.random.default_rng(1)
    dig = np.unique(rng.integers(2, 2**63, size=n + 1000, dtype=np.uint64))[:n]
    ix = DigestIndex()
    ix.bulk_load(dig, np.zeros(n, np.uint32), np.arange(n, dtype=np.uint32), np.full(n, 99, np.uint32),
                 np.full(n, 7, np.uint32))
    assert len(ix) == n and ix.nbytes / n <= 64
    slots, _, off, rec, _ = ix.get_many(dig)  # every entry where its probe finds it
    assert (slots >= 0).all() and (off == np.arange(n)).all() and (rec == 99).all()
    for d in dig[:: 50_000].tolist():
        assert ix.get(d) is not None and ix.get(d)[1] == int(np.flatnonzero(dig == d)[0])
    assert ix.get(1 << 62 | 5) is None or (1 << 62 | 5) in set(dig.tolist())
    for d in dig[:1000].tolist():  # and it grows and shrinks one at a time
        assert ix.remove(d) is not None
    assert len(ix) == n - 1000 and ix.get(int(dig[0])) is None
    ix.put(int(dig[0]), 3, 4, 5, 6)
    assert ix.get(int(dig[0])) == (3, 4, 5, 6)


def test_index_batch_puts_and_lookups_agree_with_a_dict():
    """``put_many`` (duplicates within a batch, deleted slots reused, growth) and ``lookup`` against a model."""
    rng = random.Random(7)
    ix = DigestIndex(slots=16)
    model: dict[int, tuple[int, int, int, int]] = {}
    pool = [rng.randrange(2, 1 << 64) for _ in range(400)] + [5, 5 + 16, 5 + 32]  # (some of one home slot)
    for step in range(300):
        batch = [rng.choice(pool) for _ in range(rng.randrange(1, 40))]
        offs = [step * 100 + j for j in range(len(batch))]
        olds = ix.put_many(batch, step % 7, offs, [64 + j for j in range(len(batch))], list(range(len(batch))))
        want_olds = []
        for j, d in enumerate(batch):
            if d in model:
                want_olds.append(model[d][:3])
            model[d] = (step % 7, offs[j], 64 + j, j)
        assert sorted(olds) == sorted(want_olds)
        for d in rng.sample(pool, 10):  # deletes leave deleted slots for later puts
            got = ix.remove(d)
            assert (got is None) == (d not in model)
            model.pop(d, None)
        assert len(ix) == len(model)
        probe = rng.sample(pool, 30)
        found = ix.lookup(probe)
        assert found == [(i, *model[d]) for i, d in enumerate(probe) if d in model]
        assert all(ix.get(d) == model.get(d) for d in probe)


def test_a_reopen_takes_the_checkpointed_index_when_every_object_is_current(tmp_path, monkeypatch):
    """The checkpoint carries the index's slots; a reopen that finds every listed object current loads them
    as they are, and one that does not (a removal in the dead log since) builds the index from the objects."""
    d = str(tmp_path / "s")
    t = SSDTier("ssd", 16 * MiB, d, region_size="1MiB")
    keys = [key(i) for i in range(300)]
    assert t.write(keys, [[blob(i, 1000 + i)] for i in range(300)]) == [True] * 300
    t.close()
    built = []
    real = DigestIndex.bulk_load
    monkeypatch.setattr(DigestIndex, "bulk_load", lambda self, *a: (built.append(len(a[0])), real(self, *a))[1])
    t = SSDTier("ssd", 16 * MiB, d, region_size="1MiB")
    assert built == [] and len(t._state.catalogue.index) == 300 and t.extra_stats()["recovered_from"] == "checkpoint"
    assert sorted(k for k, _ in t.recover()) == sorted(keys)
    ok, outs = read_all(t, keys, [1000 + i for i in range(300)])
    assert all(ok) and all(torch.equal(o, blob(i, 1000 + i)) for i, o in enumerate(outs))
    assert t.contains([key(1000)]) == [False]
    t.delete(keys[:10])  # named in the dead log; the checkpoint is rewritten only by a flush or close
    t._state.catalogue.dead.write(True)
    t._health.lock_file.release()  # (as a killed process would leave it)
    t2 = SSDTier("ssd", 16 * MiB, d, region_size="1MiB")
    assert built == [290] and len(t2._state.catalogue.index) == 290
    assert sorted(k for k, _ in t2.recover()) == sorted(keys[10:])
    assert t2.contains(keys[:12]) == [False] * 10 + [True] * 2
    t2.close()
    t.close()  # (its state is the same 290 objects)


# -- inspect ----------------------------------------------------------------------------------
def test_inspect_reports_and_repairs(tmp_path):
    d = str(tmp_path / "s")
    t = SSDTier("ssd", 4 * MiB, d, region_size="1MiB")
    t.write([key(i) for i in range(10)], [[blob(i, 2000)] for i in range(10)])
    t.close()
    before = {f: open(f, "rb").read() for f in region_files(d)}
    info = inspect_dir(d, verify=True)
    assert info["objects"] == 10 and info["bytes"] == 20000 and info["corrupt"] == 0
    assert info["checkpoint"]["valid"] and info["layout"] == "regions"
    assert sum(r["objects"] for r in info["regions"]) == 10
    assert all({"index", "objects", "live_bytes", "size_bytes"} <= set(r) for r in info["regions"])
    assert {f: open(f, "rb").read() for f in region_files(d)} == before  # read-only
    (f,) = region_files(d)
    data = bytearray(open(f, "rb").read())
    at = data.find(key(3).encode())
    data[at + 500] ^= 0xFF  # a payload byte of key 3
    open(f, "wb").write(data)
    assert inspect_dir(d)["corrupt"] == 0  # without verify, payloads are not read
    info = inspect_dir(d, verify=True)
    assert info["corrupt"] == 1 and info["corrupt_keys"] == [key(3)]
    info = inspect_dir(d, repair=True)
    assert info["repaired"] == 1 and info["corrupt"] == 0 and info["objects"] == 9
    t = SSDTier("ssd", 4 * MiB, d, region_size="1MiB")
    assert key(3) not in {k for k, _ in t.recover()}
    t.close()


# -- a stateful model with restarts and reclamation ----------------------------------------------------
KEYS = [f"key{i:02d}" for i in range(30)]
SIZES = [1, 700, 9000, 40000, 100000]


def content(k: str, size: int, gen: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(int(k[3:]) * 100003 + size * 7 + gen)
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g)


class SSDMachine(RuleBasedStateMachine):
    """The tier against a dict: what was written and not removed is read back exact, across restarts."""

    CAP = 1200 << 10

    def __init__(self):
        super().__init__()
        import tempfile

        self.dir = tempfile.mkdtemp(prefix="tierkv-ssd-model-")
        self.opts = {"region_size": "1MiB"}
        self.tier = SSDTier("ssd", self.CAP, self.dir, **self.opts)
        self.model: dict[str, tuple[int, int]] = {}  # key -> (size, generation)
        self.gen = 0

    def teardown(self):
        self.tier.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def used(self) -> int:
        return sum(self.tier.footprint(n) for n, _ in self.model.values())

    @rule(k=st.sampled_from(KEYS), size=st.sampled_from(SIZES))
    def put(self, k, size):
        if k in self.model:
            self.tier.delete([k])
            del self.model[k]
        if self.used() + self.tier.footprint(size) > self.CAP:
            return
        self.gen += 1
        assert self.tier.write([k], [[content(k, size, self.gen)]]) == [True]
        self.model[k] = (size, self.gen)

    @rule(ks=st.lists(st.sampled_from(KEYS), min_size=1, max_size=5, unique=True))
    def get(self, ks):
        sizes = [self.model[k][0] if k in self.model else 10 for k in ks]
        ok, outs = read_all(self.tier, ks, sizes)
        for k, f, o in zip(ks, ok, outs):
            assert f == (k in self.model), k
            if f:
                assert torch.equal(o, content(k, *self.model[k])), "wrong bytes"

    @rule(ks=st.lists(st.sampled_from(KEYS), min_size=1, max_size=4))
    def remove(self, ks):
        self.tier.delete(ks)
        for k in ks:
            self.model.pop(k, None)

    @rule()
    def flush(self):
        self.tier.flush()

    @rule(lose_checkpoint=st.booleans(), direct=st.booleans())
    def restart(self, lose_checkpoint, direct):
        self.tier.close()
        if lose_checkpoint and os.path.exists(os.path.join(self.dir, "checkpoint")):
            os.unlink(os.path.join(self.dir, "checkpoint"))
        self.tier = SSDTier("ssd", self.CAP, self.dir, direct_io=direct and direct_ok_cached(), **self.opts)
        assert sorted(k for k, _ in self.tier.recover()) == sorted(self.model)

    @invariant()
    def accounting(self):
        assert self.tier.used_bytes <= self.used()
        assert self.tier.extra_stats()["objects"] == len(self.model)


_DIRECT: list = []


def direct_ok_cached() -> bool:
    if not _DIRECT:
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            _DIRECT.append(direct_ok(os.path.join(d, "p")))
    return _DIRECT[0]


SSDMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=60, deadline=None)
TestSSDModel = SSDMachine.TestCase


class StagedSSDMachine(SSDMachine):
    """The same model with large payloads staged in huge-page memory (as the store's write-behind stages
    them): with O_DIRECT they are written from where they are, in padded records, beside copied ones,
    through restarts, lost checkpoints and reclamation of 4 MiB regions."""

    CAP = 6 << 20

    def __init__(self):
        super().__init__()
        from tierkv.hostmem import StagingArena

        self.tier.close()
        self.opts = {"region_size": "4MiB"}
        self.tier = SSDTier("ssd", self.CAP, self.dir, direct_io=direct_ok_cached(), **self.opts)
        self.arena = StagingArena()

    def teardown(self):
        super().teardown()
        self.arena.release()

    @rule(ks=st.lists(st.sampled_from(KEYS), min_size=1, max_size=4, unique=True),
          size=st.sampled_from([130_000, 200_000, 333_333, 500_000]))
    def put_staged(self, ks, size):
        self.tier.delete(ks)
        for k in ks:
            self.model.pop(k, None)
        room = self.CAP - self.used()
        ks = ks[:max(0, room // self.tier.footprint(size))]
        if not ks:
            return
        self.gen += 1
        views = self.arena.carve([size] * len(ks))
        for k, v in zip(ks, views):
            v.copy_(content(k, size, self.gen))
        assert self.tier.write(ks, [[v] for v in views]) == [True] * len(ks)
        for k in ks:
            self.model[k] = (size, self.gen)


StagedSSDMachine.TestCase.settings = settings(max_examples=25, stateful_step_count=50, deadline=None)
TestStagedSSDModel = StagedSSDMachine.TestCase


def test_direct_reads_take_neighbours_up_to_two_mib_in_one_read(tmp_path, monkeypatch):
    """O_DIRECT: a batch of neighbouring records is read with one aligned read per 2 MiB of them (the
    device serves one long read faster than several short ones), and every one comes back exact."""
    if not direct_ok(tmp_path / "probe"):
        pytest.skip("no O_DIRECT on this file system")
    from tierkv.tiers.ssd import recordreader as rp

    t = SSDTier("ssd", 64 * MiB, str(tmp_path / "s"), region_size="16MiB", direct_io=True)
    try:
        size = 256 << 10
        g = torch.Generator().manual_seed(3)
        vals = [torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g) for _ in range(8)]
        keys = [f"n{i}" for i in range(8)]
        assert t.write(keys, [[v] for v in vals]) == [True] * 8
        t.close()  # (reopened: the records are read from the file, not from the active region's image)
        t = SSDTier("ssd", 64 * MiB, str(tmp_path / "s"), region_size="16MiB", direct_io=True)
        spans = []
        real = rp.R.read_span_scratch

        def spy(fd, offset, length, direct):
            spans.append(length)
            return real(fd, offset, length, direct)

        monkeypatch.setattr(rp.R, "read_span_scratch", spy)
        ok, outs = read_all(t, keys, [size] * 8)
        assert ok == [True] * 8 and all(torch.equal(o, v) for o, v in zip(outs, vals))
        # eight records of a little over 256 KiB lie within 2 MiB and a gap: one read (four per read at 1 MiB)
        assert len(spans) == 1 and 8 * size < spans[0] <= rp._RUN_MAX_DIRECT + rp._RUN_GAP
        # twice as many: two reads, none longer than a run
        more = [f"m{i}" for i in range(8)]
        assert t.write(more, [[v] for v in vals]) == [True] * 8
        t.close()
        t = SSDTier("ssd", 64 * MiB, str(tmp_path / "s"), region_size="16MiB", direct_io=True)
        spans.clear()
        ok, outs = read_all(t, keys + more, [size] * 16)
        assert ok == [True] * 16 and all(torch.equal(o, v) for o, v in zip(outs, vals + vals))
        assert len(spans) == 2 and max(spans) <= rp._RUN_MAX_DIRECT + rp._RUN_GAP
    finally:
        t.close()


# -- staging buffers ----------------------------------------------------------------------------
def _mapping_of(addr: int) -> dict:
    """The /proc/self/smaps entry (VmFlags, Rss in KiB) of the mapping that holds ``addr``."""
    cur: dict = {}
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                cur = {"hit": lo <= addr < hi}
            elif cur.get("hit"):
                if head == "VmFlags:":
                    cur["flags"] = line.split()[1:]
                    return cur
                if head == "Rss:":
                    cur["rss"] = int(line.split()[1])
    raise AssertionError(f"no mapping holds {addr:#x}")


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps") or not hasattr(__import__("mmap"), "MADV_HUGEPAGE"),
                    reason="Linux with transparent huge pages only")
def test_large_staging_buffers_ask_for_huge_pages_and_small_ones_do_not():
    """Region images and read scratch of 2 MiB or more are advised as huge pages (an O_DIRECT transfer
    from physically contiguous memory is a few long segments); ``huge=False`` and small buffers are not;
    ``populate`` faults every page in, after the advice."""
    import ctypes

    def addr(b) -> int:
        return ctypes.addressof(ctypes.c_char.from_buffer(b))

    big = fmt.aligned_buffer(4 << 20, populate=True)
    small = fmt.aligned_buffer(1 << 20)
    plain = fmt.aligned_buffer(4 << 20, huge=False)
    m = _mapping_of(addr(big))
    assert "hg" in m["flags"] and m["rss"] >= 4096  # (KiB: all of it resident)
    assert "hg" not in _mapping_of(addr(small))["flags"]
    assert "hg" not in _mapping_of(addr(plain))["flags"]
    assert bytes(big[:4096]) == bytes(4096) and len(big) == 4 << 20
