"""Drafts from the model's own MTP block (glm4moe's nextn, `--draft-source mtp`): the block's math against a direct
torch computation of llama.cpp's GLM MTP graph from the same stored weights, and the engine's output against plain
decoding (the oracle: identical greedy text; sampled text the model's sampler allows), with several sequences,
tiered experts and a stop inside a draft. The tiny model's block has random weights: its drafts are mostly wrong,
which exercises the rollback; a test that forces right drafts checks they are taken."""

from __future__ import annotations

import pytest
import torch

from strata import StrataError
from strata.config import EngineConfig, ExpertConfig
from strata.engine.engine import Engine, Sequence
from strata.engine.loader import load_model
from strata.engine.sampler import SamplingParams
from strata.kv.cache import Segment

GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def path(hf_and_gguf):
    return hf_and_gguf("glm4moe")[1]


def _engine(path, draft_max=0, source="auto", n_slots=1, experts=None, graphs=None):
    cfg = EngineConfig(model=str(path), device="cpu", dtype="float32", ctx_size=256, draft_max=draft_max,
                       draft_source=source, experts=experts or ExpertConfig(), cuda_graphs=graphs)
    return Engine(load_model(str(path), cfg, with_tokenizer=False), n_slots=n_slots)


def _prompt(n, seed):
    return torch.randint(3, 900, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_block_math_is_llamacpps_graph(path):
    """eh_proj(concat(enorm(embed(t)), hnorm(h))) -> attention block -> MoE block -> shared head, written out in
    float32 from the GGUF's tensors (attention over the block's own cache; here two positions)."""
    eng = _engine(path, 3, "mtp")
    head, m = eng.mtp.head, eng.model
    h = torch.randn(2, m.args.d_model, generator=torch.Generator().manual_seed(0))
    toks, pos = torch.tensor([17, 5]), torch.tensor([0, 1])
    got, x_out = head.forward(h, toks, pos, Segment(0, 0, 2), head.new_kv_cache(1, 8))

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + m.args.norm_eps) * w

    e = head.embed.dequantize(torch.float32).reshape(head.embed.shape)[toks]
    eh = head.eh_proj.dequantize(torch.float32).reshape(head.eh_proj.shape)
    x = torch.cat([rms(e, head.enorm), rms(h, head.hnorm)], -1) @ eh.T
    x = x + head.attn(rms(x, head.attn_norm), pos, [Segment(0, 0, 2)], head.new_kv_cache(1, 8))
    x = x + head.moe(rms(x, head.ffn_norm), m.step_context([Segment(0, 0, 2)], 2))
    hd = head.head.dequantize(torch.float32).reshape(head.head.shape)
    want = rms(x, head.head_norm) @ hd.T
    assert torch.allclose(got, want, atol=1e-4) and torch.allclose(x_out, x, atol=1e-5)
    last, x_last = head.forward(h, toks, pos, Segment(0, 0, 2), head.new_kv_cache(1, 8), last_only=True)
    assert last.shape == (1, got.shape[1]) and torch.allclose(last[0], got[-1], atol=1e-4) and torch.equal(x_last, x_out)
    # the block's own tensors, not the trunk's last layer's
    assert head.eh_proj.shape == (m.args.d_model, 2 * m.args.d_model)


def test_the_blocks_tail_forward_is_its_last_row(path):
    """`tail`: the rows before the last write their K/V only (no query, no MoE); the last row's logits and output
    and every K/V row are the whole forward's, bit for bit on the CPU (each row of a decode-sized product is
    computed by itself), and the MoE sees the one row."""
    eng = _engine(path, 3, "mtp")
    head, m = eng.mtp.head, eng.model
    g = torch.Generator().manual_seed(3)
    h, toks = torch.randn(7, m.args.d_model, generator=g), torch.randint(3, 900, (7,), generator=g)
    whole, tail = head.new_kv_cache(1, 16), head.new_kv_cache(1, 16)
    rows, real = [], head.moe.__call__
    head.moe = type("Spy", (), {"__call__": lambda self, x, ctx: rows.append(x.shape[0]) or real(x, ctx)})()
    at = 0
    for n in (4, 3):  # a first segment, then one after it (its last query reads the rows the first wrote)
        pos, seg = torch.arange(at + 1, at + 1 + n), Segment(0, at, n)
        lw, xw = head.forward(h[at:at + n], toks[at:at + n], pos, seg, whole, last_only=True)
        lt, xt = head.forward(h[at:at + n], toks[at:at + n], pos, seg, tail, last_only=True, tail=True)
        assert xt.shape == (1, m.args.d_model) and torch.equal(xt[0], xw[-1]) and torch.equal(lt, lw)
        at += n
    assert rows == [4, 1, 3, 1]
    for kind in ("k", "v"):
        assert torch.equal(getattr(whole, kind)[0][0, :at], getattr(tail, kind)[0][0, :at]), kind


