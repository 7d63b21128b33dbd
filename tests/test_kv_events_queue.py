"""The connector's KV event records: a chunk is published stored once and removed only after, a full queue drops
(counted), a removed key maps back to its chunk, the scheduler turns records into vLLM events with the planned
block hashes, and the save path reports a chunk only when every layer of it is saved."""

from __future__ import annotations

from types import SimpleNamespace

import pytest


@pytest.mark.vllm
def test_full_queue_drops_and_counts():
    from adapters.vllm.kv_events import ChunkEvents

    ev = ChunkEvents(queue_max=2)
    for i in range(5):
        ev.note_keys(bytes([i]), [f"k{i}"])
        ev.stored(bytes([i]), "dram")
    assert ev.take_counts() == (3, 0)
    taken = ev.take()
    assert taken is not None and len(taken.get_all_events()) == 2
    assert ev.take() is None and ev.take_counts() == (0, 0)


@pytest.mark.vllm
def test_a_chunk_is_published_once_and_removed_once_after():
    from adapters.vllm.kv_events import ChunkEvents, ChunkRemoved, ChunkStored

    ev = ChunkEvents()
    ev.note_keys(b"a", ["a/0", "a/1"])
    ev.stored(b"a", "dram")
    ev.stored(b"a", "dram")  # (a second report of the same life publishes nothing)
    ev.on_removed(["a/0"])
    ev.on_removed(["a/1", "other"])  # the chunk's second key: already reported; another engine's key: unmapped
    assert ev.take().get_all_events() == [ChunkStored(b"a", "dram"), ChunkRemoved(b"a", "dram")]
    assert ev.take_counts() == (0, 1)
    # written again after it left: a new life, published again
    ev.note_keys(b"a", ["a/0", "a/1"])
    ev.stored(b"a", "ssd")
    assert ev.take().get_all_events() == [ChunkStored(b"a", "ssd")]


@pytest.mark.vllm
def test_a_chunk_gone_before_its_report_is_never_published():
    from adapters.vllm.kv_events import ChunkEvents

    ev = ChunkEvents()
    ev.note_keys(b"a", ["a/0"])
    ev.on_removed(["a/0"])  # evicted before the last layer's put came back
    ev.stored(b"a", "dram")
    assert ev.take() is None and ev.take_counts() == (0, 0)


@pytest.mark.vllm
def test_the_key_map_is_bounded_and_forgotten_keys_count_unmapped():
    from adapters.vllm.kv_events import ChunkEvents

    ev = ChunkEvents(keys_max=4)
    for i in range(4):
        ev.note_keys(bytes([i]), [f"{i}/0", f"{i}/1"])
        ev.stored(bytes([i]), "dram")
    assert len(ev.take().get_all_events()) == 4
    ev.on_removed(["0/0", "3/0"])  # chunk 0 was forgotten (8 keys > 4): its removal cannot be published
    recs = ev.take().get_all_events()
    assert [r.last_hash for r in recs] == [bytes([3])]
    assert ev.take_counts() == (0, 1)


@pytest.mark.vllm
def test_scheduler_events_carry_planned_hashes_and_count():
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    from adapters.vllm.kv_events import BlockEvents, ChunkRemoved, ChunkStored, TierKVEvents

    hashes = [bytes([i]) * 32 for i in range(4)]
    req = SimpleNamespace(block_hashes=hashes, all_token_ids=list(range(8)))
    be = BlockEvents(block_size=2)
    be.plan(req, [(0, 1), (2, 3)])
    # two ranks report the same chunks; a record of a chunk never planned is dropped (counted)
    be.add(TierKVEvents([ChunkStored(hashes[3], "ssd"), ChunkStored(hashes[1], "dram"), ChunkStored(hashes[3], "ssd"),
                         ChunkStored(b"unknown", "ssd")], workers=2))
    be.add(TierKVEvents([ChunkRemoved(hashes[1], "dram"), ChunkRemoved(hashes[1], "dram")]))
    out = be.take()
    assert [type(e) for e in out] == [BlockStored, BlockStored, BlockRemoved]
    second, first, removed = out
    assert second.medium == "ssd" and second.block_size == 2 and second.token_ids == [4, 5, 6, 7]
    assert second.parent_block_hash == maybe_convert_block_hash(hashes[1])
    assert second.block_hashes == [maybe_convert_block_hash(h) for h in hashes[2:]]
    assert first.parent_block_hash is None and first.token_ids == [0, 1, 2, 3]
    assert removed.medium == "dram" and removed.block_hashes == [maybe_convert_block_hash(h) for h in hashes[:2]]
    n = be.take_counts()
    assert (n.stored, n.removed, n.dropped) == (2, 1, 1)
    assert be.take() == [] and be.take_counts().stored == 0


class _Store:
    """A store stand-in for the save path: answers each put from a script, and says every key is in ``dram``."""

    def __init__(self, answers):
        self.answers = list(answers)

    def put_detailed(self, keys, values, tenant=None):
        return [self.answers.pop(0) for _ in keys]

    def locate(self, keys):
        return ["dram"] * len(keys)


