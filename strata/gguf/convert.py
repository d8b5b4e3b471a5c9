"""`strata convert HF_DIR OUT.gguf`: a transformers checkpoint (safetensors + config + tokenizer) to GGUF.

Tensor names and metadata follow llama.cpp's converter, so files made here also load in llama.cpp (and files
made there load here): Llama/Mixtral Q/K rows are permuted for pair-order rotary, experts are stacked into one
`[E, out, in]` tensor per projection, DeepSeek's kv_b is split into per-head k_b/v_b, GLM's, DeepSeek-V3's and
Qwen3-Next's MTP blocks follow the trunk, gpt-oss's interleaved gate_up is split (strata.gguf.convert_gpt_oss).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
from pathlib import Path

import numpy as np
import torch

from strata import StrataError
from strata.gguf.convert_input import INDEX, Checkpoint, read_config

log = logging.getLogger("strata")

FILE_TYPES = {"f32": 0, "f16": 1, "q8_0": 7, "bf16": 32}  # llama.cpp's LLAMA_FTYPE values
# The smallest magnitude f16 rounds to inf (halfway between its largest finite value, 65504, and 65536).
F16_OVERFLOW = 65520.0
Q8_0_BLOCK = 32  # values per Q8_0 block: a row must hold whole blocks


def _permute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    # Rotate-half order -> adjacent-pair order, per head (what llama.cpp's LlamaModel.permute does).
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _rope_theta(cfg: dict) -> float:
    rp = cfg.get("rope_parameters") or {}
    return float(rp.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def output_path(out: Path, d: Path, out_type: str) -> Path:
    """Where `strata convert` writes: OUT, or OUT/<checkpoint name>-<TYPE>.gguf when OUT is a directory (as
    llama.cpp's converter names it, less its parameter-count label). StrataError when that cannot be written."""
    import gguf

    if out.is_dir():
        out = out / f"{gguf.naming_convention(d.name, None, None, None, None, out_type.upper())}.gguf"
        if out.is_dir():
            raise StrataError(f"{out} is a directory, not a file to write the GGUF to")
    parent = out.parent
    if not parent.exists():
        raise StrataError(f"cannot write {out}: the directory {parent} does not exist")
    if not parent.is_dir():
        raise StrataError(f"cannot write {out}: {parent} is not a directory")
    return out


def _range_error(name: str, a: torch.Tensor, qtype) -> str | None:
    """Why tensor `a` cannot be written as f16 (or as Q8_0, whose block scales are f16) without infinities."""
    import gguf

    if qtype not in (gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.Q8_0) or not a.numel():
        return None
    m = float(a.abs().amax())
    if qtype == gguf.GGMLQuantizationType.F16 and m >= F16_OVERFLOW:
        return (f"tensor {name} holds values up to {m:.6g}, beyond f16's range (65504): convert with --type bf16 "
                "or --type f32")
    if qtype == gguf.GGMLQuantizationType.Q8_0 and m / 127 >= F16_OVERFLOW:  # (gguf-py's scale: amax / 127)
        return (f"tensor {name} holds values up to {m:.6g}: its Q8_0 block scale ({m / 127:.6g}) is beyond the "
                "range of the f16 that stores it (65504): convert with --type bf16 or --type f32")
    return None


def convert(hf_dir: str | os.PathLike, out: str | os.PathLike, out_type: str = "f32") -> Path:
    """Write `hf_dir` as GGUF to `out` (a file, or a directory to name it in: see output_path); out_type "auto"
    picks bf16 or f16 as llama.cpp's `--outtype auto` does. Returns the file written."""
    if isinstance(out, str) and out.endswith(os.sep) and not Path(out).is_dir():  # (Path drops the slash)
        raise StrataError(f"cannot write to {out}: the directory does not exist")
    d, out = Path(hf_dir), Path(out)
    if out_type not in (*FILE_TYPES, "auto"):
        raise StrataError(f"--type must be one of auto, {', '.join(FILE_TYPES)} (got {out_type})")
    cfg = read_config(d)
    mt = cfg.get("model_type")
    if not mt:
        raise StrataError(f"{cfg.path} has no model_type (it names the architecture strata convert maps)")
    mt = mt if isinstance(mt, str) else repr(mt)
    arch = {"qwen3_moe": "qwen3moe", "qwen3": "qwen3", "mixtral": "llama", "llama": "llama",
            "deepseek_v3": "deepseek2", "deepseek_v2": "deepseek2", "glm4_moe": "glm4moe",
            "gpt_oss": "gpt-oss", "qwen3_next": "qwen3next"}.get(mt)
    if arch is None:
        raise StrataError(f"{d}: model_type '{mt}' is not supported by strata convert "
                          "(qwen3_moe, qwen3, mixtral, llama, deepseek_v3, deepseek_v2, glm4_moe, gpt_oss, "
                          "qwen3_next)")
    ck = Checkpoint(d)  # (headers only: the weights are read as they are converted)
    tok = _tokenizer(d, int(cfg["vocab_size"]))  # (before hours of converting a large checkpoint, not after)
    if out_type == "auto":
        out_type = ck.auto_type()
    out = output_path(out, d, out_type)
    inputs = [*ck.files, cfg.path, *(d / n for n in ("tokenizer.json", "tokenizer_config.json", INDEX))]
    if out.exists() and any(f.exists() and os.path.samefile(out, f) for f in inputs):
        raise StrataError(f"{out} is a file of the checkpoint being converted: give another OUT")
    # Create the temporary file now: a path that cannot be written fails before any tensor is converted. Its name
    # is this run's own (claim_temp): through one shared OUT.tmp, two runs writing one OUT renamed each other's
    # file half-written.
    from strata.gguf.writer import claim_temp

    try:
        tmp = claim_temp(out)
    except OSError as e:
        raise StrataError(f"cannot write {out}: {e.strerror or e}") from None
    try:
        _convert(d, cfg, mt, arch, ck, out, tmp, out_type, tok)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return out


def _convert(d: Path, cfg: dict, mt: str, arch: str, ck: Checkpoint, out: Path, tmp: Path, out_type: str,
             tok: dict) -> None:
    import gguf

    from strata.quant import QTensor

    n_layers, d_model, n_head = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]
    n_kv = cfg.get("num_key_value_heads") or n_head
    head_dim = cfg.get("head_dim") or d_model // n_head
    qtype = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
             "bf16": gguf.GGMLQuantizationType.BF16, "q8_0": gguf.GGMLQuantizationType.Q8_0}[out_type]

    w = gguf.GGUFWriter(str(tmp), arch)
    w.add_name(cfg.get("_name_or_path") or d.name)
    w.add_file_type(FILE_TYPES[out_type])
    # GLM's and DeepSeek-V3's MTP blocks follow the trunk as blocks n_layers.. (llama.cpp's layout: block_count
    # counts them); a checkpoint that declares them without their tensors is written without
    n_nextn = int(cfg.get("num_nextn_predict_layers") or 0) if arch in ("glm4moe", "deepseek2") else 0
    if n_nextn and not ck.has(f"model.layers.{n_layers}.eh_proj.weight"):
        log.warning("strata convert: %s declares %d MTP block(s) (num_nextn_predict_layers) but holds none: "
                    "written without them", d, n_nextn)
        n_nextn = 0
    if arch == "qwen3next":  # Qwen3-Next keeps its MTP block apart, as mtp.*
        from strata.gguf.convert_qwen3next import mtp_layers

        n_nextn = mtp_layers(cfg, ck, d)
    w.add_block_count(n_layers + n_nextn)
    w.add_context_length(int(cfg.get("max_position_embeddings", 4096)))
    w.add_embedding_length(d_model)
    w.add_head_count(n_head)
    # MLA runs as MQA over the latent cache: llama.cpp's layout (and its graph) needs head_count_kv = 1
    w.add_head_count_kv(1 if arch == "deepseek2" else n_kv)
    w.add_rope_freq_base(_rope_theta(cfg))
    w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
    w.add_vocab_size(int(cfg["vocab_size"]))
    if cfg.get("intermediate_size"):
        w.add_feed_forward_length(int(cfg["intermediate_size"]))

    F32, F16, Q8_0 = gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.Q8_0

    def tensor_type(a: torch.Tensor, keep_f32: bool):
        if keep_f32 or a.ndim == 1 or qtype == F32:
            return F32
        if qtype == Q8_0 and a.shape[-1] % Q8_0_BLOCK:
            # rows that are not whole Q8_0 blocks: this tensor as f16, as llama.cpp's converter does (its
            # QuantError fallback), so the file stays a 16-bit one rather than holding it as f32
            return F16
        return qtype

    # Two passes over the same mapping, so that only one converted tensor is held at a time (GGUFWriter.add_tensor
    # would keep every one until the end): the first, over the checkpoint's headers (meta tensors), lays out the
    # metadata and each tensor's name, shape and type; the second converts and writes the tensors in that order.
    planned: list[str] = []

    def plan(name: str, t: torch.Tensor, keep_f32: bool = False) -> None:
        qt, shape = tensor_type(t, keep_f32), tuple(t.shape)
        if qt == F32:
            w.add_tensor_info(name, shape, np.dtype(np.float32), 4 * math.prod(shape))
        else:
            if not shape:  # (what QTensor.from_float says of it)
                raise StrataError(f"cannot quantize shape {shape} to {qt.name}: the last dim must be a multiple of 1")
            raw = gguf.quants.quant_shape_to_byte_shape(shape, qt)
            w.add_tensor_info(name, raw, np.dtype(np.uint8), math.prod(raw), raw_dtype=qt)
        planned.append(name)

    def put(name: str, t: torch.Tensor, keep_f32: bool = False) -> None:
        if name != planned[len(written)]:
            raise RuntimeError(f"strata convert wrote {name} where it planned {planned[len(written)]}")
        a = t.detach().float().contiguous()
        qt = tensor_type(a, keep_f32)
        if qt == F32:
            w.write_tensor_data(a.numpy())
        else:
            if (why := _range_error(name, a, qt)) is not None:
                if qt != qtype:
                    why += (f" (its rows of {a.shape[-1]} are not whole {Q8_0_BLOCK}-value Q8_0 blocks: it is f16 "
                            "in a q8_0 file)")
                raise StrataError(why)  # (convert() then removes the temporary file)
            w.write_tensor_data(QTensor.from_float(a, qt).raw.numpy())
        written.append(name)

    written: list[str] = []
    ck.meta = True
    try:
        _tensors(d, cfg, mt, arch, ck, w, plan, n_nextn, head_dim)
    finally:
        ck.meta = False

    from strata.gguf.tokenizer_hf import write_tokenizer_metadata

    write_tokenizer_metadata(w, tok)

    def unmapped(k: str) -> bool:
        if k in ck.used or "rotary_emb" in k:
            return False
        if k.startswith("mtp."):  # Qwen3-Next's MTP block: all of it is used when it is written (n_nextn)
            return bool(n_nextn)
        m = re.search(r"layers\.(\d+)\.", k)
        # layers past the last are MTP heads, converted for glm4moe and deepseek2 (n_nextn) only
        return not (m and int(m.group(1)) >= n_layers + n_nextn)

    left = [k for k in ck.index if unmapped(k)]
    if left:
        raise StrataError(f"{d}: checkpoint tensors strata convert does not map: {', '.join(sorted(left)[:5])}")
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        _tensors(d, cfg, mt, arch, ck, _MetadataWritten(), put, n_nextn, head_dim)
        w.close()
        os.replace(tmp, out)
    except OSError as e:  # a full disk, a quota, a file size limit: one line, and convert() removes tmp
        _close_quietly(w)
        # (numpy's tofile reports a short write with no errno: the cause is then most likely space)
        why = e.strerror or f"{e}: a short write (is the disk full?)"
        raise StrataError(f"cannot write {out}: {why}") from None
    except BaseException:
        _close_quietly(w)
        raise


