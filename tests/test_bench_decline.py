"""The decline benchmark's arithmetic (bench/bench_decline.py): what its ratios to the connector-free engine mean."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import bench_decline as B


def test_summarise_pairs_each_prompt_with_the_connector_free_engine_and_skips_the_evidence() -> None:
    times = {"none": [1.0, 1.0, 2.0, 2.0], "tierkv": [3.0, 3.0, 2.0, 1.0]}
    cached = {"none": [0, 0, 0, 0], "tierkv": [512, 512, 0, 0]}
    got = B.summarise(times, cached)
    assert got["tierkv"]["vs_none_median"] == pytest.approx(2.0)  # ratios 3, 3, 1, 0.5
    assert got["tierkv"]["vs_none_mean"] == pytest.approx(9 / 6)
    assert got["tierkv"]["hit_prompts"] == 2 and got["none"]["hit_prompts"] == 0
    assert "vs_none_median" not in got["none"]
    later = B.summarise(times, cached, skip=2)
    assert later["tierkv"]["n"] == 2 and later["tierkv"]["hit_prompts"] == 0
    assert later["tierkv"]["vs_none_median"] == pytest.approx(0.75)
    assert later["tierkv"]["median_ms"] == pytest.approx(1500.0)


def test_bad_options_are_refused_with_a_short_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        B.main(["--prompts", "2"])
    assert e.value.code == 2
    assert "--prompts must be at least" in capsys.readouterr().err
