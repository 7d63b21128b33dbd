"""The SGLang backend's extra-config and namespaces, checked without SGLang (``tierkv.adapters.sglang.options``)."""

from __future__ import annotations

import json

import pytest

from tierkv.adapters.sglang.options import (
    DEFAULT_STORE_CONFIG,
    SGLANG_KEYS,
    EngineRanks,
    page_namespace,
    parse_options,
)
from tierkv.errors import ConfigError

SGLANG_PART = {"backend_name": "tierkv", "module_path": "tierkv.adapters.sglang", "class_name": "TierKVStorage",
               "interface_v1": 1, "tp_lcm_size": 4, "prefetch_threshold": 256, "prefetch_timeout_base": 1,
               "prefetch_timeout_per_ki_token": 0.25, "hicache_storage_pass_prefix_keys": True}


def test_sglang_keys_are_accepted_and_the_default_store_is_small():
    opts = parse_options(SGLANG_PART)
    assert opts.store_config == DEFAULT_STORE_CONFIG
    assert [t["medium"] for t in DEFAULT_STORE_CONFIG["tiers"]] == ["dram"]
    assert set(SGLANG_PART) <= SGLANG_KEYS
    assert parse_options(None).store_config == DEFAULT_STORE_CONFIG


def test_inline_store_config_and_file(tmp_path):
    store = {"tiers": [{"medium": "dram", "capacity": "64MiB"}]}
    assert parse_options({**SGLANG_PART, "tierkv": store}).store_config == store
    assert parse_options({"tierkv": json.dumps(store)}).store_config == store  # (a JSON string, as a shell passes it)
    f = tmp_path / "store.json"
    f.write_text(json.dumps(store))
    assert parse_options({"tierkv_config_file": str(f)}).store_config == str(f)


@pytest.mark.parametrize("extra, names", [
    ({"tierkv_typo": 1}, "tierkv_typo"),
    ({"lease_timeout_s": "30"}, "lease_timeout_s"),
    ({"lease_timeout_s": -1.0}, "lease_timeout_s"),
    ({"model_id": 7}, "model_id"),
    ({"namespace": " "}, "namespace"),
    ({"metrics_port": "9000"}, "metrics_port"),
    ({"metrics_port": 70000}, "metrics_port"),
    ({"tierkv": [1]}, "tierkv"),
    ({"tierkv": "{not json"}, "tierkv"),
    ({"tierkv_config_file": "/nonexistent/store.yaml"}, "tierkv_config_file"),
    ({"tierkv": {}, "tierkv_config_file": "x"}, "tierkv_config_file"),
])
def test_bad_options_are_config_errors_naming_them(extra, names):
    with pytest.raises(ConfigError, match=names):
        parse_options({**SGLANG_PART, **extra})


def test_not_a_mapping():
    with pytest.raises(ConfigError, match="mapping"):
        parse_options(["tierkv"])


def test_namespaces_differ_in_every_part_that_changes_a_page():
    g = EngineRanks(tp_rank=0, tp_size=2)
    base = {"model": "m", "ranks": g, "pool": "kv", "dtype": "bfloat16", "layout": "layer_first", "page_size": 16,
            "layers": (0, 2), "page_shape": (2, 2, 16, 1, 64)}
    ns = page_namespace(**base)
    changes = [{"model": "m2"}, {"ranks": EngineRanks(tp_rank=1, tp_size=2)}, {"ranks": EngineRanks(pp_rank=1, pp_size=2,
               tp_size=2)}, {"pool": "mamba"}, {"dtype": "float16"}, {"layout": "page_first"}, {"page_size": 32},
               {"layers": (2, 4)}, {"page_shape": (2, 16, 2, 1, 64)}, {"tenant": "a"}]
    seen = {ns}
    for c in changes:
        other = page_namespace(**{**base, **c})
        assert other not in seen, c
        seen.add(other)


def test_mla_ranks_share_one_namespace():
    a = page_namespace("m", EngineRanks(tp_rank=0, tp_size=4, mla=True), "kv", "bfloat16", "layer_first", 16, (0, 2),
                       (2, 16, 1, 576))
    b = page_namespace("m", EngineRanks(tp_rank=3, tp_size=4, mla=True), "kv", "bfloat16", "layer_first", 16, (0, 2),
                       (2, 16, 1, 576))
    assert a == b and "/mla/" in a
