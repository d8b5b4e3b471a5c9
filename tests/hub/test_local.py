"""Choosing a model's files from a listing, and `resolve_model` over the models directory."""

from __future__ import annotations

import hashlib
import json

import pytest

from strata import StrataError
from strata.hub.local import default_models_dir, parse_spec, resolve_model, select_files, shard_info
from strata.hub.plan import url_plan
from strata.hub.verify import Digest, write_marker

LISTING = [
    "README.md",
    "Qwen3-30B-A3B-Q4_K_M.gguf",
    "Qwen3-30B-A3B-Q4_K_S.gguf",
    "Qwen3-30B-A3B-Q4_K.gguf",
    "Qwen3-30B-A3B-UD-Q4_K_XL.gguf",
    "Q8_0/Qwen3-30B-A3B-Q8_0-00002-of-00002.gguf",
    "Q8_0/Qwen3-30B-A3B-Q8_0-00001-of-00002.gguf",
    "mmproj-F16.gguf",
    "Qwen3-30B-A3B-F16.gguf",
]


@pytest.mark.parametrize(
    "sel, want",
    [
        ("Q4_K_M", ["Qwen3-30B-A3B-Q4_K_M.gguf"]),
        ("q4_k_m", ["Qwen3-30B-A3B-Q4_K_M.gguf"]),
        ("Q4_K", ["Qwen3-30B-A3B-Q4_K.gguf"]),  # not Q4_K_M / Q4_K_S / Q4_K_XL
        ("UD-Q4_K_XL", ["Qwen3-30B-A3B-UD-Q4_K_XL.gguf"]),
        ("Q4_K_XL", ["Qwen3-30B-A3B-UD-Q4_K_XL.gguf"]),
        ("Q8_0", ["Q8_0/Qwen3-30B-A3B-Q8_0-00001-of-00002.gguf", "Q8_0/Qwen3-30B-A3B-Q8_0-00002-of-00002.gguf"]),
        ("F16", ["Qwen3-30B-A3B-F16.gguf"]),  # the projector only rides along when nothing else matches
        ("mmproj-F16.gguf", ["mmproj-F16.gguf"]),
        ("README.md", ["README.md"]),
        (
            "Q8_0/Qwen3-30B-A3B-Q8_0-00002-of-00002.gguf",  # one shard named: the whole set
            ["Q8_0/Qwen3-30B-A3B-Q8_0-00001-of-00002.gguf", "Q8_0/Qwen3-30B-A3B-Q8_0-00002-of-00002.gguf"],
        ),
    ],
)
def test_select_files(sel, want):
    assert select_files(LISTING, sel, "repo") == want


def test_select_errors():
    with pytest.raises(StrataError, match="matches 6 models"):
        select_files(LISTING, None, "repo")
    with pytest.raises(StrataError, match="no file in repo matches 'IQ1_S'"):
        select_files(LISTING, "IQ1_S", "repo")
    assert select_files(["a.json", "x-Q4_0.gguf"], None, "repo") == ["x-Q4_0.gguf"]


def test_specs():
    assert parse_spec("unsloth/Qwen3-30B-A3B-GGUF:Q4_K_M") == ("unsloth/Qwen3-30B-A3B-GGUF", "Q4_K_M")
    assert parse_spec("a/b") == ("a/b", None)
    with pytest.raises(StrataError):
        parse_spec("not a repo")
    assert shard_info("d/x-00003-of-00010.gguf") == ("d/x", 3, 10)
    assert shard_info("x.gguf") is None


