"""Qwen3-Next in the engine: the recurrent state per slot under tiered experts, several sequences at once, slot
reuse and prefix reuse, drafts, static-shape (graph) decode steps and an out-of-memory retry. The oracle is the
same model run alone and fresh (itself checked against transformers in test_parity)."""

from __future__ import annotations

import pytest
import torch

from strata.config import EngineConfig, ExpertConfig
from strata.engine.engine import Engine, Sequence
from strata.engine.loader import forward_all, load_model
from strata.engine.request import Request
from strata.engine.sampler import SamplingParams

GREEDY = SamplingParams(temperature=0)


def _prompt(n, seed):
    return torch.randint(0, 1001, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def path(hf_and_gguf):
    return hf_and_gguf("qwen3next")[1]


@pytest.fixture(scope="module")
def lm(path):
    return load_model(str(path), EngineConfig(device="cpu", dtype="float32", ctx_size=1024), with_tokenizer=False)


def _alone(lm, prompt, n=12, **kw):
    return list(Engine(lm, n_slots=1, prefill_chunk=kw.pop("chunk", 6), **kw).generate(prompt, GREEDY, n))


def _run_all(eng: Engine, seqs: list[Sequence], join_at: dict[int, int] | None = None) -> list[list[int]]:
    """Step the engine until every sequence is done; seqs[i] joins at step join_at[i] (default 0)."""
    join_at = join_at or {}
    step = 0
    while not all(s.finished for s in seqs):
        for i, s in enumerate(seqs):
            if join_at.get(i, 0) == step and s.slot < 0:
                eng.add(s)
        eng.step()
        step += 1
    return [s.output for s in seqs]


def _seq(prompt, n=12, **kw):
    return Sequence.of(Request(prompt, GREEDY, n, set(), **kw))


def test_cache_holds_attention_layers_and_state_per_slot(lm):
    m = lm.model
    assert m.attn_layers == [1, 3] and m.recurrent_layers == [0, 2]
    kv = m.new_kv_cache(3, 64)
    assert kv.n_layers == 2 and kv.recurrent.ssm[0].shape == (3, 4, 12, 20)  # [slots, Hv, Dk, Dv]
    assert kv.recurrent.conv[2].shape == (3, 3, 2 * 2 * 12 + 4 * 20)  # [slots, K-1, conv channels]
    assert m.kv_bytes_per_token() == 2 * 2 * (2 * 24) * 4  # attention layers x (K + V) x heads x dim x float32


@pytest.mark.parametrize("slots,plan", [(0, "012"), (0, "000"), (3, "011")])
def test_tiered_experts_equal_resident(path, lm, slots, plan):
    ids = _prompt(30, seed=4)
    tiered = load_model(str(path), EngineConfig(device="cpu", dtype="float32", ctx_size=1024, experts=ExpertConfig(
        mode="tiered", slots=slots, cpu_plan=plan)), with_tokenizer=False)
    assert (forward_all(tiered, ids) - forward_all(lm, ids)).abs().max().item() <= 1e-5
    assert _alone(tiered, ids) == _alone(lm, ids)


def test_two_slots_at_once_equal_each_alone(lm):
    a, b = _prompt(17, seed=5), _prompt(11, seed=6)
    want = [_alone(lm, a), _alone(lm, b)]
    # b joins while a is still reading its prompt, then both decode in one step (mixed steps, batched decode)
    assert _run_all(Engine(lm, n_slots=2, prefill_chunk=6), [_seq(a), _seq(b)], {1: 1}) == want
    assert _run_all(Engine(lm, n_slots=2, prefill_chunk=64), [_seq(b), _seq(a)]) == want[::-1]


def test_a_reused_slot_starts_from_a_fresh_state(lm):
    a, b = _prompt(20, seed=7), _prompt(9, seed=8)
    eng = Engine(lm, n_slots=1, prefill_chunk=6)
    list(eng.generate(a, GREEDY, 8))
    assert list(eng.generate(b, GREEDY, 12)) == _alone(lm, b)


def test_prefix_reuse_only_from_a_whole_slot(lm):
    a = _prompt(20, seed=9)
    eng = Engine(lm, n_slots=1, prefill_chunk=6)
    out = list(eng.generate(a, GREEDY, 8))
    # a follow-up turn: everything the slot absorbed (the prompt, the replies but the last) and more
    turn2 = a + out + _prompt(5, seed=10)
    got = list(eng.generate(turn2, GREEDY, 10))
    assert eng.last.cached == len(a) + len(out) - 1  # the state at the end of the slot's tokens is reused
    assert got == _alone(lm, turn2, 10)
    # a prompt sharing only part of the slot: the state at that point is gone, so nothing is reused
    branch = turn2[:15] + _prompt(6, seed=11)
    got = list(eng.generate(branch, GREEDY, 10))
    assert eng.last.cached == 0
    assert got == _alone(lm, branch, 10)


def test_no_prefix_reuse_after_the_slot_changed_behind_the_engine(lm):
    a = _prompt(20, seed=12)
    eng = Engine(lm, n_slots=1, prefill_chunk=6)
    list(eng.generate(a, GREEDY, 4))
    other = _prompt(30, seed=13)
    eng.slot_tokens[0] = list(other[:20])  # as a conversation cache restoring another prompt's KV rows does
    got = list(eng.generate(other, GREEDY, 10))
    assert eng.last.cached == 0 and got == _alone(lm, other, 10)


class _KnownDrafter:
    """Drafts that are partly right: the first `right` of each draft are the tokens greedy decoding gives (known
    from a plain run), the rest wrong, `right` cycling through 0..room. (Random weights seldom repeat their
    context, so the n-gram drafter would propose nothing here.)"""

    def __init__(self, want: list[int]):
        self.want, self.output, self.calls = want, [], 0

    def sync(self, prompt, output):
        self.output = output

    def draft(self, room: int) -> list[int]:
        self.calls += 1
        at, right = len(self.output), self.calls % (room + 1)
        good = self.want[at : at + right]
        return good + [(t + 1) % 1001 for t in self.want[at + len(good) : at + room]]


def _drafted(prompt, want, n):
    s = _seq(prompt, n=n, draft_max=4)
    s.drafter = _KnownDrafter(want)
    return s


def test_conversation_cache_keeps_the_state_with_the_rows(lm):
    """The RAM conversation cache on a recurrent model: a conversation pushed out of its slot by another keeps
    its KV rows and the state after its last token; its next turn (the whole conversation so far, then more)
    gets both back and reads only the new tokens, with the tokens of a cold run."""
    from strata.server.prompt_cache import PromptCache

    eng, cache = Engine(lm, n_slots=1, prefill_chunk=6), PromptCache(64)
    a, b = _prompt(20, seed=20), _prompt(20, seed=21)

    def run(p, n=4):
        s = _seq(p, n=n)
        cache.prepare(eng, s.prompt)
        out = _run_all(eng, [s])[0]
        assert out == _alone(lm, p, n)
        return s

    run(a)
    held = list(eng.slot_tokens[0])  # a and the replies the state absorbed (all but the last)
    assert len(held) == 23
    run(b)  # a goes to RAM, rows and state
    assert cache.saves == 1 and next(iter(cache.entries.values())).state is not None
    turn = run(held + _prompt(5, seed=22), n=6)
    assert cache.restores == 1 and turn.cached == len(held)
    # a prompt that leaves the conversation part-way cannot use the state: no restore, computed cold
    run(b)
    part = run(held[:15] + _prompt(5, seed=23))
    assert cache.restores == 1 and part.cached == 0


def test_conversation_cache_skips_a_slot_whose_state_is_not_its_tokens(lm):
    """A slot changed behind the engine (its state no longer that of its tokens) is not saved."""
    from strata.server.prompt_cache import PromptCache

    eng, cache = Engine(lm, n_slots=1, prefill_chunk=6), PromptCache(64)
    list(eng.generate(_prompt(20, seed=24), GREEDY, 4))
    eng.slot_tokens[0] = list(_prompt(20, seed=25))
    s = _seq(_prompt(20, seed=26), n=2)
    cache.prepare(eng, s.prompt)
    assert cache.saves == 0 and not cache.entries


def test_drafts_give_plain_greedy_tokens(lm):
    """Verify steps fold drafts into the state; the rejected ones must be taken back exactly."""
    a, b = _prompt(20, seed=14), _prompt(9, seed=18)
    want_a, want_b = _alone(lm, a, 24), _alone(lm, b, 24)
    s = _drafted(a, want_a, 24)
    assert _run_all(Engine(lm, n_slots=1, prefill_chunk=64), [s]) == [want_a]
    assert s.draft_steps > 2 and 0 < s.draft_accepted < s.draft_n  # some drafts stood, some were taken back
    # beside a sequence without drafts (and one reading its prompt), in the same steps
    s = _drafted(a, want_a, 24)
    assert _run_all(Engine(lm, n_slots=2, prefill_chunk=5), [s, _seq(b, n=24)], {1: 6}) == [want_a, want_b]
    assert 0 < s.draft_accepted < s.draft_n


def test_static_decode_steps_equal_eager(path, lm):
    cfg = EngineConfig(device="cpu", dtype="float32", ctx_size=1024, cuda_graphs=True, n_slots=2)
    glm = load_model(str(path), cfg, with_tokenizer=False)
    eng = Engine(glm, n_slots=2, prefill_chunk=6)
    assert eng.graphs is not None and eng.graph_batch == 2
    a, b = _prompt(13, seed=15), _prompt(8, seed=16)
    assert _run_all(eng, [_seq(a), _seq(b)]) == [_alone(lm, a), _alone(lm, b)]


def test_out_of_memory_mid_chunk_takes_the_state_back(lm, monkeypatch):
    prompt = _prompt(403, seed=17)
    ref = Engine(lm, n_slots=1, prefill_chunk=400)
    want = list(ref.generate(prompt, GREEDY, 1))
    eng = Engine(lm, n_slots=1, prefill_chunk=400)
    last = lm.model.blocks[-1]
    inner, failed = last.attn, []

    def attn(x, pos, segments, kv):
        # the second chunk runs out of memory once, after the recurrent layers before this one folded it in
        if segments[0].start > 0 and not failed:
            failed.append(segments[0].start)
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return inner(x, pos, segments, kv)

    monkeypatch.setattr(last, "attn", attn)
    assert list(eng.generate(prompt, GREEDY, 1)) == want
    assert failed == [400] and eng.prefill_chunk == 200
    for i in lm.model.recurrent_layers:  # the state of the prompt, as a run without the failure leaves it
        assert torch.allclose(eng.kv.recurrent.ssm[i][0], ref.kv.recurrent.ssm[i][0], atol=1e-6)
        assert torch.equal(eng.kv.recurrent.conv[i][0], ref.kv.recurrent.conv[i][0])


@pytest.mark.gpu
def test_cuda_graphs_equal_cpu_eager(path, lm):
    """Captured decode steps (the warm-up's steps taken back from the state) give the CPU's eager tokens."""
    cfg = EngineConfig(device="cuda", dtype="float32", ctx_size=1024, cuda_graphs=True, n_slots=2)
    eng = Engine(load_model(str(path), cfg, with_tokenizer=False), n_slots=2, prefill_chunk=6)
    a, b = _prompt(13, seed=15), _prompt(8, seed=16)
    assert _run_all(eng, [_seq(a), _seq(b)]) == [_alone(lm, a), _alone(lm, b)]
    assert eng.graphs is not None and eng.graphs.graphs  # captured, not fallen back to eager


def _legacy(src, dst, hk=2, dk=12, r=2, dv=20):
    """The file as older llama.cpp converters wrote it: one fused `ssm_in` per delta-net layer, interleaved per key
    head as transformers' in_proj_qkvz is ([q, k, v, z] x Hk), rows kept in their stored format."""
    import gguf
    import numpy as np

    rd = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(str(dst), rd.fields["general.architecture"].contents())
    for name, f in rd.fields.items():
        if not name.startswith("GGUF.") and name != "general.architecture":
            vt = f.types[0]
            w.add_key_value(name, f.contents(), vt, sub_type=f.types[-1] if vt == gguf.GGUFValueType.ARRAY else None)
    tensors = {t.name: t for t in rd.tensors}

    def rows(t):
        a = np.asarray(t.data)
        return a.reshape(int(t.shape[-1]), -1) if t.tensor_type != gguf.GGMLQuantizationType.F32 else a

    for name, t in tensors.items():
        if name.endswith("attn_gate.weight"):
            continue
        if name.endswith("attn_qkv.weight"):
            qkv, z = rows(t), rows(tensors[name.replace("attn_qkv", "attn_gate")])
            q, k, v = np.split(qkv, [hk * dk, 2 * hk * dk])
            per = [np.concatenate([q[h * dk:(h + 1) * dk], k[h * dk:(h + 1) * dk], v[h * r * dv:(h + 1) * r * dv],
                                   z[h * r * dv:(h + 1) * r * dv]]) for h in range(hk)]
            w.add_tensor(name.replace("attn_qkv", "ssm_in"), np.concatenate(per), raw_dtype=t.tensor_type)
            continue
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        data = np.asarray(t.data)
        if t.tensor_type == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, np.ascontiguousarray(data).reshape(shape))
        else:
            w.add_tensor(name, np.ascontiguousarray(data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_legacy_layout_equals_current(hf_and_gguf, tmp_path):
    # in Q8_0, so that the fused projection's rows are reordered as stored blocks. (No closeness to float32 is
    # asserted: the random-weight model, like transformers' own, amplifies small perturbations along the sequence)
    _, q8 = hf_and_gguf("qwen3next", "q8_0")
    cfg = EngineConfig(device="cpu", dtype="float32", ctx_size=1024)
    ids = _prompt(40, seed=19)
    a = forward_all(load_model(str(q8), cfg, with_tokenizer=False), ids)
    assert torch.isfinite(a).all()
    old = _legacy(q8, tmp_path / "legacy.gguf")
    assert torch.equal(forward_all(load_model(str(old), cfg, with_tokenizer=False), ids), a)


def test_strata_check_counts_the_state_per_sequence(path, lm):
    """`strata check` sizes one sequence as its KV plus the recurrent state the engine allocates per slot."""
    from strata.hub.check import model_footprint

    fp = model_footprint([path])
    eng = Engine(lm, n_slots=2)
    assert fp.state_bytes_per_slot > 0 and fp.state_bytes_per_slot == eng.kv.recurrent.nbytes // 2
    # check sizes the KV as a GPU holds it (bf16): the attention layers only
    assert fp.kv_bytes_per_token == lm.model.kv_bytes_per_token(torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["staged", "direct"])
def test_cuda_tiered_graphs_keep_their_captures(hf_and_gguf, mode):
    """Experts offloaded (2 slots a layer, misses staged or read in place) under captured decode steps: the tokens of
    the resident model on the same device, and the steps stay graphed (a capture failure would fall back to eager,
    as B2's profile run once did)."""
    q8 = hf_and_gguf("qwen3next", "q8_0")[1]
    a, b = _prompt(13, seed=15), _prompt(8, seed=16)

    def engine(**ex):
        cfg = EngineConfig(device="cuda", dtype="float32", ctx_size=1024, cuda_graphs=True, n_slots=2,
                           experts=ExpertConfig(**ex))
        return Engine(load_model(str(q8), cfg, with_tokenizer=False), n_slots=2, prefill_chunk=6)

    want = _run_all(engine(mode="resident"), [_seq(a), _seq(b)])
    eng = engine(mode="tiered", slots=2, cpu_plan="000", decode_misses=mode)
    assert _run_all(eng, [_seq(a), _seq(b)]) == want
    assert eng.graphs is not None and eng.graphs.graphs
    ex = eng.model.experts
    if ex.direct is not None:
        ex.direct.flush()
    assert ex.stats.pcie > 0 and ex.stats.cpu == 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_steps_launched_ahead_keep_the_state_of_what_the_slot_holds(path, lm, device):
    """Decode steps launched one ahead (strata.engine.ahead) fold their unread input token into the recurrent
    state; a sequence that stops at that token takes the state back. Against steps one at a time: the same text,
    the same reuse of the slot by a follow-up turn, the same state after each turn (a stop token and a length
    limit, the stop found while the step after it is in flight)."""
    def engine(ahead: bool) -> Engine:
        cfg = EngineConfig(device=device, dtype="float32", ctx_size=1024, cuda_graphs=True, decode_ahead=ahead)
        return Engine(load_model(str(path), cfg, with_tokenizer=False), n_slots=1, prefill_chunk=6)

    on, off = engine(True), engine(False)
    assert on.ahead is not None and off.ahead is None
    a = _prompt(20, seed=19)
    stop = _alone(lm, a, 12)[6]  # the sequence stops on its 7th token (or before, where it comes earlier)
    turns = [(a, {stop}, 12), (None, set(), 9), (None, set(), 10)]
    prev: list[int] = []
    for prompt, stops, n in turns:
        prompt = prompt if prompt is not None else prev + _prompt(5, seed=len(prev))
        outs = []
        for eng in (on, off):
            out = list(eng.generate(prompt, GREEDY, n, stop_ids=stops))
            outs.append((out, eng.last.cached, eng.slot_tokens[0][:]))
        assert outs[0] == outs[1]
        for i in lm.model.recurrent_layers:  # (graphed and eager steps may differ in the last bits on a GPU)
            assert torch.allclose(on.kv.recurrent.ssm[i][0], off.kv.recurrent.ssm[i][0], atol=1e-5)
            assert torch.allclose(on.kv.recurrent.conv[i][0], off.kv.recurrent.conv[i][0], atol=1e-6)
        prev = prompt + outs[0][0]
    assert on.ahead.launched > 0 and on.ahead.dropped > 0
    assert off.last.cached > 0  # the follow-up turns reused the slot


def test_two_sequences_ahead_one_stopping_keep_each_state(path, lm):
    """Two sequences decode in one step launched ahead; the first stops on a stop token while the step after it is
    in flight: it takes its state back, the other goes on. Texts and both slots' states as without the step
    ahead (and the first slot's state then serves a follow-up turn)."""
    def engine(ahead: bool) -> Engine:
        cfg = EngineConfig(device="cpu", dtype="float32", ctx_size=1024, cuda_graphs=True, decode_ahead=ahead,
                           n_slots=2)
        return Engine(load_model(str(path), cfg, with_tokenizer=False), n_slots=2, prefill_chunk=64)

    a, b = _prompt(14, seed=21), _prompt(9, seed=22)
    stop = _alone(lm, a, 12)[4]
    got = []
    for ahead in (True, False):
        eng = engine(ahead)
        seqs = [Sequence.of(Request(a, GREEDY, 12, {stop})), _seq(b, n=16)]
        outs = _run_all(eng, seqs)
        states = {i: (eng.kv.recurrent.ssm[i].clone(), eng.kv.recurrent.conv[i].clone())
                  for i in lm.model.recurrent_layers}
        follow = a + outs[0] + _prompt(4, seed=23)
        more = list(eng.generate(follow, GREEDY, 6))
        got.append((outs, states, more, eng.last.cached, (eng.ahead.launched, eng.ahead.dropped) if eng.ahead else 0))
    (o1, s1, m1, c1, (launched, dropped)), (o2, s2, m2, c2, _) = got
    assert launched > 0 and dropped > 0 and len(o1[0]) < 12 and c2 > 0
    assert o1 == o2 and m1 == m2 and c1 == c2
    for i in lm.model.recurrent_layers:
        assert torch.allclose(s1[i][0], s2[i][0], atol=1e-5) and torch.allclose(s1[i][1], s2[i][1], atol=1e-6)
