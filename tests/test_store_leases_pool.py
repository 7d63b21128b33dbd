"""What a lease can and cannot hold beside a real Mooncake pool (a ``mooncake_master`` on 127.0.0.1).

A chunk in the local tier is pinned there; a chunk only the pool holds is named
``unheld`` (the pool evicts by its own rules: tierkv cannot keep it from lookup to
load), and the lease's release leaves the pool untouched.
"""

from __future__ import annotations

import uuid

import pytest
import torch
from mooncake_util import missing_reason, shared_mooncake_master  # noqa: F401 (fixture)

from tierkv import TieredStore

pytestmark = [pytest.mark.mooncake, pytest.mark.skipif(missing_reason() is not None, reason=str(missing_reason()))]

KB = 64 << 10


def test_a_lease_pins_the_local_copy_and_names_what_only_the_pool_holds(shared_mooncake_master):
    pool = shared_mooncake_master.tier_config(segment="32MiB", namespace=uuid.uuid4().hex)
    with TieredStore.from_config({"tiers": [{"medium": "dram", "capacity": "512KiB", "eviction": "lru"},
                                            {"name": "pool", **pool}]}) as s:
        keys = [f"k{i}" for i in range(16)]
        s.put(keys, [torch.full((KB,), i, dtype=torch.uint8) for i in range(16)])
        assert s.drain_write_behind(30)
        where = s.locate(keys)
        local = [k for k, w in zip(keys, where) if w == "dram"]
        pooled = [k for k, w in zip(keys, where) if w == "pool"]
        assert local and pooled  # the first ones went down to the pool only
        with s.lease(keys, ttl_s=60) as lease:
            assert lease.held == len(local) and lease.unheld == pooled
            assert set(s.levels[0].pinned) == set(local)
        assert not s.levels[0].pinned
        assert all(s.contains(pooled))  # the release leaves the pool as it was
