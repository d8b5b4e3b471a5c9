"""strata synth: real-shape synthetic models that load and run, deterministic bytes, skewed but uncollapsed routing,
the fast random-block writer (checked with gguf-py's dequantizers), the default model cache, the CLI."""

from __future__ import annotations

import math
import pathlib
import subprocess
import sys
import threading

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from strata import StrataError
from strata.config import EngineConfig
from strata.gguf import synth as S
from strata.gguf.reader import open_gguf
from strata.gguf.writer import RandomBlocks, TensorSpec, _add_offset, write_streamed
from strata.quant.formats import SUPPORTED_TYPES, block_geometry

ROOT = pathlib.Path(__file__).resolve().parents[2]

TINY = ("tiny-qwen3moe", "tiny-deepseek", "tiny-mixtral", "tiny-glm4moe", "tiny-qwen3next")


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("synth")
    files = {}
    for p in TINY:
        S.synth(p, d / f"{p}.gguf", progress=False)
        files[p] = d / f"{p}.gguf"
    return files


# ---- the models load, run and are labelled ------------------------------------------------------------------

@pytest.mark.parametrize("preset", TINY)
def test_tiny_preset_loads_and_generates(tiny_files, preset):
    from strata.engine.engine import Engine
    from strata.engine.loader import load_model
    from strata.engine.sampler import SamplingParams

    lm = load_model(str(tiny_files[preset]), EngineConfig(device="cpu", ctx_size=64))
    p = S.PRESETS[preset]
    assert lm.gguf.arch == p.arch and lm.args.n_experts == p.n_experts and lm.args.n_layers == p.n_layers
    assert "synthetic" in lm.gguf.get("general.name") and lm.gguf.get("strata.synthetic") is True
    assert lm.template is not None and "<|im_start|>assistant" in lm.template.render(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True)
    ids = lm.tokenizer.encode("Hello, world!")
    assert lm.tokenizer.decode(ids) == "Hello, world!"
    out = list(Engine(lm).generate(ids, SamplingParams(temperature=0), max_tokens=8))
    assert len(out) == 8 and all(0 <= t < p.vocab for t in out)


def test_same_seed_same_bytes(tmp_path, tiny_files):
    a, b, c = tmp_path / "a.gguf", tmp_path / "b.gguf", tmp_path / "c.gguf"
    S.synth("tiny-deepseek", a, progress=False)
    S.synth("tiny-deepseek", c, seed=1, progress=False)
    assert a.read_bytes() == tiny_files["tiny-deepseek"].read_bytes()
    assert a.read_bytes() != c.read_bytes()
    S.synth("tiny-qwen3moe", b, experts_type="Q8_0", dense_type="F16", head_type="Q4_0", progress=False)
    g = open_gguf(b)
    assert g.tensors["blk.0.ffn_up_exps.weight"].qtype == Q.Q8_0
    assert g.tensors["blk.0.attn_q.weight"].qtype == Q.F16 and g.tensors["token_embd.weight"].qtype == Q.F16
    assert g.tensors["output.weight"].qtype == Q.Q4_0 and g.tensors["blk.0.ffn_gate_inp.weight"].qtype == Q.F32
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("preset", [*TINY, "tiny-deepseek-yarn"])
def test_llamacpp_runs_synthetic_models_the_same(tmp_path, monkeypatch, preset):
    """llama.cpp reads the synthetic files as their architecture and computes what strata computes (float
    weights: greedy tokens equal, top log-probabilities equal to float rounding)."""
    pytest.importorskip("xllamacpp")
    from oracle.llamacpp import run_llamacpp

    from strata.engine.engine import Engine
    from strata.engine.loader import forward_all, load_model
    from strata.engine.sampler import SamplingParams

    if preset == "tiny-deepseek-yarn":  # DeepSeek-V3's YaRN settings on the tiny model
        import dataclasses

        p = dataclasses.replace(S.PRESETS["tiny-deepseek"], name=preset, yarn=S.PRESETS["deepseek-v3"].yarn)
        monkeypatch.setitem(S.PRESETS, preset, p)
    f = tmp_path / f"{preset}.gguf"
    S.synth(preset, f, experts_type="F32", dense_type="F32", head_type="F32", progress=False)
    lm = load_model(str(f), EngineConfig(device="cpu", dtype="f32", ctx_size=64))
    ids = lm.tokenizer.encode("Hello, world! def add(a, b): return a + b")
    greedy, top = run_llamacpp(f, [{"op": "greedy", "prompt": ids, "n": 8}, {"op": "top", "prompts": [ids], "k": 5}],
                               force_token=ids[0], workdir=tmp_path)
    assert list(Engine(lm).generate(ids, SamplingParams(temperature=0), max_tokens=8)) == greedy["tokens"]
    lp = torch.log_softmax(forward_all(lm, ids)[-1].double(), -1)
    for tok, want in top["top"][0]:
        assert lp[tok].item() == pytest.approx(want, abs=2e-3)


