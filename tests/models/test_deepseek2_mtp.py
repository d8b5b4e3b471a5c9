"""DeepSeek-V3's MTP block (`model.layers.{L}` of the checkpoint, `num_nextn_predict_layers` = 1), converted by
`strata convert` into llama.cpp's deepseek2 layout (`blk.L.*` plus `blk.L.nextn.*`, `deepseek2.nextn_predict_layers`):
the trunk's logits stay transformers' own, the block computes transformers' own DeepSeek-V3 decoder layer (latent
attention, routed experts with the correction bias and group-limited top-k, the shared expert) inside the MTP graph
(enorm(embed) and hnorm(h) concatenated, eh_proj, the layer, the shared head's norm and head), and drafting with
it leaves the text unchanged, resident and with the experts tiered."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch

from strata.config import EngineConfig, ExpertConfig
from strata.engine.engine import Engine
from strata.engine.loader import forward_all, load_model
from strata.engine.sampler import SamplingParams
from strata.gguf.reader import GGUFModel
from strata.kv.cache import Segment
from strata.models.mtp import MtpHead

PROMPT = torch.randint(3, 900, (30,), generator=torch.Generator().manual_seed(5)).tolist()
CPU32 = dict(device="cpu", dtype="float32")
GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def files(hf_and_gguf):
    from safetensors.torch import load_file

    hf, path = hf_and_gguf("deepseek_v3_mtp")
    return hf, load_file(hf / "model.safetensors"), path


def test_the_converted_file_keeps_the_block_and_the_trunk_is_transformers(files):
    from transformers import AutoModelForCausalLM

    hf, _, path = files
    g = GGUFModel(str(path))
    assert g.arch_get("block_count") == 4 and g.arch_get("nextn_predict_layers") == 1
    assert {f"blk.3.nextn.{n}.weight" for n in ("eh_proj", "enorm", "hnorm", "embed_tokens", "shared_head_head",
                                                 "shared_head_norm")} <= set(g.tensors)
    assert {"blk.3.attn_kv_a_mqa.weight", "blk.3.attn_k_b.weight", "blk.3.ffn_gate_exps.weight",
            "blk.3.ffn_up_shexp.weight", "blk.3.exp_probs_b.bias"} <= set(g.tensors)
    lm = load_model(str(path), EngineConfig(**CPU32), with_tokenizer=False)
    assert [b.layer for b in lm.model.nextn] == [3] and len(lm.model.blocks) == 3
    ref = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()  # (it ignores layer 3)
    with torch.no_grad():
        want = ref(torch.tensor([PROMPT])).logits[0]
    got = forward_all(lm, PROMPT)
    assert ((got - want).norm() / want.norm()).item() < 1e-4


def test_the_block_is_transformers_layer_in_the_mtp_graph(files):
    from transformers import AutoConfig
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m

    hf, t, path = files
    lm = load_model(str(path), EngineConfig(**CPU32), with_tokenizer=False)
    head = MtpHead(lm.model, lm.model.nextn[0], 64)
    kv = head.new_kv_cache(1, 64, torch.float32)
    n = 12
    d = t["model.norm.weight"].shape[0]
    h = torch.randn(n, d, generator=torch.Generator().manual_seed(9))
    toks = torch.tensor(PROMPT[1:n + 1])
    pos = torch.arange(1, n + 1)
    # as the drafter calls it: positions 1..n (the embedded tokens'), in the cache's rows 0..n-1
    logits, out = head.forward(h, toks, pos, Segment(0, 0, n), kv)

    cfg = AutoConfig.from_pretrained(hf)
    layer = m.DeepseekV3DecoderLayer(cfg, layer_idx=3).eval()
    p = "model.layers.3."
    sd = {k[len(p):]: v for k, v in t.items() if k.startswith(p)}
    for k in ("eh_proj.weight", "enorm.weight", "hnorm.weight", "embed_tokens.weight", "shared_head.head.weight",
              "shared_head.norm.weight"):
        sd.pop(k)
    want_keys = set(layer.state_dict())
    if "mlp.experts.gate_up_proj" in want_keys:  # this transformers keeps the experts fused; the checkpoint per expert
        E = cfg.n_routed_experts
        sd["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([sd.pop(f"mlp.experts.{e}.gate_proj.weight"),
                                                                 sd.pop(f"mlp.experts.{e}.up_proj.weight")])
                                                      for e in range(E)])
        sd["mlp.experts.down_proj"] = torch.stack([sd.pop(f"mlp.experts.{e}.down_proj.weight") for e in range(E)])
    layer.load_state_dict(sd)
    rot = m.DeepseekV3RotaryEmbedding(cfg)

    def rms(x, name):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * t[p + name]

    with torch.no_grad():
        e = t[p + "embed_tokens.weight"][toks]
        x = (torch.cat([rms(e, "enorm.weight"), rms(h, "hnorm.weight")], -1) @ t[p + "eh_proj.weight"].T)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        y = layer(x, position_embeddings=rot(x, pos[None]), attention_mask=mask, position_ids=pos[None])
        y = y[0] if isinstance(y, tuple) else y
        ref = rms(y[0], "shared_head.norm.weight") @ t[p + "shared_head.head.weight"].T
    assert ((out - y[0]).norm() / y[0].norm()).item() < 1e-4
    assert ((logits - ref).norm() / ref.norm()).item() < 1e-4


def _engine(path, draft_max=0, experts=None, n_slots=1, graphs=None):
    cfg = EngineConfig(model=str(path), **CPU32, ctx_size=256, draft_max=draft_max, draft_source="mtp",
                       experts=experts or ExpertConfig(), cuda_graphs=graphs)
    return Engine(load_model(str(path), cfg, with_tokenizer=False), n_slots=n_slots)


# True on a CPU: the block's static-buffer path and the drafted steps on the "device", run eagerly
@pytest.mark.parametrize("graphs", [None, True])
def test_drafts_from_the_block_keep_the_greedy_text(files, graphs):
    _, _, path = files
    plain = list(_engine(path).generate(PROMPT, GREEDY, 32))
    eng = _engine(path, 3, graphs=graphs)
    assert eng.mtp is not None
    assert list(eng.generate(PROMPT, GREEDY, 32)) == plain
    assert eng.last.draft_steps > 0 and eng.last.draft_n > 0 and eng.mtp.runs > 0


def test_tiered_drafts_keep_the_sampled_text_and_the_block_takes_the_tiers(files):
    """Two slots of the 8 experts a layer, the block's experts one more layer of the same backend."""
    _, _, path = files
    sampled = SamplingParams(temperature=0.8, seed=3)
    plain = list(_engine(path).generate(PROMPT, sampled, 32))
    eng = _engine(path, 2, experts=ExpertConfig(mode="tiered", slots=2, cpu_plan="011"))
    # the block's experts: its GGUF index in the trunk's backend, beside the trunk's MoE layers 1 and 2
    assert 3 in eng.model.experts.index and eng.mtp.head.moe.experts is eng.model.experts
    assert list(eng.generate(PROMPT, sampled, 32)) == plain
    assert eng.last.draft_steps > 0


