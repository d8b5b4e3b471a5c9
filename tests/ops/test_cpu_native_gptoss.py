"""gpt-oss's experts on the native CPU kernel: MXFP4 (and Q8_0) projections with per-expert biases, the clamped
SwiGLU (`swiglu_oai`) and rows that are multiples of 32 but not of 256 (gpt-oss's 2880; the activations' last
256-block partial). Through the CPU lane's entry against gguf-py's dequantizer with strata's reference activation,
and tighter against the kernel's own activation rounding emulated in numpy; the AVX2 build and the plain C loops
agree; a format of 256-wide blocks in such rows is refused; a whole tiny gpt-oss model run tiered with every miss
on the CPU lane gives the resident logits."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from strata import StrataError
from strata.experts import cpu_lane
from strata.experts.cpu_lane import CpuLane
from strata.experts.resident import ExpertAct, ExpertWeights, expert_ffn
from strata.ops import cpu_native
from strata.quant import QTensor, formats, random_qtensor
from tests.ops.native_oracle import build as _build
from tests.ops.native_oracle import deq as _deq
from tests.ops.native_oracle import int8_rows as _int8_rows
from tests.ops.native_oracle import native_or_skip as _native_or_skip
from tests.ops.native_oracle import rel as _rel

ALPHA, LIMIT = 1.702, 7.0



def _mxfp4(shape, rng) -> QTensor:
    """MXFP4 weights, block scales 2^-9..2^-5 (weights up to 12 x 2^-5 / 2, as gguf-py doubles the E2M1 values)."""
    rows, k = int(np.prod(shape[:-1])), shape[-1]
    blocks = rng.integers(0, 256, size=(rows * k // 32, 17), dtype=np.uint8)
    blocks[:, 0] = rng.integers(119, 124, size=blocks.shape[0]).astype(np.uint8)
    return QTensor.from_raw(torch.from_numpy(blocks.reshape(rows, -1)), Q.MXFP4, tuple(shape))


def _experts(gu, dn, E, d, ff, seed, bias_scale=1.0) -> ExpertWeights:
    """gpt-oss-shaped experts: gate/up [E, ff, d], down [E, d, ff], biases on all three, the clamped SwiGLU."""
    rng = np.random.default_rng(seed)

    def one(qt, shape):
        return _mxfp4(shape, rng) if qt == Q.MXFP4 else random_qtensor(qt, shape, rng, scale=0.05)

    g = torch.Generator().manual_seed(seed)
    act = ExpertAct("swiglu_oai", ALPHA, LIMIT, torch.randn(E, ff, generator=g) * bias_scale,
                    torch.randn(E, ff, generator=g) * bias_scale, torch.randn(E, d, generator=g) * bias_scale)
    return ExpertWeights(one(gu, (E, ff, d)), one(gu, (E, ff, d)), one(dn, (E, d, ff)), act)




def _glu(g: np.ndarray, u: np.ndarray, act: ExpertAct) -> np.ndarray:
    """strata's reference activation (ExpertAct.glu), in float64."""
    return act.glu(torch.from_numpy(g), torch.from_numpy(u)).numpy()


def _reference(ew: ExpertWeights, e: int, x: np.ndarray, emulate: bool = False):
    """gguf-py dequantize + float64 math: glu(x G^T + gb, x U^T + ub) D^T + db; with `emulate`, x and the
    intermediate rounded to int8 as the kernel rounds them. Returns (output, the gate pre-activations)."""
    a = ew.act
    g, u, dn = (_deq(w, e) for w in (ew.gate, ew.up, ew.down))
    xq = _int8_rows(x) if emulate else x
    pre_g = xq @ g.T + a.gate_b[e].double().numpy()
    h = _glu(pre_g, xq @ u.T + a.up_b[e].double().numpy(), a)
    h = _int8_rows(h) if emulate else h
    return h @ dn.T + a.down_b[e].double().numpy(), pre_g



# (gate/up, down formats, d, ff): gpt-oss's own width, rows of one partial block, of whole blocks and a partial one
CASES = [pytest.param(Q.MXFP4, Q.MXFP4, 2880, 2880, id="MXFP4-2880"),
         pytest.param(Q.MXFP4, Q.MXFP4, 352, 352, id="MXFP4-352"),
         pytest.param(Q.MXFP4, Q.MXFP4, 96, 608, id="MXFP4-96x608"),
         pytest.param(Q.Q8_0, Q.MXFP4, 352, 288, id="Q8_0-MXFP4-352x288"),
         pytest.param(Q.Q8_0, Q.Q8_0, 352, 352, id="Q8_0-352")]


