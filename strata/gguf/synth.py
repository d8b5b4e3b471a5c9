"""`strata synth PRESET OUT.gguf`: architecture-faithful GGUF files with pseudo-random weights, for benchmarks.

Shapes, metadata and tensor names are those of the real model (the way llama.cpp's converter writes them); the
vocabulary is the real one (Qwen3's 151,936 tokens, Llama 2's SentencePiece for Mixtral, DeepSeek LLM's BPE padded
to V3's size) with the family's chat template, so prompts tokenize as they would on the real model.

The weights are random but shaped so that routing behaves like a trained model's, not uniformly: the token
embeddings are large (std 1, 50x the usual 0.02) and every residual branch writes back small (attention output
and FFN down projections at 0.1x), so the hidden state stays dominated by the token's identity through the whole
depth. Each layer's router then sends a token to the same experts whenever it occurs (reuse from token to token,
Zipf-like popularity from the text's own word frequencies) and different tokens to different experts (no
collapse into a few shared experts late in the sequence). All embeddings also share one direction, which each
router sees as a fixed per-expert bias: some experts are popular everywhere, as in real MoE models.
`strata synth` measures this on a sample text with strata's own forward (`routing_report`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import lzma
import math
import re
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, LlamaFileType

from strata import StrataError
from strata.gguf.synth_report import (  # noqa: F401 (the routing report: callers import it from here too)
    FRACTIONS, REPORT_CPU_MAX_BYTES, capture_routing, format_report, routing_report, routing_stats, sample_text,
)
from strata.gguf import synth_families
from strata.gguf.writer import TensorSpec, check_output, write_streamed
from strata.quant.formats import FLOAT_TYPES, SUPPORTED_TYPES, as_qtype, block_geometry, check_supported

Q = GGMLQuantizationType
DATA = Path(__file__).resolve().parents[1] / "data"
SOURCE_VOCABS = Path(__file__).resolve().parents[2] / "tests" / "data" / "llama.cpp-models"

# Weight shaping (see the module docstring). Stds are gain / sqrt(fan_in): each projection keeps activations at
# about the scale of its input, whatever the model's width.
EMBED_STD = 1.0  # = 50x the usual 0.02: the token's identity dominates the residual stream
EMBED_SHARED = 0.6  # std of the direction every embedding shares, relative to EMBED_STD: routers see it as a
#                     per-expert bias, which makes some experts popular everywhere (skew) without tying tokens
BRANCH_OUT_GAIN = 0.1  # attention output and FFN down projections write small updates
ROUTER_GAIN = 1.5  # router logit std (of the token-specific part)
NORM_NOISE = 0.02  # norm weights are 1 + N(0, this)


@dataclass(frozen=True)
class Preset:
    name: str
    arch: str  # GGUF architecture: qwen3moe | llama | deepseek2 | glm4moe | qwen3next
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab: int
    ctx: int
    ffn: int  # dense FFN width (llama.cpp's feed_forward_length)
    n_experts: int
    k: int
    expert_ffn: int
    rope_theta: float = 1e6
    eps: float = 1e-6
    qk_norm: bool = False
    n_shared: int = 0
    first_dense: int = 0
    q_lora: int = 0
    kv_lora: int = 0
    nope: int = 0
    rope_dim: int = 0
    v_dim: int = 0
    n_groups: int = 1
    topk_groups: int = 1
    gating: str = "softmax"
    routed_scale: float = 1.0
    yarn: tuple[float, int, float] | None = None  # (factor, original context, yarn_log_multiplier)
    shared_ffn: int = 0  # the shared expert's FFN width when not n_shared x expert_ffn (qwen3next)
    # qwen3next's gated delta-net layers: key / value heads and their dims, the causal conv's kernel, and one full
    # attention layer every full_attn_interval
    lin_k_heads: int = 0
    lin_v_heads: int = 0
    lin_k_dim: int = 0
    lin_v_dim: int = 0
    conv_kernel: int = 4
    full_attn_interval: int = 4
    vocab_source: str = "tiny"  # qwen2 | llama-spm | deepseek-llm | tiny
    template: str = "qwen3"  # qwen3 | mixtral | deepseek-v3.1
    about: str = ""


_QWEN3_30B = Preset("qwen3-30b-a3b", "qwen3moe", 48, 2048, 32, 4, 128, 151936, 40960, 6144, 128, 8, 768,
                    qk_norm=True, vocab_source="qwen2", about="Qwen3-30B-A3B: 48 layers, 128 experts top-8")
_DEEPSEEK_V3 = Preset("deepseek-v3", "deepseek2", 61, 7168, 128, 128, 192, 129280, 163840, 18432, 256, 8, 2048,
                      rope_theta=10000.0, n_shared=1, first_dense=3, q_lora=1536, kv_lora=512, nope=128,
                      rope_dim=64, v_dim=128, n_groups=8, topk_groups=4, gating="sigmoid", routed_scale=2.5,
                      yarn=(40.0, 4096, 0.1), vocab_source="deepseek-llm", template="deepseek-v3.1",
                      about="DeepSeek-V3: 61 layers (3 dense), 256 experts top-8 + 1 shared, MLA")
_MIXTRAL = Preset("mixtral-8x7b", "llama", 32, 4096, 32, 8, 128, 32000, 32768, 14336, 8, 2, 14336, eps=1e-5,
                  vocab_source="llama-spm", template="mixtral", about="Mixtral-8x7B: 32 layers, 8 experts top-2")
_GLM45_AIR = Preset("glm-4.5-air", "glm4moe", 46, 4096, 96, 8, 128, 151936, 131072, 10944, 128, 8, 1408, eps=1e-5,
                    n_shared=1, first_dense=1, rope_dim=64, gating="sigmoid", vocab_source="qwen2",
                    about="GLM-4.5-Air: 46 layers (1 dense), 128 experts top-8 + 1 shared (with Qwen3's vocabulary)")
_QWEN3_NEXT = Preset("qwen3-next-80b-a3b", "qwen3next", 48, 2048, 16, 2, 256, 151936, 262144, 5120, 512, 10, 512,
                     rope_theta=1e7, shared_ffn=512, rope_dim=64, lin_k_heads=16, lin_v_heads=32, lin_k_dim=128,
                     lin_v_dim=128, vocab_source="qwen2",
                     about="Qwen3-Next-80B-A3B: 48 layers (every 4th gated attention, the others gated delta-net), "
                           "512 experts top-10 + 1 shared")
PRESETS: dict[str, Preset] = {p.name: p for p in (
    _QWEN3_30B,
    _GLM45_AIR,
    _QWEN3_NEXT,
    dataclasses.replace(_GLM45_AIR, name="tiny-glm4moe", n_layers=4, d_model=256, n_heads=4, n_kv_heads=2,
                        head_dim=64, rope_dim=32, vocab=2048, ctx=32768, ffn=512, n_experts=16, k=4, expert_ffn=256,
                        vocab_source="tiny", about="tiny GLM-4.5: 4 layers (1 dense), 16 experts top-4 + 1 shared"),
    dataclasses.replace(_QWEN3_NEXT, name="tiny-qwen3next", n_layers=4, d_model=256, n_heads=4, n_kv_heads=2,
                        head_dim=64, rope_dim=16, vocab=2048, ctx=32768, ffn=512, n_experts=16, k=4, expert_ffn=256,
                        shared_ffn=256, lin_k_heads=2, lin_v_heads=4, lin_k_dim=64, lin_v_dim=64, vocab_source="tiny",
                        about="tiny Qwen3-Next: 4 layers (1 gated attention), 16 experts top-4 + 1 shared"),
    dataclasses.replace(_QWEN3_30B, name="qwen3-235b-a22b", n_layers=94, d_model=4096, n_heads=64, ffn=12288,
                        expert_ffn=1536, about="Qwen3-235B-A22B: 94 layers, 128 experts top-8"),
    _DEEPSEEK_V3,
    _MIXTRAL,
    dataclasses.replace(_QWEN3_30B, name="tiny-qwen3moe", n_layers=4, d_model=256, n_heads=4, n_kv_heads=2,
                        head_dim=64, vocab=2048, ctx=32768, ffn=512, n_experts=16, k=4, expert_ffn=256,
                        vocab_source="tiny", about="tiny Qwen3-MoE: 4 layers, 16 experts top-4"),
    dataclasses.replace(_DEEPSEEK_V3, name="tiny-deepseek", n_layers=4, first_dense=1, d_model=256, n_heads=4,
                        n_kv_heads=4, head_dim=64, vocab=2048, ctx=32768, ffn=512, n_experts=16, k=4,
                        expert_ffn=256, q_lora=128, kv_lora=128, nope=32, rope_dim=32, v_dim=64, n_groups=4,
                        topk_groups=2, yarn=None, vocab_source="tiny", template="qwen3",
                        about="tiny DeepSeek-V3: 4 layers (1 dense), 16 experts top-4 + 1 shared, MLA"),
    dataclasses.replace(_MIXTRAL, name="tiny-mixtral", n_layers=4, d_model=256, n_heads=4, n_kv_heads=2,
                        head_dim=64, vocab=2048, ctx=32768, ffn=512, expert_ffn=512, vocab_source="tiny",
                        template="qwen3", about="tiny Mixtral: 4 layers, 8 experts top-2"),
)}

# Mixtral-8x7B-Instruct-v0.1's chat template (its tokenizer_config.json).
MIXTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)

# Qwen3's added tokens after <|im_end|> (ids 151646..151668); llama.cpp's qwen2 vocabulary file has padding there.
QWEN3_ADDED = (
    "<|object_ref_start|> <|object_ref_end|> <|box_start|> <|box_end|> <|quad_start|> <|quad_end|> "
    "<|vision_start|> <|vision_end|> <|vision_pad|> <|image_pad|> <|video_pad|> <tool_call> </tool_call> "
    "<|fim_prefix|> <|fim_middle|> <|fim_suffix|> <|fim_pad|> <|repo_name|> <|file_sep|> <tool_response> "
    "</tool_response> <think> </think>"
).split()
CONTROL, USER_DEFINED, UNUSED = 3, 4, 5


SEED_MAX = 2**32 - 1  # the file records the seed as a uint32 (strata.synth.seed)


def check_seed(seed: int) -> int:
    """seed, or StrataError: numpy's seeding refuses negatives and the metadata key holds 32 bits."""
    if not 0 <= seed <= SEED_MAX:
        raise StrataError(f"--seed {seed}: the seed must be a whole number from 0 to {SEED_MAX}")
    return seed


