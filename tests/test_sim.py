"""The simulator: the real store over null media against brute-force replays of the same traces."""

from __future__ import annotations

import random
import time
from collections import OrderedDict

import pytest

from tierkv.errors import ConfigError
from tierkv.policies import build_eviction
from tierkv.tiers import medium_class
from tierkv.tools.sim import Request, generate, null_store, read_trace, replay, simulate, write_trace
from tierkv.tools.sim.replay import footprint_rule

BT = 16  # tokens per block in the small traces
BPT = 64  # bytes per token: 1 KiB blocks


def random_trace(seed: int, n: int = 300, prefixes: int = 12) -> list[Request]:
    """Requests that extend one of a few random prefix trees: shared heads, divergent tails."""
    rng = random.Random(seed)
    trees: list[list[int]] = [[rng.getrandbits(40) for _ in range(rng.randint(1, 6))] for _ in range(prefixes)]
    out = []
    for i in range(n):
        base = rng.choice(trees)
        keep = rng.randint(0, len(base))
        ids = base[:keep] + [rng.getrandbits(40) for _ in range(rng.randint(0, 4))]
        if not ids:
            ids = [rng.getrandbits(40)]
        if rng.random() < 0.3:
            rng.choice(trees).extend(ids[len(base):])  # the tree grows: later requests reuse this tail
        out.append(Request(float(i), len(ids) * BT - rng.randrange(BT), 8, ids, BT))
    return out


def _offered(keys: list, lead: int, cache) -> tuple[int, list, list]:
    """The batch past the ``lead`` leading hits, as an engine offers it: how many of its keys are present (in
    ``cache``, or earlier in the request), the cached ones and the missing ones (each once, first appearance
    order)."""
    seen = set(keys[:lead])
    present = 0
    held: list = []
    missing: list = []
    for k in keys[lead:]:
        if k in seen or k in cache:
            present += 1
            if k in cache and k not in held:
                held.append(k)
        elif k not in missing:
            missing.append(k)
        seen.add(k)
    return present, held, missing


def reference_lru(requests, capacity_blocks: int) -> tuple[int, int]:
    """An independent LRU over blocks, as an engine drives a cache: (hit tokens, present blocks).

    Per request: the leading blocks present are read (refreshed, in order); the rest
    are offered in one batch — those present when it starts count as used (refreshed,
    once each, in order) and are never evicted by it, the missing ones inserted in
    order, the least recent other block evicted to make room.  Blocks the batch
    inserts are not evicted while it inserts (they are in flight).
    """
    cache: OrderedDict[int, None] = OrderedDict()
    hit_tokens = present = 0
    for r in requests:
        lead = 0
        for h in r.hash_ids:
            if h not in cache:
                break
            lead += 1
        for h in r.hash_ids[:lead]:
            cache.move_to_end(h)
        hit_tokens += min(lead * r.block_tokens, r.input_length)
        present += lead
        new: list[int] = []
        more, held, missing = _offered(r.hash_ids, lead, cache)
        present += more
        for h in held:
            cache.move_to_end(h)
        for h in missing:
            if len(cache) + len(new) >= capacity_blocks:
                victim = next((b for b in cache if b not in held), None)
                if victim is None:
                    continue  # only in-flight and protected blocks left: this one is refused
                del cache[victim]
            new.append(h)
        for h in new:
            cache[h] = None
    return hit_tokens, present


