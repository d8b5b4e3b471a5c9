"""llama.cpp as a second oracle for strata's model math: the same GGUF files run in both.

Tiny random checkpoints of each family go through strata's converter (llama.cpp's layout: Mixtral as `llama`
with permuted Q/K and stacked experts, DeepSeek's kv_b split into k_b/v_b), then run in strata and in llama.cpp
(the `xllamacpp` CPU build, in a child process, prompts given as token ids).

- Float weights: both compute in float32 (llama.cpp with an f32 KV cache), so greedy tokens must be identical
  and teacher-forced top-5 logprobs equal up to summation order.
- Quantized weights: llama.cpp also rounds the activations to 8 bits (Q8_0 for Q8_0 weights, Q8_K for
  K-quants) where strata multiplies float activations by the dequantized weights, so strata is only close to
  llama.cpp; with that rounding reproduced in strata (llamacpp_activation_rounding) the two agree tightly.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("xllamacpp")

from .llamacpp import (  # noqa: E402
    VOCAB, gguf_value, llamacpp_activation_rounding, make_checkpoint, rewrite_gguf, run_llamacpp,
)

PROMPT_LEN, N_GREEDY, SEQ_LEN, TOPK = 16, 32, 64, 5
POSITIONS = range(PROMPT_LEN, SEQ_LEN)  # teacher-forced: 48 predicted positions

# Float weights. Greedy steps whose top-1/top-2 logit margin (strata's) is below F32_TIE are near-ties that
# float32 summation order (~1e-6 here) could flip: the token comparison stops before the first one (none occur
# with these seeds; margins are >= 1e-3). Teacher-forced |d logprob|: measured <= 6e-6; F32_TOL has 30x headroom.
F32_TIE, F32_TOL = 1e-4, 2e-4

# Quantized weights. Positions whose strata top-1/top-2 margin is under Q_TIE nats are near-ties for the
# top-1 agreement (not counted there; their logprobs still are).
#  - strata as it is: llama.cpp's 8-bit activation rounding is the same kind and size of rounding as Q8_0
#    weight rounding, so its effect on the logprobs should be of the order of the weights' own rounding, which
#    the test measures (strata on the f32 file vs on the q8_0 file: 0.03-0.17 nats mean over the top 5).
#    Bound: mean |d| <= 2x that + 0.02 (measured 0.7-1.3x). No bound on the worst position: in MoE models the
#    rounding can flip a router's choice (measured up to 6.8 nats at one position of deepseek_v3).
#  - strata with llama.cpp's rounding reproduced: measured mean |d| ~1e-6 (the float32 level) for the dense
#    models, Mixtral and the Q4_K experts; 0.007 (qwen3moe) and 0.017 (deepseek_v3), where float32
#    summation-order differences (~1e-6) tip a rounding the other way at some position and the K/V every later
#    position reads then differ by one rounding step. Bounds: every top-1 equal, mean at most Q_EMU_RATIO of
#    the plain mean (measured <= 0.14; a subtle slip such as an f32 instead of f16 activation scale gives
#    0.29-0.95), worst position <= 0.25.
Q_TIE, Q_AGREE = 0.15, 0.90
Q_PLAIN_FACTOR, Q_PLAIN_FLOOR = 2.0, 0.02
Q4K_PLAIN_MEAN = 0.15  # no float original to calibrate against; measured 0.076 (Q8_K rounds 256 at a time)
Q_EMU_RATIO, Q_EMU_MAX = 0.25, 0.25

# name -> (tests/models/hf_fixtures.py family, config overrides). Mixtral converts to arch `llama` + experts.
FAMILIES = {
    "qwen3moe": ("qwen3moe", {}),
    "qwen3": ("qwen3", {}),
    "mixtral": ("mixtral", {}),
    "llama": ("llama", {}),
    "deepseek_v3": ("deepseek_v3", {}),
    # with DeepSeek-V3's MTP block kept (blk.3 + blk.3.nextn.*): llama.cpp loads the file and runs the trunk
    "deepseek_v3_mtp": ("deepseek_v3_mtp", {}),
    "glm4moe": ("glm4moe", {}),  # (with its MTP block, blk.3.nextn.*: llama.cpp loads it and runs the trunk)
    # llama.cpp rounds YaRN's ramp ends to whole dims (ggml_rope_yarn_corr_dims) where gpt-oss's reference does
    # not, and strata follows the reference (strata.models.gpt_oss): here plain rotary; sinks, the sliding window
    # shorter than the prompt, the biases and the clamped SwiGLU as the fixture has them (a wider FFN: with the
    # fixture's, llama.cpp's greedy run ends on an end-of-generation token before 16 tokens)
    "gpt_oss": ("gpt_oss", {"rope_parameters": dict(rope_type="default", rope_theta=150000.0),
                            "intermediate_size": 64}),
    # this llama.cpp build sizes attn_qkv as if the delta-net's key and value heads were one size (the released
    # Qwen3-Next's are): equal here
    "qwen3next": ("qwen3next", {"linear_value_head_dim": 12}),
    # llama.cpp reads a deepseek2 file without q_lora_rank (V2-Lite style attn_q) only when the layer count is
    # that of a known lite model (26 or 27: llama_model_deepseek2::load_arch_hparams), hence 26 layers
    "deepseek_lite": ("deepseek_v3_noqlora", {"num_hidden_layers": 26}),
    # every expert row a multiple of 256, for K-quant experts
    "qwen3moe_256": ("qwen3moe", {"hidden_size": 256, "moe_intermediate_size": 256, "head_dim": 64,
                                  "num_experts": 4, "num_hidden_layers": 2}),
}
GREEDY = ["qwen3moe", "qwen3", "mixtral", "llama", "deepseek_v3", "deepseek_v3_mtp", "glm4moe", "gpt_oss",
          "qwen3next"]
QUANTIZED = ["qwen3moe", "qwen3", "mixtral", "llama", "deepseek_v3"]


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    """zoo(name, "f32"|"q8_0") -> the converted GGUF file as llama.cpp reads it (built once, on first use);
    zoo(name, out_type, as_converted=True) -> the converter's own output."""
    from strata.gguf.convert import convert
    from strata.gguf.tokenizer_hf import make_tiny_hf_tokenizer

    root = tmp_path_factory.mktemp("oracle")
    tok = make_tiny_hf_tokenizer(root / "tok", VOCAB)
    built: dict = {}

    def get(name: str, out_type: str, as_converted: bool = False):
        if (name, out_type) not in built:
            fam, overrides = FAMILIES[name]
            hf = root / name
            if not hf.exists():
                make_checkpoint(fam, hf, tok, **overrides)
            path = convert(hf, root / f"{name}.{out_type}.gguf", out_type)
            built[name, out_type] = (path, _for_llamacpp(path))
        return built[name, out_type][0 if as_converted else 1]

    return get


