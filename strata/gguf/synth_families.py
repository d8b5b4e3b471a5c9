"""`strata synth` for glm4moe (GLM-4.5/4.6) and qwen3next (Qwen3-Next): each layer's tensors and the metadata keys,
named and shaped as llama.cpp's converter writes them (strata.gguf.convert does the same from a checkpoint), with
the weight shaping of strata.gguf.synth (token identity dominant, small branch outputs).

glm4moe: Q/K/V biases, partial NEOX rotary, `post_attention_norm`, leading dense layers, sigmoid routing with the
`exp_probs_b` correction bias and one shared expert. No MTP block (a file without one is valid: llama.cpp can keep
the MTP blocks in a file of their own).

qwen3next: every `full_attention_interval`-th layer is gated full attention (the Q projection yields a query and a
gate per head; Q/K RMSNorm), the others gated delta-net layers (qkv and z projections, the short causal conv, the
decay parameters); every layer's FFN is MoE with a sigmoid-gated shared expert.
"""

from __future__ import annotations

import math

import numpy as np

ARCHS = ("glm4moe", "qwen3next")


def _rng(seed: int, name: str) -> np.random.Generator:
    import zlib

    return np.random.default_rng([seed, zlib.crc32(name.encode()), 2])


def _const(seed: int, name: str, make):
    return lambda: make(_rng(seed, name)).astype(np.float32)


def layer_tensors(p, i: int, w, f32, norm, router, bias, dt, et, st, et_down, seed: int, out_gain: float) -> None:
    """Layer i's tensors of a glm4moe or qwen3next preset `p`, through the tensor_plan callbacks (w: a weight of
    a format, f32: a float32 tensor with its init; norm/router/bias: inits). dt: dense type, et / et_down: the
    routed experts' gate/up and down types, st: the shared expert's type."""
    d, b = p.d_model, f"blk.{i}."
    f32(b + "attn_norm.weight", (d,), norm(b + "attn_norm", d))
    f32(b + "post_attention_norm.weight", (d,), norm(b + "post_attention_norm", d))
    if p.arch == "glm4moe":
        for n, rows in (("attn_q", p.n_heads * p.head_dim), ("attn_k", p.n_kv_heads * p.head_dim),
                        ("attn_v", p.n_kv_heads * p.head_dim)):
            w(b + n + ".weight", (rows, d), dt)
            f32(b + n + ".bias", (rows,), bias(b + n + ".bias", rows))
        w(b + "attn_output.weight", (d, p.n_heads * p.head_dim), dt, out_gain)
        if p.qk_norm:
            f32(b + "attn_q_norm.weight", (p.head_dim,), norm(b + "attn_q_norm", p.head_dim))
            f32(b + "attn_k_norm.weight", (p.head_dim,), norm(b + "attn_k_norm", p.head_dim))
    elif (i + 1) % p.full_attn_interval == 0:  # qwen3next gated attention
        w(b + "attn_q.weight", (2 * p.n_heads * p.head_dim, d), dt)  # [query, gate] per head
        w(b + "attn_k.weight", (p.n_kv_heads * p.head_dim, d), dt)
        w(b + "attn_v.weight", (p.n_kv_heads * p.head_dim, d), dt)
        w(b + "attn_output.weight", (d, p.n_heads * p.head_dim), dt, out_gain)
        f32(b + "attn_q_norm.weight", (p.head_dim,), norm(b + "attn_q_norm", p.head_dim))
        f32(b + "attn_k_norm.weight", (p.head_dim,), norm(b + "attn_k_norm", p.head_dim))
    else:  # qwen3next gated delta-net
        hk, hv, dk, dv = p.lin_k_heads, p.lin_v_heads, p.lin_k_dim, p.lin_v_dim
        conv = 2 * hk * dk + hv * dv  # the causal conv's channels: all q heads, all k heads, all v heads
        w(b + "attn_qkv.weight", (conv, d), dt)
        w(b + "attn_gate.weight", (hv * dv, d), dt)
        w(b + "ssm_ba.weight", (2 * hv, d), dt)
        k = p.conv_kernel
        f32(b + "ssm_conv1d.weight", (conv, k), _const(seed, b + "ssm_conv1d", lambda r: r.standard_normal((conv, k))
                                                         / math.sqrt(k)))
        # dt_bias = softplus^-1 of a step in [1e-3, 1e-1], A = -[1, 16): transformers' initialisation ranges
        f32(b + "ssm_dt.bias", (hv,), _const(seed, b + "ssm_dt", lambda r: np.log(np.expm1(np.exp(
            r.uniform(math.log(1e-3), math.log(1e-1), hv))))))
        f32(b + "ssm_a", (hv,), _const(seed, b + "ssm_a", lambda r: -r.uniform(1.0, 16.0, hv)))
        f32(b + "ssm_norm.weight", (dv,), norm(b + "ssm_norm", dv))
        w(b + "ssm_out.weight", (d, hv * dv), dt, out_gain)
    if i < p.first_dense:
        w(b + "ffn_gate.weight", (p.ffn, d), dt)
        w(b + "ffn_up.weight", (p.ffn, d), dt)
        w(b + "ffn_down.weight", (d, p.ffn), dt, out_gain)
        return
    E, f = p.n_experts, p.expert_ffn
    f32(b + "ffn_gate_inp.weight", (E, d), router(b + "ffn_gate_inp", E, d))
    if p.gating == "sigmoid":
        f32(b + "exp_probs_b.bias", (E,), bias(b + "exp_probs_b", E))
    w(b + "ffn_gate_exps.weight", (E, f, d), et)
    w(b + "ffn_up_exps.weight", (E, f, d), et)
    w(b + "ffn_down_exps.weight", (E, d, f), et_down, out_gain)
    fs = p.shared_ffn or f * p.n_shared
    if fs:
        w(b + "ffn_gate_shexp.weight", (fs, d), st)
        w(b + "ffn_up_shexp.weight", (fs, d), st)
        w(b + "ffn_down_shexp.weight", (d, fs), st, out_gain)
    if p.arch == "qwen3next":
        f32(b + "ffn_gate_inp_shexp.weight", (1, d), router(b + "ffn_gate_inp_shexp", 1, d))


def write_metadata(w, p) -> None:
    """The `{arch}.*` keys of a glm4moe or qwen3next preset beyond those every preset writes."""
    a = p.arch
    w.add_key_length(p.head_dim)
    w.add_value_length(p.head_dim)
    w.add_rope_dimension_count(p.rope_dim)
    w.add_expert_feed_forward_length(p.expert_ffn)
    w.add_expert_weights_norm(True)
    if a == "glm4moe":
        w.add_expert_shared_count(p.n_shared)
        w.add_leading_dense_block_count(p.first_dense)
        w.add_uint32(f"{a}.expert_gating_func", 2)  # sigmoid
        w.add_expert_weights_scale(p.routed_scale)
        return
    w.add_expert_shared_feed_forward_length(p.shared_ffn)
    w.add_ssm_conv_kernel(p.conv_kernel)
    w.add_ssm_state_size(p.lin_k_dim)
    w.add_ssm_group_count(p.lin_k_heads)
    w.add_ssm_time_step_rank(p.lin_v_heads)
    w.add_ssm_inner_size(p.lin_v_dim * p.lin_v_heads)
    w.add_full_attention_interval(p.full_attn_interval)
