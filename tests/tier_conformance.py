"""The contract every medium keeps, as a mixin (one suite, every tier).

Subclass ``TierConformance`` in a test module and provide a ``make_tier`` fixture
that returns a factory ``make_tier(capacity_bytes) -> Tier`` (the fixture owns
closing what it made).  Every test here then runs against that medium.
"""

from __future__ import annotations

import pytest
import torch

from tierkv.tiers.base import Tier


def fail_nth(real, n: int, calls: list, sticky: bool = False):
    """A stand-in for a write call ``real(fd, buf_or_bufs, offset)`` whose ``n``-th call (from 0) raises EIO
    (``sticky``: and every call after it, a device that stays broken); every call's offset goes to ``calls``
    (one list can count the calls of several stand-ins together)."""
    import errno

    def flaky(fd, bufs, off):
        calls.append(off)
        if len(calls) - 1 == n or (sticky and len(calls) - 1 > n):
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, bufs, off)

    return flaky


def blob(seed: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def key(i: int, tag: str = "k") -> str:
    return f"{tag}{i:04d}" + "0" * 32


class TierConformance:
    capacity = 4 << 20

    @pytest.fixture
    def tier(self, make_tier) -> Tier:
        return make_tier(self.capacity)

    def test_is_a_tier(self, tier):
        assert isinstance(tier, Tier)
        assert tier.capacity_bytes > 0
        assert isinstance(tier.name, str) and tier.name

    def test_write_then_read_exact_bytes(self, tier):
        keys = [key(i) for i in range(4)]
        vals = [blob(i, 1000 + 4096 * i) for i in range(4)]
        assert tier.write(keys, [[v] for v in vals]) == [True] * 4
        outs = [torch.zeros_like(v) for v in vals]
        assert tier.read(keys, [[o] for o in outs]) == [True] * 4
        for v, o in zip(vals, outs):
            assert torch.equal(v, o)

    def test_contains_reflects_writes_and_deletes(self, tier):
        keys = [key(i, "c") for i in range(3)]
        assert tier.contains(keys) == [False] * 3
        tier.write(keys[:2], [[blob(1, 100)], [blob(2, 100)]])
        assert tier.contains(keys) == [True, True, False]
        tier.delete([keys[0], keys[2]])  # absent key ignored
        assert tier.contains(keys) == [False, True, False]

    def test_read_of_absent_key_is_a_miss(self, tier):
        out = torch.zeros(64, dtype=torch.uint8)
        assert tier.read([key(9, "absent")], [[out]]) == [False]

    def test_multi_part_objects_round_trip_across_part_boundaries(self, tier):
        whole = blob(7, 10_000)
        parts_in = [whole[:1], whole[1:4097], whole[4097:]]
        assert tier.write([key(1, "m")], [parts_in]) == [True]
        parts_out = [torch.zeros(5000, dtype=torch.uint8), torch.zeros(5000, dtype=torch.uint8)]
        assert tier.read([key(1, "m")], [parts_out]) == [True]
        assert torch.equal(torch.cat(parts_out), whole)

    def test_read_into_wrong_size_is_not_a_hit(self, tier):
        tier.write([key(2, "s")], [[blob(3, 512)]])
        out = torch.zeros(511, dtype=torch.uint8)
        assert tier.read([key(2, "s")], [[out]]) == [False]

    def test_batch_results_are_per_key(self, tier):
        tier.write([key(1, "b")], [[blob(1, 256)]])
        outs = [torch.zeros(256, dtype=torch.uint8) for _ in range(3)]
        got = tier.read([key(0, "b"), key(1, "b"), key(2, "b")], [[o] for o in outs])
        assert got == [False, True, False]
        assert torch.equal(outs[1], blob(1, 256))

    def test_caller_buffers_are_not_retained(self, tier):
        src = blob(5, 4096)
        keep = src.clone()
        tier.write([key(5, "o")], [[src]])
        src.zero_()  # the caller reuses its buffer right away
        out = torch.zeros(4096, dtype=torch.uint8)
        assert tier.read([key(5, "o")], [[out]]) == [True]
        assert torch.equal(out, keep)

    def test_footprint_covers_bytes(self, tier):
        for n in (1, 255, 4096, 1 << 20):
            assert tier.footprint(n) >= n

    def test_used_bytes_tracks_contents(self, tier):
        before = tier.used_bytes
        assert tier.write([key(1, "u")], [[blob(1, 8192)]]) == [True]
        held = tier.used_bytes
        assert held > before, "used_bytes did not grow when an object was stored"
        assert held <= before + tier.footprint(8192)
        tier.delete([key(1, "u")])
        assert tier.used_bytes < held, "used_bytes did not shrink when the object was deleted"

    def test_stats_and_availability(self, tier):
        assert tier.available
        assert isinstance(tier.extra_stats(), dict)
