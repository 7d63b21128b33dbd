"""Asking a running deployment what it holds: a store through its metrics endpoint, a pool through its master.

* A store: ``read_store(url)`` scrapes an endpoint that carries tierkv's metrics — the
  standalone exporter (``tierkv.metrics.serve``: ``/metrics``, or ``/status``, its
  JSON) or vLLM's own ``/metrics`` under the connector — rebuilds the store's snapshot
  from it (``snapshot_from_text``; several engines on one vLLM endpoint are combined
  as the exporters combine ranks) and ``describe_store`` turns that into a report:
  tiers, usage, hit rates, faults, the write-behind backlog and health
  (``tierkv.metrics.health``, the rule ``/status`` applies too).
* A pool: ``read_master(master, metrics_port)`` asks a ``mooncake_master``: its RPC
  port (does it accept a connection), its HTTP endpoint (the ``--metrics_port``:
  ``/health`` and ``/metrics``), and reports the pool as the master counts it:
  capacity, used bytes, keys, clients, segments.

Nothing here raises for a target that does not answer: that is a finding
(``reachable`` false, a problem in the report).  Input that names no target (a
malformed URL, a port out of range) is a ``ConfigError``.
"""

from __future__ import annotations

import http.client
import json
import math
import re
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import defaultdict
from dataclasses import fields
from typing import Any, Optional

from prometheus_client.parser import text_string_to_metric_families

from tierkv import metrics
from tierkv.errors import ConfigError
from tierkv.stats import TierCounters

MAX_BODY = 64 << 20  # a scrape larger than this is no metrics endpoint we know
DEFAULT_MASTER_METRICS_PORT = 9003


# -- addresses -----------------------------------------------------------------------------------------------
def endpoint_url(target: str) -> str:
    """``HOST:PORT``, ``http://HOST:PORT`` or a full URL -> the URL to scrape (``/metrics`` when no path is given).

    Raises ``ConfigError`` naming what is wrong (scheme, host, port)."""
    if not isinstance(target, str) or not target.strip():
        raise ConfigError("expected a metrics endpoint: HOST:PORT or http://HOST:PORT/metrics")
    text = target.strip()
    if "://" not in text:
        text = "http://" + text
    u = urllib.parse.urlsplit(text)
    if u.scheme not in ("http", "https"):
        raise ConfigError(f"{target!r}: not an http:// or https:// URL")
    try:
        port = u.port
    except ValueError:
        raise ConfigError(f"{target!r}: the port is not a number of 1-65535") from None
    if not u.hostname:
        raise ConfigError(f"{target!r}: no host (expected HOST:PORT or http://HOST:PORT/metrics)")
    if port is None:
        raise ConfigError(f"{target!r}: no port (the exporter's port: HOST:PORT)")
    if port == 0:
        raise ConfigError(f"{target!r}: port 0 names no endpoint")
    path = u.path if u.path not in ("", "/") else "/metrics"
    return urllib.parse.urlunsplit((u.scheme, u.netloc, path, u.query, ""))


def host_port(value: str, what: str) -> tuple[str, int]:
    """``"host:port"`` -> (host, port), or ``ConfigError`` naming ``what``."""
    if not isinstance(value, str) or ":" not in value:
        raise ConfigError(f"{what}: expected HOST:PORT, got {value!r}")
    host, _, port = value.strip().rpartition(":")
    host = host.strip("[]")
    if not host:
        raise ConfigError(f"{what}: no host in {value!r}")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{what}: the port of {value!r} is not a number of 1-65535")
    return host, int(port)


def master_target(master: str, metrics_port: Any) -> tuple[str, int, int]:
    """(host, RPC port, HTTP port) of a ``mooncake_master``, checked."""
    host, rpc_port = host_port(master, "--master")
    metrics_port = check_port(metrics_port, "--metrics-port")
    if metrics_port == rpc_port:
        raise ConfigError(f"--master {master} and --metrics-port {metrics_port} name one port: the master's RPC port "
                          "(--rpc_port) and its HTTP port (--metrics_port) differ")
    return host, rpc_port, metrics_port


def check_port(port: Any, what: str) -> int:
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ConfigError(f"{what}: expected a port number of 1-65535, got {port!r}")
    return port


