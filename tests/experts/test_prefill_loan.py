"""The VRAM a prompt chunk's activations take, lent to the expert cache between prompts (`--prefill-loan`): more rows
at the end of each slot pool, released to the device while a prompt runs and mapped again for decoding
(strata.experts.releasable). Against the resident oracle over two prompts (the second releases rows the first
prompt's decode refilled). On the CPU a released row is overwritten with bytes that make NaNs, so a read of one
while it is out (a map row left pointing there, a copy landing late) changes the text."""

from __future__ import annotations

import pytest
import torch

from strata.engine.sampler import SamplingParams
from strata.experts import loan, releasable
from tests.experts.test_chunk_loan import A, B, _texts
from tests.experts.test_tiered_direct import _engine
from tests.experts.tiered_model import Q, write_moe_gguf


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_moe_gguf(tmp_path_factory.mktemp("prefill_loan") / "moe.gguf", n_experts=8, k=2,
                          expert_type=Q.Q8_0)


@pytest.fixture(scope="module")
def reference(model_path):
    return _texts(_engine(model_path, "cpu", False, mode="resident"))


@pytest.fixture
def chunked_on_cpu(monkeypatch):
    import strata.experts.tiered_eager as tiered_eager

    monkeypatch.setattr(tiered_eager, "GROUPED_CHUNKS_ON_CPU", True)  # the chunk path as a GPU runs it
    monkeypatch.setenv("STRATA_CHUNK_STAGE_MIB", "0.05")  # ~8 of these experts a chunk buffer
    monkeypatch.setattr(loan, "CPU_ACT_SLOTS", 2)  # as a GPU lends its activations' VRAM


@pytest.mark.parametrize("misses", ["handoff", "staged"])
def test_lent_activation_rows_keep_the_text(model_path, reference, chunked_on_cpu, misses):
    eng = _engine(model_path, "cpu", True, slots=1, cpu_plan="000", decode_misses=misses, chunk_loan="on",
                  prefill_loan="on")
    ex = eng.model.experts
    sp = SamplingParams(temperature=0)
    a = list(eng.generate(A, sp, 24))
    cache = ex.cache
    first = cache.layer_ids[0]
    assert cache.act_slots[first] == 2 and cache.lent and ex.loans == 1
    chunk_share = cache.loan_slots[first] - 2
    assert all(ex.policy.capacity(li) == 1 + chunk_share + 2 for li in range(len(cache.layer_ids)))
    pool = cache.pool_of[first]
    assert pool.releasable and all(not r.released for r in pool.releasable)  # mapped again for decoding
    # the decode refilled the activations' rows: some expert sits in one of the layers' last two slots
    last = 1 + chunk_share
    assert any(s >= last for li in range(len(cache.layer_ids)) for s in ex.policy.resident(li).values())
    b = list(eng.generate(B, sp, 24))
    assert ex.loans == 2 and cache.lent
    assert [a, b] == reference


def test_a_prompt_releases_the_rows_and_their_experts(model_path, chunked_on_cpu):
    """While a prompt's chunks run the rows are out: no expert is mapped there and their bytes are the poison."""
    eng = _engine(model_path, "cpu", True, slots=1, cpu_plan="000", chunk_loan="on", prefill_loan="on")
    list(eng.generate(A, SamplingParams(temperature=0), 12))
    seen = []

    def spy(t, ctx, inner=loan.loan_turn):
        inner(t, ctx)
        if not t.cache.lent:  # borrowed: the chunk runs now
            pool = t.cache.pool_of[t.cache.layer_ids[0]]
            seen.append((all(r.released for r in pool.releasable),
                         bool((pool.gate.raw[pool.act_base:] == releasable.POISON).all()),
                         int((t.cache.map >= pool.act_base).sum())))

    import strata.experts.tiered as tiered

    orig = tiered.loan_turn
    tiered.loan_turn = spy
    try:
        list(eng.generate(B, SamplingParams(temperature=0), 4))
    finally:
        tiered.loan_turn = orig
    assert seen and seen[0] == (True, True, 0)


def test_a_decode_step_out_of_memory_takes_the_lent_activations_back(model_path, reference, chunked_on_cpu,
                                                                     monkeypatch, caplog):
    """A decode step that runs out of VRAM beside the lent activations: their rows' experts are evicted, the VRAM
    goes back to the device for good, the step runs again and the text is the resident one; later prompts keep
    the rows out of the cache (before: the request failed with an out-of-memory error)."""
    eng = _engine(model_path, "cpu", False, slots=1, cpu_plan="000", chunk_loan="on", prefill_loan="on")
    ex, sp = eng.model.experts, SamplingParams(temperature=0)
    a = list(eng.generate(A, sp, 24))
    cache = ex.cache
    first = cache.layer_ids[0]
    assert cache.lent and cache.act_slots[first] == 2
    inner, failed = eng.model.forward, []

    def forward(t, p, segs, kv, **kw):  # B's third decode step runs out of memory once
        if eng.last is not None and len(eng.last.output) == 3 and segs[0].n == 1 and not failed:
            failed.append(True)
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return inner(t, p, segs, kv, **kw)

    monkeypatch.setattr(eng.model, "forward", forward)
    with caplog.at_level("WARNING", logger="strata"):
        b = list(eng.generate(B, sp, 24))
    assert failed and "in a decode step" in caplog.text
    assert [a, b] == reference
    pool = cache.pool_of[first]
    assert all(r.released for r in pool.releasable) and int((cache.map >= pool.act_base).sum()) == 0
    chunk_share = cache.loan_slots[first] - 2
    assert all(ex.policy.capacity(li) == 1 + chunk_share for li in range(len(cache.layer_ids)))
    assert list(eng.generate(A, sp, 24)) == a  # the next prompt: the rows stay out, the text the same
    assert all(r.released for r in pool.releasable) and cache.lent


