"""`strata convert` for Qwen3-Next (transformers `qwen3_next`): llama.cpp's `qwen3next` tensor names and metadata.

What differs from the checkpoint (as llama.cpp's converter does it, so files load in either):
- RMSNorm weights are stored as 1 + w (transformers scales by 1 + w); the delta-net's gated output norm is not.
- The fused `in_proj_qkvz`, interleaved per key head as [q, k, v, z], is split into `attn_qkv` (all q heads, all k
  heads, all v heads: the causal conv's channel order) and `attn_gate` (z).
- A_log becomes `ssm_a` = -exp(A_log); dt_bias becomes `ssm_dt.bias`; the conv kernel is squeezed to [C, K].
- The MTP block (`mtp.*`) follows the trunk as block n_layers (`nextn_predict_layers` counts it): its decoder layer
  `mtp.layers.0.*` named as a full-attention layer, fc -> `nextn.eh_proj`, pre_fc_norm_embedding / _hidden ->
  `nextn.enorm` / `nextn.hnorm`, norm -> `nextn.shared_head_norm` (norms 1 + w as well), as llama.cpp's
  converter (_QwenMtpMixin) writes it and strata's and llama.cpp's qwen3next loaders read it.
"""

from __future__ import annotations

import logging
import re

import torch

from strata import StrataError

ARCH = "qwen3next"
log = logging.getLogger("strata")


def _interval(cfg: dict, n_layers: int) -> int:
    """full_attention_interval from the config's layer_types, which must follow that pattern."""
    types = cfg.get("layer_types")
    if not types:
        return int(cfg.get("full_attention_interval", 4))
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    interval = full[0] + 1 if full else 0
    want = ["full_attention" if interval and (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)]
    if not full or list(types[:n_layers]) != want:
        raise StrataError(f"qwen3_next layer_types {types} do not repeat one full-attention layer every N layers "
                          "(the layout GGUF's full_attention_interval describes)")
    return interval


def _split_qkvz(t: torch.Tensor, hk: int, dk: int, r: int, dv: int) -> tuple[torch.Tensor, torch.Tensor]:
    per_head = t.view(hk, 2 * dk + 2 * r * dv, -1)  # [Hk, q + k + v + z, d]
    q, k, v, z = per_head.split([dk, dk, r * dv, r * dv], dim=1)
    d = t.shape[-1]
    return torch.cat([q.reshape(-1, d), k.reshape(-1, d), v.reshape(-1, d)]), z.reshape(-1, d)


def mtp_layers(cfg: dict, ck, d) -> int:
    """How many MTP blocks to write: those the checkpoint holds (`mtp.layers.N.*`; Qwen3-Next's config does not
    always count them, so llama.cpp counts them in the checkpoint too); a config that declares blocks the checkpoint
    lacks (a trunk-only export) is written without them, with a warning."""
    held = {int(m.group(1)) for k in ck.index if (m := re.match(r"mtp\.layers\.(\d+)\.", k))}
    n = max(held) + 1 if held else 0
    declared = int(cfg.get("mtp_num_hidden_layers") or cfg.get("num_nextn_predict_layers") or 0)
    if declared and not n:
        log.warning("strata convert: %s declares %d MTP block(s) (num_nextn_predict_layers) but holds none: "
                    "written without them", d, declared)
    elif not n and any(k.startswith("mtp.") for k in ck.index):
        log.warning("strata convert: %s holds mtp.* tensors but no MTP decoder layer (mtp.layers.0): written "
                    "without them", d)
    return n


