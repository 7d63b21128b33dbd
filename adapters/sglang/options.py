"""The SGLang backend's options and key namespaces, checked without importing SGLang.

:func:`parse_options` reads ``--hicache-storage-backend-extra-config``: the store config (inline under
``"tierkv"`` or a file under ``"tierkv_config_file"``, as the vLLM connector takes them; with neither,
:data:`DEFAULT_STORE_CONFIG`) and tierkv's own options, each checked by type (``tierkv.options``).  The keys
SGLang reads itself (:data:`SGLANG_KEYS`) are accepted and left to it; any other key is a ``ConfigError``
naming it.  :func:`page_namespace` is what a stored page's key is made under: everything that changes a
page's bytes (weights, dtype, layout, page size, layers, KV heads or MLA, pipeline stage, pool).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tierkv.errors import ConfigError
from tierkv.options import pop_float, pop_int, pop_store_config, pop_str

WHAT = "hicache-storage-backend-extra-config"

#: the store used when the extra-config names none: 1 GiB of this process's DRAM, nothing below it
DEFAULT_STORE_CONFIG: dict[str, Any] = {"tiers": [{"medium": "dram", "capacity": "1GiB", "eviction": "lru"}]}

#: extra-config keys SGLang itself consumes (the dynamic factory's, ``interface_v1``, the prefetch knobs):
#: accepted and ignored here
SGLANG_KEYS = frozenset({
    "backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size", "prefetch_threshold",
    "prefetch_timeout_base", "prefetch_timeout_per_ki_token", "hicache_storage_pass_prefix_keys",
})

#: tierkv's own options
OPTION_NAMES = ("tierkv", "tierkv_config_file", "model_id", "namespace", "lease_timeout_s", "metrics_port",
                "metrics_addr")


@dataclass(frozen=True)
class BackendOptions:
    """The backend's options, checked (see ``docs/sglang.md``)."""

    store_config: dict[str, Any] | str = field(default_factory=lambda: DEFAULT_STORE_CONFIG)
    #: the model part of every key; None: the digest of the weights SGLang serves (``tierkv.weights``)
    model_id: str | None = None
    #: a name folded into every key and the tenant of every put; None: none
    namespace: str | None = None
    #: how long the pages ``batch_exists`` found are held for the ``batch_get_v1`` that follows (seconds);
    #: 0: nothing is held
    lease_timeout_s: float = 30.0
    #: the store's metrics endpoint (``/metrics``, ``/status``: what ``tierkv describe`` / ``ping`` read), at
    #: this port plus the rank's index (``pp_rank * tp_size + tp_rank``); 0: a free port (logged); None: none
    metrics_port: int | None = None
    metrics_addr: str = "127.0.0.1"


def parse_options(extra: Any) -> BackendOptions:
    """Check the extra-config; a ``ConfigError`` names the first bad option, or every unknown one."""
    if extra is None:
        extra = {}
    if not isinstance(extra, dict):
        raise ConfigError(f"{WHAT} must be a mapping, got {type(extra).__name__}")
    opts = {k: v for k, v in extra.items() if k not in SGLANG_KEYS}
    store = pop_store_config(opts, WHAT, DEFAULT_STORE_CONFIG)
    model_id = pop_str(opts, "model_id", None, WHAT)
    namespace = pop_str(opts, "namespace", None, WHAT)
    if namespace is not None and not namespace.strip():
        raise ConfigError(f"{WHAT} option 'namespace': expected a non-empty name, got {namespace!r}")
    lease_timeout = pop_float(opts, "lease_timeout_s", 30.0, WHAT, min_value=0.0, max_value=3600.0)
    metrics_port = pop_int(opts, "metrics_port", None, WHAT, min_value=0, max_value=65535)
    metrics_addr = pop_str(opts, "metrics_addr", "127.0.0.1", WHAT)
    if opts:
        raise ConfigError(f"{WHAT}: unknown option(s) {sorted(opts)}; tierkv's: {sorted(OPTION_NAMES)}; "
                          f"SGLang's: {sorted(SGLANG_KEYS)}")
    return BackendOptions(store, model_id, namespace, lease_timeout, metrics_port, metrics_addr)


def _clean(part: object) -> str:
    return str(part).replace("/", "_").replace("\x00", "_")


@dataclass(frozen=True)
class EngineRanks:
    """What SGLang tells a backend about its place in the engine (``HiCacheStorageConfig``)."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    mla: bool = False
    cp_rank: int = 0
    cp_size: int = 1
    dcp_rank: int = 0
    dcp_size: int = 1

    @classmethod
    def of(cls, storage_config: Any) -> EngineRanks:
        g = storage_config
        return cls(int(g.tp_rank), int(g.tp_size), int(g.pp_rank), int(g.pp_size), bool(g.is_mla_model),
                   int(getattr(g, "attn_cp_rank", 0) or 0), int(getattr(g, "attn_cp_size", 1) or 1),
                   int(getattr(g, "dcp_rank", 0) or 0), int(getattr(g, "dcp_size", 1) or 1))

    def shard(self) -> str:
        """The rank part of a namespace: MLA's latent is one copy for every TP rank (per DCP shard); MHA ranks
        each hold their own KV heads."""
        if self.mla:
            return f"mla-dcp{self.dcp_rank}-of-{self.dcp_size}" if self.dcp_size > 1 else "mla"
        s = f"tp{self.tp_rank}-of-{self.tp_size}"
        return s + (f"-cp{self.cp_rank}-of-{self.cp_size}" if self.cp_size > 1 else "")


def page_namespace(model: str, ranks: EngineRanks, pool: str, dtype: str, layout: str, page_size: int,
                   layers: tuple[int, int], page_shape: tuple[int, ...], tenant: str | None = None) -> str:
    """The namespace a pool's pages are keyed under.

    ``page_shape`` is the shape of one page as the host pool lays it out (heads, head size, layers in their
    order), so two configurations whose pages differ in any byte's meaning never share a key.
    """
    return "/".join([
        "sglang", _clean(model), _clean(pool), _clean(dtype), _clean(layout), f"ps{int(page_size)}",
        f"layers{int(layers[0])}-{int(layers[1])}", "x".join(str(int(d)) for d in page_shape), ranks.shard(),
        f"pp{ranks.pp_rank}-of-{ranks.pp_size}", "tenant:" + _clean(tenant) if tenant is not None else "-",
    ])
