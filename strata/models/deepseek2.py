"""DeepSeek-V2/V3 and Kimi-K2 (`deepseek2`): multi-head latent attention, shared experts, sigmoid scoring with a
correction bias, group-limited top-k, scaled routed weights, and leading dense layers.

DeepSeek-V3's multi-token-prediction block, where a file carries it (`nextn_predict_layers`, appended after the
trunk as `blk.N.*` with `blk.N.nextn.*`: llama.cpp's loader reads this layout; `strata convert` writes it from the
checkpoint's `model.layers.N`), is kept in host RAM as `model.nextn` for `--draft-source mtp`, with its own latent
attention (strata.models.mtp).
"""

from __future__ import annotations

import math

from strata.gguf.reader import GGUFModel
from strata.layers.attention import MLAttention
from strata.layers.moe import Routing
from strata.layers.rotary import Rotary
from strata.models.args import read_args
from strata.models.base import (Block, CacheSpec, WeightLoader, build_ffn, finish_model, mtp_experts_tiered,
                                nextn_layers, split_nextn)


def load_args(g: GGUFModel):
    a = read_args(g.metadata, g.arch, g.tensors, **{"expert_weights_norm": False})
    split_nextn(g, a)
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


def _mla_weights(q, f, has, p: str = "") -> dict:
    """Layer p's latent-attention weights (q: a stored tensor, f: a float32 one, has: present), either q layout
    (low-rank or not) and either kv_b layout (split per head, or one tensor)."""
    w = {"attn_output": q(p + "attn_output.weight"), "attn_kv_a_mqa": q(p + "attn_kv_a_mqa.weight"),
         "attn_kv_a_norm": f(p + "attn_kv_a_norm.weight")}
    if has(p + "attn_q.weight"):
        w["attn_q"] = q(p + "attn_q.weight")
    else:
        w["attn_q_a"] = q(p + "attn_q_a.weight")
        w["attn_q_a_norm"] = f(p + "attn_q_a_norm.weight")
        w["attn_q_b"] = q(p + "attn_q_b.weight")
    if has(p + "attn_k_b.weight"):
        w["attn_k_b"] = q(p + "attn_k_b.weight")
        w["attn_v_b"] = q(p + "attn_v_b.weight")
        if has(p + "attn_kv_b.weight"):
            q(p + "attn_kv_b.weight")  # both layouts present: the split one is used
    else:
        w["attn_kv_b"] = q(p + "attn_kv_b.weight")
    return w


def _rotary(args, max_ctx: int) -> Rotary:
    s = args.rope_scaling
    rotary = Rotary(args.qk_rope_dim, args.rope_theta, "norm", max_ctx, s)
    if s.kind == "yarn":
        rotary.attn_factor = 1.0  # see load_args: the magnitude correction goes into the softmax scale
        rotary._cache.clear()
    return rotary


def _layer_names(args, i: int) -> list[str]:
    """The tensors an MTP block at GGUF block i needs besides its nextn ones (a MoE layer, as DeepSeek-V3's)."""
    p = f"blk.{i}."
    names = ["attn_norm", "ffn_norm", "attn_kv_a_mqa", "attn_kv_a_norm", "attn_output", "ffn_gate_inp",
             "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"]
    return [p + n + ".weight" for n in names]


def mtp_attention_of(q, f, t: dict, args, max_ctx: int):
    """The MTP block's latent attention from its stored tensors (strata.models.mtp.MtpHead): (the attention,
    the shapes of its one-layer cache)."""
    attn = MLAttention(0, args, _mla_weights(q, f, lambda n: n in t), _rotary(args, max_ctx))
    return attn, MLAttention.cache_shapes(args)


def build(g: GGUFModel, cfg, make_experts, max_ctx: int, args=None):
    args = args or load_args(g)
    L = WeightLoader(g, cfg.torch_device)
    rotary = _rotary(args, max_ctx)
    routing = Routing(args.n_experts, args.n_experts_used, args.gating, norm_topk=args.norm_topk,
                      scale=args.routed_scale, n_groups=args.n_groups, topk_groups=args.topk_groups)
    blocks, experts = [], {}
    for i in range(args.n_layers):
        p = f"blk.{i}."
        attn = MLAttention(i, args, _mla_weights(L.q, L.f, L.has, p), rotary)
        ffn = build_ffn(L, args, i, routing, experts)
        blocks.append(Block(L.f(p + "attn_norm.weight"), attn, L.f(p + "ffn_norm.weight"), ffn, args.norm_eps))
    nextn = nextn_layers(L, args, lambda i: _layer_names(args, i))
    mtp_experts_tiered(cfg, nextn, experts)
    k, v = MLAttention.cache_shapes(args)
    model = finish_model(L, args, blocks, experts, CacheSpec(k, v), cfg.torch_dtype, make_experts)
    model.nextn = nextn
    if nextn:
        model.mtp_attention_of = mtp_attention_of
    return model