def test_a_checkpoint_declaring_a_block_it_does_not_hold_converts_without_it(files, tmp_path, caplog):
    from safetensors.torch import save_file

    from strata.gguf.convert import convert

    hf, t, _ = files
    d = tmp_path / "hf"
    shutil.copytree(hf, d)
    save_file({k: v for k, v in t.items() if not k.startswith("model.layers.3.")}, d / "model.safetensors",
              metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING, logger="strata"):
        out = convert(d, tmp_path / "trunk.gguf", "f32")
    assert "declares 1 MTP block" in caplog.text
    g = GGUFModel(str(out))
    assert g.arch_get("block_count") == 3 and not g.arch_get("nextn_predict_layers")
    lm = load_model(str(out), EngineConfig(**CPU32), with_tokenizer=False)
    assert lm.model.nextn == []
    assert torch.equal(forward_all(lm, PROMPT), forward_all(load_model(str(files[2]), EngineConfig(**CPU32),
                                                                       with_tokenizer=False), PROMPT))


@pytest.mark.gpu
def test_cuda_the_blocks_graphed_latent_attention_keeps_the_text(files):
    """On a GPU the block's forwards, latent attention included, are captured and replayed, a greedy sequence's
    whole drafted step as one graph: plain decoding's text."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _, _, path = files

    def eng(draft_max):
        cfg = EngineConfig(model=str(path), device="cuda", dtype="float32", ctx_size=256, draft_max=draft_max,
                           draft_source="mtp", cuda_graphs=True)
        return Engine(load_model(str(path), cfg, with_tokenizer=False), n_slots=1)

    ref = list(eng(0).generate(PROMPT, GREEDY, 40))
    e = eng(3)
    assert e.mtp.graphs is not None and e.mtp.graphs.cuda
    assert list(e.generate(PROMPT, GREEDY, 40)) == ref
    assert e.device_drafts is not None and e.device_drafts.steps > 0