class _MetadataWritten:
    """The writer the second pass maps with: the metadata is in the file by then, so its add_* calls do nothing."""

    def __getattr__(self, name: str):
        return lambda *args, **kwargs: None


def _close_quietly(w) -> None:
    for f in w.fout or []:
        with contextlib.suppress(OSError):  # closing flushes, which fails as the write did
            f.close()
    w.fout = None


def _tensors(d: Path, cfg: dict, mt: str, arch: str, ck: Checkpoint, w, put, n_nextn: int, head_dim: int) -> None:
    """Every output tensor, in file order, through put(name, tensor, keep_f32), and the metadata that goes with
    the layer layout through w."""
    n_layers, d_model, n_head = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]
    n_kv = cfg.get("num_key_value_heads") or n_head



    put("token_embd.weight", ck.get("model.embed_tokens.weight"))
    # Qwen3-Next's RMSNorms scale by 1 + w: GGUF stores 1 + w (as llama.cpp's converter does)
    put("output_norm.weight", ck.get("model.norm.weight") + (1.0 if arch == "qwen3next" else 0.0))
    if ck.has("lm_head.weight") and not cfg.get("tie_word_embeddings", False):
        put("output.weight", ck.get("lm_head.weight"))
    elif ck.has("lm_head.weight"):
        ck.used.add("lm_head.weight")  # tied: the embedding serves as the head

    n_exp = cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 0
    if arch == "deepseek2":
        _deepseek(cfg, ck, w, put, n_layers, n_exp, n_nextn)
    elif arch == "glm4moe":
        _glm4moe(cfg, ck, w, put, n_layers, n_nextn, head_dim)
    elif arch == "gpt-oss":
        from strata.gguf.convert_gpt_oss import gpt_oss

        gpt_oss(cfg, ck, w, put, n_layers, n_exp)
    elif arch == "qwen3next":
        from strata.gguf.convert_qwen3next import convert_layers

        convert_layers(cfg, ck, w, put, n_layers, n_exp, head_dim, n_nextn)
    else:
        if n_exp:
            w.add_expert_count(int(n_exp))
            w.add_expert_used_count(int(cfg["num_experts_per_tok"]))
        if arch == "qwen3moe":
            w.add_expert_feed_forward_length(int(cfg["moe_intermediate_size"]))
            w.add_bool(f"{arch}.expert_weights_norm", bool(cfg.get("norm_topk_prob", True)))
        if arch in ("qwen3moe", "qwen3"):
            w.add_key_length(head_dim)
            w.add_value_length(head_dim)
        elif head_dim != d_model // n_head:
            w.add_key_length(head_dim)
            w.add_value_length(head_dim)
        if arch == "llama":
            w.add_rope_dimension_count(head_dim)
        sparse = set(cfg.get("mlp_only_layers") or [])
        step = cfg.get("decoder_sparse_step", 1) or 1
        for i in range(n_layers):
            p, b = f"model.layers.{i}.", f"blk.{i}."
            q, k = ck.get(p + "self_attn.q_proj.weight"), ck.get(p + "self_attn.k_proj.weight")
            if arch == "llama":
                q, k = _permute_qk(q, n_head), _permute_qk(k, n_kv)
            put(b + "attn_q.weight", q)
            put(b + "attn_k.weight", k)
            put(b + "attn_v.weight", ck.get(p + "self_attn.v_proj.weight"))
            put(b + "attn_output.weight", ck.get(p + "self_attn.o_proj.weight"))
            if ck.has(p + "self_attn.q_norm.weight"):
                put(b + "attn_q_norm.weight", ck.get(p + "self_attn.q_norm.weight"))
                put(b + "attn_k_norm.weight", ck.get(p + "self_attn.k_norm.weight"))
            put(b + "attn_norm.weight", ck.get(p + "input_layernorm.weight"))
            put(b + "ffn_norm.weight", ck.get(p + "post_attention_layernorm.weight"))
            moe = n_exp and i not in sparse and (i + 1) % step == 0
            if moe and mt == "mixtral":
                m = p + "block_sparse_moe."
                m = m if ck.has(m + "gate.weight") else p + "mlp."
                put(b + "ffn_gate_inp.weight", ck.get(m + "gate.weight"), keep_f32=True)
                g, u, dn = ck.experts(m + "experts.", n_exp, ("w1", "w3", "w2"))
            elif moe:
                put(b + "ffn_gate_inp.weight", ck.get(p + "mlp.gate.weight"), keep_f32=True)
                g, u, dn = ck.experts(p + "mlp.experts.", n_exp, ("gate_proj", "up_proj", "down_proj"))
            if moe:
                put(b + "ffn_gate_exps.weight", g)
                put(b + "ffn_up_exps.weight", u)
                put(b + "ffn_down_exps.weight", dn)
            else:
                for hf, gg in (("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"), ("down_proj", "ffn_down")):
                    put(f"{b}{gg}.weight", ck.get(f"{p}mlp.{hf}.weight"))
        if n_exp and (sparse or step != 1):
            raise StrataError(f"{d}: mixed dense/MoE layer patterns (mlp_only_layers, decoder_sparse_step) are not supported")


