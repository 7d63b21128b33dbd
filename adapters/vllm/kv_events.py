"""vLLM KV cache events for what tierkv holds: ``BlockStored`` / ``BlockRemoved`` with the tier as ``medium``.

Two halves, one per role, joined by vLLM's ``KVConnectorOutput.kv_cache_events``:

* worker: :class:`ChunkEvents` keeps, for the chunks this worker wrote, which store keys
  (one per layer) belong to which chunk, and a bounded queue of records: a
  :class:`ChunkStored` once every layer of a chunk's save answered true and at least one
  was written now, a :class:`ChunkRemoved` once one of a published chunk's keys left
  every tier (the store's removal listener).  ``get_kv_connector_kv_cache_events`` drains
  the queue into a :class:`TierKVEvents` once per step.
* scheduler: :class:`BlockEvents` remembers the block hashes, parent hash and tokens of
  each chunk it plans to save (keyed by the hash of the chunk's last block, as the save
  spec names it), turns the workers' records into vLLM events for ``take_events``, and
  counts what it published.

A chunk is published as stored at most once until it is removed, and removed only after
it was published.  Nothing grows without bound: a full queue drops the new record, a
full map forgets its oldest chunk; both are counted (``events_dropped``,
``events_unmapped``) and logged.  The ``medium`` of an event is the name of the tierkv
tier that held the chunk when it was published (``TieredStore.locate``); its removal
names the same medium, so a router retracts exactly what it was told.
"""

from __future__ import annotations

import logging
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent, KVConnectorKVEvents

logger = logging.getLogger("vllm.tierkv.kv_events")

#: records a worker keeps between two steps; beyond it new ones are dropped (counted)
QUEUE_MAX = 1 << 14
#: store keys (chunks x layers) a worker maps back to their chunk; beyond it the oldest chunks are forgotten
KEYS_MAX = 1 << 18
#: chunks planned and not yet reported stored whose tokens the scheduler keeps
PENDING_MAX = 1 << 13
#: published chunks whose block hashes the scheduler keeps for their removal
PUBLISHED_MAX = 1 << 16


@dataclass(frozen=True)
class ChunkStored:
    """The chunk whose last block hash is ``last_hash`` is stored, in tier ``medium``."""

    last_hash: bytes
    medium: str


@dataclass(frozen=True)
class ChunkRemoved:
    """The chunk ``last_hash`` (published stored in ``medium``) lost a layer from every tier."""

    last_hash: bytes
    medium: str


ChunkRecord = ChunkStored | ChunkRemoved


class TierKVEvents(KVConnectorKVEvents):
    """The records of one step, from one or more workers (vLLM merges the workers' containers)."""

    def __init__(self, records: list[ChunkRecord] | None = None, workers: int = 1) -> None:
        self._records: list[Any] = list(records or ())
        self._workers = workers

    def add_events(self, events: list[Any]) -> None:
        self._records.extend(events)

    def aggregate(self) -> TierKVEvents:
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._workers += count

    def get_all_events(self) -> list[Any]:
        return list(self._records)

    def get_number_of_workers(self) -> int:
        return self._workers

    def clear_events(self) -> None:
        self._records = []


@dataclass
class _Chunk:
    """A chunk this worker wrote: how many of its keys are mapped, and what was published of it."""

    keys: list[str] = field(default_factory=list)
    live: int = 0
    medium: str = ""
    published: bool = False
    removed: bool = False


