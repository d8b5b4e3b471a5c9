"""DeepSeek-V2/V3 and Kimi-K2 (`deepseek2`): multi-head latent attention, shared experts, sigmoid scoring with a
correction bias, group-limited top-k, scaled routed weights, and leading dense layers.
"""

from __future__ import annotations

import math

from strata.gguf.reader import GGUFModel
from strata.layers.attention import MLAttention
from strata.layers.moe import Routing
from strata.layers.rotary import Rotary
from strata.models.args import read_args
from strata.models.base import Block, CacheSpec, WeightLoader, build_ffn, finish_model


def load_args(g: GGUFModel):
    a = read_args(g.metadata, g.arch, g.tensors, **{"expert_weights_norm": False})
    a.qk_rope_dim = int(g.arch_get("rope.dimension_count", 64))
    if g.arch_get("attention.key_length_mla") is not None:
        # current layout: key/value_length describe the latent cache; *_mla the per-head sizes
        a.head_dim = int(g.arch_get("attention.key_length_mla"))
        a.v_head_dim = int(g.arch_get("attention.value_length_mla", a.v_head_dim))
    a.qk_nope_dim = a.head_dim - a.qk_rope_dim  # per-head key = nope + rope
    a.rope_dim = a.qk_rope_dim
    s = a.rope_scaling
    if s.kind == "yarn" and s.factor > 1:
        # DeepSeek applies YaRN's magnitude correction to the softmax scale (mscale^2), not to the rotary tables.
        # the GGUF key holds 0.1 * mscale_all_dim already (llama.cpp's yarn_log_multiplier)
        m = s.mscale_all_dim * math.log(s.factor) + 1.0 if s.mscale_all_dim else 1.0
        a.extra["mla_mscale"] = m
    return a


def build(g: GGUFModel, cfg, make_experts, max_ctx: int, args=None):
    args = args or load_args(g)
    L = WeightLoader(g, cfg.torch_device)
    s = args.rope_scaling
    rotary = Rotary(args.qk_rope_dim, args.rope_theta, "norm", max_ctx, s)
    if s.kind == "yarn":
        rotary.attn_factor = 1.0  # see load_args: the magnitude correction goes into the softmax scale
        rotary._cache.clear()
    routing = Routing(args.n_experts, args.n_experts_used, args.gating, norm_topk=args.norm_topk,
                      scale=args.routed_scale, n_groups=args.n_groups, topk_groups=args.topk_groups)
    blocks, experts = [], {}
    for i in range(args.n_layers):
        p = f"blk.{i}."
        w = {"attn_output": L.q(p + "attn_output.weight"), "attn_kv_a_mqa": L.q(p + "attn_kv_a_mqa.weight"),
             "attn_kv_a_norm": L.f(p + "attn_kv_a_norm.weight")}
        if L.has(p + "attn_q.weight"):
            w["attn_q"] = L.q(p + "attn_q.weight")
        else:
            w["attn_q_a"] = L.q(p + "attn_q_a.weight")
            w["attn_q_a_norm"] = L.f(p + "attn_q_a_norm.weight")
            w["attn_q_b"] = L.q(p + "attn_q_b.weight")
        if L.has(p + "attn_k_b.weight"):
            w["attn_k_b"] = L.q(p + "attn_k_b.weight")
            w["attn_v_b"] = L.q(p + "attn_v_b.weight")
            if L.has(p + "attn_kv_b.weight"):
                L.q(p + "attn_kv_b.weight")  # both layouts present: the split one is used
        else:
            w["attn_kv_b"] = L.q(p + "attn_kv_b.weight")
        attn = MLAttention(i, args, w, rotary)
        ffn = build_ffn(L, args, i, routing, experts)
        blocks.append(Block(L.f(p + "attn_norm.weight"), attn, L.f(p + "ffn_norm.weight"), ffn, args.norm_eps))
    k, v = MLAttention.cache_shapes(args)
    return finish_model(L, args, blocks, experts, CacheSpec(k, v), cfg.torch_dtype, make_experts)
