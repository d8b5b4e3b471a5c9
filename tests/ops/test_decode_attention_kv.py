"""The split-key one-query attention reading q8_0 / q4_0 KV blocks in place (`strata.ops.decode_attention_kv`)
against the op's reference twin (both dequantized, then SDPA with the window mask): in Triton's interpreter on the
CPU, compiled on CUDA (marked gpu) inside a captured graph, and wired into whole models (a q8_0 and a q4_0 cache
decode the torch path's tokens)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from strata.kv.quant import QuantRows
from strata.ops.reference import one_query_blocks

pytest.importorskip("triton")

CASES = textwrap.dedent("""
    import torch
    from strata.kv.quant import QuantRows
    from strata.ops.decode_attention_kv import decode_attention_blocks
    from strata.ops.reference import one_query_blocks

    def window(kind, L, hkv, D, dev, dtype, g):
        x = torch.randn(2, L, hkv, D, generator=g) * 2
        x[..., 3] *= 12  # an outlier channel, as real keys have (the q4_0 rotation's case)
        if kind is None:
            return x[1].to(dev, dtype)
        rows = QuantRows(2, L, (hkv, D), kind, dev)
        rows.write(1, 0, L, x[1].to(dev))
        return rows.window(1, L)

    def check(dev, dtype=torch.bfloat16):
        g = torch.Generator().manual_seed(0)
        # (K type, V type, H, Hkv, D, Dv, window, positions): Qwen3-30B's 32/4 heads, MHA, a window that is not a
        # whole number of splits, one KV head, K quantized over a plain V and the reverse
        for kt, vt, H, hkv, D, DV, L, poss in (("q8_0", "q8_0", 32, 4, 128, 128, 1024, (0, 700, 1023)),
                                               ("q4_0", "q4_0", 32, 4, 128, 128, 512, (5, 511)),
                                               ("q8_0", "q4_0", 4, 4, 64, 64, 300, (1, 299)),
                                               ("q4_0", None, 8, 1, 64, 32, 96, (95,)),
                                               (None, "q8_0", 16, 2, 32, 64, 200, (150,))):
            ks = window(kt, L, hkv, D, dev, dtype, g)
            vs = window(vt, L, hkv, DV, dev, dtype, g)
            for pos in poss:
                q = torch.randn(1, H, D, generator=g).to(dev, dtype)
                pos_t = torch.tensor([pos], device=dev)
                out = decode_attention_blocks(q, ks, vs, pos_t, D ** -0.5)
                ref = one_query_blocks(q.float(), ks, vs, pos_t, D ** -0.5)
                assert out.shape == (1, H, DV) and out.dtype == dtype, (out.shape, out.dtype)
                err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
                assert err < 2e-2, (kt, vt, H, hkv, D, L, pos, err)
""")


def _interpreted(code: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


def test_block_attention_in_the_interpreter():
    r = _interpreted(CASES + "\ncheck('cpu', torch.float32)\nprint('ok')\n")
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_the_reference_twin_is_the_dequantized_window(kind):
    """The twin equals attention over the dequantized rows with the window's mask (what the layers ran before)."""
    from strata.ops.reference import one_query_attention

    g = torch.Generator().manual_seed(1)
    L, hkv, D, H, pos = 40, 2, 64, 8, 23
    k, v = QuantRows(1, L, (hkv, D), kind, "cpu"), QuantRows(1, L, (hkv, D), kind, "cpu")
    k.write(0, 0, L, torch.randn(L, hkv, D, generator=g))
    v.write(0, 0, L, torch.randn(L, hkv, D, generator=g))
    q = torch.randn(1, H, D, generator=g)
    pos_t = torch.tensor([pos])
    mask = torch.zeros(1, L).masked_fill_(torch.arange(L)[None, :] > pos, float("-inf"))
    want = one_query_attention(q, k.read(0, L, torch.float32), v.read(0, L, torch.float32), mask, pos_t, D ** -0.5)
    got = one_query_blocks(q, k.window(0, L), v.window(0, L), pos_t, D ** -0.5)
    assert torch.equal(got, want)


