"""Qwen3-Next (Qwen3-Next-80B-A3B): a hybrid of gated delta-net linear attention and gated full attention.

Layer i is full attention when `attention.recurrent_layers[i]` is false (llama.cpp's current converter writes that
array), else, in older files, when (i + 1) % full_attention_interval == 0; every other layer is a recurrent gated
delta-net layer
(strata.layers.deltanet) whose state lives per KV slot beside the KV cache (strata.kv.recurrent). Full attention
is GQA with per-head Q/K RMSNorm, NEOX rotary over the first `rope.dimension_count` dims of each head (partial
rotary), and an output gate: the Q projection yields [query, gate] per head and the attention output is scaled by
sigmoid(gate) before o_proj. Every layer's FFN is MoE: softmax over many experts, top-k renormalised, plus a
shared expert scaled by a sigmoid gate.

transformers' Qwen3-Next RMSNorms scale by (1 + w); llama.cpp's converter (and strata convert) store 1 + w, so the
GGUF weights are read as plain RMSNorm weights. The delta-net's output norm is the exception (plain w, gated).
"""

from __future__ import annotations

import torch

from strata import StrataError
from strata.gguf.reader import GGUFModel
from strata.kv.cache import KVCache, Segment
from strata.kv.recurrent import HybridCache, RecurrentState
from strata.layers.attention import _as_dtype, _cache_step, _one_query, _rows_alone, attend, fuse_rows, row_views
from strata.layers.deltanet import GatedDeltaNet, legacy_split
from strata.layers.moe import Routing
from strata.layers.rotary import Rotary
from strata.models.args import read_args
from strata.models.base import (Block, CacheSpec, CausalLM, NextNLayer, WeightLoader, build_ffn, finish_model,
                                mtp_experts_tiered)
from strata.quant import qmatmul


def load_args(g: GGUFModel):
    args = read_args(g.metadata, g.arch, g.tensors)
    need = {"hk": "ssm.group_count", "hv": "ssm.time_step_rank", "dk": "ssm.state_size", "inner": "ssm.inner_size",
            "kernel": "ssm.conv_kernel"}
    dims = {}
    for key, name in need.items():
        value = g.arch_get(name)
        if value is None:
            raise StrataError(f"GGUF metadata is missing {g.arch}.{name} (needed by the {g.arch} architecture)")
        dims[key] = int(value)
    if dims["hv"] % dims["hk"] or dims["inner"] % dims["hv"]:
        raise StrataError(f"{g.arch}: {dims['hv']} value heads do not divide into {dims['hk']} key heads, or the "
                          f"inner size {dims['inner']} into the value heads")
    dims["dv"] = dims.pop("inner") // dims["hv"]
    args.extra["linear"] = dims
    # llama.cpp's converter appends the checkpoint's MTP block after the trunk (block_count counts it)
    nextn = int(g.arch_get("nextn_predict_layers", 0) or 0)
    if not 0 <= nextn < args.n_layers:
        raise StrataError(f"{g.paths[0].name}: {g.arch}.nextn_predict_layers = {nextn} does not fit "
                          f"block_count = {args.n_layers}")
    args.n_layers -= nextn
    args.extra["nextn_layers"] = nextn
    recurrent = g.arch_get("attention.recurrent_layers")
    if recurrent is not None:  # llama.cpp's current converter: which layers are recurrent, one flag a layer
        flags = [bool(v) for v in recurrent]
        if len(flags) < args.n_layers:
            raise StrataError(f"{g.arch}.attention.recurrent_layers has {len(flags)} entries for {args.n_layers} "
                              "layers")
        args.extra["full_attention"] = [i for i in range(args.n_layers) if not flags[i]]
        return args
    interval = int(g.arch_get("full_attention_interval", 4))
    if interval < 1:
        raise StrataError(f"{g.arch}.full_attention_interval must be >= 1 (got {interval})")
    args.extra["full_attention"] = [i for i in range(args.n_layers) if (i + 1) % interval == 0]
    return args


