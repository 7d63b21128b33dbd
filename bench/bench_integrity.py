"""What checking each chunk's checksum costs a ``get``, beside the same reads unchecked, in one run.

    .venv/bin/python bench/bench_integrity.py [--chunk-mib 2] [--batch 32] [--reps 7] [--no-pool]

* ``dram``: two stores, one ``dram`` tier each, the same chunks in both: ``"verify": "external"`` (reads
  unchecked, the default for a local tier) and ``"verify": "always"`` (each read hashed and compared).
* ``dram_pool`` (when Mooncake is installed; it starts its own ``mooncake_master``): ``store.get`` from the
  pool (every read checked: the trailer against the bytes) beside the pool tier's own read of the same
  objects into the same buffers, trailer included, unchecked.  The objects lie in the reader's own segment,
  so each read is a memory copy (summed as it copies): the case where a check is most visible.
* ``dram_pool_remote``: the same, the objects stored by another process into its own segment, so each read
  is a Mooncake transfer (``tcp`` here), the case of an engine reading what another instance stored.  The
  run fails unless every checked read was a transfer (the tier's ``local_reads`` stays 0).

Rounds alternate the two sides; GB/s are medians of ``--reps`` rounds, the ratio checked / unchecked the
median of each round's own ratio (the target: >= 0.90).  ``cpu_ratio`` is the same from the CPU time the
process spent on each side (all its threads): on a machine shared with other work, where the wall clock also
counts the time others held the cores, it says what the check itself costs.  Prints one JSON line per case.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

from tierkv.checksum import trailer_buffers
from tierkv.store import TieredStore

MiB = 1 << 20


def chunks(n: int, size: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g) for _ in range(n)]


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def rate(fn: Callable[[], Any], nbytes: int) -> tuple[float, float]:
    """(GB/s by the wall clock, GB/s by the process's CPU time) of one call."""
    c0, t0 = cpu_seconds(), time.perf_counter()
    fn()
    wall, cpu = time.perf_counter() - t0, cpu_seconds() - c0
    return nbytes / wall / 1e9, nbytes / max(cpu, 1e-6) / 1e9


def alternate(checked: Callable[[], Any], unchecked: Callable[[], Any], nbytes: int, reps: int) -> dict[str, Any]:
    checked()
    unchecked()  # (warm both)
    on, off = [], []
    for _ in range(reps):
        off.append(rate(unchecked, nbytes))
        on.append(rate(checked, nbytes))
    a, b = statistics.median(x[0] for x in on), statistics.median(x[0] for x in off)
    # (each round's two sides ran back to back: the median of their ratios is steadier under load than a ratio
    # of medians)
    return {"checked_gbps": round(a, 3), "unchecked_gbps": round(b, 3),
            "ratio": round(statistics.median([x[0] / y[0] for x, y in zip(on, off)]), 3),
            "cpu_ratio": round(statistics.median([x[1] / y[1] for x, y in zip(on, off)]), 3)}


def bench_dram(vals: list[torch.Tensor], reps: int) -> dict[str, Any]:
    keys = [f"k{i}" for i in range(len(vals))]
    nbytes = sum(v.numel() for v in vals)
    cap = 2 * nbytes + 64 * MiB
    off = TieredStore.from_config({"tiers": [{"medium": "dram", "capacity": cap, "verify": "external"}]})
    on = TieredStore.from_config({"tiers": [{"medium": "dram", "capacity": cap, "verify": "always"}]})
    try:
        assert all(off.put(keys, vals)) and all(on.put(keys, vals))
        outs = [torch.empty_like(v) for v in vals]

        def get(s: TieredStore) -> Callable[[], None]:
            def run() -> None:
                if not all(s.get(keys, outs)):
                    raise RuntimeError("a get missed")
            return run

        res = alternate(get(on), get(off), nbytes, reps)
        assert all(torch.equal(o, v) for o, v in zip(outs, vals))
        assert on.stats()["tiers"]["dram"]["corrupt"] == 0
        return {"case": "dram", **res}
    finally:
        off.close()
        on.close()


def pool_sides(s: TieredStore, keys: list[str], outs: list[torch.Tensor]) -> tuple[Callable[[], None], ...]:
    """The two sides of a pool case: ``store.get`` (checked) and the pool tier's own read of the same objects
    into the same buffers, trailer included (unchecked)."""
    tier = s.levels[0].tier
    tr = trailer_buffers(len(keys))

    def checked() -> None:
        if not all(s.get(keys, outs)):
            raise RuntimeError("a get missed")

    def unchecked() -> None:
        if not all(tier.read(keys, [[o, t] for o, t in zip(outs, tr)])):
            raise RuntimeError("a read missed")

    return checked, unchecked


def bench_pool(vals: list[torch.Tensor], reps: int) -> dict[str, Any]:
    from mooncake_util import MooncakeMaster, client_env

    os.environ.update(client_env())
    keys = [f"k{i}" for i in range(len(vals))]
    nbytes = sum(v.numel() for v in vals)
    with MooncakeMaster() as m:
        pool = m.tier_config(segment=f"{2 * nbytes // MiB + 64}MiB", namespace=f"bench-{uuid.uuid4().hex[:8]}")
        s = TieredStore.from_config({"tiers": [pool]})
        try:
            assert all(s.put(keys, vals))
            outs = [torch.empty_like(v) for v in vals]
            res = alternate(*pool_sides(s, keys, outs), nbytes, reps)
            assert all(torch.equal(o, v) for o, v in zip(outs, vals))
            assert s.stats()["tiers"]["dram_pool"]["corrupt"] == 0
            return {"case": "dram_pool", **res}
        finally:
            s.close()


OWNER = r"""
import sys, json, torch
sys.path.insert(0, sys.argv[3])
from bench_integrity import chunks
from tierkv.store import TieredStore
cfg, n, size = json.loads(sys.argv[1]), int(sys.argv[2].split(",")[0]), int(sys.argv[2].split(",")[1])
s = TieredStore.from_config(cfg)
ok = s.put([f"k{i}" for i in range(n)], chunks(n, size))
print("ready" if all(ok) else "refused", flush=True)
sys.stdin.read()
s.close()
"""


def bench_pool_remote(vals: list[torch.Tensor], reps: int) -> dict[str, Any]:
    """Reads of objects another process stored in its own segment: every read a transfer."""
    import subprocess

    from mooncake_util import MooncakeMaster, client_env

    os.environ.update(client_env())
    keys = [f"k{i}" for i in range(len(vals))]
    nbytes = sum(v.numel() for v in vals)
    with MooncakeMaster() as m:
        ns = f"bench-{uuid.uuid4().hex[:8]}"
        owner_cfg = {"tiers": [m.tier_config(segment=f"{2 * nbytes // MiB + 64}MiB", namespace=ns)]}
        owner = subprocess.Popen([sys.executable, "-c", OWNER, json.dumps(owner_cfg),
                                  f"{len(vals)},{vals[0].numel()}", HERE],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            line = owner.stdout.readline().strip() if owner.stdout else ""
            if line != "ready":
                raise RuntimeError(f"the owner process did not store the objects ({line or 'it died'})")
            # (the smallest segment Mooncake takes: this process reads, it stores nothing)
            s = TieredStore.from_config({"tiers": [m.tier_config(segment="16MiB", namespace=ns)]})
            try:
                outs = [torch.empty_like(v) for v in vals]
                res = alternate(*pool_sides(s, keys, outs), nbytes, reps)
                assert all(torch.equal(o, v) for o, v in zip(outs, vals))
                st = s.stats()["tiers"]["dram_pool"]
                assert st["corrupt"] == 0
                if st["local_reads"]:
                    raise RuntimeError(f"{st['local_reads']} reads were local copies, not transfers")
                return {"case": "dram_pool_remote", **res}
            finally:
                s.close()
        finally:
            if owner.stdin:
                owner.stdin.close()
            try:
                owner.wait(60)
            except subprocess.TimeoutExpired:
                owner.kill()
                owner.wait(10)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunk-mib", type=float, default=2.0)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--no-pool", action="store_true", help="skip the dram_pool cases")
    a = ap.parse_args()
    if a.chunk_mib <= 0 or a.batch < 1 or a.reps < 1:
        print("bench_integrity: --chunk-mib must be > 0, --batch and --reps >= 1", file=sys.stderr)
        return 2
    vals = chunks(a.batch, int(a.chunk_mib * MiB))
    print(json.dumps({"chunk_mib": a.chunk_mib, "batch": a.batch, "reps": a.reps, **bench_dram(vals, a.reps)}),
          flush=True)
    if not a.no_pool:
        from mooncake_util import missing_reason

        why = missing_reason()
        if why:
            print(json.dumps({"case": "dram_pool", "skipped": why}), flush=True)
        else:
            print(json.dumps({"chunk_mib": a.chunk_mib, "batch": a.batch, "reps": a.reps,
                              **bench_pool(vals, a.reps)}), flush=True)
            print(json.dumps({"chunk_mib": a.chunk_mib, "batch": a.batch, "reps": a.reps,
                              **bench_pool_remote(vals, a.reps)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
