"""GLM-4.5, GLM-4.5-Air, GLM-4.6 (`glm4moe`): GQA with Q/K/V biases and optional per-head Q/K RMSNorm, partial
NEOX-order rotary (transformers' rotate-half over the first `rope.dimension_count` dims of each head), leading
dense layers, then MoE layers with sigmoid scoring, an `exp_probs_b` correction bias that steers the choice but
not the weights, optional group-limited top-k, renormalised and scaled routed weights, and one shared expert.

The post-attention norm is stored as `post_attention_norm` (llama.cpp's name for this family), not `ffn_norm`.

Multi-token prediction: llama.cpp's converter appends the checkpoint's `nextn_predict_layers` MTP blocks after
the trunk (`block_count` counts them) as ordinary block tensors plus `blk.N.nextn.*` (eh_proj, enorm, hnorm, and
optionally embed_tokens, shared_head_head, shared_head_norm). strata keeps each block's tensors, unread and
mapped from the file in host RAM (no VRAM), as `model.nextn` for speculative decoding with them; the normal
forward runs the trunk only and its KV cache has trunk layers only.
"""

from __future__ import annotations

from strata import StrataError
from strata.gguf.reader import GGUFModel
from strata.layers.attention import GQAttention
from strata.layers.moe import Routing
from strata.layers.rotary import Rotary
from strata.models.args import read_args
from strata.models.base import NEXTN_REQUIRED, NextNLayer  # noqa: F401 - (where callers found them)
from strata.models.base import (Block, CacheSpec, WeightLoader, build_ffn, finish_model, gqa_weights,
                                mtp_experts_tiered, nextn_layers, split_nextn)

NEXTN_OPTIONAL = ("nextn.embed_tokens.weight", "nextn.shared_head_head.weight", "nextn.shared_head_norm.weight")


def load_args(g: GGUFModel):
    # llama.cpp's defaults for this family: sigmoid gating when the key is unset, no renormalisation, no scale
    a = read_args(g.metadata, g.arch, g.tensors,
                  **{"expert_weights_norm": False, "attention.layer_norm_rms_epsilon": 1e-5})
    if g.arch_get("rope.dimension_sections") is not None:
        raise StrataError(f"{g.paths[0].name}: multi-section rotary (rope.dimension_sections, the GLM-V vision "
                          "models) is not supported; strata runs the text-only glm4moe models")
    gating = g.arch_get("expert_gating_func", 0)
    a.gating = "softmax" if gating == 1 else "sigmoid"  # 0 = unset: llama.cpp takes sigmoid for glm4moe
    if a.routed_scale == 0.0:  # llama.cpp writes/reads 0 as "no scaling"
        a.routed_scale = 1.0
    split_nextn(g, a)
    if not a.is_moe:
        raise StrataError(f"{g.paths[0].name}: {g.arch} needs {g.arch}.expert_count > 0")
    if a.first_dense_layers > a.n_layers:
        raise StrataError(f"{g.paths[0].name}: leading_dense_block_count = {a.first_dense_layers} exceeds the "
                          f"{a.n_layers} layers")
    if a.n_groups > 1 and (a.n_experts % a.n_groups or not 1 <= a.topk_groups <= a.n_groups):
        raise StrataError(f"{g.paths[0].name}: {a.n_experts} experts do not split into {a.n_groups} groups with "
                          f"{a.topk_groups} used")
    return a


def _require(L: WeightLoader, name: str) -> None:
    if not L.has(name):
        L.q(name)  # raises the loader's "tensor ... is missing" error


def _layer_names(args, i: int) -> list[str]:
    """The tensors every block i needs (optional ones, Q/K norms and biases, are read where present)."""
    p = f"blk.{i}."
    names = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "post_attention_norm"]
    if i < args.first_dense_layers:
        names += ["ffn_gate", "ffn_up", "ffn_down"]
    else:
        names += ["ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"]
        if args.n_shared_experts:
            names += ["ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"]
    out = [p + n + ".weight" for n in names]
    if i >= args.first_dense_layers:
        out.append(p + "exp_probs_b.bias")
    return out


def build(g: GGUFModel, cfg, make_experts, max_ctx: int, args=None):
    args = args or load_args(g)
    L = WeightLoader(g, cfg.torch_device)
    rotary = Rotary(args.rope_dim or args.head_dim, args.rope_theta, "neox", max_ctx, args.rope_scaling)
    routing = Routing(args.n_experts, args.n_experts_used, args.gating, norm_topk=args.norm_topk,
                      scale=args.routed_scale, n_groups=args.n_groups, topk_groups=args.topk_groups)
    blocks, experts = [], {}
    for i in range(args.n_layers):
        p = f"blk.{i}."
        for n in _layer_names(args, i):
            _require(L, n)  # (build_ffn reads the correction bias and the shared expert only where present)
        attn = GQAttention(i, args, gqa_weights(L, p), rotary)
        ffn = build_ffn(L, args, i, routing, experts)
        blocks.append(Block(L.f(p + "attn_norm.weight"), attn, L.f(p + "post_attention_norm.weight"), ffn,
                            args.norm_eps))
    nextn = nextn_layers(L, args, lambda i: _layer_names(args, i))
    mtp_experts_tiered(cfg, nextn, experts)
    k, v = GQAttention.cache_shapes(args)
    model = finish_model(L, args, blocks, experts, CacheSpec(k, v), cfg.torch_dtype, make_experts)
    model.nextn = nextn
    return model
