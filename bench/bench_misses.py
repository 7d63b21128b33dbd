"""What explaining a lookup's misses costs: a worker's probe of a request the store does not hold, with the
reasons (``ProbeAnswer.missed``: one ``why_missing`` call for the absent chunks) beside the same probe without.

    .venv/bin/python bench/bench_misses.py [--layers 32] [--blocks 512] [--rounds 11] [--evicted 0.5] [--json out.json]

The rig is bench_connector's (a ``TierKVWorker`` over a ``dram`` store, no engine).  Each round probes
fresh block hashes (nothing stored: every chunk misses; with ``--evicted`` that share of them is first
recorded as evicted, so the memory answers for them) twice, once with the reasons and once with them off
(``Prober._explain`` answering nothing), the first of the two alternating between rounds.  Reported: µs
per object of the question (every layer's objects) of each, medians over rounds, and the ratio. A hit is
not measured here: a probe that reaches the end asks nothing more (bench_connector's lookup measures it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from bench_connector import Rig, clock, hashes, since

from tierkv.adapters.vllm.probe import Prober
from tierkv.adapters.vllm.service import ProbeRequest
from tierkv.outcome import MissReason


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--evicted", type=float, default=0.5, help="share of the chunks recorded as evicted first")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    rig = Rig(a.layers, a.blocks, 8, lease=False)
    explain = Prober.__dict__["_explain"]  # (the staticmethod itself)
    objects = a.layers * a.blocks
    t: dict[str, list[float]] = {"with": [], "without": []}
    try:
        for r in range(a.rounds):
            hs = hashes(10_000 + r, a.blocks)
            gone = rig.w.keys.keys(a.layers - 1, hs[:int(a.blocks * a.evicted)], None)
            rig.store._departures.record(gone, MissReason.EVICTED, rig.store.levels[0].name, "lru")
            for side in (("with", "without") if r % 2 == 0 else ("without", "with")):
                Prober._explain = explain if side == "with" else staticmethod(lambda *args: {})  # type: ignore
                t0 = clock()
                got = rig.w.probe(ProbeRequest(hs, 0, None, f"{side}-{r}"))
                t[side].append(since(t0)[0] / objects * 1e6)
                if got.reach or (side == "with" and sum(got.missed.values()) != a.blocks):
                    raise AssertionError(f"unexpected probe answer {got.reach} {got.missed}")
    finally:
        Prober._explain = explain
        rig.w.shutdown()
        rig.store.close()
    out = {k: statistics.median(v) for k, v in t.items()}
    out["ratio"] = out["with"] / out["without"]
    print(f"miss lookup, µs per object ({a.layers} layers x {a.blocks} blocks, {a.rounds} rounds): "
          f"with reasons {out['with']:.3f}, without {out['without']:.3f}, ratio {out['ratio']:.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), **out, "rounds": t}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