def _for_llamacpp(path):
    """deepseek2 files get head_count_kv 1, what llama.cpp's converter writes and llama.cpp needs (see
    test_deepseek2_head_count_kv_is_llamacpps); strata reads either. Other files are used as they are."""
    if gguf_value(path, "general.architecture") != "deepseek2":
        return path
    if gguf_value(path, "deepseek2.attention.head_count_kv") == 1:
        return path
    return rewrite_gguf(path, path.with_name(path.stem + ".kv1.gguf"), kv={"deepseek2.attention.head_count_kv": 1})


def _strata(path):
    from strata.config import EngineConfig
    from strata.engine.loader import load_model

    return load_model(str(path), EngineConfig(device="cpu", dtype="float32"))


def _ids(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB - 8, (n,), generator=g).tolist()  # below the special/added tokens


PROMPT, TEACHER = _ids(1, PROMPT_LEN), _ids(2, SEQ_LEN)


def _logprobs(lm, seq: list[int]) -> torch.Tensor:
    from strata.engine.loader import forward_all

    return torch.log_softmax(forward_all(lm, seq).float(), -1)  # [T, V]


def _top_requests() -> dict:
    return {"op": "top", "prompts": [TEACHER[:p] for p in POSITIONS], "k": TOPK}


def _llamacpp(path, lm, requests, tmp_path):
    # the token llama.cpp samples in "top" requests: any whose text is complete UTF-8 (see llamacpp_worker.py)
    return run_llamacpp(path, requests, lm.tokenizer.piece_to_id("a"), tmp_path)


def _compare_top(lp: torch.Tensor, top: list, tie: float) -> dict:
    """strata's teacher-forced logprobs [T, V] against llama.cpp's top-k (id, logprob) lists per position."""
    agree = counted = 0
    diffs, worst = [], 0.0
    for i, p in enumerate(POSITIONS):
        row = lp[p - 1]  # the logits at p-1 predict token p
        v = row.topk(2).values
        ids = [int(t) for t, _ in top[i]]
        d = (row[ids] - torch.tensor([x for _, x in top[i]])).abs()  # [k]
        diffs.append(float(d.mean()))
        worst = max(worst, float(d.max()))
        if float(v[0] - v[1]) >= tie:
            counted += 1
            agree += int(row.argmax()) == ids[0]
    return {"agree": agree, "counted": counted, "mean": round(sum(diffs) / len(diffs), 7), "max": round(worst, 7)}


@pytest.mark.parametrize("name", GREEDY)
def test_float_weights_greedy_and_logprobs_equal(zoo, name, tmp_path):
    from strata.engine.engine import Engine
    from strata.engine.sampler import SamplingParams

    path = zoo(name, "f32")
    lm = _strata(path)
    ours = list(Engine(lm).generate(PROMPT, SamplingParams(temperature=0), N_GREEDY))
    greedy, top = _llamacpp(path, lm, [{"op": "greedy", "prompt": PROMPT, "n": N_GREEDY}, _top_requests()],
                            tmp_path)
    theirs = greedy["tokens"]

    lp = _logprobs(lm, PROMPT + ours)[PROMPT_LEN - 1:-1]  # [N, V]: the logits each greedy token came from
    v = lp.topk(2, -1).values
    margins = (v[:, 0] - v[:, 1]).tolist()
    n = next((i for i, m in enumerate(margins) if m < F32_TIE), N_GREEDY)  # up to the first near-tie
    n = min(n, len(theirs))  # llama.cpp stops after an end-of-generation token
    assert n >= 16, f"{name}: only {n} comparable greedy tokens (margins {margins[:n + 1]})"
    assert ours[:n] == theirs[:n], f"{name}: strata {ours} != llama.cpp {theirs}"

    r = _compare_top(_logprobs(lm, TEACHER), top["top"], F32_TIE)
    print(f"{name} f32: greedy {n}/{N_GREEDY} equal (min margin {min(margins):.3g}), teacher-forced {r}")
    assert r["agree"] == r["counted"] == len(POSITIONS), f"{name}: {r}"
    assert r["max"] < F32_TOL, f"{name}: teacher-forced top-{TOPK} logprobs differ: {r}"


