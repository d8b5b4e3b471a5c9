"""The header reader against gguf-py's GGUFReader, the structural check, hashing against git, markers."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess

import numpy as np
import pytest

from strata import StrataError
from strata.hub.verify import (
    Digest,
    check_gguf_file,
    hash_file,
    marker_path,
    marker_valid,
    read_gguf_header,
    read_marker,
    write_marker,
)


def _rich_gguf(path, endianess=None):
    import gguf

    kw = {"endianess": endianess} if endianess is not None else {}
    w = gguf.GGUFWriter(str(path), "qwen3moe", **kw)
    w.add_block_count(2)
    w.add_expert_count(4)
    w.add_float32("qwen3moe.rope.freq_base", 1e6)
    w.add_bool("x.flag", True)
    w.add_uint64("x.big", 1 << 40)
    w.add_int32("x.neg", -5)
    w.add_string("x.s", "héllo")
    w.add_array("qwen3moe.attention.head_count_kv", [4, 0, 4])
    w.add_token_list([f"tok{i}" for i in range(5000)])  # long string array: skipped, not decoded
    w.add_array("x.floats", [0.5, 1.5])
    rng = np.random.default_rng(0)
    w.add_tensor("a.weight", rng.standard_normal((3, 5), dtype=np.float32))
    w.add_tensor("b.weight", rng.standard_normal((2, 4, 32), dtype=np.float32).astype(np.float16))
    q = rng.integers(0, 255, size=(8, 2 * 18), dtype=np.uint8)  # 8 rows of 64 Q4_0 weights (2 blocks x 18 B)
    w.add_tensor("c.weight", q, raw_dtype=gguf.GGMLQuantizationType.Q4_0)
    w.add_tensor("d.weight", np.arange(7, dtype=np.int32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("big_endian", [False, True])
def test_header_matches_gguf_reader(tmp_path, big_endian):
    import gguf

    p = _rich_gguf(tmp_path / "m.gguf", gguf.GGUFEndian.BIG if big_endian else None)
    h = read_gguf_header(p)
    r = gguf.GGUFReader(p)
    assert h.data_offset == r.data_offset and h.alignment == r.alignment
    assert [(t.name, t.shape, t.ggml_type, t.n_bytes, t.offset) for t in h.tensors] == [
        (t.name, tuple(int(d) for d in t.shape), int(t.tensor_type), int(t.n_bytes), int(t.data_offset))
        for t in r.tensors
    ]
    for key in ["general.architecture", "qwen3moe.block_count", "qwen3moe.expert_count", "x.flag", "x.big",
                "x.neg", "x.s", "qwen3moe.attention.head_count_kv", "x.floats", "qwen3moe.rope.freq_base"]:  # fmt: skip
        assert h.metadata[key] == pytest.approx(r.fields[key].contents()), key
    assert "tokenizer.ggml.tokens" not in h.metadata
    assert h.arch_value("expert_count") == 4
    check_gguf_file(p)


def test_header_of_real_vocab_file(llamacpp_models):
    h = check_gguf_file(llamacpp_models / "ggml-vocab-qwen2.gguf")
    assert h.architecture == "qwen2" and h.metadata["tokenizer.ggml.model"] == "gpt2" and h.tensors == []


def test_truncation_is_named(tmp_path):
    p = _rich_gguf(tmp_path / "m.gguf")
    data = p.read_bytes()
    h = read_gguf_header(p)
    last = h.tensors[-1]
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: last.offset + 1])
    with pytest.raises(StrataError, match=rf"cut\.gguf: tensor {last.name} ends at byte {last.offset + last.n_bytes}"):
        check_gguf_file(cut)
    cut.write_bytes(data[: h.tensors[1].offset + 3])  # the first tensor past the end is named
    with pytest.raises(StrataError, match="tensor b.weight ends"):
        check_gguf_file(cut)
    cut.write_bytes(data[: h.data_offset - 40])
    with pytest.raises(StrataError, match="not a readable GGUF header"):
        check_gguf_file(cut)
    cut.write_bytes(b"")
    with pytest.raises(StrataError, match="not a GGUF file"):
        check_gguf_file(cut)
    cut.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(StrataError, match="x.gguf: a PyTorch checkpoint"):
        check_gguf_file(cut, name="x.gguf")
    cut.write_bytes(bytes(100))
    with pytest.raises(StrataError, match="does not start with GGUF's magic"):
        check_gguf_file(cut)


def test_hash_matches_git_and_hashlib(tmp_path):
    p = tmp_path / "f"
    data = np.random.default_rng(1).bytes(3 * (8 << 20) // 2)  # spans several read buffers
    p.write_bytes(data)
    d = hash_file(p, git_sha1=True)
    assert d.size == len(data) and d.sha256 == hashlib.sha256(data).hexdigest()
    if shutil.which("git"):
        assert d.git_sha1 == subprocess.check_output(["git", "hash-object", str(p)], text=True).strip()
    assert hash_file(p).git_sha1 is None


def test_marker_validity(tmp_path):
    f = tmp_path / "x.gguf"
    f.write_bytes(b"abc")
    assert not marker_valid(f)
    write_marker(f, Digest(3, hashlib.sha256(b"abc").hexdigest()), "src", "sha256")
    m = read_marker(f)
    assert (m.size, m.source, m.verified_against) == (3, "src", "sha256") and m.time.endswith("Z")
    assert marker_valid(f) and marker_valid(f, 3, hashlib.sha256(b"abc").hexdigest().upper())
    assert not marker_valid(f, 4) and not marker_valid(f, 3, "00" * 32)
    f.write_bytes(b"abcd")
    assert not marker_valid(f)  # the file changed size under its marker
    marker_path(f).write_text("{not json")
    assert read_marker(f) is None and not marker_valid(f)


def test_marker_records_mtime(tmp_path):
    f = tmp_path / "x.gguf"
    f.write_bytes(b"abc")
    write_marker(f, hash_file(f), "src", "sha256")
    st = f.stat()
    assert read_marker(f).mtime_ns == st.st_mtime_ns and marker_valid(f, allow_legacy=False)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1))  # rewritten in place, same size
    assert not marker_valid(f)
    # a marker from before mtimes were kept: accepted on its size unless the caller asks for proof
    m = json.loads(marker_path(f).read_text())
    del m["mtime_ns"]
    marker_path(f).write_text(json.dumps(m))
    assert read_marker(f).mtime_ns is None
    assert marker_valid(f) and not marker_valid(f, allow_legacy=False)
