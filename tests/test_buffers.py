"""Part lists: coalescing neighbours and copying between differently cut part lists."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv.buffers import coalesce, copy_many, copy_parts, host_copy, memmove_many


def _cut(base: torch.Tensor, sizes: list[int], gaps: list[int]) -> list[torch.Tensor]:
    parts, off = [], 0
    for n, g in zip(sizes, gaps):
        off += g
        parts.append(base[off:off + n])
        off += n
    return parts


@st.composite
def part_lists(draw):
    """Views of one or two base tensors: some adjacent, some with gaps, sometimes out of order."""
    sizes = draw(st.lists(st.integers(1, 64), min_size=1, max_size=12))
    gaps = draw(st.lists(st.sampled_from([0, 0, 0, 1, 7]), min_size=len(sizes), max_size=len(sizes)))
    a = torch.zeros(sum(sizes) + sum(gaps) + 8, dtype=torch.uint8)
    b = torch.zeros_like(a)
    parts = _cut(a, sizes, gaps)
    if draw(st.booleans()) and len(parts) > 2:  # splice in a part of another tensor
        i = draw(st.integers(0, len(parts) - 1))
        parts[i] = b[: parts[i].numel()]
    if draw(st.booleans()):
        order = draw(st.permutations(range(len(parts))))
        parts = [parts[i] for i in order]
    return parts


@settings(max_examples=200, deadline=None)
@given(part_lists())
def test_coalesce_keeps_the_bytes_and_their_order(parts):
    for i, p in enumerate(parts):
        p.copy_(torch.arange(p.numel(), dtype=torch.int64).add(i * 31).remainder(251).to(torch.uint8))
    before = torch.cat([p.clone() for p in parts])
    merged = coalesce(parts)
    assert len(merged) <= len(parts)
    assert torch.equal(torch.cat(list(merged)), before)
    # every merged part is a view of memory some input part covered
    lo = min(p.data_ptr() for p in parts)
    assert all(m.data_ptr() >= lo for m in merged)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_copy_parts_between_any_two_cuts(data):
    src = data.draw(part_lists(), "src")
    total = sum(p.numel() for p in src)
    dst_sizes = data.draw(st.lists(st.integers(1, total), min_size=1, max_size=6), "cuts")
    cuts = sorted({min(total, c) for c in dst_sizes} | {total})
    dst_base = torch.full((total + 64,), 255, dtype=torch.uint8)
    gap = data.draw(st.sampled_from([0, 3]), "gap")
    dst, prev, off = [], 0, 0
    for c in cuts:
        dst.append(dst_base[off:off + c - prev])
        off += c - prev + gap
        prev = c
    payload = torch.randint(0, 255, (total,), dtype=torch.uint8)
    pos = 0
    for p in src:
        p.copy_(payload[pos:pos + p.numel()])
        pos += p.numel()
    # sources that alias each other (a spliced part of tensor b reused) read back as written last
    expect = torch.cat([p.clone() for p in src])
    copy_parts(dst, src)
    assert torch.equal(torch.cat(dst), expect)
    if gap:  # bytes between the destination parts are untouched
        assert int(dst_base[cuts[0]]) == 255 or len(cuts) == 1


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 4096), st.integers(0, 64), st.integers(0, 64),
       st.sampled_from([torch.uint8, torch.float32, torch.bfloat16, torch.int64]))
def test_host_copy_moves_exactly_the_bytes_and_nothing_around_them(n, doff, soff, dtype):
    size = torch.tensor([], dtype=dtype).element_size()
    doff, soff = doff * size, soff * size  # views of another dtype start on its element boundary
    src_base = torch.randint(0, 255, (n + soff + 16,), dtype=torch.uint8)
    dst_base = torch.full((n + doff + 16,), 7, dtype=torch.uint8)
    k = n // size * size
    src = src_base[soff:soff + k].view(dtype)
    dst = dst_base[doff:doff + k].view(dtype)
    host_copy(dst, src)
    assert torch.equal(dst_base[doff:doff + k], src_base[soff:soff + k])
    assert bool((dst_base[:doff] == 7).all()) and bool((dst_base[doff + k:] == 7).all())


def test_host_copy_falls_back_to_copy_for_strided_and_converting_copies():
    src = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    dst = torch.zeros(8, 8, dtype=torch.float32)
    host_copy(dst, src.t())  # a transposed (non-contiguous) source: element order, not byte order
    assert torch.equal(dst, src.t())
    wide = torch.zeros(8, 8, dtype=torch.float64)
    host_copy(wide, src)  # a dtype conversion: values, not bytes
    assert torch.equal(wide, src.double())
    with pytest.raises(RuntimeError):
        host_copy(torch.zeros(3), torch.zeros(5))  # sizes disagree: torch's own error, never a partial memmove


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 3 << 20), min_size=1, max_size=12), st.booleans())
def test_copy_many_copies_every_pair_on_one_thread_or_two(sizes, split_parts):
    """Batches above PARALLEL_COPY_MIN run on two threads; either way every destination gets its source."""
    srcs = [torch.randint(0, 255, (n,), dtype=torch.uint8) for n in sizes]
    dst_base = torch.zeros(sum(sizes) + len(sizes), dtype=torch.uint8)
    jobs, off = [], 0
    for s in srcs:
        d = dst_base[off:off + s.numel()]
        off += s.numel() + 1  # one untouched byte between destinations
        jobs.append(([d[: s.numel() // 2], d[s.numel() // 2:]] if split_parts else [d], [s]))
    copy_many(jobs)
    off = 0
    for s in srcs:
        assert torch.equal(dst_base[off:off + s.numel()], s)
        off += s.numel()
        if off < dst_base.numel():
            assert int(dst_base[off]) == 0
        off += 1


def test_copy_many_reports_a_failed_copy():
    with pytest.raises(RuntimeError):
        copy_many([([torch.zeros(8 << 20, dtype=torch.uint8)], [torch.zeros(8 << 20, dtype=torch.uint8)]),
                   ([torch.zeros(3)], [torch.zeros(5)])])


@settings(max_examples=20, deadline=None)
@given(st.lists(st.integers(0, 3 << 20), min_size=1, max_size=10))
def test_memmove_many_moves_every_range(sizes):
    src = torch.randint(0, 255, (sum(sizes),), dtype=torch.uint8)
    dst = torch.zeros(sum(sizes) + len(sizes), dtype=torch.uint8)
    moves, s_off, d_off, expect = [], 0, 0, []
    for n in sizes:  # destinations in reverse order, one untouched byte after each
        moves.append((dst.data_ptr() + d_off, src.data_ptr() + s_off, n))
        expect.append((d_off, s_off, n))
        s_off += n
        d_off += n + 1
    memmove_many(moves[::-1])
    for d, s, n in expect:
        assert torch.equal(dst[d:d + n], src[s:s + n])
        if d + n < dst.numel():
            assert int(dst[d + n]) == 0


@pytest.mark.parametrize("which", ["copy_many", "memmove_many"])
def test_a_large_batch_does_not_wait_for_a_helper_busy_elsewhere(which):
    """While the helper thread is held by another caller's work, a large batch is done by its own caller
    (every byte exact) and returns without waiting for the helper."""
    import threading

    from tierkv import buffers

    n, size = 12, 1 << 20  # 12 MiB: above PARALLEL_COPY_MIN
    assert n * size >= buffers.PARALLEL_COPY_MIN
    srcs = [torch.randint(0, 255, (size,), dtype=torch.uint8) for _ in range(n)]
    dsts = [torch.zeros(size, dtype=torch.uint8) for _ in range(n)]
    release, held = threading.Event(), threading.Event()

    def hold():
        held.set()
        release.wait(30)

    blocker = buffers._copy_helper().submit(hold)
    assert held.wait(10)
    done = threading.Event()

    def work():
        if which == "copy_many":
            copy_many([([d], [s]) for d, s in zip(dsts, srcs)])
        else:
            memmove_many([(d.data_ptr(), s.data_ptr(), size) for d, s in zip(dsts, srcs)])
        done.set()

    t = threading.Thread(target=work)
    t.start()
    try:
        assert done.wait(20), "the batch waited for the busy helper"
    finally:
        release.set()
        t.join(30)
        blocker.result(30)
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs))


def test_to_parts_ptrs_gives_addresses_only_for_a_batch_of_flat_host_bytes():
    from tierkv.buffers import to_parts_ptrs

    flat = [torch.arange(n, dtype=torch.uint8) for n in (0, 5, 300)]
    prepared, ptrs = to_parts_ptrs(flat, "values")
    assert [nb for _, nb in prepared] == [0, 5, 300]
    assert ptrs == [t.data_ptr() for t in flat]
    # one value of another kind anywhere in the batch: no addresses (the tier checks every part itself)
    for other in ([torch.zeros(4, dtype=torch.uint8)[::2].contiguous(), torch.zeros(2, dtype=torch.float32)],
                  torch.zeros(3, dtype=torch.int16), torch.zeros((2, 2), dtype=torch.uint8)):
        prepared, ptrs = to_parts_ptrs([*flat, other], "values")
        assert ptrs is None and len(prepared) == 4


@pytest.mark.parametrize("large", [False, True])
def test_store_reads_and_writes_by_address_exactly_the_bytes_of_each_chunk(large):
    """Batches of flat host tensors go by address, others by parts, side-table chunks (16 MiB and up) by
    their location: every chunk comes back exact, and nothing beside a buffer is written."""
    from tierkv import Level, TieredStore
    from tierkv.tiers.dram import DRAMTier

    big = (16 << 20) + 3 if large else 700
    sizes = [1, 8, 13, 64, 255, big, 0, 4096]
    g = torch.Generator().manual_seed(5)
    vals = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in sizes]
    store = TieredStore([Level(DRAMTier("dram", 64 << 20))])
    try:
        keys = [f"k{i}" for i in range(len(sizes))]
        assert store.put(keys, vals) == [True] * len(keys)
        # flat host outs inside a larger buffer with guard bytes around each
        guard = 7
        buf = torch.full((sum(sizes) + guard * (len(sizes) + 1),), 0xAB, dtype=torch.uint8)
        outs, off = [], guard
        for n in sizes:
            outs.append(buf[off:off + n])
            off += n + guard
        assert store.get(keys, outs) == [True] * len(keys)
        for o, v in zip(outs, vals):
            assert torch.equal(o, v)
        off = 0
        for n in sizes:
            assert bool((buf[off:off + guard] == 0xAB).all())
            off += guard + n
        assert bool((buf[off:] == 0xAB).all())
        # the same reads with one out given as two parts (no addresses for the batch)
        outs2 = [torch.empty(n, dtype=torch.uint8) for n in sizes]
        split = [outs2[2][:5], outs2[2][5:]]
        assert store.get(keys, [*outs2[:2], split, *outs2[3:]]) == [True] * len(keys)
        for o, v in zip(outs2, vals):
            assert torch.equal(o, v)
        # a buffer of the wrong size is refused by name before anything is read
        with pytest.raises(Exception, match="bytes"):
            store.get(keys[:2], [outs2[0], torch.empty(9, dtype=torch.uint8)])
    finally:
        store.close()


def test_host_views_are_taken_on_trust_and_checked_where_they_are_made():
    """``HostViews`` carry each view's address and size; ``to_parts_ptrs`` takes them as they are, and
    the views themselves are exactly the spans asked for."""
    from tierkv.buffers import HostViews, to_parts_ptrs

    flat = torch.arange(256, dtype=torch.uint8).repeat(4)
    v = HostViews.over(flat)
    v.add(3, 10)
    v.add_rows(100, 4, 16)
    v.add(1000, 0)
    assert [t.numel() for t in v] == v.sizes == [10, 16, 16, 16, 16, 0]
    assert v.ptrs == [t.data_ptr() for t in v]
    assert torch.equal(v[0], flat[3:13]) and torch.equal(v[4], flat[148:164])
    prepared, ptrs = to_parts_ptrs(v, "values")
    assert ptrs == v.ptrs and [nb for _, nb in prepared] == v.sizes
    assert all(len(p[0]) == 1 and p[0][0] is t for p, t in zip(prepared, v))
    # spans outside the tensor, and tensors views cannot be trusted over, are refused where made
    for bad in ((-1, 4), (1020, 8), (0, 1025)):
        with pytest.raises(ValueError, match="outside"):
            v.add(*bad)
    with pytest.raises(ValueError, match="outside"):
        v.add_rows(1000, 2, 16)
    for t in (torch.zeros(8, dtype=torch.float32), torch.zeros((2, 4), dtype=torch.uint8),
              torch.zeros(8, dtype=torch.uint8)[::2]):
        with pytest.raises(ValueError, match="flat, contiguous uint8 host tensor"):
            HostViews.over(t)
    # joined lists keep every address; nothing more can be cut into them
    w = HostViews.over(torch.zeros(64, dtype=torch.uint8))
    w.add_rows(0, 2, 32)
    j = HostViews.join([v, w])
    assert j.ptrs == v.ptrs + w.ptrs and [t.data_ptr() for t in j] == j.ptrs and j.sizes == [*v.sizes, 32, 32]
    with pytest.raises(TypeError, match="joined"):
        j.add(0, 1)
    with pytest.raises(TypeError, match="HostViews.join takes HostViews"):
        HostViews.join([v, [flat]])  # type: ignore[list-item]


# same spy shape as test_integrity's copy_and_sum spy: each test wraps a different function of a different module
def test_the_store_hands_host_views_to_to_parts_ptrs_as_they_are(monkeypatch):
    """put and get pass a ``HostViews`` batch on unconverted (a plain list would lose its addresses)."""
    import tierkv.store as store_mod
    from tierkv import Level, TieredStore
    from tierkv.buffers import HostViews
    from tierkv.tiers.dram import DRAMTier

    seen = []
    real = store_mod.to_parts_ptrs

    def spy(values, what):
        seen.append(type(values))
        return real(values, what)

    monkeypatch.setattr(store_mod, "to_parts_ptrs", spy)
    src = torch.randint(0, 256, (256,), dtype=torch.uint8)
    v = HostViews.over(src)
    v.add_rows(0, 4, 64)
    dst = HostViews.over(torch.zeros(256, dtype=torch.uint8))
    dst.add_rows(0, 4, 64)
    store = TieredStore([Level(DRAMTier("dram", 1 << 20))])
    try:
        keys = [f"s{i}" for i in range(4)]
        assert store.put(keys, v) == [True] * 4
        assert store.get(keys, dst) == [True] * 4
        assert all(torch.equal(a, b) for a, b in zip(v, dst))
    finally:
        store.close()
    assert seen == [HostViews, HostViews]


def test_a_host_views_list_changed_by_hand_is_checked_view_by_view():
    """A list whose ends no longer match their addresses (changed other than through its methods), or
    one made without ``over``, goes through the checks of any other batch: exact bytes either way."""
    from tierkv import Level, TieredStore
    from tierkv.buffers import HostViews, to_parts_ptrs
    from tierkv.tiers.dram import DRAMTier

    flat = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    v = HostViews.over(flat)
    v.add_rows(0, 8, 64)
    other = torch.randint(0, 256, (64,), dtype=torch.uint8)
    v[-1] = other  # by hand: its address list still names the old view
    prepared, ptrs = to_parts_ptrs(v, "values")
    assert ptrs == [t.data_ptr() for t in v] and ptrs[-1] == other.data_ptr()
    bare = HostViews([flat[:4], flat[4:8]])  # never given addresses
    assert to_parts_ptrs(bare, "values")[1] == [flat.data_ptr(), flat.data_ptr() + 4]
    store = TieredStore([Level(DRAMTier("dram", 1 << 20))])
    try:
        keys = [f"h{i}" for i in range(8)]
        assert store.put(keys, v) == [True] * 8
        outs = HostViews.over(torch.zeros(512, dtype=torch.uint8))
        outs.add_rows(0, 8, 64)
        assert store.get(keys, outs) == [True] * 8
        for o, want in zip(outs, v):
            assert torch.equal(o, want)
    finally:
        store.close()


@st.composite
def host_view_ops(draw):
    size = draw(st.integers(1, 2048))
    ops = []
    for _ in range(draw(st.integers(0, 12))):
        if draw(st.booleans()):
            start = draw(st.integers(0, size))
            ops.append(("add", start, draw(st.integers(0, size - start))))
        else:
            n = draw(st.integers(1, 64))
            start = draw(st.integers(0, size))
            count = draw(st.integers(0, max(0, (size - start) // n)))
            ops.append(("rows", start, count, n))
    return size, ops


@settings(max_examples=150, deadline=None)
@given(host_view_ops())
def test_host_views_addresses_always_name_their_views(case):
    """Any list built through ``add`` / ``add_rows``: ``to_parts_ptrs`` gives what the per-view checks
    give (each view's own address and size), and a store takes and returns its bytes exactly."""
    from tierkv import Level, TieredStore
    from tierkv.buffers import HostViews, to_parts_ptrs
    from tierkv.tiers.dram import DRAMTier

    size, ops = case
    flat = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(size))
    v = HostViews.over(flat)
    for op in ops:
        if op[0] == "add":
            v.add(op[1], op[2])
        else:
            v.add_rows(op[1], op[2], op[3])
    prepared, ptrs = to_parts_ptrs(v, "values")
    plain_prepared, plain_ptrs = to_parts_ptrs(list(v), "values")
    assert [nb for _, nb in prepared] == [nb for _, nb in plain_prepared] == [t.numel() for t in v]
    assert [p for p, t in zip(ptrs, v) if t.numel()] == [t.data_ptr() for t in v if t.numel()]
    assert plain_ptrs is not None and [p for p, t in zip(plain_ptrs, v) if t.numel()] == \
        [p for p, t in zip(ptrs, v) if t.numel()]
    if not v:
        return
    store = TieredStore([Level(DRAMTier("dram", 1 << 20))])
    try:
        keys = [f"p{i}" for i in range(len(v))]
        assert store.put(keys, v) == [True] * len(v)  # (repeated spans are distinct keys: stored twice)
        out_flat = torch.zeros(sum(v.sizes), dtype=torch.uint8)
        outs = HostViews.over(out_flat)
        pos = 0
        for n in v.sizes:
            outs.add(pos, n)
            pos += n
        assert store.get(keys, outs) == [True] * len(v)
        for o, want in zip(outs, v):
            assert torch.equal(o, want)
    finally:
        store.close()
