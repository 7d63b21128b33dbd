"""Several threads hammer put / get / lookup / remove; then the invariants are checked."""

from __future__ import annotations

import random
import threading
import time

import torch

from tierkv import TieredStore
from tierkv.tiers.slab import ALIGN

N_KEYS = 64


def content(i: int, size: int) -> torch.Tensor:
    return torch.full((size,), i % 251, dtype=torch.uint8)


def size_of(i: int) -> int:
    return (1 + i % 5) * ALIGN


def test_threads_hammering_the_store_see_no_wrong_bytes(tmp_path):
    cfg = {
        "tiers": [
            {"medium": "hbm", "device": "cpu", "capacity": 24 * ALIGN},
            {"medium": "dram", "capacity": 40 * ALIGN, "eviction": "lfu"},
            {"medium": "ssd", "path": str(tmp_path / "s"), "capacity": 40 * 4096, "eviction": "fifo"},
        ],
        "promotion": {"policy": "on-hit", "min_hits": 2},
    }
    store = TieredStore.from_config(cfg)
    keys = [f"k{i:03d}" for i in range(N_KEYS)]
    errors: list[str] = []
    stop = time.monotonic() + 4.0
    counts = {"hits": 0, "gets": 0}
    lock = threading.Lock()

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            while time.monotonic() < stop:
                idx = rng.sample(range(N_KEYS), rng.randint(1, 4))
                op = rng.random()
                if op < 0.4:
                    store.put([keys[i] for i in idx], [content(i, size_of(i)) for i in idx])
                elif op < 0.8:
                    outs = [torch.empty(size_of(i), dtype=torch.uint8) for i in idx]
                    found = store.get([keys[i] for i in idx], outs)
                    with lock:
                        counts["gets"] += len(idx)
                        counts["hits"] += sum(found)
                    for i, f, o in zip(idx, found, outs):
                        if f and not torch.equal(o, content(i, size_of(i))):
                            errors.append(f"wrong bytes for {keys[i]}")
                elif op < 0.9:
                    store.lookup([keys[i] for i in sorted(idx)])
                else:
                    store.remove([keys[idx[0]]])
        except Exception as e:  # any exception is a failure of the test
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:5]
    assert counts["hits"] > 0  # the run really exercised hits
    # the background copies into the write-behind tier are calls of their own: they hold their
    # reservations until they finish, so the bookkeeping is checked once they have
    assert store.drain_write_behind(timeout=60)
    for lvl in store.levels:
        assert lvl.used <= lvl.capacity
        assert not lvl.pinned
        assert lvl.used == sum(e.footprint for _, e in lvl.items())
        assert all(e.ready for _, e in lvl.items()), "a reservation leaked"
        assert lvl.ready_count == len(lvl.keys()) and lvl.ready_bytes == lvl.used
        assert lvl.tier.used_bytes <= lvl.capacity
        assert len(lvl.eviction) == len(lvl.keys())
        lvl.check()
    # every key the index claims is readable with the right bytes
    present = [i for i in range(N_KEYS) if store.contains([keys[i]])[0]]
    outs = [torch.empty(size_of(i), dtype=torch.uint8) for i in present]
    assert store.get([keys[i] for i in present], outs) == [True] * len(present)
    assert all(torch.equal(o, content(i, size_of(i))) for i, o in zip(present, outs))
    store.close()
