"""Pipeline parallel (strata.engine.pipeline): the layers split over 2 and 3 real processes talking gloo over
loopback give exactly the single process's logits and greedy tokens, for every family, resident and tiered; the
split is checked; a stage that dies is an error on the driver, not a hang."""

from __future__ import annotations

import pytest
import torch

from strata import StrataError
from strata.config import EngineConfig, ExpertConfig
from strata.engine.engine import Engine
from strata.engine.loader import load_model
from strata.engine.pipeline import LocalPipeline, layer_split
from strata.engine.sampler import SamplingParams
from strata.kv.cache import Segment

GREEDY = SamplingParams(temperature=0)


def test_layer_split():
    assert layer_split(10, 3) == [range(0, 4), range(4, 7), range(7, 10)]
    assert layer_split(4, 1) == [range(0, 4)]
    assert layer_split(6, 2, "1,5") == [range(0, 1), range(1, 6)]
    for bad in ("1,4", "0,6", "a,b", "2,2,2"):
        with pytest.raises(StrataError, match="layer-split"):
            layer_split(6, 2, bad)
    with pytest.raises(StrataError, match="exceeds"):
        layer_split(2, 3)


def _logits(lm, ids):
    kv = lm.model.new_kv_cache(1, 256, torch.float32)
    pos = torch.arange(len(ids))
    with torch.inference_mode():
        return lm.model.forward(torch.tensor(ids), pos, [Segment(0, 0, len(ids))], kv, all_logits=True)


def _check(path, size, experts=None, split="auto", n=12):
    cfg = EngineConfig(model=str(path), device="cpu", dtype="float32", ctx_size=256,
                       experts=experts or ExpertConfig(), pipeline_parallel_size=size, layer_split=split,
                       draft_source="ngram")
    ids = torch.randint(3, 1000, (37,), generator=torch.Generator().manual_seed(size)).tolist()
    single = load_model(str(path), EngineConfig(**{**cfg.__dict__, "pipeline_parallel_size": 1}),
                        with_tokenizer=False)
    ref_logits = _logits(single, ids)
    ref = list(Engine(single, n_slots=1).generate(ids, GREEDY, n))
    pipe = LocalPipeline(str(path), cfg, n_slots=1)
    try:
        got = _logits(pipe.lm, ids)
        assert torch.equal(got, ref_logits), (got - ref_logits).abs().max()
        eng = Engine(pipe.lm, n_slots=1)
        # the driver computes its own layers only (so the others' did the rest) and keeps only their KV
        own = pipe.lm.model.inner.stage_layers
        assert own == frozenset(pipe.lm.model.stage.layers) and len(own) < single.args.n_layers
        assert sum(b is not None for b in eng.kv.k) < len(eng.kv.k)
        assert list(eng.generate(ids, GREEDY, n)) == ref
        assert list(eng.generate(ids[:20], GREEDY, 5)) == list(Engine(single, n_slots=1).generate(ids[:20], GREEDY, 5))
    finally:
        pipe.close()
    assert all(p.exitcode == 0 for p in pipe.procs), [p.exitcode for p in pipe.procs]


@pytest.mark.parametrize("family", ["qwen3moe", "llama", "deepseek_v3", "glm4moe", "gpt_oss", "qwen3next"])
def test_two_stages_equal_one_process(hf_and_gguf, family):
    _check(hf_and_gguf(family)[1], 2)


def test_three_stages_tiered_and_an_uneven_split(hf_and_gguf):
    path = hf_and_gguf("qwen3moe")[1]
    _check(path, 3, experts=ExpertConfig(mode="tiered", slots=1, cpu_plan="011"))


def test_a_stage_that_dies_is_an_error_not_a_hang(hf_and_gguf):
    path = hf_and_gguf("qwen3moe")[1]
    cfg = EngineConfig(model=str(path), device="cpu", dtype="float32", ctx_size=256, pipeline_parallel_size=2)
    pipe = LocalPipeline(str(path), cfg, n_slots=1)
    try:
        assert _logits(pipe.lm, [5, 6, 7]).shape[0] == 3
        pipe.procs[0].kill()
        pipe.procs[0].join()
        with pytest.raises(RuntimeError):
            _logits(pipe.lm, [5, 6, 7])
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def test_torchrun_starts_the_stages(tmp_path):
    """The same command under torchrun (one process per stage, its rank from the environment, a rendezvous on
    loopback as across machines): rank 0 prints the text of a single process, the other rank serves and exits."""
    import os
    import subprocess
    import sys

    from strata.engine.pipeline import free_port
    from strata.models.default import default_model_path

    torchrun = [sys.executable, "-m", "torch.distributed.run"]  # what the torchrun command runs
    model = str(default_model_path(warn=False))
    args = ["-m", "strata", "generate", "-m", model, "-p", "def fib(n):", "-n", "12", "--temperature", "0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, env=env)
    assert one.returncode == 0, one.stderr[-2000:]
    two = subprocess.run([*torchrun, "--nproc-per-node", "2", "--master-port", str(free_port()), *args],
                         capture_output=True, text=True, timeout=300, env=env)
    assert two.returncode == 0, two.stderr[-3000:]
    assert two.stdout == one.stdout and one.stdout.strip()
    assert "pipeline of 2 stages (stage 0: layers 0-3 on cpu, stage 1: layers 4-7 on cpu)" in two.stderr


def test_micro_batches_cut_by_tokens():
    from strata.engine.pipeline import micro_batches

    segs = [Segment(i, 0, n) for i, n in enumerate([1, 1, 1, 1])]
    assert micro_batches(segs, 2) == [(0, 2), (2, 4)]
    assert micro_batches(segs, 3) == [(0, 2), (2, 3), (3, 4)] or micro_batches(segs, 3) == [(0, 1), (1, 2), (2, 4)]
    assert micro_batches(segs, 8) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert micro_batches(segs[:1], 4) == [(0, 1)]
    mixed = [Segment(0, 0, 500), Segment(1, 9, 1), Segment(2, 7, 1)]
    runs = micro_batches(mixed, 2)
    assert runs[0] == (0, 1) and runs[-1][1] == 3 and len(runs) == 2


def test_several_sequences_in_micro_batches_equal_one_process(hf_and_gguf):
    """Three sequences decoding (and one prefilling) at once over 2 and 3 stages: each step is cut into
    micro-batches that stages compute at the same time; every text equals the single process's."""
    from strata.engine.engine import Sequence

    path = hf_and_gguf("qwen3moe")[1]
    prompts = [torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (9, 23, 15)]
    cfg = EngineConfig(model=str(path), device="cpu", dtype="float32", ctx_size=256, draft_source="ngram")
    single = Engine(load_model(str(path), cfg, with_tokenizer=False), n_slots=3)

    def run(eng):
        seqs = [Sequence(list(p), GREEDY, n, set()) for p, n in zip(prompts, (7, 12, 5))]
        for s in seqs:
            eng.add(s)
        while any(not s.finished for s in seqs):
            eng.step()
        return [s.output for s in seqs]

    ref = run(single)
    for size in (2, 3):
        pipe = LocalPipeline(str(path), EngineConfig(**{**cfg.__dict__, "pipeline_parallel_size": size}), n_slots=3)
        try:
            assert run(Engine(pipe.lm, n_slots=3)) == ref, size
        finally:
            pipe.close()
