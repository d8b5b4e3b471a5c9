"""Tiny random-weight transformers models (no downloads) saved as checkpoint directories, for parity tests."""

from __future__ import annotations

from pathlib import Path

import torch

FAMILIES = {
    "qwen3moe": dict(
        cls="Qwen3MoeForCausalLM", cfg="Qwen3MoeConfig",
        kw=dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=40, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=24, num_experts=8, num_experts_per_tok=2,
                norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], rope_theta=10000.0,
                max_position_embeddings=512, tie_word_embeddings=False),
    ),
    # every row length a multiple of 256, so that every GGML block format (K-quants included) applies
    "qwen3moe_256": dict(
        cls="Qwen3MoeForCausalLM", cfg="Qwen3MoeConfig",
        kw=dict(hidden_size=256, intermediate_size=256, moe_intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=4, num_experts_per_tok=2,
                norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=256,
                tie_word_embeddings=False),
    ),
    "qwen3": dict(
        cls="Qwen3ForCausalLM", cfg="Qwen3Config",
        kw=dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, max_position_embeddings=512, tie_word_embeddings=True),
    ),
    "mixtral": dict(
        cls="MixtralForCausalLM", cfg="MixtralConfig",
        kw=dict(hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=512,
                tie_word_embeddings=False, rope_theta=1e6),
    ),
    "llama": dict(
        cls="LlamaForCausalLM", cfg="LlamaConfig",
        kw=dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=4, max_position_embeddings=512, tie_word_embeddings=False),
    ),
    "deepseek_v3": dict(
        cls="DeepseekV3ForCausalLM", cfg="DeepseekV3Config",
        kw=dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
                topk_group=1, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                v_head_dim=12, first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5,
                max_position_embeddings=512, tie_word_embeddings=False),
    ),
    # DeepSeek-V3 with its MTP block appended to the checkpoint as DeepSeek ships it (model.layers.{L})
    "deepseek_v3_mtp": dict(
        cls="DeepseekV3ForCausalLM", cfg="DeepseekV3Config", mtp=1,
        kw=dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
                topk_group=1, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                v_head_dim=12, first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5,
                num_nextn_predict_layers=1, max_position_embeddings=512, tie_word_embeddings=False),
    ),
    "deepseek_v3_noqlora": dict(
        cls="DeepseekV3ForCausalLM", cfg="DeepseekV3Config",
        kw=dict(hidden_size=48, intermediate_size=64, moe_intermediate_size=24, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                topk_group=1, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                v_head_dim=16, first_k_dense_replace=0, n_shared_experts=2, routed_scaling_factor=1.0,
                max_position_embeddings=512, tie_word_embeddings=False),
    ),
    # odd sizes, q width != hidden, partial rotary (12 of 20 dims), qk-norm, Q/K/V biases, grouped routing, a
    # leading dense layer, a shared expert, and one MTP block appended to the checkpoint as GLM ships it
    "glm4moe": dict(
        cls="Glm4MoeForCausalLM", cfg="Glm4MoeConfig", mtp=1,
        kw=dict(hidden_size=52, intermediate_size=72, moe_intermediate_size=20, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=20, partial_rotary_factor=0.6,
                n_routed_experts=8, num_experts_per_tok=3, n_group=2, topk_group=1, first_k_dense_replace=1,
                n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True, use_qk_norm=True,
                attention_bias=True, num_nextn_predict_layers=1, max_position_embeddings=512,
                tie_word_embeddings=False),
    ),
    # GLM-4.5-Air's shape: no qk-norm, ungrouped routing; here also two dense layers, two shared experts, no
    # renormalisation, no MTP block
    "glm4moe_noqknorm": dict(
        cls="Glm4MoeForCausalLM", cfg="Glm4MoeConfig",
        kw=dict(hidden_size=48, intermediate_size=80, moe_intermediate_size=24, num_hidden_layers=4,
                num_attention_heads=6, num_key_value_heads=2, head_dim=16, n_routed_experts=6,
                num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=2, n_shared_experts=2,
                routed_scaling_factor=1.0, norm_topk_prob=False, use_qk_norm=False, attention_bias=True,
                num_nextn_predict_layers=0, max_position_embeddings=512, tie_word_embeddings=False),
    ),
    # odd head count (5 query heads over 5 KV heads would be plain MHA: 5 over 1 is GQA with G = 5), a sliding
    # window shorter than the parity prompts, alternating layer types, YaRN (untruncated, as gpt-oss ships it)
    "gpt_oss": dict(
        cls="GptOssForCausalLM", cfg="GptOssConfig",
        kw=dict(hidden_size=64, intermediate_size=48, num_hidden_layers=4, num_attention_heads=5,
                num_key_value_heads=1, head_dim=16, num_local_experts=6, num_experts_per_tok=2, sliding_window=6,
                layer_types=["sliding_attention", "full_attention"] * 2, max_position_embeddings=256,
                rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0, beta_fast=32.0,
                                     beta_slow=1.0, truncate=False, original_max_position_embeddings=64),
                tie_word_embeddings=False),
    ),
    # hybrid: delta-net layers (key/value head sizes differ, 2 value heads per key head) and gated attention
    # every 2nd layer (partial rotary: 6 of 24 dims)
    "qwen3next": dict(
        cls="Qwen3NextForCausalLM", cfg="Qwen3NextConfig",
        kw=dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=40, shared_expert_intermediate_size=48,
                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                linear_conv_kernel_dim=4, linear_key_head_dim=12, linear_value_head_dim=20, linear_num_key_heads=2,
                linear_num_value_heads=4, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                full_attention_interval=2, max_position_embeddings=512, tie_word_embeddings=False),
        # slow decays (as trained models have in many heads): the state then carries the far past, so that a
        # state that is wrong at a chunk's start shows in what follows
        init={"A_log": lambda p: p.uniform_(0.02, 0.3).log_(), "dt_bias": lambda p: p.uniform_(-3.0, -1.0)},
    ),
}

