"""A decode step's K/V rows written into the cache by the fused q/k-norm + rotary kernel (`qk_norm_rope_kv`, no
index_copy_ after it), wired into whole models: with the kernel taken (in Triton's interpreter on the CPU) the
static decode steps of one sequence and of three together in slots 0..2, and a drafted sequence's verify steps (all
its tokens in its slot), write no KV row themselves and give the torch path's greedy tokens; a quantized cache keeps
its own write."""

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

    def drafted(path, fold):
        # one sequence with n-gram drafts on a prompt that repeats itself: its verify steps (static segments of
        # several tokens in one slot) and plain steps -> (tokens, drafts tried)
        fused.use_for = (lambda x: True) if fold else torch_rule
        fused.KV_FOLD_GPU_TESTED = fold
        cfg = EngineConfig(device="cpu", dtype="float32", cuda_graphs=True, draft_max=6, draft_source="ngram")
        eng = Engine(load_model(path, cfg), n_slots=1)
        g = torch.Generator().manual_seed(1)
        base = torch.randint(3, 200, (40,), generator=g).tolist()
        out = list(eng.generate(base + base[5:30] + base[:20] + base, SamplingParams(temperature=0), 40))
        return out, eng.last.draft_n

    for path in sys.argv[1:]:
        ref, _ = drafted(path, False)
        writes.clear()
        got, n_drafts = drafted(path, True)
        assert n_drafts > 0, (path, "no drafts: no verify step was tried")
        assert got == ref, (path, "drafted", got, ref)
        assert not writes, (path, "a verify or decode step wrote KV rows itself", len(writes))

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


MTP = textwrap.dedent("""
    import sys
    import torch
    from strata.config import EngineConfig
    from strata.engine.engine import Engine
    from strata.engine.loader import load_model
    from strata.engine.sampler import SamplingParams
    from strata.ops import fused

    fused.use_for = lambda x: True  # every fused kernel taken (the interpreter's), the rotary's K/V fold too
    fused.KV_FOLD_GPU_TESTED = True
    path = sys.argv[1]
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(3, 200, (40,), generator=g).tolist()

    def run(graphs):
        cfg = EngineConfig(model=path, device="cpu", dtype="float32", ctx_size=256, draft_max=3,
                           draft_source="mtp", cuda_graphs=graphs)
        eng = Engine(load_model(path, cfg, with_tokenizer=False), n_slots=1)
        eng.device_drafts = None  # the block's static forwards on the host's path (their rows: one slot's)
        made, real = [], eng.mtp.draft
        eng.mtp.draft = lambda s, room: made.append(real(s, room)) or made[-1]
        out = list(eng.generate(prompt, SamplingParams(temperature=0), 24))
        return out, made, eng.mtp.kv

    text, drafts, kv = run(True)
    ref_text, ref_drafts, ref_kv = run(False)
    assert text == ref_text and drafts == ref_drafts, (drafts, ref_drafts)
    assert sum(len(d) for d in drafts) > 0
    for kind in ("k", "v"):  # the block's rows where the eager block wrote them (row i, rotated at i + 1)
        a, b = getattr(kv, kind)[0][0], getattr(ref_kv, kind)[0][0]
        assert a.abs().sum() > 0 and torch.allclose(a, b, atol=1e-5, rtol=1e-4), kind
    print("ok")
""")


def test_an_mtp_blocks_rows_stay_its_own(hf_and_gguf):
    """An MTP block caches row i rotated at position i + 1: its static forwards (one-row chain steps in slot 0, and
    the rows that stood) must not take the rotary kernel's K/V fold, which writes at the rotary's position."""
    path = str(hf_and_gguf("glm4moe")[1])
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run([sys.executable, "-c", MTP, path], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
