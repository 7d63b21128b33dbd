"""``tierkv describe``: what a running store holds (through its metrics endpoint), or a pool (through its master)."""

from __future__ import annotations

import argparse
from typing import Any

from ._common import EXIT_FAIL, EXIT_OK, CommandError, dump_json, fmt_bytes, note, table

HELP = "a running store (URL of its metrics endpoint) or a Mooncake pool (--master): contents, usage, health"
DESCRIPTION = """\
Describe a running deployment without writing code.

tierkv describe URL
    A store, through an endpoint that carries its metrics: the standalone exporter
    (tierkv.metrics.serve: http://HOST:PORT/metrics, or /status) or a vLLM
    server running TierKVConnector (its /metrics).  URL may be HOST:PORT (then
    /metrics is read).  Shows each tier (used / capacity, entries, hit rate, share
    of the store's hits, evictions, errors, the medium's faults), the store's
    totals, the write-behind backlog and the health.

tierkv describe --master HOST:PORT [--metrics-port P]
    A Mooncake pool, through its mooncake_master: whether its RPC port and its HTTP
    endpoint (the master's --metrics_port, default 9003) answer, and the pool as the
    master counts it: capacity, used bytes, keys, clients, segments, evictions,
    failed requests.  ('tierkv inspect --master' lists tierkv's own objects.)

Healthy: the endpoint answered with its figures and reports no problem.  A store is
unhealthy when it is closed, a tier reports itself unavailable, or acknowledged
chunks are not durable now in their persistent tier; a pool when its master does not answer, says it
is not serving, or has no memory mounted.  Errors that cost only a miss are warnings.
Exit 0 healthy, 1 unhealthy or unreachable (one line on stderr says why), 2 bad input."""


def add_parser(sub) -> None:
    p = sub.add_parser("describe", help=HELP, description=DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_target_options(p)
    p.add_argument("--json", action="store_true",
                   help="the report as one JSON document on stdout, nothing else (the verdict goes to stderr)")
    p.set_defaults(func=run)


def add_target_options(p: argparse.ArgumentParser) -> None:
    """URL | --master HOST:PORT [--metrics-port P], and --timeout: what ``describe`` and ``ping`` share."""
    p.add_argument("url", nargs="?", metavar="URL",
                   help="a store's metrics endpoint: HOST:PORT, http://HOST:PORT/metrics or .../status")
    p.add_argument("--master", metavar="HOST:PORT", help="a mooncake_master's RPC address (a pool) instead of URL")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="the master's HTTP port (its --metrics_port; default 9003)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for each answer (default 3)")


def pick_target(args: argparse.Namespace) -> str:
    """``"store"`` or ``"pool"``; a missing or doubled target is a ``CommandError``."""
    if args.url and args.master:
        raise CommandError("give either URL (a store) or --master HOST:PORT (a pool), not both")
    if args.master:
        return "pool"
    if args.metrics_port is not None:
        raise CommandError("--metrics-port goes with --master HOST:PORT (a pool)")
    if not args.url:
        raise CommandError("give a store's metrics endpoint (URL, e.g. 127.0.0.1:9400) or --master HOST:PORT")
    return "store"


def run(args: argparse.Namespace) -> int:
    from tierkv.tools import live

    if pick_target(args) == "pool":
        doc = live.read_master(args.master, args.metrics_port if args.metrics_port is not None
                               else live.DEFAULT_MASTER_METRICS_PORT, args.timeout)
    else:
        doc = live.read_store(args.url, args.timeout)
    if args.json:
        dump_json(doc)
    elif doc.get("reachable") or (doc["target"] == "pool" and doc.get("rpc", {}).get("answered")):
        print(render(doc), end="")
    if not doc["healthy"]:
        note("describe", "unhealthy: " + "; ".join(doc["problems"]))
        return EXIT_FAIL
    return EXIT_OK


# -- text ----------------------------------------------------------------------------------------------------
def render(doc: dict[str, Any]) -> str:
    """The report as text (``--json`` prints ``doc`` itself)."""
    lines: list[str] = []
    (_render_pool if doc["target"] == "pool" else _render_store)(doc, lines)
    if doc["healthy"]:
        lines.append("health: ok" + (f" ({len(doc['warnings'])} warnings)" if doc["warnings"] else ""))
    else:
        lines.append("health: UNHEALTHY")
        lines += [f"  problem: {p}" for p in doc["problems"]]
    lines += [f"  warning: {w}" for w in doc["warnings"]]
    return "\n".join(lines) + "\n"


def _pct(r: Any) -> str:
    return "-" if r is None else f"{100 * r:.1f}%"


def _num(v: Any) -> str:
    return "-" if v is None else str(v)


def _table(rows: list[list[Any]], header: list[str]) -> list[str]:
    import io

    buf = io.StringIO()
    table(rows, header, out=buf)
    return buf.getvalue().splitlines()