def test_greedy_text_is_the_same_with_mtp_drafts(path):
    prompt = _prompt(30, 1)
    ref = list(_engine(path).generate(prompt, GREEDY, 40))
    eng = _engine(path, 3, "mtp")
    assert eng.mtp is not None and eng.graphs is None
    out = list(eng.generate(prompt, GREEDY, 40))
    seq = eng.last
    assert out == ref
    assert seq.draft_steps > 0 and seq.draft_n > 0 and eng.mtp.runs > 0
    assert seq.draft_n >= seq.draft_accepted


def test_right_drafts_stand(path, monkeypatch):
    """Drafts equal to the greedy continuation are all taken (the verify step emits them and one more)."""
    prompt = _prompt(30, 2)
    ref = list(_engine(path).generate(prompt, GREEDY, 30))
    eng = _engine(path, 3, "mtp")
    real = eng.mtp.draft

    def known(s, room):
        got = real(s, room)  # (the block still runs: its KV stays written)
        at = len(s.output)
        return ref[at:at + len(got)] if got else []

    monkeypatch.setattr(eng.mtp, "draft", known)
    out = list(eng.generate(prompt, GREEDY, 30))
    seq = eng.last
    assert out == ref and seq.draft_accepted == seq.draft_n > 0
    assert seq.draft_steps < 30 / 2  # several tokens a step


def test_sampled_and_several_sequences_and_tiered(path):
    prompts = [_prompt(20, 3), _prompt(33, 4)]
    plain = _engine(path, n_slots=2)
    ref = [list(plain.generate(p, GREEDY, 20)) for p in prompts]
    eng = _engine(path, 4, "mtp", n_slots=2, experts=ExpertConfig(mode="tiered", slots=3, cpu_plan="0111"))
    seqs = [Sequence(list(p), GREEDY, 20, set()) for p in prompts]
    for s in seqs:
        eng.add(s)
    while any(not s.finished for s in seqs):
        eng.step()
    assert [s.output for s in seqs] == ref and all(s.draft_steps > 0 for s in seqs)
    # sampled: the same draws as without drafts (the verify step draws each position with the sequence's generator)
    sp = SamplingParams(temperature=0.9, top_k=1, seed=5)
    assert list(_engine(path, 3, "mtp").generate(prompts[0], sp, 20)) == ref[0]


@pytest.mark.parametrize("temperature", [0.8, 1.5])
def test_sampled_text_is_the_same_with_mtp_drafts(path, temperature):
    """Each token's draw is seeded by its position (sampler.position_uniform): with drafts, the rejected rows' draws
    shift nothing, so a seeded sampled run writes the plain run's text, token for token."""
    sp = SamplingParams(temperature=temperature, seed=11)
    for seed in (5, 6):
        prompt = _prompt(25, seed)
        ref = list(_engine(path).generate(prompt, sp, 30))
        eng = _engine(path, 3, "mtp")
        assert list(eng.generate(prompt, sp, 30)) == ref
        assert eng.last.draft_n > 0
    # and the seed matters: another seed writes another text
    assert list(_engine(path).generate(prompt, SamplingParams(temperature=temperature, seed=12), 30)) != ref


def test_sources(path, hf_and_gguf):
    assert _engine(path, 3).mtp is not None  # auto: the model has the block
    assert _engine(path, 3, "ngram").mtp is None
    assert _engine(path, 0, "mtp").mtp is None  # drafting off
    _, plain = hf_and_gguf("qwen3moe")
    with pytest.raises(StrataError, match="no multi-token-prediction block"):
        _engine(plain, 3, "mtp")


def test_p_min_ends_the_chain(path):
    """--draft-p-min: a draft the block rates below it ends the chain (1.0: no draft ever stands the floor)."""
    prompt = _prompt(30, 6)
    ref = list(_engine(path).generate(prompt, GREEDY, 16))
    cfg = EngineConfig(model=str(path), device="cpu", dtype="float32", ctx_size=256, draft_max=4,
                       draft_source="mtp", draft_p_min=1.0)
    eng = Engine(load_model(str(path), cfg, with_tokenizer=False), n_slots=1)
    assert list(eng.generate(prompt, GREEDY, 16)) == ref and eng.last.draft_n == 0 and eng.mtp.runs > 0


