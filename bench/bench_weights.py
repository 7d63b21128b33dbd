"""What the weights fingerprint costs at start-up: ``tierkv.weights.weights_identity`` on a multi-GB checkpoint.

    .venv/bin/python bench/bench_weights.py [--gib 4] [--shards 4] [--dir DIR] [--rounds 3]

Writes ``--gib`` GiB of random bytes as ``--shards`` ``*.safetensors`` files and a ``config.json`` into a
temp directory (under ``--dir``, default the system's temp dir), then times, in the same run:

* the fingerprint cold: every file's pages dropped from the page cache first (``fsync`` +
  ``posix_fadvise(DONTNEED)``, what an engine's first start after a copy or a reboot sees);
* the fingerprint warm (the pages it samples already cached);
* reading every byte of the files, cold and warm (8 MiB reads): what hashing whole files would cost at
  least.

Prints each figure's median and the ratio fingerprint / full read, cold and warm, as JSON on the last
line.  The files are removed at the end, also on failure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

from tierkv.weights import resolve_weights, weight_files

MiB = 1 << 20
GiB = 1 << 30


def _write(path: str, size: int, seed: int) -> None:
    block = bytearray(os.urandom(64 * MiB))
    with open(path, "wb") as f:
        done = 0
        while done < size:
            block[:16] = (seed * (1 << 64) + done).to_bytes(16, "little")  # no two blocks alike
            n = min(len(block), size - done)
            f.write(memoryview(block)[:n])
            done += n
        f.flush()
        os.fsync(f.fileno())


def _drop(files: list[str]) -> None:
    """Drop the files' pages from the page cache (they are clean: written and fsynced)."""
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _read_all(files: list[str]) -> int:
    total = 0
    buf = bytearray(8 * MiB)
    for p in files:
        with open(p, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                total += n
    return total


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=4.0, help="checkpoint size, GiB")
    ap.add_argument("--shards", type=int, default=4, help="weight files")
    ap.add_argument("--dir", help="where the temp checkpoint is written (default: the system's temp dir)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    if args.gib <= 0 or args.shards < 1 or args.rounds < 1:
        ap.error("--gib must be positive, --shards and --rounds at least 1")
    if args.dir is not None and not os.path.isdir(args.dir):
        ap.error(f"--dir {args.dir}: no such directory")
    root = tempfile.mkdtemp(prefix="tierkv-bench-weights-", dir=args.dir)
    try:
        size = int(args.gib * GiB) // args.shards
        t = time.perf_counter()
        with open(os.path.join(root, "config.json"), "w") as f:
            json.dump({"model_type": "llama", "bench": True}, f)
        for i in range(args.shards):
            _write(os.path.join(root, f"model-{i + 1:05d}-of-{args.shards:05d}.safetensors"), size, i)
        print(f"wrote {args.gib:g} GiB in {args.shards} files in {time.perf_counter() - t:.1f} s ({root})")
        files = weight_files(root)
        res: dict[str, list[float]] = {"fingerprint_cold": [], "fingerprint_warm": [], "read_cold": [],
                                       "read_warm": []}
        digest = ""
        for _ in range(args.rounds):
            _drop(files)
            res["fingerprint_cold"].append(_timed(lambda: resolve_weights(root)))
            ident = resolve_weights(root)
            res["fingerprint_warm"].append(_timed(lambda: resolve_weights(root)))
            digest = ident.digest
            _drop(files)
            res["read_cold"].append(_timed(lambda: _read_all(files)))
            res["read_warm"].append(_timed(lambda: _read_all(files)))
        med = {k: statistics.median(v) for k, v in res.items()}
        out = {
            "gib": args.gib, "shards": args.shards, "rounds": args.rounds, "digest": digest, "detail": ident.detail,
            "fingerprint_cold_ms": round(med["fingerprint_cold"] * 1e3, 2),
            "fingerprint_warm_ms": round(med["fingerprint_warm"] * 1e3, 2),
            "read_cold_s": round(med["read_cold"], 3), "read_warm_s": round(med["read_warm"], 3),
            "ratio_cold": round(med["fingerprint_cold"] / med["read_cold"], 5),
            "ratio_warm": round(med["fingerprint_warm"] / med["read_warm"], 5),
            "load_average": round(os.getloadavg()[0], 2),
            "rounds_s": {k: [round(x, 4) for x in v] for k, v in res.items()},
        }
        print(f"fingerprint: cold {out['fingerprint_cold_ms']} ms, warm {out['fingerprint_warm_ms']} ms; "
              f"reading every byte: cold {out['read_cold_s']} s, warm {out['read_warm_s']} s; "
              f"ratio cold {out['ratio_cold']}, warm {out['ratio_warm']}")
        print(json.dumps(out))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