def check_timeout(timeout: Any) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout) \
            or timeout <= 0:
        raise ConfigError(f"--timeout must be a positive number of seconds, got {timeout!r}")
    return float(timeout)


# -- talking to a target -------------------------------------------------------------------------------------
class Unreachable(Exception):
    """The target did not answer as an HTTP endpoint should; the message says how, in a few words."""


def http_get(url: str, timeout: float) -> tuple[int, str, str]:
    """``(status, content type, body)`` of a GET; an HTTP error status is an answer too (its body is read).

    Raises ``Unreachable`` when nothing answered (refused, unknown host, timeout) or what answered is not HTTP."""
    try:
        try:
            resp = urllib.request.urlopen(url, timeout=timeout)
        except urllib.error.HTTPError as e:  # an answer: the caller judges the status
            resp = e
        with resp:
            body = resp.read(MAX_BODY + 1)
            status, ctype = resp.status, resp.headers.get("Content-Type", "")
    except urllib.error.URLError as e:
        raise Unreachable(_why(e.reason)) from None
    except (http.client.HTTPException, OSError, ValueError) as e:
        raise Unreachable(_why(e)) from None
    if len(body) > MAX_BODY:
        raise Unreachable(f"answered with more than {MAX_BODY >> 20} MiB (not a metrics endpoint)")
    try:
        return status, ctype, body.decode()
    except UnicodeDecodeError:
        raise Unreachable("answered with bytes that are not text (not a metrics endpoint)") from None


def _why(e: Any) -> str:
    if isinstance(e, (socket.timeout, TimeoutError)):
        return "no answer in time (timed out)"
    if isinstance(e, ConnectionRefusedError):
        return "connection refused (nothing listens on that port)"
    if isinstance(e, socket.gaierror):
        return f"unknown host ({e.strerror or e})"
    if isinstance(e, (http.client.BadStatusLine, http.client.RemoteDisconnected, ConnectionResetError)):
        return "something answered, but not HTTP (is that the right port?)"
    if isinstance(e, OSError):
        return e.strerror or str(e) or type(e).__name__
    return " ".join(str(e).split()) or type(e).__name__


def tcp_answers(host: str, port: int, timeout: float) -> tuple[bool, Optional[float], str]:
    """``(answered, round trip in ms, why not)`` of one TCP connect."""
    t0 = time.perf_counter()
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True, (time.perf_counter() - t0) * 1e3, ""
    except OSError as e:
        return False, None, _why(e)


# -- a store: Prometheus text back into a snapshot -----------------------------------------------------------
_TIER_COUNTER_FIELD = {f"tierkv_tier_{metrics.TIER_COUNTERS.get(f.name, (f.name, ''))[0]}": f.name
                       for f in fields(TierCounters)}
_TIER_GAUGE_FIELD = {f"tierkv_tier_{f}": f for f in metrics.TIER_GAUGES}
_MEDIUM_ERROR_FIELD = {reason: f for f, reason in metrics.MEDIUM_ERRORS.items()}
_STORE_TOTAL_FIELD = {f"tierkv_{suffix}": f for f, (suffix, _) in metrics.TIER_COUNTERS.items()}
_CHUNKS_FIELD = {labels: f for f, labels in metrics.CHUNK_OUTCOMES.items()}
_SHADOW_FACTOR_FIELD = {f"tierkv_tier_shadow_{name}": f for f, (name, _, _) in metrics.SHADOW_FACTOR_FIELDS.items()}
_SHADOW_FIELD = {f"tierkv_tier_shadow_{f}": f for f in metrics.SHADOW_FIELDS}
_OWN_LABELS = {"tier", "reason", "field", "capacity_factor", "op", "outcome", "tenant"}


