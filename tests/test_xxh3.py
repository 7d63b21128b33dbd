"""``tierkv.xxh3``: xxHash's C functions called outside the interpreter lock give the values of the ``xxhash``
package's own functions, for every size and split, and so does the fallback when they are missing; a summed copy
moves every byte and sums exactly the bytes asked for."""

from __future__ import annotations

import itertools
import shutil

import pytest
import torch
import xxhash

from tierkv import xxh3
from tierkv.buffers import PARALLEL_COPY_MIN
from tierkv.checksum import chunk_sum, chunk_sums

SIZES = [0, 1, 15, 16, 17, 128, 129, 240, 241, 1023, 1024, 1025, 64 << 10, (256 << 10) + 3, (1 << 20) + 7]


def data(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def ref(t: torch.Tensor) -> int:
    return xxhash.xxh3_64_intdigest(t.numpy().tobytes())


@pytest.fixture(params=["fused", "fused-per-job", "native", "fallback"])
def way(request, monkeypatch):
    """fused: the C helper copies and sums (a batch in one call per thread); fused-per-job: one C call per
    job, as a build without the batch function does; native: xxHash's C functions called piece by piece;
    fallback: the package's Python functions."""
    if request.param.startswith("fused"):
        if not xxh3.FUSED:
            pytest.skip("tierkv's C helper was not built here")
        if request.param == "fused-per-job":
            monkeypatch.setattr(xxh3, "_FUSED_JOBS", None)
            monkeypatch.setattr(xxh3, "FUSED_BATCH", False)
        return request.param
    monkeypatch.setattr(xxh3, "_FUSED", None)
    monkeypatch.setattr(xxh3, "FUSED", False)
    if request.param == "native":
        if not xxh3.NATIVE:
            pytest.skip("this xxhash build exports no C functions")
    else:
        monkeypatch.setattr(xxh3, "_C", None)
        monkeypatch.setattr(xxh3, "NATIVE", False)
    return request.param


def test_the_native_functions_are_found_in_this_environment():
    assert xxh3.NATIVE  # (the wheel on PyPI exports them; a build that does not is slower, not wrong)


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler here")
def test_the_copy_helper_is_built_where_a_compiler_is():
    # (pip install builds tierkv/_copysum.c where it finds a compiler; without one the install goes on, slower)
    assert xxh3.FUSED and xxh3.FUSED_BATCH


@pytest.mark.parametrize("n", SIZES)
def test_one_range_and_any_split_give_the_packages_value(way, n):
    t = data(n, n)
    want = ref(t)
    assert xxh3.sum_at(t.data_ptr(), n) == want
    for cut in sorted({0, 1, n // 3, n // 2, max(n - 1, 0), n}):
        assert xxh3.sum_ranges([(t.data_ptr(), cut), (t.data_ptr() + cut, n - cut)]) == want
    assert chunk_sum([t]) == want
    assert chunk_sum([t[:n // 2], t[n // 2:]]) == want


def test_a_large_batch_is_summed_on_two_threads_with_the_same_values(way):
    objs = [data(3 << 20, i) for i in range(4)]  # (over PARALLEL_COPY_MIN in all)
    assert sum(o.numel() for o in objs) >= PARALLEL_COPY_MIN
    assert chunk_sums([[o[:100], o[100:]] for o in objs]) == [ref(o) for o in objs]


@pytest.mark.parametrize("total", [(1 << 20) + 16, 9 << 20])
@pytest.mark.parametrize("piece", [64 << 10, xxh3.PIECE_BYTES])
def test_a_summed_copy_moves_every_byte_and_sums_the_bytes_asked_for(way, monkeypatch, total, piece):
    # (64 KiB pieces: several per part, pieces across part edges; the default: a first part copied and summed whole)
    monkeypatch.setattr(xxh3, "PIECE_BYTES", piece)
    monkeypatch.setattr(xxh3, "FUSED_PIECE_BYTES", piece)
    n = 6
    srcs = [data(total, 10 + i) for i in range(n)]
    dsts = [torch.zeros(total, dtype=torch.uint8) for _ in range(n)]
    # object i: three parts of uneven sizes, the last one 16 bytes (a trailer left out of the sum)
    cuts = [0, (total - 16) // 3 + 5, total - 16, total]
    jobs = [[(d.data_ptr() + a, s.data_ptr() + a, b - a) for a, b in itertools.pairwise(cuts)]
            for s, d in zip(srcs, dsts)]
    sum_bytes = [total - 16, total - 16, total, 0, 1000, (64 << 10) + 1]
    got = xxh3.copy_and_sum(jobs, sum_bytes)
    for s, d in zip(srcs, dsts):
        assert torch.equal(s, d)
    assert got == [ref(s[:k]) for s, k in zip(srcs, sum_bytes)]


def test_a_summed_copy_of_a_chunk_and_its_trailer_sums_the_chunk_alone(way):
    # the shape of a pool's object: the chunk's bytes, then a 16-byte trailer left out of the sum
    srcs = [data((2 << 20) + 16, 40 + i) for i in range(5)] + [data(16, 45)]
    dsts = [torch.zeros_like(s) for s in srcs]
    jobs = [[(d.data_ptr(), s.data_ptr(), s.numel() - 16),
             (d.data_ptr() + s.numel() - 16, s.data_ptr() + s.numel() - 16, 16)] for s, d in zip(srcs, dsts)]
    jobs[-1] = jobs[-1][1:]  # (an empty chunk: its trailer alone)
    got = xxh3.copy_and_sum(jobs, [s.numel() - 16 for s in srcs])
    assert all(torch.equal(s, d) for s, d in zip(srcs, dsts))
    assert got == [ref(s[:-16]) for s in srcs]
    assert xxh3.copy_and_sum([[]], [0]) == [ref(data(0))]


def test_a_batch_with_empty_jobs_sums_them_as_nothing(way):
    s, d = data(1000, 50), torch.zeros(1000, dtype=torch.uint8)
    got = xxh3.copy_and_sum([[], [(d.data_ptr(), s.data_ptr(), 1000)], []], [0, 1000, 5])
    assert torch.equal(s, d)
    assert got == [ref(data(0)), ref(s), ref(data(0))]


def test_a_sum_length_for_every_job():
    with pytest.raises(ValueError, match="1 jobs but 2 sum lengths"):
        xxh3.copy_and_sum([[]], [0, 1])