def get_preset(name: str, layers: int | None = None) -> Preset:
    p = PRESETS.get(name)
    if p is None:
        raise StrataError(f"unknown synth preset '{name}' (presets: {', '.join(PRESETS)})")
    if layers is not None:
        if layers < 1:
            raise StrataError("--layers must be at least 1")
        if layers > p.n_layers:  # --layers only cuts: more layers than the real model would be another model
            raise StrataError(f"--layers {layers}: {p.name} has {p.n_layers} layers (--layers keeps the first N, "
                              f"at most {p.n_layers})")
        p = dataclasses.replace(p, n_layers=layers, first_dense=min(p.first_dense, layers - 1))
    return p


# ---- tokenizer ----------------------------------------------------------------------------------------------

def _load_vocab(name: str) -> dict:
    packed = DATA / f"vocab-{name}.json.xz"
    if packed.is_file():
        return json.loads(lzma.decompress(packed.read_bytes()))
    src = SOURCE_VOCABS / f"ggml-vocab-{name}.gguf"
    if src.is_file():
        from strata.gguf.tokenizer import read_gguf_metadata

        return {k: v for k, v in read_gguf_metadata(src).items() if k.startswith("tokenizer.")}
    raise StrataError(f"the {name} vocabulary is missing: neither {packed} nor {src} exists (reinstall strata)")


