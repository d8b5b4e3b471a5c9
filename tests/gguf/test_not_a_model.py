"""What a user passes as `-m` by mistake gets one line saying what the file is and what to do instead: a checkpoint
that is not GGUF, a Git LFS pointer, an error page, a vocabulary-only GGUF, one part of a split set alone."""

from strata.cli import main


def _error(capsys, argv) -> str:
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 1, err
    lines = [ln for ln in err.splitlines() if ln.startswith("strata: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _both(capsys, path) -> str:
    """The error of `strata generate -m path` and of `strata check -m path`: the same line."""
    gen = _error(capsys, ["generate", "-m", str(path), "-p", "x", "--device", "cpu"])
    chk = _error(capsys, ["check", "-m", str(path)])
    assert gen == chk
    return gen


def test_files_that_are_not_gguf_say_what_they_are(tmp_path, capsys):
    import torch
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(4)}, tmp_path / "model.safetensors")
    torch.save({"w": torch.zeros(4)}, tmp_path / "pytorch_model.bin")
    torch.save({"w": torch.zeros(4)}, tmp_path / "legacy.bin", _use_new_zipfile_serialization=False)
    (tmp_path / "lfs.gguf").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:00\nsize 9\n")
    (tmp_path / "page.gguf").write_text("<!DOCTYPE html><html><body>Not Found</body></html>")
    (tmp_path / "ggjt.bin").write_bytes(b"tjgg" + bytes(64))
    (tmp_path / "text.gguf").write_text("hello")
    for name, words in [("model.safetensors", ["safetensors", "strata convert"]),
                        ("pytorch_model.bin", ["PyTorch checkpoint", "strata convert"]),
                        ("legacy.bin", ["PyTorch checkpoint"]),
                        ("lfs.gguf", ["Git LFS pointer", "git lfs pull"]),
                        ("page.gguf", ["web page"]),
                        ("ggjt.bin", ["before GGUF"]),
                        ("text.gguf", ["not a GGUF file"])]:
        line = _both(capsys, tmp_path / name)
        assert line.startswith(f"strata: error: {name}: "), line
        for w in words:
            assert w in line, (name, line)


def test_a_vocabulary_only_gguf_is_not_a_model(llamacpp_models, capsys):
    # (gpt2 is an architecture strata does not run, llama one it does: the vocabulary is said either way)
    for name in ("ggml-vocab-gpt-2.gguf", "ggml-vocab-llama-bpe.gguf"):
        line = _both(capsys, llamacpp_models / name)
        assert "holds no tensors: a vocabulary-only GGUF" in line, line


def test_a_split_part_renamed_is_named_as_a_part(hf_and_gguf, tmp_path, capsys):
    from test_split import _split  # (tests/models is on the path: conftest)

    _, single = hf_and_gguf("qwen3moe")
    first, _ = _split(single, tmp_path)
    alone = first.rename(tmp_path / "model.gguf")  # the set's first part, its name no longer saying so
    line = _both(capsys, alone)
    assert "model.gguf is part 1 of a split GGUF set of 2 files" in line and "-00001-of-00002.gguf" in line



def test_a_directory_or_a_missing_path_says_what_to_pass(tmp_path, capsys):
    import shutil

    from strata.models.default import SHIPPED

    hf = tmp_path / "Qwen3-30B-A3B"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    line = _both(capsys, hf)
    assert "transformers checkpoint directory" in line and f"strata convert {hf} out.gguf" in line
    models = tmp_path / "models"
    models.mkdir()
    shutil.copy(SHIPPED, models / "tiny.gguf")
    assert f"-m {models / 'tiny.gguf'}" in _both(capsys, models)
    # a path that is not there is not a repo id
    assert _both(capsys, tmp_path / "nothing") == f"strata: error: no such file: {tmp_path / 'nothing'}"
