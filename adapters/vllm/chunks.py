"""Which stored objects hold which blocks: the connector's chunking rules.

The connector stores a request's KV in *chunks* of ``chunk_blocks`` consecutive
engine blocks (``chunk_tokens // block_size``), one object per chunk and slice, so
that a long prompt is a few large objects rather than thousands of small ones.
Chunk boundaries are fixed in block space: chunk ``g`` covers blocks
``g*chunk_blocks`` to ``(g+1)*chunk_blocks - 1`` of any request.

An object is named by the engine hash of its **last** block.  Engine block
hashes are chained over the whole prefix, so that one hash fixes the prefix, the
block index ``j`` and therefore the object's first block (``j`` rounded down to a
multiple of ``chunk_blocks``): equal keys
always mean equal bytes.  Two kinds of object exist:

* a *full* chunk, every block of chunk ``g``, saved as soon as its last block is
  computed;
* a *tail*, ``g*chunk_blocks .. j`` with ``j`` short of the chunk end, saved once a prompt's
  prefill is complete, so a prompt repeated exactly is served to its last full block.

A request can use a tail of another request only when they share every block of it.
Divergence inside a chunk costs at most ``chunk_blocks-1`` blocks of reuse; ``chunk_tokens``
equal to the block size gives one object per block and no such loss.

Everything here is pure block arithmetic: no engine, no store.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Chunk = tuple[int, int]  # (first block, last block), inclusive


def blocks_per_chunk(chunk_tokens: int, block_size: int) -> int:
    """``chunk_blocks``: engine blocks per stored chunk (at least one)."""
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be a positive integer, got {chunk_tokens!r}")
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    return max(1, chunk_tokens // block_size)


def resolve(
    lo: int,
    hi: int,
    known: int,
    chunk_blocks: int,
    full_present: Callable[[list[int]], int],
    tail_present: Callable[[list[int]], int | None],
) -> list[Chunk]:
    """Stored chunks that cover the leading blocks of ``lo .. hi-1``, in order.

    ``known``: blocks ``0 .. known-1`` have hashes (objects ending past it cannot
    be named).  ``full_present(ends)`` says how many leading full chunks, given by
    their last blocks, are stored; ``tail_present(ends)`` returns the first of
    ``ends`` that is stored, or None.  Only the first chunk that is not stored
    whole is served by a tail: a tail never covers a whole chunk, so nothing can
    follow it.  Among tails, the shortest one reaching ``hi-1`` is preferred
    (fewest bytes to read), then the longest that falls short.
    """
    if hi <= lo or chunk_blocks <= 0:
        return []
    g0 = lo // chunk_blocks
    ends: list[int] = []
    g = g0
    while g * chunk_blocks < hi and (g + 1) * chunk_blocks <= known:
        ends.append((g + 1) * chunk_blocks - 1)
        g += 1
    n = min(len(ends), max(0, int(full_present(ends)))) if ends else 0
    out: list[Chunk] = [(e - chunk_blocks + 1, e) for e in ends[:n]]
    g = g0 + n
    if g * chunk_blocks >= hi:
        return out
    cands = tail_candidates(g, lo, hi, known, chunk_blocks)
    if not cands:
        return out
    j = tail_present(cands)
    if j is not None:
        if j not in cands:
            raise ValueError(f"tail_present returned {j}, not one of the candidates")
        out.append((g * chunk_blocks, j))
    return out


def tail_candidates(g: int, lo: int, hi: int, known: int, chunk_blocks: int) -> list[int]:
    """The last blocks of the tails of chunk ``g`` that may serve ``lo .. hi-1``, by preference.

    A tail of chunk ``g`` ends short of the chunk's end and at a named block; the
    shortest reaching ``hi-1`` comes first, then the longer ones, then those falling
    short, longest first.
    """
    top = min(known - 1, (g + 1) * chunk_blocks - 2)
    bottom = max(lo, g * chunk_blocks)
    if top < bottom:
        return []
    reach = hi - 1
    return [j for j in range(bottom, top + 1) if j >= reach] + list(range(min(top, reach - 1), bottom - 1, -1))


def covered(chunks: Sequence[Chunk], lo: int, hi: int) -> int:
    """How many blocks of ``lo .. hi-1``, counted from ``lo``, the chunks cover."""
    if not chunks or hi <= lo:
        return 0
    return max(0, min(hi, chunks[-1][1] + 1) - lo)


def plan_saves(next_chunk: int, tail_end: int, end: int, final: bool, chunk_blocks: int) -> tuple[list[Chunk], int, int]:
    """Chunks to save once blocks ``0 .. end-1`` are computed.

    ``next_chunk``: the first chunk not yet saved (or known stored);
    ``tail_end``: one past the last block of the longest tail saved for the
    request (or known stored); ``final``: this step completes the prompt's
    prefill, so its trailing blocks are saved as a tail (once: blocks generated
    later are saved in full chunks only, never as a growing series of tails).  Returns ``(chunks, next_chunk, tail_end)``.
    """
    out: list[Chunk] = []
    g = next_chunk
    while (g + 1) * chunk_blocks <= end:
        out.append((g * chunk_blocks, (g + 1) * chunk_blocks - 1))
        g += 1
    if final and end > g * chunk_blocks and end > tail_end:
        out.append((g * chunk_blocks, end - 1))
        tail_end = end
    return out, g, max(tail_end, g * chunk_blocks)