@functools.lru_cache(maxsize=4)
def _tiny_vocab(vocab_size: int) -> str:
    import tempfile

    from strata.gguf.tokenizer_hf import hf_tokenizer_to_metadata, make_tiny_hf_tokenizer

    try:
        with tempfile.TemporaryDirectory() as d:
            make_tiny_hf_tokenizer(d, vocab_size)
            return json.dumps(hf_tokenizer_to_metadata(d))  # a string: callers get their own copy
    except Exception as e:  # (a full temporary disk: the tokenizers library raises a bare Exception for it)
        raise StrataError(f"cannot make the tiny vocabulary in {tempfile.gettempdir()}: {e}") from None


def tokenizer_metadata(p: Preset) -> dict:
    """The `tokenizer.*` keys (chat template included) for a preset, sized to its vocabulary."""
    from strata.gguf.builtin_templates import QWEN3_TEMPLATE

    if p.vocab_source == "tiny":
        md = json.loads(_tiny_vocab(p.vocab))
    else:
        md = _load_vocab(p.vocab_source)
    toks, types = list(md["tokenizer.ggml.tokens"]), list(md["tokenizer.ggml.token_type"])
    template = {"qwen3": QWEN3_TEMPLATE, "mixtral": MIXTRAL_TEMPLATE}.get(p.template)
    if template is None:
        template = (DATA / f"template-{p.template}.jinja").read_text(encoding="utf-8")
    if p.vocab_source == "qwen2":  # Qwen3: its added tokens, and <|im_end|> ends a turn
        first = toks.index("<|im_end|>") + 1
        for i, t in enumerate(QWEN3_ADDED):
            toks[first + i] = t
            types[first + i] = CONTROL if t.startswith("<|") else USER_DEFINED
        md["tokenizer.ggml.eos_token_id"] = toks.index("<|im_end|>")
        md["tokenizer.ggml.padding_token_id"] = toks.index("<|endoftext|>")
        md["tokenizer.ggml.add_bos_token"] = False
    if len(toks) > p.vocab:
        raise StrataError(f"the {p.vocab_source} vocabulary has {len(toks)} tokens, more than {p.name}'s {p.vocab}")
    if len(toks) < p.vocab:  # pad like llama.cpp's converter, then give the template's special tokens ids
        n = len(toks)
        toks += [f"[PAD{i}]" for i in range(n, p.vocab)]
        types += [UNUSED] * (p.vocab - n)
        if "tokenizer.ggml.scores" in md:
            md["tokenizer.ggml.scores"] = list(md["tokenizer.ggml.scores"]) + [0.0] * (p.vocab - n)
        have = set(toks)
        wanted = [t for t in dict.fromkeys(re.findall(r"<\uff5c[^<>]*?\uff5c>|</?think>", template)) if t not in have]
        if n + len(wanted) > p.vocab:
            raise StrataError(f"no room in {p.name}'s vocabulary for the template's special tokens")
        for i, t in enumerate(wanted):
            toks[n + i] = t
            types[n + i] = CONTROL if t.startswith("<\uff5c") else USER_DEFINED
    md["tokenizer.ggml.tokens"], md["tokenizer.ggml.token_type"] = toks, types
    md["tokenizer.chat_template"] = template
    return md


