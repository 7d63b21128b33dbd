"""Helpers for the vLLM connector tests and benchmark.

* :func:`make_tiny_model` writes a random-weight Llama (no download).
* :class:`OpenAIServer` / :func:`openai_server`: vLLM's OpenAI server (``vllm.entrypoints.openai.api_server``) on a
  free loopback port, in a process group of its own, stopped (SIGTERM, then SIGKILL) by whoever started it;
  its output goes to a log file that failure messages quote.
* Run as a script, this module starts one in-process vLLM engine, plays a list
  of steps from a JSON spec and prints one JSON line of results, so each engine
  lives in its own process (true cross-process tests, and memory is returned).

    python tests/vllm_util.py SPEC.json
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from netutil import HOST, free_port
from procgroup import kill_group, stop_group, wait_healthy

RESULT_PREFIX = "TIERKV-RESULT "


def save_random_model(path: str | os.PathLike, config_cls: str, model_cls: str, dtype: str = "float32",
                      seed: int = 0, **config: Any) -> str:
    """Save a random-weight ``transformers`` model to ``path`` (idempotent: a folder with a config.json is taken as
    written) and return the path: ``config_cls(**config)`` (class names in ``transformers``) drawn with ``seed``.

    Wide weights (``initializer_range=0.2``) spread the logits, so greedy decoding has no near-ties; the
    embeddings are not tied; the weights are saved in ``dtype``.
    """
    path = Path(path)
    if (path / "config.json").exists():
        return str(path)
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = getattr(transformers, config_cls)(**config, initializer_range=0.2, tie_word_embeddings=False,
                                            torch_dtype=dtype)
    model = getattr(transformers, model_cls)(cfg).to(getattr(torch, dtype))
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path), safe_serialization=True)
    return str(path)


def make_tiny_model(path: str | os.PathLike, layers: int = 4, hidden: int = 128, heads: int = 2,
                    kv_heads: int = 2, vocab: int = 1024, intermediate: int | None = None,
                    max_positions: int = 8192, seed: int = 0) -> str:
    """Save a random-weight Llama to ``path`` (idempotent) and return the path."""
    return save_random_model(path, "LlamaConfig", "LlamaForCausalLM", seed=seed, vocab_size=vocab,
                             hidden_size=hidden, intermediate_size=intermediate or hidden * 2,
                             num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                             head_dim=hidden // heads, max_position_embeddings=max_positions)


#: the two-tier store most engine tests put under the connector: an ``hbm`` tier on the CPU, then LRU ``dram``
HOST_STORE: dict[str, Any] = {
    "tiers": [
        {"medium": "hbm", "device": "cpu", "capacity": "64MiB"},
        {"medium": "dram", "capacity": "128MiB", "eviction": "lru"},
    ]
}


def full_block_prefix(n_tokens: int, block_size: int = 32) -> int:
    """The tokens of an ``n_tokens`` prompt that a prefix cache can serve: its whole blocks, the last token
    excluded (the engine always computes that one)."""
    return (n_tokens - 1) // block_size * block_size


def engine_fixtures(name: str, layers: int = 4) -> tuple[Any, Any]:
    """Module-scoped pytest fixtures of a test module that runs engines: ``workdir``, a temporary folder named
    after ``name`` that the module's tests share, and ``model``, a tiny Llama of ``layers`` layers in it.

        workdir, model = U.engine_fixtures("vllm-async")
    """
    import pytest  # (this module also runs as the engine process's script, where pytest has no business)

    @pytest.fixture(scope="module")
    def workdir(tmp_path_factory):
        return tmp_path_factory.mktemp(name)

    @pytest.fixture(scope="module")
    def model(workdir):
        return make_tiny_model(workdir / "model", layers=layers)

    return workdir, model


def engine_env(cache_root: str | os.PathLike) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_CACHE_ROOT": str(cache_root),
            "VLLM_LOGGING_LEVEL": env.get("VLLM_LOGGING_LEVEL", "WARNING"),
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONHASHSEED": "0",
        }
    )
    return env


def start_engine(spec: dict[str, Any], cache_root: str | os.PathLike, stdin=None,
                 stderr=subprocess.PIPE) -> subprocess.Popen:
    """Start this module on ``spec`` in a new process; finish with :func:`engine_result`.

    ``spec["env"]`` adds environment variables (e.g. ``VLLM_ENABLE_V1_MULTIPROCESSING=1``
    for vLLM's default layout: scheduler and worker in processes of their own).
    """
    spec_path = Path(cache_root) / f"spec-{os.getpid()}-{time.monotonic_ns()}.json"
    spec_path.parent.mkdir(parents=True, exist_ok=True)
    spec_path.write_text(json.dumps(spec))
    return subprocess.Popen(
        [sys.executable, __file__, str(spec_path)],
        env={**engine_env(cache_root), **{k: str(v) for k, v in (spec.get("env") or {}).items()}},
        stdin=stdin,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        start_new_session=True,  # its own process group: engine-core/worker children go with it
    )


def engine_result(proc: subprocess.Popen, timeout: float = 300) -> dict[str, Any]:
    """Wait for an engine process and return its JSON result (raises with its output on failure)."""
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        stdout, stderr = proc.communicate()
        raise RuntimeError(f"engine process timed out\n{stdout[-4000:]}\n{stderr[-8000:]}") from None
    kill_group(proc)  # leftovers of a crashed engine, if any
    for line in stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    raise RuntimeError(
        f"engine process failed (rc={proc.returncode})\n--- stdout ---\n{stdout[-4000:]}"
        f"\n--- stderr ---\n{stderr[-8000:]}"
    )


def run_engine(spec: dict[str, Any], cache_root: str | os.PathLike, timeout: float = 300) -> dict[str, Any]:
    """Run this module on ``spec`` in a new process and return its JSON result."""
    return engine_result(start_engine(spec, cache_root), timeout)


class EngineServer:
    """An engine process that plays steps one at a time (``spec["steps"] = "stdin"``).

    Several can stay up side by side and take turns, so a benchmark compares back
    ends under the same machine conditions, round by round.
    """

    def __init__(self, spec: dict[str, Any], cache_root: str | os.PathLike, timeout: float = 600):
        self._timeout = timeout
        Path(cache_root).mkdir(parents=True, exist_ok=True)
        # its log goes to a file: a pipe nobody reads would stall a long-lived engine
        self._log = open(Path(cache_root) / f"engine-{os.getpid()}-{time.monotonic_ns()}.log", "w+")
        self.proc = start_engine({**spec, "steps": "stdin"}, cache_root, stdin=subprocess.PIPE, stderr=self._log)
        self._stdin = self.proc.stdin
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        ready = self._read()
        self.startup_s = ready.get("startup_s")

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _read(self) -> dict[str, Any]:
        deadline = time.monotonic() + self._timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.close()
                raise RuntimeError("engine server did not answer in time") from None
            if line is None:
                self._log.seek(0)
                err = self._log.read()
                self.close()
                raise RuntimeError(f"engine server exited (rc={self.proc.poll()})\n{err[-8000:]}")
            if line.startswith(RESULT_PREFIX):
                return json.loads(line[len(RESULT_PREFIX):])

    def step(self, step: dict[str, Any]) -> dict[str, Any]:
        self._stdin.write(json.dumps(step) + "\n")
        self._stdin.flush()
        return self._read()

    def close(self) -> None:
        try:
            self._stdin.write(json.dumps({"op": "quit"}) + "\n")
            self._stdin.flush()
            self.proc.wait(timeout=60)
        except Exception:
            pass
        kill_group(self.proc)
        self._log.close()


def engine_args(block_size: int = 32, kv_cache_bytes: int = 64 << 20, max_model_len: int = 1024) -> list[str]:
    """The OpenAI server's flags for a tiny test engine: no tokenizer (prompts are token ids), eager, float32,
    a KV cache of ``kv_cache_bytes``."""
    return ["--skip-tokenizer-init", "--enforce-eager", "--block-size", str(block_size),
            "--kv-cache-memory-bytes", str(kv_cache_bytes), "--dtype", "float32", "--max-model-len", str(max_model_len)]


class OpenAIServer:
    """One ``python -m vllm.entrypoints.openai.api_server`` for ``model`` on a free loopback port.

    It runs in a process group of its own (the engine core is a child): :meth:`stop` ends the whole group.
    Its stderr, and its stdout unless ``pipe_stdout``, go to ``log_path``; with ``pipe_stdout`` the stdout
    is a pipe a thread of this object reads into :attr:`lines` (it reaches its end only once every process
    holding it is gone: :meth:`output_closed`).  The object that starts it owns it: call :meth:`stop` on
    every path (:func:`openai_server` does).
    """

    def __init__(self, model: str, args: Sequence[str], env: dict[str, str], log_path: str | os.PathLike, *,
                 pipe_stdout: bool = False, cpus: set[int] | None = None) -> None:
        """``args``: the server's flags besides model, host and port; ``env``: its whole environment;
        ``cpus``: the cores it (and every process it starts) may run on, None for this process's."""
        self.model = model
        self.port = free_port()
        self.log_path = Path(log_path)
        self.lines: list[str] = []
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", HOST,
               "--port", str(self.port), *args]
        with open(self.log_path, "w") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE if pipe_stdout else log,
                stderr=log if pipe_stdout else subprocess.STDOUT, text=True, start_new_session=True,
                preexec_fn=None if cpus is None else lambda: os.sched_setaffinity(0, cpus))
        self.started = time.monotonic()
        self._reader: threading.Thread | None = None
        if pipe_stdout:
            self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
            self._reader.start()

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def wait_ready(self, timeout: float = 600) -> float:
        """Block until ``/health`` answers 200: the seconds since the start.  Raises with the log when the
        server exits first or is not up ``timeout`` s after its start."""
        return wait_healthy(self.base_url + "/health", self.proc, timeout, "the OpenAI server", self.log_tail,
                            started=self.started)

    def output(self) -> str:
        """All the server wrote so far: its piped stdout (if any), then the log file."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            text = ""
        return "".join(self.lines) + text

    def log_tail(self, n: int = 6000) -> str:
        return self.output()[-n:]

    def complete(self, prompt: list[int], max_tokens: int = 1, timeout: float = 300) -> dict[str, Any]:
        """A greedy ``/v1/completions`` of the token ids ``prompt``: the server's JSON answer."""
        body = json.dumps({"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                           "temperature": 0}).encode()
        req = urllib.request.Request(self.base_url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def text(self, path: str, timeout: float = 30) -> str:
        """The body of a GET of ``path`` (``"/metrics"``), decoded."""
        with urllib.request.urlopen(self.base_url + path, timeout=timeout) as r:
            return r.read().decode()

    def output_closed(self, timeout: float) -> bool:
        """With ``pipe_stdout``: whether the stdout pipe reached its end (no process holds it) within ``timeout``."""
        if self._reader is None:
            raise ValueError("output_closed needs a server started with pipe_stdout=True")
        self._reader.join(timeout)
        return not self._reader.is_alive()

    def stop(self, sig: int = signal.SIGTERM, grace: float = 60.0) -> None:
        """``sig`` to the server's group, ``grace`` s for it to exit, then SIGKILL to what is left of the group."""
        stop_group(self.proc, sig, grace)


@contextlib.contextmanager
def openai_server(model: str, args: Sequence[str], env: dict[str, str], log_path: str | os.PathLike, *,
                  startup_timeout: float = 600, pipe_stdout: bool = False) -> Iterator[OpenAIServer]:
    """An :class:`OpenAIServer`, healthy, for the ``with`` block; stopped (SIGTERM, then SIGKILL) when it ends,
    failures included."""
    server = OpenAIServer(model, args, env, log_path, pipe_stdout=pipe_stdout)
    try:
        server.wait_ready(startup_timeout)
        yield server
    finally:
        server.stop()


def connector_config(store: dict[str, Any] | str | None, name: str = "TierKVConnector",
                     extra: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """A kv_transfer_config for TierKVConnector over ``store`` (a dict, or a config file path)."""
    if name == "none":
        return None
    if name == "ExampleConnector":
        return {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": dict(extra or {})}
    ex = dict(extra or {})
    if isinstance(store, str):
        ex["tierkv_config_file"] = store
    elif store is not None:
        ex["tierkv"] = store
    return {
        "kv_connector": "TierKVConnector",
        "kv_connector_module_path": "tierkv.adapters.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": ex,
    }


# ------------------------------------------------------------------------ in the engine process
def _rank_records(_worker: Any = None, drain_timeout: float = 0.0) -> list:
    """This process's worker connectors: their records (after waiting for their saves, if asked).

    ``collective_rpc`` calls it in each worker process with that process's vLLM worker first.
    """
    workers = [c.worker for c in _connectors()[0]]
    if drain_timeout:
        for w in workers:
            w.wait_for_all_saves(drain_timeout)
    return _jsonable([
        {
            "tp_rank": w.tp_rank,
            "shard": [w.shard.shard, w.shard.num_shards, w.shard.replica, w.shard.replicas],
            "totals": w.totals.data,
            "layerwise": w.layerwise,
            "sync_loads": w.load_counts["sync"],
            "async_loads": w.load_counts["async"],
            "requests": dict(w.request_records),
            "load_trace": list(w.load_trace),
            "store": w.store.stats() if w.store is not None else None,
        }
        for w in workers
    ])


def _connectors():
    """This process's connectors with a worker side, and those with a scheduler side."""
    from tierkv.adapters.vllm import live_connectors

    workers = [c for c in live_connectors() if c.worker is not None]
    scheds = [c for c in live_connectors() if c.scheduler is not None]
    return workers, scheds


def _drain(llm, timeout: float = 60.0) -> None:
    """Step the engine until delayed block frees are done and the prefix cache can be reset."""
    workers, _ = _connectors()
    for w in workers:
        w.wait_for_all_saves(timeout)
    deadline = time.monotonic() + timeout
    engine = llm.llm_engine
    in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
    while time.monotonic() < deadline:
        if llm.reset_prefix_cache():
            return
        if in_process:
            engine.step()  # nobody else steps the engine
        else:
            time.sleep(0.05)  # the engine-core process steps on its own
    raise RuntimeError("prefix cache could not be reset")


class _LayerGate:
    """Store proxy: layer l+1's get may not finish before layer l's wait_for_layer_load returned.

    ``worker`` is a TierKVWorker.  A connector that loads layer by layer passes straight through; one that waits
    for all layers before letting layer 0 compute would stall here (and is
    recorded as such after ``timeout``).
    """

    def __init__(self, store, worker, timeout: float = 20.0):
        self._store = store
        self._worker = worker
        self._timeout = timeout
        self._job = None
        self._n = 0
        self.timeouts = 0
        self.gated = 0

    def __getattr__(self, name):
        return getattr(self._store, name)

    def get(self, keys, outs):
        job = self._worker.load_job
        if job is None and self._worker.layerwise:
            # the loader thread may reach its first gets before the engine thread has stored the job
            # it was handed (start_load_kv returns it): wait for that, or no layer would be gated
            deadline = time.monotonic() + self._timeout
            while job is None and time.monotonic() < deadline:
                time.sleep(0.0005)
                job = self._worker.load_job
        if job is not self._job:
            self._job, self._n = job, 0
        layer = self._n
        self._n += 1
        if job is not None and layer > 0:
            self.gated += 1
            deadline = time.monotonic() + self._timeout
            while job.wait_return[layer - 1] == 0.0:
                if time.monotonic() > deadline:
                    self.timeouts += 1
                    break
                time.sleep(0.0005)
        return self._store.get(keys, outs)


class _FaultyGets:
    """Store proxy whose gets fail: ``"raise"`` (the get raises, as a broken tier would) or
    ``"drop"`` (the chunks asked for are removed just before the get: gone since the lookup).
    A raising get first writes garbage into half of the destination blocks, so that a
    failure not reported to vLLM would change the outputs.

    Only the first ``limit`` gets are hit (all when None); ``threads`` records which threads ran
    them (the engine's, or the connector's background loader).
    """

    def __init__(self, store, mode: str, limit: int | None = None):
        self._store = store
        self._mode = mode
        self._limit = limit
        self.hit = 0
        self.threads: set[str] = set()

    def __getattr__(self, name):
        return getattr(self._store, name)

    def get(self, keys, outs):
        import torch

        self.threads.add(threading.current_thread().name)
        if self._limit is None or self.hit < self._limit:
            self.hit += 1
            if self._mode == "raise":
                # a read that wrote part of its bytes, then failed: garbage in the blocks
                for value in outs[: max(1, len(outs) // 2)]:
                    for t in [value] if isinstance(value, torch.Tensor) else value:  # a tensor or its parts
                        t.view(-1).view(torch.uint8).fill_(0x41)
                raise OSError("injected: the medium is down")
            # one layer's chunks of every object asked for: a partial miss
            self._store.remove(list(keys[: max(1, len(keys) // 2)]))
        return self._store.get(keys, outs)


class _SlowGets:
    """Store proxy whose gets on the connector's background loader start ``delay`` seconds late (a loader
    busy behind a slow medium): the step's saves land meanwhile, so a chunk a lookup found may be evicted
    before its load reads it.  Gets on other threads pass straight through."""

    def __init__(self, store, delay: float):
        self._store = store
        self._delay = delay
        self.slowed = 0

    def __getattr__(self, name):
        return getattr(self._store, name)

    def get(self, keys, outs):
        if threading.current_thread().name.startswith("tierkv-async-load"):
            self.slowed += 1
            time.sleep(self._delay)
        return self._store.get(keys, outs)


class _RecordingPuts:
    """Store proxy that records the keys and sizes of every ``put_detailed`` call, in order.

    The connector's save thread puts one layer of a save plan per call, layers in order, so
    call ``i`` of a single prompt saved in one step is layer ``i``, its keys in chunk order.
    """

    def __init__(self, store):
        self._store = store
        self.calls: list[list[tuple[str, int]]] = []

    def __getattr__(self, name):
        return getattr(self._store, name)

    def put_detailed(self, keys, values, tenant=None):
        from tierkv.buffers import to_parts

        self.calls.append([(k, to_parts(v)[1]) for k, v in zip(keys, values)])
        return self._store.put_detailed(keys, values, tenant)


def _plant(store, calls, step: dict[str, Any]) -> dict[str, Any]:
    """Store the bytes of one recorded key under another (same size) through the store's API: wrong
    content under a real key, with the checksum the put computes for it."""
    import torch

    key, size = calls[step["call"]][step["index"]]
    src, src_size = calls[step["from_call"]][step.get("from_index", step["index"])]
    if size != src_size:
        raise ValueError(f"cannot plant {src_size} bytes under a key of {size}")
    buf = torch.empty(size, dtype=torch.uint8)
    if not store.get([src], [buf])[0]:
        raise RuntimeError("the source chunk is not in the store")
    old = torch.empty(size, dtype=torch.uint8)
    store.get([key], [old])
    if torch.equal(old, buf):
        raise RuntimeError("the planted bytes equal the stored ones")
    store.remove([key])
    if not store.put([key], [buf])[0]:
        raise RuntimeError("the planted chunk was not stored")
    return {"key": key, "size": size}


def _corrupt_files(root: str, limit: int | None = None) -> int:
    """Flip bytes in the middle of the payload of stored objects under ``root`` (an ssd tier's directory).

    Walks the region files' records (64-byte aligned headers: magic, version, flags,
    key length, seq, raw and stored length) and damages each payload, leaving headers
    intact so only the payload checksum can tell; returns how many objects were hit.
    """
    import struct

    rec = struct.Struct("<4sBBHQIIQ")
    n = 0
    for dirpath, _, files in os.walk(root):
        for f in sorted(files):
            if not f.endswith(".region"):
                continue
            p = os.path.join(dirpath, f)
            with open(p, "r+b") as fh:
                data = fh.read()
                at = data.find(b"TKVO")
                while at >= 0:
                    if at % 64 == 0 and at + 64 <= len(data):
                        _, _, _, key_len, _, _, stored, _ = rec.unpack_from(data, at)
                        mid = at + 64 + key_len + stored // 2
                        if stored >= 32 and mid + 16 <= len(data):
                            fh.seek(mid)
                            fh.write(bytes(x ^ 0x5A for x in data[mid:mid + 16]))
                            n += 1
                            if limit is not None and n >= limit:
                                return n
                    at = data.find(b"TKVO", at + 4)
    return n


def _step(llm, step: dict[str, Any], state: dict[str, Any]) -> dict[str, Any]:
    """Play one step of a spec on the engine and return its result."""
    from vllm import SamplingParams

    op = step["op"]
    res: dict[str, Any] = {"op": op}
    if op == "generate":
        sp = SamplingParams(temperature=0.0, max_tokens=step.get("max_tokens", 8), ignore_eos=True)
        prompts = [{"prompt_token_ids": p} for p in step["prompts"]]
        for pr, salt in zip(prompts, step.get("salts") or []):
            if salt is not None:
                pr["cache_salt"] = salt
        sps: Any = sp
        if step.get("kv_transfer_params"):
            # a P/D proxy's part: each request's transfer parameters (do_remote_decode / do_remote_prefill)
            sps = [SamplingParams(temperature=0.0, max_tokens=step.get("max_tokens", 8), ignore_eos=True,
                                  extra_args={"kv_transfer_params": params} if params is not None else None)
                   for params in step["kv_transfer_params"]]
        if step.get("one_by_one"):
            outs = []
            for i, p in enumerate(prompts):
                outs.extend(llm.generate([p], sps[i] if isinstance(sps, list) else sps, use_tqdm=False))
        else:
            outs = llm.generate(prompts, sps, use_tqdm=False)
        res["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
        res["num_cached_tokens"] = [o.num_cached_tokens for o in outs]
        res["kv_transfer_params"] = [getattr(o, "kv_transfer_params", None) for o in outs]
    elif op == "ttft":
        # time to first token of each prompt on its own (max_tokens=1)
        sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        times, toks, cached, blocked = [], [], [], []
        for p in step["prompts"]:
            b0 = _LOAD_BLOCKED[0]
            t = time.perf_counter()
            o = llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0]
            times.append(time.perf_counter() - t)
            blocked.append(_LOAD_BLOCKED[0] - b0)
            toks.append(list(o.outputs[0].token_ids))
            cached.append(o.num_cached_tokens)
        res.update(times=times, tokens=toks, num_cached_tokens=cached, load_blocked=blocked)
    elif op == "reset":
        _drain(llm)
    elif op == "drain":
        if state.get("ranks_elsewhere"):
            llm.collective_rpc(_rank_records, args=(60.0,))
        else:
            _rank_records(drain_timeout=60.0)
    elif op == "kv_groups":
        res.update(_kv_groups(llm))
    elif op == "corrupt":
        res["corrupted"] = _corrupt_files(step["path"], step.get("limit"))
    elif op == "fault_gets":
        workers, _ = _connectors()
        w = workers[0].worker
        state["faults"] = _FaultyGets(w.store, step["mode"], step.get("limit"))
        w.store = state["faults"]
    elif op == "record_puts":
        workers, _ = _connectors()
        w = workers[0].worker
        state["puts"] = _RecordingPuts(w.store)
        w.store = state["puts"]
    elif op == "plant":
        workers, _ = _connectors()
        res.update(_plant(workers[0].worker.store, state["puts"].calls, step))
        state.setdefault("planted", []).append(res["key"])
    elif op == "contains":
        workers, _ = _connectors()
        res["contains"] = workers[0].worker.store.contains(step.get("keys") or state.get("planted") or [])
    elif op == "slow_gets":
        workers, _ = _connectors()
        w = workers[0].worker
        state["slow"] = _SlowGets(w.store, step["delay"])
        w.store = state["slow"]
    elif op == "gate_layers":
        workers, _ = _connectors()
        w = workers[0].worker
        state["gate"] = _LayerGate(w.store, w)
        w.store = state["gate"]
    elif op == "signal":
        Path(step["path"]).write_text("1")
    elif op == "wait_file":
        deadline = time.monotonic() + step.get("timeout", 300)
        while not os.path.exists(step["path"]):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{step['path']} did not appear")
            time.sleep(0.05)
    elif op == "records":
        _, scheds = _connectors()
        gate = state["gate"]
        if gate is not None:
            res["gate"] = {"timeouts": gate.timeouts, "gated": gate.gated}
        slow = state.get("slow")
        if slow is not None:
            res["slowed"] = slow.slowed
        faults = state.get("faults")
        if faults is not None:
            res["faults"] = {"hit": faults.hit, "threads": sorted(faults.threads)}
        # snapshots: the connector keeps updating its own dicts after this step
        if state.get("ranks_elsewhere"):  # tensor-parallel ranks in worker processes: ask each of them
            res["workers"] = [r for rank in llm.collective_rpc(_rank_records) for r in rank]
        else:
            res["workers"] = _rank_records()
        res["scheduler"] = _jsonable([dataclasses.asdict(s.scheduler.totals) for s in scheds])
        res["transfers"] = {k: list(v) for k, v in _TRANSFERS.items()}
        from tierkv.adapters.vllm import live_connectors

        # connectors that serve nothing, and why (a model whose KV cache groups they cannot serve)
        res["idle"] = [c.idle_reason for c in live_connectors() if getattr(c, "idle_reason", None)]
        # what each connector's key root names the model by (the weights' digest, or model_id)
        res["weights"] = [getattr(c, "weights_identity", None) for c in live_connectors()]
    else:
        raise ValueError(f"unknown op {op!r}")
    return res


def _kv_groups(llm) -> dict[str, Any]:
    """The engine's KV cache groups (in-process engine only): each group's spec kind, layers and sizes."""
    core = llm.llm_engine.engine_core.engine_core
    cfg = core.scheduler.kv_cache_config
    groups = []
    for g in cfg.kv_cache_groups:
        spec = g.kv_cache_spec
        groups.append({
            "kind": type(spec).__name__,
            "layers": list(g.layer_names),
            "block_size": spec.block_size,
            "sliding_window": getattr(spec, "sliding_window", None),
            "page_size_bytes": spec.page_size_bytes,
        })
    cache = llm.llm_engine.vllm_config.cache_config
    pool = core.scheduler.kv_cache_manager.block_pool
    return {"groups": groups, "num_blocks": cfg.num_blocks, "block_size": cache.block_size,
            "hash_block_size": getattr(pool, "hash_block_size", None),
            "mamba_cache_mode": cache.mamba_cache_mode}


#: seconds the engine's thread has spent inside a connector's load hooks (start_load_kv and
#: wait_for_layer_load): what loading costs the forward, whatever the connector
_LOAD_BLOCKED = [0.0]


def _time_loads(name: str) -> None:
    """Count the time the engine spends in the connector's load hooks (``ttft`` reports it per prompt)."""
    if name == "TierKVConnector":
        from tierkv.adapters.vllm.connector import TierKVConnector as cls
    elif name == "ExampleConnector":
        from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector as cls
    elif name == "MooncakeStoreConnector":
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.connector import (
            MooncakeStoreConnector as cls,
        )
    else:
        return

    def timed(fn):
        def run(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                _LOAD_BLOCKED[0] += time.perf_counter() - t
        return run

    for hook in ("start_load_kv", "wait_for_layer_load"):
        setattr(cls, hook, timed(getattr(cls, hook)))


_TRANSFERS: dict[str, list[str]] = {"sent": [], "received": [], "failed": []}


def _count_transfers() -> None:
    """Record the requests whose KV vLLM's NixlConnector finished sending and receiving (``records`` reports them)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlConnector

    inner = NixlConnector.get_transfer_results

    def get_transfer_results(self, finished_req_ids):
        results = inner(self, finished_req_ids)
        _TRANSFERS["sent"].extend(sorted(results.finished_sending))
        _TRANSFERS["received"].extend(sorted(results.finished_recving))
        _TRANSFERS["failed"].extend(sorted(results.failed_recving))
        return results

    NixlConnector.get_transfer_results = get_transfer_results


def _main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kv = spec.get("kv_transfer_config")
    if kv and spec.get("time_loads"):
        _time_loads(kv["kv_connector"])
    if kv and "NixlConnector" in json.dumps(kv):
        _count_transfers()
    kwargs = {
        "model": spec["model"],
        "skip_tokenizer_init": True,
        "enforce_eager": True,
        "block_size": spec.get("block_size", 32),
        "kv_cache_memory_bytes": spec.get("kv_cache_memory_bytes", 64 << 20),
        "dtype": spec.get("dtype", "float32"),
        "seed": 0,
        "enable_prefix_caching": spec.get("enable_prefix_caching", True),
        "max_model_len": spec.get("max_model_len", 2048),
        "max_num_batched_tokens": spec.get("max_num_batched_tokens", 8192),
    }
    if "max_num_seqs" in spec:
        kwargs["max_num_seqs"] = spec["max_num_seqs"]
    state: dict[str, Any] = {"gate": None}
    if spec.get("tensor_parallel_size", 1) > 1:
        # ranks run in worker processes; "records" and "drain" reach them through collective_rpc
        kwargs["tensor_parallel_size"] = spec["tensor_parallel_size"]
        kwargs["distributed_executor_backend"] = "mp"
        state["ranks_elsewhere"] = True
    if kv is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(**kv)
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    out: dict[str, Any] = {"startup_s": time.perf_counter() - t0, "steps": []}
    if spec["steps"] == "stdin":
        # served one step at a time: a JSON step per input line, a result line per step
        print(RESULT_PREFIX + json.dumps({"ready": True, "startup_s": out["startup_s"]}), flush=True)
        for line in sys.stdin:
            if not line.strip():
                continue
            step = json.loads(line)
            if step.get("op") == "quit":
                break
            print(RESULT_PREFIX + json.dumps(_step(llm, step, state), default=str), flush=True)
    else:
        for step in spec["steps"]:
            out["steps"].append(_step(llm, step, state))
    workers, _ = _connectors()
    for w in workers:
        w.wait_for_all_saves(60)
    print(RESULT_PREFIX + json.dumps(out, default=str), flush=True)
    # release the store (flush to disk) before the interpreter goes
    workers, scheds = _connectors()
    for c in workers + scheds:
        c.shutdown()
    sys.stdout.flush()
    # stop engine-core / worker processes (they would hold our output pipes open)
    try:
        llm.llm_engine.engine_core.shutdown(timeout=30)
    except Exception as e:
        print(f"engine shutdown: {e}", file=sys.stderr)
    os._exit(0)


def _jsonable(x):
    return json.loads(json.dumps(x, default=str))


if __name__ == "__main__":
    _main(sys.argv[1])
