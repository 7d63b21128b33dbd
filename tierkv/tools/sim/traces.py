"""Request traces: reading Mooncake, Qwen-Bailian and tierkv capture files.

A trace is a sequence of ``Request`` records, each a prompt described only by
the hash ids of its blocks (``hash_ids[i]`` names block ``i`` and, because the
ids are chained over the prefix, everything before it).  No token ids.

Formats (JSON lines, one request per line; ``.gz`` files are read as gzip):

``mooncake``  Mooncake's published traces: ``timestamp`` (ms), ``input_length``,
              ``output_length``, ``hash_ids`` of 512-token blocks.
``bailian``   The Qwen-Bailian traces: ``chat_id``, ``parent_chat_id``,
              ``timestamp`` (s), ``input_length``, ``output_length``, ``type``,
              ``turn``, ``hash_ids`` of 16-token blocks.
``tierkv``    tierkv's capture format (``tierkv.trace.TraceWriter``): Mooncake's
              fields plus ``block_tokens``; a first line ``{"format": "tierkv-trace",
              ...}`` may carry defaults for the file.

``read_trace`` detects the format from the first record unless told.
"""

from __future__ import annotations

import glob
import gzip
import io
import json
import math
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Optional, cast

from tierkv.errors import ConfigError

FORMATS = ("mooncake", "bailian", "tierkv")
#: tokens per hash id, by format
BLOCK_TOKENS = {"mooncake": 512, "bailian": 16, "tierkv": 512}
HEADER_FORMAT = "tierkv-trace"


@dataclass(slots=True)
class Request:
    """One request of a trace; ``timestamp`` in seconds from the trace's origin."""

    timestamp: float
    input_length: int
    output_length: int
    hash_ids: list[int]
    block_tokens: int
    session: Optional[str] = None
    extra: dict = field(default_factory=dict)
    #: bytes of one block's KV when the trace says (captures do); None: the reader must assume a model
    block_bytes: Optional[int] = None

    def to_mooncake(self) -> dict:
        """The record in Mooncake's JSONL shape (timestamp in ms), with tierkv's ``block_tokens``."""
        rec = {"timestamp": int(round(self.timestamp * 1000)), "input_length": self.input_length,
               "output_length": self.output_length, "hash_ids": self.hash_ids, "block_tokens": self.block_tokens}
        if self.block_bytes is not None:
            rec["block_bytes"] = self.block_bytes
        if self.session is not None:
            rec["session"] = self.session
        for k in MISS_FIELDS:  # (a capture's account of the request's misses, kept as read)
            if k in self.extra:
                rec[k] = self.extra[k]
        return rec

    @property
    def miss_reasons(self) -> Optional[dict[str, int]]:
        """Tokens the store did not serve at the request's lookup, by reason (None: the trace does not say)."""
        return self.extra.get("miss_reasons")


#: what a capture says of a request's misses (``adapters/vllm/trace_hook.py``), kept by the readers and writers
MISS_FIELDS = ("request_id", "miss_tokens", "miss_reasons")


def trace_files(path: str) -> list[str]:
    """The files of a trace: a file, a directory of rotated captures (oldest first), or a glob."""
    if os.path.isdir(path):
        files = sorted(f for f in glob.glob(os.path.join(path, "*")) if os.path.isfile(f)
                       and (f.endswith(".jsonl") or f.endswith(".jsonl.gz") or ".jsonl." in os.path.basename(f)))
        if not files:
            raise ConfigError(f"trace {path!r}: a directory with no trace files (*.jsonl, *.jsonl.gz, *.jsonl.N)")
        return sorted(files, key=_rotation_order)
    if any(c in path for c in "*?[") and not os.path.exists(path):
        files = [f for f in glob.glob(path) if os.path.isfile(f)]
        if not files:
            raise ConfigError(f"trace {path!r}: no file matches")
        return sorted(files, key=_rotation_order)
    if not os.path.exists(path):
        raise ConfigError(f"trace {path!r}: no such file or directory")
    return [path]


def _rotation_order(path: str) -> tuple:
    """Rotated captures are ``name.jsonl`` (newest) and ``name.jsonl.N`` (older as N grows)."""
    base = os.path.basename(path)
    stem, _, suffix = base.rpartition(".")
    if suffix.isdigit():
        return (stem, -int(suffix))
    return (base, 0)


GZIP_MAGIC = b"\x1f\x8b"
LFS_POINTER = "version https://git-lfs.github.com/spec/"