# ---- tensors ------------------------------------------------------------------------------------------------

# llama.cpp's choice when a row is not a whole number of K-quant super-blocks (256): a 32-block type (IQ4_NL
# for the i-quants, Q4_0 for the ternary types, as llama-quant does).
_FALLBACK = {Q.Q2_K: Q.Q4_0, Q.Q3_K: Q.Q4_0, Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0,
             **{t: Q.IQ4_NL for t in (Q.IQ1_S, Q.IQ1_M, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S,
                                      Q.IQ4_XS)},
             Q.TQ1_0: Q.Q4_0, Q.TQ2_0: Q.Q4_0}


def fit_type(qtype: Q, row: int) -> Q:
    """qtype, or the closest type whose blocks divide a row of `row` elements."""
    for t in (qtype, _FALLBACK.get(qtype, qtype), Q.F16):
        if row % block_geometry(t)[0] == 0:
            return t
    return Q.F32


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode()), 1])


def _norm(seed: int, name: str, n: int):
    return lambda: (1.0 + NORM_NOISE * _rng(seed, name).standard_normal(n)).astype(np.float32)


def _router(seed: int, name: str, n_exp: int, d: int):
    def make():
        r = _rng(seed, name)
        return (r.standard_normal((n_exp, d)) * (ROUTER_GAIN / math.sqrt(d))).astype(np.float32)  # [E, d]
    return make


