"""The connector's counters: vLLM's stats payload, per-request records, and how a put is counted.

``TierKVConnectorStats`` travels from the workers to vLLM's logger (one interval
at a time) and also keeps a worker's totals.  :meth:`SaveTally.of` is the one
place that decides what a put's answers (``PutOutcome``) count as.  Nothing here
touches a store or an engine.
"""

from __future__ import annotations

import collections
import operator
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from tierkv.outcome import PutOutcome

from .chunks import Chunk
from .prom import merge_store_snapshots

COUNTERS = (
    "load_requests", "load_blocks", "load_tokens", "load_bytes", "load_s", "load_errors",
    "save_blocks", "save_bytes", "save_s", "save_errors", "save_refused",
    "audits", "audit_mismatches", "audit_skipped", "audit_s", "leases", "lease_expired",
    "lease_cuts", "events_stored", "events_removed", "events_dropped", "events_unmapped",
)
#: the engine's steps as the workers timed them (the decline rule's compute samples): sent with every step's
#: stats, but a step alone is no news (``is_empty``)
STEP_COUNTERS = ("steps", "step_tokens", "step_s")
#: counters by tier: hits the decline rule did not claim (decline.py), their tokens, and the slow hits claimed
#: anyway as probes
BY_TIER = ("declined_slow", "declined_slow_tokens", "decline_probes")
#: loads by tier, for the decline rule: tier -> [tokens, seconds, load jobs]
TIER_LOADS = "tier_loads"


@dataclass
class TierKVConnectorStats(KVConnectorStats):
    """Counters of one interval: loads, saves, errors and hit tokens by tier."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = dict.fromkeys(COUNTERS, 0)
        self.data["hit_tokens"] = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        od = other.data or {}
        for k in COUNTERS:
            self.data[k] = self.data.get(k, 0) + od.get(k, 0)
        for k in STEP_COUNTERS:
            if od.get(k):
                self.data[k] = self.data.get(k, 0) + od[k]
        for key in ("hit_tokens", *BY_TIER):
            if od.get(key):
                mine = self.data.setdefault(key, {})
                for tier, n in od[key].items():
                    mine[tier] = mine.get(tier, 0) + n
        for tier, sample in (od.get(TIER_LOADS) or {}).items():
            add_tier_load(self.data, tier, *sample)
        merge_store_snapshots(self.data, od)
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        out: dict[str, int | float] = {
            "loaded_tokens": d.get("load_tokens", 0),
            "load_MiB": round(d.get("load_bytes", 0) / 2**20, 3),
            "load_ms": round(d.get("load_s", 0.0) * 1e3, 3),
            "load_errors": d.get("load_errors", 0),
            "saved_blocks": d.get("save_blocks", 0),
            "save_MiB": round(d.get("save_bytes", 0) / 2**20, 3),
            "save_ms": round(d.get("save_s", 0.0) * 1e3, 3),
            "save_errors": d.get("save_errors", 0),
            "save_refused": d.get("save_refused", 0),
            "audits": d.get("audits", 0),
            "audit_mismatches": d.get("audit_mismatches", 0),
            "audit_skipped": d.get("audit_skipped", 0),
            "audit_ms": round(d.get("audit_s", 0.0) * 1e3, 3),
            "leases": d.get("leases", 0),
            "lease_expired": d.get("lease_expired", 0),
            "lease_cuts": d.get("lease_cuts", 0),
            "events_stored": d.get("events_stored", 0),
            "events_removed": d.get("events_removed", 0),
            "events_dropped": d.get("events_dropped", 0),
            "events_unmapped": d.get("events_unmapped", 0),
        }
        for key in ("hit_tokens", *BY_TIER):
            for tier, n in sorted((d.get(key) or {}).items()):
                out[f"{key}[{tier}]"] = n
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(k, 0) for k in COUNTERS) and not any(
            self.data.get(k) for k in ("hit_tokens", *BY_TIER))

    @classmethod
    def from_payload(cls, data: dict[str, Any] | None) -> TierKVConnectorStats:
        """Stats rebuilt from a payload another process sent (never aliasing its dicts)."""
        if not data:
            return cls()
        return cls(data={k: dict(v) if isinstance(v, dict) else v for k, v in data.items()})


def add_tier_load(data: dict[str, Any], tier: str, tokens: float, seconds: float, jobs: int) -> None:
    """Add a load sample of ``tier`` to a stats payload's ``tier_loads``."""
    loads = data.setdefault(TIER_LOADS, {})
    t, s, n = loads.get(tier, (0, 0.0, 0))
    loads[tier] = [t + tokens, s + seconds, n + jobs]  # (a new list: a payload's copy may share the old one)


