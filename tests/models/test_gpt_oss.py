"""gpt-oss against transformers' GptOssForCausalLM beyond the shared parity tests: every expert backend (resident,
tiered with no / some / all cache slots, misses on the CPU lane and over PCIe), stored expert formats, the static
decode step's window mask, and the clamped SwiGLU where the clamp bites."""

import pytest
import torch

from strata import StrataError
from strata.config import EngineConfig, ExpertConfig
from strata.engine.engine import Engine
from strata.engine.loader import forward_all, load_model
from strata.engine.sampler import SamplingParams
from strata.experts.resident import ExpertAct
from strata.kv.cache import Segment

pytestmark = pytest.mark.exact_cpu  # float oracles: CPU qmatmul stays the float32 reference

CPU32 = dict(device="cpu", dtype="float32")
N_EXPERTS = 6  # hf_fixtures' gpt_oss


def _hf(hf_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()


def _prompt(n, seed):
    return torch.randint(0, 1001, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def _cfg(mode="resident", **ex):
    return EngineConfig(**CPU32, experts=ExpertConfig(mode=mode, **ex))


# slots per layer: none (every expert a miss), some, all; plans (CPU share per miss count): every miss on the CPU
# lane, every miss over PCIe, a mix
TIERED = [(0, "012"), (0, "000"), (2, "011"), (3, "001"), (N_EXPERTS, "000")]


@pytest.mark.parametrize("slots,plan", TIERED)
def test_tiered_logits_and_greedy_match_transformers(hf_and_gguf, slots, plan):
    hf_dir, path = hf_and_gguf("gpt_oss")
    lm = load_model(str(path), _cfg("tiered", slots=slots, cpu_plan=plan))
    hf = _hf(hf_dir)
    ids = _prompt(40, seed=4)  # longer than the sliding window (6)
    ours = forward_all(lm, ids)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    assert _rel(ours, ref) <= 1e-4
    short = _prompt(12, seed=5)
    got = list(Engine(lm, prefill_chunk=5).generate(short, SamplingParams(temperature=0), max_tokens=16))
    with torch.no_grad():
        out = hf.generate(torch.tensor([short]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    assert got == out[0, len(short):].tolist()
    s = lm.model.experts.stats  # the cache fills as it goes: hits once some slots hold experts
    assert s.lookups > 0 and (s.hits == 0) == (slots == 0)
    if slots == 0:
        assert (s.cpu, s.pcie > 0) == (0, True) if plan == "000" else (s.cpu > 0, s.pcie) == (True, 0)


@pytest.mark.parametrize("out_type", ["f16", "q8_0"])
def test_stored_expert_formats_tiered_equals_resident(hf_and_gguf, out_type):
    hf_dir, path = hf_and_gguf("gpt_oss", out_type)
    ids = _prompt(24, seed=6)
    res = forward_all(load_model(str(path), _cfg()), ids)
    for slots, plan in ((0, "011"), (2, "000")):
        tiered = forward_all(load_model(str(path), _cfg("tiered", slots=slots, cpu_plan=plan)), ids)
        assert torch.equal(tiered, res), (slots, plan)  # the same expert math wherever it runs
    with torch.no_grad():
        ref = _hf(hf_dir)(torch.tensor([ids])).logits[0].float()
    assert _rel(res, ref) <= 2e-2  # the format's own rounding only


@torch.inference_mode()
def test_static_decode_window_masks_like_eager(hf_and_gguf):
    # a static-shape decode step (what CUDA graphs capture) spans a fixed window of the cache, masked beyond the
    # device-side position and, in sliding layers, before the sliding window
    _, path = hf_and_gguf("gpt_oss")
    m = load_model(str(path), _cfg()).model
    prompt, nxt = _prompt(20, seed=7), _prompt(6, seed=8)
    outs = []
    for static in (False, True):
        kv = m.new_kv_cache(1, 64)
        m.forward(torch.tensor(prompt), torch.arange(len(prompt)), [Segment(0, 0, len(prompt))], kv)
        rows = []
        for i, t in enumerate(nxt):
            p = len(prompt) + i
            seg = Segment(0, p, 1, pos_t=torch.tensor([p]), window=48) if static else Segment(0, p, 1)
            rows.append(m.forward(torch.tensor([t]), torch.tensor([p]), [seg], kv))
        outs.append(torch.cat(rows))
    assert _rel(outs[1], outs[0]) <= 1e-5


def test_clamped_swiglu_follows_transformers():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    ref = GptOssExperts(GptOssConfig(hidden_size=8, intermediate_size=16, num_local_experts=2))
    gate_up = torch.randn(64, 32, generator=torch.Generator().manual_seed(0)) * 6  # well past the limit of 7
    act = ExpertAct("swiglu_oai", 1.702, 7.0)
    assert torch.allclose(act.glu(gate_up[:, 0::2], gate_up[:, 1::2]), ref._apply_gate(gate_up), atol=1e-6)
    assert (gate_up.abs() > 7).any()


def test_native_cpu_kernel_refuses_biased_experts(hf_and_gguf):
    _, path = hf_and_gguf("gpt_oss")
    with pytest.raises(StrataError, match="plain SwiGLU"):
        load_model(str(path), _cfg("tiered", slots=0, cpu_plan="012", cpu_kernel="int4"))


@pytest.mark.gpu
@pytest.mark.parametrize("mode,slots,plan", [("resident", None, "auto"), ("tiered", 0, "011"), ("tiered", 2, "000")])
def test_cuda_matches_transformers_and_cpu(hf_and_gguf, mode, slots, plan):
    # float32 on the GPU: eager prefill and captured decode steps (CUDA graphs) with sinks and sliding windows
    hf_dir, path = hf_and_gguf("gpt_oss")
    lm = load_model(str(path), EngineConfig(device="cuda", dtype="float32",
                                            experts=ExpertConfig(mode=mode, slots=slots, cpu_plan=plan)))
    ids = _prompt(40, seed=4)
    with torch.no_grad():
        ref = _hf(hf_dir)(torch.tensor([ids])).logits[0].float()
    assert _rel(forward_all(lm, ids).cpu(), ref) <= 1e-4
    short = _prompt(12, seed=5)
    cpu = list(Engine(load_model(str(path), _cfg())).generate(short, SamplingParams(temperature=0), max_tokens=24))
    assert list(Engine(lm).generate(short, SamplingParams(temperature=0), max_tokens=24)) == cpu


@pytest.mark.gpu
def test_cuda_bf16_q8_0_close_to_float32(hf_and_gguf):
    _, path = hf_and_gguf("gpt_oss", "q8_0")
    ids = _prompt(32, seed=9)
    a = forward_all(load_model(str(path), EngineConfig(device="cuda", dtype="bfloat16")), ids).float().cpu()
    b = forward_all(load_model(str(path), _cfg()), ids)
    assert (a.argmax(-1) == b.argmax(-1)).float().mean().item() >= 0.9


def test_mxfp4_experts_equal_their_dequantized_weights(hf_and_gguf, tmp_path):
    """gpt-oss ships its experts in MXFP4: the same file with gate/up in MXFP4 (gguf-py's quantizer) gives the logits
    of a float32 file holding gguf-py's dequantization of those blocks, resident and tiered."""
    import gguf

    from tests.models.gguf_rewrite import rewrite

    Q = gguf.GGMLQuantizationType
    _, path = hf_and_gguf("gpt_oss")

    def to(kind):
        def fn(name, data, qtype, shape):
            if not (name.endswith(("ffn_gate_exps.weight", "ffn_up_exps.weight")) and qtype == Q.F32):
                return data, qtype
            blocks = gguf.quants.quantize(data.reshape(shape), Q.MXFP4)
            return (blocks, Q.MXFP4) if kind == "mxfp4" else (gguf.quants.dequantize(blocks, Q.MXFP4), Q.F32)
        return fn

    mx = rewrite(path, tmp_path / "mxfp4.gguf", to("mxfp4"))
    f32 = rewrite(path, tmp_path / "dequantized.gguf", to("f32"))
    kinds = {int(t.tensor_type) for t in gguf.GGUFReader(mx).tensors if "_exps" in t.name}
    assert Q.MXFP4 in kinds  # the experts really are MXFP4 blocks
    ids = _prompt(24, seed=11)
    ref = forward_all(load_model(str(f32), _cfg()), ids)
    got = forward_all(load_model(str(mx), _cfg()), ids)
    assert _rel(got, ref) <= 1e-5
    for slots, plan in ((0, "011"), (2, "000")):
        tiered = forward_all(load_model(str(mx), _cfg("tiered", slots=slots, cpu_plan=plan)), ids)
        assert torch.equal(tiered, got), (slots, plan)
