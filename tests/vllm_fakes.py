"""Stand-ins for the vLLM objects the connector's two sides read, for tests that build the scheduler and the worker
directly (no engine, no vLLM import): a request, a scheduler output of one new request, and one engine step on the
worker side as vLLM runs it.

The stand-ins carry exactly the attributes the connector reads; a test that needs more passes them as keywords.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import SimpleNamespace
from typing import Any


def fake_request(rid: str, blocks: int, block_size: int, tokens_over: int = 3, tag: int = 7,
                 cache_salt: str | None = None, **more: Any) -> SimpleNamespace:
    """A request of ``blocks`` full blocks and ``tokens_over`` tokens more; its block hashes depend on the block's
    index and ``tag`` alone (two requests with the same tag share their prefix)."""
    n = blocks * block_size + tokens_over
    return SimpleNamespace(request_id=rid, num_tokens=n, num_prompt_tokens=n,
                           block_hashes=[bytes([i, tag]) * 16 for i in range(blocks)], cache_salt=cache_salt, **more)


def new_request_output(rid: str, block_ids: list[int], computed: int, scheduled: int) -> SimpleNamespace:
    """A scheduler output that schedules one new request: ``computed`` tokens already there (found),
    ``scheduled`` to compute, in the blocks ``block_ids`` of the one KV cache group."""
    cached = SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[])
    new = SimpleNamespace(req_id=rid, block_ids=(block_ids,), num_computed_tokens=computed)
    return SimpleNamespace(scheduled_new_reqs=[new], scheduled_cached_reqs=cached,
                           num_scheduled_tokens={rid: scheduled}, preempted_req_ids=set())


def worker_step(worker: Any, meta: Any, layers: Iterable[str]) -> None:
    """One engine step on the worker side as vLLM runs it: ``meta`` bound, the loads started, each layer waited for
    and saved, the saves waited for, the metadata cleared.  (The load errors stay with the worker for the caller
    to take, as vLLM does after the step.)"""
    worker.bind_metadata(meta)
    worker.start_load_kv()
    for name in layers:
        worker.wait_for_layer_load(name)
        worker.save_kv_layer(name)
    worker.wait_for_save()
    worker.clear_metadata()
