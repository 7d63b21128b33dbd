"""A host pool's pages as tierkv parts: the bytes of one page, where they lie, without a copy.

SGLang's host pools lay a page out in one of several layouts (``layer_first``: a slice of every layer's K and
V; ``page_first``: one run per K and V; ``page_first_direct``, ``page_head``: one block per K and V; MLA
pools: one latent instead of K and V).  Each pool's ``get_data_page(index, flat=False)`` gives the page as a
strided view; :func:`contiguous_parts` splits it into the fewest contiguous runs, in the view's element
order.  So the stored object is the same bytes as SGLang's own flat page (``get_data_page(index)``), the v1
zero-copy path and the generic path read and write the same objects, and the bytes are copied once, between
the pool and the medium.  Nothing here imports SGLang.
"""

from __future__ import annotations

from typing import Any

import torch


def contiguous_parts(view: torch.Tensor) -> list[torch.Tensor]:
    """``view``'s elements, in order, as the fewest contiguous tensors splitting along leading dimensions."""
    if view.is_contiguous():
        return [view]
    if view.dim() == 0:
        return [view.contiguous()]  # (unreachable for a pool page: a 0-dim tensor is contiguous)
    out: list[torch.Tensor] = []
    for i in range(view.shape[0]):
        out.extend(contiguous_parts(view[i]))
    return out


class PoolPages:
    """One registered host pool: the parts of the page starting at a host index, and its page's shape."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.page_size = int(pool.page_size)
        first = pool.get_data_page(0, flat=False)  # (a layout the pool does not know raises here, at registration)
        self.page_shape = tuple(int(d) for d in first.shape)
        self.page_bytes = first.numel() * first.element_size()
        self.dtype = str(pool.dtype).removeprefix("torch.")
        self.layout = str(pool.layout)
        self.layers = (int(getattr(pool, "start_layer", 0) or 0),
                       int(getattr(pool, "end_layer", getattr(pool, "layer_num", 0)) or 0))
        self.parts_per_page = len(contiguous_parts(first))

    def page_index(self, host_indices: torch.Tensor, i: int) -> int:
        """The host index page ``i`` of a transfer starts at."""
        return int(host_indices[i * self.page_size])

    def parts(self, index: int) -> list[torch.Tensor]:
        """The page at host index ``index`` as contiguous parts (views into the pool)."""
        return contiguous_parts(self.pool.get_data_page(index, flat=False))
