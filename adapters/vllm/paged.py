"""Whole-block access to an engine's paged KV tensor, whatever its layout.

A layer's paged KV cache is one tensor with a ``num_blocks`` dimension
somewhere in it: CPU backends use ``[num_blocks, kv_heads, block_size, 2*head]``,
most GPU/NPU backends ``[2, num_blocks, block_size, kv_heads, head]`` (K pages
then V pages).  The inside of a page is backend- and ISA-specific, so it is
treated as opaque bytes: a block of one layer is moved as a list of contiguous
*parts* (one part when the block dimension is outermost, one per leading index
otherwise, e.g. its K page and its V page).

When the allocator's block is split into several kernel blocks
(``kernel_blocks_per_block > 1``) the block dimension holds
``num_blocks * kernel_blocks_per_block`` entries and one engine block covers that
many consecutive kernel blocks.

This module needs only torch; it knows nothing of the engine.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch

from tierkv.buffers import HostViews


def find_block_dim(shape: tuple[int, ...], num_blocks: int, block_size: int | None = None) -> tuple[int, int]:
    """Return ``(dim, kernel_blocks_per_block)`` for a paged tensor of ``shape``.

    The block dimension is the first one whose size is ``num_blocks`` times a
    power of two no larger than ``block_size`` (exact ``num_blocks`` preferred),
    looking past a leading K/V dimension of size 2.  Raises ``ValueError`` when
    no dimension fits.
    """
    if num_blocks <= 0:
        raise ValueError(f"num_blocks must be positive, got {num_blocks}")
    dims = list(range(len(shape)))
    # exact match first, scanning from the outside in
    for d in dims:
        if shape[d] == num_blocks and not (d == 0 and len(shape) > 1 and shape[0] == 2 and shape[1] == num_blocks):
            return d, 1
    limit = block_size or max(shape)
    for d in dims:
        if shape[d] % num_blocks == 0:
            r = shape[d] // num_blocks
            if r > 1 and (r & (r - 1)) == 0 and r <= limit:
                return d, r
    raise ValueError(f"no dimension of KV tensor shape {tuple(shape)} is a multiple of num_blocks={num_blocks}")


class Cuts:
    """Where a batch of objects lies in a paged layer, worked out once and cut from every layer.

    ``objects[i]`` lists object i's engine block ids in order (None: a block read
    and dropped).  Objects whose blocks are one run of consecutive ids are
    *regular*; consecutive regular objects of equal length that follow one another
    in the cache form a group, which a layer cuts as one view and splits into the
    objects' views in one call.  A group's objects may be single blocks or whole
    chunks.  Nothing here depends on a layer, so one ``Cuts`` serves every layer
    of a step.
    """

    __slots__ = ("blocks", "groups", "objects")

    def __init__(self, objects: Sequence[Sequence[int | None]]) -> None:
        self.objects = objects
        #: (first object, objects in the group, first block, blocks per object); count 0: irregular
        self.groups: list[tuple[int, int, int, int]] = []
        #: blocks the objects fill (None entries excluded)
        self.blocks = 0
        groups = self.groups
        nxt = n_prev = -1  # block after the open group, and its objects' length
        for i, ids in enumerate(objects):
            n = len(ids)
            first = ids[0] if n else None
            if first is not None and (n == 1 or _one_run(ids)):
                self.blocks += n
                if first == nxt and n == n_prev:
                    g = groups[-1]
                    groups[-1] = (g[0], g[1] + 1, g[2], n)
                else:
                    groups.append((i, 1, first, n))
                    n_prev = n
                nxt = first + n
            else:
                self.blocks += n - list(ids).count(None)
                groups.append((i, 0, -1, 0))
                nxt = -1

    def __len__(self) -> int:
        return len(self.objects)


def _one_run(ids: Sequence[int | None]) -> bool:
    """True when ``ids`` are consecutive block ids, ascending (no None)."""
    if None in ids:
        return False
    run = cast(Sequence[int], ids)
    return run[-1] - run[0] == len(run) - 1 and all(b - a == 1 for a, b in itertools.pairwise(run))


@dataclass
class PagedLayer:
    """One layer's paged KV tensor, addressed by engine block id."""

    tensor: torch.Tensor
    block_dim: int
    kernel_blocks_per_block: int = 1
    #: a slice of a flat layer's blocks (``split_heads``): (the layer's flat uint8 view, bytes from one block
    #: to the next, bytes from a block's start to the slice's); each block's slice is one view of it
    span: tuple[torch.Tensor, int, int] | None = None

    @classmethod
    def wrap(cls, tensor: torch.Tensor, num_blocks: int, block_size: int | None = None) -> PagedLayer:
        dim, r = find_block_dim(tuple(tensor.shape), num_blocks, block_size)
        return cls(tensor, dim, r)

    @functools.cached_property
    def num_parts(self) -> int:
        """Pages per block: the product of the dimensions outside the block dimension (fixed per layer)."""
        return math.prod(self.tensor.shape[: self.block_dim])

    @functools.cached_property
    def block_nbytes(self) -> int:
        """Bytes of one engine block of this layer (all parts)."""
        per_entry = self.tensor[(0,) * (self.block_dim + 1)].numel() * self.tensor.element_size()
        return per_entry * self.kernel_blocks_per_block * self.num_parts

    def parts(self, block_id: int) -> list[torch.Tensor]:
        """Views of block ``block_id``'s pages, outermost index first (may be non-contiguous)."""
        r = self.kernel_blocks_per_block
        lo = block_id * r
        if self.block_dim == 0:
            return [self.tensor[lo : lo + r]]
        lead = [range(n) for n in self.tensor.shape[: self.block_dim]]
        # indexing (never reshape) keeps every part a view of the cache
        return [self.tensor[idx][lo : lo + r] for idx in itertools.product(*lead)]

    def is_direct(self) -> bool:
        """True when every block's parts are contiguous CPU memory (no staging copy needed)."""
        d = self.__dict__.get("_direct")
        if d is None:
            d = self.tensor.device.type == "cpu" and all(p.is_contiguous() for p in self.parts(0))
            self.__dict__["_direct"] = d
        return d

    def prepare(self) -> None:
        """Make the cached views now (call where the cache tensor was made, not in inference mode)."""
        self.is_direct()
        self._flat()

    def is_flat(self) -> bool:
        """True when :meth:`cut` gives views of the cache alone, never staging: one view per regular object,
        or for a slice of a flat layer (``span``) one per block."""
        return self._flat() is not None or self.span is not None

    def _flat(self) -> torch.Tensor | None:
        """The whole cache as one flat uint8 view when blocks are its outermost dimension, else None."""
        f = self.__dict__.get("_flat_view", False)
        if f is False:
            f = None
            if self.block_dim == 0 and self.is_direct() and self.tensor.is_contiguous():
                f = self.tensor.reshape(-1).view(torch.uint8)
            self.__dict__["_flat_view"] = f
        return f

    def byte_runs(self, block_ids: Sequence[int | None], filler) -> tuple[list[torch.Tensor], list]:
        """Buffers for ``block_ids`` in order, consecutive blocks merged into one part.

        ``None`` entries take ``filler()`` (a list of parts); returns (parts,
        staging pairs to copy afterwards), like :meth:`write_targets`.
        """
        flat = self._flat()
        parts: list[torch.Tensor] = []
        pending: list = []
        if flat is None:
            for bid in block_ids:
                if bid is None:
                    parts.extend(filler())
                else:
                    b, p = self.write_targets(bid)
                    parts.extend(b)
                    pending.extend(p)
            return parts, pending
        nb = self.block_nbytes
        start = prev = None
        for bid in block_ids:
            if bid is not None and prev is not None and bid == prev + 1:
                prev = bid
                continue
            if start is not None:
                parts.append(flat[start * nb:(cast(int, prev) + 1) * nb])  # (set with start)
            if bid is None:
                parts.extend(filler())
                start = prev = None
            else:
                start = prev = bid
        if start is not None:
            parts.append(flat[start * nb:(cast(int, prev) + 1) * nb])
        return parts, pending

    # -- staging --------------------------------------------------------------
    def read_parts(self, block_id: int) -> list[torch.Tensor]:
        """Contiguous CPU tensors holding the block's bytes.

        Views into the cache when possible (no copy): the caller must keep the
        block from being reused until it has consumed them.
        """
        if self.is_direct():
            return self.parts(block_id)
        out = []
        for p in self.parts(block_id):
            if p.device.type != "cpu":
                p = p.to("cpu")
            out.append(p if p.is_contiguous() else p.contiguous())
        return out

    def read_runs(self, block_ids: list[int]) -> list[torch.Tensor]:
        """:meth:`read_parts` of several blocks in order, consecutive blocks as one part."""
        if self._flat() is None:
            return [p for bid in block_ids for p in self.read_parts(bid)]
        return self.byte_runs(block_ids, list)[0]

    def cut(self, cuts: Cuts, filler) -> tuple[list, list | None]:
        """Buffers to fill for each of ``cuts``' objects, and the staging copies to make afterwards.

        An object is one flat uint8 view of the cache when its blocks are one run
        of a layer whose blocks are its outermost dimension, else a list of parts
        (:meth:`byte_runs`; ``filler()`` gives the parts of a block read and
        dropped).  The second value is None when nothing needs copying, else one
        list of (staging, destination) pairs per object.
        """
        flat = self._flat()
        out: list = []
        pending: list | None = None
        if flat is None and self.span is not None:
            return self._cut_span(cuts, filler), None
        if flat is None:
            pending = []
            for ids in cuts.objects:
                parts, pend = self.byte_runs(ids, filler)
                out.append(parts)
                pending.append(pend)
            return out, pending if any(pending) else None
        nb = self.block_nbytes
        size = flat.numel()
        objects = cuts.objects
        groups = cuts.groups
        if all(k and (start + k * n) * nb <= size for _, k, start, n in groups):
            # the common case: every object a run of blocks inside the cache, listed with its address
            # (``HostViews``: the store takes them without checking each view again)
            views = HostViews.over(flat)
            for _, k, start, n in groups:
                if k == 1:
                    views.add(start * nb, n * nb)
                else:
                    views.add_rows(start * nb, k, n * nb)
            return views, None
        for i, k, start, n in groups:
            if k == 1:
                out.append(flat[start * nb:(start + n) * nb])
            elif k and (start + k * n) * nb <= size:
                out.extend(flat[start * nb:(start + k * n) * nb].view(k, n * nb).unbind(0))
            elif k:  # reaches past the cache (a bad block id): each object alone, the store refuses the short one
                out.extend(flat[(start + j * n) * nb:(start + (j + 1) * n) * nb] for j in range(k))
            else:
                out.append(self.byte_runs(objects[i], filler)[0])
        return out, None

    def _cut_span(self, cuts: Cuts, filler) -> list:
        """:meth:`cut` of a slice of a flat layer: an object of one block is one view (all such: ``HostViews``),
        a longer one a list of one view per block (``filler()`` for a block read and dropped)."""
        whole, stride, off = self.span  # type: ignore[misc]  # (set: checked by the caller)
        nb = self.block_nbytes
        objects = cuts.objects
        top = whole.numel() // stride
        if all(len(ids) == 1 and ids[0] is not None and 0 <= ids[0] < top for ids in objects):
            views = HostViews.over(whole)
            for ids in objects:
                views.add(cast(int, ids[0]) * stride + off, nb)  # (checked above)
            return views
        out: list = []
        for ids in objects:
            parts: list = []
            for b in ids:
                if b is None:
                    parts.extend(filler())
                else:
                    at = b * stride + off
                    parts.append(whole[at:at + nb])  # (a bad block id: a short view, which the store refuses)
            out.append(parts)
        return out

    def read_cut(self, cuts: Cuts) -> list:
        """The bytes of each of ``cuts``' objects (no None entries): views where the layout allows,
        as :meth:`cut` makes them, else staged copies (:meth:`read_runs`)."""
        if self.span is not None:
            return self._cut_span(cuts, list)
        if self._flat() is None:
            return [self.read_runs(list(ids)) for ids in cuts.objects]  # type: ignore[arg-type]
        return self.cut(cuts, list)[0]

    def write_targets(self, block_id: int) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
        """Contiguous CPU buffers to fill for the block, and (staging, destination) pairs to copy afterwards."""
        if self.is_direct():
            return self.parts(block_id), []
        bufs: list[torch.Tensor] = []
        pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        for p in self.parts(block_id):
            if p.device.type == "cpu" and p.is_contiguous():
                bufs.append(p)
            else:
                stage = torch.empty(p.shape, dtype=p.dtype, device="cpu")
                bufs.append(stage)
                pending.append((stage, p))
        return bufs, pending

    def discard_targets(self, n: int, pool: dict) -> list[list[torch.Tensor]]:
        """``n`` distinct sets of CPU buffers shaped like one block's parts, for bytes read and dropped.

        A stored chunk may hold blocks the engine already has or does not need;
        they are read into these.  The sets never overlap one another (a reader may
        verify what it wrote).  ``pool`` keeps them for reuse, by part shapes and
        dtype, across layers and calls: its owner lets one load at a time use it.
        """
        key = (tuple(tuple(p.shape) for p in self.parts(0)), self.tensor.dtype)
        sets = pool.setdefault(key, [])
        while len(sets) < n:
            sets.append([torch.empty(p.shape, dtype=p.dtype, device="cpu") for p in self.parts(0)])
        return sets[:n]