def _deepseek(cfg, ck, w, put, n_layers, n_exp, n_nextn=0):
    """DeepSeek-V2/V3: llama.cpp's deepseek2 layout (the latent attention's kv_b split per head); DeepSeek-V3's MTP
    blocks keep their block tensors plus `nextn.*`, as llama.cpp's deepseek2 loader reads them."""
    nope, rope, vd = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    lora, qlora, h = cfg["kv_lora_rank"], cfg.get("q_lora_rank") or 0, cfg["num_attention_heads"]
    a = "deepseek2"
    # llama.cpp's current layout: key/value lengths describe the latent cache, *_mla the per-head sizes.
    w.add_key_length(lora + rope)
    w.add_value_length(lora)
    w.add_uint32(f"{a}.attention.key_length_mla", nope + rope)
    w.add_uint32(f"{a}.attention.value_length_mla", vd)
    w.add_rope_dimension_count(rope)
    w.add_kv_lora_rank(lora)
    if qlora:
        w.add_q_lora_rank(qlora)
    first_dense = int(cfg.get("first_k_dense_replace", 0))
    w.add_leading_dense_block_count(first_dense)
    w.add_expert_count(int(n_exp))
    w.add_expert_used_count(int(cfg["num_experts_per_tok"]))
    w.add_expert_feed_forward_length(int(cfg["moe_intermediate_size"]))
    w.add_expert_shared_count(int(cfg.get("n_shared_experts") or 0))
    w.add_expert_weights_scale(float(cfg.get("routed_scaling_factor", 1.0)))
    w.add_expert_weights_norm(bool(cfg.get("norm_topk_prob", False)))
    gating = cfg.get("scoring_func", "sigmoid" if cfg.get("model_type") == "deepseek_v3" else "softmax")
    w.add_uint32(f"{a}.expert_gating_func", 2 if gating == "sigmoid" else 1)
    w.add_uint32(f"{a}.expert_group_count", int(cfg.get("n_group") or 1))
    w.add_uint32(f"{a}.expert_group_used_count", int(cfg.get("topk_group") or 1))
    rs = cfg.get("rope_scaling") or {}
    rp = cfg.get("rope_parameters") or {}
    if (rs.get("type") or rs.get("rope_type") or rp.get("rope_type")) == "yarn":
        r = rs or rp
        w.add_rope_scaling_type(__import__("gguf").RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(r["factor"]))
        w.add_rope_scaling_orig_ctx_len(int(r["original_max_position_embeddings"]))
        w.add_float32(f"{a}.rope.scaling.yarn_log_multiplier", 0.1 * float(r.get("mscale_all_dim", 0.0)))
    if n_nextn:
        w.add_uint32(f"{a}.nextn_predict_layers", n_nextn)
    for i in range(n_layers + n_nextn):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        if i >= n_layers:
            _nextn_tensors(ck, put, p, b)
        s = p + "self_attn."
        if qlora:
            put(b + "attn_q_a.weight", ck.get(s + "q_a_proj.weight"))
            put(b + "attn_q_a_norm.weight", ck.get(s + "q_a_layernorm.weight"))
            put(b + "attn_q_b.weight", ck.get(s + "q_b_proj.weight"))
        else:
            put(b + "attn_q.weight", ck.get(s + "q_proj.weight"))
        put(b + "attn_kv_a_mqa.weight", ck.get(s + "kv_a_proj_with_mqa.weight"))
        put(b + "attn_kv_a_norm.weight", ck.get(s + "kv_a_layernorm.weight"))
        kvb = ck.get(s + "kv_b_proj.weight").view(h, nope + vd, lora)
        put(b + "attn_k_b.weight", kvb[:, :nope].transpose(1, 2).contiguous())  # [H, lora, nope]
        put(b + "attn_v_b.weight", kvb[:, nope:].contiguous())  # [H, v, lora]
        put(b + "attn_output.weight", ck.get(s + "o_proj.weight"))
        put(b + "attn_norm.weight", ck.get(p + "input_layernorm.weight"))
        put(b + "ffn_norm.weight", ck.get(p + "post_attention_layernorm.weight"))
        if i < first_dense:
            for hf, gg in (("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"), ("down_proj", "ffn_down")):
                put(f"{b}{gg}.weight", ck.get(f"{p}mlp.{hf}.weight"))
            continue
        put(b + "ffn_gate_inp.weight", ck.get(p + "mlp.gate.weight"), keep_f32=True)
        if ck.has(p + "mlp.gate.e_score_correction_bias"):
            put(b + "exp_probs_b.bias", ck.get(p + "mlp.gate.e_score_correction_bias"), keep_f32=True)
        g, u, dn = ck.experts(p + "mlp.experts.", n_exp, ("gate_proj", "up_proj", "down_proj"))
        put(b + "ffn_gate_exps.weight", g)
        put(b + "ffn_up_exps.weight", u)
        put(b + "ffn_down_exps.weight", dn)
        if cfg.get("n_shared_experts"):
            for hf, gg in (("gate_proj", "ffn_gate_shexp"), ("up_proj", "ffn_up_shexp"), ("down_proj", "ffn_down_shexp")):
                put(f"{b}{gg}.weight", ck.get(f"{p}mlp.shared_experts.{hf}.weight"))


