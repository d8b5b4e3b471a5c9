"""strata-tiny's tools: the training modules (Qwen3-MoE, and GLM-4.5 with its MTP block) against transformers and
strata, routing statistics on hand-made id streams, the data rules, and tools/train_tiny.py end to end at toy scale
(the glm4moe family: outputs, split/join, recomputation, MTP drafting)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # tools.tiny

from strata.bench.routing import (RoutingTrace, lru_hit_rates, lru_hits, popularity, record_routing,  # noqa: E402
                                  reuse_distances, routing_stats)
from tools.tiny import data as D  # noqa: E402
from tools.tiny.glm import GlmConfig, TinyGlm  # noqa: E402
from tools.tiny.model import TinyConfig, TinyMoE, save_hf_checkpoint  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """strata's CPU forwards here run on one thread: the numbers do not depend on it, and on a runner shared with
    other jobs torch's spinning thread pool was measured 30x slower (39 s vs 1.3 s for a 1024-token forward)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# -- routing statistics, by hand ---------------------------------------------------------------------------------

STREAM = np.array([[0, 1], [0, 2], [1, 0], [3, 2]])


@pytest.mark.parametrize("capacity,hits", [(1, 2), (2, 2), (3, 4), (4, 4)])
def test_lru_hits_by_hand(capacity, hits):
    # capacity 3: t0 misses both -> [1, 0]; t1: 0 hits -> [1, 2, 0]; t2: 1 and 0 hit -> [2, 0, 1]; t3: 2 hits
    assert lru_hits(STREAM, capacity) == (hits, 8)


def test_popularity_and_reuse_by_hand():
    tr = RoutingTrace(4, {0: STREAM, 1: STREAM[:, ::-1].copy()})
    pop = popularity(tr)
    assert pop["mean_sorted_share"] == pytest.approx([3 / 8, 2 / 8, 2 / 8, 1 / 8])
    assert pop["top_share"]["0.25"] == pytest.approx(3 / 8) and pop["top_share"]["0.50"] == pytest.approx(5 / 8)
    assert pop["unused_experts"] == 0
    # per layer: expert 0 at t0,t1,t2 (1, 1), expert 1 at t0,t2 (2), expert 2 at t1,t3 (2)
    assert sorted(reuse_distances(tr).tolist()) == [1, 1, 1, 1, 2, 2, 2, 2]
    s = routing_stats(tr, fractions=(0.5, 1.0))
    assert s["lru"]["0.50"] == {"capacity": 2, "hit_rate": 2 / 8, "uniform": 0.5}
    assert s["lru"]["1.00"]["hit_rate"] == 4 / 8  # only first uses miss: 4 distinct experts of 8 picks
    assert s["reuse_distance"]["median"] == 1.5 and s["k"] == 2 and s["tokens"] == 4


def test_lru_on_uniform_routing_matches_capacity_fraction():
    rng = np.random.default_rng(0)
    ids = np.stack([rng.choice(32, 4, replace=False) for _ in range(4000)])
    r = lru_hit_rates(RoutingTrace(32, {0: ids}), fractions=(0.25, 0.5))
    assert abs(r["0.25"]["hit_rate"] - 0.25) < 0.02 and abs(r["0.50"]["hit_rate"] - 0.5) < 0.02


# -- the training module against transformers and strata ------------------------------------------------------------

TOY = TinyConfig(vocab_size=512, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, experts=8, top_k=2,
                 expert_ffn=32, ctx=64)


@pytest.fixture(scope="module")
def toy_model(tmp_path_factory):
    """A random toy TinyMoE (non-trivial norms, decisive routers), its checkpoint and its f32 GGUF."""
    from strata.gguf.convert import convert
    from strata.gguf.tokenizer_hf import make_tiny_hf_tokenizer

    torch.manual_seed(0)
    m = TinyMoE(TOY).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.ndim == 1:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0, 0.5 if "gate.weight" in name else 0.08)
    d = tmp_path_factory.mktemp("tinymoe") / "strata-tiny"
    make_tiny_hf_tokenizer(d, TOY.vocab_size)
    save_hf_checkpoint(m, d, bos_id=0, eos_id=1, pad_id=0)
    return m, d, convert(d, d.parent / "toy.gguf", "f32")


