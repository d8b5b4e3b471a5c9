"""`strata convert` on the checkpoint directories users download: sharded ones (a shard missing, a stray
consolidated copy beside the shards), PyTorch .bin only, no model_type, no tokenizer, OUT naming an input file."""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """(one-file checkpoint, the same model sharded with a model.safetensors.index.json)."""
    from hf_fixtures import make_hf_model, make_tokenizer_dir

    root = tmp_path_factory.mktemp("hf")
    one, sharded = root / "one", root / "sharded"
    model = make_hf_model("qwen3moe", one, vocab_size=1001)
    make_tokenizer_dir(one, 1001)
    model.save_pretrained(sharded, max_shard_size="100KB")
    for n in TOKENIZER_FILES:
        shutil.copy(one / n, sharded / n)
    assert len(list(sharded.glob("model-*.safetensors"))) > 3 and (sharded / "model.safetensors.index.json").exists()
    return one, sharded


def _error(capsys, *args) -> str:
    from strata.cli import main

    rc = main(["convert", *map(str, args)])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc == 1 and len(lines) == 1 and lines[0].startswith("strata: error: "), err
    return lines[0]


def _tensors(path: pathlib.Path) -> dict[str, bytes]:
    import gguf

    return {t.name: bytes(t.data.tobytes()) for t in gguf.GGUFReader(path).tensors}


def _copy(src: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
    shutil.copytree(src, dst)
    return dst


def test_sharded_checkpoint(ckpts, tmp_path, capsys):
    from strata.cli import main

    one, sharded = ckpts
    assert main(["convert", str(one), str(tmp_path / "a.gguf")]) == 0
    assert main(["convert", str(sharded), str(tmp_path / "b.gguf")]) == 0
    want = _tensors(tmp_path / "a.gguf")
    assert _tensors(tmp_path / "b.gguf") == want
    # a consolidated copy beside the shards, under other tensor names (as Mistral's repositories hold one):
    # the index says which files make the checkpoint
    d = _copy(sharded, tmp_path / "cons")
    import torch
    from safetensors.torch import save_file

    save_file({"layers.0.attention.wq.weight": torch.zeros(4, 4)}, d / "consolidated.safetensors")
    assert main(["convert", str(d), str(tmp_path / "c.gguf")]) == 0
    assert _tensors(tmp_path / "c.gguf") == want
    capsys.readouterr()


def test_sharded_checkpoint_with_a_shard_missing_or_wrong(ckpts, tmp_path, capsys):
    _, sharded = ckpts
    out = tmp_path / "out" / "m.gguf"
    out.parent.mkdir()
    d = _copy(sharded, tmp_path / "miss")
    shard = sorted(d.glob("model-*.safetensors"))[2]
    n = len(list(d.glob("model-*.safetensors")))
    shard.unlink()
    line = _error(capsys, d, out)
    assert line == (f"strata: error: {d}: {shard.name} is missing (model.safetensors.index.json lists {n} shards: "
                    "the download is incomplete)")
    # a shard that does not hold what the index says it does (one from another download)
    shutil.copy(sorted(d.glob("model-*.safetensors"))[0], shard)
    line = _error(capsys, d, out)
    assert "model.safetensors.index.json: tensor " in line and f"is listed in {shard.name}, which does not hold it" in line
    (d / "model.safetensors.index.json").write_text('{"metadata": {}}')
    assert "model.safetensors.index.json is not a safetensors index" in _error(capsys, d, out)
    assert list(out.parent.iterdir()) == []


def test_pytorch_bin_only(ckpts, tmp_path, capsys):
    import torch
    from safetensors.torch import load_file

    one, _ = ckpts
    d = tmp_path / "bin"
    d.mkdir()
    for f in one.glob("*.json"):
        shutil.copy(f, d / f.name)
    torch.save(load_file(one / "model.safetensors"), d / "pytorch_model.bin")
    line = _error(capsys, d, tmp_path / "m.gguf")
    assert "pytorch_model.bin" in line and "safetensors" in line


def test_config_without_model_type(ckpts, tmp_path, capsys):
    d = _copy(ckpts[0], tmp_path / "nomt")
    cfg = json.loads((d / "config.json").read_text())
    del cfg["model_type"]
    (d / "config.json").write_text(json.dumps(cfg))
    assert _error(capsys, d, tmp_path / "m.gguf") == (f"strata: error: {d / 'config.json'} has no model_type (it "
                                                      "names the architecture strata convert maps)")


def test_missing_tokenizer_is_named_before_converting(ckpts, tmp_path, capsys):
    # this checkpoint's f16 range error would come from converting its first layer: the tokenizer's comes first
    from test_convert_cli import _as_bf16

    d = _as_bf16(ckpts[0], tmp_path / "notok", big=1e8)
    (d / "tokenizer.json").unlink()
    line = _error(capsys, d, tmp_path / "m.gguf", "--type", "f16")
    assert line == f"strata: error: {d}: no tokenizer.json (strata convert needs the checkpoint's tokenizer)"
    assert not list(tmp_path.glob("*.gguf*"))


@pytest.mark.parametrize("name", ["model.safetensors", "tokenizer.json", "config.json"])
def test_output_naming_a_checkpoint_file_is_refused(ckpts, tmp_path, capsys, name):
    d = _copy(ckpts[0], tmp_path / "ck")
    before = (d / name).read_bytes()
    line = _error(capsys, d, d / name)
    assert line == f"strata: error: {d / name} is a file of the checkpoint being converted: give another OUT"
    assert (d / name).read_bytes() == before and not list(d.glob("*.tmp"))


def test_damaged_tokenizer_files(ckpts, tmp_path, capsys):
    # read before any tensor is converted: this checkpoint's f16 range error would otherwise come first
    from test_convert_cli import _as_bf16

    d = _as_bf16(ckpts[0], tmp_path / "tok", big=1e8)
    good = (d / "tokenizer.json").read_text()
    for name, text, why in (("tokenizer.json", good[: len(good) // 2], " at line "),
                            ("tokenizer.json", "", "Expecting value at line 1 column 1"),
                            ("tokenizer_config.json", "{", "Expecting property name")):
        before = (d / name).read_text()
        (d / name).write_text(text)
        line = _error(capsys, d, tmp_path / "m.gguf", "--type", "f16")
        assert line.startswith(f"strata: error: {d / name} is not valid JSON: ") and why in line, line
        (d / name).write_text(before)
    assert not list(tmp_path.glob("*.gguf*"))


def test_tokenizer_larger_than_the_vocabulary(ckpts, tmp_path, capsys):
    # config.json's vocab_size (the embedding's rows) below the tokenizer's ids: refused, as llama.cpp does
    d = _copy(ckpts[0], tmp_path / "v")
    cfg = json.loads((d / "config.json").read_text())
    cfg["vocab_size"] = 900
    (d / "config.json").write_text(json.dumps(cfg))
    assert _error(capsys, d, tmp_path / "m.gguf") == (f"strata: error: {d / 'tokenizer.json'} has 1001 tokens, "
                                                      "more than the 900 of config.json's vocab_size (the "
                                                      "embedding's rows)")
    assert not list(tmp_path.glob("*.gguf*"))


def test_output_directory_with_a_trailing_slash_that_does_not_exist(ckpts, tmp_path, capsys):
    # `OUT/` means a directory: one that is not there is an error, not a file named OUT
    line = _error(capsys, ckpts[0], f"{tmp_path / 'newdir'}/")
    assert line == f"strata: error: cannot write to {tmp_path / 'newdir'}/: the directory does not exist"
    assert list(tmp_path.iterdir()) == []
