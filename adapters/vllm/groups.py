"""Hits across KV cache groups (hybrid models): the arithmetic, with no vLLM import.

vLLM's hybrid KV cache manager gives each kind of layer a KV cache group of its own, each with its own block
table (docs/vllm-hybrid.md). A prefix of ``H`` tokens is a hit only when every group can rebuild
its state at token ``H`` from stored blocks, and what that takes depends on the group's kind:

* full attention and MLA: every block of the prefix, ``[0, H)``;
* sliding window of ``w`` tokens: the blocks holding tokens ``[H - w + 1, H)`` (the window of the first token
  computed after the hit; vLLM frees the blocks before it while the request runs);
* recurrent state (Mamba, Gated DeltaNet, short convolution, in vLLM's ``align`` mode): the one state block
  written at the boundary ``H``, block ``H / block_size - 1``; the others hold states of other boundaries.

A hit is the longest prefix ``H`` that is a multiple of :func:`hit_alignment` (the least common multiple of
the groups' block sizes and the engine's hash block size) and that every group can serve
(:func:`longest_hit`). What each group stores lives under a namespace carrying its kind and shape
(:meth:`GroupGeometry.namespace`), so chunks of different groups, or of the same layer served with another
kind (a sliding-window layer promoted to full attention when the hybrid manager is off), never alias.

Every function works on whole arrays (numpy): no per-block Python loop, whatever the prompt length.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tierkv.enums import StrEnum


class GroupKind(StrEnum):
    """What a KV cache group's blocks hold, as far as a hit is concerned."""

    FULL = "full"  #: full attention: K/V of every token
    MLA = "mla"  #: multi-head latent attention: one latent per token (every block, like full attention)
    SLIDING_WINDOW = "sliding_window"  #: K/V of every token, only the last ``sliding_window`` read
    STATE = "state"  #: a recurrent state per block boundary (Mamba / GDN / short conv, ``align`` mode)


class UnsupportedGroup(ValueError):
    """A KV cache group whose kind the connector cannot store (named in the message)."""


