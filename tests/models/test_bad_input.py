"""Bad input: one clear error line on stderr, exit != 0, nothing on stdout."""

import subprocess
import sys

import gguf
import numpy as np

from gguf_rewrite import rewrite


def run_generate(path, *extra):
    cmd = [sys.executable, "-m", "strata", "generate", "-m", str(path), "-p", "hello world", "-n", "4",
           "--device", "cpu", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def _check(res, *needles):
    assert res.returncode != 0
    assert res.stdout == "", res.stdout
    err = [ln for ln in res.stderr.splitlines() if ln.startswith("strata: error:")]
    assert len(err) == 1, res.stderr
    for n in needles:
        assert n in err[0], err[0]
    assert "Traceback" not in res.stderr


def test_truncated_file(hf_and_gguf, tmp_path):
    _, good = hf_and_gguf("qwen3moe")
    bad = tmp_path / "trunc.gguf"
    data = good.read_bytes()
    bad.write_bytes(data[: len(data) - 1000])
    _check(run_generate(bad), "truncated", "trunc.gguf")


def test_truncated_header(tmp_path, hf_and_gguf):
    _, good = hf_and_gguf("qwen3moe")
    bad = tmp_path / "head.gguf"
    bad.write_bytes(good.read_bytes()[:200])
    _check(run_generate(bad), "head.gguf")


def test_unknown_architecture(hf_and_gguf, tmp_path):
    _, good = hf_and_gguf("qwen3moe")
    bad = rewrite(good, tmp_path / "arch.gguf", lambda n, d, q, s: (d, q), arch="frobnicator")
    _check(run_generate(bad), "unknown model architecture", "frobnicator")


def test_unsupported_quant_type(hf_and_gguf, tmp_path):
    _, good = hf_and_gguf("qwen3moe")
    iq = gguf.GGMLQuantizationType.NVFP4  # a real weight format strata has no dequantizer for

    def to_iq(name, data, qtype, shape):
        if name == "blk.0.attn_q.weight":
            bs, ts = gguf.GGML_QUANT_SIZES[iq]
            return np.zeros((shape[0], shape[1] // bs * ts), dtype=np.uint8), int(iq)
        return data, qtype

    bad = rewrite(good, tmp_path / "iq.gguf", to_iq)
    _check(run_generate(bad), "NVFP4")


def test_missing_file(tmp_path):
    _check(run_generate(tmp_path / "nope.gguf"), "nope.gguf")


def test_prompt_over_context(hf_and_gguf):
    _, good = hf_and_gguf("qwen3moe")
    res = run_generate(good, "-c", "8", "-p", "one two three four five six seven eight nine ten eleven twelve")
    _check(res, "exceeds the context")


def test_missing_tensor(hf_and_gguf, tmp_path):
    _, good = hf_and_gguf("qwen3moe")
    # drop one tensor by renaming it: the loader names both the missing and the unmapped one
    def rename(name, data, qtype, shape):
        return data, qtype

    src = rewrite(good, tmp_path / "copy.gguf", rename)
    raw = bytearray(src.read_bytes())
    i = raw.find(b"blk.1.attn_k.weight")
    raw[i : i + len(b"blk.1.attn_k.weight")] = b"blk.1.attn_X.weight"
    bad = tmp_path / "missing.gguf"
    bad.write_bytes(bytes(raw))
    _check(run_generate(bad), "blk.1.attn_k.weight", "missing")
