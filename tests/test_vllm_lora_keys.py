"""A request with a LoRA adapter is keyed under the adapter's files too: one rewritten in place is never a hit.

vLLM's block hashes carry the adapter's name and path, not its content.  The scheduler and the worker are
built directly (no engine) over one DRAM store: a request under adapter ``a`` stores its chunks; the
adapter's files are rewritten at the same path, and a new scheduler (a new engine) finds none of them;
with the former files back it finds them all.  Tenants stay the requests' ``cache_salt``.
"""

from __future__ import annotations

import os
import random
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.vllm

import torch
from vllm_fakes import fake_request, new_request_output, worker_step

from tierkv import TieredStore
from tierkv.adapters.vllm.config import ConnectorOptions, EngineInfo, RequestSalts, kv_shard, salt_tenant
from tierkv.adapters.vllm.scheduler import TierKVScheduler
from tierkv.adapters.vllm.worker import TierKVWorker

BS = 16
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
NB = 32


def _adapter(path, seed: int) -> None:
    path.mkdir(exist_ok=True)
    (path / "adapter_config.json").write_text('{"r": 8, "target_modules": ["q_proj"]}')
    (path / "adapter_model.safetensors").write_bytes(random.Random(seed).randbytes(1 << 16))


def _request(rid: str, lora, salt: str | None = None):
    return fake_request(rid, 4, BS, cache_salt=salt, lora_request=lora)


_output = new_request_output


# same shape as test_vllm_audit._serve: kept apart because each builds its own request (here a LoRA one)
def _serve(s: TierKVScheduler, w: TierKVWorker, req, ids: list[int]) -> int:
    """One request from lookup to finish; the tokens the scheduler reported matched."""
    ext, _ = s.get_num_new_matched_tokens(req, 0)
    s.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (ids,)), ext)
    worker_step(w, s.build_connector_meta(_output(req.request_id, ids, ext, req.num_tokens - ext)), LAYERS)
    s.request_finished(req)
    w.get_finished({req.request_id})
    return ext


@pytest.fixture
def engines():
    store = TieredStore.from_config({"tiers": [{"medium": "dram", "capacity": "64MiB"}]})
    info = EngineInfo(block_size=BS, layers=LAYERS, num_blocks=NB, shard=kv_shard(0, 1, 2), namespaces={0: "ns"},
                      engine_id=f"test-lora-{os.getpid()}")
    caches = {n: torch.randn(NB, 2, BS, 8) for n in LAYERS}
    made = []

    def make():
        """A new engine's two sides over the same store (a new scheduler: nothing remembered)."""
        opts = ConnectorOptions(chunk_tokens=2 * BS, load_async=False, audit_rate=0.0)
        worker = TierKVWorker(opts, info, store, release=lambda _: None, serve=False)
        worker.register_kv_caches(caches)
        made.append(worker)
        return TierKVScheduler(opts, info, ask=lambda rank, request: worker.probe(request)), worker

    yield SimpleNamespace(store=store, make=make)
    for w in made:
        w.shutdown()
    store.close()


def test_an_adapter_rewritten_in_place_never_finds_its_former_kv(engines, tmp_path):
    path = tmp_path / "lora_a"
    _adapter(path, 1)
    lora = SimpleNamespace(lora_name="a", lora_int_id=1, lora_path=str(path))
    s, w = engines.make()
    assert _serve(s, w, _request("r1", lora), [0, 1, 2, 3, 4]) == 0  # stores 2 chunks of 2 blocks
    s, w = engines.make()
    assert _serve(s, w, _request("r2", lora), [8, 9, 10, 11, 12]) == 4 * BS  # the same adapter: a hit

    _adapter(path, 2)  # rewritten at the same path, under the same name
    s, w = engines.make()
    assert _serve(s, w, _request("r3", lora), [16, 17, 18, 19, 20]) == 0

    _adapter(path, 1)  # the former files again: their KV is found again
    s, w = engines.make()
    assert _serve(s, w, _request("r4", lora), [24, 25, 26, 27, 28]) == 4 * BS


def test_key_salts_without_an_adapter_are_unchanged_and_tenants_stay_the_cache_salt(tmp_path):
    _adapter(tmp_path / "a", 1)
    lora = SimpleNamespace(lora_name="a", lora_int_id=1, lora_path=str(tmp_path / "a"))
    salts = RequestSalts()
    assert salts.of(_request("x", None)) is None
    assert salts.of(_request("x", None, "team")) == "team"
    plain, salted = salts.of(_request("x", lora)), salts.of(_request("x", lora, "team"))
    assert plain is not None and salted is not None and len({plain, salted, "team"}) == 3
    assert salt_tenant(plain) is None and salt_tenant(salted) == "team" and salt_tenant("team") == "team"
    assert salt_tenant(salts.of(_request("x", lora, ""))) == ""