def test_mtp_drafts_through_the_static_path(path):
    """With graphs (here the static path run eagerly on the CPU) every step still feeds the block the trunk's
    hidden states (a graph output), verify steps go through the static path, and sequences that move to the
    lowest slots take their block's cache rows with them: the text equals plain decoding."""
    prompts = [_prompt(20, 3), _prompt(33, 4), _prompt(27, 5)]
    plain = _engine(path)
    refs = [list(plain.generate(p, GREEDY, n)) for p, n in zip(prompts, (6, 20, 14))]
    eng = _engine(path, 4, "mtp", n_slots=3, graphs=True)
    assert eng.graphs is not None and eng.mtp is not None and eng.graphs.want_hidden
    calls, real = [], eng.graphs.step_batch

    def spy(toks, starts, slots, T=1):
        calls.append((tuple(slots), T))
        return real(toks, starts, slots, T)

    eng.graphs.step_batch = spy
    seqs = [Sequence(list(p), GREEDY, n, set()) for p, n in zip(prompts, (6, 20, 14))]
    for s in seqs[:2]:
        eng.add(s)
    steps = 0
    while any(not s.finished for s in seqs):
        eng.step()
        steps += 1
        for s in seqs[:2]:
            if s.finished and s in eng.running:
                eng.release(s)  # slot 0 frees: the third sequence takes it, the second must move down
        if steps == 3:
            eng.add(seqs[2])
    assert [s.output for s in seqs] == refs
    assert all(s.draft_steps > 0 for s in seqs[1:])
    # alone, a sequence's verify steps are static ones (several sequences verify eagerly unless their drafts are
    # equally long)
    assert list(eng.generate(prompts[1], GREEDY, 20)) == refs[1]
    assert any(T > 1 for _, T in calls)


def test_a_moved_sequence_takes_its_block_cache_rows(path):
    from strata.engine.slots import _exchange

    eng = _engine(path, 4, "mtp", n_slots=3, graphs=True)
    s = Sequence(_prompt(20, 3), GREEDY, 8, set())
    eng.add(s)
    while not s.output:
        eng.step()
    a, b = s.slot, 2
    rows = eng.mtp.kv.k[0][a, :s.pos + 1].clone()
    trunk = eng.kv.k[0][a, :s.pos].clone()
    assert rows.abs().sum() > 0
    _exchange(eng, a, b, {x.slot: x for x in eng.running})
    assert s.slot == b and b not in eng.free_slots and a in eng.free_slots
    assert torch.equal(eng.mtp.kv.k[0][b, :s.pos + 1], rows) and torch.equal(eng.kv.k[0][b, :s.pos], trunk)


def test_the_blocks_cache_has_no_unwritten_row_below_its_last(path):
    """The pair (h[i], token i + 1) sits at rotary position i + 1 in row i: after the prompt the block's rows 0 ..
    P - 1 are written, and nothing past them (a row left unwritten below would be attended as a zero key)."""
    eng = _engine(path, 3, "mtp")
    prompt = _prompt(20, 3)
    s = Sequence(list(prompt), GREEDY, 2, set())
    eng.add(s)
    while not s.output:
        eng.step()
    rows = eng.mtp.kv.k[0][s.slot].abs().flatten(1).sum(-1)
    assert bool((rows[:len(prompt)] > 0).all()) and not bool(rows[len(prompt):].any())


@pytest.mark.parametrize("misses", ["handoff", "direct"])
def test_the_blocks_experts_go_through_the_tiers(path, misses):
    """With tiered experts the MTP block's experts are one more layer of the trunk's backend (its store, its VRAM
    cache, its counts), not a resident copy outside the budget; the text is still plain decoding's."""
    from strata.experts.resident import ResidentExperts

    prompt = _prompt(30, 1)
    ref = list(_engine(path).generate(prompt, GREEDY, 24))
    ex = ExpertConfig(mode="tiered", slots=2, cpu_plan="0111", decode_misses=misses)
    eng = _engine(path, 3, "mtp", experts=ex, graphs=True)
    backend = eng.model.experts
    layer = eng.model.nextn[0].layer
    assert layer in backend.index and eng.mtp.head.moe.experts is backend
    assert not isinstance(eng.mtp.head.moe.experts, ResidentExperts)
    assert list(eng.generate(prompt, GREEDY, 24)) == ref
    assert eng.last.draft_steps > 0
    if backend.direct is not None:
        backend.direct.flush()
    s = backend.stats
    assert s.hits + s.cpu + s.pcie == s.lookups  # (the block's lookups counted with the trunk's)


