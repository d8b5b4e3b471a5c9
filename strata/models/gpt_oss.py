"""gpt-oss (gpt-oss-20b, gpt-oss-120b): OpenAI's open-weight MoE, as llama.cpp's converter lays it out (`gpt-oss`).

GQA with Q/K/V/O biases and a learned sink logit per head; even layers attend over a sliding window
(`attention.sliding_window`), odd layers over the whole prefix; NEOX-order rotary with YaRN (not truncated:
the reference implementation's ramp). MoE in every layer: a router with a bias, top-k of the logits weighed by a
softmax over those k, experts with biases on all three projections and the clamped SwiGLU
(strata.experts.resident.ExpertAct), no shared expert. The post-attention norm is `post_attention_norm`.
"""

from __future__ import annotations

from dataclasses import replace

from strata import StrataError
from strata.experts.resident import ExpertAct, ExpertWeights
from strata.gguf.reader import GGUFModel
from strata.layers.attention import GQAttention, SinkAttention
from strata.layers.moe import MoE, Routing
from strata.layers.rotary import Rotary
from strata.models.args import read_args
from strata.models.base import Block, CacheSpec, WeightLoader, finish_model, gqa_weights

ARCH = "gpt-oss"
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0  # fixed by the architecture (llama.cpp hard-codes them too)


def load_args(g: GGUFModel):
    args = read_args(g.metadata, g.arch, g.tensors, expert_gating_func=3)
    args.rope_scaling = replace(args.rope_scaling, truncate=False)
    window = int(g.arch_get("attention.sliding_window", 0) or 0)
    if window <= 0:
        raise StrataError(f"{g.paths[0].name}: {ARCH}.attention.sliding_window is missing or not positive")
    pattern = g.arch_get("attention.sliding_window_pattern", None)
    if isinstance(pattern, (list, tuple)):  # per layer: true = sliding
        if len(pattern) != args.n_layers:
            raise StrataError(f"{g.paths[0].name}: {ARCH}.attention.sliding_window_pattern has {len(pattern)} "
                              f"entries for {args.n_layers} layers")
        sliding = [bool(p) for p in pattern]
    else:  # llama.cpp's gpt-oss: every even layer slides (its swa pattern 2)
        sliding = [i % 2 == 0 for i in range(args.n_layers)]
    args.extra.update(sliding_window=window, sliding=sliding)
    return args


def _experts(L: WeightLoader, i: int) -> ExpertWeights:
    import torch

    cpu = torch.device("cpu")
    p = f"blk.{i}.ffn_"
    ws = [L.q(f"{p}{n}_exps.weight", cpu) for n in ("gate", "up", "down")]
    # the biases stay float32: the backend keeps them whole on the compute device, indexed by expert id
    bias = [L.q(f"{p}{n}_exps.bias", cpu, required=False) for n in ("gate", "up", "down")]
    gb, ub, db = (b.dequantize(torch.float32).reshape(b.shape) if b is not None else None for b in bias)
    return ExpertWeights(*ws, act=ExpertAct("swiglu_oai", SWIGLU_ALPHA, SWIGLU_LIMIT, gb, ub, db))


def build(g: GGUFModel, cfg, make_experts, max_ctx: int, args=None):
    args = args or load_args(g)
    if not args.is_moe:
        raise StrataError(f"{g.paths[0].name}: {ARCH} without experts ({ARCH}.expert_count)")
    L = WeightLoader(g, cfg.torch_device)
    rotary = Rotary(args.rope_dim or args.head_dim, args.rope_theta, "neox", max_ctx, args.rope_scaling)
    routing = Routing(args.n_experts, args.n_experts_used, "softmax_weight")
    window, sliding = args.extra["sliding_window"], args.extra["sliding"]
    blocks, experts = [], {}
    for i in range(args.n_layers):
        p = f"blk.{i}."
        w = gqa_weights(L, p)
        w["attn_output.bias"] = L.f(p + "attn_output.bias", required=False)
        attn = SinkAttention(i, args, w, rotary, L.f(p + "attn_sinks.weight"), window if sliding[i] else 0)
        experts[i] = _experts(L, i)
        moe = MoE(i, routing, L.q(p + "ffn_gate_inp.weight"), None,
                  router_bias=L.f(p + "ffn_gate_inp.bias", required=False))
        blocks.append(Block(L.f(p + "attn_norm.weight"), attn, L.f(p + "post_attention_norm.weight"), moe,
                            args.norm_eps))
    k, v = GQAttention.cache_shapes(args)
    return finish_model(L, args, blocks, experts, CacheSpec(k, v), cfg.torch_dtype, make_experts)
