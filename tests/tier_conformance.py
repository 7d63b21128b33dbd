"""The contract every medium keeps, as a mixin (one suite, every tier).

Subclass ``TierConformance`` in a test module and provide a ``make_tier`` fixture
that returns a factory ``make_tier(capacity_bytes) -> Tier`` (the fixture owns
closing what it made).  Every test here then runs against that medium.

``LocatedTierConformance`` does the same for the located half of the interface
(``allocate`` / ``write_at`` / ``read_at`` / ``free_at`` / ``views_at``), with a
Hypothesis model (``LocatedModel``) that interleaves those calls against a plain
dict; ``tests/test_located_conformance.py`` runs it against every located medium.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from tierkv.errors import StoreClosedError
from tierkv.location_code import CODE_SHIFT, NB_FIELD
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
        got = tier.read([key(2, "s")], [[out]])
        assert len(got) == 1 and not got[0]  # False, or CORRUPT where the medium sees the other size

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


# -- the located half of Tier (tiers/base.py, "Located tiers") ---------------------------------------------------


def split_parts(t: torch.Tensor, cuts: list[int]) -> list[torch.Tensor]:
    """``t`` as consecutive parts cut at the sorted offsets ``cuts`` (empty parts included)."""
    edges = [0, *sorted(min(max(c, 0), t.numel()) for c in cuts), t.numel()]
    return [t[a:b] for a, b in itertools.pairwise(edges)]


#: the Hypothesis model's tier: small, so that every allocation path (slot classes, extents, a larger slot,
#: gathered pieces) is reached in a few steps
MODEL_CAPACITY = 96 << 10
MODEL_SIZES = st.one_of(
    st.integers(0, 64),
    st.sampled_from([256, 1000, 1024, 4096]),  # the few sizes of one model's chunks, twice as likely
    st.sampled_from([256, 1000, 1024, 4096]),
    st.integers(0, MODEL_CAPACITY // 3),
)


class LocatedModel(RuleBasedStateMachine):
    """A located tier driven by the level's calls, beside a plain model: code -> (nbytes, bytes written).

    Checked after every step: every object written reads back exact (so no two live objects share a byte),
    codes are positive ints that tell their nbytes, the footprints of live objects never exceed
    ``capacity_bytes`` and an allocation is refused only when its footprint does not fit in what is left
    (no fragmentation failure), ``used_bytes`` lies between the live objects' nbytes and their footprints.
    """

    make: Any = None  # capacity -> tier: set by ``LocatedTierConformance.test_model`` on a subclass

    def __init__(self) -> None:
        super().__init__()
        self.tier = type(self).make(MODEL_CAPACITY)
        self.live: dict[int, int] = {}  # code -> nbytes, of the objects of at least one byte
        self.empty: list[int] = []  # codes of empty objects (which hold no byte: they may share a code)
        self.data: dict[int, torch.Tensor] = {}  # code -> what was last written there
        self.host = self.tier.views_at([]) is not None

    def fp(self, n: int) -> int:
        return self.tier.footprint(n)

    def room(self) -> int:
        return self.tier.capacity_bytes - sum(self.fp(n) for n in self.live.values())

    def _take(self, sizes: list[int], codes: list) -> None:
        assert len(codes) == len(sizes), f"allocate answered {len(codes)} codes for {len(sizes)} sizes"
        room = self.room()
        for n, code in zip(sizes, codes):
            if code is None:
                assert self.fp(n) > room, f"allocate({n}) refused with {room} bytes free (fragmentation failure)"
                continue
            assert type(code) is int and code > 0, f"allocate answered {code!r}, not a positive int"
            if n == 0:
                assert self.tier.code_nbytes(code) == 0
                self.empty.append(code)
                continue
            assert code not in self.live, f"code {code} given out twice"
            assert self.fp(n) <= room, f"allocate({n}) placed an object with {room} bytes free: capacity exceeded"
            assert self.tier.code_nbytes(code) == n
            room -= self.fp(n)
            self.live[code] = n

    @rule(sizes=st.lists(MODEL_SIZES, min_size=1, max_size=12))
    def allocate(self, sizes):
        self._take(sizes, self.tier.allocate(sizes))

    @rule(n=st.sampled_from([0, 8, 256, 1000, 1024]), k=st.integers(9, 24))
    def allocate_a_batch_of_one_size(self, n, k):
        """Many objects of one size at once, as a model's chunks come; given back and taken again at once
        (the freed slots wait for the second batch: the batch fast path)."""
        codes = self.tier.allocate([n] * k)
        self._take([n] * k, codes)
        if n and None not in codes:
            self.tier.free_at(codes)
            for c in codes:
                del self.live[c]
            self._take([n] * k, self.tier.allocate([n] * k))

    @rule(data=st.data())
    def fill_to_the_last_byte(self, data):
        """Sizes whose footprints add up to exactly the room left are all placed; then nothing more fits."""
        room = self.room()
        sizes = []
        while room > 0:
            n = min(data.draw(MODEL_SIZES, label="size"), room) or room
            while n and self.fp(n) > room:
                n -= 1
            if not n:
                break
            sizes.append(n)
            room -= self.fp(n)
        codes = self.tier.allocate(sizes)
        assert None not in codes, f"{sizes} fit the {self.room()} bytes left, yet allocate refused {codes}"
        self._take(sizes, codes)
        assert self.room() == 0 or self.fp(1) > self.room()
        assert self.tier.allocate([1]) == [None], "an object was placed in a full tier"

    @precondition(lambda self: self.live)
    @rule(data=st.data(), with_ptrs=st.booleans())
    def write(self, data, with_ptrs):
        codes = data.draw(st.lists(st.sampled_from(sorted(self.live)), min_size=1, max_size=6, unique=True))
        vals = [torch.randint(0, 256, (self.live[c],), dtype=torch.uint8) for c in codes]
        if with_ptrs and self.host:  # vouched buffers: one contiguous host part of exactly the object's size
            self.tier.write_at(codes, [[v] for v in vals], [v.data_ptr() for v in vals])
        else:
            srcs = []
            for v in vals:
                cuts = data.draw(st.lists(st.integers(0, v.numel()), max_size=3))
                if data.draw(st.booleans(), label="strided source") and v.numel():
                    # a non-contiguous part: every second byte of a buffer twice as long
                    wide = torch.zeros(2 * v.numel(), dtype=torch.uint8)
                    wide[::2] = v
                    srcs.append([wide[::2]])
                else:
                    srcs.append(split_parts(v, cuts))
            self.tier.write_at(codes, srcs)
        for c, v in zip(codes, vals):
            self.data[c] = v

    @precondition(lambda self: self.data)
    @rule(data=st.data(), with_ptrs=st.booleans())
    def read(self, data, with_ptrs):
        codes = data.draw(st.lists(st.sampled_from(sorted(self.data)), min_size=1, max_size=6, unique=True))
        outs = [torch.full((self.live[c],), 0xA5, dtype=torch.uint8) for c in codes]
        if with_ptrs and self.host:
            got = self.tier.read_at(codes, [[o] for o in outs], [o.data_ptr() for o in outs])
        else:
            got = self.tier.read_at(codes, [split_parts(o, data.draw(st.lists(st.integers(0, o.numel()), max_size=3)))
                                            for o in outs])
        assert got == [True] * len(codes)
        for c, o in zip(codes, outs):
            assert torch.equal(o, self.data[c]), f"code {c}: the bytes read are not the bytes written"

    @precondition(lambda self: self.data)
    @rule(data=st.data(), delta=st.sampled_from([-1, 1, 8]))
    def read_into_a_wrong_size_is_a_miss(self, data, delta):
        c = data.draw(st.sampled_from(sorted(self.data)))
        if self.live[c] + delta < 0:
            return
        out = torch.zeros(self.live[c] + delta, dtype=torch.uint8)
        assert self.tier.read_at([c], [[out]]) == [False]

    @precondition(lambda self: self.live)
    @rule(data=st.data(), delta=st.sampled_from([-1, 1, 8]))
    def write_of_a_wrong_size_is_refused(self, data, delta):
        c = data.draw(st.sampled_from(sorted(self.live)))
        if self.live[c] + delta < 0:
            return
        with pytest.raises(ValueError, match="bytes"):
            self.tier.write_at([c], [[torch.zeros(self.live[c] + delta, dtype=torch.uint8)]])

    @precondition(lambda self: self.data)
    @rule(data=st.data())
    def views_alias_the_stored_bytes(self, data):
        codes = data.draw(st.lists(st.sampled_from(sorted(self.data)), min_size=1, max_size=6, unique=True))
        views = self.tier.views_at(codes)
        if views is None:
            assert not self.host
            return
        assert len(views) == len(codes)
        for c, parts in zip(codes, views):
            for p in parts:
                assert p.dtype == torch.uint8 and p.dim() == 1 and p.is_cpu and p.is_contiguous()
            got = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8)
            assert torch.equal(got, self.data[c]), f"code {c}: its views do not show the bytes written"
        # a view is the stored bytes themselves, not a copy: a new write shows through a view taken before it
        c, parts = codes[0], views[0]
        if self.live[c]:
            new = torch.randint(0, 256, (self.live[c],), dtype=torch.uint8)
            self.tier.write_at([c], [[new]])
            self.data[c] = new
            assert torch.equal(torch.cat(parts), new), f"code {c}: a view taken before a write does not show it"

    @precondition(lambda self: self.empty)
    @rule()
    def empty_objects_round_trip_and_free(self):
        none = torch.zeros(0, dtype=torch.uint8)
        self.tier.write_at(self.empty, [[none] for _ in self.empty])
        assert self.tier.read_at(self.empty, [[] for _ in self.empty]) == [True] * len(self.empty)
        self.tier.free_at(self.empty)
        self.empty = []

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        codes = data.draw(st.lists(st.sampled_from(sorted(self.live)), min_size=1, max_size=8, unique=True))
        self.tier.free_at(codes)
        for c in codes:
            del self.live[c]
            self.data.pop(c, None)

    @invariant()
    def accounting_and_bytes(self):
        assert self.room() >= 0, "the live objects' footprints exceed the capacity"
        nbytes = sum(self.live.values())
        assert nbytes <= self.tier.used_bytes <= sum(self.fp(n) for n in self.live.values())
        if self.data:  # every written object still holds its bytes: nothing written since overlapped it
            codes = sorted(self.data)
            outs = [torch.empty(self.live[c], dtype=torch.uint8) for c in codes]
            assert self.tier.read_at(codes, [[o] for o in outs]) == [True] * len(codes)
            for c, o in zip(codes, outs):
                assert torch.equal(o, self.data[c]), f"code {c} lost its bytes to another object"

    def teardown(self):
        self.tier.close()


class LocatedTierConformance:
    """The located half of ``Tier``: ``allocate`` / ``write_at`` / ``read_at`` / ``free_at`` / ``views_at`` /
    ``code_nbytes``, as the level calls them (the production path of ``hbm`` and ``dram``).

    Subclass it with a ``make_tier`` fixture as for ``TierConformance`` (``make_tier(capacity_bytes) -> Tier``,
    the fixture closes what it made) and ``model_tier``, a plain callable of the same shape that the
    Hypothesis model calls for each example (its teardown closes the tier)."""

    capacity = 4 << 20
    model_examples = 60

    @staticmethod
    def model_tier(capacity: int) -> Tier:
        raise NotImplementedError

    @pytest.fixture
    def tier(self, make_tier) -> Tier:
        return make_tier(self.capacity)

    def test_is_located(self, tier):
        assert tier.located is True and tier.managed is True

    def test_codes_are_positive_ints_that_tell_their_nbytes(self, tier):
        sizes = [0, 1, 7, 8, 9, 255, 4096, 4097, 65536, 65537, 1 << 20]
        codes = tier.allocate(sizes)
        assert None not in codes
        assert all(type(c) is int and c > 0 for c in codes) and len(set(codes)) == len(codes)
        assert [tier.code_nbytes(c) for c in codes] == sizes
        tier.free_at(codes)

    def test_write_at_then_read_at_exact_bytes(self, tier):
        sizes = [0, 1, 100, 4096, 70_000, 1 << 20]
        vals = [blob(i, n) for i, n in enumerate(sizes)]
        codes = tier.allocate(sizes)
        tier.write_at(codes, [[v] for v in vals])
        outs = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
        assert tier.read_at(codes, [[o] for o in outs]) == [True] * len(sizes)
        assert all(torch.equal(v, o) for v, o in zip(vals, outs))

    def test_parts_cross_any_boundary_either_way(self, tier):
        whole = blob(3, 10_000)
        (code,) = tier.allocate([whole.numel()])
        tier.write_at([code], [[whole[:1], whole[1:4097], whole[4097:4097], whole[4097:]]])
        out = torch.zeros(10_000, dtype=torch.uint8)
        assert tier.read_at([code], [split_parts(out, [5000, 5001, 9999])]) == [True]
        assert torch.equal(out, whole)

    def test_objects_larger_than_a_code_can_hold(self, make_tier):
        """nbytes at and past ``NB_FIELD``: the code's field saturates and ``code_nbytes`` still answers."""
        tier = make_tier(3 * NB_FIELD + (1 << 20))
        sizes = [NB_FIELD - 1, NB_FIELD, NB_FIELD + 1]
        codes = tier.allocate(sizes)
        assert None not in codes and [tier.code_nbytes(c) for c in codes] == sizes
        vals = [blob(i, n) for i, n in enumerate(sizes)]
        tier.write_at(codes, [[v] for v in vals])
        outs = [torch.empty(n, dtype=torch.uint8) for n in sizes]
        assert tier.read_at(codes, [[o] for o in outs]) == [True] * 3
        assert all(torch.equal(v, o) for v, o in zip(vals, outs))
        tier.free_at(codes)
        assert tier.allocate([3 * NB_FIELD]) != [None]  # their space is whole again

    def test_capacity_is_never_exceeded_and_freed_space_is_reused(self, tier):
        f = tier.footprint(4096)
        n = tier.capacity_bytes // f
        codes = tier.allocate([4096] * (n + 3))
        assert codes[n:] == [None] * 3 and None not in codes[:n]
        assert tier.allocate([1]) == [None] or tier.capacity_bytes - n * f >= tier.footprint(1)
        tier.free_at(codes[:n])
        again = tier.allocate([tier.capacity_bytes - tier.capacity_bytes % f])  # one object where there were n
        assert again != [None], "freed space is not reusable as one object"

    def test_a_refused_batch_entry_takes_nothing(self, tier):
        """A None in an allocate answer costs nothing: what it could not place is free afterwards too."""
        big = tier.capacity_bytes
        codes = tier.allocate([1000, big, 1000])
        assert codes[1] is None and codes[0] is not None and codes[2] is not None
        tier.free_at([codes[0], codes[2]])
        assert tier.allocate([big]) != [None]

    def test_a_batch_sees_the_space_its_own_earlier_entries_took(self, tier):
        """Slots popped for the first entries of a batch are not counted free for its later ones: the later
        ones are refused (None), never a crash or a leak."""
        codes = tier.allocate([1024] * (tier.capacity_bytes // 1024))
        assert None not in codes
        tier.free_at(codes[:4])  # 4 KiB free, in 1 KiB slots
        got = tier.allocate([1024, 3584, 1024])  # after the first, 3 KiB are free: 3.5 KiB does not fit
        assert got[0] is not None and got[1] is None and got[2] is not None
        tier.free_at([got[0], got[2]])
        assert None not in tier.allocate([1024] * 4)  # and nothing leaked

    def test_views_alias_the_stored_bytes(self, tier):
        vals = [blob(1, 3000), blob(2, 70_000)]
        codes = tier.allocate([v.numel() for v in vals])
        tier.write_at(codes, [[v] for v in vals])
        views = tier.views_at(codes)
        if views is None:
            pytest.skip(f"{tier.name} gives no host views (device memory)")
        for v, parts in zip(vals, views):
            assert torch.equal(torch.cat(parts), v)
        new = blob(3, 3000)
        tier.write_at(codes[:1], [[new]])
        assert torch.equal(torch.cat(views[0]), new)  # the same bytes, not a copy
        assert torch.equal(torch.cat(views[1]), vals[1])  # and only that object's
        tier.close()  # a view still held keeps its memory alive: reading it is never a use after free
        assert torch.equal(torch.cat(views[1]), vals[1])

    def test_bad_sizes_are_refused_by_name(self, tier):
        for bad in ([-1], [1, -8]):
            with pytest.raises(ValueError, match="size"):
                tier.allocate(bad)
        for bad in ([1.5], ["8"], [None], [True], 8, "8"):
            with pytest.raises(TypeError, match="size"):
                tier.allocate(bad)
        assert tier.used_bytes == 0  # and nothing was taken
        codes = tier.allocate(list(np.array([8, 16], dtype=np.int64)))  # an integer of any type is a size
        assert None not in codes and [tier.code_nbytes(c) for c in codes] == [8, 16]
        tier.free_at(codes)
        assert tier.allocate([tier.capacity_bytes]) != [None]

    def test_codes_it_never_gave_out_are_refused(self, make_tier):
        """A code no ``allocate`` answered (not positive, not odd, naming no place of this tier) is a ValueError
        on every located call, and nothing moves: never a copy outside the tier's memory."""
        tier = make_tier(2 * NB_FIELD)
        vals = [blob(1, 16), blob(2, NB_FIELD + 8)]
        live = tier.allocate([v.numel() for v in vals])
        tier.write_at(live, [[v] for v in vals])
        nowhere = (1 << 40) << CODE_SHIFT
        for bad in (0, -1, -(16 << 1 | 1), 16 << 1, nowhere | 16 << 1 | 1, nowhere | NB_FIELD << 1 | 1):
            buf = torch.zeros(16, dtype=torch.uint8)
            with pytest.raises(ValueError, match="code"):
                tier.write_at([bad], [[buf]])
            with pytest.raises(ValueError, match="code"):
                tier.read_at([bad], [[buf]])
            if tier.views_at([]) is not None:  # (a tier without host views answers None, whatever the codes)
                with pytest.raises(ValueError, match="code"):
                    tier.views_at([live[0], bad])
            with pytest.raises(ValueError, match="code"):
                tier.code_nbytes(bad)
            with pytest.raises(ValueError, match="code"):
                tier.free_at([live[1], bad])  # checked before anything is freed
        outs = [torch.zeros(v.numel(), dtype=torch.uint8) for v in vals]
        assert tier.read_at(live, [[o] for o in outs]) == [True, True]
        assert all(torch.equal(v, o) for v, o in zip(vals, outs))
        tier.free_at(live)
        with pytest.raises(ValueError, match="code"):
            tier.free_at(live[1:])  # a large object's code is gone once freed: a second free is refused

    def test_threads_allocating_writing_and_freeing_at_once(self, tier):
        """The level's callers run on several threads (requests, write-behind, promotion): each thread's
        objects keep their bytes, and once all are freed every byte of the capacity is free again."""
        errors: list[BaseException] = []

        def churn(seed: int) -> None:
            try:
                g = torch.Generator().manual_seed(seed)
                held: list[tuple[int, torch.Tensor]] = []
                for r in range(60):
                    sizes = [int(x) for x in torch.randint(0, 9000, (4,), generator=g)]
                    codes = tier.allocate(sizes)
                    got = [(c, torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g))
                           for c, n in zip(codes, sizes) if c is not None]
                    tier.write_at([c for c, _ in got], [[v] for _, v in got])
                    held += got
                    outs = [torch.empty_like(v) for _, v in held]
                    assert tier.read_at([c for c, _ in held], [[o] for o in outs]) == [True] * len(held)
                    for (c, v), o in zip(held, outs):
                        assert torch.equal(v, o), f"thread {seed}: code {c} lost its bytes"
                    if r % 3 == 2:  # give back half of what this thread holds
                        tier.free_at([c for c, _ in held[::2]])
                        held = held[1::2]
                tier.free_at([c for c, _ in held])
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=churn, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors[0]
        assert tier.used_bytes == 0
        assert tier.allocate([tier.capacity_bytes]) != [None], "space was lost to the threads' churn"

    def test_attached_the_level_holds_the_index(self, make_tier):
        """Once a level attaches it, ``read`` / ``contains`` by key go through the level's index, and ``write`` /
        ``delete`` by key are refused (the level alone places objects); a tier holding objects of its own
        cannot be attached."""
        used = make_tier(1 << 20)
        used.write([key(1)], [[blob(1, 100)]])
        with pytest.raises(RuntimeError, match="attach it empty"):
            used.attach(lambda keys: [None] * len(keys))
        tier = make_tier(1 << 20)
        v = blob(2, 5000)
        (code,) = tier.allocate([v.numel()])
        tier.write_at([code], [[v]])
        index = {key(2): code}
        tier.attach(lambda keys: [index.get(k) for k in keys])
        assert tier.contains([key(2), key(3)]) == [True, False]
        out = torch.zeros(5000, dtype=torch.uint8)
        assert tier.read([key(3), key(2)], [[torch.zeros(1, dtype=torch.uint8)], [out]]) == [False, True]
        assert torch.equal(out, v)
        with pytest.raises(RuntimeError, match="by key"):
            tier.write([key(4)], [[blob(4, 10)]])
        with pytest.raises(RuntimeError, match="by key"):
            tier.delete([key(2)])

    def test_mismatched_batches_are_refused(self, tier):
        codes = tier.allocate([16, 16])
        with pytest.raises(ValueError, match="2 codes"):
            tier.write_at(codes, [[torch.zeros(16, dtype=torch.uint8)]])
        with pytest.raises(ValueError, match="2 codes"):
            tier.read_at(codes, [[torch.zeros(16, dtype=torch.uint8)]] * 3)

    def test_a_closed_tier_refuses_located_calls(self, tier):
        (code,) = tier.allocate([64])
        tier.close()
        tier.free_at([code])  # the space went with the tier: giving it back is a no-op
        with pytest.raises(StoreClosedError):
            tier.allocate([64])
        with pytest.raises(StoreClosedError):
            tier.write_at([code], [[torch.zeros(64, dtype=torch.uint8)]])
        with pytest.raises(StoreClosedError):
            tier.read_at([code], [[torch.zeros(64, dtype=torch.uint8)]])

    def test_model(self):
        model = type(f"{type(self).__name__}Model", (LocatedModel,), {"make": staticmethod(self.model_tier)})
        run_state_machine_as_test(model, settings=settings(
            max_examples=self.model_examples, stateful_step_count=30, deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))
