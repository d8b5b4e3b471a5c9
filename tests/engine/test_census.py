"""`strata generate --profile` prints what a decode step launches (strata.engine.census): per step and per layer,
the busiest launches; on the CPU torch's top-level operators (the GPU counts kernels, GPU-marked test)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from strata.config import EngineConfig
from strata.engine.census import decode_census, render
from strata.engine.engine import Engine
from strata.engine.loader import load_model


def _engine(path, device="cpu"):
    return Engine(load_model(str(path), EngineConfig(device=device, dtype="float32"), with_tokenizer=False),
                  n_slots=1)


def test_a_decode_step_counted_per_layer(hf_and_gguf):
    _, path = hf_and_gguf("qwen3moe")
    eng = _engine(path)
    c = decode_census(eng, list(range(3, 20)), steps=4)
    assert c["steps"] == 4 and c["device"] == "cpu" and c["launches"] == "operators"
    assert c["layers"] == len(eng.model.blocks)
    assert c["per_step"] > c["per_layer"] * c["layers"] * 0.99 > 0  # (the head and embedding too)
    assert c["top"] and all(n > 0 for _, n, _ in c["top"])
    assert not eng.running  # the traced sequence was dropped
    text = render(c)
    assert "per layer of" in text and "operators" in text


def test_the_step_count_follows_the_steps(hf_and_gguf):
    """Twice the steps, the same per-step figure (each step is counted, not the trace's set-up)."""
    _, path = hf_and_gguf("qwen3moe")
    eng = _engine(path)
    a = decode_census(eng, list(range(3, 20)), steps=2)["per_step"]
    b = decode_census(eng, list(range(3, 20)), steps=6)["per_step"]
    assert abs(a - b) <= 0.1 * a
    with pytest.raises(ValueError):
        decode_census(eng, [3, 4], steps=0)


def test_generate_profile_prints_the_census(hf_and_gguf):
    _, path = hf_and_gguf("qwen3moe")
    cmd = [sys.executable, "-m", "strata", "generate", "-m", str(path), "--device", "cpu", "-p", "def f():",
           "-n", "6", "--temperature", "0", "--profile"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert re.search(r"a decode step \(cpu, 8 traced\): [\d.]+ operators \([\d.]+ per layer of \d+\)", r.stderr), \
        r.stderr[-2000:]


@pytest.mark.gpu
def test_cuda_census_counts_kernels_of_replayed_graphs(hf_and_gguf):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _, path = hf_and_gguf("qwen3moe")
    eng = _engine(path, "cuda")
    c = decode_census(eng, list(range(3, 20)), steps=4)
    assert c["launches"] == "kernels" and c["per_layer"] >= 5 and c["busy_ms_per_step"] > 0


@pytest.mark.parametrize("extra", [[], ["--cuda-graphs"], ["--experts", "tiered", "--cuda-graphs"]])
def test_generate_profile_on_a_cpu_prints_the_per_token_breakdown(extra):
    """On a CPU `--profile` prints the per-token breakdown a GPU prints, before the census: its resident experts
    (the CPU's default) timed as one bucket, and the static decode steps of --cuda-graphs timed eagerly (a CPU
    captures nothing), so no row is left empty."""
    from strata.models.default import default_model_path

    cmd = [sys.executable, "-m", "strata", "generate", "-m", str(default_model_path()), "--device", "cpu", "-p",
           "def f():", "-n", "4", "--temperature", "0", "--profile", *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    err = r.stderr
    head = re.search(r"^ +ms/tok +%$", err, re.M)
    assert head, err[-2000:]
    rows = dict(re.findall(r"^(\S[\w/ ]*?) +(\d+\.\d\d) +\d+\.\d", err[head.end():], re.M))
    assert {"attention", "router/shared", "dense/other", "total"} <= set(rows), err[-2000:]
    assert ("GPU experts" if "tiered" in extra else "experts") in rows
    assert all(float(v) > 0 for v in rows.values()), rows
    assert head.start() < err.index("a decode step (cpu")  # (the breakdown, then the census)
