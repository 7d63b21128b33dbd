"""``TierKVConnector``: vLLM V1 KV connector over a tierkv store.

A facade: it reads vLLM's config once (options in config.py, engine geometry and
key namespaces here) and hands each hook to the object of its role, as vLLM's own
``OffloadingConnector`` does:

* scheduler role -> :class:`~.scheduler.TierKVScheduler` (lookups, allocation,
  step plans, finished requests);
* worker role -> :class:`~.worker.TierKVWorker` (KV cache, store, loads, saves,
  the probes it answers), over a store leased from the process's registry
  (registry.py).

Metadata (scheduler -> workers) is in metadata.py, counters in connector_stats.py and accounting.py, and
what happens when the engine goes down in lifecycle.py.  A model whose KV cache
groups it cannot serve leaves the connector idle (every hook a no-op).
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from tierkv.stores import STORES

from . import lifecycle
from .config import (
    ConnectorOptions,
    EngineInfo,
    base_namespace,
    kv_shard,
    model_key,
    parse_options,
    shard_from_replicas,
    stored_kv_head_shards,
)
from .connector_stats import TierKVConnectorStats
from .groups import GroupGeometry, GroupKind, UnsupportedGroup, geometry_of_spec
from .metadata import LoadSpec, SaveSpec, TierKVConnectorMetadata
from .scheduler import TierKVScheduler
from .trace_hook import RequestTracer
from .worker import TierKVWorker

try:  # vLLM >= 0.32
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:  # pragma: no cover - older engines
    CacheHitSource = None  # type: ignore[assignment, misc]

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent, KVConnectorKVEvents
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

# under "vllm." so that the lines go through vLLM's own log handlers and format
logger = logging.getLogger("vllm.tierkv.connector")

__all__ = [
    "LoadSpec",
    "SaveSpec",
    "TierKVConnector",
    "TierKVConnectorMetadata",
    "TierKVConnectorStats",
    "engine_info",
    "live_connectors",
]

#: every live connector of this process (the test suite and tools read their records)
_LIVE: weakref.WeakSet = weakref.WeakSet()


def live_connectors() -> list[TierKVConnector]:
    """The TierKVConnector instances alive in this process."""
    return list(_LIVE)


def _layout_descriptor(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, slices: int = 1) -> str:
    """What decides the bytes of a page: platform, layout, backend, ISA and KV spec.

    Computed identically on scheduler and workers (it uses no tensors), so both
    sides derive the same keys.  ``slices``: stored KV-head shards per rank; the
    heads and page bytes named are one stored shard's, so engines of different
    tensor-parallel sizes that store the same shards name the same layout.
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

            isa = _get_attn_isa(vllm_config.model_config.dtype,  # type: ignore[arg-type]  # a torch.dtype by now
                                spec.block_size, getattr(spec, "head_size", None),
                                vllm_config.cache_config.cache_dtype)
        except Exception:  # noqa: BLE001 - unknown ISA: still a valid, private namespace
            import platform

            isa = "isa-" + platform.machine()
    return ":".join([
        device, str(layout), str(backend), isa or "-",
        f"h{getattr(spec, 'num_kv_heads', 0) // slices}x{getattr(spec, 'head_size', 0)}",
        str(getattr(spec, "dtype", "")).replace("torch.", ""),
        f"kv-{vllm_config.cache_config.cache_dtype}",
        f"page{spec.page_size_bytes // slices}",
        type(spec).__name__,
    ])


def _block_bytes(group: Any, layers: int) -> int | None:
    """One block's KV bytes over every layer of a KV cache group (one worker's share), or None if unknown."""
    try:
        return int(group.kv_cache_spec.page_size_bytes) * layers or None
    except (AttributeError, TypeError, ValueError):
        return None


