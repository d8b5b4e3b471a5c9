"""A decode step's K/V rows written into the cache by the fused q/k-norm + rotary kernel (`qk_norm_rope_kv`, no
index_copy_ after it), wired into whole models: with the kernel taken (in Triton's interpreter on the CPU) the
static decode steps of one sequence and of three together in slots 0..2 write no KV row themselves and give the
torch path's greedy tokens; a quantized cache keeps its own write."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from strata.config import EngineConfig
    from strata.engine.engine import Engine, Sequence
    from strata.engine.loader import load_model
    from strata.engine.sampler import SamplingParams
    from strata.kv.cache import KVCache
    from strata.ops import fused

    writes = []
    real_write_at = KVCache.write_at

    def counted(self, *a, **kw):
        writes.append(1)
        return real_write_at(self, *a, **kw)

    KVCache.write_at = counted
    torch_rule = fused.use_for
    PROMPTS = [[3, 5, 7, 9, 11], [4, 8, 15, 16, 23, 42], [2, 7, 1, 8, 2, 8, 1]]

    def run(path, fold, slots, kv=None):
        fused.use_for = (lambda x: True) if fold else torch_rule
        fused.KV_FOLD_GPU_TESTED = fold
        cfg = EngineConfig(device="cpu", dtype="float32", cuda_graphs=True, **({"kv_dtype": kv} if kv else {}))
        eng = Engine(load_model(path, cfg), n_slots=slots)
        assert eng.graphs is not None  # the decode steps below are the static-shape (windowed) ones
        seqs = [Sequence(list(p), SamplingParams(temperature=0), 5, set()) for p in PROMPTS[:slots]]
        for s in seqs:
            eng.add(s, reuse_prefix=False)
        while eng.running:
            eng.step()
        return [s.output for s in seqs]

    for path in sys.argv[1:]:
        for slots in (1, 3):
            ref = run(path, False, slots)
            writes.clear()
            got = run(path, True, slots)
            assert got == ref, (path, slots, got, ref)
            assert not writes, (path, slots, "a decode step wrote KV rows itself", len(writes))
        ref = run(path, False, 1, "q8_0")
        writes.clear()
        assert run(path, True, 1, "q8_0") == ref
        assert writes, "a quantized cache's rows are written by the cache"
    print("ok")
""")


def test_decode_steps_write_kv_in_the_rotary_kernel(hf_and_gguf):
    paths = [str(hf_and_gguf(f)[1]) for f in ("qwen3moe", "llama")]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run([sys.executable, "-c", SCRIPT, *paths], env=env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
