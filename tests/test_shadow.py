"""Sampled shadow caches against the simulator on the same trace."""

from __future__ import annotations

import time

import pytest
import torch

from tierkv import TieredStore
from tierkv.errors import ConfigError
from tierkv.shadow import attach
from tierkv.tools.sim import generate, replay, simulate

BPT = 64
BLOCK = 16 * BPT  # 1 KiB chunks: the store's bookkeeping, not byte copies, dominates


@pytest.fixture(scope="module")
def chat():
    return list(generate("chat", 2500, 16, seed=5))


@pytest.mark.parametrize("policy,rate", [("lru", 1.0), ("lru", 0.25), ("arc", 0.25), ("s3fifo", 0.25)])
def test_top_tier_estimates_match_simulated_capacities(chat, policy, rate):
    cap = 300 * BLOCK
    cfg = {"tiers": [{"medium": "dram", "capacity": cap, "eviction": policy}]}
    store = TieredStore.from_config({**cfg, "shadow": {"rate": rate}})
    try:
        real = replay(chat, store, bytes_per_token=BPT)  # a real DRAM tier, real bytes
        sh = store.stats()["tiers"]["dram"]["shadow"]
    finally:
        store.close()
    assert sh["sample_rate"] == rate and sh["requests"] == real.blocks
    assert sh["sampled_requests"] == pytest.approx(rate * real.blocks, rel=0.35)
    # factor 1 against what the real tier did
    assert sh["factors"]["1"]["hit_rate"] == pytest.approx(real.chunk_hit_rate, abs=0.03)
    est = {f: sh["factors"][f]["hit_rate"] for f in ("0.5", "2", "4")}
    sims = {f: simulate(chat, cfg, capacities={"dram": int(float(f) * cap)}, bytes_per_token=BPT).chunk_hit_rate
            for f in est}
    for f in est:
        assert est[f] == pytest.approx(sims[f], abs=0.03), (f, est, sims)
        assert sh["factors"][f]["capacity_bytes"] == int(float(f) * cap)
    assert sims["0.5"] < sims["2"] < sims["4"]  # the capacities really differ in what they buy


def test_lower_tier_estimates_the_chain_at_other_capacities(chat):
    cfg = {"tiers": [{"medium": "hbm", "device": "cpu", "capacity": 100 * BLOCK},
                     {"medium": "dram", "capacity": 300 * BLOCK}]}
    store = TieredStore.from_config({**cfg, "shadow": {"rate": 0.5}})
    try:
        replay(chat, store, bytes_per_token=BPT)
        st = store.stats()["tiers"]
    finally:
        store.close()
    for f in ("1", "2", "4"):
        sim = simulate(chat, cfg, capacities={"dram": int(float(f) * 300 * BLOCK)}, bytes_per_token=BPT)
        assert st["dram"]["shadow"]["factors"][f]["cumulative_hit_rate"] == pytest.approx(sim.chunk_hit_rate,
                                                                                          abs=0.05)
    top = st["hbm"]["shadow"]["factors"]
    low = st["dram"]["shadow"]["factors"]
    for f in ("0.5", "1", "2", "4"):  # the lower tier's own share excludes what the top tier serves
        assert low[f]["hit_rate"] == pytest.approx(low[f]["cumulative_hit_rate"] - top["1"]["cumulative_hit_rate"])


def test_shadow_config_errors_and_cost():
    base = {"tiers": [{"medium": "dram", "capacity": "4MiB"}]}
    for bad, msg in (({"rate": 0}, "shadow rate"), ({"rate": 2}, "shadow rate"), ({"size": 1}, "unknown option"),
                     ("yes", "expected true or false")):
        with pytest.raises(ConfigError, match=msg):
            TieredStore.from_config({**base, "shadow": bad})
    # the cost of shadowing 4 capacities at the default rate, on 1 KiB chunks where bookkeeping is all the
    # store does (figures, not an assert): CPU time, best of 3 rounds taken in turn
    reqs = list(generate("mix", 2000, 16, seed=1))
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(3):
        for shadow in (False, True):
            store = TieredStore.from_config({"tiers": [{"medium": "dram", "capacity": 2000 * BLOCK}],
                                             "shadow": shadow})
            t0 = time.process_time()
            replay(reqs, store, bytes_per_token=BPT)
            times[shadow].append(time.process_time() - t0)
            store.close()
    on, off = min(times[True]), min(times[False])
    print(f"shadow at rate 0.05: replay CPU {on:.2f} s vs {off:.2f} s without ({(on / off - 1) * 100:+.1f}%)")


def test_a_failing_policy_in_a_shadow_never_reaches_the_caller():
    store = TieredStore.from_config({"tiers": [{"medium": "dram", "capacity": 64 * 1024}]})
    obs = attach(store, rate=1.0)
    for _, shadows in obs._tiers:
        for sh in shadows.values():
            sh.policy.victims = lambda n, p: (_ for _ in ()).throw(RuntimeError("boom"))
    x = torch.zeros(4096, dtype=torch.uint8)
    try:
        for i in range(40):  # the shadows overflow and their policy raises: the store goes on
            assert store.put([f"k{i}"], [x]) == [True]
        assert store.get(["k39"], [x]) == [True]
    finally:
        store.close()