def _open(path: str) -> io.TextIOBase:
    """The file as text; a ``.gz`` that is not gzip, or an unreadable file, is a ``ConfigError``."""
    try:
        with open(path, "rb") as f:
            magic = f.read(2)
        if path.endswith(".gz"):
            if magic != GZIP_MAGIC:
                raise ConfigError(f"{path}: not a gzip file (the name ends in .gz)")
            return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
        return open(path, encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror or e}") from e


def _lines(fpath: str) -> Iterator[tuple[int, str]]:
    """(line number, stripped line) of a trace file; undecodable bytes and broken gzip are ``ConfigError``."""
    lineno = 0
    try:
        with _open(fpath) as f:
            for lineno, line in enumerate(f, 1):
                if lineno == 1 and line.startswith(LFS_POINTER):
                    raise ConfigError(f"{fpath}: a Git LFS pointer, not the trace itself (fetch the file: "
                                      "git lfs pull)")
                yield lineno, line.strip()
    except UnicodeDecodeError as e:
        raise ConfigError(f"{fpath}: not UTF-8 text (byte {e.object[e.start]:#04x}); "
                          "a trace is JSON lines, optionally gzip-compressed as a .gz file") from e
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise ConfigError(f"{fpath}: a broken gzip stream after line {lineno}: {e}") from e
    except OSError as e:
        raise ConfigError(f"{fpath}: cannot read: {e.strerror or e}") from e


def detect_format(rec: dict) -> str:
    if rec.get("format") == HEADER_FORMAT or "block_tokens" in rec:
        return "tierkv"
    if "chat_id" in rec or "parent_chat_id" in rec or "turn" in rec:
        return "bailian"
    if "hash_ids" in rec and "timestamp" in rec:
        return "mooncake"
    raise ConfigError(f"cannot tell the trace format from a record with keys {sorted(rec)[:8]}; "
                      f"pass --format ({', '.join(FORMATS)})")


def read_trace(path: str, fmt: Optional[str] = None, block_tokens: Optional[int] = None,
               limit: Optional[int] = None) -> Iterator[Request]:
    """Requests of a trace in file order.  ``block_tokens`` overrides the format's block size."""
    if fmt is not None and fmt not in FORMATS:
        raise ConfigError(f"unknown trace format {fmt!r}; known: {', '.join(FORMATS)}")
    if block_tokens is not None and (type(block_tokens) is not int or block_tokens < 1):
        raise ConfigError(f"block_tokens must be a positive integer, got {block_tokens!r}")
    n = 0
    for fpath in trace_files(path):
        file_fmt, file_bt, file_bb = fmt, block_tokens, None
        for lineno, line in _lines(fpath):
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{fpath}:{lineno}: not JSON: {e}") from e
            if not isinstance(rec, dict):
                raise ConfigError(f"{fpath}:{lineno}: expected a JSON object per line")
            try:
                if rec.get("format") == HEADER_FORMAT:
                    file_fmt = file_fmt or "tierkv"
                    if file_bt is None and rec.get("block_tokens") is not None:
                        file_bt = _positive(rec["block_tokens"], "block_tokens")
                    if rec.get("block_bytes") is not None:
                        file_bb = _positive(rec["block_bytes"], "block_bytes")
                    continue
                if file_fmt is None:
                    file_fmt = detect_format(rec)
                req = _parse(rec, file_fmt, file_bt, file_bb)
            except ConfigError as e:
                raise ConfigError(f"{fpath}:{lineno}: {e}") from e
            except (KeyError, TypeError, ValueError, OverflowError) as e:
                why = f"lacks {e}" if isinstance(e, KeyError) else str(e)
                raise ConfigError(f"{fpath}:{lineno}: bad {file_fmt} record: {why}") from e
            yield req
            n += 1
            if limit is not None and n >= limit:
                return


def _positive(v: object, what: str) -> int:
    if type(v) is not int or v < 1:
        raise ValueError(f"{what} must be a positive integer, got {v!r}")
    return v


def _count(v: object, what: str) -> int:
    """A token count: an integer (or an integral float, as some traces write), 0 or more."""
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if type(v) is not int or v < 0:
        raise ValueError(f"{what} must be an integer of 0 or more, got {v!r}")
    return v


def _timestamp(v: object) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"timestamp must be a finite number, got {v!r}")
    return float(v)