@pytest.mark.parametrize("fixture,cls", [("toy_model", "Qwen3MoeForCausalLM"), ("glm_model", "Glm4MoeForCausalLM")])
def test_module_matches_transformers(request, fixture, cls):
    # the training module (either family) against transformers' own implementation of its exported checkpoint
    transformers = pytest.importorskip("transformers")
    m, d, _ = request.getfixturevalue(fixture)
    hf = getattr(transformers, cls).from_pretrained(str(d)).float().eval()
    x = torch.randint(0, m.cfg.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = m(x)[0], hf(x).logits
    assert torch.allclose(ours, theirs, atol=1e-4, rtol=1e-4), (ours - theirs).abs().max()


def test_module_matches_strata_and_routing_is_captured(toy_model):
    from strata.engine.loader import forward_all
    from tools.tiny.evaluate import load_cpu

    m, _, gguf = toy_model
    lm = load_cpu(gguf, TOY.ctx)
    ids = torch.randint(0, TOY.vocab_size, (60,), generator=torch.Generator().manual_seed(2)).tolist()
    with record_routing(lm.model) as tr:
        got = forward_all(lm, ids)
    with torch.no_grad():
        want, _, want_ids = m(torch.tensor([ids]), return_ids=True)
    assert torch.allclose(got, want[0], atol=1e-3, rtol=1e-3), (got - want[0]).abs().max()
    assert tr.layers == [0, 1] and tr.n_experts == TOY.experts and tr.n_tokens == len(ids)
    for layer in (0, 1):
        same = [set(a) == set(b) for a, b in zip(tr.ids[layer].tolist(), want_ids[layer].tolist())]
        assert sum(same) >= len(same) - 1  # a near-tie may flip one choice between the two summation orders
    assert "forward" not in vars(lm.model.experts)  # the capture is undone


# -- the GLM-4.5 training module and its MTP block -----------------------------------------------------------------

GLM_TOY = GlmConfig(vocab_size=512, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, experts=8, top_k=2,
                    expert_ffn=32, ctx=64, routed_scale=1.5)


@pytest.fixture(scope="module")
def glm_model(tmp_path_factory):
    """A random toy TinyGlm (non-trivial norms and biases, decisive routers, a non-zero correction bias), its
    checkpoint and its f32 GGUF."""
    from strata.gguf.convert import convert
    from strata.gguf.tokenizer_hf import make_tiny_hf_tokenizer

    torch.manual_seed(0)
    m = TinyGlm(GLM_TOY).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.ndim == 1:
                p.copy_((0.0 if name.endswith(".bias") else 1.0) + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0, 0.5 if "gate.weight" in name else 0.08)
        for r in [layer.mlp.gate for layer in m.layers] + [b.mlp.gate for b in m.mtp]:
            r.e_score_correction_bias.normal_(0, 0.1)
    d = tmp_path_factory.mktemp("tinyglm") / "strata-tiny"
    make_tiny_hf_tokenizer(d, GLM_TOY.vocab_size)
    save_hf_checkpoint(m, d, bos_id=0, eos_id=1, pad_id=0)
    return m, d, convert(d, d.parent / "toy.gguf", "f32")


def test_glm_checkpoint_is_glms_layout(glm_model):
    from safetensors.torch import load_file

    m, d, _ = glm_model
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["model_type"] == "glm4_moe" and cfg["num_nextn_predict_layers"] == 1 and cfg["first_k_dense_replace"] == 0
    names = set(load_file(d / "model.safetensors"))
    L = GLM_TOY.layers
    for n in ("eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight",
              "mlp.gate.e_score_correction_bias", "mlp.shared_experts.down_proj.weight", "self_attn.q_proj.bias",
              "mlp.experts.7.up_proj.weight"):
        assert f"model.layers.{L}.{n}" in names
    assert not any(n.startswith(f"model.layers.{L + 1}.") or "mtp." in n or "lm_head" in n for n in names)
    assert len(names) == len(m.hf_state_dict())
    n_params = sum(t.numel() for k, t in load_file(d / "model.safetensors").items() if "correction_bias" not in k)
    assert n_params == GLM_TOY.n_params() - (GLM_TOY.layers + 1) * GLM_TOY.experts


def test_glm_module_and_its_mtp_block_match_strata(glm_model):
    from strata.engine.loader import forward_all
    from strata.kv.cache import Segment
    from strata.models.mtp import MtpHead
    from tools.tiny.evaluate import load_cpu, module_mtp_accuracy, strata_mtp_top1

    m, _, gguf = glm_model
    lm = load_cpu(gguf, GLM_TOY.ctx)
    assert lm.gguf.arch == "glm4moe" and len(lm.model.nextn) == 1 and lm.args.n_layers == GLM_TOY.layers
    ids = torch.randint(0, GLM_TOY.vocab_size, (60,), generator=torch.Generator().manual_seed(2)).tolist()
    with record_routing(lm.model) as tr:
        got = forward_all(lm, ids)
    t = torch.tensor([ids])
    with torch.no_grad():
        want, _, want_ids = m(t, return_ids=True)
        h, _, _ = m.trunk(t)
        want_mtp, _ = m.mtp_logits(h[:, :-1], t[:, 1:])
    assert torch.allclose(got, want[0], atol=1e-3, rtol=1e-3), (got - want[0]).abs().max()
    for layer in range(GLM_TOY.layers):
        same = [set(a) == set(b) for a, b in zip(tr.ids[layer].tolist(), want_ids[layer].tolist())]
        assert sum(same) >= len(same) - 1
    # the MTP block: strata's head over the trunk's hidden states, as the drafter places the pairs
    mdl, hid = lm.model, []
    mdl.forward(t[0], torch.arange(60), [Segment(0, 0, 60)], mdl.new_kv_cache(1, GLM_TOY.ctx), all_logits=True,
                hidden_out=hid)
    head = MtpHead(mdl, mdl.nextn[0], GLM_TOY.ctx + 2)
    got_mtp, _ = head.forward(hid[0][:59], t[0, 1:], torch.arange(1, 60), Segment(0, 0, 59),
                              head.new_kv_cache(1, GLM_TOY.ctx + 2))
    assert torch.allclose(got_mtp, want_mtp[0], atol=1e-3, rtol=1e-3), (got_mtp - want_mtp[0]).abs().max()
    acc, n = strata_mtp_top1(lm, ids, GLM_TOY.ctx)
    assert n == 58 and acc == pytest.approx(module_mtp_accuracy(m, ids, GLM_TOY.ctx, "cpu"))


def test_glm_training_step_trains_the_block_and_balances_the_routers():
    torch.manual_seed(0)
    cfg = GlmConfig(vocab_size=64, hidden=32, layers=1, heads=2, kv_heads=1, head_dim=16, experts=4, top_k=2,
                    expert_ffn=16, ctx=16, bias_rate=0.01)
    m = TinyGlm(cfg)
    x = torch.randint(0, 64, (2, 17))
    o = m.train_losses(x[:, :-1], x[:, 1:])
    assert set(o) == {"ce", "mtp_ce", "aux", "ids"} and len(o["ids"]) == 2
    (o["ce"] + 0.3 * o["mtp_ce"] + o["aux"]).backward()
    assert m.mtp[0].eh_proj.weight.grad.abs().sum() > 0 and m.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0
    assert m.mtp[0].mlp.gate.e_score_correction_bias.grad is None  # a buffer: moved by update_bias only
    ids = [torch.tensor([[0, 1], [0, 1], [0, 2]])] * 2  # expert 0 over-used, 3 never picked
    m.update_bias(ids)
    b = m.layers[0].mlp.gate.e_score_correction_bias
    assert b.tolist() == pytest.approx([-0.01, -0.01, 0.01, 0.01])  # loads 3, 2, 1, 0 vs the mean 1.5


# -- data rules ---------------------------------------------------------------------------------------------------

def test_split_rules():
    assert D.split_of("test/test_os.py") == "train" and D.split_of("idlelib/idle_test/x.py") == "train"
    assert D.split_of("encodings/cp1252.py") == "train" and D.is_test("pkg/test_x.py")
    names = [f"mod{i}/x.py" for i in range(4000)]
    splits = [D.split_of(n) for n in names]
    assert splits == [D.split_of(n) for n in names]  # deterministic
    assert 60 < splits.count("heldout") < 140 and 150 < splits.count("val") < 250


def test_collector_leaves_out_what_it_must(tmp_path):
    files = {"a.py": b"x = 1\n", "dup.py": b"x = 1\n", "latin.py": "x = 'é'\n".encode("latin-1"),
             "chat.py": b"T = '<|im_start|>'\n", "empty.py": b"\n\n", "big.py": b"#" * 2000 + b"\n"}
    c = D.Collector(max_file_bytes=1000)
    for n, b in files.items():
        (tmp_path / n).write_bytes(b)
        c.add("t", n, tmp_path / n)
    assert [f.rel for f in c.files] == ["a.py"]
    assert {e["path"]: e["reason"] for e in c.excluded} == {
        "dup.py": "duplicate content", "latin.py": "not UTF-8", "chat.py": "contains special-token text",
        "empty.py": "empty", "big.py": "too large"}


def test_heldout_slice_is_whole_lines_and_deterministic():
    fs = [D.SourceFile("stdlib", f"m{i}.py", str(i), 0, "".join(f"line {i}.{j}\n" for j in range(300)), "heldout")
          for i in range(5)]
    text, used = D.heldout_slice(fs, 5000, per_file_chars=1500)
    assert 4000 < len(text) <= 5000 + 5 and text == D.heldout_slice(fs[::-1], 5000, 1500)[0]
    for part in text.split("\n\n"):
        assert all(line.startswith("line ") for line in part.strip("\n").split("\n"))
    assert sum(u["chars"] for u in used) + len(used) - 1 == len(text)


def test_larger_caps_keep_the_first_selection_as_the_tokenizers(monkeypatch):
    """More text from each package (the second version's caps) adds files; the files the first caps took are still
    the ones marked `base` (the tokenizer's sample), so the tokenizer does not change."""
    extras = tuple(n for n in ("pytest", "rich", "click", "jinja2") if D.EXTRA_PACKAGES.get(n))
    small, total = 200_000, 300_000
    monkeypatch.setattr(D, "BASE_PACKAGE_BYTES", small)
    monkeypatch.setattr(D, "BASE_EXTRA_BYTES", total)
    first, _ = D.collect(extras, extra_bytes=total, per_package_bytes=small, stdlib_limit=6)
    more, src = D.collect(extras, extra_bytes=10 * total, per_package_bytes=4 * small, stdlib_limit=6)
    if sum(s.get("bytes", 0) for n, s in src.items() if n != "stdlib") <= total:
        pytest.skip("too little installed text from these packages")
    old = {(f.source, f.rel) for f in first.files}
    assert all(f.base for f in first.files)
    assert {(f.source, f.rel) for f in more.files if f.base} == old < {(f.source, f.rel) for f in more.files}


SRC = '''
import os


def public(a, b):
    """Add two numbers and return the result of it."""
    return a + b


def _private():
    """Hidden from the chat examples, it starts with an underscore."""
    return 1


class K:
    @staticmethod
    def method(x):
        """Return x doubled, a method inside a class body."""
        y = x * 2
        return y


if os.name:
    def inside_if():
        """Defined under an if statement at module level."""
        return None
'''


def test_chat_examples_from_functions():
    found = D._functions(SRC)
    assert [n for n, _, _ in found] == ["public", "method", "inside_if"]
    name, doc, src = found[1]
    assert doc == "Return x doubled, a method inside a class body." and src.startswith("@staticmethod\ndef method")
    assert D._functions("def broken(:\n") == []


def test_chat_text_is_what_the_qwen3_template_renders():
    from strata.gguf.builtin_templates import QWEN3_TEMPLATE
    from strata.gguf.chat_template import ChatTemplate

    t = ChatTemplate(QWEN3_TEMPLATE, eos_token="<|im_end|>")
    for system in (None, "You are a helpful assistant."):
        msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": "Do it."}]
        full = D.chat_text(system, "Do it.", "```python\nx = 1\n```")
        reply = msgs + [{"role": "assistant", "content": "```python\nx = 1\n```"}]
        assert t.render(reply, add_generation_prompt=False) == full
        assert full.startswith(t.render(msgs, add_generation_prompt=True))
        assert full.startswith(t.render(msgs, add_generation_prompt=True, enable_thinking=False))


# -- the script end to end, toy scale -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("toy-out")
    work = tmp_path_factory.mktemp("toy-work")
    cmd = [sys.executable, str(ROOT / "tools" / "train_tiny.py"), "--out", str(out), "--work", str(work), "--toy",
           "--steps", "30", "--heldout-kb", "2", "--part-mb", "0.06"]  # (30 steps: the MTP block's drafts stand)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}  # see one_thread
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return out, json.loads((out / "strata-tiny.json").read_text())


@pytest.mark.slow
def test_toy_run_outputs(toy_run, tmp_path):
    out, rec = toy_run
    assert rec["model"]["family"] == "glm4moe" and rec["model"]["mtp"]["layers"] == 1
    names = {p.name for p in out.iterdir()}
    parts = [p["file"] for p in rec["gguf"]["parts"]]
    assert len(parts) > 1 and set(parts) | {"strata-tiny.json", "train_log.json", "manifest.json",
                                            "strata-tiny-heldout.txt"} == names
    assert rec["training"]["steps"] == 30 and rec["training"]["toy"]
    log = json.loads((out / "train_log.json").read_text())
    assert [r["step"] for r in log["log"]] == list(range(2, 31, 2)) and log["val"]
    assert all("mtp_loss" in r for r in log["log"])
    man = json.loads((out / "manifest.json").read_text())
    held = {f["path"] for f in man["files"] if f["split"] == "heldout"}
    assert {f["path"] for f in rec["heldout"]["files"]} <= held
    assert rec["heldout"]["tokenizer_agrees"]
    assert abs(rec["perplexity"]["train_f32"] / rec["perplexity"]["strata"] - 1) < 0.01  # q8_0 export
    assert rec["perplexity"]["hf_f32"] == pytest.approx(rec["perplexity"]["train_f32"], rel=1e-4)  # the trunk
    # the MTP block drafts (the text with drafts was checked to be the plain greedy text) and drafts get accepted
    mtp = rec["mtp"]
    assert "error" not in mtp, mtp
    tf = mtp["teacher_forced"]
    assert tf["positions"] > 0 and abs(tf["strata_top1"] - tf["train_f32_top1"]) < 0.02
    dr = mtp["drafting"]
    assert [r["draft_max"] for r in dr["drafter"]] == [1, 2, 3] and dr["plain"]["proposed"] == 0
    assert all(r["proposed"] > 0 for r in dr["drafter"]) and sum(r["accepted"] for r in dr["drafter"]) > 0
    assert all(r["tokens"] == dr["plain"]["tokens"] and r["steps"] <= dr["plain"]["steps"] for r in dr["drafter"])

    # install: pieces joined and verified, files placed; a corrupt piece is refused
    from tools.tiny.install import main as install

    root = tmp_path / "repo"
    assert install([str(out), "--root", str(root), "--no-doc"]) == 0
    gguf = root / "strata" / "data" / "strata-tiny.gguf"
    assert gguf.stat().st_size == rec["gguf"]["bytes"]
    assert (root / "tests" / "data" / "strata-tiny-heldout.txt").read_text() == (out / "strata-tiny-heldout.txt").read_text()
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    p = bad / parts[0]
    p.write_bytes(b"\0" + p.read_bytes()[1:])
    with pytest.raises(SystemExit, match="sha256"):
        install([str(bad), "--root", str(tmp_path / "repo2"), "--no-doc"])
    # a run that saved the model but failed to measure it: install measures it (strata, CPU float32)
    unmeasured = tmp_path / "unmeasured"
    shutil.copytree(out, unmeasured)
    r2 = dict(rec, routing=None, completions=None, perplexity=dict(rec["perplexity"], strata=None))
    (unmeasured / "strata-tiny.json").write_text(json.dumps(r2))
    assert install([str(unmeasured), "--root", str(tmp_path / "repo3"), "--no-doc"]) == 0
    got = json.loads((tmp_path / "repo3" / "strata" / "data" / "strata-tiny.json").read_text())
    assert got["perplexity"]["strata"] == pytest.approx(rec["perplexity"]["strata"], rel=1e-4)
    hit = [v["hit_rate"] for v in rec["routing"]["lru"].values()]
    assert [v["hit_rate"] for v in got["routing"]["lru"].values()] == pytest.approx(hit) and "ids" not in got["heldout"]
    assert [c["ids"] for c in got["completions"]] == [c["ids"] for c in rec["completions"]]


@pytest.mark.slow
@pytest.mark.exact_cpu  # the recorded numbers are the float32 reference's (tools/tiny/evaluate.fill_strata_numbers)
def test_toy_run_is_reproduced_by_strata(toy_run, tmp_path):
    """What CI does with the shipped model, on the toy run: the recorded numbers are recomputed by strata."""
    from tools.tiny.evaluate import completion_diff, load_cpu, recompute, routing_diffs
    from tools.tiny.install import join_gguf
    from tools.tiny.report import render, routing_tables, update_doc

    out, rec = toy_run
    gguf = tmp_path / "m.gguf"
    join_gguf(out, rec, gguf)
    lm = load_cpu(gguf, rec["heldout"]["ctx"])
    ev = recompute(lm, (out / "strata-tiny-heldout.txt").read_text(encoding="utf-8"), rec)
    assert ev["perplexity"] == pytest.approx(rec["perplexity"]["strata"], rel=1e-4)
    assert routing_diffs(rec["routing"], ev["routing"], tol=1e-9) == []
    for c, got in zip(rec["completions"], ev["completions"]):
        assert completion_diff(lm, c, got["ids"]) is None
    # a different completion is reported
    c = dict(rec["completions"][0], ids=[(t + 1) % 512 for t in rec["completions"][0]["ids"]])
    assert completion_diff(lm, c, rec["completions"][0]["ids"]) is not None
    # the doc section renders from the record, between the markers
    doc = tmp_path / "doc.md"
    doc.write_text("intro\n<!-- BEGIN GENERATED by tools/tiny/report.py: do not edit by hand -->\nold\n"
                   "<!-- END GENERATED -->\nend\n")
    update_doc(doc, rec)
    text = doc.read_text()
    assert routing_tables(rec) in text and "old" not in text and text.endswith("<!-- END GENERATED -->\nend\n")
    assert render(rec) in text


@pytest.mark.slow
def test_toy_run_plots(toy_run, tmp_path):
    pytest.importorskip("matplotlib")
    from tools.tiny.report import plots

    out, rec = toy_run
    made = plots(rec, json.loads((out / "train_log.json").read_text()), tmp_path)
    assert [p.name for p in made] == ["loss.png", "popularity.png", "lru.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in made)
