"""Request traces from vLLM's scheduler: the connector's ``trace_path`` option.

``RequestTracer.from_extra_config(kv_connector_extra_config)`` returns None
unless ``"trace_path"`` is set; otherwise a tracer whose ``on_lookup(request)``
records the request's block hashes once (the first lookup of a request id: the
scheduler may ask again while a request waits), keyed-digested by
``tierkv.trace.TraceWriter`` — no token id and no raw block hash is written.
Each record also says why the store did not serve the rest of the prompt:
``request_id`` (vLLM's id), ``miss_tokens`` (tokens of full blocks past vLLM's own
cache the store did not hold) and ``miss_reasons`` (those tokens by
``tierkv.outcome.MissReason``), so ``tierkv trace show --request ID`` answers
"why did this request recompute N tokens?".  Each record reaches the file when its
request is looked up (flushed, not held in a buffer until the engine stops).

Options (in ``kv_connector_extra_config``): ``trace_path`` (file; rotated copies
beside it), ``trace_max_bytes`` (default 64MiB), ``trace_max_files`` (default 8),
``trace_salt`` (ids comparable across deployments sharing it).

Nothing here imports vLLM; a request is read through ``block_hashes``,
``request_id``, ``num_prompt_tokens`` and ``max_tokens``.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any, Optional

from tierkv.options import pop_int, pop_size, pop_str
from tierkv.trace import TraceWriter

from .config import block_hash_bytes

log = logging.getLogger("tierkv.adapters.vllm")

OPTIONS = ("trace_path", "trace_max_bytes", "trace_max_files", "trace_salt")
_SEEN_LIMIT = 1 << 16


class RequestTracer:
    """One trace record per request, at its first lookup."""

    def __init__(self, writer: TraceWriter) -> None:
        self.writer = writer
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._warned = False

    @classmethod
    def from_extra_config(cls, extra: Optional[dict[str, Any]], block_size: int,
                          block_bytes: Optional[int] = None) -> Optional["RequestTracer"]:
        """``block_bytes``: one block's KV in one worker's store (every layer), written into each record."""
        opts = {k: v for k, v in (extra or {}).items() if k in OPTIONS}
        what = "kv_connector_extra_config"
        path = pop_str(opts, "trace_path", None, what)
        if path is None:
            return None
        writer = TraceWriter(path, max_bytes=pop_size(opts, "trace_max_bytes", 64 << 20, what),
                             max_files=pop_int(opts, "trace_max_files", 8, what, min_value=1),
                             block_tokens=block_size, salt=pop_str(opts, "trace_salt", None, what),
                             block_bytes=block_bytes or None)
        return cls(writer)

    def on_lookup(self, request: Any, missed: Optional[dict[str, int]] = None) -> None:
        """Record ``request`` unless it was recorded already, with the tokens its lookup found not stored by
        reason (``missed``; None: not known).  Never raises into the scheduler."""
        rid = str(getattr(request, "request_id", id(request)))
        if rid in self._seen:
            return
        self._seen[rid] = None
        if len(self._seen) > _SEEN_LIMIT:
            self._seen.popitem(last=False)
        try:
            hashes = [block_hash_bytes(h) for h in (getattr(request, "block_hashes", None) or [])]
            n_prompt = getattr(request, "num_prompt_tokens", None)
            extra: dict[str, Any] = {"request_id": rid}
            if missed is not None:
                extra["miss_tokens"] = sum(missed.values())
                extra["miss_reasons"] = dict(missed)
            self.writer.record(hashes, input_length=n_prompt, output_length=int(getattr(request, "max_tokens", 0) or 0),
                               **extra)
            # written through at once: a live server's capture answers ``trace show`` for a request just served
            # (one small write per request; a server stopped by a signal may never close the file)
            self.writer.flush()
        except Exception as e:  # noqa: BLE001 - tracing never fails a request
            (log.debug if self._warned else log.warning)("tierkv: request %s not traced: %s", rid, e)
            self._warned = True

    def close(self) -> None:
        self.writer.close()