def served_groups(kv_cache_config: KVCacheConfig | None, block_size: int) -> tuple[GroupGeometry, ...]:
    """The geometry of each KV cache group, or :class:`UnsupportedGroup` naming why the connector cannot serve them.

    Served: one group of any attention kind, or several groups of full attention, MLA, sliding windows and
    recurrent state (``align`` mode) at the engine's block size.  Not yet: groups of different block sizes.
    """
    groups = kv_cache_config.kv_cache_groups if kv_cache_config is not None else []
    if not groups:
        raise UnsupportedGroup("no KV cache group (an attention-free model)")
    if len(groups) == 1:
        # one group: served as always; a sliding window's geometry is kept (the scheduler saves only the blocks
        # the group still holds)
        try:
            geom = geometry_of_spec(groups[0].kv_cache_spec)
        except UnsupportedGroup:
            return ()
        if geom.kind is GroupKind.STATE:
            raise UnsupportedGroup("a model of recurrent-state layers alone (no attention group) is not served")
        return (geom,) if geom.kind is GroupKind.SLIDING_WINDOW else ()
    geoms = tuple(geometry_of_spec(g.kv_cache_spec) for g in groups)
    for geom in geoms:
        if geom.block_size != block_size:
            raise UnsupportedGroup(f"KV cache groups of block sizes {sorted({g.block_size for g in geoms})} "
                                   "are not served yet")
    if all(g.kind is GroupKind.STATE for g in geoms):
        raise UnsupportedGroup("a model of recurrent-state layers alone (no attention group) is not served")
    return geoms