# ---------------------------------------------------------------------------------------
# saves: what a put's answers count as
# ---------------------------------------------------------------------------------------
_FIRST, _LAST = operator.itemgetter(0), operator.itemgetter(1)


@dataclass
class SaveTally:
    """One put call's outcome, in the units the counters use."""

    blocks: int = 0
    nbytes: int = 0
    errors: int = 0
    refused: int = 0
    seconds: float = 0.0

    @classmethod
    def of(cls, results: list[PutOutcome], chunks: list[Chunk], block_nbytes: int) -> SaveTally:
        """The tally of one ``put_detailed`` of ``chunks`` (``block_nbytes`` bytes per block), from its answers.

        ``STORED`` and ``PRESENT`` count as saved blocks, ``ERROR`` as an error (a
        medium failed), ``REJECTED`` and ``NO_ROOM`` as refused (the store declined to
        keep the chunk: admission, or no room could be made).
        """
        t = cls()
        n = len(results)
        if n != len(chunks):
            raise ValueError(f"a put answered {n} outcomes for {len(chunks)} chunks")
        # the common case, counted in C (a loop would call PutOutcome.__bool__ per answer)
        if results.count(PutOutcome.STORED) + results.count(PutOutcome.PRESENT) == n:
            t.blocks = sum(map(_LAST, chunks)) - sum(map(_FIRST, chunks)) + n
        else:
            for res, (first, last) in zip(results, chunks):
                if res is PutOutcome.STORED or res is PutOutcome.PRESENT:
                    t.blocks += last - first + 1
                elif res is PutOutcome.ERROR:
                    t.errors += 1
                elif res is PutOutcome.REJECTED or res is PutOutcome.NO_ROOM:
                    t.refused += 1
                else:
                    raise TypeError(f"a put answered {res!r}, not a PutOutcome")
        t.nbytes = t.blocks * block_nbytes
        return t

    def add_to(self, stats: TierKVConnectorStats) -> None:
        d = stats.data
        d["save_blocks"] += self.blocks
        d["save_bytes"] += self.nbytes
        d["save_s"] += self.seconds
        d["save_errors"] += self.errors
        d["save_refused"] = d.get("save_refused", 0) + self.refused


# ---------------------------------------------------------------------------------------
# per-request records
# ---------------------------------------------------------------------------------------
class RequestRecords(collections.OrderedDict):
    """Loads and saves per request (bytes, seconds, tokens by tier), the newest ``limit`` requests."""

    def __init__(self, limit: int = 4096) -> None:
        super().__init__()
        self.limit = limit

    def record(self, rid: str) -> dict[str, Any]:
        rec = self.get(rid)
        if rec is None:
            rec = self[rid] = {
                "load_tokens": 0, "load_bytes": 0, "load_s": 0.0, "load_errors": 0, "hit_tokens": {},
                "save_blocks": 0, "save_bytes": 0, "save_s": 0.0, "save_errors": 0, "save_refused": 0,
            }
            while len(self) > self.limit:
                self.popitem(last=False)
        return rec

    def add_save(self, rid: str, tally: SaveTally) -> None:
        rec = self.record(rid)
        rec["save_blocks"] += tally.blocks
        rec["save_bytes"] += tally.nbytes
        rec["save_s"] += tally.seconds
        rec["save_errors"] += tally.errors
        rec["save_refused"] += tally.refused

    @staticmethod
    def summary(rid: str, rec: dict[str, Any]) -> str | None:
        """The log line for a finished request (None when it moved nothing)."""
        if not (rec["load_tokens"] or rec["save_blocks"] or rec["save_errors"]):
            return None
        audited = ""
        if rec.get("audits") or rec.get("audit_skipped"):
            audited = (f"; audited {rec['audits']} stored chunk-layers, {rec['audit_mismatches']} differed, "
                       f"{rec['audit_skipped']} not compared")
        return (f"TierKVConnector: request {rid} loaded {rec['load_tokens']} tokens {rec['hit_tokens']} "
                f"({rec['load_bytes'] / 2**20:.2f} MiB, {rec['load_s'] * 1e3:.1f} ms, {rec['load_errors']} errors); "
                f"saved {rec['save_blocks']} block-layers ({rec['save_bytes'] / 2**20:.2f} MiB, "
                f"{rec['save_s'] * 1e3:.1f} ms){audited}")
