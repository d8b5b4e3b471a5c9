"""Llama (dense) and Mixtral (`llama` with experts): GQA, no Q/K norm, adjacent-pair rotary.

llama.cpp's converter permutes the Q and K weights of this family so that its NORM-order rotary (adjacent
pairs) reproduces transformers' rotate-half; strata reads those files as they are and rotates pairs.
Mixtral routing: softmax over all experts, top-k, renormalised.
"""

from __future__ import annotations

from strata.gguf.reader import GGUFModel
from strata.layers.attention import GQAttention
from strata.layers.moe import Routing
from strata.layers.rotary import Rotary
from strata.models.args import read_args
from strata.models.base import Block, CacheSpec, WeightLoader, build_ffn, finish_model, gqa_weights


def load_args(g: GGUFModel):
    return read_args(g.metadata, g.arch, g.tensors, **{"attention.layer_norm_rms_epsilon": 1e-5})


def build(g: GGUFModel, cfg, make_experts, max_ctx: int, args=None):
    args = args or load_args(g)
    L = WeightLoader(g, cfg.torch_device)
    rotary = Rotary(args.rope_dim or args.head_dim, args.rope_theta, "norm", max_ctx, args.rope_scaling)
    routing = Routing(args.n_experts, args.n_experts_used, "softmax", norm_topk=True)
    blocks, experts = [], {}
    for i in range(args.n_layers):
        p = f"blk.{i}."
        w = gqa_weights(L, p)
        attn = GQAttention(i, args, w, rotary)
        ffn = build_ffn(L, args, i, routing, experts)
        blocks.append(Block(L.f(p + "attn_norm.weight"), attn, L.f(p + "ffn_norm.weight"), ffn, args.norm_eps))
    k, v = GQAttention.cache_shapes(args)
    # rope_freqs (Llama 3.1 long-context factors) is not applied yet: refuse rather than run wrong.
    return finish_model(L, args, blocks, experts, CacheSpec(k, v), cfg.torch_dtype, make_experts)
