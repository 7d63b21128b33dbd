"""Prometheus exporter of a store's counters, gauges and latencies.

``serve(store, port)`` starts an HTTP endpoint (port 0 picks a free one; the
chosen port is ``.port``) and returns an ``Exporter`` with ``stop()`` /
``close()``.  ``Exporter(store).registry`` can also be served by the engine's
own HTTP server, or ``register(store, registry)`` adds tierkv's metrics to an
existing registry.

Per tier (label ``tier``), read from ``store.stats()`` at scrape time:
``tierkv_tier_hits_total``, ``_misses_total``, ``_read_bytes_total``,
``_written_bytes_total``, ``_evictions_total``, ``_demotions_total``,
``_promotions_total``, ``_rejected_total``, ``_errors_total`` (all
``tierkv_tier_…``), gauges ``tierkv_tier_used_bytes``,
``tierkv_tier_capacity_bytes``, ``tierkv_tier_entries``,
``tierkv_tier_available`` (1 or 0) and, with a shadow observer,
``tierkv_tier_shadow_hit_ratio{tier, capacity_factor}`` (plus
``tierkv_tier_shadow_cumulative_hit_ratio``).

Store totals: ``tierkv_hits_total``, ``tierkv_misses_total``,
``tierkv_read_bytes_total``, ``tierkv_written_bytes_total``,
``tierkv_evictions_total``, ``tierkv_demotions_total``,
``tierkv_promotions_total``, ``tierkv_rejected_total``, ``tierkv_errors_total``,
``tierkv_used_bytes``, ``tierkv_capacity_bytes``, ``tierkv_calls_total{op}``,
``tierkv_chunks_total{op}``, ``tierkv_write_behind_dropped_total{reason}`` (acknowledged
chunks whose copy into a persistent tier was given up: see ``TieredStore.flush``) and
``tierkv_in_flight``.

Latency (one observation per batch, timed in the store): histograms
``tierkv_get_seconds``, ``tierkv_put_seconds`` and ``tierkv_lookup_seconds``.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Optional, cast

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from prometheus_client.registry import Collector

#: stats() field -> (metric suffix, help); counters
TIER_COUNTERS = {
    "hits": ("hits", "Chunks served by the tier"),
    "misses": ("misses", "Chunks looked for in the tier and not found there"),
    "bytes_read": ("read_bytes", "Bytes read from the tier (hits, demotion sources)"),
    "bytes_written": ("written_bytes", "Bytes written into the tier (puts, demotions, promotions)"),
    "evictions": ("evictions", "Chunks evicted from the tier"),
    "demotions": ("demotions", "Evicted chunks copied to a lower tier"),
    "promotions": ("promotions", "Hits of the tier copied up to a faster tier"),
    "rejected": ("rejected", "Chunks the tier refused (admission, no room)"),
    "errors": ("errors", "Failed or corrupt reads and writes"),
}
TIER_GAUGES = {
    "used_bytes": ("used_bytes", "Bytes of capacity in use"),
    "capacity_bytes": ("capacity_bytes", "Configured capacity"),
    "entries": ("entries", "Chunks held (managed tiers)"),
    "available": ("available", "1 while the tier serves, 0 while its backend is down"),
}
LATENCY_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25,
                   0.5, 1.0, 2.5, 5.0, 10.0)


class StoreCollector:
    """A prometheus_client collector that reads ``store.stats()`` on every scrape."""

    def __init__(self, store: Any, prefix: str = "tierkv") -> None:
        self.store = store
        self.prefix = prefix

    def describe(self):  # no pre-registration: metric names depend on nothing but the prefix
        return []

    def collect(self):
        p = self.prefix
        if getattr(self.store, "closed", False):
            return
        st = self.store.stats()
        tiers = st["tiers"]
        for field, (suffix, doc) in TIER_COUNTERS.items():
            m = CounterMetricFamily(f"{p}_tier_{suffix}", doc, labels=["tier"])
            for name, t in tiers.items():
                m.add_metric([name], float(t.get(field) or 0))
            yield m
        for field, (suffix, doc) in TIER_GAUGES.items():
            m = GaugeMetricFamily(f"{p}_tier_{suffix}", doc, labels=["tier"])
            for name, t in tiers.items():
                v = t.get(field)
                if v is not None:
                    m.add_metric([name], float(v))
            yield m
        shadow = GaugeMetricFamily(f"{p}_tier_shadow_hit_ratio",
                                   "Estimated share of chunk requests the tier would serve at capacity_factor x "
                                   "its capacity (sampled shadow cache)", labels=["tier", "capacity_factor"])
        cum = GaugeMetricFamily(f"{p}_tier_shadow_cumulative_hit_ratio",
                                "Estimated share of chunk requests served at or above the tier at capacity_factor "
                                "x its capacity", labels=["tier", "capacity_factor"])
        for name, t in tiers.items():
            for f, est in ((t.get("shadow") or {}).get("factors") or {}).items():
                shadow.add_metric([name, f], est["hit_rate"])
                cum.add_metric([name, f], est["cumulative_hit_rate"])
        yield shadow
        yield cum
        tot = st["total"]
        for field, (suffix, doc) in TIER_COUNTERS.items():
            src = {"hits": "hits", "misses": "misses"}.get(field, field)
            m = CounterMetricFamily(f"{p}_{suffix}", f"{doc} (all tiers)" if field not in ("hits", "misses")
                                    else ("Chunks a get found in some tier" if field == "hits"
                                          else "Chunks a get found in no tier"))
            m.add_metric([], float(tot.get(src) or 0))
            yield m
        for field in ("used_bytes", "capacity_bytes"):
            m = GaugeMetricFamily(f"{p}_{field}", f"{TIER_GAUGES[field][1]} (all tiers)")
            m.add_metric([], float(tot.get(field) or 0))
            yield m
        calls = CounterMetricFamily(f"{p}_calls", "Store calls (batches)", labels=["op"])
        for op in ("put", "get", "lookup"):
            calls.add_metric([op], float(tot.get(f"{op}_calls", 0)))
        yield calls
        chunks = CounterMetricFamily(f"{p}_chunks", "Chunks by outcome", labels=["op"])
        for op in ("put", "stored", "deduped", "rejected"):
            chunks.add_metric([op], float(tot.get(f"chunks_{op}", 0)))
        yield chunks
        dropped = CounterMetricFamily(f"{p}_write_behind_dropped",
                                      "Acknowledged chunks whose copy into a persistent tier was given up, by "
                                      "reason (flush() names them)", labels=["reason"])
        for reason, n in (tot.get("write_behind_dropped_by_reason") or {}).items():
            dropped.add_metric([reason], float(n))
        yield dropped
        g = GaugeMetricFamily(f"{p}_in_flight", "Store calls in progress")
        g.add_metric([], float(tot.get("in_flight", 0)))
        yield g


class LatencyObserver:
    """Store observer feeding one histogram per operation (a batch is one observation)."""

    def __init__(self, registry: CollectorRegistry, prefix: str = "tierkv") -> None:
        self.hists = {op: Histogram(f"{prefix}_{op}_seconds", f"Latency of one store {op} batch",
                                    registry=registry, buckets=LATENCY_BUCKETS)
                      for op in ("get", "put", "lookup")}

    def observe(self, op: str, keys: list, result: Any, seconds: float, sizes: Any) -> None:
        h = self.hists.get(op)
        if h is not None:
            h.observe(seconds)


class Exporter:
    """tierkv's metrics for one store in a registry of their own; ``serve`` starts an HTTP endpoint."""

    def __init__(self, store: Any, registry: Optional[CollectorRegistry] = None) -> None:
        self.store = store
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=False)
        self.collector = StoreCollector(store)
        self.registry.register(self.collector)
        self.latency = LatencyObserver(self.registry)
        store.add_observer(self.latency)
        self._server: Optional[WSGIServer] = None
        self._thread: Optional[threading.Thread] = None
        self.port: Optional[int] = None
        self.addr: Optional[str] = None

    def serve(self, port: int = 0, addr: str = "127.0.0.1") -> "Exporter":
        self._server, self._thread = start_http_server(port, addr=addr, registry=self.registry)
        self.addr = addr
        self.port = self._server.server_port
        return self

    @property
    def url(self) -> str:
        return f"http://{self.addr}:{self.port}/metrics"

    def text(self) -> str:
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode()

    def stop(self) -> None:
        """Stop the HTTP endpoint and detach from the store.  Idempotent."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        self.store.remove_observer(self.latency)
        for c in (self.collector, *self.latency.hists.values()):
            try:
                self.registry.unregister(cast("Collector", c))
            except KeyError:
                pass

    close = stop

    def __enter__(self) -> "Exporter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def serve(store: Any, port: int = 0, addr: str = "127.0.0.1") -> Exporter:
    """Export ``store``'s metrics over HTTP on ``addr:port`` (0: a free port, read ``.port``)."""
    return Exporter(store).serve(port, addr)


def register(store: Any, registry: CollectorRegistry) -> Exporter:
    """Add ``store``'s metrics to an existing registry (e.g. an engine's); no server."""
    return Exporter(store, registry)
