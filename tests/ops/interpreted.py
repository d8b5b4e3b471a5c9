"""Kernel checks run in Triton's interpreter on the CPU, each in its own process (TRITON_INTERPRET is read when
Triton loads): a script of checks that prints "ok" when its assertions hold."""

from __future__ import annotations

import os
import subprocess
import sys


def run(script: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)


def assert_passes(script: str) -> None:
    r = run(script)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def assert_caught(script: str) -> None:
    """The script's checks fail (a deliberately wrong kernel is caught: the check can fail)."""
    r = run(script)
    assert r.returncode != 0 and "AssertionError" in r.stderr, r.stderr[-3000:]
