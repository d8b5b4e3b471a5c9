"""Every weight format end to end: a tiny model stored in that format gives the logits of a float32 forward over
gguf-py's dequantization of the same blocks, so the only error left is the format's own."""

import gguf
import numpy as np
import pytest
import torch

from gguf_rewrite import rewrite
from strata.config import EngineConfig
from strata.engine.loader import forward_all, load_model
from strata.quant import random_qtensor

pytestmark = pytest.mark.exact_cpu  # float oracles: CPU qmatmul stays the float32 reference

Q = gguf.GGMLQuantizationType
FORMATS = [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K,
           Q.IQ1_S, Q.IQ1_M, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.IQ4_NL, Q.IQ4_XS, Q.MXFP4,
           Q.TQ1_0, Q.TQ2_0]


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_format_logits_equal_gguf_py_dequantized(fmt, hf_and_gguf, tmp_path):
    _, f32 = hf_and_gguf("qwen3moe_256")
    block = gguf.GGML_QUANT_SIZES[fmt][0]

    def quantize(name, data, qtype, shape):
        if len(shape) < 2 or shape[-1] % block or "norm" in name or "ffn_gate_inp" in name:
            return data, qtype
        seed = abs(hash(name)) % 2**31
        qt = random_qtensor(fmt, shape, rng=seed, scale=0.05)
        return qt.raw.numpy(), int(fmt)

    qpath = rewrite(f32, tmp_path / f"m-{fmt.name}.gguf", quantize)

    def deq(name, data, qtype, shape):
        if qtype == Q.F32:
            return data, qtype
        return gguf.quants.dequantize(data, Q(qtype)).reshape(shape), int(Q.F32)

    ref_path = rewrite(qpath, tmp_path / f"m-{fmt.name}-deq.gguf", deq)
    cfg = EngineConfig(device="cpu", dtype="float32")
    ids = torch.randint(0, 1001, (32,), generator=torch.Generator().manual_seed(5)).tolist()
    ours = forward_all(load_model(str(qpath), cfg, with_tokenizer=False), ids)
    ref = forward_all(load_model(str(ref_path), cfg, with_tokenizer=False), ids)
    rel = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert rel <= 1e-4, f"{fmt.name}: {rel:.2e}"
    assert np.isfinite(ours.numpy()).all()
