"""What the worker's save thread is handed: a step's save plan per request, and one put per layer.

A ``SavePlan`` is made once per request and step (the chunks this rank saves, their
block hashes as bytes, and where their blocks lie in the paged cache); every layer
of the step reuses it, so the per-layer work is one ``SaveItem``: the plan, the
layer, and the chunks' bytes when the engine thread had to stage them.
"""

from __future__ import annotations

from .chunks import Chunk
from .config import block_hash_bytes
from .metadata import SaveSpec
from .paged import Cuts


class SavePlan:
    """One save spec's chunks on this rank, as every layer of the step uses them."""

    __slots__ = ("chunks", "cuts", "hashes", "spec")

    def __init__(self, spec: SaveSpec, pos: list[int]) -> None:
        self.spec = spec
        self.chunks = [spec.chunks[j] for j in pos]
        self.hashes = [block_hash_bytes(spec.block_hashes[j]) for j in pos]
        self.cuts = Cuts([spec.block_ids[j] for j in pos])


class SaveItem:
    """One put: a plan's chunks (``keep``: only these of them; None: all) of one layer.

    ``values`` are the chunks' bytes when the engine thread had to stage them (a
    device or strided cache); None when the save thread cuts them itself, as views
    of a CPU cache, keys and all, off the engine's thread.
    """

    __slots__ = ("keep", "layer", "plan", "values")

    def __init__(self, plan: SavePlan, layer: int, values: list | None, keep: list[int] | None = None) -> None:
        self.plan, self.layer, self.values, self.keep = plan, layer, values, keep

    @property
    def req_id(self) -> str:
        return self.plan.spec.req_id

    def chunks(self) -> list[Chunk]:
        chunks = self.plan.chunks
        return chunks if self.keep is None else [chunks[j] for j in self.keep]