@dataclass(frozen=True)
class GroupGeometry:
    """One KV cache group as the hit arithmetic and the keys see it.

    ``block_size`` is in tokens (for a :attr:`GroupKind.STATE` group, the tokens between two state
    boundaries). ``shape`` and ``dtype`` describe one layer's block (the key namespace carries them);
    ``sliding_window`` is the window in tokens, for sliding-window groups only.
    """

    kind: GroupKind
    block_size: int
    sliding_window: int = 0
    shape: tuple[int, ...] = ()
    dtype: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.kind, GroupKind):
            raise ValueError(f"group kind must be a GroupKind, got {self.kind!r}")
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"group block_size must be an int >= 1, got {self.block_size!r}")
        if self.kind is GroupKind.SLIDING_WINDOW:
            if not isinstance(self.sliding_window, int) or self.sliding_window < 1:
                raise ValueError(f"a sliding-window group needs sliding_window >= 1, got {self.sliding_window!r}")
        elif self.sliding_window:
            raise ValueError(f"sliding_window is for sliding-window groups only, not {self.kind.value}")

    def blocks_needed(self, hit_tokens: int) -> tuple[int, int]:
        """The blocks ``[lo, hi)`` of this group that a hit of ``hit_tokens`` tokens reads.

        ``hit_tokens`` must be a multiple of the block size; 0 needs nothing.
        """
        if hit_tokens < 0 or hit_tokens % self.block_size:
            raise ValueError(f"a hit of {hit_tokens} tokens is not a whole number of {self.block_size}-token blocks")
        n = hit_tokens // self.block_size
        if n == 0:
            return 0, 0
        if self.kind is GroupKind.SLIDING_WINDOW:
            return max(0, hit_tokens - self.sliding_window + 1) // self.block_size, n
        if self.kind is GroupKind.STATE:
            return n - 1, n
        return 0, n

    def live_blocks(self, num_computed_tokens: int) -> tuple[int, int]:
        """The computed blocks ``[lo, hi)`` vLLM still holds for a request at ``num_computed_tokens``.

        Full and MLA groups hold every block until the request finishes; a sliding-window group frees the
        blocks wholly before the window of the next token (so they must be saved before that); a state
        group's blocks are offered one boundary at a time (see :func:`save_mask`).
        """
        hi = max(0, num_computed_tokens) // self.block_size
        if self.kind is GroupKind.SLIDING_WINDOW:
            return min(hi, max(0, num_computed_tokens - self.sliding_window + 1) // self.block_size), hi
        return 0, hi

    def namespace(self) -> str:
        """The key segment of this group: kind, block size, window, per-layer block shape and dtype."""
        parts = [self.kind.value, f"bs{self.block_size}"]
        if self.kind is GroupKind.SLIDING_WINDOW:
            parts.append(f"w{self.sliding_window}")
        if self.shape:
            parts.append("x".join(str(int(d)) for d in self.shape))
        if self.dtype:
            parts.append(self.dtype.replace("/", "_"))
        return "-".join(parts)


def hit_alignment(groups: Sequence[GroupGeometry], hash_block_size: int) -> int:
    """The granularity of a hit: the least common multiple of the groups' block sizes and the hash block size."""
    if hash_block_size < 1:
        raise ValueError(f"hash_block_size must be >= 1, got {hash_block_size}")
    return math.lcm(hash_block_size, *(g.block_size for g in groups))


def _as_mask(present: Any, length: int) -> np.ndarray:
    """``present`` as a bool array of exactly ``length`` blocks (missing ones absent)."""
    p = np.asarray(present, dtype=bool).reshape(-1)
    out = np.zeros(length, dtype=bool)
    k = min(length, p.size)
    out[:k] = p[:k]
    return out


def servable(group: GroupGeometry, present: Any, hits: np.ndarray) -> np.ndarray:
    """For each candidate hit length in ``hits`` (multiples of the block size, > 0): can ``group`` serve it?

    ``present[i]`` says whether block ``i`` of the prompt is stored for this group (for every layer of it).
    """
    hits = np.asarray(hits, dtype=np.int64)
    if hits.size == 0:
        return np.zeros(0, dtype=bool)
    if np.any(hits <= 0) or np.any(hits % group.block_size):
        raise ValueError(f"candidate hits must be positive multiples of {group.block_size}")
    n = hits // group.block_size  # blocks in each candidate prefix
    p = _as_mask(present, int(n.max()))
    last = n - 1
    if group.kind is GroupKind.STATE:
        return p[last]
    if group.kind is GroupKind.SLIDING_WINDOW:
        # length of the run of stored blocks ending at each block
        idx = np.arange(p.size)
        last_gap = np.maximum.accumulate(np.where(p, -1, idx))
        run = idx - last_gap
        lo = np.maximum(0, hits - group.sliding_window + 1) // group.block_size
        return run[last] >= n - lo
    return np.cumprod(p, dtype=np.int8).astype(bool)[last]


def longest_hit(groups: Sequence[GroupGeometry], present: Sequence[Any], hash_block_size: int,
                max_tokens: int) -> int:
    """The longest prefix, at most ``max_tokens`` and a multiple of :func:`hit_alignment`, every group serves.

    ``present[g]`` is group ``g``'s stored-block mask (see :func:`servable`); 0 when no prefix qualifies.
    """
    if len(present) != len(groups):
        raise ValueError(f"{len(present)} presence masks for {len(groups)} groups")
    if not groups:
        return 0
    align = hit_alignment(groups, hash_block_size)
    hits = np.arange(1, max(0, max_tokens) // align + 1, dtype=np.int64) * align
    if hits.size == 0:
        return 0
    ok = np.ones(hits.size, dtype=bool)
    for g, p in zip(groups, present):  # one vectorized pass per group
        ok &= servable(g, p, hits)
    found = np.flatnonzero(ok)
    return int(hits[found[-1]]) if found.size else 0


def save_mask(group: GroupGeometry, num_tokens: int, alignment: int) -> np.ndarray:
    """The blocks of a ``num_tokens``-token sequence worth storing for ``group``: those some hit reads.

    A hit ends on a multiple of ``alignment`` (:func:`hit_alignment`); a block no such hit reads (a state
    block off the alignment, a sliding-window block outside every aligned window) is not worth its space.
    """
    if alignment < 1 or alignment % group.block_size:
        raise ValueError(f"alignment {alignment} is not a multiple of the block size {group.block_size}")
    nblocks = max(0, num_tokens) // group.block_size
    mask = np.zeros(nblocks, dtype=bool)
    hits = np.arange(1, max(0, num_tokens) // alignment + 1, dtype=np.int64) * alignment
    if hits.size == 0:
        return mask
    hi = hits // group.block_size
    if group.kind is GroupKind.STATE:
        mask[hi - 1] = True
        return mask
    if group.kind is GroupKind.SLIDING_WINDOW:
        lo = np.maximum(0, hits - group.sliding_window + 1) // group.block_size
    else:
        lo = np.zeros_like(hi)
    # mark the union of the intervals [lo, hi) with a difference array
    diff = np.zeros(nblocks + 1, dtype=np.int64)
    np.add.at(diff, lo, 1)
    np.add.at(diff, hi, -1)
    mask[:] = np.cumsum(diff[:-1]) > 0
    return mask


# -- from vLLM's KV cache specs -----------------------------------------------------------------------------
#: spec class names (and their subclasses) by the kind they are served as; checked most specific first
_SPEC_KINDS: tuple[tuple[str, GroupKind], ...] = (
    ("SlidingWindowMLASpec", GroupKind.SLIDING_WINDOW),
    ("SlidingWindowSpec", GroupKind.SLIDING_WINDOW),
    ("MLAAttentionSpec", GroupKind.MLA),
    ("MambaSpec", GroupKind.STATE),
    ("FullAttentionSpec", GroupKind.FULL),
)
#: spec kinds whose blocks are not a function of the prefix alone, or whose hits vLLM computes otherwise
_UNSUPPORTED = ("HiddenStateCacheSpec", "RSWASpec", "SinkFullAttentionSpec", "CrossAttentionSpec",
                "EncoderOnlyAttentionSpec", "ChunkedLocalAttentionSpec", "CircularBufferSpec",
                "HiSparseHotSpec", "HiSparseResidentSpec", "UniformTypeKVCacheSpecs")


def geometry_of_spec(spec: Any) -> GroupGeometry:
    """The :class:`GroupGeometry` of a vLLM ``KVCacheSpec`` (duck-typed by class name: no vLLM import).

    Raises :class:`UnsupportedGroup` for kinds the connector cannot serve, and for a recurrent-state group
    outside ``align`` mode (its states are not kept at block boundaries).
    """
    names = [c.__name__ for c in type(spec).__mro__]
    for bad in _UNSUPPORTED:
        if names[0] == bad:
            raise UnsupportedGroup(f"KV cache group kind {bad} is not supported by the connector")
    kind = next((k for name, k in _SPEC_KINDS if name in names), None)
    if kind is None:
        raise UnsupportedGroup(f"KV cache group kind {names[0]} is not supported by the connector")
    block_size = int(spec.block_size)
    if kind is GroupKind.STATE:
        mode = getattr(spec, "mamba_cache_mode", "none")
        if mode != "align":
            raise UnsupportedGroup(f"recurrent-state group in mamba_cache_mode {mode!r}: only 'align' keeps "
                                   "a state per block boundary")
        shape = tuple(int(d) for s in spec.shapes for d in (len(s), *s))
        dtype = "+".join(str(d).removeprefix("torch.") for d in spec.dtypes)
        return GroupGeometry(kind, block_size, shape=shape, dtype=dtype)
    shape = (int(spec.num_kv_heads), int(spec.head_size))
    dtype = str(spec.dtype).removeprefix("torch.")
    if kind is GroupKind.SLIDING_WINDOW:
        return GroupGeometry(kind, block_size, sliding_window=int(spec.sliding_window), shape=shape, dtype=dtype)
    return GroupGeometry(kind, block_size, shape=shape, dtype=dtype)