class GatedAttention:
    """GQA whose Q projection also yields a per-head output gate: out = o_proj(attn * sigmoid(gate)).

    `slot` indexes this layer in the KV cache, which holds the attention layers alone."""

    def __init__(self, slot: int, args, w: dict, rotary: Rotary):
        self.layer, self.rotary = slot, rotary
        self.n_heads, self.n_kv, self.hd = args.n_heads, args.n_kv_heads, args.head_dim
        self.eps, self.scale = args.norm_eps, args.head_dim ** -0.5
        self.wq, self.wk, self.wv, self.wo = w["attn_q"], w["attn_k"], w["attn_v"], w["attn_output"]
        self.q_norm, self.k_norm = w["attn_q_norm"], w["attn_k_norm"]
        # on a GPU q (with its gates), k and v as one weight: one GEMV a step (each a view of it)
        self.wqkv, self.qkv_sizes = fuse_rows((self.wq, self.wk, self.wv))
        if self.wqkv is not None:
            self.wq, self.wk, self.wv = row_views(self.wqkv, self.qkv_sizes)

    def __call__(self, x: torch.Tensor, pos: torch.Tensor, segments: list[Segment], kv: KVCache) -> torch.Tensor:
        n = x.shape[0]
        if self.wqkv is not None:
            qg, k, v = qmatmul(x, self.wqkv).split(self.qkv_sizes, dim=-1)
        else:
            qg, k, v = (qmatmul(x, w) for w in (self.wq, self.wk, self.wv))
        qg = qg.view(n, self.n_heads, 2 * self.hd)  # per head: [query, gate]
        q, gate = qg[..., : self.hd], qg[..., self.hd :]  # (strided views: the rotary reads them in place)
        k, v = k.view(n, self.n_kv, self.hd), v.view(n, self.n_kv, self.hd)
        q, k = self.rotary.qk(q, k, pos, self.q_norm, self.k_norm, self.eps)
        outs, i = [], 0
        for seg in segments:
            one = bool(seg.window) and seg.n == 1
            ks, vs, mask = _cache_step(kv, self.layer, seg, k[i : i + seg.n], v[i : i + seg.n],
                                       want_mask=not (one or _rows_alone(seg, x)))
            ks, vs = _as_dtype(ks, vs, x.dtype)
            if one:
                outs.append(_one_query(q[i : i + 1], ks, vs, seg, self.scale, k.dtype))
            else:
                outs.append(attend(q[i : i + seg.n], ks, vs, mask, seg, self.scale))
            i += seg.n
        out = outs[0] if len(outs) == 1 else torch.cat(outs)  # [n, H, D]
        out = out * torch.sigmoid(gate.to(out.dtype))
        return qmatmul(out.reshape(n, self.n_heads * self.hd), self.wo)


class HybridLM(CausalLM):
    """A causal LM whose KV cache covers its attention layers only, with the recurrent layers' state beside it."""

    mtp_attention = GatedAttention  # its MTP block's attention (strata.models.mtp.MtpHead)

    def __init__(self, args, *rest, **kw):
        super().__init__(args, *rest, **kw)
        self.attn_layers = args.extra["full_attention"]
        self.recurrent_layers = [i for i in range(len(self.blocks)) if i not in set(self.attn_layers)]
        self.state_shapes = GatedDeltaNet.state_shapes(args.extra["linear"])

    def new_kv_cache(self, n_slots: int, max_ctx: int, dtype: torch.dtype | None = None, k_type=None,
                     v_type=None) -> KVCache:
        own = self.stage_layers  # a pipeline stage keeps the state and KV of its own layers only
        rec = RecurrentState([i for i in self.recurrent_layers if own is None or i in own], n_slots,
                             *self.state_shapes, device=self.device)
        kv_own = None if own is None else [j for j, i in enumerate(self.attn_layers) if i in own]
        return HybridCache(len(self.attn_layers), n_slots, max_ctx, self.cache_spec.k_shape, self.cache_spec.v_shape,
                           dtype or self.dtype, self.device, rec, k_type, v_type, layers=kv_own)

    def kv_bytes_per_token(self, dtype: torch.dtype | None = None, k_type=None, v_type=None) -> int:
        return KVCache.bytes_per_token(len(self.attn_layers), self.cache_spec.k_shape, self.cache_spec.v_shape,
                                       dtype or self.dtype, k_type, v_type)

    def state_bytes_per_slot(self) -> int:
        return RecurrentState.bytes_per_slot(len(self.recurrent_layers), *self.state_shapes)


