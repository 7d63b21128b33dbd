"""Prometheus metrics of a store: one catalogue, two exporters.

``snapshot(store)`` reads every number a store reports (``stats()``: per-tier
counters and gauges, the medium's own figures, shadow estimates, store totals,
the write-behind queue; the latency histograms of its ``LatencyRecorder``) into a
JSON-able dict.  ``families(snapshot)`` turns one into metric families, each a
name, a kind, a help line, label names and samples.  Both exporters render those
families, so the names are the same everywhere:

* standalone: ``serve(store, port)`` starts an HTTP endpoint (port 0 picks a free
  one; read ``.port``) and returns an ``Exporter`` with ``stop()`` / ``close()``; beside
  ``/metrics`` it serves ``/status``, the same snapshot as JSON with the store's health
  (``status_document``: HTTP 200 when healthy, 503 when not);
  ``register(store, registry)`` adds the metrics to an existing registry;
* vLLM: the connector ships each worker's snapshot to vLLM's logger, which renders
  the same families on vLLM's ``/metrics`` (``tierkv.adapters.vllm.prom``).

Generic by construction: every field of ``TierCounters`` and ``StoreCounters``
(``tierkv.stats``) is exported, and a medium's numeric ``extra_stats()`` too, so a
counter added there appears without touching this module.  After ``close()`` the
standalone exporter keeps serving the store's final figures (taken as it closed),
with ``tierkv_open`` 0 and every ``tierkv_tier_available`` 0.  The list of metrics
and their meaning is in docs/metrics.md.
"""

from __future__ import annotations

import bisect
import enum
import errno
import json
import math
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, Optional
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import ThreadingWSGIServer

from tierkv.options import check_int, check_str
from tierkv.stats import StoreCounters, TierCounters

LATENCY_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25,
                   0.5, 1.0, 2.5, 5.0, 10.0)
LATENCY_OPS = ("get", "put", "lookup")


class Kind(enum.Enum):
    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"  # (latency: ``latency_families``)


class Merge(enum.Enum):
    """How one engine's ranks combine into one value (vLLM's ``/metrics``); counters always add up."""

    SUM = "sum"
    MIN = "min"  # 1 only when every rank says 1
    MEAN = "mean"


@dataclass
class Family:
    """One metric: ``name`` (a counter's without ``_total``), its samples as (label values, value)."""

    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()
    samples: list[tuple[tuple[str, ...], float]] = field(default_factory=list)
    merge: Merge = Merge.SUM


# -- the catalogue: stats() field -> (metric name, help) ------------------------------------------------------
#: per-tier counters (``TierCounters``); a field not listed is exported as ``tierkv_tier_<field>_total``
TIER_COUNTERS = {
    "hits": ("hits", "Chunks served by the tier"),
    "misses": ("misses", "Chunks looked for in the tier and not found there"),
    "bytes_read": ("read_bytes", "Bytes read from the tier (hits, demotion sources)"),
    "bytes_written": ("written_bytes", "Bytes written into the tier (puts, demotions, promotions)"),
    "puts": ("puts", "Chunks a put stored in the tier"),
    "evictions": ("evictions", "Chunks evicted from the tier"),
    "demotions": ("demotions", "Evicted chunks a lower tier keeps (copied there, or found there already)"),
    "promotions": ("promotions", "Hits of the tier copied up to a faster tier"),
    "rejected": ("rejected", "Chunks the tier refused (admission, no room)"),
    "errors": ("errors", "Failed or corrupt reads and writes"),
    "corrupt": ("corrupt", "Copies that failed their checksum (the store's check or the medium's own): dropped "
                "from the tier, each read as a miss"),
    "persisted": ("persisted", "Chunks the write-behind queue copied into the tier"),
}
#: per-tier gauges: field -> (help, how ranks combine)
TIER_GAUGES = {
    "used_bytes": ("Bytes of capacity in use", Merge.SUM),
    "capacity_bytes": ("Configured capacity", Merge.SUM),
    "stored_bytes": ("Bytes the medium holds (payloads and their headers)", Merge.SUM),
    "entries": ("Chunks held (managed tiers)", Merge.SUM),
    "available": ("1 while the tier serves, 0 while its backend is down or the store is closed", Merge.MIN),
}
#: a medium's fault counters (``extra_stats()``) -> the ``reason`` of ``tierkv_tier_medium_errors_total``
MEDIUM_ERRORS = {
    "io_errors": "io",
    "enospc": "disk_full",
    "too_large": "too_large",
    "checkpoint_errors": "checkpoint",
    "bad_key": "bad_key",
    "timeouts": "timeout",
    "transfer_errors": "peer_unreachable",
    "late_reads_running": "late_write",
}
#: a shadow's estimate per capacity factor (``tierkv.shadow``): field -> (metric suffix, help, how ranks combine)
SHADOW_FACTOR_FIELDS = {
    "hit_rate": ("hit_ratio", "Estimated share of chunk requests the tier would serve at capacity_factor x its "
                 "capacity (sampled shadow cache)", Merge.MEAN),
    "cumulative_hit_rate": ("cumulative_hit_ratio", "Estimated share of chunk requests served at or above the tier "
                            "at capacity_factor x its capacity", Merge.MEAN),
    "capacity_bytes": ("capacity_bytes", "The capacity the shadow cache models (capacity_factor x the tier's)",
                       Merge.SUM),
    "sampled_chunks": ("sampled_chunks", "Chunks the shadow cache holds (a few hundred make a steady estimate)",
                       Merge.SUM),
}
#: a shadow's figures per tier
SHADOW_FIELDS = {
    "sample_rate": (Kind.GAUGE, "Share of chunk keys the shadow samples"),
    "sampled_requests": (Kind.COUNTER, "Chunk requests the shadow sampled"),
    "requests": (Kind.COUNTER, "Chunk requests the shadow saw (gets that found the chunk, and puts)"),
}
#: store counters with a name of their own; every other ``StoreCounters`` field is ``tierkv_<field>_total``
_CALLS = {"put_calls": "put", "get_calls": "get", "lookup_calls": "lookup"}
CHUNK_OUTCOMES = {"chunks_stored": ("put", "stored"), "chunks_deduped": ("put", "deduped"),
           "chunks_rejected": ("put", "rejected"), "hits": ("get", "hit"), "misses": ("get", "miss")}