def test_float_weights_deepseek_lite_logprobs_equal(zoo, tmp_path):
    """DeepSeek-V2-Lite layout (no q_lora: one attn_q), teacher-forced only (26 layers make greedy slow)."""
    path = zoo("deepseek_lite", "f32")
    lm = _strata(path)
    (top,) = _llamacpp(path, lm, [_top_requests()], tmp_path)
    r = _compare_top(_logprobs(lm, TEACHER), top["top"], F32_TIE)
    print(f"deepseek_lite f32: teacher-forced {r}")
    assert r["agree"] == r["counted"] == len(POSITIONS), r
    assert r["max"] < F32_TOL, r


def _check_quantized(label: str, lm, top: list, plain_mean_tol: float, note: str = "") -> None:
    plain = _compare_top(_logprobs(lm, TEACHER), top, Q_TIE)
    with llamacpp_activation_rounding():
        emu = _compare_top(_logprobs(lm, TEACHER), top, Q_TIE)
    msg = f"{label}: strata {plain}; with llama.cpp's activation rounding {emu}{note}"
    print(msg)
    assert plain["counted"] >= len(POSITIONS) // 2, msg
    assert plain["agree"] >= Q_AGREE * plain["counted"], msg
    assert plain["mean"] <= plain_mean_tol, msg
    assert emu["agree"] == emu["counted"], msg
    assert emu["mean"] <= Q_EMU_RATIO * plain["mean"] and emu["max"] <= Q_EMU_MAX, msg


# "plain" is strata's float32 reference against llama.cpp: with the native kernel's own int8 rounding of decode-sized
# batches (here the experts' few tokens each) a random tiny model's near-tied routing flips elsewhere than llama.cpp's
@pytest.mark.exact_cpu
@pytest.mark.parametrize("name", QUANTIZED)
def test_q8_0_close_to_llamacpp(zoo, name, tmp_path):
    path = zoo(name, "q8_0")
    lm = _strata(path)
    (top,) = _llamacpp(path, lm, [_top_requests()], tmp_path)
    # the weights' own rounding: strata on the f32 file vs on the q8_0 file, over the f32 file's top 5
    lp32, lp8 = _logprobs(_strata(zoo(name, "f32")), TEACHER), _logprobs(lm, TEACHER)
    rows = slice(PROMPT_LEN - 1, SEQ_LEN - 1)
    idx = lp32[rows].topk(TOPK, -1).indices
    wq = float((lp32[rows].gather(-1, idx) - lp8[rows].gather(-1, idx)).abs().mean())
    _check_quantized(f"{name} q8_0", lm, top["top"], Q_PLAIN_FACTOR * wq + Q_PLAIN_FLOOR,
                     f"; weight rounding's own effect {wq:.4f}")


def test_q4_k_experts_close_to_llamacpp(zoo, tmp_path):
    """Experts in Q4_K (random valid blocks: there is no Q4_K quantizer here), everything else Q8_0."""
    import gguf

    from strata.quant import random_qtensor

    q4k = gguf.GGMLQuantizationType.Q4_K
    src = zoo("qwen3moe_256", "q8_0")
    tensors = {}
    for i, t in enumerate(gguf.GGUFReader(src).tensors):
        if "_exps." in t.name:
            shape = tuple(int(s) for s in reversed(t.shape.tolist()))  # torch order [E, out, in]
            q = random_qtensor(q4k, shape, rng=i, scale=0.08)
            tensors[t.name] = (q.raw.numpy().reshape(*shape[:-1], -1), q4k)  # [E, out, row bytes]
    assert len(tensors) == 6  # gate, up, down in both layers
    path = rewrite_gguf(src, tmp_path / "qwen3moe_q4k.gguf", tensors=tensors)
    lm = _strata(path)
    assert lm.gguf.tensors["blk.0.ffn_down_exps.weight"].qtype == q4k
    (top,) = _llamacpp(path, lm, [_top_requests()], tmp_path)
    _check_quantized("qwen3moe Q4_K experts", lm, top["top"], Q4K_PLAIN_MEAN)


def test_deepseek2_head_count_kv_is_llamacpps(zoo):
    assert gguf_value(zoo("deepseek_v3", "f32", as_converted=True), "deepseek2.attention.head_count_kv") == 1
