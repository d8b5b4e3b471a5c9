"""The linter over the whole tree (ruff, configured in pyproject.toml): CI runs it with the tests."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PATHS = ("strata", "tests", "tools", "bench")


def _ruff() -> list[str] | None:
    if importlib.util.find_spec("ruff") is not None:
        return [sys.executable, "-m", "ruff"]
    exe = shutil.which("ruff")
    return [exe] if exe else None


RUFF = _ruff()
pytestmark = pytest.mark.skipif(RUFF is None, reason="ruff is not installed (pip install -e '.[test]')")


def _check(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([*RUFF, "check", "--no-cache", *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_the_tree_passes_ruff():
    r = _check(*PATHS)
    assert r.returncode == 0, f"ruff check {' '.join(PATHS)} (fix with `ruff check --fix`):\n{r.stdout}{r.stderr}"


def test_the_config_catches_an_unused_import_and_an_undefined_name(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n\n\ndef f():\n    return undefined_name\n", encoding="utf-8")
    r = _check("--config", str(ROOT / "pyproject.toml"), str(bad), cwd=tmp_path)
    assert r.returncode == 1
    assert "F401" in r.stdout and "F821" in r.stdout