def _bias(seed: int, name: str, n: int):
    return lambda: (0.01 * _rng(seed, name).standard_normal(n)).astype(np.float32)


def tensor_plan(p: Preset, experts_type="Q4_K", dense_type="Q8_0", head_type="Q6_K", seed: int = 0,
                experts_down_type=None, shared_type=None) -> list[TensorSpec]:
    """Every tensor of the preset in file order, with its GGUF name, shape (torch order), type and init.
    experts_down_type: the routed experts' down projection (default: experts_type); shared_type: the shared
    experts (default: dense_type)."""
    et, dt, ht = (check_supported(as_qtype(t)) for t in (experts_type, dense_type, head_type))
    et_down = check_supported(as_qtype(experts_down_type)) if experts_down_type else et
    st = check_supported(as_qtype(shared_type)) if shared_type else dt
    d, specs = p.d_model, []

    def w(name, shape, qtype, gain=1.0, std=None):
        specs.append(TensorSpec(name, shape, fit_type(qtype, shape[-1]),
                                std if std is not None else gain / math.sqrt(shape[-1]), asked=qtype))

    def f32(name, shape, make):
        specs.append(TensorSpec(name, shape, Q.F32, 0.0, make))

    # Q8_0 (or the float type asked for): the formats the shared embedding direction can be added to
    shared = EMBED_SHARED * EMBED_STD * _rng(seed, "token_embd.shared").standard_normal(d).astype(np.float32)
    specs.append(TensorSpec("token_embd.weight", (p.vocab, d), dt if dt in FLOAT_TYPES else Q.Q8_0, EMBED_STD,
                            offset=shared))
    f32("output_norm.weight", (d,), _norm(seed, "output_norm.weight", d))
    w("output.weight", (p.vocab, d), ht)
    for i in range(p.n_layers):
        b = f"blk.{i}."
        if p.arch in synth_families.ARCHS:
            synth_families.layer_tensors(
                p, i, w, f32, lambda n, k: _norm(seed, n, k), lambda n, e, k: _router(seed, n, e, k),
                lambda n, k: _bias(seed, n, k), dt, et, st, et_down, seed, BRANCH_OUT_GAIN)
            continue
        f32(b + "attn_norm.weight", (d,), _norm(seed, b + "attn_norm", d))
        if p.arch == "deepseek2":
            hq = p.n_heads * (p.nope + p.rope_dim)
            w(b + "attn_q_a.weight", (p.q_lora, d), dt)
            f32(b + "attn_q_a_norm.weight", (p.q_lora,), _norm(seed, b + "attn_q_a_norm", p.q_lora))
            w(b + "attn_q_b.weight", (hq, p.q_lora), dt)
            w(b + "attn_kv_a_mqa.weight", (p.kv_lora + p.rope_dim, d), dt)
            f32(b + "attn_kv_a_norm.weight", (p.kv_lora,), _norm(seed, b + "attn_kv_a_norm", p.kv_lora))
            # k_b is stored [H, lora, nope] but multiplies over lora: its std follows lora, not its row length
            w(b + "attn_k_b.weight", (p.n_heads, p.kv_lora, p.nope), dt, std=1 / math.sqrt(p.kv_lora))
            w(b + "attn_v_b.weight", (p.n_heads, p.v_dim, p.kv_lora), dt)
            w(b + "attn_output.weight", (d, p.n_heads * p.v_dim), dt, BRANCH_OUT_GAIN)
        else:
            w(b + "attn_q.weight", (p.n_heads * p.head_dim, d), dt)
            w(b + "attn_k.weight", (p.n_kv_heads * p.head_dim, d), dt)
            w(b + "attn_v.weight", (p.n_kv_heads * p.head_dim, d), dt)
            w(b + "attn_output.weight", (d, p.n_heads * p.head_dim), dt, BRANCH_OUT_GAIN)
            if p.qk_norm:
                f32(b + "attn_q_norm.weight", (p.head_dim,), _norm(seed, b + "attn_q_norm", p.head_dim))
                f32(b + "attn_k_norm.weight", (p.head_dim,), _norm(seed, b + "attn_k_norm", p.head_dim))
        f32(b + "ffn_norm.weight", (d,), _norm(seed, b + "ffn_norm", d))
        if i < p.first_dense:
            w(b + "ffn_gate.weight", (p.ffn, d), dt)
            w(b + "ffn_up.weight", (p.ffn, d), dt)
            w(b + "ffn_down.weight", (d, p.ffn), dt, BRANCH_OUT_GAIN)
            continue
        E, f = p.n_experts, p.expert_ffn
        f32(b + "ffn_gate_inp.weight", (E, d), _router(seed, b + "ffn_gate_inp", E, d))
        if p.gating == "sigmoid":
            f32(b + "exp_probs_b.bias", (E,), _bias(seed, b + "exp_probs_b", E))
        w(b + "ffn_gate_exps.weight", (E, f, d), et)
        w(b + "ffn_up_exps.weight", (E, f, d), et)
        w(b + "ffn_down_exps.weight", (E, d, f), et_down, BRANCH_OUT_GAIN)
        if p.n_shared:
            fs = f * p.n_shared
            w(b + "ffn_gate_shexp.weight", (fs, d), st)
            w(b + "ffn_up_shexp.weight", (fs, d), st)
            w(b + "ffn_down_shexp.weight", (d, fs), st, BRANCH_OUT_GAIN)
    return specs