WIRING = textwrap.dedent("""
    import sys
    import torch
    from strata.config import EngineConfig
    from strata.engine.engine import Engine
    from strata.engine.loader import load_model
    from strata.engine.sampler import SamplingParams
    from strata.ops import decode_attention_kv as dak

    calls = []
    gpu_rule = dak.use_for

    def run(path, kv, kernel):
        # on the CPU use_for says no; saying yes where the rows fit sends the decode steps' attention through the
        # interpreted kernel
        dak.use_for = (lambda q, ks, vs: dak._fits(ks) and dak._fits(vs) and (calls.append(1) or True)) \\
            if kernel else gpu_rule
        lm = load_model(path, EngineConfig(device="cpu", dtype="float32", cuda_graphs=True, kv_dtype=kv))
        eng = Engine(lm, n_slots=1)
        assert eng.graphs is not None  # the decode below is the static-shape (windowed) step
        return list(eng.generate([3, 5, 7, 9, 11, 13, 2], SamplingParams(temperature=0), 6))

    path = sys.argv[1]
    for kv in ("q8_0", "q4_0"):
        ref = run(path, kv, False)
        assert not calls
        got = run(path, kv, True)
        assert calls, "the layers did not ask for the block kernel"
        calls.clear()
        assert got == ref, (kv, got, ref)
    print("ok")
""")


def test_a_model_decodes_through_the_block_kernel(tmp_path):
    """A tiny Qwen3-MoE (head dim 32) with q8_0 and q4_0 KV: the same greedy tokens with the decode steps'
    attention read from the blocks by the (interpreted) kernel as through the dequantized window."""
    from tests.experts.tiered_model import write_moe_gguf

    path = write_moe_gguf(tmp_path / "moe.gguf", head_dim=32, heads=4, kv_heads=2)
    r = _interpreted(WIRING, str(path))
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("dynamic,lean", [(False, False), (True, False), (True, True)],
                         ids=["fixed-splits", "dynamic-splits", "dynamic-splits-lean-tiles"])
def test_block_attention_on_cuda_and_in_a_graph(monkeypatch, dynamic, lean):
    """(dynamic: each split's keys from the position on the device, strata.ops.decode_attention's
    DYNAMIC_SPLITS_GPU_TESTED; lean: the block scales loaded once a block and f16 dot operands, its
    LEAN_GPU_TESTED; replays at positions far below the window's end and at it)"""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from strata.ops import decode_attention as da

    monkeypatch.setattr(da, "DYNAMIC_SPLITS_GPU_TESTED", dynamic)
    monkeypatch.setattr(da, "LEAN_GPU_TESTED", lean)
    ns: dict = {}
    exec(CASES, ns)
    ns["check"]("cuda")
    from strata.ops.decode_attention_kv import decode_attention_blocks

    g = torch.Generator().manual_seed(3)
    dev = torch.device("cuda")
    k, v = QuantRows(1, 2048, (4, 128), "q8_0", dev), QuantRows(1, 2048, (4, 128), "q4_0", dev)
    k.write(0, 0, 2048, torch.randn(2048, 4, 128, generator=g).to(dev))
    v.write(0, 0, 2048, torch.randn(2048, 4, 128, generator=g).to(dev))
    kb, vb = k.window(0, 2048), v.window(0, 2048)
    q = torch.randn(1, 32, 128, generator=g).to(dev).bfloat16()
    pos_t = torch.tensor([7], device=dev)
    decode_attention_blocks(q, kb, vb, pos_t, 128 ** -0.5)  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention_blocks(q, kb, vb, pos_t, 128 ** -0.5)
    for pos in (7, 1500, 2047):
        pos_t.fill_(pos)
        graph.replay()
        ref = one_query_blocks(q.float(), kb, vb, pos_t, 128 ** -0.5)
        assert ((out.float() - ref).abs().max() / ref.abs().max()).item() < 2e-2, pos
