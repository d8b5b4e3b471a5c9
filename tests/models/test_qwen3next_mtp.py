"""Qwen3-Next's MTP block, as llama.cpp's current converter and `strata convert` write it (its `mtp.*` tensors
appended after the trunk as `blk.N`, `nextn_predict_layers` = 1): the file loads (the trunk's logits as without the
block), the block computes what transformers' own Qwen3-Next decoder layer computes inside llama.cpp's MTP graph
(enorm(embed) and hnorm(h) concatenated, eh_proj, the gated-attention layer with its MoE and shared expert, the
head's norm), and drafting with it leaves the greedy text unchanged. The llama.cpp cases are skipped without its
source package; with it, both converters write the same tensors."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch

from strata.config import EngineConfig
from strata.engine.engine import Engine
from strata.engine.loader import forward_all, load_model
from strata.engine.sampler import SamplingParams
from strata.kv.cache import Segment
from strata.models.mtp import MtpHead
from test_llamacpp_converter import DRIVER, converter  # noqa: F401 - the fixture

PROMPT = torch.randint(0, 1001, (30,), generator=torch.Generator().manual_seed(5)).tolist()
CPU32 = dict(device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def checkpoint(hf_and_gguf, tmp_path_factory):
    """The tiny Qwen3-Next checkpoint with an MTP block, its tensors, and strata's conversion of it without one."""
    from safetensors.torch import load_file, save_file

    hf_dir, trunk = hf_and_gguf("qwen3next")
    root = tmp_path_factory.mktemp("q3n_mtp")
    hf = root / "hf"
    shutil.copytree(hf_dir, hf)
    t = load_file(hf / "model.safetensors")
    g = torch.Generator().manual_seed(3)
    d = t["model.norm.weight"].shape[0]
    # the MTP block: a full-attention decoder layer (layer 1's tensors, perturbed) and its projections; norms in
    # the checkpoint's (1 + w) convention, near zero
    for k in [k for k in t if k.startswith("model.layers.1.")]:
        v = t[k]
        t["mtp.layers.0." + k[len("model.layers.1."):]] = v + 0.02 * torch.randn(v.shape, generator=g)
    t["mtp.fc.weight"] = 0.1 * torch.randn(d, 2 * d, generator=g)
    for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        t[f"mtp.{n}.weight"] = 0.1 * torch.randn(d, generator=g)
    save_file(t, hf / "model.safetensors", metadata={"format": "pt"})
    return hf, t, trunk


def _llamacpp(hf, root, converter) -> dict:  # noqa: F811
    out = {}
    for name, extra in (("mtp", []), ("trunk", ["--no-mtp"])):
        path = root / f"{name}.gguf"
        res = subprocess.run([sys.executable, "-c", DRIVER, str(hf), "--outfile", str(path), "--outtype", "f32",
                              *extra], cwd=converter, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]
        out[name] = path
    return out


@pytest.fixture(scope="module", params=["strata", "llamacpp"])
def files(request, checkpoint, tmp_path_factory):
    """(checkpoint dir, its tensors, {"mtp": the file with the block, "trunk": one without}) as written by strata
    convert or by llama.cpp's converter."""
    hf, t, trunk = checkpoint
    root = tmp_path_factory.mktemp(request.param)
    if request.param == "llamacpp":
        return hf, t, _llamacpp(hf, root, request.getfixturevalue("converter"))
    from strata.gguf.convert import convert

    return hf, t, {"mtp": convert(hf, root / "mtp.gguf", "f32"), "trunk": trunk}


def test_the_file_loads_and_the_trunk_is_unchanged(files):
    _, _, f = files
    lm = load_model(str(f["mtp"]), EngineConfig(**CPU32), with_tokenizer=False)
    assert [b.layer for b in lm.model.nextn] == [4] and len(lm.model.blocks) == 4
    trunk = load_model(str(f["trunk"]), EngineConfig(**CPU32), with_tokenizer=False)
    assert trunk.model.nextn == []
    assert torch.equal(forward_all(lm, PROMPT), forward_all(trunk, PROMPT))


