"""tierkv as the storage tier of a real SGLang server (SGLang 0.5.23 on this CPU, in .venv-sglang).

A tiny random-weight Llama built here; a prompt well past SGLang's ``prefetch_threshold`` (256 tokens) is
computed, its pages reach tierkv (seen through the store's own ``/status``: a handshake, not a sleep), SGLang's
device and host caches are flushed (``/flush_cache``) and the prompt is sent again: SGLang says how many of its
tokens came from storage (``meta_info.cached_tokens_details``) and the output must be the first run's.
Server starts are few (each 30-60 s here): one for the SSD run, one for its restart, one with SGLang's failure
injector, two on a shared Mooncake pool.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest
from netutil import free_port
from sglang_util import TIERKV_BACKEND, SGLangServer, make_tiny_model, prompt_ids, storage_tokens

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

PROMPT_TOKENS = 768
PAGE = 16
PROMPT = prompt_ids(PROMPT_TOKENS)
#: SGLang stores full pages of the prompt (the last token is computed, not loaded): 47 of 16 tokens here
PAGES = (PROMPT_TOKENS - 1) // PAGE


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("sglang-model") / "tiny-llama")


def status(port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=10) as r:
        return json.loads(r.read())["snapshot"]


def wait_status(port: int, done: Callable[[dict[str, Any]], bool], what: str, timeout: float = 180) -> dict[str, Any]:
    """Poll the store's ``/status`` (in the server's scheduler process) until ``done`` holds."""
    deadline = time.monotonic() + timeout
    snap: dict[str, Any] = {}
    while time.monotonic() < deadline:
        try:
            snap = status(port)
        except OSError:
            snap = {}
        if snap and done(snap):
            return snap
        time.sleep(0.5)  # (polling the store's own report of what it holds)
    raise AssertionError(f"the store never showed {what}: {json.dumps(snap.get('total', {}))[:2000]}")


def stored(snap: dict[str, Any]) -> float:
    t = snap["total"]
    return t.get("chunks_stored", 0) + t.get("chunks_deduped", 0)


def backend_config(store: dict[str, Any], metrics_port: int) -> dict[str, Any]:
    return {**TIERKV_BACKEND, "tierkv": store, "metrics_port": metrics_port, "model_id": "tiny-llama-test"}


def ssd_store(path: str) -> dict[str, Any]:
    return {"tiers": [{"medium": "dram", "capacity": "64MiB", "eviction": "lru"},
                      {"medium": "ssd", "path": path, "capacity": "256MiB"}]}


def compute_flush_again(server: SGLangServer, port: int, ssd: bool = False) -> dict[str, Any]:
    """The prompt, its pages stored, SGLang's caches flushed, the prompt again."""
    first = server.generate(PROMPT)
    server.generate(prompt_ids(40, seed=1))
    wait_status(port, lambda s: stored(s) >= PAGES and (not ssd or (
        s["tiers"]["ssd"]["values"].get("objects", 0) >= PAGES and s["total"].get("write_behind_pending", 0) == 0)),
        f"the prompt's {PAGES} pages stored")
    server.flush_cache()
    second = server.generate(PROMPT)
    return {"first": first, "second": second}


@pytest.fixture(scope="module")
def ssd_run(tmp_path_factory, model):
    d = tmp_path_factory.mktemp("sglang-ssd")
    store = {**ssd_store(str(d / "ssd")), "trace_path": str(d / "trace.jsonl")}
    port = free_port()
    with SGLangServer(model, d / "server1.log", extra_config=backend_config(store, port)) as s:
        out = compute_flush_again(s, port, ssd=True)
        out["status"] = status(port)
        # the operator's view of an SGLang-hosted store: the same command as for vLLM's
        out["describe"] = subprocess.run([sys.executable, "-m", "tierkv", "describe", f"http://127.0.0.1:{port}/metrics"],
                                         capture_output=True, text=True, timeout=60)
        out["ping"] = subprocess.run([sys.executable, "-m", "tierkv", "ping", f"127.0.0.1:{port}"],
                                     capture_output=True, text=True, timeout=60)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
            out["metrics"] = r.read().decode()
    # the store's hash-only trace, written by the store inside SGLang's process and closed with it
    out["trace"] = subprocess.run([sys.executable, "-m", "tierkv", "trace", "show", "--json", store["trace_path"]],
                                  capture_output=True, text=True, timeout=60)
    out.update(store=store, dir=d, model=model)
    return out