STORE_COUNTER_HELP = {
    "hits": "Chunks a get found in some tier",
    "misses": "Chunks a get found in no tier",
    "bytes_put": "Bytes of the chunks puts stored",
    "bytes_got": "Bytes of the chunks gets found",
    "write_behind_queued": "Chunks handed to the write-behind queue",
    "promotions_dropped": "Promotions the background queue gave up (full, closing, or a failed batch)",
    "leases": "Leases granted (chunks held from a lookup to its load)",
    "leased_chunks": "Chunks those leases pinned",
    "leases_released": "Leases their holder released",
    "lease_expired": "Leases their deadline released (their chunks could be evicted again)",
    "write_behind_dropped": "Write-behind copies of acknowledged chunks given up over the store's life, by reason "
                            "(write_behind_not_durable: those not durable now)",
    "misses_by_reason": "Misses explained, by reason (tierkv.outcome.MissReason: never_stored, evicted, rejected, "
                        "corrupt, audit_failed, lease_expired, unavailable, other_namespace)",
}
#: store gauges (``stats()["total"]`` fields that are neither ``StoreCounters`` nor per-tier sums)
STORE_GAUGE_HELP = {
    "used_bytes": "Bytes of capacity in use (all tiers)",
    "capacity_bytes": "Configured capacity (all tiers)",
    "in_flight": "Store calls in progress",
    "leases_active": "Leases holding chunks now",
    "miss_memory": "Departures the store remembers at most to explain misses (config miss_memory)",
    "miss_memory_used": "Departures remembered now",
    "write_behind_pending": "Chunks waiting in the write-behind queue (its depth)",
    "write_behind_not_durable": "Acknowledged chunks not durable now in a persistent tier that admits them "
                                "(flush() names them)",
}
_STORE_COUNTERS = {f.name for f in fields(StoreCounters)}
STORE_COUNTER_NAMES = frozenset(_STORE_COUNTERS)  # (a split of one of these is exported as ``<name>_by_reason``)
_TIER_COUNTERS = [f.name for f in fields(TierCounters)]
_NOT_MEDIUM = {*_TIER_COUNTERS, *TIER_GAUGES, *MEDIUM_ERRORS}


def _number(v: Any) -> bool:
    return isinstance(v, (int, float))  # (bool included: 1 / 0)


