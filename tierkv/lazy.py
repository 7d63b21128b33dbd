"""Names a package exports but imports on first use (PEP 562 ``__getattr__``), so that importing the package stays
cheap and works without the optional dependency (vLLM, SGLang) that some of its modules need.

A package keeps a table ``{exported name: its submodule}`` and forwards its module-level ``__getattr__`` to
:func:`load_export`; the value loaded is stored in the package's namespace, so each name is imported once.
"""

from __future__ import annotations

import importlib
from typing import Any


def load_export(package: str, table: dict[str, str], namespace: dict[str, Any], name: str) -> Any:
    """The export ``name`` of ``package``: imported from ``package.<table[name]>`` and kept in ``namespace``.

    Raises AttributeError for a name the table does not list (as a missing module attribute does).
    """
    module = table.get(name)
    if module is None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{package}.{module}"), name)
    namespace[name] = value
    return value
