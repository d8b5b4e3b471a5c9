from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from strata.hub.pull import PullOptions, Reporter

from .fakehub import FakeHub

REPO = "acme/Tiny-MoE-GGUF"


def write_gguf(path: Path, tensors: dict[str, np.ndarray], kv: dict | None = None, arch: str = "qwen3moe") -> Path:
    """A real GGUF file written by gguf-py. kv: {key: int | float | str | list[int]}."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    for k, v in (kv or {}).items():
        if isinstance(v, bool):
            w.add_bool(k, v)
        elif isinstance(v, int):
            w.add_uint32(k, v)
        elif isinstance(v, float):
            w.add_float32(k, v)
        elif isinstance(v, str):
            w.add_string(k, v)
        else:
            w.add_array(k, v)
    for name, arr in tensors.items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def split_set(tmp: Path, stem: str, n: int, floats_per_shard: int, seed: int = 0) -> dict[str, bytes]:
    """A split GGUF set (stem-0000i-of-0000n.gguf) of random float32 tensors -> {name: bytes}."""
    rng = np.random.default_rng(seed)
    out = {}
    for i in range(1, n + 1):
        name = f"{stem}-{i:05d}-of-{n:05d}.gguf"
        t = {f"blk.{i}.ffn_down_exps.weight": rng.standard_normal((4, floats_per_shard // 64, 16), dtype=np.float32)}
        kv = {"split.no": i - 1, "split.count": n, "split.tensors.count": n}
        out[name] = write_gguf(tmp / name, t, kv).read_bytes()
    return out


@pytest.fixture(scope="session")
def model_set(tmp_path_factory) -> dict[str, bytes]:
    """Repo contents: a Q4_K_M split set of 3 (~256 KiB each), a single-file Q8_0, a README."""
    tmp = tmp_path_factory.mktemp("src")
    files = split_set(tmp, "Tiny-MoE-Q4_K_M", 3, 64 * 1024)
    single = write_gguf(
        tmp / "Tiny-MoE-Q8_0.gguf", {"token_embd.weight": np.arange(4096, dtype=np.float32).reshape(64, 64)}
    )
    files["Tiny-MoE-Q8_0.gguf"] = single.read_bytes()
    files["README.md"] = b"# tiny\n"
    return files


@pytest.fixture
def hub(model_set):
    h = FakeHub().start()
    h.add_repo(REPO, model_set)
    yield h
    h.stop()


@pytest.fixture
def opts():
    return PullOptions(jobs=3, retries=3, backoff=0.0, sleep=lambda s: None)


@pytest.fixture
def reporter():
    return Reporter()


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