def head_dim(shape: tuple[int, ...], block_dim: int, heads: int, cpu: bool = False) -> int:
    """The dimension of a paged layer's KV heads: the one past the block dimension of size ``heads``.

    ``[2, num_blocks, block_size, heads, head]`` gives 3.  When several fit (as many heads as tokens in a
    block), vLLM's CPU layout ``[num_blocks, heads, block_size, 2*head]`` (``cpu``) decides: the one right
    after the block dimension.  Raises ``ValueError`` when none fits, or several do elsewhere.
    """
    dims = [d for d in range(block_dim + 1, len(shape)) if shape[d] == heads]
    if len(dims) > 1 and cpu and dims[0] == block_dim + 1:
        dims = dims[:1]
    if len(dims) != 1:
        raise ValueError(f"cannot tell the KV-head dimension of a paged KV tensor of shape {tuple(shape)} "
                         f"({heads} heads, block dimension {block_dim})")
    return dims[0]


def split_heads(layer: PagedLayer, heads: int, parts: int) -> list[PagedLayer]:
    """``layer`` as ``parts`` layers, part ``k`` holding heads ``k*heads/parts ..`` of each block (views, no copy).

    ``heads`` is the layer's KV heads.  On CPU layouts a block's heads are contiguous, so each part's block is
    one contiguous view of the cache (a chunk is one view per block); in layouts where a block's heads are
    strided the parts are staged, as any strided layer is (:meth:`PagedLayer.read_parts`).
    """
    if parts == 1:
        return [layer]
    if heads <= 0 or heads % parts:
        raise ValueError(f"{heads} KV heads cannot be split into {parts} equal parts")
    t = layer.tensor
    d = head_dim(tuple(t.shape), layer.block_dim, heads, t.device.type == "cpu" and layer.block_dim == 0)
    h = heads // parts
    r = layer.kernel_blocks_per_block
    flat = layer._flat()
    if flat is not None and d == 1 and r == 1:
        # heads right after the blocks of a flat layer: each block's slice is one run of bytes of it
        nb = layer.block_nbytes
        return [PagedLayer(t.narrow(d, k * h, h), 0, 1, span=(flat, nb, k * (nb // parts))) for k in range(parts)]
    return [PagedLayer(t.narrow(d, k * h, h), layer.block_dim, r) for k in range(parts)]
