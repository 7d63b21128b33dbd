"""Store benchmarks, each figure a ratio to a baseline measured in the same run.

    python bench/bench_store.py [--quick] [--json > out.json]   (same as: tierkv bench --suite dram,ssd,lookup,keys)

* dram put / get, 2 MiB and 32 MiB chunks, batches of 32, vs a plain torch copy
  of the same bytes into preallocated tensors (target ≥ 0.8×);
* ssd write / read, same sizes, vs raw sequential file I/O (os.writev / os.preadv
  of the same bytes, one file per chunk) on the same directory (target ≥ 0.8×);
* lookup of a 512-chunk prefix against 1M stored keys (target ≤ 100 µs);
* chunk_keys over 128K tokens (target ≥ 50M tokens/s).
The suites live in ``tierkv.tools.benchmarks``; ``tierkv bench`` runs them too.
"""

from __future__ import annotations

import sys

from tierkv.tools.cli import main

if __name__ == "__main__":
    args = sys.argv[1:]
    if not any(a.startswith("--suite") for a in args):
        args = ["--suite", "dram,ssd,lookup,keys", *args]
    sys.exit(main(["bench", *args]))
