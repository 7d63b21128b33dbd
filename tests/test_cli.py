"""The ``tierkv`` command run as a user runs it: a subprocess, its output, its exit code, what it writes."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tierkv import TieredStore
from tierkv.sim import read_trace, simulate

BIN = Path(sys.executable).parent
TESTS = Path(__file__).parent


def tierkv(*args, cwd=None, timeout=300, exe="tierkv"):
    env = {**os.environ, "PYTHONPATH": str(TESTS), "GLOG_minloglevel": "2", "MC_LOG_LEVEL": "ERROR"}
    cmd = [str(BIN / exe), *map(str, args)] if exe != "-m" else [sys.executable, "-m", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=timeout, env=env)


STORE_YAML = """\
tiers:
  - {medium: hbm, device: cpu, capacity: 3GiB}
  - {medium: dram, capacity: 8GiB, eviction: lru}
  - {medium: ssd, path: /nonexistent/sim-only, capacity: 40GiB}
"""


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    (d / "store.yaml").write_text(STORE_YAML)
    (d / "dram.yaml").write_text("tiers:\n  - {medium: dram, capacity: 8GiB, eviction: lru}\n")
    r = tierkv("simulate", "--generate", "chat", "--requests", "600", "--seed", "4", "-o", d / "chat.jsonl")
    assert r.returncode == 0, r.stderr
    assert "wrote 600 chat requests" in r.stdout
    return d


def test_help_and_exit_codes(tmp_path):
    r = tierkv("--help")
    assert r.returncode == 0
    for cmd in ("demo", "bench", "inspect", "simulate", "trace"):
        assert cmd in r.stdout
        sub = tierkv(cmd, "--help")
        assert sub.returncode == 0 and f"tierkv {cmd}" in sub.stdout
    assert tierkv().returncode == 2  # no command: usage
    r = tierkv("simulate", "--no-such-flag")
    assert r.returncode == 2 and "unrecognized arguments" in r.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("tiers:\n  - {medium: dram, capacity: 1GiB, eviction: nope}\n")
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n')
    r = tierkv("simulate", trace, "--config", bad)
    assert r.returncode == 2
    assert r.stderr.startswith("tierkv simulate: ") and "unknown eviction policy 'nope'" in r.stderr
    assert "Traceback" not in r.stderr
    r = tierkv("simulate", tmp_path / "missing.jsonl", "--config", bad)
    assert r.returncode == 2 and "no such file" in r.stderr
    r = tierkv("inspect", tmp_path / "nowhere")
    assert r.returncode == 2 and "not a directory" in r.stderr


def test_simulate_prints_and_writes_what_the_library_computes(work):
    r = tierkv("simulate", work / "chat.jsonl", "--config", work / "store.yaml", "--bandwidth", "hbm=20GiB",
               "--bandwidth", "dram=10GiB", "--bandwidth", "ssd=2GiB", "--prefill-tokens-per-s", "8000",
               "--json", work / "sim.json")
    assert r.returncode == 0, r.stderr
    out = json.loads((work / "sim.json").read_text())
    ref = simulate(list(read_trace(str(work / "chat.jsonl"))), str(work / "store.yaml"),
                   bandwidths={"hbm": 20 * 2**30, "dram": 10 * 2**30, "ssd": 2 * 2**30}, prefill_tokens_per_s=8000)
    assert out["prefill_tokens_saved"] == ref.hit_tokens > 0
    assert out["token_hit_rate"] == pytest.approx(ref.token_hit_rate)
    assert out["load_s"] == pytest.approx(ref.load_s) and out["recompute_s"] == pytest.approx(ref.recompute_s)
    for name in ("hbm", "dram", "ssd"):
        assert out["tiers"][name]["hits"] == ref.tiers[name]["hits"]
        assert out["tiers"][name]["evictions"] == ref.tiers[name]["evictions"]
    assert f"token hit rate: {ref.token_hit_rate:.4f}" in r.stdout
    assert f"prefill tokens saved: {ref.hit_tokens} of" in r.stdout
    assert "load time:" in r.stdout and "recompute" in r.stdout
    for line in r.stdout.splitlines():
        if line.startswith("hbm "):
            assert str(ref.tiers["hbm"]["hits"]) in line.split()
    # --json - alone: a JSON document on stdout and nothing else
    r = tierkv("simulate", work / "chat.jsonl", "--config", work / "store.yaml", "--json", "-", "--limit", "100")
    assert r.returncode == 0 and json.loads(r.stdout)["requests"] == 100


def test_simulate_bandwidths_from_a_bench_json(work, tmp_path):
    bench = {"version": 1, "bandwidth_Bps": {"dram": 8e9, "ssd": 1e9}}
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    r = tierkv("simulate", work / "chat.jsonl", "--config", work / "store.yaml", "--bench-json",
               tmp_path / "bench.json", "--json", "-")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    t = out["tiers"]
    assert t["hbm"]["read_bandwidth"] == 8e9  # hbm on cpu is priced as dram
    assert t["ssd"]["read_bandwidth"] == 1e9
    assert out["load_s"] == pytest.approx(sum(x["bytes_read"] / x["read_bandwidth"] for x in t.values()))


def _axes_box(img: np.ndarray) -> tuple[int, int, int, int]:
    dark = img.max(axis=2) < 90
    rows = np.where(dark.sum(axis=1) > 0.4 * img.shape[1])[0]
    cols = np.where(dark.sum(axis=0) > 0.4 * img.shape[0])[0]
    return int(cols.min()), int(rows.min()), int(cols.max()), int(rows.max())  # left, top, right, bottom


def _color_mask(img: np.ndarray, hex_color: str) -> np.ndarray:
    rgb = np.array([int(hex_color[i:i + 2], 16) for i in (1, 3, 5)])
    return np.abs(img.astype(int) - rgb).sum(axis=2) < 60


def test_sweep_writes_a_csv_and_a_png_of_those_numbers(work):
    out = work / "sweep"
    r = tierkv("simulate", work / "chat.jsonl", "--config", work / "dram.yaml", "--sweep", "dram=256MiB..16GiB:5",
               "--policies", "lru,fifo,sim_policies:MRUPolicy", "--out", out)
    assert r.returncode == 0, r.stderr
    rows = list(csv.DictReader(open(out / "sweep.csv")))
    assert len(rows) == 15
    caps = sorted({int(x["capacity_bytes"]) for x in rows})
    assert caps[0] == 256 << 20 and caps[-1] == 16 << 30 and len(caps) == 5
    for x in rows:  # every row is a real replay at that capacity and policy
        assert 0.0 <= float(x["token_hit_rate"]) <= 1.0
    lru = {int(x["capacity_bytes"]): float(x["token_hit_rate"]) for x in rows if x["policy"] == "lru"}
    assert lru[caps[-1]] > lru[caps[0]]  # more DRAM, more hits
    ref = simulate(list(read_trace(str(work / "chat.jsonl"))), str(work / "dram.yaml"),
                   capacities={"dram": caps[2]}, evictions={"dram": "fifo"})
    assert float(next(x for x in rows if x["policy"] == "fifo" and int(x["capacity_bytes"]) == caps[2])
                 ["token_hit_rate"]) == pytest.approx(ref.token_hit_rate)

    from PIL import Image

    img = np.asarray(Image.open(out / "sweep.png").convert("RGB"))
    assert img.shape[0] > 200 and img.shape[1] > 300
    left, top, right, bottom = _axes_box(img)
    assert right - left > 200 and bottom - top > 150
    colors = {"lru": "#1f77b4", "fifo": "#ff7f0e", "sim_policies:MRUPolicy": "#2ca02c"}  # matplotlib's cycle
    order = list(colors)
    lo, hi = math.log2(caps[0]), math.log2(caps[-1])
    for x in rows:
        pol, cap, v = x["policy"], int(x["capacity_bytes"]), float(x["token_hit_rate"])
        px = left + (0.05 + 0.9 * (math.log2(cap) - lo) / (hi - lo)) * (right - left)  # default 5% x margins
        py = bottom - v * (bottom - top)  # y limits are exactly 0..1
        mask = _color_mask(img, colors[pol])
        col = mask[top + 2:bottom - 1, int(round(px)) - 1:int(round(px)) + 2].any(axis=1)
        ys = np.where(col)[0] + top + 2
        covered = any(y["policy"] in order[order.index(pol) + 1:] and int(y["capacity_bytes"]) == cap
                      and abs(float(y["token_hit_rate"]) - v) < 0.03 for y in rows)
        if not covered:  # the marker of this point is visible where its value puts it
            assert len(ys), (pol, cap, v)
        if len(ys):  # at a point's x, a curve is nowhere but at that point
            assert abs(ys.min() - py) < 9 and abs(ys.max() - py) < 9, (pol, cap, v, ys.min(), ys.max(), py)


def test_bench_table_json_and_compare(tmp_path):
    args = ["bench", "--suite", "dram,ssd,keys", "--sizes", "1", "--batch", "4", "--rounds", "1",
            "--dir", tmp_path]
    r = tierkv(*args, "--json", tmp_path / "b1.json")
    assert r.returncode == 0, r.stderr
    doc = json.loads((tmp_path / "b1.json").read_text())
    names = [x["bench"] for x in doc["rows"]]
    assert "dram get 1 MiB x4" in names and "ssd put 1 MiB x4" in names
    for x in doc["rows"]:
        if x["ratio"] is not None:  # ratio of the median rounds: tierkv throughput / baseline throughput
            assert x["ratio"] > 0 and x["baseline"] > 0 and x["value"] > 0
            assert x["bench"] in r.stdout
    assert doc["bandwidth_Bps"]["ssd"] > 0 and doc["bandwidth_Bps"]["dram"] > 0
    assert "ratio" in r.stdout.splitlines()[0]
    old = dict(doc)
    old["rows"] = [{**x, "ratio": x["ratio"] / 2 if x["ratio"] else None,
                    "value": x["value"] / 2} for x in doc["rows"]]
    (tmp_path / "old.json").write_text(json.dumps(old))
    r = tierkv(*args, "--compare", tmp_path / "old.json")
    assert r.returncode == 0, r.stderr
    header = r.stdout.splitlines()[0]
    assert "old" in header and "change" in header
    assert any("%" in line for line in r.stdout.splitlines()[2:])
    assert tierkv("bench", "--suite", "nope").returncode == 2
    r = tierkv("bench", "--suite", "dram_pool")
    assert r.returncode == 2 and "--master" in r.stderr


def _ssd_store(path, n=6, size=5000):
    store = TieredStore.from_config({"tiers": [{"medium": "ssd", "path": str(path), "capacity": "64MiB"}]})
    vals = [torch.full((size,), i, dtype=torch.uint8) for i in range(n)]
    assert all(store.put([f"key{i}" for i in range(n)], vals))
    store.close()
    return vals


def test_inspect_reads_a_directory_and_finds_corruption_read_only(tmp_path):
    d = tmp_path / "ssd"
    _ssd_store(d)
    r = tierkv("inspect", d, "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["objects"] == 6 and info["bytes"] == 6 * 5000 and info["corrupt"] == []
    assert sum(x["objects"] for x in info["regions"]) == 6
    assert all(x["size_bytes"] >= x["live_bytes"] for x in info["regions"])
    for k in ("path", "layout", "regions", "objects", "bytes", "corrupt", "repaired", "checkpoint"):
        assert k in info
    # flip a payload byte of key0's record: the headers stay intact, so only --verify can see it
    region = next(p for p in d.rglob("*.region"))
    data = region.read_bytes()
    at = data.find(b"key0") + 4 + 2000
    with open(region, "r+b") as f:
        f.seek(at)
        f.write(bytes([data[at] ^ 0xFF]))
    r = tierkv("inspect", d, "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["corrupt"] == []
    r = tierkv("inspect", d, "--verify")
    assert r.returncode == 1, r.stdout
    assert "--repair" in r.stderr
    r = tierkv("inspect", d, "--verify", "--json")
    assert r.returncode == 1 and len(json.loads(r.stdout)["corrupt"]) == 1
    assert region.read_bytes()[at] != data[at]  # read-only without --repair: nothing was rewritten
    r = tierkv("inspect", d, "--verify", "--repair", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["repaired"] == 1
    r = tierkv("inspect", d, "--verify", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["objects"] == 5
    # the store agrees: what is left is readable and exact
    store = TieredStore.from_config({"tiers": [{"medium": "ssd", "path": str(d), "capacity": "64MiB"}]})
    try:
        keys = [f"key{i}" for i in range(6)]
        assert store.contains(keys) == [False] + [True] * 5
    finally:
        store.close()


def test_trace_show_and_convert(work, tmp_path):
    r = tierkv("trace", "show", work / "chat.jsonl", "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    reqs = list(read_trace(str(work / "chat.jsonl")))
    assert s["requests"] == 600 == len(reqs)
    assert s["blocks"] == sum(len(x.hash_ids) for x in reqs)
    assert s["distinct_blocks"] == len({h for x in reqs for h in x.hash_ids})
    r = tierkv("trace", "show", work / "chat.jsonl", "--head", "2")
    assert r.returncode == 0 and r.stdout.count("hash_ids=") == 2
    r = tierkv("trace", "convert", work / "chat.jsonl", "--to", "mooncake", "-o", tmp_path / "mc.jsonl",
               "--limit", "10")
    assert r.returncode == 0, r.stderr
    lines = [json.loads(x) for x in (tmp_path / "mc.jsonl").read_text().splitlines()]
    assert len(lines) == 10 and set(lines[0]) == {"timestamp", "input_length", "output_length", "hash_ids"}
    assert lines[3]["hash_ids"] == reqs[3].hash_ids
    assert lines[3]["timestamp"] == round(reqs[3].timestamp * 1000)
    assert tierkv("trace").returncode == 2


def test_demo_entry_points(tmp_path):
    r = tierkv("demo", "--chunks", "16", "--json")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["exact"] and summary["found"] == summary["asked"] > 0
    assert "hbm" in r.stdout and "ssd" in r.stdout
    for how in (("-m", "tierkv", "demo", "--chunks", "8"), ("-m", "tierkv.demo", "--chunks", "8")):
        r = tierkv(*how[1:], exe="-m")
        assert r.returncode == 0, r.stderr
        assert "repeated request" in r.stdout
    r = tierkv("--chunks", "8", exe="tierkv-demo")
    assert r.returncode == 0 and "bytes exact: True" in r.stdout


@pytest.mark.vllm
@pytest.mark.slow
def test_demo_vllm_cold_then_warm(tmp_path):
    pytest.importorskip("vllm")
    r = tierkv("demo", "--vllm", "--prompt-tokens", "512", "--dir", tmp_path, "--json", timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["same_tokens"]  # the warm run, served from tierkv, computes the same next token
    assert summary["warm_hit_tokens"] >= 256  # at least one 256-token chunk came from the tiers
    assert sum(t["hits"] for t in summary["tiers"].values()) > 0
    assert "cold TTFT" in r.stdout and "warm TTFT" in r.stdout


def test_pool_start_runs_the_standalone_pool_command():
    r = tierkv("pool", "start", "--master", "127.0.0.1:50051", "--metadata-server",
               "http://127.0.0.1:8080/metadata", "--segment", "1GiB", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert "mooncake_client" in r.stdout and "--global_segment_size=1GB" in r.stdout
    assert "--master_server_address=127.0.0.1:50051" in r.stdout
    r = tierkv("pool", "start", "--metadata-server", "http://127.0.0.1:8080/metadata", "--dry-run")
    assert r.returncode == 2 and "--master" in r.stderr