# ---- the real presets have the real shapes ------------------------------------------------------------------

@pytest.mark.parametrize("preset,billions", [("qwen3-30b-a3b", 30.5), ("qwen3-235b-a22b", 235.1),
                                             ("deepseek-v3", 671.0), ("mixtral-8x7b", 46.7)])
def test_real_preset_parameter_count(preset, billions):
    # The published totals: a wrong width, head count or expert count anywhere would move these by > 0.5%.
    n = sum(math.prod(s.shape) for s in S.tensor_plan(S.PRESETS[preset]))
    assert n / 1e9 == pytest.approx(billions, rel=0.005)


def test_hybrid_presets_parameter_count():
    # GLM-4.5-Air (106B without its MTP block) and Qwen3-Next-80B-A3B; the synth files use Qwen3's vocabulary of
    # 151,936 tokens for GLM's 151,552 (0.003B apart)
    for preset, billions in (("glm-4.5-air", 106.85), ("qwen3-next-80b-a3b", 79.67)):
        n = sum(math.prod(s.shape) for s in S.tensor_plan(S.PRESETS[preset]))
        assert n / 1e9 == pytest.approx(billions, rel=0.005), preset


def test_expert_mix_types(tmp_path):
    """--experts-down-type and --shared-type: a 2-bit mix (IQ2_XXS gate/up, IQ3_XXS down, Q6_K shared)."""
    f = tmp_path / "mix.gguf"
    S.synth("tiny-glm4moe", f, experts_type="IQ2_XXS", experts_down_type="IQ3_XXS", shared_type="Q6_K",
            dense_type="Q8_0", progress=False, data=False)
    g = open_gguf(f)
    t = {n: g.tensors[f"blk.1.{n}.weight"].qtype for n in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps",
                                                              "ffn_gate_shexp", "ffn_down_shexp", "attn_q")}
    assert t == {"ffn_gate_exps": Q.IQ2_XXS, "ffn_up_exps": Q.IQ2_XXS, "ffn_down_exps": Q.IQ3_XXS,
                 "ffn_gate_shexp": Q.Q6_K, "ffn_down_shexp": Q.Q6_K, "attn_q": Q.Q8_0}


@pytest.mark.parametrize("preset,layers", [("qwen3-30b-a3b", None), ("deepseek-v3", 4), ("mixtral-8x7b", 2),
                                           ("qwen3-235b-a22b", 2), ("glm-4.5-air", 3), ("qwen3-next-80b-a3b", 4)])
