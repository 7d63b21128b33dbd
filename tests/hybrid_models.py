"""Tiny random-weight hybrid models for the vLLM tests (no download).

* :func:`make_gemma3_model` — Gemma-3-style: sliding-window attention layers beside full attention
  (``layer_types``), float32.
* :func:`make_qwen3_next_model` — Qwen3-Next-style: Gated DeltaNet linear attention layers beside full
  attention, bfloat16 (vLLM's GDN kernels on CPU want it), one small mixture-of-experts layer.

Both keep vLLM's hybrid KV cache manager busy with several KV cache groups while a forward stays a
few milliseconds on a CPU; tests/vllm_util.py runs them (``"dtype"`` in a spec picks the engine dtype).
"""

from __future__ import annotations

import os

from vllm_util import save_random_model

#: layer kinds of the Gemma-3-style model: three sliding-window layers, then one full-attention layer
GEMMA3_LAYER_TYPES = ["sliding_attention"] * 3 + ["full_attention"]
#: its sliding window, in tokens: shorter than the prompts the tests use, so layers really slide
GEMMA3_SLIDING_WINDOW = 64
#: layer kinds of the Qwen3-Next-style model: three Gated DeltaNet layers, then one full-attention layer
QWEN3_NEXT_LAYER_TYPES = ["linear_attention"] * 3 + ["full_attention"]


def make_gemma3_model(path: str | os.PathLike, hidden: int = 128, heads: int = 2, kv_heads: int = 1,
                      vocab: int = 1024, sliding_window: int = GEMMA3_SLIDING_WINDOW,
                      layer_types: list[str] | None = None, max_positions: int = 8192, seed: int = 0) -> str:
    """Save a random-weight Gemma-3-style text model to ``path`` (idempotent) and return the path."""
    types = list(layer_types or GEMMA3_LAYER_TYPES)
    return save_random_model(path, "Gemma3TextConfig", "Gemma3ForCausalLM", seed=seed, vocab_size=vocab,
                             hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=len(types),
                             num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
                             max_position_embeddings=max_positions, sliding_window=sliding_window,
                             layer_types=types)


def make_qwen3_next_model(path: str | os.PathLike, hidden: int = 128, heads: int = 2, kv_heads: int = 1,
                          vocab: int = 1024, layer_types: list[str] | None = None,
                          max_positions: int = 8192, seed: int = 0) -> str:
    """Save a random-weight Qwen3-Next-style model (bfloat16) to ``path`` (idempotent) and return the path."""
    types = list(layer_types or QWEN3_NEXT_LAYER_TYPES)
    return save_random_model(
        path, "Qwen3NextConfig", "Qwen3NextForCausalLM", dtype="bfloat16", seed=seed,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=len(types),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        # one small mixture-of-experts layer (the last; vLLM's Qwen3-Next wants at least one), dense MLPs
        # elsewhere
        mlp_only_layers=list(range(len(types) - 1)),
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=hidden,
        shared_expert_intermediate_size=hidden,
        layer_types=types,
        max_position_embeddings=max_positions,
    )