# The families again with widths as real models have them (every row a multiple of 32 values): torch's CPU
# elementwise kernels (silu, sigmoid, ...) compute a tensor's last elements, its size modulo two vectors, by other
# code than the rest, so with an odd width which of a row's elements take that path depends on how many rows are
# beside it (tests/engine/test_batch_invariance.py)
_ALIGNED = {
    "qwen3moe": dict(moe_intermediate_size=64, head_dim=32),
    "mixtral": dict(intermediate_size=64),
    "deepseek_v3": dict(intermediate_size=128, moe_intermediate_size=64, q_lora_rank=64, kv_lora_rank=32,
                        qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16),
    "glm4moe": dict(hidden_size=64, moe_intermediate_size=64, intermediate_size=128, head_dim=32,
                    partial_rotary_factor=0.5),
    "gpt_oss": dict(intermediate_size=64, head_dim=32),
    "qwen3next": dict(intermediate_size=128, moe_intermediate_size=64, shared_expert_intermediate_size=64,
                      head_dim=32, linear_key_head_dim=16, linear_value_head_dim=32),
}
for _f, _kw in _ALIGNED.items():
    FAMILIES[_f + "_aligned"] = dict(FAMILIES[_f], kw={**FAMILIES[_f]["kw"], **_kw})

def _append_mtp_blocks(model, out: Path, n: int, std: float) -> None:
    """Add n MTP blocks to the saved checkpoint as GLM's and DeepSeek-V3's releases carry them: `model.layers.{L+j}.*`, a decoder
    layer like the last one plus eh_proj, enorm, hnorm, embed_tokens and shared_head (transformers' causal LM
    builds no such layer and ignores the tensors on load; the converters must carry them)."""
    from safetensors.torch import load_file, save_file

    path = out / "model.safetensors"
    tensors = load_file(path)
    L, d, V = model.config.num_hidden_layers, model.config.hidden_size, model.config.vocab_size
    last = f"model.layers.{L - 1}."
    for j in range(n):
        p = f"model.layers.{L + j}."
        for k, t in list(tensors.items()):
            if k.startswith(last):
                scale = 0.05 if "e_score_correction_bias" in k else std
                mean = 1.0 if t.ndim == 1 and "norm" in k else 0.0
                tensors[p + k[len(last):]] = (mean + scale * torch.randn_like(t)).contiguous()
        tensors[p + "eh_proj.weight"] = std * torch.randn(d, 2 * d)
        for k in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
            tensors[p + k] = 1.0 + 0.1 * torch.randn(d)
        tensors[p + "embed_tokens.weight"] = std * torch.randn(V, d)
        tensors[p + "shared_head.head.weight"] = std * torch.randn(V, d)
    save_file(tensors, path, metadata={"format": "pt"})


def make_hf_model(family: str, out: Path, vocab_size: int, seed: int = 0, std: float = 0.05):
    import transformers

    spec = FAMILIES[family]
    torch.manual_seed(seed)
    cfg = getattr(transformers, spec["cfg"])(vocab_size=vocab_size, **spec["kw"])
    model = getattr(transformers, spec["cls"])(cfg).float().eval()
    with torch.no_grad():
        special = spec.get("init", {})
        for name, p in model.named_parameters():
            fill = next((f for key, f in special.items() if name.endswith(key)), None)
            if fill is not None:
                fill(p)
            elif p.ndim == 1 and "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))  # non-trivial norms catch a missing norm
            elif "e_score_correction_bias" in name:
                p.copy_(0.05 * torch.randn_like(p))
            elif name.endswith("sinks"):  # sinks large enough to take a real share of each softmax
                p.copy_(torch.randn_like(p))
            elif "bias" in name:  # biases (gpt-oss: attention, router, experts) large enough to matter
                p.normal_(0.0, 0.2)
            else:
                p.normal_(0.0, std)
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(0.05 * torch.randn_like(b))
    model.save_pretrained(out)
    if spec.get("mtp"):
        _append_mtp_blocks(model, out, spec["mtp"], std)
    return model


def make_tokenizer_dir(d: Path, vocab: int) -> None:
    """A small trained byte-level BPE tokenizer (with a Qwen3 chat template) beside a checkpoint."""
    from strata.gguf.tokenizer_hf import make_tiny_hf_tokenizer

    make_tiny_hf_tokenizer(d, vocab_size=vocab)
