"""tierkv's metrics on vLLM's ``/metrics``: the connector's Prometheus hooks.

vLLM asks a connector class for ``build_prom_metrics(vllm_config, metric_types,
labelnames, per_engine_labelvalues)`` and then calls ``observe(data, engine_idx)``
with each interval's aggregated ``KVConnectorStats.data``.  Two things ride in it:

* the connector's own interval counters (``load_tokens``, ``load_bytes``,
  ``load_s``, ``load_errors``, ``save_blocks``, ``save_bytes``, ``save_s``,
  ``save_errors``, ``save_refused``, the audit's ``audits``, ``audit_mismatches``,
  ``audit_skipped``, ``audit_s``, ``leases``, ``lease_expired``, ``lease_cuts``, ``hit_tokens`` by tier) -> counters
  ``tierkv_connector_loaded_tokens_total`` … and ``tierkv_connector_hit_tokens_total{tier}``; the hits the
  decline rule did not claim (``declined_slow``, ``declined_slow_tokens``, ``decline_probes``, by tier) ->
  ``tierkv_connector_declined_slow_total{tier}`` and the two others (decline.py);
* each worker's store as ``tierkv.metrics.snapshot`` reads it, under ``"tierkv_store"``
  by rank (put there by ``attach_store_snapshot``, merged across workers by
  ``merge_store_snapshots``) -> every family ``tierkv.metrics.families`` makes, under
  the standalone exporter's names: counters advanced by each rank's growth since its
  last snapshot, gauges combined over ranks as the family says (sum; ``available`` and
  ``tierkv_open``: the minimum; shadow ratios: the mean), latency histograms advanced
  bucket by bucket.

vLLM's labels (engine, model) come first, then the family's own.  Metrics are made on
first sight, so a counter the store adds later appears without a change here.  Nothing
here imports vLLM until ``build_prom_metrics`` is called.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from tierkv.metrics import LATENCY_BUCKETS, Kind, LatencyRecorder, Merge, families, latency_families, latency_help
from tierkv.metrics import snapshot as read_snapshot

if TYPE_CHECKING:
    from tierkv.store import TieredStore

SNAPSHOT_KEY = "tierkv_store"
#: a worker sends a snapshot with every non-empty interval, and at least this often while the engine steps
SNAPSHOT_EVERY_S = 1.0
CONNECTOR_COUNTERS = {
    "load_tokens": ("tierkv_connector_loaded_tokens", "Tokens loaded from tierkv into vLLM's KV cache"),
    "load_bytes": ("tierkv_connector_loaded_bytes", "Bytes loaded from tierkv"),
    "load_s": ("tierkv_connector_load_seconds", "Seconds spent loading from tierkv"),
    "load_errors": ("tierkv_connector_load_errors", "Loads that failed (the blocks were recomputed)"),
    "save_blocks": ("tierkv_connector_saved_blocks", "Blocks saved to tierkv"),
    "save_bytes": ("tierkv_connector_saved_bytes", "Bytes saved to tierkv"),
    "save_s": ("tierkv_connector_save_seconds", "Seconds spent saving to tierkv"),
    "save_errors": ("tierkv_connector_save_errors", "Saves that failed"),
    "save_refused": ("tierkv_connector_save_refused", "Chunks the store declined to keep (admission, no room)"),
    "audits": ("tierkv_connector_audits", "Stored chunks compared with KV computed afresh (audit_rate)"),
    "audit_mismatches": ("tierkv_connector_audit_mismatches",
                         "Audited chunks that differed from the KV computed afresh (removed from every tier)"),
    "audit_skipped": ("tierkv_connector_audit_skipped",
                      "Audited chunks not compared (gone from the store by the save, or unreadable)"),
    "audit_s": ("tierkv_connector_audit_seconds", "Seconds spent reading audited chunks back and comparing"),
    "leases": ("tierkv_connector_leases", "Lookups whose chunks were held for their load (a lease each)"),
    "lease_expired": ("tierkv_connector_lease_expired", "Leases that ran past lease_timeout_s before their load "
                      "(their chunks could be evicted)"),
    "lease_cuts": ("tierkv_connector_lease_cuts", "Objects a lookup found that were gone when it leased them "
                   "(the hit ends before the first of them)"),
    "events_stored": ("tierkv_connector_events_stored", "BlockStored KV events published for chunks tierkv stored"),
    "events_removed": ("tierkv_connector_events_removed",
                       "BlockRemoved KV events published for chunks that left every tier"),
    "events_dropped": ("tierkv_connector_events_dropped",
                       "KV events not published (a worker's queue was full, or the chunk's block hashes were "
                       "forgotten)"),
    "events_unmapped": ("tierkv_connector_events_unmapped",
                        "Removed keys no chunk this worker stored maps to (no KV event)"),
}

#: counters by tier (the decline rule's, decline.py): stats key -> (metric name, help)
CONNECTOR_TIER_COUNTERS = {
    "declined_slow": ("tierkv_connector_declined_slow",
                      "Hits not claimed because their tier loads slower than vLLM computes them, by that tier"),
    "declined_slow_tokens": ("tierkv_connector_declined_slow_tokens",
                             "Tokens of hits not claimed (computed instead) because a tier was slow, by that tier"),
    "decline_probes": ("tierkv_connector_decline_probes",
                       "Hits of a slow tier claimed anyway to measure it again (decline_probe_share), by tier"),
}


def watch_store(store: TieredStore) -> None:
    """Time ``store``'s batches for the latency histograms (a ``LatencyRecorder``, once)."""
    LatencyRecorder.of(store)