def _drafts_of(eng, prompt, n):
    """(the text, every draft list the block made) of a greedy generation."""
    made, real = [], eng.mtp.draft

    def spy(s, room):
        d = real(s, room)
        made.append(list(d))
        return d

    eng.mtp.draft = spy
    return list(eng.generate(prompt, GREEDY, n)), made


@pytest.mark.parametrize("p_min", [0.0, 0.003])  # (the tiny random block's top-1: ~0.002-0.006)
def test_the_blocks_static_path_drafts_as_its_eager_one(path, p_min):
    """The block's small forwards through static buffers (strata.engine.mtp_graphs: replayed graphs on a GPU, run
    eagerly here), its cache read over a window masked past each row, make the eager path's drafts: the rows
    that stood, and a chain of drafts computed whole on the device with their probabilities (the --draft-p-min
    cut made after it)."""
    prompt = _prompt(40, 7)

    def eng(graphs):
        cfg = EngineConfig(model=str(path), device="cpu", dtype="float32", ctx_size=256, draft_max=3,
                           draft_source="mtp", cuda_graphs=graphs, draft_p_min=p_min)
        e = Engine(load_model(str(path), cfg, with_tokenizer=False), n_slots=1)
        # which steps draft is the drafters' own adaptation, not the timed costs: the two engines' step times differ,
        # and at an acceptance near where drafts start to pay they would choose differently
        e.draft_cost = None
        return e

    eager = eng(False)
    assert eager.mtp.graphs is None
    static = eng(True)
    g = static.mtp.graphs
    assert g is not None and g.max_rows == 4
    static.device_drafts = None  # (the host's path with the static forwards; the device's: the test below)
    calls, chains, real, real_chain = [], [], g.forward, g.chain
    g.forward = lambda h, t, start, slot: calls.append(h.shape[0]) or real(h, t, start, slot)
    g.chain = lambda lg, h, p, slot, m: chains.append(m) or real_chain(lg, h, p, slot, m)
    text, drafts = _drafts_of(static, prompt, 30)
    assert (text, drafts) == _drafts_of(eager, prompt, 30)
    assert calls and max(calls) <= 4                         # verify rows (the prompt: eagerly)
    assert chains and max(chains) <= 3
    assert sum(len(d) for d in drafts) > 0
    if p_min:  # some chains were cut after the device computed them whole
        assert sum(len(d) for d in drafts) < sum(chains)
    else:  # the rows the block wrote: the same keys (rotary at each row's own position) and values
        for kind in ("k", "v"):
            a, b = getattr(static.mtp.kv, kind)[0][0], getattr(eager.mtp.kv, kind)[0][0]
            assert a.abs().sum() > 0 and torch.allclose(a, b, atol=1e-5, rtol=1e-4), kind