def _file_type(qtype: Q) -> int:
    name = {Q.F32: "ALL_F32", Q.F16: "MOSTLY_F16", Q.BF16: "MOSTLY_BF16", Q.Q2_K: "MOSTLY_Q2_K",
            Q.Q3_K: "MOSTLY_Q3_K_M", Q.Q4_K: "MOSTLY_Q4_K_M", Q.Q5_K: "MOSTLY_Q5_K_M", Q.Q6_K: "MOSTLY_Q6_K",
            Q.MXFP4: "MOSTLY_MXFP4_MOE"}
    return int(LlamaFileType[name.get(qtype, f"MOSTLY_{qtype.name}")])


def write_metadata(w, p: Preset, name: str, experts_type: Q, seed: int) -> None:
    """The preset's `general.*` and `{arch}.*` keys as llama.cpp's converter writes them."""
    a = p.arch
    w.add_name(name)
    w.add_description(f"strata synth {p.name}: synthetic weights (seed {seed}), not a trained model")
    w.add_file_type(_file_type(experts_type))
    w.add_quantization_version(2)
    w.add_bool("strata.synthetic", True)
    w.add_string("strata.synth.preset", p.name)
    w.add_uint32("strata.synth.seed", seed)
    w.add_block_count(p.n_layers)
    w.add_context_length(p.ctx)
    w.add_embedding_length(p.d_model)
    w.add_feed_forward_length(p.ffn)
    w.add_head_count(p.n_heads)
    w.add_head_count_kv(1 if a == "deepseek2" else p.n_kv_heads)  # MLA runs as MQA over the latent cache
    w.add_rope_freq_base(p.rope_theta)
    w.add_layer_norm_rms_eps(p.eps)
    w.add_vocab_size(p.vocab)
    w.add_expert_count(p.n_experts)
    w.add_expert_used_count(p.k)
    if a in synth_families.ARCHS:
        synth_families.write_metadata(w, p)
    elif a == "qwen3moe":
        w.add_key_length(p.head_dim)
        w.add_value_length(p.head_dim)
        w.add_expert_feed_forward_length(p.expert_ffn)
    elif a == "llama":
        w.add_rope_dimension_count(p.head_dim)
    elif a == "deepseek2":
        w.add_leading_dense_block_count(p.first_dense)
        w.add_q_lora_rank(p.q_lora)
        w.add_kv_lora_rank(p.kv_lora)
        w.add_key_length(p.kv_lora + p.rope_dim)
        w.add_value_length(p.kv_lora)
        w.add_uint32(f"{a}.attention.key_length_mla", p.nope + p.rope_dim)
        w.add_uint32(f"{a}.attention.value_length_mla", p.v_dim)
        w.add_rope_dimension_count(p.rope_dim)
        w.add_expert_feed_forward_length(p.expert_ffn)
        w.add_expert_shared_count(p.n_shared)
        w.add_expert_weights_scale(p.routed_scale)
        w.add_expert_weights_norm(True)
        w.add_uint32(f"{a}.expert_gating_func", 2 if p.gating == "sigmoid" else 1)
        w.add_uint32(f"{a}.expert_group_count", p.n_groups)
        w.add_uint32(f"{a}.expert_group_used_count", p.topk_groups)
        if p.yarn:
            import gguf

            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(p.yarn[0])
            w.add_rope_scaling_orig_ctx_len(p.yarn[1])
            w.add_float32(f"{a}.rope.scaling.yarn_log_multiplier", p.yarn[2])


