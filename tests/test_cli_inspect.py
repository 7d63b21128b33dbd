"""``tierkv inspect`` on SSD tier directories, run as a user runs it: a subprocess, its output, its exit code,
and what it leaves on disk (repair removes exactly the corrupt objects; a foreign directory is never touched;
a live writer is never mistaken for corruption)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tierkv import TieredStore

BIN = Path(sys.executable).parent


def tierkv(*args, timeout=300):
    r = subprocess.run([str(BIN / "tierkv"), *map(str, args)], capture_output=True, text=True, timeout=timeout)
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout, r.stderr
    return r


def _store(path, region_size="64MiB"):
    return TieredStore.from_config({"tiers": [{"medium": "ssd", "path": str(path), "capacity": "64MiB",
                                               "region_size": region_size}]})


def _fill(path, n, size, region_size="64MiB"):
    vals = [torch.full((size,), i % 251, dtype=torch.uint8) for i in range(n)]
    store = _store(path, region_size)
    try:
        assert all(store.put([f"key{i}" for i in range(n)], vals))
    finally:
        store.close()
    return vals


def _read_back(path, n, size, region_size="64MiB"):
    """{key: exact?} for the keys still there."""
    store = _store(path, region_size)
    try:
        keys = [f"key{i}" for i in range(n)]
        present = [k for k, ok in zip(keys, store.contains(keys)) if ok]
        outs = [torch.empty(size, dtype=torch.uint8) for _ in present]
        ok = store.get(present, outs) if present else []
        return {k: bool(g) and bool((o == int(k[3:]) % 251).all()) for k, g, o in zip(present, ok, outs)}
    finally:
        store.close()


def _files(d: Path) -> dict:
    """Every file's bytes but LOCK's (which holds a pid while a writer runs)."""
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file() and p.name != "LOCK"}


def _flip(region: Path, at: int, mask: int = 0xFF) -> None:
    with open(region, "r+b") as f:
        f.seek(at)
        b = f.read(1)[0]
        f.seek(at)
        f.write(bytes([b ^ mask]))


def test_repair_keeps_every_intact_object_of_a_directory_of_small_objects(tmp_path):
    # 4,000 one-byte chunks in 1 MiB regions: their footprints far exceed regions x region_size
    d = tmp_path / "small"
    _fill(d, 4000, 1, region_size="1MiB")
    before = _files(d)
    r = tierkv("inspect", d, "--repair")
    assert r.returncode == 0, r.stderr
    assert "repaired: 0 removed" in r.stdout and "objects: 4000" in r.stdout
    assert _files(d) == before  # nothing rewritten, nothing trimmed
    r = tierkv("inspect", d, "--repair", "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["repaired"] == 0 and info["removed"] == [] and info["corrupt"] == [] and info["objects"] == 4000
    got = _read_back(d, 4000, 1, region_size="1MiB")
    assert len(got) == 4000 and all(got.values())


def test_verify_names_corrupt_objects_and_repair_removes_exactly_them(tmp_path):
    d = tmp_path / "ssd"
    _fill(d, 6, 5000)
    (region,) = d.glob("regions/*.region")
    data = region.read_bytes()
    _flip(region, data.find(b"key1") + 4 + 2000)  # a payload byte
    _flip(region, data.find(b"key4") - 64 + 20, 0x01)  # a record header byte (raw_len)
    r = tierkv("inspect", d, "--verify")
    assert r.returncode == 1
    assert "key1: payload sum mismatch" in r.stdout and "key4: bad record header" in r.stdout
    assert "None" not in r.stdout and "--repair" in r.stderr
    r = tierkv("inspect", d, "--verify", "--json")  # JSON alone on stdout, the hint on stderr
    assert r.returncode == 1 and "--repair" in r.stderr
    corrupt = json.loads(r.stdout)["corrupt"]
    assert sorted((c["key"], c["reason"]) for c in corrupt) == [("key1", "payload sum mismatch"),
                                                                 ("key4", "bad record header")]
    r = tierkv("inspect", d, "--repair")
    assert r.returncode == 0, r.stderr
    assert "repaired: 2 removed" in r.stdout
    assert "removed key1: payload sum mismatch" in r.stdout and "removed key4: bad record header" in r.stdout
    r = tierkv("inspect", d, "--verify", "--json")
    info = json.loads(r.stdout)
    assert r.returncode == 0 and info["objects"] == 4 and info["corrupt"] == []
    assert _read_back(d, 6, 5000) == {f"key{i}": True for i in (0, 2, 3, 5)}


def test_plain_inspect_says_what_it_checked_and_catches_a_flipped_region_header(tmp_path):
    d = tmp_path / "ssd"
    _fill(d, 6, 5000)
    (region,) = d.glob("regions/*.region")
    _flip(region, region.read_bytes().find(b"key2") - 64 + 20, 0x01)  # a record's header
    r = tierkv("inspect", d)  # records are not read without --verify, and it says so
    assert r.returncode == 0, r.stderr
    assert "headers checked" not in r.stdout
    assert "checked: region headers" in r.stdout and "not checked: the objects' records" in r.stdout
    r = tierkv("inspect", d, "--verify")
    assert r.returncode == 1 and "key2: bad record header" in r.stdout
    _flip(region, 12, 0x01)  # the region's header (its index)
    r = tierkv("inspect", d, "--json")
    assert r.returncode == 1
    (c,) = json.loads(r.stdout)["corrupt"]
    assert c["file"] == "regions/r000000.region" and c["reason"] == "bad region header" and c["objects_lost"] == 6
    r = tierkv("inspect", d, "--repair")  # the file is left as it is (the tier never reuses it): still corrupt
    assert r.returncode == 1 and "repaired: 0 removed" in r.stdout and "regions/r000000.region" in r.stdout
    assert region.exists()


@pytest.mark.parametrize("with_files", [True, False])
def test_a_directory_without_tier_data_is_refused_and_left_untouched(tmp_path, with_files):
    d = tmp_path / "srv-data"
    d.mkdir()
    os.chmod(d, 0o755)
    if with_files:
        (d / "notes.txt").write_text("not ours\n")
        (d / "sub").mkdir()
        (d / "sub" / "x.bin").write_bytes(b"\0" * 100)
    listing = sorted(str(p.relative_to(d)) for p in d.rglob("*"))
    for extra in ([], ["--verify"], ["--repair"], ["--verify", "--repair", "--json"]) if with_files else (["--repair"],):
        r = tierkv("inspect", d, *extra)
        assert r.returncode == 2, (extra, r.stdout, r.stderr)
        assert r.stdout == ""
        assert r.stderr.startswith("tierkv inspect: ") and len(r.stderr.strip().splitlines()) == 1
        assert "not an ssd tier's directory" in r.stderr
    assert sorted(str(p.relative_to(d)) for p in d.rglob("*")) == listing  # no LOCK, no regions/
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o755
    r = tierkv("inspect", tmp_path / "missing", "--repair")
    assert r.returncode == 2 and "not a directory" in r.stderr and not (tmp_path / "missing").exists()


def test_the_old_one_file_per_object_layout_is_refused_not_read(tmp_path):
    from tierkv.errors import ConfigError
    from tierkv.tools.inspect import inspect_dir

    # (in process: the command's own refusal is the test above) shards of *.kv files, as the former layout kept them
    old = tmp_path / "a7" / ("k" * 64 + ".kv")
    old.parent.mkdir()
    old.write_bytes(b"TKV1" + bytes(100))
    with pytest.raises(ConfigError, match="not an ssd tier's directory"):
        inspect_dir(str(tmp_path), verify=True, repair=True)
    assert old.read_bytes() == b"TKV1" + bytes(100)  # refused, neither read as a tier nor repaired away
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a7"]


def test_bad_arguments_are_one_line_errors(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    for args in ([f], [f, "--repair"], ["--master", "127.0.0.1:1", "--verify"], ["--master", "h:1", tmp_path], []):
        r = tierkv("inspect", *args)
        assert r.returncode == 2, (args, r.stderr)
        assert r.stdout == "" and r.stderr.startswith("tierkv inspect: ") and len(r.stderr.splitlines()) == 1


WRITER = """
import sys, threading, torch
from tierkv.tiers.ssd import SSDTier
t = SSDTier("ssd", 8 << 20, {d!r}, region_size="1MiB")
stop = threading.Event()
def run():  # puts, removals and flushes without pause: regions fill, seal and are reclaimed
    i = 0
    while not stop.is_set():
        keys = [f"w{{i}}-{{j}}" for j in range(8)]
        t.write(keys, [[torch.full((20000,), (i + j) % 256, dtype=torch.uint8)] for j in range(8)])
        if i % 3 == 0:
            t.delete(keys[:4])
        if i % 7 == 0:
            t.flush()
        i += 1
