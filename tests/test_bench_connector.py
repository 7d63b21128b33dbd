"""bench/bench_connector.py's modes on a small rig: what they report and that they check what they move."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import bench_connector as B


def test_baseline_moves_are_the_load_s_objects_into_their_block_views():
    rig = B.Rig(layers=2, blocks=3, head=8)
    try:
        per = rig.object_bytes
        src = B.torch.arange(2 * 3 * per, dtype=B.torch.int64).to(B.torch.uint8)
        moves = B.baseline_moves(rig, src)
        assert len(moves) == 6 and all(n == per for _, _, n in moves)
        assert [s - src.data_ptr() for _, s, _ in moves] == [i * per for i in range(6)]  # back to back, in order
        B.Memcpy(B.COPY_THREADS).run(moves)
        # layer-major: the second layer's first block holds the fourth object's bytes
        got = rig.caches[rig.names[1]][0].reshape(-1).view(B.torch.uint8)
        assert B.torch.equal(got, src[3 * per:4 * per])
    finally:
        rig.w.shutdown()


def test_bandwidth_reports_both_loads_against_the_memcpy(tmp_path, capsys):
    out = tmp_path / "bw.json"
    assert B.main(["--bandwidth", "--layers", "2", "--blocks", "4", "--head", "64", "--rounds", "2",
                   "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["bytes"] == d["objects"] * d["object_bytes"] == 2 * 4 * 2 * 16 * 2 * 64 * 4
    assert d["threads"] == B.COPY_THREADS and len(d["loadavg"]) == 3
    for side in ("always", "external", "memcpy"):
        lo, hi = d[side]["gib_s_range"]
        assert 0 < lo <= d[side]["gib_s"] <= hi
    for side in ("always", "external"):
        lo, hi = d[side]["ratio_range"]
        assert 0 < lo <= d[side]["ratio"] <= hi
    text = capsys.readouterr().out
    assert "checksums checked" in text and "verify off" in text and "target >= 0.8" in text


@pytest.mark.parametrize("flag", [[], ["--verify-cost"]])
def test_other_modes_still_run(flag, tmp_path):
    out = tmp_path / "o.json"
    assert B.main([*flag, "--layers", "2", "--blocks", "4", "--rounds", "1", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["objects"] == 8