def snapshot_from_text(text: str) -> tuple[Optional[dict[str, Any]], dict[str, Any]]:
    """``(snapshot or None, extras)`` from a Prometheus scrape.

    The snapshot has the shape ``tierkv.metrics.snapshot`` returns (no ``info``, no latency): None when the
    text carries no store figures.  Samples under other labels than tierkv's own (vLLM's ``engine``,
    ``model_name``) are sources: counters and sizes add up over them, ``available`` and ``open`` take the
    minimum, shadow ratios the mean.  ``extras``: ``{"sources": [label dicts], "connector": {...}}``, the
    connector's own counters where vLLM's endpoint carries them.  Raises ``ValueError`` for text that is not the
    Prometheus format."""
    # path in the snapshot -> {source: value}: two families that carry one figure (tierkv_hits_total and
    # tierkv_chunks_total{op="get",outcome="hit"}) give it once per source, never twice
    acc: dict[tuple, dict[tuple, float]] = defaultdict(dict)
    sources: list[dict[str, str]] = []
    connector: dict[str, Any] = {}
    by_tier: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for fam in text_string_to_metric_families(text):
        if not fam.name.startswith("tierkv_") or fam.type == "histogram":
            continue
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue
            name = s.name[:-len("_total")] if s.name.endswith("_total") else s.name  # (a counter's family name)
            own = {k: v for k, v in s.labels.items() if k in _OWN_LABELS}
            src = {k: v for k, v in s.labels.items() if k not in _OWN_LABELS}
            if src not in sources:
                sources.append(src)
            if name.startswith("tierkv_connector_") and "tier" in own:  # (hit tokens, declined hits: by tier)
                by_tier[name[len("tierkv_connector_"):]][own["tier"]] += s.value
            elif name.startswith("tierkv_connector_"):
                key = name[len("tierkv_connector_"):]
                connector[key] = connector.get(key, 0.0) + s.value
            else:
                path = _path(name, own)
                if path is not None:
                    acc[path][tuple(sorted(src.items()))] = s.value
    snap: dict[str, Any] = {"open": 1.0, "tiers": {}, "total": {}, "by_reason": {}}
    found = False
    for path, by_source in acc.items():
        value = _combine(path, list(by_source.values()))
        found = True
        if path[0] == "open":
            snap["open"] = value
        elif path[0] == "tier":
            _, tier, part, *rest = path
            t = snap["tiers"].setdefault(tier, {"values": {}, "shadow": {}, "factors": {}})
            if part == "factors":
                t["factors"].setdefault(rest[0], {})[rest[1]] = value
            else:
                t[part][rest[0]] = value
        elif path[0] == "tenant":
            snap.setdefault("tenants", {}).setdefault(path[1], {}).setdefault(path[2], {})[path[3]] = value
        elif path[0] == "by_reason":
            snap["by_reason"].setdefault(path[1], {})[path[2]] = value
            if len(path) == 3:  # (a split counter's total is the sum of its reasons)
                snap["total"][path[1]] = snap["total"].get(path[1], 0.0) + value
        else:
            snap["total"][path[1]] = value
    outcomes = [snap["total"][f] for f, (op, _) in metrics.CHUNK_OUTCOMES.items() if op == "put" and f in snap["total"]]
    if outcomes:  # (the exporters leave out the sum of the put outcomes)
        snap["total"]["chunks_put"] = sum(outcomes)
    for key, counts in by_tier.items():
        connector[key] = dict(counts)
    return (snap if found else None), {"sources": [s for s in sources if s], "connector": connector}


#: a tenant family -> its field in a snapshot's ``tenants[label][tier]``
_TENANT_FIELD = {"tierkv_tenant_used_bytes": "used_bytes", "tierkv_tenant_hits": "hits"}