def test_prompt_served_from_tierkv_after_flush(ssd_run):
    first, second = ssd_run["first"], ssd_run["second"]
    assert storage_tokens(first) == 0
    details = second["meta_info"].get("cached_tokens_details")
    assert storage_tokens(second) >= 0.9 * PROMPT_TOKENS, details
    assert details.get("storage_backend") == "TierKVStorage", details
    assert second["output_ids"] == first["output_ids"]
    assert ssd_run["status"]["total"]["hits"] >= storage_tokens(second) // PAGE


def test_tierkv_describe_reads_the_sglang_hosted_store(ssd_run):
    d = ssd_run["describe"]
    assert d.returncode == 0, d.stdout + d.stderr
    assert "ssd" in d.stdout and "dram" in d.stdout, d.stdout


def test_tierkv_ping_metrics_and_trace_work_for_the_sglang_hosted_store(ssd_run):
    p = ssd_run["ping"]
    assert p.returncode == 0, p.stdout + p.stderr
    # the same metric families as a vLLM-hosted store's, counting this run's hits
    hits = [line for line in ssd_run["metrics"].splitlines()
            if line.startswith("tierkv_hits_total") and not line.endswith(" 0.0")]
    assert hits, ssd_run["metrics"][:2000]
    t = ssd_run["trace"]
    assert t.returncode == 0, t.stdout + t.stderr
    summary = json.loads(t.stdout)
    assert summary["requests"] > 0 and summary["blocks"] > 0, summary


def test_restart_on_the_same_ssd_serves_the_prompt(ssd_run):
    port = free_port()
    with SGLangServer(ssd_run["model"], ssd_run["dir"] / "server2.log",
                      extra_config=backend_config(ssd_run["store"], port)) as s:
        again = s.generate(PROMPT)
        snap = status(port)
    assert storage_tokens(again) >= 0.9 * PROMPT_TOKENS, again["meta_info"].get("cached_tokens_details")
    assert again["output_ids"] == ssd_run["first"]["output_ids"]
    assert snap["tiers"]["ssd"]["values"].get("hits", 0) >= PAGES * 0.9


def test_failure_injection_keeps_outputs_identical(ssd_run, tmp_path):
    """SGLang's own injector fails half of the backend's calls: every output stays the uncached run's."""
    port = free_port()
    store = {"tiers": [{"medium": "dram", "capacity": "64MiB", "eviction": "lru"}]}
    want = ssd_run["first"]["output_ids"]
    outs = []
    with SGLangServer(ssd_run["model"], tmp_path / "server-faults.log", extra_config=backend_config(store, port),
                      env={"SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE": "0.5"}) as s:
        for _ in range(3):
            outs.append(s.generate(PROMPT))
            s.generate(prompt_ids(40, seed=1))
            s.flush_cache()
        log = s.log(200_000)
    assert "pages failed" in log  # (SGLang's own report of the injected failures: the injector was on)
    assert [o["output_ids"] for o in outs] == [want] * 3


def test_two_servers_share_a_mooncake_pool(ssd_run, tmp_path):
    """A prompt computed on one server is served from the pool on another (a standalone Mooncake pool)."""
    from mooncake_util import MooncakeMaster

    with MooncakeMaster() as m, m.standalone_pool("256MiB") as pool:
        store = {"tiers": [pool.tier_config()]}
        pa, pb = free_port(), free_port()
        with SGLangServer(ssd_run["model"], tmp_path / "server-a.log", extra_config=backend_config(store, pa)) as a:
            first = a.generate(PROMPT)
            wait_status(pa, lambda s: stored(s) >= PAGES, f"the prompt's {PAGES} pages in the pool")
            with SGLangServer(ssd_run["model"], tmp_path / "server-b.log",
                              extra_config=backend_config(store, pb)) as b:
                served = b.generate(PROMPT)
    assert storage_tokens(first) == 0
    assert storage_tokens(served) >= 0.9 * PROMPT_TOKENS, served["meta_info"].get("cached_tokens_details")
    assert served["output_ids"] == first["output_ids"] == ssd_run["first"]["output_ids"]
