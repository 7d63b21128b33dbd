"""O_DIRECT write speed by source buffer: what the ssd tier's staging memory is chosen by.

    .venv/bin/python bench/bench_dio_buffers.py [--dir DIR] [--mib 256] [--object-mib 2] [--rounds 4]

Writes the same bytes into one preallocated file with O_DIRECT, one ``pwrite`` per object and an
``fsync`` at the end of each round, from five kinds of source buffer, the kinds alternating round by
round so a device that changes its speed slows them alike:

* ``image 4K populate``: one region-sized image of 4 KiB pages, ``MAP_POPULATE`` (the tier's image before
  huge pages);
* ``image 4K touched``: the same, its pages faulted in by the first copy into it;
* ``image huge``: the same, advised as transparent huge pages first (``format.aligned_buffer``: the tier's
  image now);
* ``separate 4K``: one page-aligned buffer per object (``bench_ssd.py``'s raw baseline);
* ``torch``: straight from the objects' own tensors (4 KiB pages; the whole blocks inside each).

Prints each kind's median GiB/s and every round's figure.  The spread between kinds is the machine's:
on a virtual disk, a transfer from scattered 4 KiB pages is as many segments as pages.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import sys
import tempfile
import time

import torch

from tierkv.tiers.ssd.format import BLOCK, aligned_buffer

MiB = 1 << 20


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", help="directory on the file system to measure (default: a temp dir)")
    ap.add_argument("--mib", type=int, default=256, help="bytes a round writes, MiB")
    ap.add_argument("--object-mib", type=int, default=2, help="bytes a pwrite writes, MiB")
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args(argv)
    if args.dir is not None and not os.path.isdir(args.dir):
        ap.error(f"--dir {args.dir}: no such directory")
    if args.mib < 1 or args.object_mib < 1 or args.rounds < 1:
        ap.error("--mib, --object-mib and --rounds must be at least 1")
    size, total = args.object_mib * MiB, args.mib * MiB
    n = total // size
    image_len = min(total, 64 * MiB)
    fd_dir = tempfile.mkdtemp(prefix="tierkv-bench-dio-", dir=args.dir)
    path = os.path.join(fd_dir, "f")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError as e:
        print(f"no O_DIRECT in {fd_dir}: {e}")
        os.rmdir(fd_dir)
        return 0
    try:
        os.posix_fallocate(fd, 0, total)
        srcs = [torch.randint(0, 256, (size,), dtype=torch.uint8) for _ in range(n)]

        def image(populate: bool, huge: bool) -> mmap.mmap:
            m = aligned_buffer(image_len, populate=populate, huge=huge)
            for i in range(image_len // size):
                m[i * size:(i + 1) * size] = srcs[i].numpy().tobytes()
            return m

        def from_image(m: mmap.mmap):
            mv = memoryview(m)

            def run() -> None:
                for i in range(n):
                    at = i * size % image_len
                    os.pwrite(fd, mv[at:at + size], i * size)
            return run

        separate = []
        for s in srcs:
            b = aligned_buffer(size, huge=False)
            b[:] = s.numpy().tobytes()
            separate.append(b)

        def from_separate() -> None:
            for i, b in enumerate(separate):
                os.pwrite(fd, b, i * size)

        def from_torch() -> None:  # the whole blocks inside each tensor, at a block-aligned file offset
            for i, s in enumerate(srcs):
                lo = (s.data_ptr() + BLOCK - 1) & -BLOCK
                os.pwrite(fd, (ctypes.c_ubyte * (size - BLOCK)).from_address(lo), i * size)

        kinds = {"image 4K populate": from_image(image(True, False)),
                 "image 4K touched": from_image(image(False, False)),
                 "image huge": from_image(image(True, True)),
                 "separate 4K": from_separate,
                 "torch": from_torch}
        got: dict[str, list[float]] = {k: [] for k in kinds}
        from_separate()  # (a first pass over the fresh file converts its unwritten extents: not measured)
        os.fsync(fd)
        for _ in range(args.rounds):
            for k, run in kinds.items():
                os.sync()
                t0 = time.perf_counter()
                run()
                os.fsync(fd)
                got[k].append(total / (time.perf_counter() - t0) / 2**30)
        print(f"{n} x {args.object_mib} MiB O_DIRECT pwrite + fsync a round, {args.rounds} rounds, in {fd_dir}")
        for k, v in got.items():
            print(f"{k:<20}{statistics.median(v):>8.2f} GiB/s   rounds: {', '.join(f'{x:.2f}' for x in v)}")
    finally:
        os.close(fd)
        os.unlink(path)
        os.rmdir(fd_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