def _parse(rec: dict, fmt: str, block_tokens: Optional[int], block_bytes: Optional[int] = None) -> Request:
    hash_ids = rec["hash_ids"]
    if not isinstance(hash_ids, list) or not all(type(h) is int for h in hash_ids):
        raise ValueError("hash_ids must be a list of integers")
    input_length = _count(rec["input_length"], "input_length")
    output_length = _count(rec.get("output_length", 0), "output_length")
    if fmt == "bailian":
        session = rec.get("chat_id")
        extra = {k: rec[k] for k in ("parent_chat_id", "type", "turn") if k in rec}
        bt = block_tokens or BLOCK_TOKENS["bailian"]
        return Request(_timestamp(rec["timestamp"]), input_length, output_length, hash_ids, bt,
                       None if session is None else str(session), extra, block_bytes)
    if block_tokens is None and rec.get("block_tokens") is not None:
        bt = _positive(rec["block_tokens"], "block_tokens")
    else:
        bt = block_tokens or BLOCK_TOKENS[fmt]
    if rec.get("block_bytes") is not None:
        block_bytes = _positive(rec["block_bytes"], "block_bytes")
    session = rec.get("session")
    return Request(_timestamp(rec["timestamp"]) / 1000.0, input_length, output_length, hash_ids, bt,
                   None if session is None else str(session), _misses(rec), block_bytes=block_bytes)


def _misses(rec: dict) -> dict:
    """A capture's ``request_id``, ``miss_tokens`` and ``miss_reasons`` (reason -> tokens), checked."""
    out: dict = {}
    if rec.get("request_id") is not None:
        out["request_id"] = str(rec["request_id"])
    if rec.get("miss_tokens") is not None:
        out["miss_tokens"] = _count(rec["miss_tokens"], "miss_tokens")
    reasons = rec.get("miss_reasons")
    if reasons is not None:
        if not isinstance(reasons, dict):
            raise ValueError("miss_reasons must be a mapping of reason -> tokens")
        out["miss_reasons"] = {str(r): _count(n, f"miss_reasons[{r!r}]") for r, n in reasons.items()}
    return out


def write_trace(requests, path: str, header: Optional[dict] = None) -> int:
    """Write requests in tierkv's capture format (Mooncake's JSONL plus ``block_tokens``).  Returns the count."""
    n = 0
    with open_output(path) as f:
        if header is not None:
            f.write(json.dumps({"format": HEADER_FORMAT, **header}) + "\n")
        for r in requests:
            f.write(json.dumps(r.to_mooncake(), separators=(",", ":")) + "\n")
            n += 1
    return n


def open_output(path: str) -> io.TextIOBase:
    """A trace file to write (gzip when it ends in ``.gz``); a path that cannot be created is a ``ConfigError``."""
    try:
        if path.endswith(".gz"):
            return io.TextIOWrapper(gzip.open(path, "wb"), encoding="utf-8")
        return open(path, "w", encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"{path}: cannot write: {e.strerror or e}") from e


def summarize(requests) -> dict:
    """Counts of a trace: requests, blocks, distinct blocks, tokens, duration, sessions; with a capture that
    says why blocks missed, ``miss_tokens`` and ``miss_tokens_by_reason`` over every request."""
    n = blocks = tokens = out_tokens = 0
    missed: dict[str, int] = {}
    miss_tokens = 0
    explained = False
    distinct: set = set()
    sessions: set = set()
    t0 = t1 = None
    bts: set = set()
    for r in requests:
        n += 1
        blocks += len(r.hash_ids)
        distinct.update(r.hash_ids)
        tokens += r.input_length
        out_tokens += r.output_length
        bts.add(r.block_tokens)
        if r.session is not None:
            sessions.add(r.session)
        reasons = r.miss_reasons
        if reasons is not None:
            explained = True
            miss_tokens += r.extra.get("miss_tokens", sum(reasons.values()))
            for k, v in reasons.items():
                missed[k] = missed.get(k, 0) + v
        t0 = r.timestamp if t0 is None else min(t0, r.timestamp)
        t1 = r.timestamp if t1 is None else max(t1, r.timestamp)
    return {"requests": n, "blocks": blocks, "distinct_blocks": len(distinct),
            "reuse_ratio": (1 - len(distinct) / blocks) if blocks else 0.0,
            "input_tokens": tokens, "output_tokens": out_tokens,
            "mean_input_tokens": tokens / n if n else 0.0, "duration_s": (cast(float, t1) - cast(float, t0)) if n else 0.0,
            "sessions": len(sessions), "block_tokens": sorted(bts),
            **({"miss_tokens": miss_tokens, "miss_tokens_by_reason": dict(sorted(missed.items(), key=lambda kv: -kv[1]))}
               if explained else {})}