def reference_policy(requests, capacity_bytes: int, block_bytes: int, policy) -> tuple[int, int]:
    """The same engine loop over a plain dict, steered by ``policy`` through its four hooks."""
    policy.capacity_bytes = capacity_bytes
    cache: dict[str, int] = {}
    hit_tokens = present = 0
    for r in requests:
        keys = [f"b{h}" for h in r.hash_ids]
        lead = 0
        for k in keys:
            if k not in cache:
                break
            lead += 1
        for k in keys[:lead]:
            policy.on_access(k)
        hit_tokens += min(lead * r.block_tokens, r.input_length)
        present += lead
        # held: present keys of the batch, used now, protected while it makes room
        more, held, missing = _offered(keys, lead, cache)
        present += more
        for k in held:
            policy.on_access(k)
        used = sum(cache.values())
        # what fits without evicting is reserved first; room for the rest is asked in one call
        free = max(0, (capacity_bytes - used) // block_bytes)
        reserved, slow = missing[:free], missing[free:]
        used += len(reserved) * block_bytes
        if len(slow) > 1:
            short = min(len(slow) * block_bytes - (capacity_bytes - used), used)
            victims = policy.victims(short, set(held)) if short > 0 else None
            for v in victims or ():
                used -= cache.pop(v)
                policy.on_remove(v)
        for k in slow:
            if used + block_bytes > capacity_bytes:
                victims = policy.victims(used + block_bytes - capacity_bytes, set(held))
                if victims is None:
                    continue
                for v in victims:
                    used -= cache.pop(v)
                    policy.on_remove(v)
            reserved.append(k)
            used += block_bytes
        for k in reserved:
            cache[k] = block_bytes
            policy.on_insert(k, block_bytes)
    return hit_tokens, present


@pytest.mark.parametrize("seed", range(6))
def test_single_lru_tier_matches_an_independent_lru_exactly(seed):
    reqs = random_trace(seed)
    cap_blocks = random.Random(seed).choice([6, 10, 25, 60])
    res = simulate(reqs, {"tiers": [{"medium": "dram", "capacity": cap_blocks * BT * BPT, "eviction": "lru"}]},
                   bytes_per_token=BPT)
    hit_tokens, present = reference_lru(reqs, cap_blocks)
    assert res.hit_tokens == hit_tokens
    assert res.present_blocks == present
    assert res.token_hit_rate == pytest.approx(hit_tokens / sum(r.input_length for r in reqs))
    assert 0 < res.token_hit_rate < 1  # the trace exercises both hits and evictions
    assert res.tiers["dram"]["evictions"] > 0


@pytest.mark.parametrize("policy", ["lru", "fifo", "lfu", "s3fifo", "arc", "sim_policies:MRUPolicy"])
@pytest.mark.parametrize("seed", range(3))
def test_every_policy_matches_a_brute_force_replay(policy, seed):
    reqs = random_trace(100 + seed, n=250)
    block = BT * BPT
    for cap_blocks in (8, 30):
        res = simulate(reqs, {"tiers": [{"medium": "dram", "capacity": cap_blocks * block, "eviction": policy}]},
                       bytes_per_token=BPT)
        hit_tokens, present = reference_policy(reqs, cap_blocks * block, block, build_eviction(policy))
        assert (res.hit_tokens, res.present_blocks) == (hit_tokens, present), (policy, cap_blocks)
        assert res.tiers["dram"]["eviction"] == build_eviction(policy).name


def test_policies_differ_on_the_same_trace():
    # the comparison above would pass for a simulator that ignored the policy if all policies agreed
    reqs = random_trace(7, n=400)
    rates = {p: simulate(reqs, {"tiers": [{"medium": "dram", "capacity": 12 * BT * BPT, "eviction": p}]},
                         bytes_per_token=BPT).hit_tokens for p in ("lru", "sim_policies:MRUPolicy", "lfu")}
    assert len(set(rates.values())) > 1


def test_chain_accounts_every_hit_to_one_tier_and_demotes():
    reqs = list(generate("chat", 600, BT, seed=3))
    cfg = {"tiers": [{"medium": "hbm", "device": "cpu", "capacity": 20 * BT * BPT},
                     {"medium": "dram", "capacity": 60 * BT * BPT},
                     {"medium": "ssd", "path": "/nonexistent/never-created", "capacity": 400 * BT * BPT}]}
    res = simulate(reqs, cfg, bytes_per_token=BPT, bandwidths={"hbm": 1e10, "dram": 5e9, "ssd": 1e9},
                   prefill_tokens_per_s=5000.0)
    t = res.tiers
    assert sum(x["hits"] for x in t.values()) == res.leading_hits
    assert t["hbm"]["demotions"] > 0 and t["dram"]["demotions"] > 0
    assert t["ssd"]["promotions"] > 0  # on-hit promotion is the default
    # each tier's load time is its hit bytes over its bandwidth; the total is their sum
    assert res.load_s == pytest.approx(sum(x["bytes_read"] / bw for x, bw in
                                           zip(t.values(), (1e10, 5e9, 1e9))))
    assert res.recompute_s == pytest.approx(res.hit_tokens / 5000.0)
    # a bigger chain hits at least as often as its top tier alone
    top = simulate(reqs, {"tiers": [cfg["tiers"][0]]}, bytes_per_token=BPT)
    assert res.hit_tokens > top.hit_tokens


def test_null_media_keep_footprint_rules_and_no_bytes():
    ssd = medium_class("ssd")
    from tierkv.tiers.slab import align_up
    from tierkv.tiers.ssd.tier import footprint_of

    rule = footprint_rule(ssd, {"direct_io": False})
    assert rule(1000) == int(footprint_of(1000))  # the SSD engine's record, rounded to its alignment
    assert footprint_rule(ssd, {"direct_io": True})(1000) == rule(1000)  # the layout does not depend on it
    assert footprint_rule(medium_class("dram"), {})(1000) == align_up(1000)  # slab alignment
    store = null_store({"tiers": [{"medium": "ssd", "path": "/nonexistent/x", "capacity": "1MiB"}]})
    try:
        lvl = store.levels[0]
        assert lvl.tier.medium == "null" and lvl.tier.locality == "disk"
        assert lvl.tier.footprint(1000) == rule(1000)
    finally:
        store.close()


def test_null_store_overrides_and_bad_config():
    store = null_store({"tiers": [{"medium": "dram", "capacity": "1MiB"}]}, capacities={"dram": 4096},
                       evictions={"dram": "arc"})
    assert store.levels[0].capacity == 4096 and store.levels[0].eviction.name == "arc"
    store.close()
    with pytest.raises(ConfigError, match="no tier named"):
        null_store({"tiers": [{"medium": "dram", "capacity": "1MiB"}]}, capacities={"ssd": 1})
    with pytest.raises(ConfigError, match="capacity"):
        null_store({"tiers": [{"medium": "dram"}]})
    with pytest.raises(ConfigError, match="unknown eviction"):
        null_store({"tiers": [{"medium": "dram", "capacity": "1MiB", "eviction": "nope"}]})


def test_trace_formats_round_trip_and_detect(tmp_path):
    reqs = random_trace(1, n=20)
    p = tmp_path / "t.jsonl"
    write_trace(reqs, str(p), header={"block_tokens": BT})
    back = list(read_trace(str(p)))
    assert [r.hash_ids for r in back] == [r.hash_ids for r in reqs]
    assert [r.block_tokens for r in back] == [BT] * 20
    # Mooncake: ms timestamps, 512-token blocks
    mc = tmp_path / "mc.jsonl"
    mc.write_text('{"timestamp": 1500, "input_length": 700, "output_length": 3, "hash_ids": [1, 2]}\n')
    (r,) = read_trace(str(mc))
    assert (r.timestamp, r.block_tokens, r.hash_ids) == (1.5, 512, [1, 2])
    # Bailian: s timestamps, 16-token blocks, sessions
    bl = tmp_path / "bl.jsonl"
    bl.write_text('{"chat_id": 7, "parent_chat_id": -1, "timestamp": 2.5, "input_length": 40, '
                  '"output_length": 5, "type": "text", "turn": 1, "hash_ids": [9, 10, 11]}\n')
    (r,) = read_trace(str(bl))
    assert (r.timestamp, r.block_tokens, r.session, r.extra["turn"]) == (2.5, 16, "7", 1)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"foo": 1}\n')
    with pytest.raises(ConfigError, match="cannot tell the trace format"):
        list(read_trace(str(bad)))
    bad.write_text("not json\n")
    with pytest.raises(ConfigError, match="bad.jsonl:1: not JSON"):
        list(read_trace(str(bad)))