def test_real_preset_layout(tmp_path, preset, layers):
    """The file as strata and gguf-py read it (header only: data=False writes a sparse file)."""
    from strata.models.registry import family_for

    out = tmp_path / "m.gguf"
    S.synth(preset, out, layers=layers, data=False, progress=False)
    assert out.stat().st_blocks * 512 < 64 << 20  # sparse: nothing but the header is on disk
    p = S.get_preset(preset, layers)
    g = open_gguf(out)
    plan = S.tensor_plan(p)
    assert [t.name for t in g] == [s.name for s in plan]
    for s in plan:
        t = g.tensors[s.name]
        assert t.shape == s.shape and t.qtype == s.qtype, s.name
    a = family_for(g.arch).load_args(g)
    assert (a.n_layers, a.d_model, a.n_heads, a.vocab_size, a.n_experts, a.n_experts_used) == \
        (p.n_layers, p.d_model, p.n_heads, p.vocab, p.n_experts, p.k)
    assert a.moe_layers == list(range(p.first_dense, p.n_layers))
    if preset in ("qwen3-30b-a3b", "qwen3-235b-a22b"):
        assert (a.n_kv_heads, a.head_dim, a.expert_ffn_dim, a.rope_theta, a.ctx_len) == (4, 128, p.expert_ffn, 1e6,
                                                                                         40960)
        assert g.tensors["blk.0.attn_q_norm.weight"].shape == (128,)
        assert g.get("tokenizer.ggml.pre") == "qwen2" and g.get("tokenizer.ggml.eos_token_id") == 151645
    if preset == "deepseek-v3":
        assert (a.first_dense_layers, a.q_lora_rank, a.kv_lora_rank, a.qk_nope_dim, a.qk_rope_dim, a.v_head_dim) == \
            (3, 1536, 512, 128, 64, 128)
        assert (a.gating, a.n_groups, a.topk_groups, a.routed_scale, a.n_shared_experts) == ("sigmoid", 8, 4, 2.5, 1)
        assert a.rope_scaling.kind == "yarn" and a.rope_scaling.factor == 40
        assert g.tensors["blk.3.ffn_gate_exps.weight"].shape == (256, 2048, 7168)
        assert g.tensors["blk.0.ffn_gate.weight"].shape == (18432, 7168)
    if preset == "glm-4.5-air":
        assert (a.n_kv_heads, a.head_dim, a.rope_dim, a.first_dense_layers, a.n_shared_experts, a.gating) == \
            (8, 128, 64, 1, 1, "sigmoid")
        assert g.tensors["blk.0.attn_q.bias"].shape == (96 * 128,) and "blk.1.exp_probs_b.bias" in g.tensors
        assert g.tensors["blk.1.ffn_gate_exps.weight"].shape == (128, 1408, 4096)
    if preset == "qwen3-next-80b-a3b":
        assert a.extra["full_attention"] == [3] and a.extra["linear"] == {"hk": 16, "hv": 32, "dk": 128, "kernel": 4,
                                                                          "dv": 128}
        assert g.tensors["blk.3.attn_q.weight"].shape == (2 * 16 * 256, 2048)  # query and gate per head
        assert g.tensors["blk.0.attn_qkv.weight"].shape == (2 * 16 * 128 + 32 * 128, 2048)
        assert g.tensors["blk.0.ffn_gate_exps.weight"].shape == (512, 512, 2048)
    if preset == "mixtral-8x7b":
        assert (a.n_kv_heads, a.ffn_dim, a.norm_eps) == (8, 14336, pytest.approx(1e-5))
        assert g.get("tokenizer.ggml.model") == "llama" and len(g.get("tokenizer.ggml.scores")) == 32000


def test_real_vocabularies(llamacpp_models):
    from strata.gguf.tokenizer import Tokenizer, read_gguf_metadata

    # the packaged copies are the llama.cpp files' tokenizer metadata, exactly
    for name in ("qwen2", "llama-spm", "deepseek-llm"):
        src = {k: v for k, v in read_gguf_metadata(llamacpp_models / f"ggml-vocab-{name}.gguf").items()
               if k.startswith("tokenizer.")}
        assert S._load_vocab(name) == src, name
    qwen = Tokenizer.from_metadata(S.tokenizer_metadata(S.PRESETS["qwen3-30b-a3b"]))
    assert qwen.vocab_size == 151936 and qwen.eos_id == 151645
    # Qwen3's own ids: <|im_start|> user \n hi <think> </think> <|im_end|>
    assert qwen.encode("<|im_start|>user\nhi<think></think><|im_end|>") == [151644, 872, 198, 6023, 151667, 151668,
                                                                           151645]
    md = S.tokenizer_metadata(S.PRESETS["deepseek-v3"])
    ids = {t: i for i, t in enumerate(md["tokenizer.ggml.tokens"])}
    assert len(md["tokenizer.ggml.tokens"]) == 129280
    for t in ("<｜User｜>", "<｜Assistant｜>", "<｜tool▁calls▁begin｜>"):  # the template's specials exist, as CONTROL
        assert md["tokenizer.ggml.token_type"][ids[t]] == 3
    assert "<｜Assistant｜>" in md["tokenizer.chat_template"]