class ChunkEvents:
    """A worker's chunk records and its map from written keys to chunks, both bounded.

    Filled by the save thread (:meth:`note_keys`, :meth:`stored`) and the store's removal
    listener (:meth:`on_removed`, which runs under the store's lock and never calls the
    store), drained on the engine's thread (:meth:`take`).
    """

    def __init__(self, queue_max: int = QUEUE_MAX, keys_max: int = KEYS_MAX) -> None:
        self._queue_max = queue_max
        self._keys_max = keys_max
        self._lock = threading.Lock()
        self._records: list[ChunkRecord] = []
        #: last block hash -> its chunk, oldest noted first; key -> last block hash
        self._chunks: OrderedDict[bytes, _Chunk] = OrderedDict()
        self._key_chunk: dict[str, bytes] = {}
        #: records dropped because the queue was full
        self.dropped = 0
        #: removed keys no chunk maps to (written by another engine, or forgotten by the bounded map)
        self.unmapped = 0
        self._counted = (0, 0)

    def note_keys(self, last_hash: bytes, keys: list[str]) -> None:
        """``keys`` (one layer each) of the chunk ``last_hash`` were written now."""
        with self._lock:
            chunk = self._chunks.get(last_hash)
            if chunk is None:
                chunk = self._chunks[last_hash] = _Chunk()
            elif chunk.removed:  # written again after it left: a new life, published anew once complete
                chunk.published = chunk.removed = False
            self._chunks.move_to_end(last_hash)
            for key in keys:
                if key not in self._key_chunk:
                    self._key_chunk[key] = last_hash
                    chunk.keys.append(key)
                    chunk.live += 1
            while len(self._key_chunk) > self._keys_max and len(self._chunks) > 1:
                self._forget_oldest()

    def stored(self, last_hash: bytes, medium: str) -> None:
        """Every layer of the chunk ``last_hash`` is stored, the fastest copy in ``medium``: publish it unless a
        key of it left meanwhile, or it is published already."""
        with self._lock:
            chunk = self._chunks.get(last_hash)
            if chunk is None or chunk.removed or chunk.published:
                return
            chunk.published, chunk.medium = True, medium
            self._add(ChunkStored(last_hash, medium))

    def on_removed(self, keys: list[str]) -> None:
        """The store's removal listener: a published chunk one of whose keys left every tier is reported once."""
        with self._lock:
            for key in keys:
                last = self._key_chunk.pop(key, None)
                if last is None:
                    self.unmapped += 1
                    continue
                chunk = self._chunks[last]
                chunk.live -= 1
                if not chunk.removed:
                    chunk.removed = True
                    if chunk.published:
                        self._add(ChunkRemoved(last, chunk.medium))
                if chunk.live <= 0:
                    del self._chunks[last]

    def _forget_oldest(self) -> None:
        last, chunk = self._chunks.popitem(last=False)
        for key in chunk.keys:
            if self._key_chunk.get(key) == last:
                del self._key_chunk[key]

    def drop(self, n: int) -> None:
        """``n`` records could not be made (counted with those a full queue dropped)."""
        with self._lock:
            self.dropped += n

    def _add(self, record: ChunkRecord) -> None:
        if len(self._records) >= self._queue_max:
            self.dropped += 1
        else:
            self._records.append(record)

    def take(self) -> TierKVEvents | None:
        """The records since the last call (None: none)."""
        with self._lock:
            records, self._records = self._records, []
        return TierKVEvents(records) if records else None

    def take_counts(self) -> tuple[int, int]:
        """Records dropped and removed keys left unmapped since the last call."""
        with self._lock:
            now = (self.dropped, self.unmapped)
            prev, self._counted = self._counted, now
        return now[0] - prev[0], now[1] - prev[1]


@dataclass
class _Planned:
    """What vLLM's event says of a chunk's blocks: their hashes, the parent hash, tokens and extra keys."""

    block_hashes: list[Any]
    parent: Any
    token_ids: array = field(default_factory=lambda: array("q"))
    extra_keys: list[Any] | None = None
    lora_id: int | None = None
    lora_name: str | None = None


@dataclass
class EventCounts:
    """What the scheduler published, and what it could not (the chunk's block hashes were forgotten)."""

    stored: int = 0
    removed: int = 0
    dropped: int = 0


