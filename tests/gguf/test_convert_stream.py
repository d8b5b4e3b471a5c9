"""`strata convert` streams: it writes each tensor as it converts it, holding about one at a time (not the whole
model until the end, as GGUFWriter.add_tensor would), and writes the same bytes as the in-memory writer."""

from __future__ import annotations

import tracemalloc

import gguf
import pytest

from strata.gguf.convert import convert


@pytest.fixture(scope="module")
def hf_256(tmp_path_factory):
    from hf_fixtures import make_hf_model, make_tokenizer_dir

    d = tmp_path_factory.mktemp("hf") / "tiny-qwen3moe-256"
    make_hf_model("qwen3moe_256", d, vocab_size=1001)  # 256 experts: ~5 MB of f16 tensors in 27
    make_tokenizer_dir(d, 1001)
    return d


@pytest.mark.parametrize("out_type", ["f32", "f16", "bf16", "q8_0"])
def test_streamed_file_is_the_in_memory_writers(hf_256, tmp_path, out_type):
    """The file equals, byte for byte, GGUFWriter's in-memory path (add_tensor, then write_tensors_to_file) fed
    the same metadata and tensors: the layout the converter wrote before it streamed."""
    from gguf_rewrite import rewrite

    out = convert(hf_256, tmp_path / "s.gguf", out_type)
    ref = rewrite(out, tmp_path / "ref.gguf")
    assert out.read_bytes() == ref.read_bytes()
    assert not list(tmp_path.glob("*.tmp"))


def test_peak_memory_is_about_one_tensor(hf_256, tmp_path):
    out = tmp_path / "m.gguf"
    convert(hf_256, out, "f16")  # (first imports and caches outside the measurement)
    tracemalloc.start()  # numpy's buffers (the f16 data written) are traced
    try:
        convert(hf_256, out, "f16")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    r = gguf.GGUFReader(out)
    total = sum(int(t.n_bytes) for t in r.tensors)
    largest = max(int(t.n_bytes) for t in r.tensors)
    assert total > 4_000_000 and largest < total / 8, (total, largest)
    # holding every converted tensor until the end would peak above the total
    assert peak < total / 3, (peak, total)