def attach_store_snapshot(data: dict[str, Any], store: Any, rank: Any = 0) -> None:
    """Put ``store``'s snapshot into a stats payload under this worker's ``rank``."""
    if store is not None:
        data.setdefault(SNAPSHOT_KEY, {})[str(rank)] = read_snapshot(store)


def merge_store_snapshots(dst: dict[str, Any], src: dict[str, Any]) -> None:
    """``KVConnectorStats.aggregate``'s part for snapshots: the newest per rank wins (they are cumulative)."""
    snaps = (src or {}).get(SNAPSHOT_KEY)
    if snaps:
        dst.setdefault(SNAPSHOT_KEY, {}).update(snaps)


class SnapshotClock:
    """When a worker's next snapshot is due even though its interval moved nothing."""

    def __init__(self, every_s: float = SNAPSHOT_EVERY_S) -> None:
        self.every_s = every_s
        self._last = float("-inf")

    def due(self) -> bool:
        return time.monotonic() - self._last >= self.every_s

    def sent(self) -> None:
        self._last = time.monotonic()


_CLASS = None


def _gauge(cls: Any, name: str, doc: str, labelnames: list[str]) -> Any:
    try:  # with vLLM's multiprocess collection, the newest value of a gauge is the one that counts
        return cls(name=name, documentation=doc, labelnames=labelnames, multiprocess_mode="mostrecent")
    except TypeError:  # a metric class without that option
        return cls(name=name, documentation=doc, labelnames=labelnames)


def _combine(merge: Merge, values: list[float]) -> float:
    if merge is Merge.MIN:
        return min(values)
    if merge is Merge.MEAN:
        return sum(values) / len(values)
    return sum(values)


def _add_to_histogram(child: Any, counts: list[float], total: float) -> None:
    """Add per-bucket counts (and their sum) to one histogram child."""
    buckets, summed = getattr(child, "_buckets", None), getattr(child, "_sum", None)
    if buckets is not None and summed is not None and len(buckets) == len(counts):
        for b, n in zip(buckets, counts):
            if n > 0:
                b.inc(n)
        summed.inc(total)
        return
    # a metric class without prometheus_client's buckets (e.g. a Ray wrapper): one observation per count at
    # its bucket's bound (the sum is then approximate)
    bounds = (*LATENCY_BUCKETS, LATENCY_BUCKETS[-1])
    for bound, n in zip(bounds, counts):
        for _ in range(int(n)):
            child.observe(bound)