# ---- routing: skewed, reused, not collapsed ---------------------------------------------------------------

def test_routing_is_skewed_but_not_collapsed(tiny_files):
    s = S.routing_report(tiny_files["tiny-qwen3moe"], device="cpu")
    E, k = 16, 4
    assert s["n_tokens"] == 640 and s["n_layers"] == 4
    assert s["share"][3] > 0.40  # the top 25% of experts take well over 25% of the picks
    last = s["layers"][3]
    assert last["tokens"] == 512 and last["distinct"] >= 14  # nearly every expert still used at the last layer
    assert last["pairs_differ"] > 0.9  # tokens keep their own experts through the depth
    assert last["reuse_prev"] > k / E  # more reuse from token to token than chance
    text = S.format_report(s)
    assert "top 25%" in text and "experts used" in text


def test_routing_stats_detect_collapse_and_uniformity():
    n, E, k = 512, 16, 4
    collapsed = torch.tensor([[0, 1, 2, 3]] * n)
    s = S.routing_stats({0: collapsed, 1: collapsed}, E)
    assert s["layers"][1]["distinct"] == k and s["layers"][1]["pairs_differ"] == 0.0
    assert s["share"][3] == pytest.approx(1.0) and s["layers"][1]["reuse_prev"] == 1.0
    g = torch.Generator().manual_seed(0)
    uniform = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(n)])
    s = S.routing_stats({5: uniform}, E)
    assert s["share"][3] == pytest.approx(0.25, abs=0.03) and s["layers"][5]["distinct"] == E
    assert s["layers"][5]["pairs_differ"] > 0.99


# ---- the writer ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("qtype", sorted(SUPPORTED_TYPES, key=int), ids=lambda t: t.name)
def test_random_blocks_are_valid(qtype):
    """gguf-py dequantizes the fast blocks to finite values of the asked std; chunks differ from each other."""
    gen = RandomBlocks(qtype, seed=0, pool_bytes=1 << 20)
    rng = np.random.default_rng(1)
    a, b = np.empty(gen.group * 64, np.uint8), np.empty(gen.group * 64, np.uint8)
    gen.fill(a, rng, 0.05)
    gen.fill(b, rng, 0.05)
    x = gguf.quants.dequantize(a, qtype).reshape(-1)
    assert np.isfinite(x).all() and x.std() == pytest.approx(0.05, rel=0.1) and abs(x.mean()) < 0.01
    assert not np.array_equal(a, b)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.F16, Q.BF16, Q.F32], ids=lambda t: t.name)