# -- latency -------------------------------------------------------------------------------------------------
class LatencyRecorder:
    """Store observer keeping one latency histogram per operation (a batch is one observation).

    Plain counts (no Prometheus object), so a snapshot travels between processes.
    ``LatencyRecorder.of(store)`` finds the store's recorder, attaching one if needed.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = {op: [0] * (len(LATENCY_BUCKETS) + 1) for op in LATENCY_OPS}
        self._sums = dict.fromkeys(LATENCY_OPS, 0.0)
        self._at_close: list[Callable[[], None]] = []

    @classmethod
    def find(cls, store: Any) -> Optional[LatencyRecorder]:
        for obs in getattr(store, "observers", tuple)():
            if isinstance(obs, cls):
                return obs
        return None

    @classmethod
    def of(cls, store: Any) -> LatencyRecorder:
        rec = cls.find(store)
        if rec is None:
            rec = cls()
            store.add_observer(rec)
        return rec

    def observe(self, op: str, keys: list, result: Any, seconds: float, sizes: Any) -> None:
        counts = self._counts.get(op)
        if counts is not None:
            i = bisect.bisect_left(LATENCY_BUCKETS, seconds)  # the first bucket whose bound is >= seconds
            with self._lock:
                counts[i] += 1
                self._sums[op] += seconds

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """``{op: {"counts": [per bucket, the last one +Inf], "sum": seconds}}``."""
        with self._lock:
            return {op: {"counts": list(c), "sum": self._sums[op]} for op, c in self._counts.items()}

    def at_close(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` when the store closes (before its tiers are released)."""
        self._at_close.append(fn)

    def forget(self, fn: Callable[[], None]) -> None:
        self._at_close = [f for f in self._at_close if f != fn]

    def close(self) -> None:
        for fn in list(self._at_close):
            fn()


# -- snapshot and families -----------------------------------------------------------------------------------
def snapshot(store: Any) -> dict[str, Any]:
    """Every number ``store`` reports, JSON-able: ``{"open", "tiers": {name: {"values", "shadow", "factors", "info"}},
    "total", "by_reason", "latency"}`` (``latency`` only with a ``LatencyRecorder`` attached; ``info``: the tier's
    words, e.g. ``medium``, ``backend``, ``last_error``, which no metric carries)."""
    st = store.stats()
    tiers: dict[str, Any] = {}
    for name, t in st["tiers"].items():
        shadow = t.get("shadow") or {}
        tiers[name] = {
            "values": {k: float(v) for k, v in t.items() if _number(v)},
            "shadow": {k: float(v) for k, v in shadow.items() if _number(v)},
            "factors": {f: {k: float(v) for k, v in e.items() if _number(v)}
                        for f, e in (shadow.get("factors") or {}).items()},
            "info": {k: v for k, v in t.items() if isinstance(v, str)},
        }
    out: dict[str, Any] = {
        "open": 0.0 if getattr(store, "closed", False) else 1.0,
        "tiers": tiers,
        "total": {k: float(v) for k, v in st["total"].items() if _number(v)},
        # ``X_by_reason`` dicts of stats()["total"]: the counter X split by reason
        "by_reason": {k[:-len("_by_reason")]: {r: float(n) for r, n in v.items()}
                      for k, v in st["total"].items() if k.endswith("_by_reason") and isinstance(v, dict)},
    }
    if "tenants" in st:  # label -> tier -> {used_bytes, hits}: the configured tenants and "other"
        out["tenants"] = {label: {tier: {"used_bytes": float(d["used_bytes"]), "hits": float(d["hits"])}
                                  for tier, d in t["tiers"].items()} for label, t in st["tenants"].items()}
    rec = LatencyRecorder.find(store)
    if rec is not None:
        out["latency"] = rec.snapshot()
    return out