def engine_info(vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig,
                options: ConnectorOptions, groups: tuple[GroupGeometry, ...] = ()) -> EngineInfo:
    """The engine geometry, ranks and key namespaces of this connector (``groups``: several KV cache groups)."""
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    block_size = int(vllm_config.cache_config.block_size)
    tp_size = int(getattr(pc, "tensor_parallel_size", 1) or 1)
    tp_rank = 0
    if role == KVConnectorRole.WORKER:
        try:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            tp_rank = int(get_tensor_model_parallel_rank())
        except Exception:  # noqa: BLE001 - not initialised: single rank
            tp_rank = 0
    replicas = int(getattr(kv_cache_config, "kv_tp_replicas", 1) or 1)
    try:
        total_heads = int(mc.get_total_num_kv_heads())
    except Exception:  # noqa: BLE001
        total_heads = 0
    mla = bool(getattr(mc, "use_mla", False))
    shard = shard_from_replicas(tp_rank, tp_size, replicas) if replicas > 1 \
        else kv_shard(tp_rank, tp_size, total_heads, mla)
    stored = stored_kv_head_shards(options.kv_head_shards, shard, total_heads, tp_size, mla=mla,
                                   state_layers=any(g.kind is GroupKind.STATE for g in groups))
    if mla and options.kv_head_shards not in (None, 1):
        logger.info("TierKVConnector: MLA keeps one copy of its latent KV for every rank: kv_head_shards %d "
                    "does not apply", options.kv_head_shards)
    slices = stored // shard.num_shards
    # the weights actually loaded (a fingerprint of the files or the resolved hub commit), unless model_id
    # asserts them: scheduler and workers read the same files, so they derive the same root
    model_id, weights = model_key(str(mc.model), getattr(mc, "revision", None),
                                  getattr(getattr(vllm_config, "load_config", None), "download_dir", None),
                                  model_id=options.model_id, namespace=options.namespace)
    layout = _layout_descriptor(vllm_config, kv_cache_config, slices)
    hash_algo = str(getattr(vllm_config.cache_config, "prefix_caching_hash_algo", ""))
    dtype = str(mc.dtype).replace("torch.", "")
    chunk_blocks = max(1, options.chunk_tokens // block_size)
    namespaces = {j: base_namespace(model_id, dtype, layout, block_size, j, stored, hash_algo, chunk_blocks)
                  for j in range(stored)}
    kv_groups = kv_cache_config.kv_cache_groups if groups else kv_cache_config.kv_cache_groups[:1]
    rank_heads = tuple(int(getattr(g.kv_cache_spec, "num_kv_heads", 0) or 0) for g in kv_groups)
    if slices > 1:  # a group's key segment names one stored shard's heads (see _layout_descriptor)
        groups = tuple(dataclasses.replace(g, shape=(g.shape[0] // slices, *g.shape[1:]))
                       if g.kind is not GroupKind.STATE and g.shape else g for g in groups)
    layers = tuple(name for g in kv_groups for name in g.layer_names)
    layer_groups = tuple(i for i, g in enumerate(kv_groups) for _ in g.layer_names) if groups else ()
    return EngineInfo(block_size=block_size, layers=layers, num_blocks=int(kv_cache_config.num_blocks),
                      shard=shard, namespaces=namespaces, tp_rank=tp_rank, tp_size=tp_size,
                      engine_id=str(vllm_config.kv_transfer_config.engine_id),  # type: ignore[union-attr]  # (set for a connector)
                      dp_rank=int(getattr(pc, "data_parallel_rank", 0) or 0),
                      layer_groups=layer_groups, groups=groups, kv_head_shards=stored,
                      rank_kv_heads=rank_heads, weights=weights,
                      kv_events=bool(getattr(vllm_config.kv_events_config, "enable_kv_cache_events", False)))


class TierKVConnector(KVConnectorBase_V1, SupportsHMA):
    """Tiered KV cache (HBM / DRAM / SSD / pooled and remote tiers) for vLLM V1.

    Options (``kv_connector_extra_config``) are described in ``docs/vllm.md`` and
    checked by :func:`~.config.parse_options`.
    """

    _cache_hit_source = CacheHitSource.HOST if CacheHitSource is not None else None  # type: ignore[assignment]  # (older engines)

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        kvt = self._kv_transfer_config
        options = parse_options(kvt.kv_connector_extra_config)
        if kvt.kv_role == "kv_consumer":
            options = dataclasses.replace(options, save=False)
        if options.load_failure_policy == "recompute":
            # a failed block is recomputed, so a store problem never fails a request
            kvt.kv_load_failure_policy = "recompute"
        self.options = options
        self.scheduler: TierKVScheduler | None = None
        self.worker: TierKVWorker | None = None
        self._tracer: RequestTracer | None = None
        #: why the connector does nothing (a model whose KV cache groups it cannot serve); None when it serves
        self.idle_reason: str | None = None
        groups = kv_cache_config.kv_cache_groups if kv_cache_config is not None else []
        try:
            geoms = served_groups(kv_cache_config, int(vllm_config.cache_config.block_size))
        except UnsupportedGroup as e:
            logger.warning("TierKVConnector: %s; the connector is idle (no loads, no saves)", e)
            self.idle_reason = str(e)
            _LIVE.add(self)
            return
        per_block = [k.value for k in (GroupKind.STATE, GroupKind.SLIDING_WINDOW) if any(g.kind is k for g in geoms)]
        if per_block and options.chunk_tokens != geoms[0].block_size:
            # one object per block: a recurrent state exists at block boundaries only (every boundary whose state
            # was saved names an object of its own), and a sliding-window group holds only its window's blocks
            # (vLLM's null block takes the others' place as the window moves, and in a prompt continued from
            # vLLM's own prefix cache), so a chunk of several blocks would not be whole in its layers
            logger.info("TierKVConnector: %s groups: chunk_tokens %d -> %d (one block per object)",
                        " and ".join(per_block), options.chunk_tokens, geoms[0].block_size)
            self.options = options = dataclasses.replace(options, chunk_tokens=geoms[0].block_size)
        info = engine_info(vllm_config, role, kv_cache_config, options, geoms)
        #: what the key root's model part rests on: the weights' digest, "unverified (model name only)" or model_id
        self.weights_identity: str = info.weights
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = TierKVScheduler(options, info)
            # hash-only request traces (option trace_path), for `tierkv simulate`
            self._tracer = RequestTracer.from_extra_config(options.trace, info.block_size,
                                                           _block_bytes(groups[0], len(info.layers))) \
                if options.trace else None
            # vLLM aborts at once (shutdown_timeout 0) and kills the workers right after:
            # ask them to drain now; when vLLM drains instead, the workers finish first
            if getattr(vllm_config, "shutdown_timeout", 0) == 0:
                lifecycle.on_engine_signal(self.scheduler.ask_workers_to_shut_down)
        else:
            # the process's store for this config, leased: the worker's shutdown gives it back
            lease = STORES.acquire(options.store_config)
            try:
                self.worker = TierKVWorker(options, info, lease.store, release=lambda _store: lease.release())
            except BaseException:
                lease.release()
                raise
            self._watch(self.worker)
            lifecycle.on_engine_signal(self.worker.shutdown)
            self._finalizer = lifecycle.on_exit(self, self.worker.shutdown)
        _LIVE.add(self)
        logger.info("TierKVConnector (%s) ready: store=%s shard=%s stored as %d KV-head shard(s)%s weights=%s "
                    "namespace=%s", role.name.lower(),
                    "file " + options.store_config if isinstance(options.store_config, str) else "inline",
                    info.shard, info.stored_shards, "" if options.kv_head_shards else " (kv_head_shards unset)",
                    info.weights, info.namespaces.get(info.slice_shard(0)))

    @staticmethod
    def _watch(worker: TierKVWorker) -> None:
        watcher = lifecycle.Watcher.get()
        if watcher is not None:
            worker.report = watcher.watch(f"tp{worker.tp_rank}-{id(worker):x}", worker.socket_paths)
            worker.report("totals", worker.totals.reduce())

    # ---- scheduler side -----------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.scheduler is None:
            return 0, False
        got = self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)
        if self._tracer is not None:
            rid, missed = self.scheduler.last_missed
            self._tracer.on_lookup(request, missed if rid == request.request_id else None)
        return got

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int):
        if self.scheduler is not None:
            self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int):
        got = self.scheduler.get_external_cache_hit_sources(request, num_external_tokens) \
            if self.scheduler is not None else None
        if got is None:
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        return got

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        if self.scheduler is None:
            return TierKVConnectorMetadata(preempted=set(scheduler_output.preempted_req_ids or ()))
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self.scheduler is not None:
            self.scheduler.update_connector_output(connector_output)

    def take_events(self) -> Iterable[KVCacheEvent]:
        """``BlockStored`` / ``BlockRemoved`` for what the workers reported stored or removed (kv_events.py)."""
        return self.scheduler.take_events() if self.scheduler is not None else ()

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self.scheduler is None:
            return False, None
        return self.scheduler.request_finished(request)

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """``request_finished`` with the hybrid manager on (one block list per KV cache group)."""
        if self.scheduler is None:
            return False, None
        return self.scheduler.request_finished(request)

    # ---- worker side --------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        if self.worker is not None:
            self.worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.worker is not None:
            self.worker.bind_metadata(connector_metadata)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        if self.worker is not None:
            self.worker.clear_metadata()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self.worker is not None:
            self.worker.start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.worker is not None:
            self.worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any):
        if self.worker is not None:
            self.worker.save_kv_layer(layer_name)

    def wait_for_save(self):
        if self.worker is not None:
            self.worker.wait_for_save()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata):
        if self.worker is not None and isinstance(kv_connector_metadata, TierKVConnectorMetadata):
            self.worker.handle_preemptions(kv_connector_metadata.preempted)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.worker is None:
            return None, None
        return self.worker.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving = self.get_finished(finished_req_ids)
        failed = self.worker.take_failed_recving() if self.worker is not None else set()
        return KVConnectorTransferResults(finished_sending=set(sending or ()),
                                          finished_recving=set(recving or ()) | failed, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors() if self.worker is not None else set()

    def get_kv_connector_kv_cache_events(self) -> KVConnectorKVEvents | None:
        return self.worker.take_kv_events() if self.worker is not None else None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self.worker is not None:
            return self.worker.get_stats()
        return self.scheduler.take_event_stats() if self.scheduler is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return TierKVConnectorStats.from_payload(data)

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        """tierkv's per-tier counters and gauges on vLLM's own ``/metrics`` (see ``prom.py``)."""
        from .prom import build_prom_metrics

        return build_prom_metrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ---- lifecycle ----------------------------------------------------------------
    def wait_for_all_saves(self, timeout: float | None = None) -> bool:
        """Block until every queued save is in the store; False on timeout."""
        return self.worker.wait_for_all_saves(timeout) if self.worker is not None else True

    def shutdown(self):
        if self.worker is not None:
            self.worker.shutdown()
        if self.scheduler is not None:
            self.scheduler.shutdown()
        if self._tracer is not None:
            self._tracer.close()
            self._tracer = None