def _glm4moe(cfg, ck, w, put, n_layers, n_nextn, head_dim):
    """GLM-4.5/4.6: llama.cpp's glm4moe layout (Q/K left in rotate-half order: this family's rotary is NEOX;
    the post-attention norm is `post_attention_norm`; MTP blocks keep their block tensors plus `nextn.*`)."""
    a = "glm4moe"
    rp = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if (rp.get("rope_type") or rp.get("type") or "default") != "default":
        raise StrataError(f"glm4_moe with rope type {rp.get('rope_type') or rp.get('type')!r} is not supported")
    partial = rp.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.5))
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(int(head_dim * partial))
    n_exp, first_dense = int(cfg["n_routed_experts"]), int(cfg.get("first_k_dense_replace", 1))
    n_shared = int(cfg.get("n_shared_experts") or 0)
    w.add_expert_count(n_exp)
    w.add_expert_used_count(int(cfg["num_experts_per_tok"]))
    w.add_expert_feed_forward_length(int(cfg["moe_intermediate_size"]))
    w.add_expert_shared_count(n_shared)
    w.add_leading_dense_block_count(first_dense)
    w.add_uint32(f"{a}.expert_gating_func", 2)  # sigmoid
    w.add_expert_weights_scale(float(cfg.get("routed_scaling_factor", 1.0)))
    w.add_expert_weights_norm(bool(cfg.get("norm_topk_prob", True)))
    if int(cfg.get("n_group") or 1) > 1:  # (the released GLM models route ungrouped: n_group = 1)
        w.add_uint32(f"{a}.expert_group_count", int(cfg["n_group"]))
        w.add_uint32(f"{a}.expert_group_used_count", int(cfg.get("topk_group") or 1))
    if n_nextn:
        w.add_uint32(f"{a}.nextn_predict_layers", n_nextn)
    for i in range(n_layers + n_nextn):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        s = p + "self_attn."
        for hf, gg in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v")):
            put(b + gg + ".weight", ck.get(s + hf + ".weight"))
            if ck.has(s + hf + ".bias"):
                put(b + gg + ".bias", ck.get(s + hf + ".bias"))
        put(b + "attn_output.weight", ck.get(s + "o_proj.weight"))
        if ck.has(s + "q_norm.weight"):
            put(b + "attn_q_norm.weight", ck.get(s + "q_norm.weight"))
            put(b + "attn_k_norm.weight", ck.get(s + "k_norm.weight"))
        put(b + "attn_norm.weight", ck.get(p + "input_layernorm.weight"))
        put(b + "post_attention_norm.weight", ck.get(p + "post_attention_layernorm.weight"))
        if i < first_dense:
            for hf, gg in (("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"), ("down_proj", "ffn_down")):
                put(f"{b}{gg}.weight", ck.get(f"{p}mlp.{hf}.weight"))
        else:
            put(b + "ffn_gate_inp.weight", ck.get(p + "mlp.gate.weight"), keep_f32=True)
            put(b + "exp_probs_b.bias", ck.get(p + "mlp.gate.e_score_correction_bias"), keep_f32=True)
            g, u, dn = ck.experts(p + "mlp.experts.", n_exp, ("gate_proj", "up_proj", "down_proj"))
            put(b + "ffn_gate_exps.weight", g)
            put(b + "ffn_up_exps.weight", u)
            put(b + "ffn_down_exps.weight", dn)
            if n_shared:
                for hf, gg in (("gate_proj", "ffn_gate_shexp"), ("up_proj", "ffn_up_shexp"),
                               ("down_proj", "ffn_down_shexp")):
                    put(f"{b}{gg}.weight", ck.get(f"{p}mlp.shared_experts.{hf}.weight"))
        if i >= n_layers:
            _nextn_tensors(ck, put, p, b)


