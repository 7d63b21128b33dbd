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
from tierkv.tools.sim import read_trace, simulate

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
    args = ("simulate", work / "chat.jsonl", "--config", work / "store.yaml", "--bandwidth", "hbm=20GiB",
            "--bandwidth", "dram=10GiB", "--bandwidth", "ssd=2GiB", "--prefill-tokens-per-s", "8000")
    r = tierkv(*args, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)  # --json: one JSON document on stdout, nothing else
    r = tierkv(*args)
    assert r.returncode == 0, r.stderr
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
    r = tierkv("simulate", work / "chat.jsonl", "--config", work / "store.yaml", "--json", "--limit", "100")
    assert r.returncode == 0 and json.loads(r.stdout)["requests"] == 100


def test_simulate_bandwidths_from_a_bench_json(work, tmp_path):
    bench = {"version": 1, "bandwidth_Bps": {"dram": 8e9, "ssd": 1e9}}
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    r = tierkv("simulate", work / "chat.jsonl", "--config", work / "store.yaml", "--bench-json",
               tmp_path / "bench.json", "--json")
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
    args = ["bench", "--suite", "dram,ssd,keys", "--sizes", "1", "--batch", "4", "--rounds", "2",
            "--dir", tmp_path]
    r = tierkv(*args, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    (tmp_path / "b1.json").write_text(r.stdout)
    names = [x["bench"] for x in doc["rows"]]
    assert "dram get 1 MiB x4" in names and "ssd put 1 MiB x4" in names
    for x in doc["rows"]:
        if x["ratio"] is not None:  # tierkv throughput / baseline throughput, of the two figures shown
            assert x["ratio"] == pytest.approx(x["value"] / x["baseline"]) and x["value"] > 0
    assert doc["bandwidth_Bps"]["ssd"] > 0 and doc["bandwidth_Bps"]["dram"] > 0
    old = dict(doc)
    old["rows"] = [{**x, "value": x["value"] / 2, "value_rounds": [v / 2 for v in x["value_rounds"]]}
                   for x in doc["rows"]]
    (tmp_path / "old.json").write_text(json.dumps(old))
    r = tierkv(*args, "--compare", tmp_path / "old.json")
    assert r.returncode == 0, r.stderr
    header = r.stdout.splitlines()[0]
    assert "ratio" in header and "old" in header and "change" in header and "verdict" in header
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
    summary = json.loads(r.stdout)
    assert summary["exact"] and summary["found"] == summary["asked"] > 0
    assert "hbm" in r.stderr and "ssd" in r.stderr  # the report, beside the JSON
    for how in (("-m", "tierkv", "demo", "--chunks", "8"), ("-m", "tierkv.tools.demo", "--chunks", "8")):
        r = tierkv(*how[1:], exe="-m")
        assert r.returncode == 0, r.stderr
        assert "repeated request" in r.stdout
    r = tierkv("--chunks", "8", exe="tierkv-demo")
    assert r.returncode == 0 and "bytes exact: True" in r.stdout


@pytest.mark.vllm
@pytest.mark.slow
def test_demo_vllm_cold_then_warm(tmp_path):
    r = tierkv("demo", "--vllm", "--prompt-tokens", "512", "--dir", tmp_path, "--json", timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    summary = json.loads(r.stdout)
    assert summary["same_tokens"]  # the warm run, served from tierkv, computes the same next token
    assert summary["warm_hit_tokens"] >= 256  # at least one 256-token chunk came from the tiers
    assert sum(t["hits"] for t in summary["tiers"].values()) > 0
    assert "cold TTFT" in r.stderr and "warm TTFT" in r.stderr


def test_pool_start_runs_the_standalone_pool_command():
    r = tierkv("pool", "start", "--master", "127.0.0.1:50051", "--metadata-server",
               "http://127.0.0.1:8080/metadata", "--segment", "1GiB", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert "mooncake_client" in r.stdout and "--global_segment_size=1GB" in r.stdout
    assert "--master_server_address=127.0.0.1:50051" in r.stdout
    r = tierkv("pool", "start", "--metadata-server", "http://127.0.0.1:8080/metadata", "--dry-run")
    assert r.returncode == 2 and "--master" in r.stderr


# -- every answer is true: one-line errors, one output convention, benchmarks that report only what they did --

def _one_line_error(r, command: str, code: int = 2, *words: str) -> None:
    assert r.returncode == code, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert lines and lines[-1].startswith(f"tierkv {command}: "), r.stderr
    for w in words:
        assert w in lines[-1], (w, lines[-1])


REC = '{"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]}\n'


@pytest.mark.parametrize("name,content,words", [
    ("latin1.jsonl", REC.encode() + b'{"timestamp": 5, "note": "caf\xe9"}\n', ["not UTF-8", "0xe9"]),
    ("notgzip.jsonl.gz", REC.encode(), ["not a gzip file"]),
    ("truncated.jsonl.gz", None, ["gzip"]),
    ("neg-bt.jsonl", b'{"format": "tierkv-trace", "version": 1, "block_tokens": -16}\n' + REC.encode(),
     ["block_tokens", "-16"]),
    ("neg-bt-record.jsonl", b'{"timestamp": 0, "input_length": 10, "hash_ids": [1], "block_tokens": -16}\n',
     ["block_tokens"]),
    ("neg-input.jsonl", b'{"timestamp": 0, "input_length": -1024, "output_length": 1, "hash_ids": [1, 2]}\n',
     ["input_length", "-1024"]),
    ("str-ids.jsonl", b'{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": ["a"]}\n',
     ["hash_ids"]),
    ("lfs.jsonl", b"version https://git-lfs.github.com/spec/v1\noid sha256:4d7a2146\nsize 12345\n",
     ["Git LFS pointer", "git lfs pull"]),
])
def test_a_bad_trace_is_a_one_line_error_in_simulate_and_trace_show(work, tmp_path, name, content, words):
    import gzip

    path = tmp_path / name
    if content is None:
        path.write_bytes(gzip.compress((REC * 200).encode())[:-30])
    else:
        path.write_bytes(content)
    r = tierkv("simulate", path, "--config", work / "dram.yaml")
    _one_line_error(r, "simulate", 2, str(path), *words)
    r = tierkv("trace", "show", path)
    _one_line_error(r, "trace", 2, str(path), *words)


def test_bad_numbers_and_missing_directories_are_one_line_errors(work, tmp_path):
    trace = work / "chat.jsonl"
    _one_line_error(tierkv("simulate", trace, "--config", work / "dram.yaml", "--block-tokens", "-1"),
                    "simulate", 2, "--block-tokens")
    _one_line_error(tierkv("simulate", trace, "--config", work / "dram.yaml", "--prefill-tokens-per-s", "nan"),
                    "simulate", 2, "--prefill-tokens-per-s")
    _one_line_error(tierkv("simulate", "--generate", "chat", "--requests", "5", "--rate", "0", "-o",
                           tmp_path / "x.jsonl"), "simulate", 2, "--rate")
    missing = tmp_path / "no" / "such" / "dir"
    _one_line_error(tierkv("simulate", "--generate", "chat", "--requests", "5", "-o", missing / "g.jsonl"),
                    "simulate", 2, str(missing / "g.jsonl"), "No such file")
    _one_line_error(tierkv("trace", "convert", trace, "-o", missing / "c.jsonl"),
                    "trace", 2, str(missing / "c.jsonl"), "No such file")
    # --json takes no file: the old `--json FILE` is refused by the parser, not written anywhere
    r = tierkv("simulate", trace, "--config", work / "dram.yaml", "--json", missing / "s.json")
    assert r.returncode == 2 and "Traceback" not in r.stderr and not missing.exists()
    # convert never overwrites the trace it reads, and leaves no half file behind a bad trace
    r = tierkv("trace", "convert", trace, "-o", trace)
    _one_line_error(r, "trace", 2, "is the trace being read")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(REC * 3 + '{"timestamp": 0, "input_length": -5, "hash_ids": [1]}\n')
    _one_line_error(tierkv("trace", "convert", bad, "-o", tmp_path / "out.jsonl"), "trace", 2, "input_length")
    assert not list(tmp_path.glob("out.jsonl*"))


def test_bench_options_are_checked(tmp_path):
    _one_line_error(tierkv("bench", "--suite", "keys", "--dir", tmp_path / "missing"), "bench", 2,
                    "--dir", "no such directory")
    for sizes in ("nan", "inf", "-2", "0", "2,x"):
        _one_line_error(tierkv("bench", "--suite", "dram", "--sizes", sizes), "bench", 2, "--sizes")
    _one_line_error(tierkv("bench", "--suite", "keys", "--rounds", "0"), "bench", 2, "--rounds")
    for rows in ([{"value": 1}], [["dram put", 1]], [{"bench": "dram put 2 MiB x32", "value": "fast"}],
                 [{"bench": "x", "value": 1, "value_rounds": "many"}]):
        (tmp_path / "old.json").write_text(json.dumps({"version": 2, "rows": rows}))
        _one_line_error(tierkv("bench", "--suite", "keys", "--compare", tmp_path / "old.json"), "bench", 2,
                        "--compare", "row 0")
    (tmp_path / "old.json").write_text("[1, 2]")
    _one_line_error(tierkv("bench", "--suite", "keys", "--compare", tmp_path / "old.json"), "bench", 2, "--compare")


def _bench_config(tmp_path, medium: str) -> Path:
    cfg = tmp_path / f"{medium}.json"
    cfg.write_text(json.dumps({"tiers": [{"medium": f"bench_media:{medium}", "name": "custom",
                                          "capacity": "64MiB"}]}))
    return cfg


@pytest.mark.parametrize("medium,words", [("RefusingTier", ["put:", "not stored"]),
                                          ("FlippingTier", ["get:", "bytes differ"]),
                                          ("SilentTier", ["get:", "bytes differ"]),
                                          ("DiskFullTier", ["put:", "not stored", "disk full"])])
def test_bench_fails_on_a_tier_that_refuses_or_corrupts(tmp_path, medium, words):
    args = ["bench", "--config", _bench_config(tmp_path, medium), "--sizes", "0.25", "--batch", "4", "--rounds", "2"]
    r = tierkv(*args)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    failed = [x for x in r.stdout.splitlines() if x.startswith("custom ") and "FAILED" in x]
    assert failed, r.stdout  # the row says FAILED, with no figure
    assert "GiB/s" not in " ".join(failed)
    assert any(all(w in x for w in words) for x in r.stderr.splitlines()), r.stderr
    r = tierkv(*args, "--json", "--suite", "keys")  # --config always adds its tiers to the suites asked for
    assert r.returncode == 1
    doc = json.loads(r.stdout)
    assert doc["suites"] == ["keys", "config"]
    assert doc["ok"] is False and doc["failures"]
    bad = [x for x in doc["rows"] if x["failures"]]
    assert bad and all(x["value"] is None and x["ratio"] is None for x in bad)
    # a run that failed cannot price anything in the simulator
    (tmp_path / "bench.json").write_text(r.stdout)
    trace = tmp_path / "t.jsonl"
    trace.write_text(REC)
    r = tierkv("simulate", trace, "--config", _bench_config(tmp_path, medium), "--bench-json", tmp_path / "bench.json")
    _one_line_error(r, "simulate", 2, "failed")


def test_bench_of_an_honest_custom_tier_passes_and_a_broken_one_is_one_line(tmp_path):
    cfg = tmp_path / "ok.json"
    cfg.write_text(json.dumps({"tiers": [{"medium": "bench_media:_DictTier", "name": "custom", "capacity": "1MiB"},
                                         {"medium": "ssd", "path": str(tmp_path / "prod-ssd"), "capacity": "1GiB"}]}))
    r = tierkv("bench", "--config", cfg, "--sizes", "0.25", "--batch", "4", "--rounds", "2", "--dir", tmp_path,
               "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["ok"] and not doc["failures"]
    names = [x["bench"] for x in doc["rows"]]
    assert names == ["custom put 0.25 MiB x4", "custom get 0.25 MiB x4", "ssd put 0.25 MiB x4", "ssd get 0.25 MiB x4"]
    for x in doc["rows"]:
        assert x["ratio"] == pytest.approx(x["value"] / x["baseline"])
        assert min(x["value_rounds"]) <= x["value"] <= max(x["value_rounds"])
    assert not (tmp_path / "prod-ssd").exists()  # the configured directory is never touched
    assert doc["where"]["ssd"]["dir"].startswith(str(tmp_path))
    assert list(tmp_path.iterdir()) == [cfg]  # the bench's own directory is removed
    broken = _bench_config(tmp_path, "BrokenTier")
    _one_line_error(tierkv("bench", "--config", broken, "--sizes", "0.25"), "bench", 1, "RuntimeError",
                    "device is gone")


def test_bench_ssd_says_where_and_how_it_measured(tmp_path):
    r = tierkv("bench", "--suite", "ssd", "--sizes", "0.5", "--batch", "2", "--rounds", "2", "--dir", tmp_path)
    assert r.returncode == 0, r.stderr
    where = [x for x in r.stdout.splitlines() if x.startswith("ssd: measured in ")]
    assert where and str(tmp_path) in where[0]
    from tierkv.tools.benchmarks import fs_type

    assert fs_type(str(tmp_path)) in where[0]
    mode = "O_DIRECT" if "O_DIRECT" in where[0] else "page cache"
    assert f"raw writev / preadv ({mode})" in r.stdout  # the baseline ran in the tier's own I/O mode


def _bench_doc(rounds_by_bench: dict) -> dict:
    rows = [{"bench": b, "unit": "GiB/s", "value": sorted(v)[len(v) // 2], "baseline": 1.0, "ratio": 1.0,
             "value_rounds": v, "against": "torch copy", "failures": []} for b, v in rounds_by_bench.items()]
    return {"version": 2, "ok": True, "rows": rows, "failures": [], "bandwidth_Bps": {}}


def test_compare_weighs_a_change_against_the_spread_of_rounds():
    from tierkv.tools.cli.bench import compare

    new = _bench_doc({"a": [9.0, 10.0, 11.0]})["rows"][0]
    noisy = _bench_doc({"a": [0.5, 0.6, 20.0]})["rows"][0]  # a median of 0.6 but rounds up to 20
    assert compare(new, noisy)[2] == "within spread"
    slow = _bench_doc({"a": [4.0, 5.0, 6.0]})["rows"][0]
    assert compare(new, slow)[1] == "+100.0%" and compare(new, slow)[2] == "better"
    assert compare(slow, new)[2] == "worse"
    one = {**new, "value_rounds": [10.0]}
    assert compare(one, slow)[2] == "no spread (1 round)"


def test_bench_keys_json_and_compare_end_to_end(tmp_path):
    r = tierkv("bench", "--suite", "keys", "--rounds", "1", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)  # stdout is the JSON document alone
    assert doc["ok"] and doc["rounds"] == 1
    (tmp_path / "b.json").write_text(r.stdout)
    r = tierkv("bench", "--suite", "keys", "--rounds", "1", "--compare", tmp_path / "b.json")
    assert r.returncode == 0, r.stderr
    assert "verdict" in r.stdout.splitlines()[0]


def test_simulate_warns_on_a_bandwidth_no_device_has(work):
    r = tierkv("simulate", work / "chat.jsonl", "--config", work / "store.yaml", "--limit", "50",
               "--bandwidth", "ssd=2642GiB", "--bandwidth", "dram=20GiB", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert any("'ssd'" in w and "more than any" in w for w in out["warnings"])
    assert "more than any" in r.stderr and "'dram'" not in r.stderr
    _one_line_error(tierkv("simulate", work / "chat.jsonl", "--config", work / "store.yaml",
                           "--bandwidth", "nvme=2GiB"), "simulate", 2, "nvme")
    r = tierkv("simulate", work / "chat.jsonl", "--config", work / "store.yaml", "--limit", "200",
               "--bandwidth", "ssd=2GiB", "--json")
    out = json.loads(r.stdout)
    assert out["load_s"] is None and any("no read bandwidth" in w and "'hbm'" in w for w in out["warnings"])


def test_captured_traces_carry_chunk_sizes(tmp_path, work):
    path = tmp_path / "cap" / "trace.jsonl"
    store = TieredStore.from_config({"tiers": [{"medium": "dram", "capacity": "64MiB"}], "trace_path": str(path)})
    try:
        keys = [f"k{i}" for i in range(4)]
        store.lookup(keys)  # before any put: the writer does not know the size yet
        store.put(keys, [torch.zeros(3000, dtype=torch.uint8)] * 4)
        store.lookup(keys)
    finally:
        store.close()
    recs = [json.loads(x) for x in path.read_text().splitlines()[1:]]
    assert "block_bytes" not in recs[0] and recs[1]["block_bytes"] == 3000
    r = tierkv("simulate", path, "--config", work / "dram.yaml", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["block_bytes"] == 3000 and out["bytes_per_token_from"] == "trace" and not out["warnings"]
    assert "assum" not in r.stderr
    # a trace with no sizes: the assumption is said, on stderr and in the result
    r = tierkv("simulate", work / "chat.jsonl", "--config", work / "dram.yaml", "--limit", "20", "--json")
    out = json.loads(r.stdout)
    assert out["bytes_per_token_from"] == "assumed" and "Llama-3-8B" in r.stderr and out["warnings"]


def test_sweep_of_a_chain_plots_what_varies(work, tmp_path):
    r = tierkv("simulate", work / "chat.jsonl", "--config", work / "store.yaml", "--sweep", "dram=256MiB..4GiB:3",
               "--policies", "lru,fifo", "--out", tmp_path / "sw", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["metric"] == "tier_hit_rate"
    lru = [x["tier_hit_rate"] for x in doc["rows"] if x["policy"] == "lru"]
    assert lru[-1] > lru[0]  # more DRAM: more of the blocks served by DRAM
    ref = simulate(list(read_trace(str(work / "chat.jsonl"))), str(work / "store.yaml"),
                   capacities={"dram": doc["rows"][0]["capacity_bytes"]})
    assert lru[0] == pytest.approx(ref.tiers["dram"]["hits"] / ref.blocks)
    assert "sweep: 6 replays" in r.stderr
    rows = list(csv.DictReader(open(tmp_path / "sw" / "sweep.csv")))
    for x, y in zip(rows, doc["rows"]):  # every tier's hits, per point
        assert [int(x[f"hits_{t}"]) for t in ("hbm", "dram", "ssd")] == [y[f"hits_{t}"] for t in ("hbm", "dram", "ssd")]
        assert int(x["hits_dram"]) == y["hits"]


def test_json_means_one_document_on_stdout(work, tmp_path):
    cases = [("trace", "show", work / "chat.jsonl", "--json"),
             ("simulate", work / "chat.jsonl", "--config", work / "dram.yaml", "--limit", "10", "--json"),
             ("simulate", "--generate", "rag", "--requests", "10", "-o", tmp_path / "g.jsonl", "--json"),
             ("demo", "--chunks", "8", "--json")]
    for args in cases:
        r = tierkv(*args)
        assert r.returncode == 0, (args, r.stderr)
        json.loads(r.stdout)  # the whole of stdout is one document


def test_demo_config_never_writes_into_the_configured_directory(tmp_path):
    prod = tmp_path / "prod-ssd"
    cfg = tmp_path / "prod.yaml"
    cfg.write_text(f"tiers:\n  - {{medium: dram, capacity: 32MiB}}\n"
                   f"  - {{medium: ssd, path: {prod}, capacity: 1GiB}}\n"
                   f"trace_path: {tmp_path / 'prod-trace.jsonl'}\n")
    r = tierkv("demo", "--chunks", "8", "--config", cfg, "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["ok"] and s["found"] == s["asked"] > 0 and s["removed"] == s["stored"]
    assert not prod.exists() and not (tmp_path / "prod-trace.jsonl").exists()
    assert str(prod) in r.stderr  # the demo says what it moved


def test_nothing_to_do_is_not_a_success(tmp_path):
    _one_line_error(tierkv("trace", "show", tmp_path / "nothing-*.jsonl"), "trace", 2, "no file matches")
    _one_line_error(tierkv("trace", "show", tmp_path), "trace", 2, "no trace files")
    _one_line_error(tierkv("demo", "--chunks", "2"), "demo", 2, "--chunks")


def test_progress_shows_life_during_one_long_step(capsys):
    import time

    from tierkv.tools.cli._common import Progress

    with Progress(3, "replays", "runs", period=0.05, command="simulate") as bar:
        deadline = time.monotonic() + 30
        while "replays: 0/3 runs" not in capsys.readouterr().err:  # one long step, no update: the timer speaks
            assert time.monotonic() < deadline
            time.sleep(0.01)
        bar.update(3)
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("tierkv simulate: replays: 3/3 runs") and last.endswith("(done)")


def test_bench_ssd_gets_read_the_device_not_the_region_image(tmp_path):
    # a batch far below a region: before the store is reopened the gets were copies of the in-memory image
    code = ("import atexit, sys\n"
            "from tierkv.tiers.ssd.recordreader import RecordReader\n"
            "n = [0]\n"
            "orig = RecordReader._image_read\n"
            "def counted(self, *a):\n"
            "    n[0] += 1\n"
            "    return orig(self, *a)\n"
            "RecordReader._image_read = counted\n"
            "atexit.register(lambda: print('image reads:', n[0], file=sys.stderr))\n"
            "from tierkv.tools.cli import main\n"
            "sys.exit(main(sys.argv[1:]))\n")
    r = subprocess.run([sys.executable, "-c", code, "bench", "--suite", "ssd", "--rounds", "1", "--batch", "2",
                        "--sizes", "0.25", "--dir", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    assert "ssd get 0.25 MiB x2" in r.stdout
    assert "image reads: 0" in r.stderr, r.stderr


def test_demo_counts_only_what_it_stored_read_and_removed(tmp_path):
    # 64 MiB of DRAM and 64 MiB of SSD cannot hold the demo's 4 MiB chunks: most are refused, none of the
    # repeated prompt survives; every figure must say so
    cfg = tmp_path / "prod.json"
    cfg.write_text(json.dumps({"tiers": [{"medium": "dram", "capacity": "64MiB"},
                                         {"medium": "ssd", "path": str(tmp_path / "prod-ssd"), "capacity": "64MiB"}]}))
    d = tmp_path / "demo"
    d.mkdir()
    (d / "mine.txt").write_text("an operator's file")
    r = tierkv("demo", "--config", cfg, "--dir", d, "--json")
    assert r.returncode == 1, r.stderr  # nothing read back
    assert "Traceback" not in r.stderr
    s = json.loads(r.stdout)
    assert 0 < s["stored"] < s["offered"]
    assert sum(s["refused"].values()) == s["offered"] - s["stored"]
    assert s["refused"].get("no_room")
    assert 0 <= s["removed"] <= s["stored"] and s["left"] == 0
    assert s["found"] == 0 and s["exact"] is None
    assert f"{s['found']}/{s['asked']} chunks read" in r.stderr  # the text and the JSON: one fact
    assert "bytes exact: n/a (nothing read)" in r.stderr
    put = next(x for x in r.stderr.splitlines() if x.strip().startswith("put:"))
    assert f"{s['stored'] * 4:.1f} MiB stored ({s['stored']} of {s['offered']} chunks offered)" in put
    assert "no room" in put
    assert f"removed {s['removed']} chunks of the {s['stored']} the demo stored" in r.stderr
    # what the demo wrote under --dir is gone, what was there stays; the configured path was never made
    assert sorted(p.name for p in d.iterdir()) == ["mine.txt"]
    assert not (tmp_path / "prod-ssd").exists()


def test_demo_dir_is_cleaned_and_never_written_over(tmp_path):
    r = tierkv("demo", "--chunks", "8", "--dir", tmp_path / "new")
    assert r.returncode == 0, r.stderr
    assert "bytes exact: True" in r.stdout
    assert not (tmp_path / "new").exists()  # made for the demo, removed with what it held
    (tmp_path / "old" / "ssd").mkdir(parents=True)
    (tmp_path / "old" / "ssd" / "region-0").write_bytes(b"someone's data")
    _one_line_error(tierkv("demo", "--chunks", "8", "--dir", tmp_path / "old"), "demo", 2, "already holds files")
    assert (tmp_path / "old" / "ssd" / "region-0").read_bytes() == b"someone's data"
