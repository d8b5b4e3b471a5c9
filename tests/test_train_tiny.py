"""strata-tiny's tools: the training module against transformers and strata, routing statistics on hand-made id
streams, the data rules, and tools/train_tiny.py end to end at toy scale (outputs, split/join, recomputation)."""

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


def test_module_matches_transformers(toy_model):
    transformers = pytest.importorskip("transformers")
    m, d, _ = toy_model
    hf = transformers.Qwen3MoeForCausalLM.from_pretrained(str(d)).float().eval()
    x = torch.randint(0, TOY.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
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
           "--steps", "6", "--heldout-kb", "2", "--part-mb", "0.06", "--no-hf-check"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}  # see one_thread
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return out, json.loads((out / "strata-tiny.json").read_text())


@pytest.mark.slow
def test_toy_run_outputs(toy_run, tmp_path):
    out, rec = toy_run
    names = {p.name for p in out.iterdir()}
    parts = [p["file"] for p in rec["gguf"]["parts"]]
    assert len(parts) > 1 and set(parts) | {"strata-tiny.json", "train_log.json", "manifest.json",
                                            "strata-tiny-heldout.txt"} == names
    assert rec["training"]["steps"] == 6 and rec["training"]["toy"]
    log = json.loads((out / "train_log.json").read_text())
    assert [r["step"] for r in log["log"]] == [2, 4, 6] and log["val"]
    man = json.loads((out / "manifest.json").read_text())
    held = {f["path"] for f in man["files"] if f["split"] == "heldout"}
    assert {f["path"] for f in rec["heldout"]["files"]} <= held
    assert rec["heldout"]["tokenizer_agrees"]
    assert abs(rec["perplexity"]["train_f32"] / rec["perplexity"]["strata"] - 1) < 0.01  # q8_0 export

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