def families(snap: dict[str, Any]) -> list[Family]:
    """The metric families of one snapshot (histograms apart: see ``latency_families``)."""
    tiers = snap.get("tiers") or {}
    out: list[Family] = [Family("tierkv_open", Kind.GAUGE, "1 while the store is open, 0 once it is closed",
                                samples=[((), float(snap.get("open", 1.0)))], merge=Merge.MIN)]
    by_tier: dict[str, Family] = {}
    for f in _TIER_COUNTERS:
        suffix, doc = TIER_COUNTERS.get(f, (f, f"stats() tier counter {f}"))
        by_tier[f] = Family(f"tierkv_tier_{suffix}", Kind.COUNTER, doc, ("tier",))
    for f, (doc, merge) in TIER_GAUGES.items():
        by_tier[f] = Family(f"tierkv_tier_{f}", Kind.GAUGE, doc, ("tier",), merge=merge)
    errors = Family("tierkv_tier_medium_errors", Kind.COUNTER,
                    "Faults the medium counted, by reason (io, disk_full, too_large, checkpoint, bad_key, "
                    "timeout, peer_unreachable)", ("tier", "reason"))
    medium = Family("tierkv_tier_medium", Kind.GAUGE,
                    "Every other number the medium reports in stats() (its own counters and levels)",
                    ("tier", "field"))
    per_factor = {f: Family(f"tierkv_tier_shadow_{name}", Kind.GAUGE, doc, ("tier", "capacity_factor"), merge=merge)
                  for f, (name, doc, merge) in SHADOW_FACTOR_FIELDS.items()}
    shadow_top = {f: Family(f"tierkv_tier_shadow_{f}", kind, doc, ("tier",), merge=Merge.MEAN)
                  for f, (kind, doc) in SHADOW_FIELDS.items()}
    for name, t in tiers.items():
        for f, v in (t.get("values") or {}).items():
            fam = by_tier.get(f)
            if fam is not None:
                fam.samples.append(((name,), v))
            elif f in MEDIUM_ERRORS:
                errors.samples.append(((name, MEDIUM_ERRORS[f]), v))
            else:
                medium.samples.append(((name, f), v))
        for f, v in (t.get("shadow") or {}).items():
            if f in shadow_top:
                shadow_top[f].samples.append(((name,), v))
        for factor, est in (t.get("factors") or {}).items():
            for f, v in est.items():
                if f in per_factor:
                    per_factor[f].samples.append(((name, factor), v))
    out += [*by_tier.values(), errors, medium, *per_factor.values(), *shadow_top.values()]
    if snap.get("tenants"):  # (bounded labels: the configured tenants and "other", never one per name seen)
        used = Family("tierkv_tenant_used_bytes", Kind.GAUGE,
                      "Footprint bytes a tenant's chunks take in a tier (quotas: tierkv.tenants)", ("tier", "tenant"))
        hits = Family("tierkv_tenant_hits", Kind.COUNTER, "Chunks read from a tier, by tenant", ("tier", "tenant"))
        for label, per_tier in snap["tenants"].items():
            for tier, d in per_tier.items():
                used.samples.append(((tier, label), d["used_bytes"]))
                hits.samples.append(((tier, label), d["hits"]))
        out += [used, hits]

    total = snap.get("total") or {}
    calls = Family("tierkv_calls", Kind.COUNTER, "Store calls (batches)", ("op",))
    chunks = Family("tierkv_chunks", Kind.COUNTER,
                    "Chunks by operation and outcome (put: stored, deduped, rejected; get: hit, miss); the sum over "
                    "outcome is the chunks of that operation", ("op", "outcome"))
    for f in _CALLS:
        calls.samples.append(((_CALLS[f],), total.get(f, 0.0)))
    for f, labels in CHUNK_OUTCOMES.items():
        chunks.samples.append((labels, total.get(f, 0.0)))
    out += [calls, chunks]
    split = snap.get("by_reason") or {}
    for f, counts in split.items():
        # (a split whose counter is also a store counter of its own, ``misses``, keeps ``_by_reason`` in its name)
        name = f"{f}_by_reason" if f in _STORE_COUNTERS else f
        out.append(Family(f"tierkv_{name}", Kind.COUNTER, STORE_COUNTER_HELP.get(name, f"stats() store counter {f}"),
                          ("reason",), [((r,), n) for r, n in counts.items()]))
    for f, v in total.items():
        if (f in _CALLS or f == "chunks_put" or (f.startswith("chunks_") and f in CHUNK_OUTCOMES)
                or (f in split and f not in _STORE_COUNTERS)):
            continue  # (chunks_put is the sum of the put outcomes; a split counter's total, of its reasons)
        if f in _STORE_COUNTERS:
            out.append(Family(f"tierkv_{f}", Kind.COUNTER, STORE_COUNTER_HELP.get(f, f"stats() store counter {f}"),
                              samples=[((), v)]))
        elif f in TIER_COUNTERS:
            suffix, doc = TIER_COUNTERS[f]
            out.append(Family(f"tierkv_{suffix}", Kind.COUNTER, f"{doc} (all tiers)", samples=[((), v)]))
        else:
            out.append(Family(f"tierkv_{f}", Kind.GAUGE, STORE_GAUGE_HELP.get(f, f"stats() store figure {f}"),
                              samples=[((), v)]))
    return out