def test_the_block_is_transformers_layer_in_llamacpps_graph(files):
    from transformers import AutoConfig
    from transformers.models.qwen3_next import modeling_qwen3_next as m

    hf, t, f = files
    lm = load_model(str(f["mtp"]), EngineConfig(**CPU32), with_tokenizer=False)
    head = MtpHead(lm.model, lm.model.nextn[0], 64)
    kv = head.new_kv_cache(1, 64, torch.float32)
    n = 12
    h = torch.randn(n, t["model.norm.weight"].shape[0], generator=torch.Generator().manual_seed(9))
    toks = torch.tensor(PROMPT[1:n + 1])
    pos = torch.arange(1, n + 1)
    # as the drafter calls it: positions 1..n (the embedded tokens'), in the cache's rows 0..n-1
    logits, out = head.forward(h, toks, pos, Segment(0, 0, n), kv)

    cfg = AutoConfig.from_pretrained(hf)
    layer = m.Qwen3NextDecoderLayer(cfg, layer_idx=1).eval()
    sd = {k[len("mtp.layers.0."):]: v for k, v in t.items() if k.startswith("mtp.layers.0.")}
    E = cfg.num_experts
    # this transformers keeps the experts fused ([E, 2 ff, d] gate then up; [E, d, ff]); the checkpoint per expert
    sd["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([sd.pop(f"mlp.experts.{e}.gate_proj.weight"),
                                                             sd.pop(f"mlp.experts.{e}.up_proj.weight")]) for e in range(E)])
    sd["mlp.experts.down_proj"] = torch.stack([sd.pop(f"mlp.experts.{e}.down_proj.weight") for e in range(E)])
    layer.load_state_dict(sd)
    rot = m.Qwen3NextRotaryEmbedding(cfg)

    def norm(x, name):  # Qwen3-Next's RMSNorm scales by (1 + w)
        nm = m.Qwen3NextRMSNorm(x.shape[-1], eps=cfg.rms_norm_eps)
        nm.weight.data.copy_(t[name])
        return nm(x)

    with torch.no_grad():
        e = t["model.embed_tokens.weight"][toks]
        x = torch.cat([norm(e, "mtp.pre_fc_norm_embedding.weight"), norm(h, "mtp.pre_fc_norm_hidden.weight")], -1)
        x = (x @ t["mtp.fc.weight"].T)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        y = layer(x, position_embeddings=rot(x, pos[None]), attention_mask=mask, position_ids=pos[None])
        y = y[0] if isinstance(y, tuple) else y
        ref = norm(y[0], "mtp.norm.weight") @ t["lm_head.weight"].T
    assert ((out - y[0]).norm() / y[0].norm()).item() < 1e-4
    assert ((logits - ref).norm() / ref.norm()).item() < 1e-4


def test_drafts_from_the_block_keep_the_greedy_text(files):
    _, _, f = files
    greedy = SamplingParams(temperature=0)
    plain = list(Engine(load_model(str(f["mtp"]), EngineConfig(**CPU32), with_tokenizer=False))
                 .generate(PROMPT, greedy, 24))
    cfg = EngineConfig(**CPU32, draft_max=4, draft_source="mtp")
    eng = Engine(load_model(str(f["mtp"]), cfg, with_tokenizer=False))
    assert eng.mtp is not None
    assert list(eng.generate(PROMPT, greedy, 24)) == plain
    assert eng.last.draft_steps > 0


def test_strata_convert_keeps_the_block(checkpoint, tmp_path):
    from strata.gguf.convert import convert
    from strata.gguf.header import read_gguf_header

    hf, t, _ = checkpoint

    h = read_gguf_header(convert(hf, tmp_path / "m.gguf", "f32"))
    assert h.metadata["qwen3next.nextn_predict_layers"] == 1 and h.metadata["qwen3next.block_count"] == 5
    names = {x.name for x in h.tensors if x.name.startswith("blk.4.")}
    trunk_attn = {x.name.replace("blk.1.", "blk.4.", 1) for x in h.tensors if x.name.startswith("blk.1.")}
    assert names == trunk_attn | {f"blk.4.nextn.{n}.weight" for n in ("eh_proj", "enorm", "hnorm", "shared_head_norm")}
    import gguf

    data = {x.name: torch.from_numpy(x.data.copy()) for x in gguf.GGUFReader(tmp_path / "m.gguf").tensors}
    assert torch.equal(data["blk.4.nextn.eh_proj.weight"], t["mtp.fc.weight"])
    assert torch.equal(data["blk.4.nextn.enorm.weight"], t["mtp.pre_fc_norm_embedding.weight"] + 1)  # (1 + w)
    assert torch.equal(data["blk.4.attn_q.weight"], t["mtp.layers.0.self_attn.q_proj.weight"])


def test_both_converters_write_the_same_block(checkpoint, converter, tmp_path):  # noqa: F811
    import gguf

    from strata.gguf.convert import convert

    hf, _, _ = checkpoint
    ours = gguf.GGUFReader(convert(hf, tmp_path / "ours.gguf", "f32"))
    theirs = gguf.GGUFReader(_llamacpp(hf, tmp_path, converter)["mtp"])
    a = {x.name: x.data for x in ours.tensors if x.name.startswith("blk.4.")}
    b = {x.name: x.data for x in theirs.tensors if x.name.startswith("blk.4.")}
    assert sorted(a) == sorted(b)
    for n in a:
        assert a[n].shape == b[n].shape and (a[n] == b[n]).all(), n
    key = "qwen3next.nextn_predict_layers"
    assert ours.fields[key].contents() == theirs.fields[key].contents() == 1


def test_a_declared_block_the_checkpoint_lacks_is_left_out(hf_and_gguf, tmp_path, caplog):
    import json

    from strata.gguf.convert import convert
    from strata.gguf.header import read_gguf_header

    hf_dir, _ = hf_and_gguf("qwen3next")
    hf = tmp_path / "hf"
    shutil.copytree(hf_dir, hf)
    cfg = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 1}))
    with caplog.at_level("WARNING", logger="strata"):
        h = read_gguf_header(convert(hf, tmp_path / "m.gguf", "f32"))
    assert "declares 1 MTP block(s) (num_nextn_predict_layers) but holds none" in caplog.text
    assert "qwen3next.nextn_predict_layers" not in h.metadata and h.metadata["qwen3next.block_count"] == 4