th = threading.Thread(target=run)
th.start()
while t.used_bytes < (4 << 20):
    pass
print("ready", flush=True)
sys.stdin.readline()
stop.set()
th.join()
t.close()
"""


def test_a_live_writer_is_never_reported_as_corruption(tmp_path):
    d = tmp_path / "live"
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(WRITER.format(d=str(d)))],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        for _ in range(2):
            r = tierkv("inspect", d, "--json")  # read without a lock: described, nothing judged
            assert r.returncode == 0, r.stderr
            info = json.loads(r.stdout)
            assert info["corrupt"] == [] and info["live_writer"] == child.pid
            assert "nothing judged" in info["checked"][0]
            r = tierkv("inspect", d)
            assert r.returncode == 0 and "corrupt: not judged" in r.stdout and f"process {child.pid}" in r.stderr
            for extra in (["--verify"], ["--repair", "--json"]):
                r = tierkv("inspect", d, *extra)  # refused, naming the writer: never a false corrupt object
                assert r.returncode == 2 and f"process {child.pid}" in r.stderr, (extra, r.stderr)
                assert r.stdout == ""
    finally:
        child.stdin.write("\n")
        child.stdin.flush()
        child.wait(60)
    r = tierkv("inspect", d, "--verify", "--json")
    info = json.loads(r.stdout)
    assert r.returncode == 0 and info["corrupt"] == [] and info["objects"] > 0 and info["live_writer"] is None


def test_verify_reads_a_consistent_view_a_tier_cannot_open_meanwhile(tmp_path, monkeypatch):
    from tierkv.errors import ConfigError
    from tierkv.tiers.ssd import SSDTier
    from tierkv.tiers.ssd import survey as ssd_inspect

    d = tmp_path / "ssd"
    _fill(d, 3, 5000)
    refused = []
    check = ssd_inspect._check_record

    def check_and_try_a_writer(*args):
        try:
            SSDTier("ssd", 64 << 20, str(d)).close()
        except ConfigError as e:
            refused.append(str(e))
        return check(*args)

    monkeypatch.setattr(ssd_inspect, "_check_record", check_and_try_a_writer)
    info = ssd_inspect.inspect_dir(str(d), verify=True)
    assert info["corrupt"] == 0 and info["objects"] == 3
    assert len(refused) == 3 and all("in use" in m for m in refused)
    SSDTier("ssd", 64 << 20, str(d)).close()  # the shared lock went with the check