def _path(name: str, labels: dict[str, str]) -> Optional[tuple]:
    """Where one sample goes in a snapshot (None: a family this reader does not know)."""
    tier = labels.get("tier")
    if name == "tierkv_open":
        return ("open",)
    if tier is not None and "tenant" in labels:
        field = _TENANT_FIELD.get(name)
        return ("tenant", labels["tenant"], tier, field) if field else None
    if tier is not None:
        if name in _TIER_COUNTER_FIELD:
            return ("tier", tier, "values", _TIER_COUNTER_FIELD[name])
        if name in _TIER_GAUGE_FIELD:
            return ("tier", tier, "values", _TIER_GAUGE_FIELD[name])
        if name == "tierkv_tier_medium_errors" and "reason" in labels:
            return ("tier", tier, "values", _MEDIUM_ERROR_FIELD.get(labels["reason"], labels["reason"]))
        if name == "tierkv_tier_medium" and "field" in labels:
            return ("tier", tier, "values", labels["field"])
        if name in _SHADOW_FACTOR_FIELD and "capacity_factor" in labels:
            return ("tier", tier, "factors", labels["capacity_factor"], _SHADOW_FACTOR_FIELD[name])
        if name in _SHADOW_FIELD:
            return ("tier", tier, "shadow", _SHADOW_FIELD[name])
        if name.startswith("tierkv_tier_"):  # a tier counter added after this reader
            return ("tier", tier, "values", name[len("tierkv_tier_"):])
        return None
    if name == "tierkv_calls" and "op" in labels:
        return ("total", f"{labels['op']}_calls")
    if name == "tierkv_chunks" and "op" in labels and "outcome" in labels:
        f = _CHUNKS_FIELD.get((labels["op"], labels["outcome"]))
        return ("total", f) if f else None
    if "reason" in labels:
        f = name[len("tierkv_"):]
        stem = f[:-len("_by_reason")]
        if f.endswith("_by_reason") and stem in metrics.STORE_COUNTER_NAMES:
            # a split of a store counter that has its own family (misses): the total is not the sum read here
            return ("by_reason", stem, labels["reason"], "own_total")
        return ("by_reason", f, labels["reason"])
    if labels:
        return None
    return ("total", _STORE_TOTAL_FIELD.get(name, name[len("tierkv_"):]))


def _combine(path: tuple, values: list[float]) -> float:
    if path[0] == "open" or path[-1] == "available":
        return min(values)
    if path[-1] in ("hit_rate", "cumulative_hit_rate", "sample_rate"):
        return sum(values) / len(values)
    return sum(values)


# -- a store: the report -------------------------------------------------------------------------------------
def _n(v: Any) -> Any:
    """A figure as JSON shows it best: whole numbers as int, others as float, unknown as None."""
    if v is None or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return int(v) if float(v).is_integer() else float(v)


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return round(a / b, 4) if a is not None and b else None


#: per-tier counters a report shows, in this order (every other figure is under ``figures``)
TIER_REPORT_COUNTERS = ("hits", "misses", "puts", "evictions", "demotions", "promotions", "rejected", "errors",
                        "persisted")


