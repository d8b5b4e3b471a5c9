"""`strata convert` as a user runs it: a real subprocess on a tiny transformers checkpoint, and bad inputs."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from strata import StrataError
from strata.gguf.reader import open_gguf

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
    # the experts' down projections (rows of moe_intermediate_size 40) are no whole Q8_0 blocks: f16, and said
    assert "wrote" in r.stderr and "q8_0, 3 tensors f16: rows not a multiple of 32)" in r.stderr and r.stdout == ""
    lm = load_model(str(out), EngineConfig(device="cpu", dtype="f32"))
    g = lm.gguf
    assert g.tensors["blk.0.attn_q.weight"].qtype == Q.Q8_0 and g.tensors["blk.0.ffn_up_exps.weight"].qtype == Q.Q8_0
    assert g.tensors["blk.0.ffn_down_exps.weight"].qtype == Q.F16
    assert g.tensors["blk.0.ffn_gate_inp.weight"].qtype == Q.F32  # routers stay exact
    ids = lm.tokenizer.encode("Hello, world! def add(a, b): return a + b")
    # the converted model computes what transformers computes (Q8_0: close, not equal)
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0]
    got = forward_all(lm, ids)
    assert torch.nn.functional.cosine_similarity(got, want, dim=-1).min() > 0.99


def test_convert_writes_its_own_temporary_file(hf_dir, tmp_path):
    """The GGUF is written under a temporary name of this run's own, then renamed: an m.gguf.tmp already there
    (another run's file in progress) is left as it is. Through one shared OUT.tmp the first run to finish renamed
    the file the other was still writing into."""
    from strata.cli import main

    other = tmp_path / "m.gguf.tmp"
    other.write_bytes(b"another run's file")
    assert main(["convert", str(hf_dir[0]), str(tmp_path / "m.gguf"), "--type", "f16"]) == 0
    assert other.read_bytes() == b"another run's file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "m.gguf.tmp"]
    assert open_gguf(tmp_path / "m.gguf").tensors["blk.0.attn_q.weight"].qtype == Q.F16


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


def _tensor_types(path) -> tuple[int, dict[str, int]]:
    from strata.gguf.header import read_gguf_header

    h = read_gguf_header(path)
    return h.metadata["general.file_type"], {t.name: t.ggml_type for t in h.tensors}


def _as_bf16(src: pathlib.Path, dst: pathlib.Path, big: float | None = None) -> pathlib.Path:
    """A copy of checkpoint `src` stored as bf16 (as most released checkpoints are), optionally with one weight
    of layer 0's q_proj set to `big`."""
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
            continue
        ts = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in load_file(f).items()}
        if big is not None and "model.layers.0.self_attn.q_proj.weight" in ts:
            ts["model.layers.0.self_attn.q_proj.weight"][0, 0] = big
        save_file(ts, dst / f.name, metadata={"format": "pt"})
    return dst


def test_auto_type_follows_the_checkpoint(hf_dir, tmp_path, capsys):
    from strata.cli import main

    # bf16 weights -> bf16 (as a real user runs it: the default, through the CLI)
    bf = _as_bf16(hf_dir[0], tmp_path / "bf16")
    r = _strata("convert", str(bf), str(tmp_path / "b.gguf"))
    assert r.returncode == 0 and "bf16)" in r.stderr, r.stderr
    ftype, types = _tensor_types(tmp_path / "b.gguf")
    assert ftype == 32 and types["blk.0.attn_q.weight"] == Q.BF16 and types["blk.0.ffn_gate_inp.weight"] == Q.F32
    # f32 weights -> f16, as llama.cpp's auto does
    assert main(["convert", str(hf_dir[0]), str(tmp_path / "f.gguf")]) == 0
    assert "f16)" in capsys.readouterr().err
    ftype, types = _tensor_types(tmp_path / "f.gguf")
    assert ftype == 1 and types["blk.0.attn_q.weight"] == Q.F16


