"""The prompts of the in-process measurements: tools/bench_decode.py makes a prompt of exactly the length asked, a
128K one included (it once came out shorter and the long prefill was skipped without a word), and
tools/bench_spec.py's suite continues code from modules the embedded model's training held out, as its docs say."""

from __future__ import annotations

import importlib
import json
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _tool(name: str):
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "tools"))


@pytest.fixture(scope="module")
def tok():
    from strata.config import EngineConfig
    from strata.engine.loader import load_model
    from strata.models.default import default_model_path

    path = str(default_model_path())
    return load_model(path, EngineConfig(model=path, device="cpu")).tokenizer


def test_a_prompt_is_as_long_as_asked(tok):
    bench_decode = _tool("bench_decode")
    twenty = len(tok.encode(open(bench_decode.__file__).read() * 20, add_special=False))
    n = 3 * twenty + 17  # more than the text the tool repeated before
    ids = bench_decode.make_prompt(tok, n, salt=99991)
    assert len(ids) == n
    assert bench_decode.make_prompt(tok, 64, salt=1) != bench_decode.make_prompt(tok, 64, salt=2)  # (the salt)


def test_the_suite_continues_code_the_model_was_not_trained_on(tok):
    bench_spec = _tool("bench_spec")
    manifest = json.loads((ROOT / "docs/strata-tiny/manifest.json").read_text())
    held = {f["path"] for f in manifest["files"] if f["source"] == "stdlib" and f["split"] == "heldout"}
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in bench_spec.SUITE:
        parts = name.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            try:
                mod = importlib.import_module(".".join(parts[:cut]))
                break
            except ImportError:
                continue
        assert Path(mod.__file__).resolve().relative_to(stdlib.resolve()).as_posix() in held, name
    got = bench_spec.prompts(tok, "suite")
    assert list(got)[:2] == ["edit", "fresh"] and len(got) == 2 + len(bench_spec.SUITE)
    assert all(len(ids) > 50 for ids in got.values())