def synth(preset: str, out: str | Path, experts_type="Q4_K", dense_type="Q8_0", head_type="Q6_K", seed: int = 0,
          layers: int | None = None, name: str | None = None, progress: bool = True, data: bool = True,
          experts_down_type=None, shared_type=None) -> dict:
    """Write a synthetic model. Returns the write statistics ({"bytes", "seconds", "gbps"}) and the preset.

    data=False writes a sparse file with every tensor's info but no weights (layout checks only).
    """
    import gguf

    from strata.gguf.tokenizer_hf import write_tokenizer_metadata

    p = get_preset(preset, layers)
    check_seed(seed)
    check_output(out)  # before the tokenizer and the plan are made: a bad OUT fails at once
    et = check_supported(as_qtype(experts_type))
    specs = tensor_plan(p, et, dense_type, head_type, seed, experts_down_type, shared_type)
    w = gguf.GGUFWriter(None, p.arch)
    label = f" ({p.n_layers} layers)" if layers is not None else ""
    write_metadata(w, p, name or f"strata synthetic {p.name}{label} (random weights)", et, seed)
    write_tokenizer_metadata(w, tokenizer_metadata(p))
    stats = write_streamed(out, w, specs, seed, progress=progress, data=data)
    return {**stats, "preset": p, "fallbacks": fallbacks(specs)}


def fallbacks(specs: list[TensorSpec]) -> list[str]:
    """What llama-quantize warns of: tensors written in another type than asked, their rows not whole blocks of
    it. One line per (asked, written) pair, e.g. "12 tensors Q5_0, not Q4_K: rows not a multiple of 256"."""
    pairs: dict[tuple[Q, Q], int] = {}
    for s in specs:
        if s.asked is not None and s.asked != s.qtype:
            pairs[s.asked, s.qtype] = pairs.get((s.asked, s.qtype), 0) + 1
    return [f"{n} tensor{'s' if n > 1 else ''} {used.name}, not {asked.name}: rows not a multiple of "
            f"{block_geometry(asked)[0]}" for (asked, used), n in pairs.items()]


def type_names() -> str:
    return ", ".join(t.name for t in sorted(SUPPORTED_TYPES, key=int))

