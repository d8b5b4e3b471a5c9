"""transformers + accelerate offloading as the peer: runs bench/peers/hf_offload.py in a child process (its own
memory, its own CUDA context) and reads its sweep-shaped record."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from strata import StrataError

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "bench" / "peers" / "hf_offload.py"


def hf_argv(model: str, out: Path, *, budget_gib: float | None, lengths: list[int], gen: int, runs: int,
            threads: int = 0) -> list[str]:
    argv = [sys.executable, str(SCRIPT), str(model), "--lengths", ",".join(map(str, lengths)), "--gen", str(gen),
            "--runs", str(runs), "--out", str(out)]
    if budget_gib is not None:
        argv += ["--budget-gib", str(budget_gib)]
    if threads:
        argv += ["--threads", str(threads)]
    return argv


def run_hf(model: str, *, budget_gib: float | None, lengths: list[int], gen: int, runs: int, threads: int = 0,
           log_path: Path | None = None, timeout: float | None = None) -> dict:
    if not SCRIPT.is_file():
        raise StrataError(f"{SCRIPT} not found (the transformers peer runs from a strata checkout)")
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "hf.json"
        argv = hf_argv(model, out, budget_gib=budget_gib, lengths=lengths, gen=gen, runs=runs, threads=threads)
        log_file = Path(log_path or Path(d) / "hf.log")
        log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(log_file, "w", encoding="utf-8") as log:
            cp = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
        if cp.returncode != 0 or not out.exists():
            tail = log_file.read_text(errors="replace").strip().splitlines()[-3:]
            raise StrataError(f"the transformers peer failed (exit {cp.returncode}): {' | '.join(tail)}")
        res = json.loads(out.read_text())
    res["command"] = argv
    return res
