"""`strata convert` as a user runs it: a real subprocess on a tiny transformers checkpoint, and bad inputs."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
import torch
from gguf import GGMLQuantizationType as Q

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _strata(*args):
    return subprocess.run([sys.executable, "-m", "strata", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from hf_fixtures import make_hf_model, make_tokenizer_dir

    d = tmp_path_factory.mktemp("hf") / "tiny-qwen3moe"
    model = make_hf_model("qwen3moe", d, vocab_size=1001)
    make_tokenizer_dir(d, 1001)
    return d, model


def test_convert_cli(hf_dir, tmp_path):
    from strata.config import EngineConfig
    from strata.engine.loader import forward_all, load_model

    d, model = hf_dir
    out = tmp_path / "m.gguf"
    r = _strata("convert", str(d), str(out), "--type", "q8_0")
    assert r.returncode == 0, r.stderr
    assert "wrote" in r.stderr and r.stdout == ""
    lm = load_model(str(out), EngineConfig(device="cpu", dtype="f32"))
    g = lm.gguf
    assert g.tensors["blk.0.attn_q.weight"].qtype == Q.Q8_0 and g.tensors["blk.0.ffn_up_exps.weight"].qtype == Q.Q8_0
    assert g.tensors["blk.0.ffn_gate_inp.weight"].qtype == Q.F32  # routers stay exact
    ids = lm.tokenizer.encode("Hello, world! def add(a, b): return a + b")
    # the converted model computes what transformers computes (Q8_0: close, not equal)
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0]
    got = forward_all(lm, ids)
    assert torch.nn.functional.cosine_similarity(got, want, dim=-1).min() > 0.99


def _one_error_line(rc: int, err: str) -> str:
    assert rc == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("strata: error: "), err
    return lines[0]


def test_convert_cli_bad_dir(tmp_path):
    r = _strata("convert", str(tmp_path / "missing"), str(tmp_path / "m.gguf"))
    assert r.stdout == "" and "not a directory" in _one_error_line(r.returncode, r.stderr)


def test_convert_cli_bad_inputs(tmp_path, hf_dir, capsys):
    """More bad inputs through the same entry point, in-process (a subprocess each would cost seconds)."""
    from strata.cli import main

    def run(*args) -> str:
        rc = main(["convert", *map(str, args)])
        return _one_error_line(rc, capsys.readouterr().err)

    out = tmp_path / "m.gguf"
    (tmp_path / "empty").mkdir()
    assert "config.json" in run(tmp_path / "empty", out)
    bad = tmp_path / "bert"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "bert"}))
    assert "bert" in run(bad, out)
    nosafe = tmp_path / "nosafe"
    nosafe.mkdir()
    (nosafe / "config.json").write_text((hf_dir[0] / "config.json").read_text())
    assert "safetensors" in run(nosafe, out)
    assert not out.exists() and not list(tmp_path.glob("*.tmp"))
    with pytest.raises(SystemExit) as e:  # argparse: usage and exit status 2
        main(["convert", str(hf_dir[0]), str(out), "--type", "q4_k"])
    assert e.value.code == 2 and "invalid choice" in capsys.readouterr().err
