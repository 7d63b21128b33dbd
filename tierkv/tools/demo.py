"""tierkv's main job on embedded defaults: store KV chunks, reload them through HBM(cpu) → DRAM → SSD.

    python -m tierkv.tools.demo [--chunks 96] [--dir PATH] [--config FILE]

Simulates an engine that saves the KV of several prompts sharing a system
prefix, then serves a repeated prompt from the tiers.  Prints per-tier hits,
bytes moved and throughput.  No server, no model download.

With a config of the operator's (``--config``), the demo keeps its tiers and
policies but never writes where that config points: every tier's ``path`` is
replaced by a directory under the demo's own, trace capture is left off, and the
chunks the demo stored are removed before it closes the store (a shared pool
keeps nothing of it either).
"""

from __future__ import annotations

import collections
import copy
import os
import time
from typing import Any, Optional

import torch

from tierkv import TieredStore, chunk_keys
from tierkv.config import default_config, load_config
from tierkv.durability import reason_of_failed_write
from tierkv.tools.benchmarks import PUT_REASONS, fault_totals

CHUNK_TOKENS = 256
LAYERS, KV_HEADS, HEAD_DIM = 4, 8, 128  # K and V, fp16: 4 MiB per 256-token chunk


_BASE: list[torch.Tensor] = []


def kv_chunk(seed: int) -> list[torch.Tensor]:
    """One chunk's KV as one part per layer: [2, tokens, heads, head_dim] fp16, distinct per seed."""
    if not _BASE:
        g = torch.Generator().manual_seed(0)
        _BASE.extend(torch.randn(2, CHUNK_TOKENS, KV_HEADS, HEAD_DIM, generator=g).half() for _ in range(LAYERS))
    return [torch.add(b, (seed % 997) / 64) for b in _BASE]


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def demo_config(config: Any, root: str) -> tuple[dict, list[str]]:
    """``config`` made safe to demo on: each ``path`` moved under ``root``, no trace capture.

    Returns the config and a line per change, for the operator to read.
    """
    cfg = copy.deepcopy(load_config(config))
    changes = []
    for i, t in enumerate(cfg["tiers"]):
        if isinstance(t, dict) and "path" in t:
            name = str(t.get("name") or t.get("medium") or i)
            new = os.path.join(root, f"tier{i}-{name}")
            changes.append(f"tier {name!r}: path {t['path']} -> {new} (the demo never writes into a configured "
                           "directory)")
            t["path"] = new
    if "trace_path" in cfg:
        changes.append(f"trace_path {cfg['trace_path']}: not captured (demo traffic is not traffic)")
        cfg.pop("trace_path")
        cfg.pop("trace", None)
    return cfg, changes


def run(n_chunks: int, root: str, config: Any = None) -> dict:
    """Store and reload the demo's chunks on ``config`` (a config made safe by ``demo_config``, else the defaults)."""
    cfg = config or default_config(root)
    store = TieredStore.from_config(cfg)
    try:
        return _run(store, n_chunks)
    finally:
        store.close()