def latency_families(snap: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``{metric name: {"counts", "sum"}}`` of the snapshot's latency histograms."""
    return {f"tierkv_{op}_seconds": h for op, h in (snap.get("latency") or {}).items()}


def latency_help(name: str) -> str:
    return f"Latency of one store {name[len('tierkv_'):-len('_seconds')]} batch (seconds)"


# -- health --------------------------------------------------------------------------------------------------
def health(snap: dict[str, Any]) -> tuple[list[str], list[str]]:
    """``(problems, warnings)`` of one snapshot: healthy means no problem.

    Problems: the store is closed, a tier reports itself unavailable, or acknowledged chunks are not durable
    now (``write_behind_not_durable`` above 0: their copy was given up and no persistent tier holds them;
    the lifetime counter ``write_behind_dropped`` is no problem by itself).
    Warnings: faults that cost a miss or a refused put and nothing else (a tier's errors, its medium's faults)."""
    problems: list[str] = []
    warnings: list[str] = []
    closed = not snap.get("open", 1.0)
    if closed:
        problems.append("the store is closed")
    for name, t in (snap.get("tiers") or {}).items():
        v = t.get("values") or {}
        if not closed and v.get("available", 1.0) < 1:
            err = (t.get("info") or {}).get("last_error")
            problems.append(f"tier {name} is unavailable" + (f" ({err})" if err else ""))
        faults = {reason: v[f] for f, reason in MEDIUM_ERRORS.items() if v.get(f)}
        said = [f"{v['errors']:.0f} failed or corrupt reads and writes"] if v.get("errors") else []
        if v.get("corrupt"):
            said.append(f"{v['corrupt']:.0f} copies failed their checksum (dropped, read as misses)")
        if faults:
            said.append("medium faults: " + ", ".join(f"{reason} {n:.0f}" for reason, n in faults.items()))
        if said:
            warnings.append(f"tier {name}: " + "; ".join(said))
    undurable = (snap.get("total") or {}).get("write_behind_not_durable", 0.0)
    if undurable:
        problems.append(f"{undurable:.0f} acknowledged chunks are not durable in their persistent tier "
                        "(flush() names them)")
    return problems, warnings


def status_document(snap: dict[str, Any]) -> dict[str, Any]:
    """What ``/status`` serves: ``{"healthy", "problems", "warnings", "snapshot"}`` (strict JSON: a number that is
    not finite is null)."""
    problems, warnings = health(snap)
    return {"healthy": not problems, "problems": problems, "warnings": warnings, "snapshot": _finite(snap)}


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


# -- the standalone exporter ---------------------------------------------------------------------------------
class StoreCollector:
    """A prometheus_client collector rendering ``families(snapshot(store))`` on every scrape.

    Once the store is closed it renders the final snapshot (taken as the store closed when
    ``recorder`` is attached to it), with ``tierkv_open`` and every ``tierkv_tier_available`` 0.
    """

    def __init__(self, store: Any, recorder: Optional[LatencyRecorder] = None) -> None:
        self.store = store
        self._final: Optional[dict[str, Any]] = None
        if recorder is not None:
            recorder.at_close(self._keep_final)

    def _keep_final(self) -> None:
        self._final = _closed(snapshot(self.store))

    def describe(self):  # no pre-registration: the names depend on what the store reports
        return []

    def current(self) -> dict[str, Any]:
        """The snapshot a scrape shows now (the final one once the store is closed)."""
        snap = self._final
        if snap is None:
            if not getattr(self.store, "closed", False):
                snap = snapshot(self.store)
            else:  # closed before a final snapshot could be kept: what stats() still says, if anything
                try:
                    snap = _closed(snapshot(self.store))
                except Exception:  # noqa: BLE001 - a released medium may refuse; the store is closed all the same
                    snap = {"open": 0.0, "tiers": {}, "total": {}}
        return snap

    def collect(self):
        yield from render(self.current())


def _closed(snap: dict[str, Any]) -> dict[str, Any]:
    snap["open"] = 0.0
    for t in snap["tiers"].values():
        t["values"]["available"] = 0.0
    return snap


def render(snap: dict[str, Any]):
    """prometheus_client metric families of one snapshot."""
    for fam in families(snap):
        cls = CounterMetricFamily if fam.kind is Kind.COUNTER else GaugeMetricFamily
        m = cls(fam.name, fam.help, labels=list(fam.labels))
        for labels, v in fam.samples:
            m.add_metric(list(labels), v)
        yield m
    for name, h in latency_families(snap).items():
        cumulative, acc = [], 0.0
        for bound, n in zip((*LATENCY_BUCKETS, float("inf")), h["counts"]):
            acc += n
            cumulative.append(("+Inf" if bound == float("inf") else repr(float(bound)), acc))
        yield HistogramMetricFamily(name, latency_help(name), buckets=cumulative, sum_value=h["sum"])


class Exporter:
    """tierkv's metrics for one store in a registry (its own unless given); ``serve`` starts an HTTP endpoint."""

    def __init__(self, store: Any, registry: Optional[CollectorRegistry] = None) -> None:
        self.store = store
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=False)
        had = LatencyRecorder.find(store)
        self.latency = had or LatencyRecorder.of(store)
        self._own_recorder = had is None
        self.collector = StoreCollector(store, self.latency)
        self.registry.register(self.collector)  # type: ignore[arg-type]
        self._metrics = make_wsgi_app(self.registry)
        self._server: Optional[WSGIServer] = None
        self._thread: Optional[threading.Thread] = None
        self.port: Optional[int] = None
        self.addr: Optional[str] = None

    def serve(self, port: int = 0, addr: str = "127.0.0.1") -> Exporter:
        """Listen on ``addr:port``; on failure (port in use…) the exporter is stopped and ``OSError`` raised
        (a port that is no integer of 0–65535, or an address that is no string: ``ConfigError``)."""
        try:
            port = check_int(port, "tierkv.metrics: port", min_value=0, max_value=65535)
            addr = check_str(addr, "tierkv.metrics: addr")
            self._server, self._thread = _start_server(port, addr, self._app)
        except OSError as e:
            self.stop()
            raise OSError(e.errno or errno.EADDRNOTAVAIL,
                          f"tierkv.metrics: cannot listen on {addr}:{port}: {e.strerror or e}") from e
        except BaseException:
            self.stop()
            raise
        self.addr = addr
        self.port = self._server.server_port
        return self

    def _app(self, environ: dict[str, Any], start_response: Any) -> list[bytes]:
        """``/status``: ``status_document`` of the snapshot a scrape would show; any other path: the metrics."""
        if environ.get("PATH_INFO") != "/status" or environ.get("REQUEST_METHOD") != "GET":
            return self._metrics(environ, start_response)
        doc = status_document(self.collector.current())
        body = json.dumps(doc, default=str).encode()
        start_response("200 OK" if doc["healthy"] else "503 Service Unavailable",
                       [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
        return [body]

    @property
    def url(self) -> str:
        return f"http://{self.addr}:{self.port}/metrics"

    @property
    def status_url(self) -> str:
        return f"http://{self.addr}:{self.port}/status"

    def text(self) -> str:
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode()

    def stop(self) -> None:
        """Stop the HTTP endpoint and detach from the store.  Idempotent."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        self.latency.forget(self.collector._keep_final)
        if self._own_recorder:
            self.store.remove_observer(self.latency)
        try:
            self.registry.unregister(self.collector)  # type: ignore[arg-type]
        except KeyError:
            pass

    close = stop

    def __enter__(self) -> Exporter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # (a scrape is no news)
        pass


def _start_server(port: int, addr: str, app: Any) -> tuple[WSGIServer, threading.Thread]:
    """A threaded HTTP server for ``app`` on ``addr:port`` (IPv4 or IPv6, as ``addr`` resolves), serving from a
    daemon thread."""
    family = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]

    class Server(ThreadingWSGIServer):
        address_family = family

    server = make_server(addr, port, app, Server, handler_class=_Quiet)
    thread = threading.Thread(target=server.serve_forever, name="tierkv-metrics", daemon=True)
    thread.start()
    return server, thread


def serve(store: Any, port: int = 0, addr: str = "127.0.0.1") -> Exporter:
    """Export ``store``'s metrics over HTTP on ``addr:port`` (0: a free port, read ``.port``).

    If the endpoint cannot start (a port in use), nothing stays attached to the store and the error is raised."""
    exporter = Exporter(store)
    try:
        return exporter.serve(port, addr)
    except BaseException:
        exporter.stop()
        raise


def register(store: Any, registry: CollectorRegistry) -> Exporter:
    """Add ``store``'s metrics to an existing registry (e.g. an engine's); no server."""
    return Exporter(store, registry)
