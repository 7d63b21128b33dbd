"""Capturing request traces from live traffic: hash-only, in Mooncake's JSONL format, rotating files.

A ``TraceWriter`` appends one JSON line per request::

    {"timestamp": 1532, "input_length": 4096, "output_length": 128, "hash_ids": [...], "block_tokens": 256,
     "block_bytes": 2097152}

``block_bytes`` — the bytes of one block's KV — is written once the writer knows
it (given, or learnt by ``StoreTracer`` from the store's puts): ``tierkv
simulate`` then prices blocks at their real size instead of assuming a model.

``timestamp`` is milliseconds since the writer started; ``hash_ids`` are 63-bit
keyed digests (BLAKE2b, ``salt``) of the engine's block hashes or the store's
keys: equal prefixes give equal ids, but no token id — nor the engine's own
hash — leaves the process.  Writers with the same ``salt`` give comparable ids
(e.g. the workers of one deployment).  ``tierkv simulate`` reads the files.

Rotation: the current file is ``path``; when it passes ``max_bytes`` it becomes
``path.1`` (``path.1`` becomes ``path.2`` …) and at most ``max_files`` files are
kept (the oldest is deleted).  Every file starts with a header line
``{"format": "tierkv-trace", "version": 1, "block_tokens": ..., "started_unix_ms": ...}``.

A failure to write (disk full, directory gone) disables the writer and is
logged once: tracing never fails a request.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Any, Optional, TextIO, Union, cast

from tierkv.errors import ConfigError
from tierkv.options import check_int, check_str
from tierkv.units import parse_size

log = logging.getLogger("tierkv.trace")

DEFAULT_SALT = b"tierkv-trace/v1"
HEADER_FORMAT = "tierkv-trace"

HashLike = Union[bytes, str, int]


class TraceWriter:
    """Thread-safe writer of hash-only request records (see the module docstring)."""

    def __init__(self, path: str, max_bytes: Union[int, str] = 64 << 20, max_files: int = 8,
                 block_tokens: int = 256, salt: Optional[Union[bytes, str]] = None,
                 block_bytes: Optional[Union[int, str]] = None) -> None:
        self.path = os.path.abspath(os.path.expanduser(check_str(path, "trace path")))
        self.max_bytes = parse_size(max_bytes, "trace max_bytes")
        self.max_files = check_int(max_files, "trace max_files", min_value=1)
        self.block_tokens = check_int(block_tokens, "trace block_tokens", min_value=1)
        #: bytes of one block's KV, written into each record once known (None: not yet)
        self.block_bytes = None if block_bytes is None else parse_size(block_bytes, "trace block_bytes")
        salt = DEFAULT_SALT if salt is None else salt
        self._key = (salt.encode() if isinstance(salt, str) else bytes(salt))[:64]
        self._lock = threading.Lock()
        self._t0 = time.monotonic()
        self._started_ms = int(time.time() * 1000)
        self._f: Optional[TextIO] = None
        self._size = 0
        self.records = 0
        self.rotations = 0
        self.failed: Optional[str] = None
        parent = os.path.dirname(self.path)
        try:
            os.makedirs(parent, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"trace path {self.path}: cannot create {parent}: {e}") from e
        self._open()

    @classmethod
    def from_options(cls, path: str, options: Optional[dict[str, Any]] = None) -> "TraceWriter":
        """From a config's ``trace_path`` and its ``trace`` options (max_bytes, max_files, block_tokens,
        block_bytes, salt)."""
        opts = dict(options or {})
        unknown = set(opts) - {"max_bytes", "max_files", "block_tokens", "block_bytes", "salt"}
        if unknown:
            raise ConfigError(f"trace: unknown option(s) {sorted(unknown)}; known: block_bytes, block_tokens, "
                              "max_bytes, max_files, salt")
        return cls(path, **opts)

    # -- ids ---------------------------------------------------------------------
    def hash_id(self, h: HashLike) -> int:
        """A 63-bit keyed digest of one block hash (or store key)."""
        if isinstance(h, str):
            b = h.encode()
        elif isinstance(h, int):
            b = h.to_bytes(max(1, (h.bit_length() + 8) // 8), "little", signed=True)
        else:
            b = bytes(h)
        return int.from_bytes(hashlib.blake2b(b, digest_size=8, key=self._key).digest(), "little") >> 1

    # -- writing -------------------------------------------------------------------
    def record(self, hashes: Sequence[HashLike], input_length: Optional[int] = None, output_length: int = 0,
               block_tokens: Optional[int] = None, block_bytes: Optional[int] = None, **extra: Any) -> None:
        """Append one request: its block hashes in prompt order; lengths in tokens; a block's KV bytes."""
        bt = block_tokens or self.block_tokens
        bb = block_bytes or self.block_bytes
        ids = [self.hash_id(h) for h in hashes]
        rec = {"timestamp": int((time.monotonic() - self._t0) * 1000),
               "input_length": int(input_length if input_length is not None else len(ids) * bt),
               "output_length": int(output_length), "hash_ids": ids, "block_tokens": bt, **extra}
        if bb:
            rec["block_bytes"] = int(bb)
        line = json.dumps(rec, separators=(",", ":")) + "\n"
        with self._lock:
            if self._f is None:
                return
            try:
                if self._size + len(line) > self.max_bytes and self._size > self._header_len:
                    self._rotate()
                self._f.write(line)
                self._size += len(line)
                self.records += 1
            except (OSError, ValueError) as e:  # ValueError: the file was closed under us
                self._fail(e)

    def _open(self) -> None:
        head: dict[str, Any] = {"format": HEADER_FORMAT, "version": 1, "block_tokens": self.block_tokens,
                                "started_unix_ms": self._started_ms}
        if self.block_bytes:
            head["block_bytes"] = self.block_bytes
        header = json.dumps(head) + "\n"
        try:
            self._f = open(self.path, "a", encoding="utf-8", buffering=1 << 16)  # noqa: SIM115 - the handle outlives this block on purpose
            self._size = self._f.tell()
            if self._size == 0:
                self._f.write(header)
                self._size = len(header)
        except OSError as e:
            raise ConfigError(f"trace path {self.path}: cannot open: {e}") from e
        self._header_len = len(header)

    def _rotate(self) -> None:
        cast(TextIO, self._f).close()  # (open: the caller checked)
        self._f = None
        for i in range(self.max_files - 1, 0, -1):
            src = self.path if i == 1 else f"{self.path}.{i - 1}"
            if os.path.exists(src):
                os.replace(src, f"{self.path}.{i}")
        if self.max_files == 1:
            os.unlink(self.path)
        stale = f"{self.path}.{self.max_files}"
        if os.path.exists(stale):
            os.unlink(stale)
        self.rotations += 1
        self._open()

    def _fail(self, e: Exception) -> None:
        self.failed = str(e)
        log.warning("tierkv: trace %s disabled after a write error: %s", self.path, e)
        try:
            if self._f is not None:
                self._f.close()
        except OSError:
            pass
        self._f = None

    def files(self) -> list[str]:
        """The trace's files, oldest first."""
        out = [f"{self.path}.{i}" for i in range(self.max_files, 0, -1) if os.path.exists(f"{self.path}.{i}")]
        return out + ([self.path] if os.path.exists(self.path) else [])

    def flush(self) -> None:
        with self._lock:
            if self._f is not None:
                try:
                    self._f.flush()
                except OSError as e:
                    self._fail(e)

    def close(self) -> None:
        with self._lock:
            if self._f is not None:
                try:
                    self._f.close()
                except OSError:
                    pass
                self._f = None

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class StoreTracer:
    """Store observer: each ``lookup`` is one request whose keys are its blocks (``trace_path`` in a store config).

    A block's size is learnt from the store's puts (the largest chunk of the latest put: a prompt's last
    chunk may be partial) unless the writer was given one.
    """

    def __init__(self, writer: TraceWriter) -> None:
        self.writer = writer
        self._learn = writer.block_bytes is None

    def observe(self, op: str, keys: list[str], result: Any, seconds: float, sizes: Any) -> None:
        if op == "lookup" and keys:
            self.writer.record(keys)
        elif op == "put" and sizes and self._learn:
            self.writer.block_bytes = max(sizes)

    def close(self) -> None:
        self.writer.close()
