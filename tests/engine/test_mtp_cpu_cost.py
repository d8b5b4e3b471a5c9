"""The MTP block's CPU forwards with fewer calls: its q, k and v as one weight and its shared expert's gate and up as
one (the trunk's stay apart on the CPU), and its two input norms in one call. The block's logits and outputs keep
their bits (its drafts are the same), and drafted greedy text stays plain decoding's."""

from __future__ import annotations

import pytest
import torch

from strata.config import EngineConfig
from strata.engine.engine import Engine
from strata.engine.loader import load_model
from strata.engine.sampler import SamplingParams
from strata.kv.cache import Segment
from strata.layers.norm import add_rms_norm, rms_norm
from strata.quant import qmatmul


@pytest.fixture(scope="module", params=["q8_0", "f32"])
def path(hf_and_gguf, request):
    return hf_and_gguf("glm4moe", request.param)[1]


def _engine(path, draft_max):
    cfg = EngineConfig(model=str(path), device="cpu", dtype="float32", ctx_size=256, draft_max=draft_max,
                       draft_source="mtp" if draft_max else "auto")
    return Engine(load_model(str(path), cfg, with_tokenizer=False), n_slots=1)


def _apart(head):
    """The same block with its projections apart (views of the same bytes) and its input norms one call each."""
    a, s = head.attn, head.moe.shared

    def forward(h, toks, pos, seg, kv):
        saved = a.wqkv, s.gate_up
        a.wqkv, s.gate_up = None, None
        try:
            e = rms_norm(head._embed(toks), head.enorm, head.eps)
            x0 = torch.cat([e, rms_norm(h, head.hnorm, head.eps)], -1)
            x = qmatmul(x0, head.eh_proj)
            att = a(rms_norm(x, head.attn_norm, head.eps), pos, [seg], kv)
            x, xn = add_rms_norm(x, att, head.ffn_norm, head.eps)
            x = x + head.moe(xn, head.model.step_context([seg], int(x.shape[0])))
            return head.logits(x[-1:]), x
        finally:
            a.wqkv, s.gate_up = saved

    return forward


def test_the_blocks_fused_forward_keeps_its_bits(path):
    eng = _engine(path, 3)
    head = eng.mtp.head
    assert head.attn.wqkv is not None and head.moe.shared.gate_up is not None  # taken on the CPU
    assert all(b.attn.wqkv is None for b in eng.model.blocks)  # (the trunk's stay apart there)
    assert head.attn.wq.raw.data_ptr() == head.attn.wqkv.raw.data_ptr()
    d = head.args.d_model
    for n, start in ((1, 0), (3, 1), (1, 4)):
        h = torch.randn(n, d, generator=torch.Generator().manual_seed(n + start))
        toks = torch.randint(3, 900, (n,), generator=torch.Generator().manual_seed(start))
        pos, seg = torch.arange(start + 1, start + 1 + n), Segment(0, start, n)
        kv_a, kv_b = head.new_kv_cache(1, 16), head.new_kv_cache(1, 16)
        for kv in (kv_a, kv_b):  # rows below `start` written alike
            if start:
                head.forward(torch.zeros(start, d), torch.full((start,), 7), torch.arange(1, start + 1),
                             Segment(0, 0, start), kv)
        got_l, got_x = head.forward(h, toks, pos, seg, kv_a, last_only=True)
        want_l, want_x = _apart(head)(h, toks, pos, seg, kv_b)
        assert torch.equal(got_l, want_l) and torch.equal(got_x, want_x)
        assert torch.equal(kv_a.k[0], kv_b.k[0]) and torch.equal(kv_a.v[0], kv_b.v[0])


def test_drafted_text_is_plain_text(path):
    prompt = torch.randint(3, 900, (30,), generator=torch.Generator().manual_seed(5)).tolist()
    sp = SamplingParams(temperature=0)
    ref = list(_engine(path, 0).generate(prompt, sp, 40))
    eng = _engine(path, 3)
    assert list(eng.generate(prompt, sp, 40)) == ref
    assert eng.last.draft_n > 0