def test_shared_row_offset(qtype):
    row, rows = 256, 8000
    off = (0.4 * np.random.default_rng(0).standard_normal(row)).astype(np.float32)  # Q8_0 clips at ~1.7
    spec = TensorSpec("e", (rows, row), qtype, 1.0, offset=off)
    gen = RandomBlocks(qtype, 0, 4 * spec.nbytes)
    buf = np.empty(-(-spec.nbytes // gen.group) * gen.group, np.uint8)
    gen.fill(buf, np.random.default_rng(1), 2.0 if qtype == Q.Q8_0 else 1.0)
    block, size = block_geometry(qtype)
    half = spec.nbytes // 2 // size * size
    _add_offset(buf[:half], spec, 0)  # in two pieces, as the writer does across chunks
    _add_offset(buf[half:spec.nbytes], spec, half // size * block)
    x = gguf.quants.dequantize(buf[:spec.nbytes], qtype).reshape(rows, row)
    assert np.abs(x.mean(0) - off).max() < 0.08 and (x - off).std() == pytest.approx(1.0, rel=0.05)


def test_streamed_file_reads_back(tmp_path):
    w = gguf.GGUFWriter(None, "test")
    w.add_uint32("test.n", 7)
    norm = np.arange(96, dtype=np.float32)
    specs = [TensorSpec("a", (3, 256), Q.Q4_K, 0.1), TensorSpec("n", (96,), Q.F32, 0.0, lambda: norm),
             TensorSpec("b", (5, 7, 64), Q.Q8_0, 0.3)]
    r = write_streamed(tmp_path / "t.gguf", w, specs, seed=0, progress=False)
    assert r["bytes"] == (tmp_path / "t.gguf").stat().st_size and not list(tmp_path.glob("*.tmp"))
    rd = gguf.GGUFReader(tmp_path / "t.gguf")
    t = {x.name: x for x in rd.tensors}
    assert np.array_equal(t["n"].data, norm) and rd.fields["test.n"].contents() == 7
    b = gguf.quants.dequantize(t["b"].data, Q.Q8_0)
    assert b.shape == (5, 7, 64) and b.std() == pytest.approx(0.3, rel=0.15)


def test_not_enough_disk(tmp_path, monkeypatch):
    """A file larger than the free disk is refused before its weights are made; one that fits is written (a 9 MB
    model on a disk with 100 MB free was refused, "it needs 0.01 GB, ... has 0.10 GB free", by a hidden margin)."""
    import shutil

    real = shutil.disk_usage
    free = {"n": 10 << 20}
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=free["n"]))
    size = S.synth("tiny-mixtral", tmp_path / "probe.gguf", progress=False, data=False)["bytes"]
    (tmp_path / "probe.gguf").unlink()
    free["n"] = size // 2
    with pytest.raises(StrataError, match=rf"not enough free disk for m.gguf: it needs {size / 1e6:.1f} MB, "):
        S.synth("tiny-mixtral", tmp_path / "m.gguf", progress=False)
    assert not list(tmp_path.iterdir())
    free["n"] = size + (1 << 20)
    S.synth("tiny-mixtral", tmp_path / "m.gguf", progress=False)
    assert (tmp_path / "m.gguf").stat().st_size == size


def test_type_fallback_for_short_rows():
    assert S.fit_type(Q.Q4_K, 128) == Q.Q5_0 and S.fit_type(Q.Q6_K, 64) == Q.Q8_0 and S.fit_type(Q.Q4_K, 512) == Q.Q4_K
    assert S.fit_type(Q.Q8_0, 48) == Q.F16


# ---- the default model -----------------------------------------------------------------------------------

def test_default_model_cached_once(tmp_path, monkeypatch, capsys):
    from strata.models import default

    monkeypatch.setenv("STRATA_CACHE_DIR", str(tmp_path / "c"))
    monkeypatch.setattr(default, "SHIPPED", tmp_path / "absent.gguf")  # as in an install without strata-tiny
    paths: list = []
    threads = [threading.Thread(target=lambda: paths.append(default.default_model_path())) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(paths) == 2 and paths[0] == paths[1] == tmp_path / "c" / "models" / paths[0].name
    assert [p.name for p in paths[0].parent.iterdir()] == [paths[0].name]  # no temporary left behind
    assert "SYNTHETIC" in open_gguf(paths[0]).get("general.name")
    assert "SYNTHETIC" in capsys.readouterr().err
    mtime = paths[0].stat().st_mtime_ns
    assert default.default_model_path(warn=False) == paths[0] and paths[0].stat().st_mtime_ns == mtime


def test_default_model_locations(tmp_path, monkeypatch):
    from strata.models import default

    monkeypatch.delenv("STRATA_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert default.synthetic_path().parent == tmp_path / "x" / "strata" / "models"
    shipped = tmp_path / "strata-tiny.gguf"
    shipped.write_bytes(b"GGUF")
    monkeypatch.setattr(default, "SHIPPED", shipped)
    assert default.default_model_path() == shipped


# ---- the CLI ---------------------------------------------------------------------------------------------

def _strata(*args, **kw):
    return subprocess.run([sys.executable, "-m", "strata", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, **kw)


def test_synth_cli(tmp_path):
    r = _strata("synth", "tiny-qwen3moe", str(tmp_path / "m.gguf"), "-q")
    assert r.returncode == 0, r.stderr
    assert "wrote" in r.stderr and "GB/s" in r.stderr
    assert "top 25%" in r.stdout and "512-token batch" in r.stdout


@pytest.mark.parametrize("fmt", ["IQ2_XXS", "MXFP4", "TQ2_0"])
def test_synth_writes_reference_only_expert_formats(tmp_path, fmt):
    """`strata synth --experts-type IQ2_XXS` (and the other formats without a fast kernel): the experts are stored
    in that format with the asked std, and the model runs on them."""
    from strata.cli import main
    from strata.engine.loader import forward_all, load_model

    path = tmp_path / "m.gguf"
    assert main(["synth", "tiny-qwen3moe", str(path), "--experts-type", fmt, "--layers", "2", "-q",
                 "--no-report"]) == 0
    g = open_gguf(path)
    qt = Q[fmt]
    assert g.get("general.file_type") == int(S._file_type(qt))
    for name in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
        assert g.tensors[f"blk.1.{name}.weight"].qtype == qt
    raw = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.0.ffn_up_exps.weight").data
    x = gguf.quants.dequantize(np.asarray(raw), qt)
    assert np.isfinite(x).all() and x.std() > 0 and abs(x.mean()) < 0.1 * x.std()
    lm = load_model(str(path), EngineConfig(device="cpu", dtype="float32"), with_tokenizer=False)
    assert lm.model.experts.layers[0].gate.qtype == qt
    logits = forward_all(lm, [1, 5, 9, 200])
    assert torch.isfinite(logits).all() and logits.std() > 0


def test_synth_cli_errors(tmp_path, capsys):
    from strata.cli import main
    from strata.gguf.cli import PRESET_NAMES

    assert PRESET_NAMES == tuple(S.PRESETS)
    for args, want in ((["no-such-model"], "tiny-qwen3moe"), (["tiny-mixtral", "--experts-type", "NVFP4"], "Q4_K"),
                       (["tiny-mixtral", "--layers", "0"], "--layers"),
                       # more layers than the preset has is a different model, not a cut: refused, naming the count
                       (["tiny-qwen3moe", "--layers", "1000", "-q", "--no-report"], "tiny-qwen3moe has 4 layers")):
        assert main(["synth", args[0], str(tmp_path / "x.gguf"), *args[1:]]) == 1
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and err.startswith("strata: error: ") and want in err, err
    assert not list(tmp_path.iterdir())


def test_synth_bad_seed_or_output_is_one_line(tmp_path, capsys, monkeypatch):
    """A seed the file cannot record, or an OUT that is not a writable file path, is one error line (no traceback),
    found before anything is written, and leaves no file behind."""
    from strata.cli import main

    (tmp_path / "d").mkdir()
    (tmp_path / "f").write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    for out, extra, want in ((tmp_path / "x.gguf", ["--seed", "-5"], "--seed -5"),
                             (tmp_path / "x.gguf", ["--seed", "99999999999999999999999"], "4294967295"),
                             (".", [], ". is a directory"), (tmp_path / "d", [], "d is a directory"),
                             (tmp_path / "f" / "x.gguf", [], "f is not a directory")):
        assert main(["synth", "tiny-qwen3moe", str(out), *extra, "--layers", "1", "-q", "--no-report"]) == 1
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and err.startswith("strata: error: ") and want in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "f"]
    assert not list((tmp_path / "d").iterdir())
    # the library call checks too, and so does a failing rename at the end (StrataError, the temporary file gone)
    with pytest.raises(StrataError, match="is a directory"):
        S.synth("tiny-qwen3moe", tmp_path / "d", layers=1, progress=False)
    monkeypatch.setattr("strata.gguf.writer.os.replace", lambda a, b: (_ for _ in ()).throw(PermissionError(
        13, "Permission denied")))
    with pytest.raises(StrataError, match="cannot write .*y.gguf: Permission denied"):
        S.synth("tiny-qwen3moe", tmp_path / "y.gguf", layers=1, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "f"]


def test_synth_says_which_tensors_fell_back(tmp_path, capsys):
    """Rows that are not whole blocks of the asked type get llama-quantize's fallback type, and the command says so
    (as llama-quantize warns) rather than write other types silently: tiny-deepseek's MLA projections have rows
    of 128 and 32, not of Q4_K's 256."""
    from strata.cli import main

    out = tmp_path / "d.gguf"
    assert main(["synth", "tiny-deepseek", str(out), "--dense-type", "Q4_K", "-q", "--no-report"]) == 0
    lines = capsys.readouterr().err.strip().splitlines()
    n = sum(t.tensor_type == Q.Q5_0 for t in gguf.GGUFReader(out).tensors)
    assert n > 0 and lines[1:] == [f"strata: {n} tensors Q5_0, not Q4_K: rows not a multiple of 256"], lines
    assert main(["synth", "tiny-qwen3moe", str(out), "-q", "--no-report"]) == 0  # all rows whole blocks: no line
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_synth_writes_its_own_temporary_file(tmp_path, capsys):
    """The file is written under a temporary name of its own, then renamed: an OUT.gguf.tmp already there
    (another run's file in progress, or a directory) is left as it is. Through one shared OUT.gguf.tmp the first
    run to finish renamed the file the other was still writing into, giving OUT a mixture that loaded."""
    from strata.cli import main

    other = tmp_path / "m.gguf.tmp"
    other.write_bytes(b"another run's file")
    (tmp_path / "n.gguf.tmp").mkdir()
    for name in ("m.gguf", "n.gguf"):
        assert main(["synth", "tiny-qwen3moe", str(tmp_path / name), "--layers", "1", "-q", "--no-report"]) == 0
        assert open_gguf(tmp_path / name).metadata["strata.synth.preset"] == "tiny-qwen3moe"
    assert other.read_bytes() == b"another run's file" and (tmp_path / "n.gguf.tmp").is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "m.gguf.tmp", "n.gguf", "n.gguf.tmp"]


def test_short_last_write_is_an_error(tmp_path):
    """A write the disk takes only part of (a file size limit here, a filling disk alike) is written on until it
    fails: a file short of its last byte was renamed to OUT and reported written."""
    import resource
    import signal

    size = S.synth("tiny-qwen3moe", tmp_path / "probe.gguf", progress=False, data=False)["bytes"]
    (tmp_path / "probe.gguf").unlink()

    def limit():  # every write but the last one fits
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (size - 1, size - 1))
    r = _strata("synth", "tiny-qwen3moe", str(tmp_path / "x.gguf"), "-q", "--no-report", preexec_fn=limit)
    assert r.returncode == 1, r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert line == f"strata: error: cannot write {tmp_path / 'x.gguf'}: File too large", line  # (OUT, not the
    assert not list(tmp_path.iterdir())  # temporary file's name with an errno)


def test_tiny_vocabulary_write_error_is_one_line(tmp_path):
    """The tiny presets train their vocabulary in a temporary directory: a disk that refuses the tokenizer's file
    (a file size limit here, a full /tmp alike) is one error line, not the tokenizers library's traceback."""
    import resource
    import signal

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (20 << 10, 20 << 10))
    r = _strata("synth", "tiny-qwen3moe", str(tmp_path / "x.gguf"), "-q", "--no-report", preexec_fn=limit)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("strata: error: cannot make the tiny vocabulary in ") and "File too large" in line, line
    assert not list(tmp_path.iterdir())
