"""tierkv as SGLang HiCache's storage tier (its "L3" backend).

Use it from SGLang with::

    --enable-hierarchical-cache --hicache-storage-backend dynamic \
    --hicache-storage-backend-extra-config '{"backend_name": "tierkv", "module_path": "tierkv.adapters.sglang",
        "class_name": "TierKVStorage", "interface_v1": 1, "tierkv": {...store config...}}'

The backend class is imported on first use (it subclasses SGLang's ``HiCacheStorage``), so the option and
page helpers in ``.options`` and ``.pages`` work without SGLang installed.  See ``docs/sglang.md``.
"""

from __future__ import annotations

from typing import Any

from tierkv.lazy import load_export

_LAZY = {
    "TierKVStorage": "storage",
    "BackendOptions": "options",
    "parse_options": "options",
    "page_namespace": "options",
    "DEFAULT_STORE_CONFIG": "options",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    return load_export(__name__, _LAZY, globals(), name)