def _run(store: TieredStore, n_chunks: int) -> dict:
    print(f"tierkv demo: {store!r}")
    # a system prompt shared by every request, then per-request text
    system = list(range(1000, 1000 + CHUNK_TOKENS * (n_chunks // 2)))
    prompts = [system + [7 * r + t for t in range(CHUNK_TOKENS * (n_chunks // 4))] for r in range(2)]
    chunk_bytes = sum(p.numel() * p.element_size() for p in kv_chunk(0))

    put_s = 0.0
    offered = 0
    written: list[str] = []  # the keys stored now (a refused one was never the demo's to remove)
    refused: collections.Counter = collections.Counter()
    for r, tokens in enumerate(prompts):
        keys = chunk_keys(tokens, CHUNK_TOKENS, namespace="demo-llama/fp16/tp0")
        have = store.lookup(keys)  # the engine saves only what the tiers lack
        values = [kv_chunk(int(k[:8], 16)) for k in keys[have:]]
        before = fault_totals(store)
        t0 = time.perf_counter()
        outcomes = store.put_detailed(keys[have:], values)
        put_s += time.perf_counter() - t0
        why = [o.value for o in outcomes]
        if "error" in why:  # (named by the tier counter that grew: disk full, too large)
            named = reason_of_failed_write(before, fault_totals(store)).value
            why = [named if w == "error" else w for w in why]
        new = [k for k, w in zip(keys[have:], why) if w == "stored"]
        written += new
        offered += len(values)
        refused.update(w for w in why if w not in ("stored", "present"))
        print(f"  request {r}: {len(keys)} chunks, {have} already stored (shared prefix), {len(values)} offered, "
              f"{len(new)} stored")

    # an engine's next request comes a while later: the background copies into the SSD tier are done by
    # then, so the locations printed below are the settled ones
    store.drain_write_behind(timeout=60)
    # the repeated prompt: find the cached prefix, reload it
    keys = chunk_keys(prompts[0], CHUNK_TOKENS, namespace="demo-llama/fp16/tp0")
    where = store.locate(keys)
    hit = store.lookup(keys)
    outs = [[torch.zeros(2, CHUNK_TOKENS, KV_HEADS, HEAD_DIM, dtype=torch.float16) for _ in range(LAYERS)]
            for _ in keys[:hit]]
    t0 = time.perf_counter()
    found = store.get(keys[:hit], outs)
    get_s = time.perf_counter() - t0
    n_read = sum(found)
    exact: Optional[bool] = None  # (nothing read: nothing checked)
    if n_read:
        exact = all(all(torch.equal(a, b) for a, b in zip(o, kv_chunk(int(k[:8], 16))))
                    for k, o, f in zip(keys, outs, found) if f)
    stats = store.stats()
    lookup_note = "" if n_read == hit else f", {hit} found by lookup"
    print(f"\n  repeated request: {n_read}/{len(keys)} chunks read{lookup_note} ({n_read * CHUNK_TOKENS} tokens need "
          f"no prefill); served from { {t: where[:hit].count(t) for t in store.tier_names()} }; bytes exact: "
          f"{'n/a (nothing read)' if exact is None else exact}")
    print(f"\n  {'tier':<8}{'capacity':>12}{'used':>12}{'hits':>7}{'read':>12}{'written':>12}"
          f"{'evicted':>9}{'demoted':>9}{'promoted':>9}")
    for name, t in stats["tiers"].items():
        print(f"  {name:<8}{_fmt_bytes(t['capacity_bytes']):>12}{_fmt_bytes(t['used_bytes']):>12}{t['hits']:>7}"
              f"{_fmt_bytes(t['bytes_read']):>12}{_fmt_bytes(t['bytes_written']):>12}{t['evictions']:>9}"
              f"{t['demotions']:>9}{t['promotions']:>9}")
    moved_in = len(written) * chunk_bytes  # only what was stored
    got = n_read * chunk_bytes
    reasons = ", ".join(f"{PUT_REASONS.get(k, k)}: {v}" for k, v in sorted(refused.items()))
    not_stored = f"; {sum(refused.values())} of {offered} refused ({reasons})" if refused else ""
    print(f"\n  put: {_fmt_bytes(moved_in)} stored ({len(written)} of {offered} chunks offered) in {put_s:.2f} s "
          f"({moved_in / max(put_s, 1e-9) / 2**30:.2f} GiB/s, demotions included){not_stored}")
    print(f"  get: {_fmt_bytes(got)} in {get_s:.2f} s ({got / max(get_s, 1e-9) / 2**30:.2f} GiB/s, promotions included)")
    store.drain_write_behind(timeout=60)
    present = sum(store.contains(written))  # (some may have been evicted from every tier since)
    store.remove(written)  # the demo leaves nothing behind, in a shared pool either
    left = sum(store.contains(written))
    removed = present - left
    gone = len(written) - present
    print(f"  removed {removed} chunks of the {len(written)} the demo stored"
          + (f" ({gone} already evicted from every tier)" if gone else "")
          + (f" ({left} still present)" if left else ""))
    return {"found": n_read, "asked": len(keys), "lookup_found": hit, "exact": exact, "offered": offered,
            "stored": len(written), "refused": dict(refused), "removed": removed, "left": left,
            "tiers": stats["tiers"], "stats": stats["total"]}


def main(argv: list[str] | None = None) -> int:
    """``python -m tierkv.tools.demo`` and ``tierkv-demo``: the same command as ``tierkv demo``."""
    import sys

    from tierkv.tools.cli import main as cli_main

    return cli_main(["demo", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())