@pytest.mark.gpu
def test_cuda_mtp_block_graphed_keeps_the_text(path):
    """On a GPU the block's forwards are captured (resident experts) and replayed, a greedy sequence's whole drafted
    step as one graph; the greedy text is plain decoding's."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")

    def eng(draft_max, source="auto"):
        cfg = EngineConfig(model=str(path), device="cuda", dtype="float32", ctx_size=256, draft_max=draft_max,
                           draft_source=source, cuda_graphs=True)  # (the block's graphs before GRAPHS_GPU_TESTED)
        return Engine(load_model(str(path), cfg, with_tokenizer=False), n_slots=1)

    prompt = _prompt(40, 7)
    ref = list(eng(0).generate(prompt, GREEDY, 40))
    e = eng(3, "mtp")
    assert e.mtp.graphs is not None and e.mtp.graphs.cuda
    # greedy: the whole drafted step as one captured graph (strata.engine.spec_device)
    assert list(e.generate(prompt, GREEDY, 40)) == ref
    assert e.device_drafts is not None and e.device_drafts.steps > 0 and e.device_drafts.graphs
    # sampled: the device's step too, its rows drawn in the graph (the text is not compared: a verify step's logits
    # may differ from a one-token step's in the last bits on a GPU, which a draw can tell; docs/BENCHMARKS.md
    # "Speculative decoding")
    before = e.device_drafts.steps
    got = list(e.generate(prompt, SamplingParams(temperature=0.8, seed=4), 40))
    assert len(got) == 40 and e.device_drafts.steps > before and len(e.device_drafts.graphs) >= 2


@pytest.mark.parametrize("draft_max", [1, 3])
def test_a_greedy_sequences_drafted_steps_on_the_device(path, draft_max):
    """One greedy sequence's whole drafted step (verify, accept, the block over what stood, the next chain) on the
    device's buffers (strata.engine.spec_device; run eagerly here): plain decoding's text, the same drafts stood as
    on the host's path, stops and max_tokens inside a step, and the host's path takes over where it leaves off
    (a second sequence joining) with the block's last prediction."""
    prompts = [_prompt(40, 7), _prompt(25, 8)]
    plain = _engine(path)
    refs = [list(plain.generate(p, GREEDY, 30)) for p in prompts]
    eng = _engine(path, draft_max, "mtp", graphs=True)
    dd = eng.device_drafts
    assert dd is not None and dd.m == draft_max
    got = list(eng.generate(prompts[0], GREEDY, 30))
    assert got == refs[0] and dd.steps > 0
    assert eng.last.draft_n == dd.steps * draft_max   # (the tiny model's random block: none of them stand)
    # a stop token inside an accepted run, and max_tokens: the text stops where plain decoding's does
    stop = refs[0][1]  # a stop inside the text (the tiny model's greedy text soon repeats one token)
    assert list(eng.generate(prompts[0], GREEDY, 30, {stop})) == refs[0][:refs[0].index(stop) + 1]
    # a client gone while a step is in flight: that step's tokens are dropped, none reach the sequence
    s = Sequence(list(prompts[0]), GREEDY, 30, set())
    eng.add(s)
    while dd.pending is None:
        eng.step()
    n = len(s.output)
    eng.release(s, "abort")
    assert eng.step() == [] and dd.dropped >= 1 and len(s.output) == n and dd.pending is None
    assert list(eng.generate(prompts[0], GREEDY, 17)) == refs[0][:17]
    dd.ahead = False  # each step read before the next is launched: the same text
    assert list(eng.generate(prompts[0], GREEDY, 30)) == refs[0] and dd.pending is None
    # two sequences: the second joins mid-way (the host's path for both from then on), each text plain's
    a, b = (Sequence(list(p), GREEDY, 30, set()) for p in prompts)
    eng2 = _engine(path, draft_max, "mtp", graphs=True, n_slots=2)
    eng2.add(a)
    steps = 0
    while not (a.finished and b.finished):
        eng2.step()
        steps += 1
        if steps == 6:
            eng2.add(b)
        for s in (a, b):
            if s.finished and s in eng2.running:
                eng2.release(s)
    assert [a.output, b.output] == refs and eng2.device_drafts.steps > 0


@pytest.mark.parametrize("right", ["all", "first", "none"])
def test_drafts_that_stand_on_the_device(path, right):
    """The device's step with drafts made right (the block's drafts replaced by the greedy continuation, all of
    them, the first only, or none): what stood is taken whole, the next step starts after it (t0 = the drawn
    token there, p advanced), and the text is plain decoding's."""
    prompt, n, m = _prompt(30, 2), 30, 3
    ref = list(_engine(path).generate(prompt, GREEDY, n))
    full = prompt + ref
    eng = _engine(path, m, "mtp", graphs=True)
    dd = eng.device_drafts

    def fix():  # the drafts the buffers hold for the step at dd.p, made right as asked
        p = int(dd.p)
        want = full[p + 1:p + 1 + m]
        if len(want) < m or right == "none":
            return
        if right == "first":
            want = [want[0]] + [(t + 1) % 900 + 3 for t in want[1:]]
        dd.tok[1:] = torch.tensor(want)

    real_body, real_enter = dd._body, dd._enter
    dd._body = lambda slot, W, pr: (real_body(slot, W, pr), fix())[0]
    dd._enter = lambda s: real_enter(s) and (fix() or True)
    assert list(eng.generate(prompt, GREEDY, n)) == ref
    seq = eng.last
    assert dd.steps > 0
    if right == "all":
        assert seq.draft_accepted == seq.draft_n > 0 and seq.draft_steps <= n // (m + 1) + 2
    elif right == "first":
        assert 0 < seq.draft_accepted <= seq.draft_steps and seq.draft_steps <= n // 2 + 2
    else:
        assert seq.draft_accepted == 0


