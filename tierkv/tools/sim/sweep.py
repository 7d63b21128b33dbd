"""Hit rate against capacity: one tier's capacity swept for several eviction policies.

``parse_sweep("dram=1GiB..64GiB:8")`` gives the tier and 8 capacities spaced
geometrically from 1 GiB to 64 GiB (both included).  ``sweep`` replays the
trace once per (policy, capacity) through ``simulate``; ``write_csv`` and
``plot`` write the numbers and one curve per policy — the plotted points are
exactly the CSV's rows.
"""

from __future__ import annotations

import csv
import re
from collections.abc import Callable, Sequence
from typing import Any, Optional

from tierkv.errors import ConfigError
from tierkv.units import parse_size

from .replay import simulate
from .traces import Request

_SPEC = re.compile(r"^\s*([^=\s]+)\s*=\s*([^.\s]+)\s*\.\.\s*([^:\s]+)\s*(?::\s*(\d+))?\s*$")

CSV_FIELDS = ("policy", "tier", "capacity_bytes", "token_hit_rate", "chunk_hit_rate", "tier_hit_rate",
              "prefill_tokens_saved", "hits", "evictions", "load_s", "recompute_s")


def parse_sweep(spec: str) -> tuple[str, list[int]]:
    """``"TIER=LO..HI[:POINTS]"`` -> (tier, capacities), geometric, default 8 points."""
    m = _SPEC.match(spec or "")
    if not m:
        raise ConfigError(f"--sweep {spec!r}: expected TIER=LO..HI[:POINTS], e.g. dram=1GiB..64GiB:8")
    tier, lo_s, hi_s, pts = m.groups()
    lo, hi = parse_size(lo_s, "--sweep low end"), parse_size(hi_s, "--sweep high end")
    points = int(pts) if pts else 8
    if hi < lo:
        raise ConfigError(f"--sweep {spec!r}: the high end is below the low end")
    if points < 1 or (points == 1 and hi != lo):
        raise ConfigError(f"--sweep {spec!r}: need at least 2 points for a range")
    if points == 1:
        return tier, [lo]
    ratio = (hi / lo) ** (1 / (points - 1))
    caps = sorted({int(round(lo * ratio ** i)) for i in range(points - 1)} | {hi})
    return tier, caps


def sweep(requests: Sequence[Request], config: Any, tier: str, capacities: Sequence[int],
          policies: Sequence[str], progress: Optional[Callable[[int], None]] = None,
          other_capacities: Optional[dict[str, Any]] = None, other_evictions: Optional[dict[str, Any]] = None,
          **kw: Any) -> list[dict]:
    """One row per (policy, capacity): the replay's hit rates and the swept tier's counters.

    ``hits_<tier>`` are every tier's hits.  ``tier_hit_rate`` is the swept tier's own hits over all blocks
    requested: in a chain, the tiers below catch what it misses, so the chain's rates may not move while
    this one does.  ``progress(n)`` counts requests replayed; ``other_capacities`` / ``other_evictions``
    override other tiers in every run.
    """
    rows = []
    caps_kw = dict(other_capacities or {})
    ev_kw = dict(other_evictions or {})
    for policy in policies:
        for cap in capacities:
            res = simulate(requests, config, capacities={**caps_kw, tier: cap}, evictions={**ev_kw, tier: policy},
                           progress=progress, **kw)
            t = res.tiers[tier]
            rows.append({"policy": policy, "tier": tier, "capacity_bytes": cap,
                         "token_hit_rate": res.token_hit_rate, "chunk_hit_rate": res.chunk_hit_rate,
                         "tier_hit_rate": t["hits"] / res.blocks if res.blocks else 0.0,
                         "prefill_tokens_saved": res.hit_tokens, "hits": t["hits"], "evictions": t["evictions"],
                         "load_s": res.load_s, "recompute_s": res.recompute_s,
                         **{f"hits_{name}": x["hits"] for name, x in res.tiers.items()}})
    return rows


def write_csv(rows: Sequence[dict], path: str) -> None:
    """The rows: ``CSV_FIELDS``, then ``hits_<tier>`` for each tier of the chain."""
    fields = list(CSV_FIELDS) + list(dict.fromkeys(k for r in rows for k in r if k.startswith("hits_")))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else r[k]) for k in fields})


def _fmt_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:g}{unit}" if n == int(n) else f"{n:.1f}{unit}"
        n /= 1024
    return str(n)


def plot(rows: Sequence[dict], path: str, title: str = "", metric: str = "token_hit_rate") -> None:
    """Hit rate (y, 0..1) against capacity (x, log scale), one line per policy, to a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
    try:
        for policy in dict.fromkeys(r["policy"] for r in rows):
            pts = sorted((r["capacity_bytes"], r[metric]) for r in rows if r["policy"] == policy)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=policy)
        caps = sorted({r["capacity_bytes"] for r in rows})
        if len(caps) > 1 and caps[-1] / caps[0] > 4:
            ax.set_xscale("log", base=2)
        ax.set_xticks(caps)
        ax.set_xticklabels([_fmt_size(c) for c in caps], rotation=30, fontsize=8)
        ax.minorticks_off()
        ax.set_ylim(0, 1)
        tier = rows[0]["tier"] if rows else ""
        ax.set_xlabel(f"{tier} capacity")
        label = f"{tier} hit rate (its hits / all blocks)" if metric == "tier_hit_rate" else metric.replace("_", " ")
        ax.set_ylabel(label)
        ax.set_title(title or f"{label} vs {tier} capacity")
        ax.grid(True, alpha=0.3)
        # outside the axes: nothing but the curves is drawn inside the plot area
        ax.legend(title="eviction", loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)
