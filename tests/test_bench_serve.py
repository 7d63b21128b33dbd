"""The serving benchmark's own arithmetic: what it reads from /metrics, and how it waits between runs.

The benchmark itself needs vLLM servers and minutes; these parts decide what its figures mean.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import bench_serve as B
import profile_split as P


def _counters(**kw: float) -> dict[str, float]:
    out = dict.fromkeys(B.COUNTERS, 0.0)
    out.update({f"vllm:{k}": v for k, v in kw.items()})
    return out


def test_served_from_takes_differences_of_counters() -> None:
    before = _counters(request_queue_time_seconds_sum=1.0, request_queue_time_seconds_count=10,
                       request_prefill_time_seconds_sum=2.0, request_prefill_time_seconds_count=10,
                       time_to_first_token_seconds_sum=5.0, time_to_first_token_seconds_count=10,
                       prefix_cache_queries=1000, prefix_cache_hits=100)
    after = _counters(request_queue_time_seconds_sum=1.5, request_queue_time_seconds_count=20,
                      request_prefill_time_seconds_sum=3.0, request_prefill_time_seconds_count=20,
                      time_to_first_token_seconds_sum=7.0, time_to_first_token_seconds_count=20,
                      prefix_cache_queries=2000, prefix_cache_hits=600)
    got = B.served_from(before, after)
    assert got["queue_ms"] == pytest.approx(50.0)
    assert got["prefill_ms"] == pytest.approx(100.0)
    assert got["server_ttft_ms"] == pytest.approx(200.0)
    assert got["local_hit"] == pytest.approx(0.5)
    assert "connector_hit" not in got  # nothing asked of a connector: no share at all


def test_served_from_leaves_out_what_did_not_move() -> None:
    same = _counters(time_to_first_token_seconds_sum=5.0, time_to_first_token_seconds_count=10)
    assert B.served_from(same, same) == {}


def test_settle_waits_at_least_the_time_asked() -> None:
    t0 = time.monotonic()
    waited = B.settle(0.2, quiet=1.01)  # every window is quiet enough: the wait is the time asked and one window
    assert 0.2 <= time.monotonic() - t0 < 5
    assert waited >= 0.2


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="reads /proc/stat")
def test_settle_gives_up_at_most_when_the_cpus_never_quieten() -> None:
    # no window is ever under 0 % busy: it waits until ``most``, and not much longer
    waited = B.settle(0.0, quiet=0.0, window=0.05, most=0.5)
    assert 0.5 <= waited < 3


def test_cpu_busy_counts_grow() -> None:
    if not Path("/proc/stat").exists():
        pytest.skip("reads /proc/stat")
    b0, t0 = B._cpu_busy()
    time.sleep(0.05)  # time passing on purpose: the counters measure it
    b1, t1 = B._cpu_busy()
    assert t1 >= t0 and b1 >= b0 and t0 >= b0


# -- the profile's split (bench/profile_split.py) -------------------------------------------------------------
_PROC = 'process 1:"VLLM::Worker_TP0"'
_THREAD = 'thread (0x1): "MainThread"'


def _stack(*frames: str, n: int = 1) -> str:
    return ";".join((_PROC, _THREAD, *frames)) + f" {n}"


def test_profile_split_counts_each_busy_sample_once_in_the_first_part_its_connector_frames_show(
        tmp_path: Path) -> None:
    raw = tmp_path / "p.txt"
    raw.write_text("\n".join([
        # an audit's checksum is audit; a checksum inside a load is checksum
        _stack("run (threading.py:1)", "_audit_one (adapters/vllm/audit.py:5)", "digest (tierkv/checksum.py:9)",
               n=3),
        _stack("execute_model (vllm/v1/worker/cpu_model_runner.py:1)", "start_load_kv (adapters/vllm/connector.py:2)",
               "load (tierkv/engine/reader.py:3)", "tierkv_copy_sum_jobs (_copysum.cpython-311.so)",
               "XXH3_hashLong_64b (_copysum.cpython-311.so)", n=5),
        _stack("execute_model (vllm/v1/worker/cpu_model_runner.py:1)", "forward (vllm/model.py:2)",
               "save_kv_layer (adapters/vllm/connector.py:2)", n=7),
        # vLLM's own prefix cache shares a name with MooncakeStoreConnector's lookup: not a connector sample
        _stack("schedule (vllm/v1/core/sched/scheduler.py:1)",
               "find_longest_cache_hit (vllm/v1/core/kv_cache_coordinator.py:2)", n=11),
        _stack("get_num_new_matched_tokens (vllm/distributed/kv_transfer/kv_connector/v1/mooncake/store/"
               "connector.py:1)", "lookup (vllm/distributed/kv_transfer/kv_connector/v1/mooncake/store/worker.py:2)",
               n=13),
        _stack("execute_model (vllm/v1/worker/cpu_model_runner.py:1)", "forward (vllm/model.py:2)", n=17),
        _stack("run (threading.py:1)", "wait (threading.py:2)", "pthread_cond_wait (libc.so)", n=19),
        "not a stack line",
    ]))
    got = P.summarise(raw, rate=10, requests=2)
    parts = {k: v["samples"] for k, v in got["parts"].items()}
    assert parts == {"connector: audit": 3, "connector: checksum": 5, "connector: save": 7,
                     "engine: vLLM scheduler": 11, "connector: probe": 13, "engine: model forward": 17}
    assert got["samples"] == 75
    (thread,) = got["threads"].values()
    assert thread["waiting"] == 19 and thread["busy"] == 56
    assert got["parts"]["engine: model forward"]["busy_ms_per_request"] == pytest.approx(17 * 100 / 2)
