"""A tiny Qwen3-MoE GGUF written directly (random weights, experts in a chosen format) for tiered tests."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

from strata.quant import random_qtensor

Q = gguf.GGMLQuantizationType


def write_moe_gguf(path: Path, *, n_layers: int = 3, d: int = 64, ff: int = 32, n_experts: int = 8, k: int = 2,
                   vocab: int = 96, heads: int = 4, kv_heads: int = 2, head_dim: int = 16,
                   expert_type=Q.F32, seed: int = 0, router_std: float = 0.5, embed_type=Q.F32,
                   ctx: int = 256) -> Path:
    """Write the model; expert tensors in `expert_type` (random valid blocks), the input embedding in `embed_type`
    (F32 or a format gguf-py quantizes, e.g. Q8_0), everything else float32."""
    g = torch.Generator().manual_seed(seed)

    def f32(*shape, std=0.05, mean=0.0):
        return (torch.randn(*shape, generator=g) * std + mean).numpy()

    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_block_count(n_layers)
    w.add_context_length(ctx)
    w.add_embedding_length(d)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(vocab)
    w.add_expert_count(n_experts)
    w.add_expert_used_count(k)
    w.add_expert_feed_forward_length(ff)
    emb = f32(vocab, d, std=1.0)
    if embed_type == Q.F32:
        w.add_tensor("token_embd.weight", emb)
    else:
        w.add_tensor("token_embd.weight", gguf.quants.quantize(emb, embed_type), raw_dtype=embed_type)
    w.add_tensor("output_norm.weight", f32(d, std=0.1, mean=1.0))
    w.add_tensor("output.weight", f32(vocab, d))
    rng = np.random.default_rng(seed)
    for i in range(n_layers):
        b = f"blk.{i}."
        w.add_tensor(b + "attn_q.weight", f32(heads * head_dim, d))
        w.add_tensor(b + "attn_k.weight", f32(kv_heads * head_dim, d))
        w.add_tensor(b + "attn_v.weight", f32(kv_heads * head_dim, d))
        w.add_tensor(b + "attn_output.weight", f32(d, heads * head_dim))
        w.add_tensor(b + "attn_q_norm.weight", f32(head_dim, std=0.1, mean=1.0))
        w.add_tensor(b + "attn_k_norm.weight", f32(head_dim, std=0.1, mean=1.0))
        w.add_tensor(b + "attn_norm.weight", f32(d, std=0.1, mean=1.0))
        w.add_tensor(b + "ffn_norm.weight", f32(d, std=0.1, mean=1.0))
        w.add_tensor(b + "ffn_gate_inp.weight", f32(n_experts, d, std=router_std))
        for name, shape in (("gate", (n_experts, ff, d)), ("up", (n_experts, ff, d)), ("down", (n_experts, d, ff))):
            if expert_type == Q.F32:
                w.add_tensor(f"{b}ffn_{name}_exps.weight", f32(*shape, std=0.1))
            else:
                qt = random_qtensor(expert_type, shape, rng=rng, scale=0.1)
                w.add_tensor(f"{b}ffn_{name}_exps.weight", qt.raw.numpy(), raw_dtype=expert_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
