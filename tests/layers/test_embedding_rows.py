"""The embedding rows kept dequantized by token (strata.layers.embedding): the bits the reference dequantizer gives
a lookup of those tokens, whatever was looked up before and whatever the bound dropped, and the path taken by a
CPU decode step and by the MTP block's forwards."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants

from strata.config import EngineConfig
from strata.engine.engine import Engine
from strata.engine.loader import load_model
from strata.engine.sampler import SamplingParams
from strata.layers import embedding
from strata.layers.embedding import EmbedRows
from strata.quant import QTensor
from strata.quant.dequant import dequantize


def _table(qtype, V=64, d=256) -> QTensor:
    w = np.random.default_rng(0).standard_normal((V, d)).astype(np.float32)
    raw = torch.from_numpy(np.ascontiguousarray(quants.quantize(w, qtype)).view(np.uint8).reshape(V, -1).copy())
    return QTensor(raw, qtype, (V, d))


def _want(t: QTensor, ids) -> torch.Tensor:
    raw = t.raw.index_select(0, torch.tensor(ids))
    return dequantize(raw, t.qtype, (len(ids), t.shape[1]))


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.F16])
def test_kept_rows_are_the_dequantizers_bits(qtype, monkeypatch):
    t = _table(qtype)
    rows = EmbedRows(t, torch.float32)
    for ids in ([5], [5], [7, 5, 7], [63, 0, 1, 2], [0]):
        got = rows.lookup(torch.tensor(ids))
        assert torch.equal(got.view(torch.int32), _want(t, ids).view(torch.int32))
    assert rows.hits == 2  # ([5] again, [0] again)
    got = rows.lookup(torch.tensor([1]))
    got += 1.0  # a fresh tensor: writing into it leaves the kept row alone
    assert torch.equal(rows.lookup(torch.tensor([1])), _want(t, [1]))
    # the bound: rows dropped first in, first out; a lookup of more new tokens than it holds is still right
    monkeypatch.setattr(embedding, "MAX_BYTES", 3 * 256 * 4)
    small = EmbedRows(t, torch.float32)
    for ids in ([1, 2], [3, 4], [1, 2, 3, 4, 5], [9] * 20):
        assert torch.equal(small.lookup(torch.tensor(ids)), _want(t, ids))
        assert len(small.rows) <= 3


def test_decode_steps_and_the_mtp_block_take_the_kept_rows(hf_and_gguf):
    """A drafted greedy run on the CPU: the trunk's steps and the block's forwards read kept rows, and the text is
    plain decoding's."""
    path = str(hf_and_gguf("glm4moe")[1])
    prompt = torch.randint(3, 900, (30,), generator=torch.Generator().manual_seed(1)).tolist()

    def run(draft_max):
        cfg = EngineConfig(model=path, device="cpu", dtype="float32", ctx_size=256, draft_max=draft_max,
                           draft_source="mtp" if draft_max else "auto")
        eng = Engine(load_model(path, cfg, with_tokenizer=False), n_slots=1)
        return eng, list(eng.generate(prompt, SamplingParams(temperature=0), 40))

    plain, ref = run(0)
    kept = plain.model.embed_rows_kept()
    assert kept.hits > 0
    eng, out = run(3)
    assert out == ref
    trunk, block = eng.model.embed_rows_kept(), eng.mtp.head.embed_rows_kept()
    assert trunk.hits > 0 and eng.last.draft_steps > 0
    # (this block has a table of its own: nextn.embed_tokens); its forwards after the prompt's read kept rows
    assert block is not trunk and block.table is eng.mtp.head.embed
    assert block.hits >= eng.mtp.runs // 2
