"""Pieces of the real-serving benchmark (``bench/bench_serve.py``) that own processes and files.

* :func:`make_word_tokenizer` saves a WordLevel tokenizer (fixed-width words over a
  64-character alphabet, written back to back) beside a model, so the OpenAI server
  and vLLM's benchmark datasets have a tokenizer without a download.  Decoding
  concatenates words and encoding cuts the text every ``width`` characters, so every
  token sequence survives a round trip
  (the ``prefix_repetition`` dataset relies on that for exact prompt lengths).
* :class:`ApiServer` is one ``python -m vllm.entrypoints.openai.api_server``
  process in a process group of its own (``tests/vllm_util.py``'s :class:`OpenAIServer`,
  named, pinned to cores if asked); :meth:`ApiServer.stop` sends SIGINT,
  then SIGKILL to the whole group after a grace period, so the engine-core child
  never outlives it.
* :class:`MooncakePool` is a loopback ``mooncake_master`` (and, in standalone
  mode, a ``mooncake_client`` that owns the pool) plus the JSON file that
  vLLM's ``MooncakeStoreConnector`` reads from ``MOONCAKE_CONFIG_PATH``.

Every process started here is stopped by its owner's ``stop()`` (the benchmark
calls them in ``finally``); logs go to files, never to pipes nobody reads.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

# tests/ helpers: loopback ports, process groups, the OpenAI server, the master binary
import mooncake_util
from netutil import HOST, free_port, wait_port
from procgroup import stop_group
from vllm_util import OpenAIServer

#: word characters: 64 of them, so 4096 ids are two-character words.  The server caps a
#: prompt's characters at (longest token's length) x (context length), so words are
#: written back to back, without separators, each exactly ``width`` characters
_ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-"


def word(i: int, width: int) -> str:
    """Token ``i`` as a ``width``-character word."""
    out = []
    for _ in range(width):
        i, r = divmod(i, len(_ALPHABET))
        out.append(_ALPHABET[r])
    return "".join(out)


def make_word_tokenizer(model_dir: str | os.PathLike, vocab: int) -> None:
    """Save a fixed-width WordLevel tokenizer of ``vocab`` words into ``model_dir`` (idempotent).

    No special tokens: the dataset draws ids uniformly from ``0..vocab-1`` and every
    id must decode to a plain word that encodes back to itself.  (Word 0 doubles as the
    unknown token, which no benchmark prompt ever produces.)
    """
    model_dir = Path(model_dir)
    if (model_dir / "tokenizer.json").exists():
        return
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    width = 1
    while len(_ALPHABET) ** width < vocab:
        width += 1
    words = {word(i, width): i for i in range(vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token=word(0, width)))
    # split the text into width-character pieces, and decode by concatenation
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("." * width), behavior="isolated")
    tok.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False).save_pretrained(str(model_dir))


class ApiServer(OpenAIServer):
    """One vLLM OpenAI server on a free loopback port, named for its back end, its log ``server-NAME.log``."""

    def __init__(self, name: str, model: str, args: list[str], env: dict[str, str], log_dir: Path,
                 cpus: set[int] | None = None) -> None:
        """``cpus``: the cores the server (and every process it starts) may run on; None: this process's."""
        self.name = name
        super().__init__(model, args, env, log_dir / f"server-{name}.log", cpus=cpus)

    def wait_ready(self, timeout: float = 600) -> float:
        """Block until ``/health`` answers 200; returns the seconds it took.  Raises with the log tail."""
        try:
            return super().wait_ready(timeout)
        except RuntimeError as e:
            raise RuntimeError(f"server {self.name}: {e}") from None

    def engine_pids(self) -> list[int]:
        """The server's pid and its descendants' (the engine core runs in a child process)."""
        pids, frontier = [self.proc.pid], [self.proc.pid]
        while frontier:
            p = frontier.pop()
            try:
                kids = Path(f"/proc/{p}/task/{p}/children").read_text().split()
            except OSError:
                continue
            for k in kids:
                pids.append(int(k))
                frontier.append(int(k))
        return pids

    def stop(self, sig: int = signal.SIGINT, grace: float = 30.0) -> None:
        super().stop(sig, grace)


class MooncakePool:
    """A loopback Mooncake pool for ``MooncakeStoreConnector``.

    ``mode="embedded"``: the engine contributes ``segment`` bytes itself.
    ``mode="standalone"``: a ``mooncake_client`` process owns the pool; the engine
    contributes none (vLLM's ``standalone-store`` mode).
    """

    def __init__(self, work: Path, mode: str = "embedded", segment: str = "1GB",
                 local_buffer: str = "512MB") -> None:
        if mode not in ("embedded", "standalone"):
            raise ValueError(f"mooncake mode must be embedded or standalone, got {mode!r}")
        self.mode = mode
        self.segment = segment
        self.work = work
        self.master = mooncake_util.MooncakeMaster().start()
        self.client: subprocess.Popen | None = None
        try:
            if mode == "standalone":
                self._start_client()
            cfg: dict[str, Any] = {
                "metadata_server": self.master.metadata_server,
                "master_server_address": self.master.master,
                "protocol": "tcp",
                "device_name": "",
                "mode": "embedded" if mode == "embedded" else "standalone-store",
                "global_segment_size": segment if mode == "embedded" else 0,
                "local_buffer_size": local_buffer,
            }
            self.config_path = work / f"mooncake-{mode}.json"
            self.config_path.write_text(json.dumps(cfg, indent=1))
        except BaseException:
            self.stop()
            raise

    def _start_client(self) -> None:
        binary = Path(self.master.binary).with_name("mooncake_client")
        if not binary.exists():
            raise RuntimeError(f"mooncake_client not found beside {self.master.binary}")
        port = free_port()
        env = dict(os.environ, **mooncake_util.client_env())
        with open(self.work / "mooncake_client.log", "w") as log:
            self.client = subprocess.Popen(
                [str(binary), f"--master_server_address={self.master.master}",
                 f"--metadata_server={self.master.metadata_server}", f"--global_segment_size={self.segment}",
                 "--local_buffer_size=0", f"--host={HOST}", f"--port={port}", "--protocol=tcp"],
                env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)
        if not wait_port(port, 30):
            raise RuntimeError("mooncake_client did not open its port")
        time.sleep(1.5)  # its segment is mounted about a second after the port opens

    def env(self) -> dict[str, str]:
        return {"MOONCAKE_CONFIG_PATH": str(self.config_path), **mooncake_util.client_env()}

    def stop(self) -> None:
        if self.client is not None:
            stop_group(self.client, signal.SIGTERM, 5)
            self.client = None
        self.master.stop()