def _render_store(doc: dict[str, Any], lines: list[str]) -> None:
    tiers = doc.get("tiers")
    if tiers is None:  # an endpoint without store figures
        lines.append(f"store at {doc['url']}: no store figures")
        return
    t = doc["total"]
    src = doc.get("sources") or []
    lines.append(f"store at {doc['url']}" + ("" if doc["open"] else "  (closed)")
                 + (f"  ({len(src)} engines: figures combined)" if len(src) > 1 else ""))
    lines.append(f"tiers: {len(tiers)}  used: {fmt_bytes(t['used_bytes'])} of {fmt_bytes(t['capacity_bytes'])}  "
                 f"hit rate: {_pct(t['hit_rate'])} ({_num(t['hits'])} hits, {_num(t['misses'])} misses)  "
                 f"errors: {_num(t['errors'])}")
    rows = []
    for r in tiers:
        faults = ", ".join(f"{k} {n}" for k, n in r["medium_errors"].items() if n)
        rows.append([r["name"] + ("" if r["medium"] in (None, r["name"]) else f" ({r['medium']})"),
                     "yes" if r["available"] else "NO", fmt_bytes(r["used_bytes"]), fmt_bytes(r["capacity_bytes"]),
                     _pct(r["used_ratio"]), _num(r["entries"]), _num(r["hits"]), _pct(r["hit_rate"]),
                     _pct(r["share_of_hits"]), _num(r["evictions"]), _num(r["errors"]), faults or "-"])
    lines += _table(rows, ["tier", "available", "used", "capacity", "full", "entries", "hits", "hit rate",
                           "of hits", "evictions", "errors", "medium faults"])
    for r in tiers:
        if r.get("last_error"):
            lines.append(f"{r['name']}: last error: {r['last_error']}")
    lines.append(f"chunks: {_num(t['chunks_stored'])} stored, {_num(t['chunks_deduped'])} deduped, "
                 f"{_num(t['chunks_rejected'])} rejected  calls: put {_num(t['put_calls'])}, get "
                 f"{_num(t['get_calls'])}, lookup {_num(t['lookup_calls'])}  in flight: {_num(t['in_flight'])}")
    wb = doc["write_behind"]
    reasons = ", ".join(f"{r} {n}" for r, n in wb["dropped_by_reason"].items())
    lines.append(f"write-behind: {_num(wb['pending'])} pending, {_num(wb['queued'])} queued, {_num(wb['persisted'])} "
                 f"persisted, {_num(wb.get('not_durable'))} not durable now, {_num(wb['dropped'])} dropped ever"
                 + (f" ({reasons})" if reasons else ""))
    if doc.get("tenants"):
        lines += _table([[r["tenant"], fmt_bytes(r["used_bytes"]), _num(r["hits"]),
                          ", ".join(f"{tier} {fmt_bytes(d.get('used_bytes'))}" for tier, d in r["tiers"].items())]
                         for r in doc["tenants"]], ["tenant", "used", "hits", "used per tier"])
    conn = doc.get("connector")
    if conn:
        hit = conn.get("hit_tokens") or {}
        lines.append(f"connector: {_num(conn.get('loaded_tokens'))} tokens loaded, {_num(conn.get('saved_blocks'))} "
                     f"blocks saved, {_num(conn.get('load_errors'))} load errors, {_num(conn.get('save_errors'))} "
                     "save errors" + (("  hit tokens: " + ", ".join(f"{k} {v}" for k, v in hit.items())) if hit else ""))
        declined, probes = conn.get("declined_slow") or {}, conn.get("decline_probes") or {}
        slow = sorted(t for t in {*declined, *probes} if declined.get(t) or probes.get(t))
        if slow:  # hits a slow tier did not serve (they were computed), and its probes
            tokens = conn.get("declined_slow_tokens") or {}
            lines.append("declined (tier slower than computing): " + ", ".join(
                f"{t} {_num(declined.get(t, 0))} hits ({_num(tokens.get(t, 0))} tokens), {_num(probes.get(t, 0))} "
                "probes" for t in slow))


def _render_pool(doc: dict[str, Any], lines: list[str]) -> None:
    rpc = doc.get("rpc") or {}
    lines.append(f"mooncake master {doc['master']}  rpc: " + (f"answered in {rpc['connect_ms']:.1f} ms"
                                                            if rpc.get("answered") else "NO ANSWER")
                 + f"  http: {doc['http']}")
    if "capacity_bytes" not in doc:
        return
    h = doc.get("health") or {}
    if h:
        lines.append(f"master: {h.get('status')}, role {h.get('role')}, service ready: {h.get('service_ready')}")
    lines.append(f"pool: {fmt_bytes(doc['used_bytes'])} used of {fmt_bytes(doc['capacity_bytes'])} "
                 f"({_pct(doc['used_ratio'])})  keys: {_num(doc['keys'])}  clients: {_num(doc['clients'])}  "
                 f"segments: {len(doc['segments'])}")
    if doc["segments"]:
        lines += _table([[s["name"], fmt_bytes(s["used_bytes"]), fmt_bytes(s["capacity_bytes"])]
                         for s in doc["segments"]], ["segment", "used", "capacity"])
    for kind, d in (doc.get("other_storage") or {}).items():
        lines.append(f"{kind}: {fmt_bytes(d['used_bytes'])} used of {fmt_bytes(d['capacity_bytes'])}")
    c = doc["counters"]
    lines.append(f"evictions: {_num(c['evictions'])} ({_num(c['evicted_keys'])} keys)  puts refused for no space: "
                 f"{_num(c['put_no_space'])}")
