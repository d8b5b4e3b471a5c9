"""The gpt-oss part of `strata convert` (transformers' GptOssForCausalLM -> llama.cpp's `gpt-oss` layout).

transformers stores each layer's experts fused and input-major: gate_up_proj [E, d, 2*ff] with gate and up
interleaved (columns 0, 2, 4, ... are gate), down_proj [E, ff, d], and their biases [E, 2*ff], [E, d]. GGUF
wants one [E, out, in] tensor per projection (`ffn_{gate,up,down}_exps.weight`) and bias (`.bias`), as llama.cpp's
converter writes them. Checkpoints in MXFP4 (the released gpt-oss weights) are not read here yet.
"""

from __future__ import annotations

from strata import StrataError


def gpt_oss(cfg: dict, ck, w, put, n_layers: int, n_exp: int) -> None:
    import gguf

    if ck.has("model.layers.0.mlp.experts.gate_up_proj_blocks"):
        raise StrataError("gpt-oss checkpoint in MXFP4 (gate_up_proj_blocks): strata convert reads float weights "
                          "only; dequantize it first (transformers' Mxfp4Config(dequantize=True))")
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_expert_count(int(n_exp))
    w.add_expert_used_count(int(cfg["num_experts_per_tok"]))
    w.add_expert_feed_forward_length(int(cfg["intermediate_size"]))
    w.add_sliding_window(int(cfg["sliding_window"]))
    types = cfg.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)]
    sliding = [t == "sliding_attention" for t in types]
    if sliding != [i % 2 == 0 for i in range(n_layers)]:
        # llama.cpp's gpt-oss assumes even layers slide; another pattern is written out (strata reads it)
        w.add_sliding_window_pattern(sliding)
    if float(cfg.get("swiglu_limit", 7.0)) != 7.0 or float(cfg.get("swiglu_alpha", 1.702)) != 1.702:
        raise StrataError("gpt-oss with swiglu_alpha/swiglu_limit other than 1.702/7.0 has no GGUF representation")
    rp = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if (rp.get("rope_type") or rp.get("type")) == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(rp["factor"]))
        w.add_rope_scaling_orig_ctx_len(int(rp["original_max_position_embeddings"]))
        w.add_rope_scaling_yarn_beta_fast(float(rp.get("beta_fast") or 32.0))
        w.add_rope_scaling_yarn_beta_slow(float(rp.get("beta_slow") or 1.0))
    for i in range(n_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        s = p + "self_attn."
        for hf, gg in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_output")):
            put(f"{b}{gg}.weight", ck.get(f"{s}{hf}.weight"))
            if ck.has(f"{s}{hf}.bias"):
                put(f"{b}{gg}.bias", ck.get(f"{s}{hf}.bias"))
        put(b + "attn_sinks.weight", ck.get(s + "sinks"))
        put(b + "attn_norm.weight", ck.get(p + "input_layernorm.weight"))
        put(b + "post_attention_norm.weight", ck.get(p + "post_attention_layernorm.weight"))
        m = p + "mlp."
        put(b + "ffn_gate_inp.weight", ck.get(m + "router.weight"), keep_f32=True)
        put(b + "ffn_gate_inp.bias", ck.get(m + "router.bias"))
        gu = ck.get(m + "experts.gate_up_proj").transpose(1, 2)  # [E, 2*ff, d]
        gub = ck.get(m + "experts.gate_up_proj_bias")  # [E, 2*ff]
        put(b + "ffn_gate_exps.weight", gu[:, 0::2])
        put(b + "ffn_up_exps.weight", gu[:, 1::2])
        put(b + "ffn_down_exps.weight", ck.get(m + "experts.down_proj").transpose(1, 2))  # [E, d, ff]
        put(b + "ffn_gate_exps.bias", gub[:, 0::2], keep_f32=True)  # biases stay exact
        put(b + "ffn_up_exps.bias", gub[:, 1::2], keep_f32=True)
        put(b + "ffn_down_exps.bias", ck.get(m + "experts.down_proj_bias"), keep_f32=True)