def convert_layers(cfg: dict, ck, w, put, n_layers: int, n_exp: int, head_dim: int, n_mtp: int = 0) -> None:
    if not n_exp:
        raise StrataError("qwen3_next without experts (num_experts 0) is not a Qwen3-Next layout strata runs")
    if cfg.get("mlp_only_layers") or (cfg.get("decoder_sparse_step") or 1) != 1:
        raise StrataError("qwen3_next with dense layers (mlp_only_layers, decoder_sparse_step) is not supported")
    hk, hv = int(cfg["linear_num_key_heads"]), int(cfg["linear_num_value_heads"])
    dk, dv = int(cfg["linear_key_head_dim"]), int(cfg["linear_value_head_dim"])
    if hv % hk:
        raise StrataError(f"qwen3_next: {hv} linear value heads are not a multiple of {hk} key heads")
    r = hv // hk
    interval = _interval(cfg, n_layers)
    rp = cfg.get("rope_parameters") or {}
    partial = float(rp.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25)))
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(int(head_dim * partial))
    w.add_expert_count(int(n_exp))
    w.add_expert_used_count(int(cfg["num_experts_per_tok"]))
    w.add_expert_feed_forward_length(int(cfg["moe_intermediate_size"]))
    w.add_expert_shared_feed_forward_length(int(cfg["shared_expert_intermediate_size"]))
    w.add_expert_weights_norm(bool(cfg.get("norm_topk_prob", True)))
    w.add_ssm_conv_kernel(int(cfg["linear_conv_kernel_dim"]))
    w.add_ssm_state_size(dk)
    w.add_ssm_group_count(hk)
    w.add_ssm_time_step_rank(hv)
    w.add_ssm_inner_size(dv * hv)
    w.add_full_attention_interval(interval)
    if n_mtp:
        w.add_nextn_predict_layers(n_mtp)
    for i in range(n_layers + n_mtp):
        p, b = (f"model.layers.{i}." if i < n_layers else f"mtp.layers.{i - n_layers}."), f"blk.{i}."
        if i == n_layers:  # the MTP block's own projection and norms (llama.cpp's nextn names)
            put(b + "nextn.eh_proj.weight", ck.get("mtp.fc.weight"))
            for hf, gg in (("pre_fc_norm_embedding", "enorm"), ("pre_fc_norm_hidden", "hnorm"),
                           ("norm", "shared_head_norm")):
                put(f"{b}nextn.{gg}.weight", ck.get(f"mtp.{hf}.weight") + 1.0)
        put(b + "attn_norm.weight", ck.get(p + "input_layernorm.weight") + 1.0)
        put(b + "post_attention_norm.weight", ck.get(p + "post_attention_layernorm.weight") + 1.0)
        if i >= n_layers or (i + 1) % interval == 0:  # (an MTP block is a full-attention layer)
            s = p + "self_attn."
            for hf, gg in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_output")):
                put(f"{b}{gg}.weight", ck.get(f"{s}{hf}.weight"))
            put(b + "attn_q_norm.weight", ck.get(s + "q_norm.weight") + 1.0)
            put(b + "attn_k_norm.weight", ck.get(s + "k_norm.weight") + 1.0)
        else:
            s = p + "linear_attn."
            qkv, z = _split_qkvz(ck.get(s + "in_proj_qkvz.weight"), hk, dk, r, dv)
            put(b + "attn_qkv.weight", qkv)
            put(b + "attn_gate.weight", z)
            put(b + "ssm_ba.weight", ck.get(s + "in_proj_ba.weight"))
            put(b + "ssm_conv1d.weight", ck.get(s + "conv1d.weight").squeeze(1), keep_f32=True)
            put(b + "ssm_dt.bias", ck.get(s + "dt_bias"))
            put(b + "ssm_a", -torch.exp(ck.get(s + "A_log")))
            put(b + "ssm_norm.weight", ck.get(s + "norm.weight"))
            put(b + "ssm_out.weight", ck.get(s + "out_proj.weight"))
        m = p + "mlp."
        put(b + "ffn_gate_inp.weight", ck.get(m + "gate.weight"), keep_f32=True)
        g, u, dn = ck.experts(m + "experts.", n_exp, ("gate_proj", "up_proj", "down_proj"))
        put(b + "ffn_gate_exps.weight", g)
        put(b + "ffn_up_exps.weight", u)
        put(b + "ffn_down_exps.weight", dn)
        for hf, gg in (("gate_proj", "ffn_gate_shexp"), ("up_proj", "ffn_up_shexp"), ("down_proj", "ffn_down_shexp")):
            put(f"{b}{gg}.weight", ck.get(f"{m}shared_expert.{hf}.weight"))
        put(b + "ffn_gate_inp_shexp.weight", ck.get(m + "shared_expert_gate.weight"), keep_f32=True)
