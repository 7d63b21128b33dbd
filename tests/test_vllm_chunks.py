"""The connector's chunking rules (adapters/vllm/chunks.py), against brute-force models."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv.adapters.vllm.chunks import blocks_per_chunk, covered, plan_saves, resolve


def _resolver(stored: set[tuple[int, int]], chunk_blocks: int):
    """full_present / tail_present over a set of stored (first, last) objects; records the calls."""
    calls = []

    def full_present(ends):
        calls.append(("full", list(ends)))
        n = 0
        for e in ends:
            if (e - chunk_blocks + 1, e) not in stored:
                break
            n += 1
        return n

    def tail_present(ends):
        calls.append(("tail", list(ends)))
        for j in ends:
            if (chunk_blocks * (j // chunk_blocks), j) in stored:
                return j
        return None

    return full_present, tail_present, calls


def _best_cover(stored, lo, hi, known, chunk_blocks):
    """Brute force: the most blocks of lo..hi-1 a chain of stored objects covers."""
    reach = lo
    g = lo // chunk_blocks
    while g * chunk_blocks < hi:
        full = (g * chunk_blocks, g * chunk_blocks + chunk_blocks - 1)
        if full[1] < known and full in stored:
            reach = full[1] + 1
            g += 1
            continue
        start = g * chunk_blocks
        tails = [j for j in range(max(lo, start), min(known, start + chunk_blocks - 1)) if (start, j) in stored]
        if tails:
            reach = max(reach, max(tails) + 1)
        break
    return max(0, min(hi, reach) - lo)


def test_blocks_per_chunk():
    assert blocks_per_chunk(256, 16) == 16
    assert blocks_per_chunk(256, 128) == 2
    assert blocks_per_chunk(100, 128) == 1  # at least one block
    assert blocks_per_chunk(300, 128) == 2  # whole blocks
    for bad in (0, -1, 2.5, "256", True):
        with pytest.raises(ValueError, match="chunk_tokens"):
            blocks_per_chunk(bad, 16)


def test_resolve_examples():
    chunk_blocks = 4
    stored = {(0, 3), (4, 7), (8, 10)}
    fp, tp, _ = _resolver(stored, chunk_blocks)
    # a 12-block request whose blocks 0..10 are stored (two chunks and a tail)
    assert resolve(0, 11, 12, chunk_blocks, fp, tp) == [(0, 3), (4, 7), (8, 10)]
    # starting mid-chunk: the whole chunk is read
    assert resolve(5, 11, 12, chunk_blocks, fp, tp) == [(4, 7), (8, 10)]
    assert covered([(4, 7), (8, 10)], 5, 11) == 6
    # a request that has only blocks 0..9 cannot name (8, 10): no tail of its own
    assert resolve(0, 10, 10, chunk_blocks, fp, tp) == [(0, 3), (4, 7)]
    # nothing stored at the start: nothing after it is used
    fp2, tp2, _ = _resolver({(4, 7)}, chunk_blocks)
    assert resolve(0, 8, 8, chunk_blocks, fp2, tp2) == []


def test_resolve_prefers_the_shortest_tail_that_reaches():
    chunk_blocks = 8
    stored = {(0, 4), (0, 5), (0, 6), (0, 2)}
    fp, tp, calls = _resolver(stored, chunk_blocks)
    # need blocks 0..3: (0, 4) reaches and is the shortest that does
    assert resolve(0, 4, 7, chunk_blocks, fp, tp) == [(0, 4)]
    # need 0..6 but block 6 is the last with a hash: (0, 6)
    assert resolve(0, 7, 7, chunk_blocks, fp, tp) == [(0, 6)]
    # nothing reaches 7 (no hash past 6): the longest that falls short
    assert resolve(0, 7, 7, chunk_blocks, *_resolver({(0, 2), (0, 4)}, chunk_blocks)[:2]) == [(0, 4)]


@settings(max_examples=300, deadline=None)
@given(
    chunk_blocks=st.integers(1, 6),
    known=st.integers(0, 40),
    data=st.data(),
)
def test_resolve_is_maximal_and_only_names_stored_objects(chunk_blocks, known, data):
    objs = [(chunk_blocks * (j // chunk_blocks), j) for j in range(known)]
    stored = set(data.draw(st.lists(st.sampled_from(objs), unique=True), "stored") if objs else [])
    lo = data.draw(st.integers(0, known), "lo")
    hi = data.draw(st.integers(lo, known), "hi")
    fp, tp, calls = _resolver(stored, chunk_blocks)
    chunks = resolve(lo, hi, known, chunk_blocks, fp, tp)
    for first, last in chunks:
        assert (first, last) in stored
        assert first % chunk_blocks == 0 and last - first < chunk_blocks and last < known
    for (_, a), (b, _) in itertools.pairwise(chunks):
        assert b == a + 1, "chunks are consecutive"
    if chunks:
        assert chunks[0][0] == chunk_blocks * (lo // chunk_blocks)
        assert all(last - first == chunk_blocks - 1 for first, last in chunks[:-1]), "only the last may be a tail"
    assert covered(chunks, lo, hi) == _best_cover(stored, lo, hi, known, chunk_blocks)
    # never asks about an object the request cannot name
    for _, ends in calls:
        assert all(e < known for e in ends)


@settings(max_examples=300, deadline=None)
@given(chunk_blocks=st.integers(1, 6), prompt_blocks=st.integers(0, 30), data=st.data())
def test_plan_saves_covers_each_block_once_per_object_kind(chunk_blocks, prompt_blocks, data):
    """Steps computing blocks up to a growing end: every full chunk saved once, and one tail at prefill end."""
    total = prompt_blocks + data.draw(st.integers(0, 10), "decode blocks")
    start = data.draw(st.integers(0, prompt_blocks), "blocks already stored")
    next_chunk, tail_end = start // chunk_blocks, start
    ends = sorted(set([*data.draw(st.lists(st.integers(0, total), max_size=8), "step ends"), total]))
    saved = []
    prefilled = False
    for end in ends:
        if end < start:
            continue
        final = not prefilled and end >= prompt_blocks  # the step that completes the prefill
        prefilled = prefilled or final
        chunks, next_chunk, tail_end = plan_saves(next_chunk, tail_end, end, final, chunk_blocks)
        saved += chunks
    assert len(saved) == len(set(saved)), "nothing saved twice"
    full = [c for c in saved if c[1] - c[0] == chunk_blocks - 1 and c[0] % chunk_blocks == 0]
    tails = [c for c in saved if c not in full]
    n = chunk_blocks
    assert full == [(g * n, g * n + n - 1) for g in range(start // n, total // n)]
    assert len(tails) <= 1
    for first, last in tails:
        assert first % chunk_blocks == 0 and last - first < chunk_blocks - 1
    # everything from the first unsaved chunk to the prompt's last full block is in some object
    cover = set()
    for first, last in saved:
        cover.update(range(first, last + 1))
    first_end_at_prefill = min(e for e in ends if e >= max(prompt_blocks, start))
    assert set(range(chunk_blocks * (start // chunk_blocks), first_end_at_prefill)) - set(range(start)) <= cover


def _info(layers: int, chunk_blocks: int, bs: int = 16):
    from tierkv.adapters.vllm.config import EngineInfo, kv_shard

    return EngineInfo(block_size=bs, layers=tuple(f"model.layers.{i}.self_attn.attn" for i in range(layers)),
                      num_blocks=64, shard=kv_shard(0, 1, 2), namespaces={0: "test-ns"})


def _worker(store, layers: int, chunk_blocks: int):
    """A worker side over ``store`` with ``layers`` layers and chunks of ``chunk_blocks`` blocks (no engine, no socket)."""
    from tierkv.adapters.vllm.config import ConnectorOptions
    from tierkv.adapters.vllm.worker import TierKVWorker

    bs = 16
    return TierKVWorker(ConnectorOptions(chunk_tokens=chunk_blocks * bs), _info(layers, chunk_blocks, bs), store,
                        release=lambda s: None, serve=False)


class _CountingStore:
    """A TieredStore that records the presence queries a question makes (each would be a round trip to
    a shared tier) and every key they ask about."""

    def __init__(self, store):
        self._store, self.calls, self.asked = store, 0, []

    def __getattr__(self, name):
        fn = getattr(self._store, name)
        if name in ("lookup", "contains", "locate"):
            def counted(keys, *a, **k):
                self.calls += 1
                self.asked.extend(keys)
                return fn(keys, *a, **k)
            return counted
        return fn


@pytest.fixture
def hashed(monkeypatch):
    """Every (namespace root, block hash) the connector turns into a key, in order."""
    from tierkv.adapters.vllm import layer_keys

    seen: list[tuple[bytes, bytes]] = []
    real = layer_keys.keys_from_root

    def counting(root, hashes):
        seen.extend((root, bytes(h)) for h in hashes)
        return real(root, hashes)

    monkeypatch.setattr(layer_keys, "keys_from_root", counting)
    return seen


@pytest.mark.vllm
@settings(max_examples=40, deadline=None)
@given(layers=st.integers(1, 5), chunk_blocks=st.sampled_from([1, 2, 4]), nblocks=st.integers(1, 14), data=st.data())
def test_probe_needs_every_layer_and_asks_each_key_once(layers, chunk_blocks, nblocks, data):
    """Against a brute-force model: a chunk counts only when every layer holds it (the probe), or the
    last layer (the chunks a load reads); the tier of each reached block comes back with it; one pass
    hashes each key once and asks the store about each key once."""
    import torch

    from tierkv import TieredStore
    from tierkv.adapters.vllm.service import ProbeRequest, TierPlace

    store = TieredStore.from_config({"tiers": [{"medium": "dram", "capacity": "64MiB"}]})
    counting = _CountingStore(store)
    c = _worker(counting, layers, chunk_blocks)
    hashes = [bytes([i]) * 8 for i in range(nblocks)]
    # full chunks (and tails from each chunk start) that some subset of layers holds
    candidates = [(f, last) for f in range(0, nblocks, chunk_blocks) for last in range(f, min(f + chunk_blocks, nblocks))]
    stored = {}
    for chunk in candidates:
        stored[chunk] = data.draw(st.sets(st.integers(0, layers - 1)), label=f"layers of {chunk}")
    one = torch.zeros(1, dtype=torch.uint8)
    for (first, last), held in stored.items():
        for layer in held:
            store.put(c.keys.keys(layer, [hashes[last]], None), [one])
    complete = {ch for ch, held in stored.items() if len(held) == layers}
    last_layer = {ch for ch, held in stored.items() if layers - 1 in held}
    local = data.draw(st.integers(0, nblocks), label="blocks vLLM holds")

    counting.calls, counting.asked = 0, []
    got = c.probe(ProbeRequest(hashes, local, None))
    assert len(counting.asked) == len(set(counting.asked))  # each key asked about once
    fp, tp, _ = _resolver(complete, chunk_blocks)
    assert got.reach == covered(resolve(local, nblocks, nblocks, chunk_blocks, fp, tp), local, nblocks)
    assert got.held == (covered(resolve(0, local, nblocks, chunk_blocks, fp, tp), 0, local) if local else 0)
    assert got.reach == _best_cover(complete, local, nblocks, nblocks, chunk_blocks)
    assert got.where == [TierPlace("dram", "host")] * got.reach
    if complete == last_layer:  # no layer lacks what the last layer holds: two stages at most
        assert counting.calls <= 2

    # the chunks a load reads: by the last layer, each with its key there and its tier
    counting.calls, counting.asked = 0, []
    plan = c.prober.locate(hashes, 0, 0, nblocks, None)
    fp, tp, _ = _resolver(last_layer, chunk_blocks)
    assert plan.chunks == resolve(0, nblocks, nblocks, chunk_blocks, fp, tp)
    for i, (_, last) in enumerate(plan.chunks):
        assert plan.keys[layers - 1][i] == c.keys.keys(layers - 1, [hashes[last]], None)[0]
        assert plan.tiers[i] == "dram" and plan.hashes[i] == hashes[last]
    assert len(counting.asked) == len(set(counting.asked)) and counting.calls <= 2
    with pytest.raises(ValueError, match="local"):
        ProbeRequest(hashes, -1, None)
    c.shutdown()
    assert c.closed and store.closed is False  # release=no-op here: the test owns the store
    store.close()


def _stored_prompt(c, store, hashes, chunk_blocks, layers, tail=True):
    """Save a prompt as the connector does: its full chunks and (``tail``) the tail after them, every layer."""
    import torch

    one = torch.zeros(1, dtype=torch.uint8)
    n = len(hashes)
    ends = list(range(chunk_blocks - 1, n, chunk_blocks)) + ([n - 1] if tail and n % chunk_blocks else [])
    for layer in range(layers):
        store.put(c.keys.keys(layer, [hashes[e] for e in ends], None), [one] * len(ends))


@pytest.mark.vllm
@pytest.mark.parametrize("layers,chunk_blocks", [(1, 1), (4, 1), (4, 4), (32, 16)])
def test_a_probe_is_one_pass_one_presence_query_per_level(layers, chunk_blocks, hashed):
    """One probe: one batched presence query for the last layer (written last: a miss stops there) and,
    as needed, one for the other layers of what the last layer holds; every key hashed once, each asked
    about once, whatever the question (reach and held at once)."""
    from tierkv import TieredStore
    from tierkv.adapters.vllm.service import ProbeRequest

    store = TieredStore.from_config({"tiers": [{"medium": "dram", "capacity": "64MiB"}]})
    counting = _CountingStore(store)
    c = _worker(counting, layers, chunk_blocks)
    nblocks = 10 * chunk_blocks + max(1, chunk_blocks // 2)  # ten full chunks and a tail
    hashes = [bytes([i % 256, i // 256]) * 8 for i in range(nblocks)]
    try:
        # a miss: one query, of the last layer only
        hashed.clear()
        got = c.probe(ProbeRequest(hashes, 3, None))
        assert (got.reach, got.held, counting.calls) == (0, 0, 1)
        assert len(hashed) == len(set(hashed)) == len(counting.asked)
        _stored_prompt(c, store, hashes, chunk_blocks, layers)
        for local in (0, 3, 5 * chunk_blocks):
            counting.calls, counting.asked = 0, []
            hashed.clear()
            got = c.probe(ProbeRequest(hashes, local, None))
            assert got.reach == nblocks - local and got.held == local
            assert counting.calls == (1 if layers == 1 else 2)
            assert len(hashed) == len(set(hashed))  # each key hashed once ...
            assert len(counting.asked) == len(set(counting.asked)) == len(hashed)  # ... and asked about once
    finally:
        c.shutdown()
        store.close()


def _scheduler(bs: int, token_mode: bool, reach_of: int):
    """A scheduler side whose workers report blocks ``0..reach_of-1`` stored, in a "dram" tier (no engine)."""
    from tierkv.adapters.vllm.config import ConnectorOptions
    from tierkv.adapters.vllm.scheduler import TierKVScheduler
    from tierkv.adapters.vllm.service import ProbeAnswer, ProbeRequest, TierPlace

    def ask(rank, request):
        assert isinstance(request, ProbeRequest)
        asked.append(request)
        lo, hi = request.local, len(request.hashes)
        reach = max(0, min(hi, reach_of) - lo)
        return ProbeAnswer(reach, min(lo, reach_of), [TierPlace("dram", "host")] * reach)

    asked: list = []
    opts = ConnectorOptions(chunk_tokens=bs, full_hit_recompute="token" if token_mode else "block")
    c = TierKVScheduler(opts, _info(1, 1, bs), ask=ask)
    c.asked = asked  # type: ignore[attr-defined]
    return c


@pytest.mark.vllm
@settings(max_examples=200, deadline=None)
@given(bs=st.sampled_from([1, 2, 16, 32]), n=st.integers(1, 200), token_mode=st.booleans(), data=st.data())
def test_hit_arithmetic_leaves_a_token_and_loads_whole_blocks(bs, n, token_mode, data):
    """full_hit_recompute: "block" hits are whole blocks short of the prompt's end; "token" hits reach
    one token short of it when every block is stored. Either way at least one token is computed, the
    load covers the hit's blocks (the last one perhaps for all but a token) and the stats add up."""
    from types import SimpleNamespace

    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    full = n // bs
    local = data.draw(st.integers(0, (n - 1) // bs), label="blocks vLLM holds")
    stored_to = data.draw(st.integers(local, full), label="blocks stored from the start")
    c = _scheduler(bs, token_mode, stored_to)
    req = SimpleNamespace(request_id="r", num_tokens=n, block_hashes=[bytes([i % 256]) * 4 for i in range(full)],
                          cache_salt=None)
    ext, is_async = c.get_num_new_matched_tokens(req, local * bs)
    assert is_async is False
    assert ext >= 0 and local * bs + ext <= n - 1  # vLLM always computes a token
    blocks_hit = stored_to - local
    if token_mode and stored_to == full and n % bs == 0:
        assert ext == max(0, n - 1 - local * bs)
    else:
        assert ext == min(blocks_hit, (n - 1) // bs - local) * bs
    blocks = SimpleNamespace(get_block_ids=lambda: (list(range(100, 100 + full + 1)),))
    c.update_state_after_alloc(req, blocks, ext)
    assert len(c.asked) == (1 if full else 0)  # one round trip a request (none with no full block)
    st_ = c.requests["r"]
    nload = -(-ext // bs)
    if ext:
        assert st_.pending_load == (local, local + nload) and local + nload <= stored_to
    else:
        assert st_.pending_load is None
    # blocks complete once the hit is in; the partly loaded last block is not one of them
    assert st_.expect_done == (local * bs + ext) // bs
    assert c.totals.hit_tokens == ext == sum(c.totals.hit_tokens_by_tier.values())
    assert sum(st_.hit_sources.values()) == ext
    # the hit's source comes from the tier's declared locality ("host" here)
    assert set(st_.hit_sources) <= {CacheHitSource.HOST}
