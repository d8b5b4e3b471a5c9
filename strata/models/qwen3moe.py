"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder), its dense sibling Qwen3, and Qwen2-MoE.

GQA with per-head RMSNorm on Q and K (Qwen3), NEOX-order rotary, softmax routing over 128 experts with the
top-k weights renormalised; Qwen2-MoE adds Q/K/V biases and a sigmoid-gated shared expert.
"""

from __future__ import annotations

from strata.gguf.reader import GGUFModel
from strata.layers.attention import GQAttention
from strata.layers.moe import Routing
from strata.layers.rotary import Rotary
from strata.models.args import read_args
from strata.models.base import Block, CacheSpec, WeightLoader, build_ffn, finish_model, gqa_weights


def load_args(g: GGUFModel):
    return read_args(g.metadata, g.arch, g.tensors)


def build(g: GGUFModel, cfg, make_experts, max_ctx: int, args=None):
    args = args or load_args(g)
    L = WeightLoader(g, cfg.torch_device)
    rotary = Rotary(args.rope_dim or args.head_dim, args.rope_theta, "neox", max_ctx, args.rope_scaling)
    routing = Routing(args.n_experts, args.n_experts_used, "softmax",
                      norm_topk=bool(g.arch_get("expert_weights_norm", g.arch != "qwen2moe")))
    blocks, experts = [], {}
    for i in range(args.n_layers):
        p = f"blk.{i}."
        w = gqa_weights(L, p)
        attn = GQAttention(i, args, w, rotary)
        ffn = build_ffn(L, args, i, routing, experts)
        blocks.append(Block(L.f(p + "attn_norm.weight"), attn, L.f(p + "ffn_norm.weight"), ffn, args.norm_eps))
    k, v = GQAttention.cache_shapes(args)
    return finish_model(L, args, blocks, experts, CacheSpec(k, v), cfg.torch_dtype, make_experts)
