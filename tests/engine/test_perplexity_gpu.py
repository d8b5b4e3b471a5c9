"""`strata perplexity` on a GPU: strata-tiny resident and tiered on CUDA against the CPU run."""

from __future__ import annotations

import re

import pytest
import torch

from strata.cli import main

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.exact_cpu]  # the CPU run is the float32 reference the GPU's float32 is held to


def _ppl(capsys, *argv) -> float:
    capsys.readouterr()
    assert main(["perplexity", *map(str, argv)]) == 0
    return float(re.search(r"Final estimate: PPL = ([0-9.]+)", capsys.readouterr().out).group(1))


def test_gpu_matches_cpu(capsys, tmp_path):
    import argparse
    import inspect

    f = tmp_path / "text.txt"
    f.write_text(inspect.getdoc(argparse) * 4)
    common = ["-f", f, "-c", 128, "--chunks", 4, "--dtype", "f32"]
    cpu = _ppl(capsys, *common, "--device", "cpu")
    gpu = _ppl(capsys, *common, "--device", "cuda", "--experts", "resident")
    tiered = _ppl(capsys, *common, "--device", "cuda", "--experts", "tiered", "--expert-slots", 8,
                  "--prefill-chunk", 48)
    # float32 on both; CUDA's summation order (and TF32-free matmuls) keep the PPL within a small fraction
    assert gpu == pytest.approx(cpu, rel=2e-3)
    assert tiered == pytest.approx(gpu, rel=2e-3)
    bf16 = _ppl(capsys, "-f", f, "-c", 128, "--chunks", 4, "--device", "cuda", "--dtype", "bf16")
    assert bf16 == pytest.approx(cpu, rel=0.03)  # bf16 activations round at ~3 significant digits