@pytest.mark.parametrize("gu,dn,d,ff", CASES)
def test_the_lane_takes_gptoss_experts_natively(gu, dn, d, ff, caplog, monkeypatch):
    _native_or_skip()
    monkeypatch.setattr(formats, "_WARNED", set())
    E = 2 if d == 2880 else 3
    ew = _experts(gu, dn, E, d, ff, seed=d + ff)
    with caplog.at_level(logging.WARNING, logger="strata"):
        lane = CpuLane({0: ew}, kernel="auto", dtype=torch.bfloat16)
    assert lane.kernel[0] == "native"
    assert not [r for r in caplog.records if "no fast kernel" in r.getMessage()]
    # activations large enough that the clamps bite: pre-activations of the gate beyond the limit
    x = 3 * torch.randn(5, d, generator=torch.Generator().manual_seed(d))
    jobs = [(E - 1, torch.tensor([0, 3])), (0, torch.tensor([1, 2, 4]))]
    got = lane.run(0, x, jobs).numpy()
    xn = x.numpy().astype(np.float64)
    r, clamped = 0, 0
    for e, tok in jobs:
        idx = tok.numpy()
        out = got[r:r + len(idx)]
        r += len(idx)
        ref, pre_g = _reference(ew, e, xn[idx])
        emu, _ = _reference(ew, e, xn[idx], emulate=True)
        clamped += int((pre_g > LIMIT).sum())
        assert _rel(out, ref) < 3e-2  # the native tests' tolerance: int8 activations
        assert _rel(out, emu) < 2e-3  # the weights, biases and activation exactly, up to float order
        want = expert_ffn(x[idx], ew.gate[e], ew.up[e], ew.down[e], ew.act, e).numpy()  # the lane's ref kernel
        assert _rel(out, want) < 3e-2
    assert clamped > 0
    one = lane.expert(0, 1, x[:2])  # the one-expert entry, and several experts for one token
    assert _rel(one.numpy(), _reference(ew, 1, xn[:2])[0]) < 3e-2
    many = lane.run_experts(0, x[4:5].bfloat16(), [1, 0])
    for i, e in enumerate([1, 0]):
        assert _rel(many[i].numpy(), _reference(ew, e, x[4:5].bfloat16().double().numpy())[0][0]) < 3e-2


def test_float32_keeps_the_reference_and_int4_still_refuses():
    ew = _experts(Q.Q8_0, Q.Q8_0, 2, 352, 352, seed=1)
    assert CpuLane({0: ew}, kernel="auto", dtype=torch.float32).kernel[0] == "ref"
    with pytest.raises(StrataError, match="plain SwiGLU"):
        CpuLane({0: ew}, kernel="int4", dtype=torch.bfloat16)


def test_rows_a_format_cannot_take_are_refused(caplog, monkeypatch):
    """Where a format's blocks do not divide its rows (a 256-wide format in rows of 2880, say) the kernel refuses
    (the C entry returns -1, NativeExperts raises) and the lane falls back to the reference with the one warning
    per format; --cpu-kernel native says why."""
    _native_or_skip()
    E, d, ff = 2, 352, 352
    gate = torch.zeros(E, ff, 198, dtype=torch.uint8)  # byte sizes are irrelevant: the rows' length is refused
    with pytest.raises(ValueError, match="multiples of their format's block"):
        cpu_native.NativeExperts(gate, gate, torch.zeros(E, d, 198, dtype=torch.uint8), fmt_gate_up="Q4_K",
                                 fmt_down="MXFP4")
    f = cpu_native.load().strata_native_experts
    F = cpu_native.FORMATS
    assert f(1, None, None, None, None, None, d, ff, F["Q6_K"], F["Q6_K"], F["MXFP4"], 1,
             None, None, None, None, 1, ALPHA, LIMIT) == -1
    assert f(1, None, None, None, None, None, 2880, 2880, F["MXFP4"], F["MXFP4"], F["Q5_K"],
             1, None, None, None, None, 0, 0.0, 0.0) == -1
    assert f(1, None, None, None, None, None, 2880, 2880, F["MXFP4"], F["Q4_K"], F["MXFP4"],  # up: 256-wide
             1, None, None, None, None, 0, 0.0, 0.0) == -1
    # the lane: MXFP4 as if its blocks were 512 wide, so that rows of 352 do not fit
    ew = _experts(Q.MXFP4, Q.MXFP4, E, d, ff, seed=2)
    monkeypatch.setattr(cpu_lane, "native_width", lambda qt: 512)
    monkeypatch.setattr(formats, "_WARNED", set())
    with caplog.at_level(logging.WARNING, logger="strata"):
        assert CpuLane({0: ew, 1: ew}, kernel="auto", dtype=torch.bfloat16).kernel == {0: "ref", 1: "ref"}
    said = [r.getMessage() for r in caplog.records if "no fast kernel" in r.getMessage()]
    assert len(said) == 1 and "MXFP4" in said[0]
    with pytest.raises(StrataError, match="multiples of 256"):
        CpuLane({0: ew}, kernel="native", dtype=torch.bfloat16)