def test_values_beyond_f16_are_an_error(hf_dir, tmp_path, capsys):
    from strata.cli import main

    bf = _as_bf16(hf_dir[0], tmp_path / "big", big=1e8)
    out = tmp_path / "m.gguf"
    r = _strata("convert", str(bf), str(out), "--type", "f16")  # no RuntimeWarning, no traceback: one line
    line = _one_error_line(r.returncode, r.stderr)
    assert "blk.0.attn_q.weight" in line and "1.00139e+08" in line and "--type bf16" in line
    assert not list(tmp_path.glob("*.gguf*"))  # nothing half-written left behind
    # Q8_0 stores each block's scale (amax / 127) as f16: 1e8 / 127 does not fit either
    assert main(["convert", str(bf), str(out), "--type", "q8_0"]) == 1
    line = _one_error_line(1, capsys.readouterr().err)
    assert "blk.0.attn_q.weight" in line and "Q8_0 block scale" in line
    assert not list(tmp_path.glob("*.gguf*"))
    # the default (auto: bf16 here) keeps the value
    assert main(["convert", str(bf), str(out)]) == 0
    import gguf

    (t,) = [t for t in gguf.GGUFReader(out).tensors if t.name == "blk.0.attn_q.weight"]
    vals = (t.data.view(np.uint16).astype(np.uint32) << 16).view(np.float32)  # bf16 -> f32: the high half
    assert np.isfinite(vals).all() and np.abs(vals).max() == pytest.approx(1e8, rel=0.01)


def test_q8_0_with_large_but_representable_scale(hf_dir, tmp_path):
    # 1e6 overflows f16 itself but its Q8_0 scale (7874) fits: q8_0 converts as before, f16 does not
    bf = _as_bf16(hf_dir[0], tmp_path / "big", big=1e6)
    from strata import StrataError
    from strata.gguf.convert import convert

    with pytest.raises(StrataError, match="beyond f16's range"):
        convert(bf, tmp_path / "a.gguf", "f16")
    convert(bf, tmp_path / "b.gguf", "q8_0")
    assert _tensor_types(tmp_path / "b.gguf")[1]["blk.0.attn_q.weight"] == Q.Q8_0


def test_output_paths(hf_dir, tmp_path, capsys):
    from strata.cli import main

    def err(*args) -> str:
        rc = main(["convert", *map(str, args)])
        return _one_error_line(rc, capsys.readouterr().err)

    # a directory: the file is named in it, as llama.cpp's converter names it
    (tmp_path / "outdir").mkdir()
    assert main(["convert", str(hf_dir[0]), str(tmp_path / "outdir")]) == 0
    assert [p.name for p in (tmp_path / "outdir").iterdir()] == ["tiny-qwen3moe-F16.gguf"]
    assert "outdir/tiny-qwen3moe-F16.gguf" in capsys.readouterr().err
    (tmp_path / "d2" / "tiny-qwen3moe-Q8_0.gguf").mkdir(parents=True)
    assert "is a directory" in err(hf_dir[0], tmp_path / "d2", "--type", "q8_0")
    # a missing directory: named before anything is converted (this checkpoint's f16 error would come later)
    big = _as_bf16(hf_dir[0], tmp_path / "big", big=1e8)
    line = err(big, tmp_path / "nowhere" / "m.gguf", "--type", "f16")
    assert "nowhere does not exist" in line and "attn_q" not in line
    (tmp_path / "afile").write_text("x")
    assert "afile is not a directory" in err(hf_dir[0], tmp_path / "afile" / "m.gguf")
    assert not (tmp_path / "nowhere").exists() and not list(tmp_path.rglob("*.tmp"))


