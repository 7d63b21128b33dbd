"""Engine-independent pieces of the vLLM connector: options, store config, namespaces, shards.

Nothing here imports vLLM, so these rules can be checked on their own.
:func:`parse_options` is the one place that reads ``kv_connector_extra_config``:
every option is checked by type (``tierkv.options``; the string ``"false"`` is
never true) and an option it does not know is an error that names it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tierkv.errors import ConfigError
from tierkv.options import (
    check_float,
    pop_bool,
    pop_choice,
    pop_float,
    pop_int,
    pop_size,
    pop_store_config,
    pop_str,
    short,
)
from tierkv.weights import resolve_weights

from .groups import GroupGeometry, GroupKind

#: Used when the connector config names no store: a small host tier over DRAM.
DEFAULT_STORE_CONFIG: dict[str, Any] = {
    "tiers": [
        {"medium": "hbm", "device": "cpu", "capacity": "256MiB"},
        {"medium": "dram", "capacity": "2GiB", "eviction": "lru"},
    ],
}


def store_config_from_extra(extra: dict[str, Any] | None) -> dict[str, Any] | str:
    """The store config named by ``kv_connector_extra_config``.

    ``{"tierkv": {...}}`` gives it inline, ``{"tierkv_config_file": path}`` names
    a JSON/YAML/TOML file; with neither, :data:`DEFAULT_STORE_CONFIG`.
    """
    return pop_store_config(dict(extra or {}), "kv_connector_extra_config", DEFAULT_STORE_CONFIG)


# -- connector options ------------------------------------------------------------
_WHAT = "kv_connector_extra_config"

#: ``audit_rate``'s default: one hit in a hundred is recomputed and compared (docs/vllm-audits.md)
DEFAULT_AUDIT_RATE = 0.01

#: every option ``kv_connector_extra_config`` may hold (see :class:`ConnectorOptions`)
OPTION_NAMES = (
    "tierkv", "tierkv_config_file", "model_id", "namespace", "load", "save", "chunk_tokens", "layerwise",
    "full_hit_recompute", "load_failure_policy", "load_async", "load_inline_max_tokens", "save_wait",
    "shutdown_timeout_s", "audit_rate", "audit_tolerance", "lease_timeout_s",
    "trace_path", "trace_max_bytes", "trace_max_files", "trace_salt", "kv_head_shards",
    "decline_slow_hits", "decline_bias", "decline_probe_share", "decline_margin_ms",
)


@dataclass(frozen=True)
class ConnectorOptions:
    """The connector's options, checked (see ``docs/vllm.md``).

    ``layerwise`` is None for ``"auto"``: settled once the KV cache's device is known.
    """

    store_config: dict[str, Any] | str = field(default_factory=lambda: DEFAULT_STORE_CONFIG)
    model_id: str | None = None
    load: bool = True
    save: bool = True
    chunk_tokens: int = 256
    layerwise: bool | None = None
    full_hit_recompute: str = "block"
    load_failure_policy: str = "recompute"
    #: where a hit is loaded: "auto" (the first hit a step admits from memory tiers loads in the step, every
    #: other between steps), True (every hit between steps: the request waits, the batch does not) or False
    #: (every hit in the step); see docs/vllm.md
    load_async: bool | str = "auto"
    #: wait_for_save returns once the step's saves are in the store (vLLM's contract)
    save_wait: bool = True
    #: how long a shutdown waits for saves still queued before abandoning them
    shutdown_timeout_s: float = 30.0
    #: request-trace capture (``trace_path`` and its rotation options), checked; empty: no capture
    trace: dict[str, Any] = field(default_factory=dict)
    #: with load_async "auto": the longest hit (tokens) loaded in the step; a longer one goes between steps
    load_inline_max_tokens: int = 8192
    #: share of the requests that would hit whose hit is recomputed and compared with the stored chunks
    audit_rate: float = DEFAULT_AUDIT_RATE
    #: 0: an audit compares bitwise; above 0, a value passes within t * (1 + |stored|); None ("auto"): scaled
    #: to the KV dtype (``adapters.vllm.audit.DTYPE_TOLERANCE``)
    audit_tolerance: float | None = None
    #: how long what a lookup found is held for its load at most (seconds); 0: nothing is held
    lease_timeout_s: float = 30.0
    #: this engine's namespace: part of every key (engines of different namespaces never share a chunk) and the
    #: tenant of the puts of requests without a ``cache_salt`` (``tierkv.tenants``); None: none
    namespace: str | None = None
    #: the KV-head shards every layer's chunk is stored under, fleet-wide, whatever the engine's tensor-parallel
    #: size (a multiple of every TP size sharing the store); None: as many as the engine's own KV-head shards
    kv_head_shards: int | None = None
    #: a hit (or its part on a tier) that would load slower than the engine computes it is not claimed
    #: (decline.py); ``decline_bias`` multiplies the compute estimate (above 1 keeps more hits), and a share
    #: ``decline_probe_share`` of the hits a slow tier would lose is claimed anyway, to see it recover; a part
    #: that loses less than ``decline_margin_ms`` against computing it is claimed (timing noise)
    decline_slow_hits: bool = True
    decline_bias: float = 1.0
    decline_probe_share: float = 1.0 / 16
    decline_margin_ms: float = 50.0


def parse_options(extra: dict[str, Any] | None) -> ConnectorOptions:
    """Check ``kv_connector_extra_config``; a ``ConfigError`` names the first bad or unknown option."""
    if extra is not None and not isinstance(extra, dict):
        raise ConfigError(f"{_WHAT} must be a mapping, got {type(extra).__name__}")
    opts = dict(extra or {})
    store = store_config_from_extra({k: opts.pop(k) for k in ("tierkv", "tierkv_config_file") if k in opts})
    model_id = pop_str(opts, "model_id", None, _WHAT)
    namespace = pop_str(opts, "namespace", None, _WHAT)
    if namespace is not None and not namespace.strip():
        raise ConfigError(f"{_WHAT} option 'namespace': expected a non-empty name, got {namespace!r}")
    load = pop_bool(opts, "load", True, _WHAT)
    save = pop_bool(opts, "save", True, _WHAT)
    chunk_tokens = pop_int(opts, "chunk_tokens", 256, _WHAT, min_value=1)
    lw = opts.pop("layerwise", "auto")
    if lw == "auto":
        layerwise = None
    elif isinstance(lw, bool):
        layerwise = lw
    else:
        raise ConfigError(f"{_WHAT} option 'layerwise': expected true, false or \"auto\", got {short(lw)}")
    full_hit = pop_choice(opts, "full_hit_recompute", "block", _WHAT, ("block", "token"))
    policy = pop_choice(opts, "load_failure_policy", "recompute", _WHAT, ("recompute", "keep"))
    la = opts.pop("load_async", "auto")
    if la == "auto" or isinstance(la, bool):
        load_async = la
    else:
        raise ConfigError(f"{_WHAT} option 'load_async': expected true, false or \"auto\", got {short(la)}")
    inline_max = pop_int(opts, "load_inline_max_tokens", 8192, _WHAT, min_value=0)
    if "load_inline_max_tokens" in (extra or {}) and load_async != "auto":
        raise ConfigError(f"{_WHAT} option 'load_inline_max_tokens' needs \"load_async\": \"auto\" (the "
                          f"default), not {short(la)}")
    save_wait = pop_bool(opts, "save_wait", True, _WHAT)
    shutdown_timeout = pop_float(opts, "shutdown_timeout_s", 30.0, _WHAT, min_value=0.0)
    audit_rate = pop_float(opts, "audit_rate", DEFAULT_AUDIT_RATE, _WHAT, min_value=0.0, max_value=1.0)
    at = opts.pop("audit_tolerance", "auto")
    audit_tolerance = None if at == "auto" else check_float(at, f"{_WHAT} option 'audit_tolerance'", min_value=0.0)
    lease_timeout = pop_float(opts, "lease_timeout_s", 30.0, _WHAT, min_value=0.0, max_value=3600.0)
    kv_head_shards = pop_int(opts, "kv_head_shards", None, _WHAT, min_value=1)
    decline = pop_bool(opts, "decline_slow_hits", True, _WHAT)
    decline_bias = pop_float(opts, "decline_bias", 1.0, _WHAT, min_value=0.0, min_exclusive=True)
    probe_share = pop_float(opts, "decline_probe_share", 1.0 / 16, _WHAT, min_value=0.0, max_value=1.0)
    margin_ms = pop_float(opts, "decline_margin_ms", 50.0, _WHAT, min_value=0.0, max_value=3_600_000.0)
    trace: dict[str, Any] = {}
    path = pop_str(opts, "trace_path", None, _WHAT)
    if path is not None:
        trace["trace_path"] = path
    for key, value in (("trace_max_bytes", pop_size(opts, "trace_max_bytes", None, _WHAT)),
                       ("trace_max_files", pop_int(opts, "trace_max_files", None, _WHAT, min_value=1)),
                       ("trace_salt", pop_str(opts, "trace_salt", None, _WHAT))):
        if value is not None:
            if path is None:
                raise ConfigError(f"{_WHAT} option {key!r} needs 'trace_path'")
            trace[key] = value
    if opts:
        raise ConfigError(f"{_WHAT}: unknown option(s) {sorted(opts)}; known: {sorted(OPTION_NAMES)}")
    return ConnectorOptions(store, model_id, load, save, chunk_tokens, layerwise, full_hit, policy, load_async,
                            save_wait, shutdown_timeout, trace, inline_max,
                            audit_rate=audit_rate, audit_tolerance=audit_tolerance, lease_timeout_s=lease_timeout,
                            namespace=namespace, kv_head_shards=kv_head_shards, decline_slow_hits=decline,
                            decline_bias=decline_bias, decline_probe_share=probe_share,
                            decline_margin_ms=margin_ms)


@dataclass(frozen=True)
class EngineInfo:
    """What the connector takes from the engine: block geometry, layers, ranks, key namespaces.

    Built from vLLM's config by the connector facade; tests build it directly.
    ``namespaces[j]`` is the base namespace of stored KV-head shard ``j`` (see :func:`base_namespace` and
    :attr:`stored_shards`); without ``kv_head_shards`` the stored shards are the engine's own.
    """

    block_size: int
    layers: tuple[str, ...]
    num_blocks: int
    shard: ShardInfo
    namespaces: dict[int, str]
    tp_rank: int = 0
    tp_size: int = 1
    engine_id: str = "engine"
    dp_rank: int = 0
    #: the KV cache group of each layer (hybrid models: vLLM's hybrid KV cache manager); empty: all in one
    layer_groups: tuple[int, ...] = ()
    #: each group's geometry (groups.py); empty: one full-attention group
    groups: tuple[GroupGeometry, ...] = ()
    #: vLLM publishes KV cache events (``--kv-events-config``): the connector reports what it stores
    kv_events: bool = False
    #: the KV-head shards each layer's chunks are stored under (option ``kv_head_shards``, checked by
    #: :func:`stored_kv_head_shards`): a multiple of ``shard.num_shards``, so this rank holds
    #: :attr:`slices_per_layer` of them; 0: as many as the engine's own KV-head shards
    kv_head_shards: int = 0
    #: the KV heads this rank holds in a layer of each KV cache group (what a layer is split along when it
    #: holds several stored shards); empty: unknown
    rank_kv_heads: tuple[int, ...] = ()
    #: what the model part of the key root rests on (:func:`model_key`): the weights' digest and how it was
    #: taken, ``unverified (model name only)``, or the ``model_id`` asserted
    weights: str = ""

    @property
    def layer_index(self) -> dict[str, int]:
        return {name: i for i, name in enumerate(self.layers)}

    @property
    def num_groups(self) -> int:
        return max(1, len(self.groups))

    @property
    def state_groups(self) -> frozenset[int]:
        """The recurrent-state groups (one state block per boundary, see groups.py)."""
        return frozenset(g for g, geom in enumerate(self.groups) if geom.kind is GroupKind.STATE)

    @property
    def state_layers(self) -> tuple[int, ...]:
        """The layers of recurrent-state groups (indices into :attr:`layers`)."""
        sg = self.state_groups
        return tuple(i for i in range(len(self.layers)) if self.group_of(i) in sg) if sg else ()

    def group_of(self, layer: int) -> int:
        """The KV cache group of layer ``layer`` (an index into :attr:`layers`)."""
        return self.layer_groups[layer] if self.layer_groups else 0

    @property
    def stored_shards(self) -> int:
        """The KV-head shards each layer's chunks are stored under (``namespaces`` has one per shard)."""
        return self.kv_head_shards or self.shard.num_shards

    @property
    def slices_per_layer(self) -> int:
        """The stored KV-head shards this rank holds: objects per chunk and layer."""
        return max(1, self.stored_shards // self.shard.num_shards)

    @property
    def slice_names(self) -> tuple[str, ...]:
        """What this rank stores per chunk, layer by layer: a *slice* per layer and stored KV-head shard it holds
        (slice ``s`` is layer ``s // slices_per_layer``); with one shard per layer, the layers themselves."""
        n = self.slices_per_layer
        if n == 1:
            return self.layers
        return tuple(f"{name}#kvshard{self.slice_shard(i * n + k)}" for i, name in enumerate(self.layers)
                     for k in range(n))

    def slice_layer(self, s: int) -> int:
        """The layer of slice ``s`` (an index into :attr:`layers`)."""
        return s // self.slices_per_layer

    def slice_shard(self, s: int) -> int:
        """The stored KV-head shard of slice ``s`` (a key of :attr:`namespaces`)."""
        n = self.slices_per_layer
        return self.shard.shard * n + s % n

    def rank_heads_of(self, layer: int) -> int:
        """The KV heads this rank holds in layer ``layer`` (0: unknown)."""
        heads = self.rank_kv_heads
        if not heads:
            return 0
        return heads[self.group_of(layer)] if len(heads) > 1 else heads[0]

    def key_name(self, layer: int) -> str:
        """The name layer ``layer``'s keys are made under: with several groups, its group's kind and shape too,
        so a layer served under another kind (one group when the hybrid manager is off) never shares keys."""
        name = self.layers[layer]
        if len(self.groups) > 1:
            name += "@" + self.groups[self.group_of(layer)].namespace()
        return name


# -- KV-head shards -------------------------------------------------------------------
@dataclass(frozen=True)
class ShardInfo:
    """Which KV bytes a tensor-parallel rank holds.

    Ranks with the same ``shard`` hold identical KV and share keys; among them
    ``replica`` (0..``replicas``-1) splits the writes.
    """

    shard: int
    num_shards: int
    replica: int
    replicas: int


def kv_shard(tp_rank: int, tp_size: int, total_kv_heads: int, use_mla: bool = False) -> ShardInfo:
    """The KV-head shard of ``tp_rank``.

    * MLA: one latent KV shared by every rank: one shard, ``tp_size`` replicas.
    * ``tp_size <= total_kv_heads``: each rank holds its own heads: ``tp_size`` shards.
    * ``tp_size > total_kv_heads``: heads are replicated over ``tp_size // heads``
      consecutive ranks: ``total_kv_heads`` shards.
    """
    if tp_size <= 0 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"bad tensor-parallel rank {tp_rank} of {tp_size}")
    if use_mla or total_kv_heads <= 0:
        return ShardInfo(0, 1, tp_rank, tp_size)
    if tp_size <= total_kv_heads:
        return ShardInfo(tp_rank, tp_size, 0, 1)
    if tp_size % total_kv_heads:
        raise ValueError(f"tensor-parallel size {tp_size} is not a multiple of {total_kv_heads} KV heads")
    replicas = tp_size // total_kv_heads
    return ShardInfo(tp_rank // replicas, total_kv_heads, tp_rank % replicas, replicas)


def stored_kv_head_shards(option: int | None, shard: ShardInfo, total_kv_heads: int, tp_size: int = 1, *,
                          mla: bool = False, state_layers: bool = False) -> int:
    """The KV-head shards each layer's chunks are stored under: option ``kv_head_shards``, checked for this engine.

    Unset, or for MLA (one latent shared by every rank: one copy), the engine's own KV-head shards: its keys
    and objects are those of an engine without the option.  Otherwise it must be a multiple of the engine's
    shards (its tensor-parallel size, or its KV heads when ranks replicate them) and divide the model's KV
    heads; every engine that shares a store must be given the same value.  Raises ``ConfigError`` naming
    the option and the numbers.
    """
    own = shard.num_shards
    if option is None or mla or option == own:
        return own
    what = f"{_WHAT} option 'kv_head_shards'"
    if option % own:
        raise ConfigError(f"{what}: {option} is not a multiple of this engine's {own} KV-head shards "
                          f"(tensor-parallel size {tp_size}); give a multiple of every tensor-parallel size "
                          "that shares the store")
    if total_kv_heads <= 0:
        raise ConfigError(f"{what}: {option} needs the model's number of KV heads, which the engine does not give")
    if total_kv_heads % option:
        raise ConfigError(f"{what}: {option} does not divide the model's {total_kv_heads} KV heads")
    if state_layers:
        raise ConfigError(f"{what}: {option} shards per layer with recurrent-state layers (not split by KV "
                          f"head): this model at tensor-parallel size {tp_size} takes {own} only")
    return option


def shard_from_replicas(tp_rank: int, tp_size: int, replicas: int) -> ShardInfo:
    """Shard of ``tp_rank`` when ``replicas`` consecutive ranks hold identical KV."""
    replicas = max(1, int(replicas))
    if tp_size % replicas:
        raise ValueError(f"tensor-parallel size {tp_size} is not a multiple of {replicas} replicas")
    return ShardInfo(tp_rank // replicas, tp_size // replicas, tp_rank % replicas, replicas)


# -- namespaces -----------------------------------------------------------------------
def _clean(part: object) -> str:
    s = str(part)
    return s.replace("/", "_").replace("\x00", "_")


def base_namespace(
    model: str,
    dtype: str,
    layout: str,
    block_size: int,
    shard: int,
    num_shards: int,
    hash_algo: str = "",
    chunk_blocks: int = 1,
) -> str:
    """The namespace shared by every layer of one engine configuration and KV shard.

    ``chunk_blocks`` (blocks per stored object) is part of it: an object's first
    block depends on it, so objects of different chunkings never share a key.
    """
    return "/".join(
        [
            "vllm",
            _clean(model),
            _clean(dtype),
            _clean(layout),
            f"bs{int(block_size)}x{int(chunk_blocks)}",
            f"kvshard{int(shard)}-of-{int(num_shards)}",
            _clean(hash_algo or "-"),
        ]
    )


def model_key(model: str, revision: str | None = None, download_dir: str | None = None, *,
              model_id: str | None = None, namespace: str | None = None) -> tuple[str, str]:
    """The model part of the key root, and what it rests on (for logs and records).

    With ``model_id``, that name as given: the operator asserts that every engine given it serves the same
    weights, and nothing is read.  Otherwise the weights actually loaded (``tierkv.weights``): a digest of
    the local weight files or of the resolved hub commit, so KV of other weights under the same name or
    path is never found; when they cannot be verified, the name and revision (a warning is logged and
    the description says ``unverified``).  A configured ``namespace`` is appended.
    """
    if model_id:
        key, how = model_id, f"model_id {model_id!r} (asserted, not fingerprinted)"
    else:
        ident = resolve_weights(model, revision=revision, download_dir=download_dir)
        how = ident.describe()
        key = f"weights:{ident.digest}" if ident.verified else model + (f"@{revision}" if revision else "")
    if namespace is not None:  # a configured namespace: its keys are its own
        key += "#ns:" + namespace
    return key, how


#: how a LoRA adapter's identity starts the salt a request's keys are made under (see :class:`RequestSalts`)
LORA_SALT = "\x00lora:"
#: adapters whose identity a scheduler keeps; beyond it they are fingerprinted again
LORA_IDENTITIES_MAX = 1024


class RequestSalts:
    """The salt each request's keys are made under: its ``cache_salt`` and, with a LoRA adapter, the adapter's.

    vLLM's block hashes carry the adapter's name and path; the identity of its files (``tierkv.weights``) is
    added here, so an adapter rewritten at the same path never finds the KV of its former self.  A request
    without an adapter keeps its ``cache_salt`` as is (keys unchanged).  Each adapter is fingerprinted once
    per (name, path) for the engine's life, as vLLM loads it once.
    """

    def __init__(self) -> None:
        self._ids: dict[tuple[str, str], str] = {}

    def of(self, request: Any) -> str | None:
        """The key salt of ``request`` (a vLLM ``Request``: ``cache_salt``, ``lora_request``)."""
        salt = getattr(request, "cache_salt", None)
        lora = getattr(request, "lora_request", None)
        if lora is None:
            return salt
        name, path = str(getattr(lora, "lora_name", "")), str(getattr(lora, "lora_path", "") or "")
        ident = self._ids.get((name, path))
        if ident is None:
            ident = resolve_weights(path or name).digest
            if len(self._ids) >= LORA_IDENTITIES_MAX:
                self._ids.clear()
            self._ids[(name, path)] = ident
        return LORA_SALT + ident + ("" if salt is None else "\x00" + salt)


def salt_tenant(salt: str | None) -> str | None:
    """The ``cache_salt`` part of a key salt (:class:`RequestSalts`): the tenant it names, None if none."""
    if salt is None or not salt.startswith(LORA_SALT):
        return salt
    _, sep, rest = salt[len(LORA_SALT):].partition("\x00")
    return rest if sep else None


def layer_namespace(base: str, layer: str, cache_salt: str | None = None) -> str:
    """Namespace of one layer's blocks; requests with different salts never share keys."""
    salt = "-" if cache_salt is None else "salt:" + _clean(cache_salt)
    return f"{base}/{salt}/{_clean(layer)}"


def block_hash_bytes(h: object) -> bytes:
    """An engine block hash as bytes (vLLM's ``BlockHash`` is a bytes subtype; older builds use ints)."""
    if isinstance(h, (bytes, bytearray, memoryview)):
        return bytes(h)
    if isinstance(h, int):
        return h.to_bytes(max(1, (h.bit_length() + 8) // 8), "little", signed=True)
    if isinstance(h, str):
        return h.encode()
    hv = getattr(h, "hash_value", None)  # BlockHashWithGroupId-like wrappers
    if hv is not None:
        return block_hash_bytes(hv)
    raise TypeError(f"unsupported block hash type {type(h).__name__}")