@pytest.mark.parametrize("d,ff", [(2880, 2880), (352, 608)])
def test_avx2_and_plain_c_paths_agree(d, ff):
    """The AVX2 path (-mno-avx512f: the sign trick where the CPU has VNNI) and the plain C loops give the machine's
    build's outputs: the same integer sums per block, float order aside (VNNI's lanes split a block's sum
    differently)."""
    _native_or_skip()
    avx2 = _build([*cpu_native.FLAGS, "-mno-avx512f"])
    plain = _build([f for f in cpu_native.FLAGS if not f.startswith("-march")] + ["-mno-avx2", "-mno-fma"])
    E = 2
    ew = _experts(Q.MXFP4, Q.MXFP4, E, d, ff, seed=5)
    kw = dict(fmt_gate_up="MXFP4", fmt_down="MXFP4", threads=1, **cpu_lane._native_act(ew))
    x = 3 * torch.randn(4, d, generator=torch.Generator().manual_seed(9))
    ex, rows = [0, 1, 1, 0], [0, 1, 2, 3]
    base = cpu_native.NativeExperts(ew.gate.raw, ew.up.raw, ew.down.raw, **kw)(ex, x, rows)
    a = cpu_native.NativeExperts(ew.gate.raw, ew.up.raw, ew.down.raw, lib=avx2, **kw)(ex, x, rows)
    c = cpu_native.NativeExperts(ew.gate.raw, ew.up.raw, ew.down.raw, lib=plain, **kw)(ex, x, rows)
    for out in (a, c):
        assert ((out - base).norm() / base.norm()).item() < 1e-5
    for i, e in enumerate(ex):
        assert _rel(base[i].numpy(), _reference(ew, e, x[i:i + 1].double().numpy())[0][0]) < 3e-2


@pytest.fixture(scope="module")
def gptoss_mxfp4(tmp_path_factory):
    """A tiny gpt-oss (hf_fixtures' with an expert width of 96: a multiple of 32, not of 256) converted to GGUF,
    its experts' gate, up and down in MXFP4 (gguf-py's quantizer)."""
    import gguf

    from gguf_rewrite import rewrite
    from hf_fixtures import FAMILIES, make_hf_model, make_tokenizer_dir
    from strata.gguf.convert import convert

    root = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    spec = dict(FAMILIES["gpt_oss"], kw=dict(FAMILIES["gpt_oss"]["kw"], intermediate_size=96))
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(FAMILIES, "gpt_oss_96", spec)
        make_hf_model("gpt_oss_96", root / "hf", vocab_size=1001)
    make_tokenizer_dir(root / "hf", 1001)
    convert(root / "hf", root / "f32.gguf", "f32")

    def mx(name, data, qtype, shape):
        if name.endswith("_exps.weight") and qtype == Q.F32:
            return gguf.quants.quantize(data.reshape(shape), Q.MXFP4), Q.MXFP4
        return data, qtype

    return rewrite(root / "f32.gguf", root / "mxfp4.gguf", mx)


def test_tiny_gptoss_tiered_on_the_native_lane_gives_the_resident_logits(gptoss_mxfp4, monkeypatch):
    """Every miss on the CPU lane through the native kernel: each lane call equals the reference lane on the same
    inputs, and the logits are the resident model's at the int8 activations' tolerance. A near tie in a router's
    top-k can flip under that rounding (one position of 32 here, with this seed), after which the positions differ
    by more than rounding: hence per-position figures (the median, and nine in ten) rather than the worst one."""
    _native_or_skip()
    from strata.config import EngineConfig, ExpertConfig
    from strata.engine.loader import forward_all, load_model

    def cfg(mode, **ex):
        return EngineConfig(device="cpu", dtype="float32", experts=ExpertConfig(mode=mode, **ex))

    ids = torch.randint(0, 1001, (32,), generator=torch.Generator().manual_seed(3)).tolist()
    res = forward_all(load_model(str(gptoss_mxfp4), cfg("resident")), ids)
    lm = load_model(str(gptoss_mxfp4), cfg("tiered", slots=0, cpu_plan="012", cpu_kernel="native"))
    t = lm.model.experts
    assert t.lane is not None and set(t.lane.kernel.values()) == {"native"}
    ew = t.lane.layers[0]
    assert ew.gate.qtype == ew.down.qtype == Q.MXFP4 and ew.gate.shape[-1] == 64 and ew.down.shape[-1] == 96
    assert ew.act is not None and ew.act.down_b is not None
    ref_lane = CpuLane(t.lane.layers, kernel="ref", dtype=torch.float32)
    calls, inner = [], cpu_native.NativeExperts.__call__

    def spy(self, *a, **k):
        calls.append(1)
        return inner(self, *a, **k)

    monkeypatch.setattr(cpu_native.NativeExperts, "__call__", spy)
    seen, run = [], t.lane.run

    def checked(layer, x, jobs):
        out = run(layer, x, jobs)
        seen.append(_rel(out.numpy(), ref_lane.run(layer, x, jobs).numpy()))
        return out

    monkeypatch.setattr(t.lane, "run", checked)
    got = forward_all(lm, ids)
    assert calls and t.stats.cpu > 0 and t.stats.pcie == 0  # every miss on the lane, through the native kernel
    assert len(seen) >= len(t.lane.layers) and max(seen) < 3e-2  # the native tests' tolerance, per lane call
    rel = ((got - res).abs().max(-1).values / res.abs().max(-1).values).numpy()
    assert np.median(rel) < 1e-2 and (rel < 3e-2).mean() >= 0.9, rel
    assert (got.argmax(-1) == res.argmax(-1)).float().mean().item() >= 0.9
