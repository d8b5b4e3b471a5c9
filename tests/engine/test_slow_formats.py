"""A weight format without a fused GPU kernel is never slow silently: loading for a GPU says so once per format
(strata.engine.loader._say_slow_formats), and says nothing about the formats that have kernels."""

from __future__ import annotations

import logging

from gguf import GGMLQuantizationType as Q

from strata.engine import loader
from strata.gguf.reader import open_gguf
from strata.gguf.synth import synth
from strata.ops import expert_triton, registry
from strata.quant import matmul


def test_one_warning_per_format_without_a_gpu_kernel(tmp_path, monkeypatch, caplog):
    path = tmp_path / "tq.gguf"
    # (the ternary formats: the only quantized expert formats without a GPU tile)
    assert not {Q.TQ1_0, Q.TQ2_0} & (expert_triton.LOOKUP_ON_GPU | expert_triton.K_ON_GPU)
    synth("tiny-qwen3moe", path, experts_type="TQ2_0", experts_down_type="TQ1_0", progress=False)
    registry.load()
    # as on a CUDA machine with Triton: the GEMV kernels registered for the K-quants and Q8_0
    for qt in (Q.Q4_K, Q.Q6_K, Q.Q8_0):
        monkeypatch.setitem(matmul.KERNELS, ("cuda", qt), matmul.reference_qmatmul)
    monkeypatch.setattr(expert_triton, "available", lambda: True)
    g = open_gguf(str(path))
    with caplog.at_level(logging.WARNING, logger="strata"):
        loader._say_slow_formats(g)
    lines = [r.getMessage() for r in caplog.records]
    assert sum("TQ2_0" in m for m in lines) == 1 and sum("TQ1_0" in m for m in lines) == 1, lines
    assert all("expert tensors" in m for m in lines) and len(lines) == 2
    caplog.clear()
    # the formats whose tiles run on GPUs (IQ2_XXS gate/up and IQ3_XXS down, as the GLM-4.5-Air recipe; IQ2_S): nothing
    assert {Q.IQ2_XXS, Q.IQ3_XXS, Q.IQ2_XS, Q.IQ3_S} <= expert_triton.LOOKUP_ON_GPU
    path = tmp_path / "iq-xxs.gguf"
    synth("tiny-qwen3moe", path, experts_type="IQ2_XXS", experts_down_type="IQ3_XXS", progress=False)
    with caplog.at_level(logging.WARNING, logger="strata"):
        loader._say_slow_formats(open_gguf(str(path)))
    assert not caplog.records
    path = tmp_path / "iq2s.gguf"
    synth("tiny-qwen3moe", path, experts_type="IQ2_S", experts_down_type="IQ2_S", progress=False)
    with caplog.at_level(logging.WARNING, logger="strata"):
        loader._say_slow_formats(open_gguf(str(path)))
    assert not caplog.records