def _nextn_tensors(ck, put, p: str, b: str) -> None:
    """An MTP block's own tensors (checkpoint layer prefix p) as llama.cpp names them (`blk.N.nextn.*`)."""
    for hf, gg in (("eh_proj", "eh_proj"), ("enorm", "enorm"), ("hnorm", "hnorm")):
        put(f"{b}nextn.{gg}.weight", ck.get(f"{p}{hf}.weight"))
    for hf, gg in (("embed_tokens", "embed_tokens"), ("shared_head.head", "shared_head_head"),
                   ("shared_head.norm", "shared_head_norm")):
        if ck.has(f"{p}{hf}.weight"):
            put(f"{b}nextn.{gg}.weight", ck.get(f"{p}{hf}.weight"))


def _tokenizer(d: Path, vocab_size: int) -> dict:
    """The tokenizer's GGUF metadata, its token list padded to the embedding's vocab_size rows."""
    if not (d / "tokenizer.json").exists():
        raise StrataError(f"{d}: no tokenizer.json (strata convert needs the checkpoint's tokenizer)")
    from strata.gguf.tokenizer_hf import hf_tokenizer_to_metadata

    md = hf_tokenizer_to_metadata(d)
    toks = md.get("tokenizer.ggml.tokens", [])
    if len(toks) > vocab_size:  # ids the embedding has no row for (llama.cpp's converter refuses these too)
        raise StrataError(f"{d / 'tokenizer.json'} has {len(toks)} tokens, more than the {vocab_size} of "
                          f"config.json's vocab_size (the embedding's rows)")
    if len(toks) < vocab_size:  # the embedding has padding rows: name them like llama.cpp does
        md["tokenizer.ggml.tokens"] = list(toks) + [f"[PAD{i}]" for i in range(len(toks), vocab_size)]
        if "tokenizer.ggml.token_type" in md:
            md["tokenizer.ggml.token_type"] = list(md["tokenizer.ggml.token_type"]) + [5] * (vocab_size - len(toks))
        if "tokenizer.ggml.scores" in md:
            md["tokenizer.ggml.scores"] = list(md["tokenizer.ggml.scores"]) + [0.0] * (vocab_size - len(toks))
    return md