def test_the_device_leaves_the_blocks_prediction_of_what_stood(path):
    """After device steps in which only the first draft stands, the block's last prediction the host's path would
    take over (MtpDrafter.last) is the block's output at the last position that stood, recomputed here from
    scratch: the trunk's hidden states over the whole context, then the block over every position."""
    prompt, m = _prompt(30, 2), 3
    ref = list(_engine(path).generate(prompt, GREEDY, 30))
    full = prompt + ref
    eng = _engine(path, m, "mtp", graphs=True)
    dd = eng.device_drafts

    def first_right():
        p = int(dd.p)
        want = full[p + 1:p + 1 + m]
        if len(want) == m:
            dd.tok[1:] = torch.tensor([want[0]] + [(t + 1) % 900 + 3 for t in want[1:]])

    real_body, real_enter = dd._body, dd._enter
    dd._body = lambda slot, W, pr: (real_body(slot, W, pr), first_right())[0]
    dd._enter = lambda s: real_enter(s) and (first_right() or True)
    s = Sequence(list(prompt), GREEDY, 30, set())
    eng.add(s)
    while dd.steps < 5:
        eng.step()
    assert not s.finished and s.output == ref[:len(s.output)] and s.draft_accepted > 0
    logits, _, p = eng.mtp.last[s.id]
    assert p == s.pos - 1
    # the oracle: trunk hidden states of positions 0 .. p, the block over all of them in a fresh cache
    m_ = eng.model
    ctx = full[:p + 1]
    hidden = []
    with torch.inference_mode():
        m_.forward(torch.tensor(ctx), torch.arange(len(ctx)), [Segment(0, 0, len(ctx))], m_.new_kv_cache(1, 256),
                   hidden_out=hidden)
        head = eng.mtp.head
        want, _ = head.forward(hidden[0], torch.tensor(full[1:p + 2]), torch.arange(1, p + 2), Segment(0, 0, p + 1),
                               head.new_kv_cache(1, 258), last_only=True)
    assert torch.allclose(logits, want[-1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("temperature", [0.8, 1.5])
def test_a_sampled_sequences_drafted_steps_on_the_device(path, temperature):
    """A seeded sampled sequence's drafted steps on the device (each row drawn at its token's position, as the
    host's path draws it): the text of plain decoding with the same seed, and the host's path's text."""
    prompt = _prompt(40, 7)
    sp = SamplingParams(temperature=temperature, seed=11)
    ref = list(_engine(path).generate(prompt, sp, 40))
    host = _engine(path, 3, "mtp", graphs=True)
    host.device_drafts = None
    eng = _engine(path, 3, "mtp", graphs=True)
    assert list(eng.generate(prompt, sp, 40)) == ref == list(host.generate(prompt, sp, 40))
    assert eng.device_drafts.steps > 0
    assert list(eng.generate(prompt, SamplingParams(temperature=temperature, seed=12), 40)) != ref


@pytest.mark.parametrize("ahead_only", [False, True])
def test_a_drafted_step_whose_capture_fails_is_left_to_the_host(path, monkeypatch, ahead_only):
    """A GPU's drafted-step capture out of VRAM (simulated here: the capture raises where the CPU runs the step
    eagerly): the first step's failure hands drafting back to the host's path, a step launched ahead only stops
    launching ahead; the text is plain decoding's either way."""
    prompt = _prompt(40, 7)
    ref = list(_engine(path).generate(prompt, GREEDY, 30))
    eng = _engine(path, 2, "mtp", graphs=True)
    dd = eng.device_drafts
    assert dd is not None
    fails = []

    def capture(key, pr):
        fails.append(key)
        raise torch.OutOfMemoryError("no VRAM for the capture")

    real_launch = dd._launch

    def launch(s, far):
        if ahead_only and far == s.pos:  # the step itself runs; only the one launched ahead fails
            return real_launch(s, far)
        dd.cuda = True
        try:
            return real_launch(s, far)
        finally:
            dd.cuda = False

    monkeypatch.setattr(dd, "_capture", capture)
    monkeypatch.setattr(dd, "_launch", launch)
    assert list(eng.generate(prompt, GREEDY, 30)) == ref
    assert fails
    if ahead_only:
        assert eng.device_drafts is dd and not dd.ahead and dd.steps > 0
    else:
        assert eng.device_drafts is None
