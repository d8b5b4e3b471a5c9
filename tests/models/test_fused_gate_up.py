"""Experts stored with gate and up fused (`blk.N.ffn_gate_up_exps.weight`, what llama.cpp's converter writes with
--fuse-gate-up-exps: [E, 2 ff, d], each expert's gate rows then its up rows) load as the two projections: the
logits equal those of the same model stored unfused, resident and tiered."""

from __future__ import annotations

import re

import gguf
import numpy as np
import pytest
import torch

from strata import StrataError
from strata.config import EngineConfig, ExpertConfig
from strata.engine.loader import forward_all, load_model
from tests.models.gguf_rewrite import rewrite

IDS = [3, 17, 99, 4, 250, 31, 8, 77, 5, 600, 12, 40]


def _fuse(src, dst, odd: bool = False):
    held: dict[int, np.ndarray] = {}

    def fn(name, data, qt, shape):
        m = re.fullmatch(r"blk\.(\d+)\.ffn_(gate|up)_exps\.weight", name)
        if not m:
            return data, qt
        E, ff = shape[0], shape[1]
        # raw blocks [E, ff, row_bytes] (a float tensor: [E, ff, d])
        rows = data.reshape(E, ff, -1) if qt != gguf.GGMLQuantizationType.F32 else data.reshape(shape)
        i = int(m.group(1))
        if i not in held:
            held[i] = rows
            return []
        gate, up = (held.pop(i), rows) if m.group(2) == "up" else (rows, held.pop(i))
        fused = np.concatenate([gate, up[:, :-1] if odd else up], axis=1)
        return [(f"blk.{i}.ffn_gate_up_exps.weight", fused, qt)]

    return rewrite(src, dst, fn)


@pytest.mark.parametrize("family,qtype", [("qwen3moe", "q8_0"), ("qwen3next", "q8_0"), ("deepseek_v3", "f32")])
def test_fused_gate_up_equals_separate(hf_and_gguf, tmp_path, family, qtype):
    _, path = hf_and_gguf(family, qtype)
    fused = _fuse(path, tmp_path / "fused.gguf")
    names = gguf.GGUFReader(fused).tensors
    assert any(t.name.endswith("ffn_gate_up_exps.weight") for t in names)
    assert not any(t.name.endswith("ffn_gate_exps.weight") for t in names)
    for ex in (ExpertConfig(mode="resident"), ExpertConfig(mode="tiered", slots=2, cpu_plan="011")):
        cfg = EngineConfig(device="cpu", dtype="float32", ctx_size=256, experts=ex)
        want = forward_all(load_model(str(path), cfg, with_tokenizer=False), IDS)
        got = forward_all(load_model(str(fused), cfg, with_tokenizer=False), IDS)
        assert torch.equal(got, want), family


def test_a_fused_tensor_that_does_not_halve_is_one_error(hf_and_gguf, tmp_path):
    _, path = hf_and_gguf("qwen3moe", "f32")
    bad = _fuse(path, tmp_path / "odd.gguf", odd=True)
    with pytest.raises(StrataError, match="ffn_gate_up_exps.weight has .* rows per expert"):
        load_model(str(bad), EngineConfig(device="cpu", dtype="float32", ctx_size=256), with_tokenizer=False)
