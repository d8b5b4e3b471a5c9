"""tools/bench_verify.py: the verify-step cost table runs end to end on a small tiered model (CPU, eager steps),
one row per step length, and its acceptance arithmetic is the geometric series of an accepted prefix."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_expected_tokens_of_a_verify_step():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        from bench_verify import expected_tokens
    finally:
        sys.path.remove(str(ROOT / "tools"))
    assert expected_tokens(0.5, 1) == 1.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.5)
    assert expected_tokens(0.7, 4) == pytest.approx(1 + 0.7 + 0.49 + 0.343)
    assert expected_tokens(1.0, 6) == 6.0


def test_the_table_on_a_tiered_model(tmp_path):
    from tests.experts.tiered_model import write_moe_gguf

    model = write_moe_gguf(tmp_path / "moe.gguf", n_experts=8, k=2)
    cmd = [sys.executable, str(ROOT / "tools" / "bench_verify.py"), "-m", str(model), "--device", "cpu",
           "--dtype", "float32", "--expert-slots", "2", "--cpu-plan", "000", "--tokens", "1,2,4", "--steps", "3",
           "--prompt-tokens", "16", "--ctx-size", "128"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    rows = out["rows"]
    assert [row["T"] for row in rows] == [1, 2, 4] and all(row["steps"] == 3 for row in rows)
    assert all(row["ms"] > 0 and row["missed_experts"] >= 0 for row in rows)
    assert rows[2]["missed_experts"] >= rows[0]["missed_experts"]  # four tokens route to at least one's experts
    assert set(rows[1]["tok_s"]) == {"50%", "70%", "90%"}
    assert "tok/s@90%" in r.stderr