@pytest.mark.parametrize("kind", ["chat", "system-prompt", "rag", "agent", "mix"])
def test_generated_workloads_reuse_prefixes(kind):
    reqs = list(generate(kind, 400, 64, seed=1))
    assert len(reqs) == 400
    assert all(r.timestamp > 0 and 0 < r.input_length <= len(r.hash_ids) * 64 for r in reqs)
    assert sorted(r.timestamp for r in reqs) == [r.timestamp for r in reqs]
    blocks = sum(len(r.hash_ids) for r in reqs)
    distinct = len({h for r in reqs for h in r.hash_ids})
    assert distinct < 0.8 * blocks  # shared prefixes are the point of every kind
    # chained ids: equal ids at position i imply equal prefixes
    first_prefix: dict[int, tuple] = {}
    for r in reqs:
        for i, h in enumerate(r.hash_ids):
            assert first_prefix.setdefault(h, tuple(r.hash_ids[:i])) == tuple(r.hash_ids[:i])


def test_replay_speed_is_measured_per_request():
    # figures, not a timed assert: the rate is reported so a regression is visible in the run's output
    reqs = list(generate("mix", 2000, 512, seed=0))
    store = null_store({"tiers": [{"medium": "dram", "capacity": "16GiB"}]})
    try:
        t0 = time.perf_counter()
        res = replay(reqs, store)
        assert res.requests == 2000 and res.wall_s <= time.perf_counter() - t0
    finally:
        store.close()
    print(f"replay: {res.requests / res.wall_s:.0f} requests/s, {res.blocks / res.wall_s:.0f} blocks/s")