def _save_layers(saver, meta, paged, layers: int = 2) -> None:
    """Save each layer of ``meta``'s plans as the engine's layers pass, wait for the writes, close the saver."""
    try:
        for layer in range(layers):
            saver.save_layer(meta, layer, paged, hold=False)
        assert saver.wait_all(30)
    finally:
        saver.close(5)


@pytest.mark.vllm
@pytest.mark.parametrize("answers, published", [
    # layer 0 then layer 1 of two chunks
    (["stored", "stored", "stored", "stored"], 2),
    (["stored", "no_room", "stored", "stored"], 1),  # chunk 1's layer 0 was refused: not stored
    (["present", "present", "present", "present"], 0),  # nothing written now: another writer published it
    (["present", "stored", "stored", "error"], 1),
])
def test_the_save_path_reports_a_chunk_when_every_layer_is_saved(answers, published):
    import torch

    from adapters.vllm.accounting import WorkerCounters
    from adapters.vllm.config import ShardInfo
    from adapters.vllm.kv_events import ChunkEvents
    from adapters.vllm.metadata import SaveSpec, TierKVConnectorMetadata
    from adapters.vllm.saving import Saver
    from tierkv.outcome import PutOutcome

    class _Keys:
        num_layers = 2

        def keys(self, layer, hashes, salt):
            return [f"{h.hex()}/{layer}" for h in hashes]

    events = ChunkEvents()
    store = _Store([PutOutcome(a) for a in answers])
    paged = SimpleNamespace(is_flat=lambda: False, read_cut=lambda cuts: [torch.zeros(1)] * len(cuts.objects),
                            block_nbytes=4)
    saver = Saver(keys=_Keys(), layers=["l0", "l1"], paged={"l0": paged, "l1": paged}, chunk_blocks=1,
                  shard=ShardInfo(0, 1, 0, 1), split_writes=False, store=lambda: store, counters=WorkerCounters(),
                  events=events)
    spec = SaveSpec("r", [(0, 0), (1, 1)], [[0], [1]], [bytes([1]) * 32, bytes([2]) * 32], [0, 1])
    _save_layers(saver, TierKVConnectorMetadata(saves=[spec]), paged)
    taken = events.take()
    assert (len(taken.get_all_events()) if taken else 0) == published


@pytest.mark.vllm
@pytest.mark.parametrize("state_answer, published", [("stored", [1, 2]), ("no_room", [1])])
def test_a_state_group_counts_only_for_the_chunks_whose_state_the_step_offers(state_answer, published):
    """Layer 0 is attention (every chunk), layer 1 a recurrent-state group that saves chunk 1's state only: chunk
    0 is complete after its attention layer, chunk 1 after its state too."""
    import torch

    from adapters.vllm.accounting import WorkerCounters
    from adapters.vllm.config import ShardInfo
    from adapters.vllm.kv_events import ChunkEvents
    from adapters.vllm.metadata import SaveSpec, TierKVConnectorMetadata
    from adapters.vllm.saving import Saver
    from tierkv.outcome import PutOutcome

    class _Keys:
        num_layers = 2

        def keys(self, layer, hashes, salt):
            return [f"{h.hex()}/{layer}" for h in hashes]

    events = ChunkEvents()
    store = _Store([PutOutcome.STORED, PutOutcome.STORED, PutOutcome(state_answer)])
    paged = SimpleNamespace(is_flat=lambda: False, read_cut=lambda cuts: [torch.zeros(1)] * len(cuts.objects),
                            read_runs=lambda ids: [torch.zeros(1)], block_nbytes=4)
    saver = Saver(keys=_Keys(), layers=["attn", "state"], paged={"attn": paged, "state": paged}, chunk_blocks=1,
                  shard=ShardInfo(0, 1, 0, 1), split_writes=False, store=lambda: store, counters=WorkerCounters(),
                  group_of=lambda layer: layer, num_groups=2, state_groups=frozenset({1}), events=events)
    spec = SaveSpec("r", [(0, 0), (1, 1)], [[0], [1]], [bytes([1]) * 32, bytes([2]) * 32], [0, 1],
                    group_block_ids=[[[0], [1]], [[5], [6]]], state_chunks=[1])
    _save_layers(saver, TierKVConnectorMetadata(saves=[spec]), paged)
    taken = events.take()
    assert [r.last_hash[0] for r in (taken.get_all_events() if taken else [])] == published


@pytest.mark.vllm
def test_a_queue_nothing_drains_counts_its_drops_in_the_stats_and_logs_them_once(caplog):
    """Behind vLLM 0.32's MultiConnector nobody collects the worker's events: what the full queue drops shows in the
    connector's stats, and the warning comes once, not with every step."""
    from adapters.vllm.accounting import WorkerCounters
    from adapters.vllm.kv_events import ChunkEvents

    ev, counters = ChunkEvents(queue_max=1), WorkerCounters()
    with caplog.at_level("WARNING", logger="vllm.tierkv.worker"):
        for step in range(3):
            ev.note_keys(bytes([step]), [f"{step}/0"])
            ev.stored(bytes([step]), "dram")
            counters.add_events(*ev.take_counts())
    assert counters.totals.data["events_dropped"] == 2
    assert counters.totals.reduce()["events_dropped"] == 2
    assert len([r for r in caplog.records if "KV event record(s) dropped" in r.getMessage()]) == 1