def describe_store(snap: dict[str, Any], url: str = "", extras: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """The report of one store snapshot (see docs/tools.md, "Looking at a running deployment")."""
    problems, warnings = metrics.health(snap)
    total = snap.get("total") or {}
    store_hits = total.get("hits")
    tiers = []
    for name, t in (snap.get("tiers") or {}).items():
        v, info = t.get("values") or {}, t.get("info") or {}
        hits, misses = v.get("hits"), v.get("misses")
        row: dict[str, Any] = {
            "name": name,
            "medium": info.get("medium"),
            "available": bool(v.get("available", 1.0) >= 1),
            "used_bytes": _n(v.get("used_bytes")),
            "capacity_bytes": _n(v.get("capacity_bytes")),
            "used_ratio": _ratio(v.get("used_bytes"), v.get("capacity_bytes")),
            "entries": _n(v.get("entries")),
            "hit_rate": _ratio(hits, (hits or 0) + (misses or 0)),
            "share_of_hits": _ratio(hits, store_hits),
            **{k: _n(v.get(k)) for k in TIER_REPORT_COUNTERS},
            "medium_errors": {reason: _n(v[f]) for f, reason in metrics.MEDIUM_ERRORS.items() if f in v},
        }
        if info.get("backend"):
            row["backend"] = info["backend"]
        if info.get("last_error"):
            row["last_error"] = info["last_error"]
        shown = {*row, *TIER_REPORT_COUNTERS, *metrics.MEDIUM_ERRORS, "available"}
        row["figures"] = {k: _n(x) for k, x in v.items() if k not in shown}
        factors = t.get("factors") or {}
        if factors:
            row["shadow_hit_rate"] = {f: e.get("cumulative_hit_rate") for f, e in factors.items()}
        tiers.append(row)
    hits, misses = total.get("hits"), total.get("misses")
    dropped = (snap.get("by_reason") or {}).get("write_behind_dropped") or {}
    doc: dict[str, Any] = {
        "target": "store",
        "url": url,
        "reachable": True,
        "healthy": not problems,
        "problems": problems,
        "warnings": warnings,
        "open": bool(snap.get("open", 1.0)),
        "tiers": tiers,
        "total": {
            "hits": _n(hits), "misses": _n(misses), "hit_rate": _ratio(hits, (hits or 0) + (misses or 0)),
            "used_bytes": _n(total.get("used_bytes")), "capacity_bytes": _n(total.get("capacity_bytes")),
            "chunks_stored": _n(total.get("chunks_stored")), "chunks_deduped": _n(total.get("chunks_deduped")),
            "chunks_rejected": _n(total.get("chunks_rejected")), "errors": _n(total.get("errors")),
            "put_calls": _n(total.get("put_calls")), "get_calls": _n(total.get("get_calls")),
            "lookup_calls": _n(total.get("lookup_calls")), "in_flight": _n(total.get("in_flight")),
        },
        "write_behind": {
            "pending": _n(total.get("write_behind_pending")),
            "queued": _n(total.get("write_behind_queued")),
            "persisted": _n(total.get("persisted")),
            "not_durable": _n(total.get("write_behind_not_durable")),
            "dropped": _n(total.get("write_behind_dropped")),
            "dropped_by_reason": {r: _n(n) for r, n in dropped.items() if n},
        },
    }
    shown = {*doc["total"], "write_behind_pending", "write_behind_queued", "persisted", "write_behind_dropped",
             "write_behind_not_durable"}
    doc["total"]["figures"] = {k: _n(x) for k, x in total.items() if k not in shown}  # every other store figure
    if snap.get("tenants"):  # (per tenant: its figures summed over the tiers, and per tier)
        doc["tenants"] = [{"tenant": label,
                           "used_bytes": _n(sum(d.get("used_bytes", 0.0) for d in per_tier.values())),
                           "hits": _n(sum(d.get("hits", 0.0) for d in per_tier.values())),
                           "tiers": {tier: {k: _n(v) for k, v in d.items()} for tier, d in per_tier.items()}}
                          for label, per_tier in snap["tenants"].items()]
    extras = extras or {}
    if extras.get("sources"):
        doc["sources"] = extras["sources"]
    if extras.get("connector"):
        doc["connector"] = {k: (_n(v) if not isinstance(v, dict) else {t: _n(n) for t, n in v.items()})
                            for k, v in extras["connector"].items()}
    return doc


def unreachable(target: str, where: str, why: str, **more: Any) -> dict[str, Any]:
    """The report of a target that did not answer."""
    return {"target": target, **more, "reachable": False, "healthy": False,
            "problems": [f"cannot reach {where}: {why}"], "warnings": []}


def read_store(target: str, timeout: float = 3.0) -> dict[str, Any]:
    """Scrape ``target`` (see ``endpoint_url``) and describe the store behind it.

    A JSON answer (the exporter's ``/status``) is read as a ``status_document``; anything else as Prometheus
    text.  An endpoint that answers without tierkv's store figures is reported unhealthy, saying so."""
    url = endpoint_url(target)
    timeout = check_timeout(timeout)
    try:
        status, ctype, body = http_get(url, timeout)
    except Unreachable as e:
        return unreachable("store", url, str(e), url=url)
    if "json" in ctype:
        try:
            doc = json.loads(body)
            snap = doc["snapshot"]
            if not isinstance(snap, dict):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            return _not_ours(url, "answered with JSON that is not tierkv's /status")
        return describe_store(snap, url)
    if status != 200:
        return _not_ours(url, f"answered HTTP {status}")
    try:
        snap, extras = snapshot_from_text(body)
    except ValueError:
        return _not_ours(url, "answered with text that is not Prometheus metrics")
    if snap is None:
        if (extras.get("connector")):
            return _not_ours(url, "carries the tierkv connector's metrics but no store figures yet (each worker "
                                  "sends its store's once the engine has stepped)")
        return _not_ours(url, "answered, but carries no tierkv metrics (the store's exporter, or a vLLM server "
                              "running TierKVConnector, has them)")
    return describe_store(snap, url, extras)


def _not_ours(url: str, why: str) -> dict[str, Any]:
    return {"target": "store", "url": url, "reachable": True, "healthy": False, "problems": [f"{url} {why}"],
            "warnings": []}


# -- a pool: its mooncake_master ---------------------------------------------------------------------------
#: the master's gauges a report shows: metric -> report field
MASTER_GAUGES = {
    "master_total_capacity_bytes": "capacity_bytes",
    "master_allocated_bytes": "used_bytes",
    "master_key_count": "keys",
    "master_soft_pin_key_count": "soft_pinned_keys",
    "master_active_clients": "clients",
}
#: the master's counters a report shows: metric (without _total) -> report field
MASTER_COUNTERS = {
    "master_successful_evictions": "evictions",
    "master_evicted_key_count": "evicted_keys",
    "master_put_start_alloc_failures": "put_no_space",
    "master_batch_put_start_failed_items": "batch_put_failed_items",
}
#: other storage the master may manage (shown when it has capacity)
MASTER_OTHER_STORAGE = {
    "nvme_of_ssd": ("master_nof_allocated_bytes", "master_total_nof_capacity_bytes"),
    "file": ("master_allocated_file_size_bytes", "master_total_file_capacity_bytes"),
}


def read_master(master: str, metrics_port: int = DEFAULT_MASTER_METRICS_PORT, timeout: float = 3.0) -> dict[str, Any]:
    """A ``mooncake_master``'s report: its RPC port (``master``, HOST:PORT) and its HTTP endpoint on
    ``metrics_port`` (``/health``, ``/metrics``) on the same host."""
    host, rpc_port, metrics_port = master_target(master, metrics_port)
    timeout = check_timeout(timeout)
    base = f"http://{host}:{metrics_port}" if ":" not in host else f"http://[{host}]:{metrics_port}"
    doc: dict[str, Any] = {"target": "pool", "master": f"{host}:{rpc_port}", "http": base, "reachable": False,
                           "healthy": False, "problems": [], "warnings": []}
    ok, rtt, why = tcp_answers(host, rpc_port, timeout)
    doc["rpc"] = {"answered": ok, "connect_ms": round(rtt, 3) if rtt is not None else None}
    if not ok:
        doc["problems"].append(f"cannot reach the master's RPC port {host}:{rpc_port}: {why}")
    try:
        status, _, body = http_get(f"{base}/metrics", timeout)
    except Unreachable as e:
        doc["problems"].append(f"cannot reach the master's HTTP endpoint {base}/metrics (its --metrics_port, given "
                               f"by --metrics-port): {e}")
        return doc
    if status != 200 or "master_total_capacity_bytes" not in body:
        doc["problems"].append(f"{base}/metrics answered, but not with a mooncake_master's metrics "
                               "(is --metrics-port the master's --metrics_port?)")
        return doc
    doc["reachable"] = ok
    gauges, counters, segments = _master_figures(body)
    for metric, f in MASTER_GAUGES.items():
        doc[f] = _n(gauges.get(metric))
    doc["used_ratio"] = _ratio(gauges.get("master_allocated_bytes"), gauges.get("master_total_capacity_bytes"))
    doc["segments"] = [{"name": name, "capacity_bytes": _n(seg.get("capacity")), "used_bytes": _n(seg.get("used"))}
                       for name, seg in sorted(segments.items())]
    other = {kind: {"used_bytes": _n(gauges.get(u)), "capacity_bytes": _n(gauges.get(c))}
             for kind, (u, c) in MASTER_OTHER_STORAGE.items() if gauges.get(c)}
    if other:
        doc["other_storage"] = other
    doc["counters"] = {f: _n(counters.get(metric)) for metric, f in MASTER_COUNTERS.items()}
    doc["failed_requests"] = {name[len("master_"):-len("_failures")]: _n(n) for name, n in counters.items()
                              if name.startswith("master_") and name.endswith("_failures") and n}
    doc["health"] = _master_health(base, timeout)
    h = doc["health"]
    if h is not None and (h.get("status") != "ok" or h.get("service_ready") is False):
        doc["problems"].append(f"the master says it is not serving: status {h.get('status')!r}, "
                               f"service_ready {h.get('service_ready')!r}")
    if not gauges.get("master_total_capacity_bytes"):
        doc["problems"].append("no memory is mounted: the pool holds nothing and refuses every put (start a "
                               "standalone pool, 'tierkv pool start', or an engine that contributes a segment)")
    if counters.get("master_put_start_alloc_failures"):
        doc["warnings"].append(f"the pool was full for {counters['master_put_start_alloc_failures']:.0f} puts "
                               "(no space to allocate)")
    if doc["failed_requests"]:
        doc["warnings"].append("failed requests: " + ", ".join(f"{op} {n}" for op, n in doc["failed_requests"].items()))
    doc["healthy"] = not doc["problems"]
    return doc


def _master_figures(text: str) -> tuple[dict[str, float], dict[str, float], dict[str, dict[str, float]]]:
    gauges: dict[str, float] = {}
    counters: dict[str, float] = {}
    segments: dict[str, dict[str, float]] = defaultdict(dict)
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError:
        return gauges, counters, segments
    for fam in families:
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue
            if fam.name in ("segment_total_capacity_bytes", "segment_allocated_bytes") and "segment" in s.labels:
                key = "capacity" if fam.name == "segment_total_capacity_bytes" else "used"
                segments[s.labels["segment"]][key] = s.value
            elif fam.type == "counter" and s.name == fam.name + "_total":
                counters[fam.name] = s.value
            elif not s.labels and s.name == fam.name:
                (counters if fam.name.endswith("_total") else gauges)[fam.name] = s.value
    return gauges, counters, segments


def _master_health(base: str, timeout: float) -> Optional[dict[str, Any]]:
    """The master's ``/health`` JSON (status, role, service_ready), or None where it has none."""
    try:
        status, _, body = http_get(f"{base}/health", timeout)
        doc = json.loads(body) if status in (200, 503) else None
    except (Unreachable, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


# -- ping ----------------------------------------------------------------------------------------------------
_TIERKV_LINE = re.compile(r"^tierkv_", re.MULTILINE)


def ping_store(target: str, timeout: float = 3.0) -> dict[str, Any]:
    """Did the endpoint answer with a tierkv store's figures? ``{"answered", "url", "ms", "why"}``."""
    url = endpoint_url(target)
    timeout = check_timeout(timeout)
    t0 = time.perf_counter()
    try:
        status, ctype, body = http_get(url, timeout)
    except Unreachable as e:
        return {"target": "store", "url": url, "answered": False, "ms": None, "why": str(e)}
    ms = round((time.perf_counter() - t0) * 1e3, 3)
    ours = ("json" in ctype and '"snapshot"' in body) or (status == 200 and _TIERKV_LINE.search(body) is not None)
    why = "" if ours else (f"answered HTTP {status}, without tierkv's metrics" if status == 200 or "json" in ctype
                           else f"answered HTTP {status}")
    return {"target": "store", "url": url, "answered": ours, "ms": ms, "why": why}


def ping_master(master: str, metrics_port: int = DEFAULT_MASTER_METRICS_PORT, timeout: float = 3.0) -> dict[str, Any]:
    """Did the master answer, on its RPC port and on its HTTP endpoint (``/health``, else ``/metrics``)?"""
    host, rpc_port, metrics_port = master_target(master, metrics_port)
    timeout = check_timeout(timeout)
    ok, rtt, why = tcp_answers(host, rpc_port, timeout)
    out: dict[str, Any] = {"target": "pool", "master": f"{host}:{rpc_port}", "answered": False,
                           "ms": round(rtt, 3) if rtt is not None else None, "why": ""}
    if not ok:
        out["why"] = f"the RPC port {host}:{rpc_port}: {why}"
        return out
    base = f"http://{host}:{metrics_port}" if ":" not in host else f"http://[{host}]:{metrics_port}"
    try:
        status, _, body = http_get(f"{base}/metrics", timeout)
    except Unreachable as e:
        out["why"] = f"the RPC port answered, the HTTP endpoint {base} did not: {e} (give --metrics-port)"
        return out
    if status != 200 or "master_total_capacity_bytes" not in body:
        out["why"] = f"{base}/metrics answered, but not with a mooncake_master's metrics (give --metrics-port)"
        return out
    out["answered"] = True
    return out
