"""Weights replaced at the same path: a new engine never finds the old weights' KV (vLLM on ``dram -> ssd``).

Engine 1 serves a tiny Llama from a local directory and stores four prompts sharing a 201-token prefix.
The weights at that path are then replaced (the same ``config.json``, other random values: a checkpoint
updated in place).  A new engine with the connector's defaults finds nothing of the old KV and generates
vLLM's own tokens on the new weights.  With the old weights back, the next engine hits them again: the
fingerprint is stable.
"""

from __future__ import annotations

import random
import shutil

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

import vllm_util as U

BS = 32


def _prompts() -> list[list[int]]:
    rng = random.Random(45)
    head = [rng.randrange(1024) for _ in range(201)]
    return [head + [rng.randrange(1024) for _ in range(n)] for n in (30, 47, 64, 81)]


def _store(path) -> dict:
    return {"tiers": [{"medium": "dram", "capacity": "64MiB"},
                      {"medium": "ssd", "path": str(path), "capacity": "512MiB"}]}


def _serve(src, dst) -> None:
    """Put the weights of ``src`` at ``dst``, in place (the directory stays, its files are rewritten)."""
    dst.mkdir(exist_ok=True)
    for f in src.iterdir():
        shutil.copyfile(f, dst / f.name)


def _run(model, ssd, prompts, cache) -> tuple[dict, dict]:
    out = U.run_engine({"model": str(model), "kv_transfer_config": U.connector_config(_store(ssd)),
                        "steps": [{"op": "generate", "prompts": prompts, "one_by_one": True},
                                  {"op": "records"}]}, cache)
    return out["steps"][0], out["steps"][1]


def test_weights_replaced_in_place_are_never_served_the_old_kv(tmp_path):
    old = tmp_path / "old"
    new = tmp_path / "new"
    U.make_tiny_model(old, layers=2, seed=0)
    U.make_tiny_model(new, layers=2, seed=1)
    assert (old / "config.json").read_bytes() == (new / "config.json").read_bytes()
    model = tmp_path / "model"
    prompts = _prompts()
    cache, ssd = tmp_path / "cache", tmp_path / "ssd"

    _serve(old, model)
    gen1, rec1 = _run(model, ssd, prompts, cache)
    ident_old = set(rec1["weights"])
    assert len(ident_old) == 1 and "unverified" not in next(iter(ident_old))  # scheduler and worker agree

    _serve(new, model)
    base = U.run_engine({"model": str(model), "kv_transfer_config": None,
                         "steps": [{"op": "generate", "prompts": prompts, "one_by_one": True}]}, cache)
    expected_new = base["steps"][0]["tokens"]
    assert expected_new != gen1["tokens"]  # the new weights answer otherwise
    gen2, rec2 = _run(model, ssd, prompts, cache)
    # nothing of the old KV is found: the tiers give 0 tokens, the first prompt has no cached token at all
    assert rec2["scheduler"][0]["hit_tokens"] == 0
    assert gen2["num_cached_tokens"][0] == 0
    assert gen2["tokens"] == expected_new
    assert set(rec2["weights"]).isdisjoint(ident_old)

    # the old weights again: the same identity, and their KV is found again
    _serve(old, model)
    gen3, rec3 = _run(model, ssd, prompts, cache)
    assert set(rec3["weights"]) == ident_old
    assert gen3["tokens"] == gen1["tokens"]
    assert gen3["num_cached_tokens"] == [(len(p) - 1) // BS * BS for p in prompts]
    assert rec3["scheduler"][0]["hit_tokens"] > 0


def test_model_id_asserts_the_weights_and_skips_the_fingerprint(tmp_path):
    """With ``model_id`` the operator says "these are the same weights": its name is the key root, as given."""
    model = U.make_tiny_model(tmp_path / "model", layers=2)
    cfg = U.connector_config({"tiers": [{"medium": "dram", "capacity": "64MiB"}]}, extra={"model_id": "tiny-v1"})
    out = U.run_engine({"model": model, "kv_transfer_config": cfg, "steps": [{"op": "records"}]},
                       tmp_path / "cache")
    weights = out["steps"][0]["weights"]
    assert weights and all("model_id 'tiny-v1'" in w for w in weights)
