"""Helpers for the ``sglang`` tests: SGLang runs in its own venv (``.venv-sglang``, built by tests/run.sh).

* :data:`SGLANG_MISSING`: why the ``sglang`` tests cannot run here (None when they can); the conftest skips
  the marked tests with it.
* :func:`run_in_sglang`: a script in the SGLang venv, with the CPU patches (``tests/sglang_cpu``) on its path.
* :func:`make_tiny_model`: a random-weight Llama written by the SGLang venv's transformers (no download).
* :class:`SGLangServer`: a real ``sglang.launch_server`` on loopback with HiCache and a storage backend,
  stopped (its whole process group) when the ``with`` block ends, failures included.
"""

from __future__ import annotations

import json
import os
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

from netutil import HOST, free_port
from procgroup import stop_group, wait_healthy

ROOT = Path(__file__).resolve().parent.parent
SGLANG_PY = ROOT / ".venv-sglang" / "bin" / "python"
CPU_PATCHES = ROOT / "tests" / "sglang_cpu"
RESULT_PREFIX = "TIERKV-RESULT "

SGLANG_MISSING = None if SGLANG_PY.exists() else (
    "the SGLang venv is absent (.venv-sglang: bash tests/run.sh builds it, or bash tests/sglang_cpu/build_venv.sh)")

#: the extra-config that selects tierkv (``docs/sglang.md``); ``"tierkv"`` (the store config) is added per test
TIERKV_BACKEND = {"backend_name": "tierkv", "module_path": "tierkv.adapters.sglang", "class_name": "TierKVStorage",
                  "interface_v1": 1}


def sglang_env(**extra: str) -> dict[str, str]:
    """The environment of an SGLang process here: the CPU patches first on the path, SGLang's CPU engine."""
    env = dict(os.environ)
    for k in ("PYTHONHOME", "VIRTUAL_ENV"):
        env.pop(k, None)
    env.update({
        "PYTHONPATH": str(CPU_PATCHES),
        "SGLANG_USE_CPU_ENGINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONHASHSEED": "0",
        "GLOG_minloglevel": "2",
        "MC_LOG_LEVEL": "ERROR",
        "MC_TCP_BIND_ADDRESS": "127.0.0.1",
    })
    env.update(extra)
    return env


def run_in_sglang(args: list[str], timeout: float = 600, **env: str) -> dict[str, Any]:
    """Run ``python ARGS`` in the SGLang venv; its ``TIERKV-RESULT`` JSON line (raises with its output if none)."""
    proc = subprocess.run([str(SGLANG_PY), *args], env=sglang_env(**env), capture_output=True, text=True,
                          timeout=timeout, cwd=str(ROOT))
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    raise RuntimeError(f"SGLang-venv script failed (rc={proc.returncode})\n--- stdout ---\n{proc.stdout[-4000:]}"
                       f"\n--- stderr ---\n{proc.stderr[-8000:]}")


def make_tiny_model(path: str | os.PathLike, layers: int = 2, hidden: int = 128, heads: int = 2,
                    kv_heads: int = 2, vocab: int = 1024) -> str:
    """A random-weight Llama at ``path`` (idempotent), written by the SGLang venv (its transformers)."""
    path = Path(path)
    if not (path / "config.json").exists():
        code = ("import sys; sys.path.insert(0, 'tests'); from vllm_util import make_tiny_model; "
                f"make_tiny_model({str(path)!r}, layers={layers}, hidden={hidden}, heads={heads}, "
                f"kv_heads={kv_heads}, vocab={vocab}); print({RESULT_PREFIX!r} + '{{}}')")
        run_in_sglang(["-c", code], timeout=300)
    return str(path)


def prompt_ids(n: int, seed: int = 0, vocab: int = 1024) -> list[int]:
    """``n`` token ids of a fixed pseudo-random prompt (no tokenizer: the server skips its own)."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


class SGLangServer:
    """``sglang.launch_server`` on a tiny model, HiCache on, the given storage backend (see ``docs/sglang.md``).

    ``backend``: ``"dynamic"`` with ``extra_config`` (tierkv's), or a built-in name (``"file"``,
    ``"mooncake"``).  ``env``: extra environment (``SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE``...).
    """

    def __init__(self, model: str, log_path: str | os.PathLike, backend: str | None = "dynamic",
                 extra_config: dict[str, Any] | None = None, env: dict[str, str] | None = None,
                 max_total_tokens: int = 2048, page_size: int = 16, startup_timeout: float = 300) -> None:
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.log_path = Path(log_path)
        args = [str(SGLANG_PY), "-m", "sglang.launch_server", "--model-path", model, "--host", HOST,
                "--port", str(self.port), "--device", "cpu", "--dtype", "bfloat16", "--skip-tokenizer-init",
                "--attention-backend", "torch_native", "--sampling-backend", "pytorch", "--disable-cuda-graph",
                "--max-total-tokens", str(max_total_tokens), "--page-size", str(page_size),
                "--enable-hierarchical-cache", "--hicache-ratio", "2", "--hicache-io-backend", "direct",
                "--hicache-mem-layout", "layer_first", "--hicache-storage-prefetch-policy", "wait_complete",
                "--enable-cache-report", "--random-seed", "0", "--log-level", "warning"]
        if backend is not None:
            args += ["--hicache-storage-backend", backend]
        if extra_config is not None:
            args += ["--hicache-storage-backend-extra-config", json.dumps(extra_config)]
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(args, env=sglang_env(**(env or {})), stdout=self._log, stderr=subprocess.STDOUT,
                                     cwd=str(ROOT), start_new_session=True)
        try:
            self._wait_ready(startup_timeout)
        except BaseException:
            self.close()
            raise

    def _wait_ready(self, timeout: float) -> None:
        wait_healthy(self.url + "/health", self.proc, timeout, "SGLang server", self.log, interval=1)

    def log(self, tail: int = 8000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-tail:]
        except OSError:
            return ""

    def post(self, path: str, body: dict[str, Any] | None = None, timeout: float = 300) -> Any:
        data = json.dumps(body or {}).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            text = r.read().decode()
        try:
            return json.loads(text)
        except ValueError:
            return text

    def generate(self, ids: list[int], max_new_tokens: int = 8) -> dict[str, Any]:
        """Greedy generation from token ids: ``output_ids`` and ``meta_info``."""
        return self.post("/generate", {"input_ids": ids, "sampling_params": {
            "max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}})

    def flush_cache(self) -> None:
        """Empty SGLang's device and host caches (storage keeps its pages)."""
        self.post("/flush_cache")

    def close(self) -> None:
        stop_group(self.proc, grace=30)  # the server, then its scheduler and detokenizer processes
        self._log.close()

    def __enter__(self) -> SGLangServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def storage_tokens(out: dict[str, Any]) -> int:
    """The prompt tokens SGLang says came from its storage backend (``cached_tokens_details``)."""
    details = (out.get("meta_info") or {}).get("cached_tokens_details") or {}
    return int(details.get("storage", 0) or 0)
