"""Where the connector runs a load job: the ``LoadMode`` of a hit.

``SYNC``: in the engine's step, before the forward (``wait_for_layer_load`` / ``start_load_kv``);
``ASYNC``: between steps, on the loader's thread (the request waits, the batch does not).  The values are
the words the worker's counters and logs print (``load_counts``).  Which mode a hit gets is the
``load_async`` option's choice (docs/vllm.md).
"""

from __future__ import annotations

from tierkv.enums import StrEnum


class LoadMode(StrEnum):
    """Where a load job runs."""

    SYNC = "sync"  #: in the engine's step
    ASYNC = "async"  #: between steps