def test_off_and_auto_on_the_cpu_lend_nothing(model_path, chunked_on_cpu):
    for how in ("off", "auto"):
        eng = _engine(model_path, "cpu", True, slots=1, cpu_plan="000", chunk_loan="on", prefill_loan=how)
        list(eng.generate(A, SamplingParams(temperature=0), 2))
        cache = eng.model.experts.cache
        assert not any(cache.act_slots.values()) and not any(p.releasable for p in cache.pools)


def test_no_layer_gets_more_slots_than_experts(model_path, chunked_on_cpu, monkeypatch):
    """A large lent VRAM (a small model's) is cut to the experts a layer has; the pool holds no unused rows."""
    monkeypatch.setattr(loan, "CPU_ACT_SLOTS", 100)
    eng = _engine(model_path, "cpu", True, slots=1, cpu_plan="000", chunk_loan="on", prefill_loan="on")
    list(eng.generate(A, SamplingParams(temperature=0), 2))
    cache = eng.model.experts.cache
    first = cache.layer_ids[0]
    assert 1 + cache.loan_slots[first] == 8 and cache.act_slots[first] > 0
    pool = cache.pool_of[first]
    assert pool.gate.raw.shape[0] - pool.act_base == cache.act_slots[first] * len(cache.layer_ids)


def test_needs_the_chunk_buffers_loan(model_path, chunked_on_cpu):
    eng = _engine(model_path, "cpu", True, slots=1, cpu_plan="000", chunk_loan="off", prefill_loan="on")
    list(eng.generate(A, SamplingParams(temperature=0), 2))
    assert not any(eng.model.experts.cache.act_slots.values())


def test_the_split_shows_the_lent_slots():
    from dataclasses import replace

    from strata.experts.sizing import GiB, MiB, split_budget

    s = split_budget(8 * GiB, context=GiB, dense=GiB, reserve=700 * MiB, staging=0, prefill=GiB,
                     expert_bytes=2 * MiB, per_slot=96 * MiB, n_experts=128)
    lent = replace(s, lent_slots=11)
    assert "slots per layer (+11 lent between prompts: " in lent.render() and lent.as_dict()["lent_slots"] == 11
    per = s.cache // s.slots  # one slot in every layer
    assert per == 96 * MiB
    assert (f"{s.slots + 11} a layer, {(s.cache + 11 * per) / GiB:.2f} GiB of experts while decoding)"
            in lent.render())
    assert "lent" not in s.render()
    # as the cache lays the loans out: the chunk buffers' share, and the activations' VRAM with the prefill loan
    from strata.experts.sizing import lent_slots

    chunk = 2 * s.chunk_experts // 48
    assert lent_slots(s, 48, 96 * MiB, prefill_loan=False) == chunk
    assert lent_slots(s, 48, 96 * MiB, prefill_loan=True) == chunk + GiB // (96 * MiB)


def test_a_releasable_buffer_on_the_cpu():
    r = releasable.Releasable((6, 2, 8), torch.device("cpu"), 4)
    r.raw.fill_(7)
    assert r.lendable() == 2 * 16 and r.release() == 32 and r.release() == 0
    assert (r.raw[:4] == 7).all() and (r.raw[4:] == releasable.POISON).all()
    assert r.restore() == 32 and not r.released and r.restore() == 0


@pytest.mark.gpu
def test_cuda_device_range_gives_memory_back_and_maps_it_again():
    if not releasable.available():
        pytest.skip("needs CUDA and its driver")
    dev = torch.device("cuda", torch.cuda.current_device())
    assert releasable.probe(dev) is None  # (what the engine asks before it lends)
    piece = releasable.PIECE
    r = releasable.Releasable((16, piece // 4), dev, 4)  # 4 pieces, the last 3 lendable
    r.raw.copy_(torch.arange(16, device=dev, dtype=torch.uint8)[:, None].expand(16, piece // 4))
    assert r.lendable() == 3 * piece
    torch.cuda.empty_cache()
    free0 = torch.cuda.mem_get_info(dev)[0]
    assert r.release() == 3 * piece
    assert torch.cuda.mem_get_info(dev)[0] - free0 >= 3 * piece
    assert (r.raw[:4] == torch.arange(4, device=dev, dtype=torch.uint8)[:, None]).all()  # kept rows intact
    x = torch.ones(3 * piece // 4, dtype=torch.float32, device=dev)  # the released memory, as torch's
    del x
    torch.cuda.empty_cache()
    assert r.restore() == 3 * piece
    r.raw[4:].fill_(9)
    torch.cuda.synchronize()
    assert (r.raw[4:] == 9).all() and (r.raw[:4, 0] == torch.arange(4, device=dev, dtype=torch.uint8)).all()


@pytest.mark.gpu
@pytest.mark.parametrize("misses", ["handoff", "staged"])
def test_cuda_lent_activation_rows_keep_the_text(model_path, monkeypatch, misses):
    if not releasable.available():
        pytest.skip("needs CUDA and its driver")
    monkeypatch.setenv("STRATA_CHUNK_STAGE_MIB", "0.05")
    ref = _texts(_engine(model_path, "cuda", True, mode="resident"))
    eng = _engine(model_path, "cuda", True, slots=1, cpu_plan="000", decode_misses=misses, chunk_loan="on",
                  prefill_loan="on")
    assert _texts(eng) == ref
    ex = eng.model.experts
    assert ex.loans == 2 and any(ex.cache.act_slots.values())
    assert all(not r.released for p in ex.cache.pools for r in p.releasable)