def test_default_models_dir(monkeypatch, tmp_path):
    monkeypatch.delenv("STRATA_CACHE_DIR", raising=False)
    monkeypatch.setenv("STRATA_MODELS_DIR", str(tmp_path / "m"))
    assert default_models_dir() == tmp_path / "m"
    monkeypatch.delenv("STRATA_MODELS_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "c"))
    assert default_models_dir() == tmp_path / "c" / "strata" / "models"
    monkeypatch.setenv("STRATA_CACHE_DIR", str(tmp_path / "root"))  # one cache root for everything
    assert default_models_dir() == tmp_path / "root" / "models"


def _finished(path, data=b"x" * 10):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    write_marker(path, Digest(len(data), hashlib.sha256(data).hexdigest()), "test", "sha256")
    return path


def test_resolve_model(tmp_path):
    root = tmp_path / "models"
    repo = root / "acme" / "M-GGUF"
    a = _finished(repo / "Q8_0" / "M-Q8_0-00001-of-00002.gguf")
    b = _finished(repo / "Q8_0" / "M-Q8_0-00002-of-00002.gguf")
    q4 = _finished(repo / "M-Q4_K_M.gguf")
    assert resolve_model("acme/M-GGUF:Q8_0", root) == [a, b]
    assert resolve_model("acme/M-GGUF:Q4_K_M", root) == [q4]
    assert resolve_model(q4) == [q4]
    with pytest.raises(StrataError, match="matches 2 models"):
        resolve_model("acme/M-GGUF", root)
    with pytest.raises(StrataError, match="acme/other is not in .*strata pull acme/other:Q4_K_M"):
        resolve_model("acme/other:Q4_K_M", root)
    with pytest.raises(StrataError, match="no such file"):
        resolve_model(str(tmp_path / "nope.gguf"), root)
    # A marker that disagrees with its file's size: not finished, not loaded.
    b.write_bytes(b"x" * 9)
    with pytest.raises(StrataError, match="not completely downloaded or not verified .*strata pull"):
        resolve_model("acme/M-GGUF:Q8_0", root)
    b.unlink()
    with pytest.raises(StrataError, match=r"incomplete split GGUF set \(have parts \[1\] of 2\)"):
        resolve_model("acme/M-GGUF:Q8_0", root)
    with pytest.raises(StrataError, match="M-Q8_0-00002-of-00002.gguf"):
        resolve_model(a)  # a first shard whose siblings are missing


def test_url_destinations(tmp_path):
    ms = "https://modelscope.cn/models/unsloth/Q-GGUF/resolve/master/Q4_K_M/Q-Q4_K_M-00001-of-00002.gguf"
    files = url_plan(ms, tmp_path)
    assert [f.dest for f in files] == [
        tmp_path / "unsloth/Q-GGUF/Q4_K_M" / f"Q-Q4_K_M-0000{i}-of-00002.gguf" for i in (1, 2)
    ]
    assert files[1].url == ms.replace("00001-of", "00002-of")
    (f,) = url_plan("https://example.com/a/b/x.gguf?sig=1", tmp_path, sha256=["AB" * 32], size=5)
    assert (f.dest, f.size, f.sha256) == (tmp_path / "x.gguf", 5, "ab" * 32)
    assert f.url == "https://example.com/a/b/x.gguf?sig=1"
    (f,) = url_plan("https://example.com/x.gguf", tmp_path, output=tmp_path / "y.gguf")
    assert f.dest == tmp_path / "y.gguf"
    with pytest.raises(StrataError, match="one per shard"):
        url_plan(ms, tmp_path, sha256=["ab" * 32])


def test_any_part_of_a_split_set_is_the_whole_set(tmp_path, capsys):
    """`-m` naming part 2 of 3 means the model the loader opens (all three parts): `strata check` sized part 2
    alone and judged a third of the model. A directory is named as one."""
    from strata.cli import main

    from .conftest import split_set

    files = split_set(tmp_path, "M", 3, 4096)
    parts = [tmp_path / n for n in sorted(files)]
    assert resolve_model(parts[1]) == parts
    assert main(["check", "-m", str(parts[1]), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["files"] == [str(p) for p in parts]
    parts[2].unlink()
    with pytest.raises(StrataError, match=r"M-00002-of-00003.gguf is part 2 of 3, but .* missing: M-00003-of-00003"):
        resolve_model(parts[1])
    with pytest.raises(StrataError, match="is a directory"):
        resolve_model(tmp_path)