class BlockEvents:
    """The scheduler's side: planned chunks' block hashes, and the vLLM events made of the workers' records."""

    def __init__(self, block_size: int, pending_max: int = PENDING_MAX, published_max: int = PUBLISHED_MAX) -> None:
        self._bs = block_size
        self._pending_max = pending_max
        self._published_max = published_max
        #: last block hash -> the chunk as planned (until it is reported stored)
        self._pending: OrderedDict[bytes, _Planned] = OrderedDict()
        #: last block hash -> (block hashes, medium) of a published chunk (until it is reported removed)
        self._published: OrderedDict[bytes, tuple[list[Any], str]] = OrderedDict()
        self._events: list[KVCacheEvent] = []
        self.counts = EventCounts()
        self._reported = EventCounts()

    def plan(self, request: Any, chunks: list[tuple[int, int]]) -> None:
        """Remember the block hashes of the request's ``chunks`` (``(first, last)`` block indices)."""
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        hashes, bs = request.block_hashes, self._bs
        lora = getattr(request, "lora_request", None)
        for first, last in chunks:
            key = bytes(hashes[last])
            self._pending[key] = _Planned(
                [maybe_convert_block_hash(h) for h in hashes[first:last + 1]],
                maybe_convert_block_hash(hashes[first - 1]) if first > 0 else None,
                array("q", request.all_token_ids[first * bs:(last + 1) * bs]),
                _extra_keys(request, first, last, bs),
                lora.adapter_id if lora else None, lora.name if lora else None)
            self._pending.move_to_end(key)
        while len(self._pending) > self._pending_max:
            self._pending.popitem(last=False)

    def add(self, events: Any) -> None:
        """The workers' records of a step (``KVConnectorOutput.kv_cache_events``)."""
        if not isinstance(events, TierKVEvents):
            return
        for rec in events.get_all_events():
            if isinstance(rec, ChunkStored):
                self._add_stored(rec)
            elif isinstance(rec, ChunkRemoved):
                self._add_removed(rec)

    def _add_stored(self, rec: ChunkStored) -> None:
        if rec.last_hash in self._published:
            return  # (each rank of a tensor-parallel engine reports the chunk it stored)
        got = self._pending.pop(rec.last_hash, None)
        if got is None:
            self.counts.dropped += 1
            return
        self._published[rec.last_hash] = (got.block_hashes, rec.medium)
        while len(self._published) > self._published_max:
            self._published.popitem(last=False)
        self._events.append(BlockStored(
            block_hashes=got.block_hashes, parent_block_hash=got.parent, token_ids=got.token_ids.tolist(),
            block_size=self._bs, lora_id=got.lora_id, medium=rec.medium, lora_name=got.lora_name,
            extra_keys=got.extra_keys))
        self.counts.stored += 1

    def _add_removed(self, rec: ChunkRemoved) -> None:
        got = self._published.pop(rec.last_hash, None)
        if got is None:
            # another rank reported it first, or it was published longer ago than the map remembers
            return
        self._events.append(BlockRemoved(block_hashes=got[0], medium=got[1]))
        self.counts.removed += 1

    def take(self) -> list[KVCacheEvent]:
        """The events made since the last call, for vLLM to publish."""
        out, self._events = self._events, []
        return out

    def take_counts(self) -> EventCounts:
        """Events published and dropped since the last call (logged when some were dropped)."""
        now, prev = self.counts, self._reported
        out = EventCounts(now.stored - prev.stored, now.removed - prev.removed, now.dropped - prev.dropped)
        self._reported = EventCounts(now.stored, now.removed, now.dropped)
        if out.dropped:
            logger.warning("TierKVConnector: %d KV event(s) not published: their chunk's block hashes were "
                           "forgotten (more than %d chunks planned since)", out.dropped, self._pending_max)
        return out


def _extra_keys(request: Any, first: int, last: int, bs: int) -> list[Any] | None:
    """vLLM's per-block extra keys of blocks ``first..last`` (LoRA, multimodal, cache salt), as its events carry
    them; None where this vLLM has no such helper or the request is not a vLLM request."""
    try:
        from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, to_event_extra_keys
    except ImportError:  # pragma: no cover - older engines
        return None
    if not hasattr(request, "mm_features"):
        return None
    keys, mm = [], 0
    for b in range(first, last + 1):
        extra, mm = generate_block_hash_extra_keys(request, b * bs, (b + 1) * bs, mm)
        keys.append(extra)
    return to_event_extra_keys(keys)