def test_write_error_is_one_line_and_leaves_nothing(hf_dir, tmp_path):
    # A file size limit makes the write fail part-way, as a full disk does (root ignores permissions).
    import resource
    import signal

    def small_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG from write(), not death by signal
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))

    out = tmp_path / "m.gguf"
    r = subprocess.run([sys.executable, "-B", "-m", "strata", "convert", str(hf_dir[0]), str(out), "--type", "f32"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300, preexec_fn=small_files)
    line = _one_error_line(r.returncode, r.stderr)
    assert line.startswith(f"strata: error: cannot write {out}: ") and ("large" in line or "disk full" in line)
    assert list(tmp_path.iterdir()) == []


def _copy_ckpt(src: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


@pytest.mark.parametrize("key", ["num_hidden_layers", "hidden_size", "vocab_size", "moe_intermediate_size",
                                 "num_experts_per_tok"])
def test_config_without_a_required_key(hf_dir, tmp_path, capsys, key):
    from strata.cli import main

    d = _copy_ckpt(hf_dir[0], tmp_path / "ck")
    cfg = json.loads((d / "config.json").read_text())
    del cfg[key]
    (d / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "out" / "m.gguf"
    out.parent.mkdir()
    line = _one_error_line(main(["convert", str(d), str(out)]), capsys.readouterr().err)
    assert line == f"strata: error: {d / 'config.json'} has no {key} (a Qwen3-MoE config needs it)"
    assert list(out.parent.iterdir()) == []  # no output, no temporary file


def test_unreadable_config_and_checkpoint(hf_dir, tmp_path, capsys):
    from strata.cli import main
    from strata.gguf.convert_input import Checkpoint

    out = tmp_path / "out" / "m.gguf"
    out.parent.mkdir()

    def err(d) -> str:
        line = _one_error_line(main(["convert", str(d), str(out)]), capsys.readouterr().err)
        assert list(out.parent.iterdir()) == []
        return line

    d = _copy_ckpt(hf_dir[0], tmp_path / "badjson")
    (d / "config.json").write_text("{not json")
    assert f"{d / 'config.json'} is not valid JSON: Expecting property name" in err(d)
    (d / "config.json").write_text("[1, 2]")
    assert f"{d / 'config.json'} is not a JSON object" in err(d)
    # a download cut short: the data, or the header itself
    st = d / "model.safetensors"
    (d / "config.json").write_text((hf_dir[0] / "config.json").read_text())
    full = st.read_bytes()
    for size in (len(full) // 2, 20):
        st.write_bytes(full[:size])
        line = err(d)
        assert f"{st} cannot be read as safetensors (truncated or damaged? re-download it)" in line
    # a shard that shrinks after its header was read: reading a tensor says so as well
    st.write_bytes(full)
    ck = Checkpoint(d)
    st.write_bytes(full[: len(full) // 2])
    with pytest.raises(StrataError, match="cannot be read as safetensors"):
        ck.get("model.embed_tokens.weight")


def test_q8_0_falls_back_to_f16_per_tensor(hf_and_gguf, tmp_path, capsys):
    """GLM with hidden size 52: tensors whose rows are not whole 32-value blocks are f16 (llama.cpp's converter's
    fallback), others would be Q8_0; norms, biases and routers stay f32; the summary line says so."""
    from strata.cli import main
    from strata.config import EngineConfig
    from strata.engine.loader import forward_all, load_model
    from strata.gguf.header import read_gguf_header

    hf, f32 = hf_and_gguf("glm4moe")
    out = tmp_path / "m.gguf"
    assert main(["convert", str(hf), str(out), "--type", "q8_0"]) == 0
    h = read_gguf_header(out)
    want = {}
    for t in h.tensors:
        row = t.shape[0]  # (GGUF lists the row length first)
        if len(t.shape) == 1 or t.name.endswith(("ffn_gate_inp.weight", ".bias")):
            want[t.name] = Q.F32
        else:
            want[t.name] = Q.F16 if row % 32 else Q.Q8_0
    got = {t.name: t.ggml_type for t in h.tensors}
    assert got == want
    n16 = sum(v == Q.F16 for v in want.values())
    assert n16 > 30  # (every matrix here: its rows are 52, 72, 20 or 80; test_convert_cli has both kinds)
    assert capsys.readouterr().err.strip().endswith(f"q8_0, {n16} tensors f16: rows not a multiple of 32)")
    assert h.metadata["general.file_type"] == 7
    ids = list(range(3, 40))
    cfg = EngineConfig(device="cpu", dtype="f32")
    a, b = forward_all(load_model(str(out), cfg), ids), forward_all(load_model(str(f32), cfg), ids)
    assert torch.nn.functional.cosine_similarity(a, b, dim=-1).min() > 0.99