def _linear_weights(L: WeightLoader, p: str, dims: dict) -> dict:
    w = {"ba": L.q(p + "ssm_ba.weight"), "out": L.q(p + "ssm_out.weight"), "conv": L.f(p + "ssm_conv1d.weight"),
         "dt_bias": L.f(p + "ssm_dt.bias"), "a": L.f(p + "ssm_a"), "norm": L.f(p + "ssm_norm.weight")}
    if L.has(p + "attn_qkv.weight"):
        w["qkv"], w["z"] = L.q(p + "attn_qkv.weight"), L.q(p + "attn_gate.weight")
    else:
        w["qkv"], w["z"] = legacy_split(L.q(p + "ssm_in.weight"), dims["hk"], dims["dk"], dims["hv"] // dims["hk"],
                                        dims["dv"])
    conv_dim = 2 * dims["hk"] * dims["dk"] + dims["hv"] * dims["dv"]
    if tuple(w["conv"].shape) != (conv_dim, dims["kernel"]):
        raise StrataError(f"{L.g.paths[0].name}: {p}ssm_conv1d.weight has shape {tuple(w['conv'].shape)}, the "
                          f"metadata gives ({conv_dim}, {dims['kernel']})")
    return w


def build(g: GGUFModel, cfg, make_experts, max_ctx: int, args=None):
    args = args or load_args(g)
    L = WeightLoader(g, cfg.torch_device)
    dims, attn_layers = args.extra["linear"], args.extra["full_attention"]
    rotary = Rotary(args.rope_dim or args.head_dim, args.rope_theta, "neox", max_ctx, args.rope_scaling)
    routing = Routing(args.n_experts, args.n_experts_used, "softmax",
                      norm_topk=bool(g.arch_get("expert_weights_norm", True)))
    blocks, experts = [], {}
    for i in range(args.n_layers):
        p = f"blk.{i}."
        if i in attn_layers:
            w = {n: L.q(p + n + ".weight") for n in ("attn_q", "attn_k", "attn_v", "attn_output")}
            w["attn_q_norm"], w["attn_k_norm"] = L.f(p + "attn_q_norm.weight"), L.f(p + "attn_k_norm.weight")
            attn = GatedAttention(attn_layers.index(i), args, w, rotary)
        else:
            attn = GatedDeltaNet(i, dims, _linear_weights(L, p, dims), args.norm_eps)
        ffn = build_ffn(L, args, i, routing, experts)
        blocks.append(Block(L.f(p + "attn_norm.weight"), attn, L.f(p + "post_attention_norm.weight"), ffn,
                            args.norm_eps))
    nextn = [b for b in (_nextn_layer(L, i) for i in range(args.n_layers, args.n_layers + args.extra["nextn_layers"]))
             if b is not None]
    mtp_experts_tiered(cfg, nextn, experts)
    spec = CacheSpec((args.n_kv_heads, args.head_dim), (args.n_kv_heads, args.head_dim))
    model = finish_model(L, args, blocks, experts, spec, cfg.torch_dtype, make_experts, lm_class=HybridLM)
    model.nextn = nextn
    return model


MTP_REQUIRED = ("nextn.eh_proj.weight", "nextn.enorm.weight", "nextn.hnorm.weight", "attn_norm.weight",
                "post_attention_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
                "attn_q_norm.weight", "attn_k_norm.weight", "ffn_gate_inp.weight", "ffn_down_exps.weight")


def _nextn_layer(L: WeightLoader, i: int) -> NextNLayer | None:
    """The MTP block at GGUF block i (a gated full-attention layer with the MoE, and the nextn projections), every
    tensor of it kept in host RAM for `--draft-source mtp`; None when the file holds none of it (llama.cpp can
    write the MTP block to a file of its own, or leave it out: --no-mtp)."""
    p = f"blk.{i}."
    names = [n for n in L.g.tensors if n.startswith(p)]
    if not names:
        return None
    for n in MTP_REQUIRED:
        if p + n not in L.g.tensors:
            raise StrataError(f"{L.g.paths[0].name}: tensor {p + n} is missing (needed by the MTP block)")
    cpu = torch.device("cpu")
    return NextNLayer(i, {n[len(p):]: L.q(n, cpu) for n in sorted(names)})