def build_prom_metrics(vllm_config: Any, metric_types: dict, labelnames: list[str],
                       per_engine_labelvalues: dict[int, list[object]]) -> Any:
    """What ``TierKVConnector.build_prom_metrics`` returns (a ``KVConnectorPromMetrics``)."""
    return _prom_class()(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def _prom_class():
    global _CLASS
    if _CLASS is not None:
        return _CLASS
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

    class TierKVPromMetrics(KVConnectorPromMetrics):
        """Per-engine tierkv counters, gauges and histograms on vLLM's registry."""

        def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
            super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
            self._names = list(labelnames)
            self._conn = {k: self._counter_cls(name=n, documentation=d, labelnames=self._names)
                          for k, (n, d) in CONNECTOR_COUNTERS.items()}
            self._hit_tokens = self._counter_cls(name="tierkv_connector_hit_tokens",
                                                 documentation="Prompt tokens found in tierkv, by the tier serving them",
                                                 labelnames=[*self._names, "tier"])
            self._by_tier = {k: self._counter_cls(name=n, documentation=d, labelnames=[*self._names, "tier"])
                             for k, (n, d) in CONNECTOR_TIER_COUNTERS.items()}
            for values in per_engine_labelvalues.values():  # every series shows from the start, at 0
                for c in self._conn.values():
                    c.labels(*[str(v) for v in values])
            self._made: dict[str, Any] = {}  # metric name -> vLLM's metric object
            self._last: dict[tuple, Any] = {}  # (engine, rank, name, labels) -> last cumulative value(s)
            self._levels: dict[tuple, dict[str, float]] = {}  # (engine, name, labels) -> {rank: gauge value}
            self._merge: dict[str, Merge] = {}

        def _metric(self, name: str, kind: Kind, doc: str, labels: tuple[str, ...]) -> Any:
            m = self._made.get(name)
            if m is None:
                names = [*self._names, *labels]
                if kind is Kind.COUNTER:
                    m = self._counter_cls(name=name, documentation=doc, labelnames=names)
                elif kind is Kind.GAUGE:
                    m = _gauge(self._gauge_cls, name, doc, names)
                else:
                    hist_cls: Any = self._histogram_cls
                    m = hist_cls(name=name, documentation=doc, labelnames=names,
                                 buckets=list(LATENCY_BUCKETS))
                self._made[name] = m
            return m

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
            for k, c in self._by_tier.items():
                for tier, n in (d.get(k) or {}).items():
                    if n > 0:
                        c.labels(*labels, tier).inc(n)
            touched = set()
            for rank, snap in (d.get(SNAPSHOT_KEY) or {}).items():
                for fam in families(snap):
                    m = self._metric(fam.name, fam.kind, fam.help, fam.labels)
                    for lv, v in fam.samples:
                        if fam.kind is Kind.COUNTER:
                            key = (engine_idx, rank, fam.name, lv)
                            prev = self._last.get(key, 0.0)
                            self._last[key] = v
                            grow = v - prev if v >= prev else v  # a restarted worker counts from zero
                            child = m.labels(*labels, *lv)  # (shown from the first snapshot on, at 0 too)
                            if grow > 0:
                                child.inc(grow)
                        else:
                            self._levels.setdefault((engine_idx, fam.name, lv), {})[rank] = v
                            self._merge[fam.name] = fam.merge
                            touched.add((engine_idx, fam.name, lv))
                for name, h in latency_families(snap).items():
                    m = self._metric(name, Kind.HISTOGRAM, latency_help(name), ())
                    key = (engine_idx, rank, name, ())
                    prev_counts, prev_sum = self._last.get(key, ([0.0] * len(h["counts"]), 0.0))
                    counts, total = [float(n) for n in h["counts"]], float(h["sum"])
                    if sum(counts) < sum(prev_counts):  # a restarted worker counts from zero
                        prev_counts, prev_sum = [0.0] * len(counts), 0.0
                    self._last[key] = (counts, total)
                    grow = [max(0.0, a - b) for a, b in zip(counts, prev_counts)]
                    child = m.labels(*labels)
                    if any(grow):
                        _add_to_histogram(child, grow, max(0.0, total - prev_sum))
                for tier in snap.get("tiers") or {}:  # (every tier's series shows, at 0 too)
                    self._hit_tokens.labels(*labels, tier)
                    for c in self._by_tier.values():
                        c.labels(*labels, tier)
            for level in touched:
                _, name, lv = level
                value = _combine(self._merge[name], list(self._levels[level].values()))
                self._made[name].labels(*labels, *lv).set(value)

    _CLASS = TierKVPromMetrics
    return _CLASS
