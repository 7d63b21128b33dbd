"""tierkv's counters on vLLM's ``/metrics``: the connector's Prometheus hooks.

vLLM asks a connector class for ``build_prom_metrics(vllm_config, metric_types,
labelnames, per_engine_labelvalues)`` and then calls ``observe(data, engine_idx)``
with each interval's aggregated ``KVConnectorStats.data``.  Two things ride in it:

* the connector's own interval counters (``load_tokens``, ``load_bytes``,
  ``load_s``, ``load_errors``, ``save_blocks``, ``save_bytes``, ``save_s``,
  ``save_errors``, ``hit_tokens`` by tier) -> counters
  ``tierkv_connector_loaded_tokens_total`` … and ``tierkv_connector_hit_tokens_total{tier}``;
* a cumulative snapshot of each worker's store under ``"tierkv_store"`` (put there by
  ``attach_store_snapshot``, merged across workers by ``merge_store_snapshots``) ->
  the same per-tier names ``tierkv.metrics`` exports (``tierkv_tier_hits_total{tier}`` …,
  gauges ``tierkv_tier_used_bytes`` / ``tierkv_tier_capacity_bytes`` summed over ranks),
  counters advanced by the growth since the last snapshot of that rank.

vLLM's labels (engine, model) come first; ``tier`` is added.  Nothing here
imports vLLM until ``build_prom_metrics`` is called.
"""

from __future__ import annotations

from typing import Any

from tierkv.metrics import TIER_COUNTERS

SNAPSHOT_KEY = "tierkv_store"
SNAPSHOT_GAUGES = ("used_bytes", "capacity_bytes")
CONNECTOR_COUNTERS = {
    "load_tokens": ("tierkv_connector_loaded_tokens", "Tokens loaded from tierkv into vLLM's KV cache"),
    "load_bytes": ("tierkv_connector_loaded_bytes", "Bytes loaded from tierkv"),
    "load_s": ("tierkv_connector_load_seconds", "Seconds spent loading from tierkv"),
    "load_errors": ("tierkv_connector_load_errors", "Loads that failed (the blocks were recomputed)"),
    "save_blocks": ("tierkv_connector_saved_blocks", "Blocks saved to tierkv"),
    "save_bytes": ("tierkv_connector_saved_bytes", "Bytes saved to tierkv"),
    "save_s": ("tierkv_connector_save_seconds", "Seconds spent saving to tierkv"),
    "save_errors": ("tierkv_connector_save_errors", "Saves that failed"),
}


def store_snapshot(store: Any) -> dict[str, dict[str, float]]:
    """Cumulative per-tier counters and gauges of one store, JSON-able (it travels worker -> logger)."""
    out = {}
    for name, t in store.stats()["tiers"].items():
        out[name] = {f: float(t.get(f) or 0) for f in (*TIER_COUNTERS, *SNAPSHOT_GAUGES)}
    return out


def attach_store_snapshot(data: dict[str, Any], store: Any, rank: Any = 0) -> None:
    """Put ``store``'s snapshot into a stats payload under this worker's ``rank``."""
    if store is not None:
        data.setdefault(SNAPSHOT_KEY, {})[str(rank)] = store_snapshot(store)


def merge_store_snapshots(dst: dict[str, Any], src: dict[str, Any]) -> None:
    """``KVConnectorStats.aggregate``'s part for snapshots: the newest per rank wins (they are cumulative)."""
    snaps = (src or {}).get(SNAPSHOT_KEY)
    if snaps:
        dst.setdefault(SNAPSHOT_KEY, {}).update(snaps)


_CLASS = None


def _gauge(cls: Any, name: str, doc: str, labelnames: list[str]) -> Any:
    try:  # with vLLM's multiprocess collection, the newest value of a gauge is the one that counts
        return cls(name=name, documentation=doc, labelnames=labelnames, multiprocess_mode="mostrecent")
    except TypeError:  # a metric class without that option
        return cls(name=name, documentation=doc, labelnames=labelnames)


def build_prom_metrics(vllm_config: Any, metric_types: dict, labelnames: list[str],
                       per_engine_labelvalues: dict[int, list[object]]) -> Any:
    """What ``TierKVConnector.build_prom_metrics`` returns (a ``KVConnectorPromMetrics``)."""
    return _prom_class()(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def _prom_class():
    global _CLASS
    if _CLASS is not None:
        return _CLASS
    from prometheus_client import Counter, Gauge
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

    class TierKVPromMetrics(KVConnectorPromMetrics):
        """Per-engine tierkv counters and gauges on vLLM's registry."""

        def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
            super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
            gauge_cls, counter_cls = metric_types[Gauge], metric_types[Counter]
            names = list(labelnames)
            self._conn = {k: counter_cls(name=n, documentation=d, labelnames=names)
                          for k, (n, d) in CONNECTOR_COUNTERS.items()}
            self._hit_tokens = counter_cls(name="tierkv_connector_hit_tokens",
                                           documentation="Prompt tokens found in tierkv, by the tier serving them",
                                           labelnames=[*names, "tier"])
            self._tier = {f: counter_cls(name=f"tierkv_tier_{suffix}", documentation=doc, labelnames=[*names, "tier"])
                          for f, (suffix, doc) in TIER_COUNTERS.items()}
            self._gauges = {f: _gauge(gauge_cls, f"tierkv_tier_{f}", f"tierkv tier {f} (all ranks)",
                                      [*names, "tier"]) for f in SNAPSHOT_GAUGES}
            self._last: dict[tuple, float] = {}  # (engine, rank, tier, field) -> last cumulative value

        def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
            labels = [str(v) for v in self.per_engine_labelvalues.get(engine_idx, [])]
            d = transfer_stats_data or {}
            for k, c in self._conn.items():
                v = d.get(k, 0) or 0
                if v > 0:
                    c.labels(*labels).inc(v)
            for tier, n in (d.get("hit_tokens") or {}).items():
                if n > 0:
                    self._hit_tokens.labels(*labels, tier).inc(n)
            snaps = d.get(SNAPSHOT_KEY) or {}
            gauges: dict[tuple[str, str], float] = {}
            for rank, tiers in snaps.items():
                for tier, vals in tiers.items():
                    for f, c in self._tier.items():
                        cur = float(vals.get(f, 0))
                        key = (engine_idx, rank, tier, f)
                        prev = self._last.get(key, 0.0)
                        grow = cur - prev if cur >= prev else cur  # a restarted worker counts from zero
                        self._last[key] = cur
                        if grow > 0:
                            c.labels(*labels, tier).inc(grow)
                    for f in SNAPSHOT_GAUGES:
                        self._last[(engine_idx, rank, tier, f)] = float(vals.get(f, 0))
            for (e, rank, tier, f), v in self._last.items():  # noqa: B007 - the name documents the loop
                if e == engine_idx and f in SNAPSHOT_GAUGES:
                    gauges[(tier, f)] = gauges.get((tier, f), 0.0) + v
            for (tier, f), v in gauges.items():
                self._gauges[f].labels(*labels, tier).set(v)

    _CLASS = TierKVPromMetrics
    return _CLASS
