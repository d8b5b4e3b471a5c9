"""`strata serve` with a model that fails to load (a real process): the error is one `strata: error:` line, as
`strata check` and `strata generate` print theirs, not also a log line naming the exception's class."""

from __future__ import annotations

import os
import struct
import subprocess
import sys

from tests.experts.tiered_model import write_moe_gguf

from .conftest import free_port


def _bad_type(path):
    """A tiny GGUF whose up-projection tensor claims ggml type 99 (no such type)."""
    write_moe_gguf(path, n_layers=1)
    b = bytearray(path.read_bytes())
    name = b"blk.0.ffn_up_exps.weight"
    i = b.find(struct.pack("<Q", len(name)) + name)
    assert i > 0
    i += 8 + len(name)  # then: n_dims (u32), the dims (u64 each), the type (u32)
    struct.pack_into("<I", b, i + 4 + 8 * struct.unpack_from("<I", b, i)[0], 99)
    path.write_bytes(b)
    return path


def test_a_load_error_is_one_line(tmp_path):
    bad = _bad_type(tmp_path / "badtype.gguf")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "STRATA_API_KEY": ""}
    p = subprocess.run([sys.executable, "-m", "strata", "serve", "-m", str(bad), "--port", str(free_port()),
                        "--no-warmup"], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stderr
    said = [ln for ln in p.stderr.splitlines() if "unknown ggml type" in ln]
    assert said == ["strata: error: badtype.gguf: tensor blk.0.ffn_up_exps.weight has unknown ggml type 99"], \
        p.stderr
    assert "StrataError" not in p.stderr and "Traceback" not in p.stderr
