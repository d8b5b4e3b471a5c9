"""`strata perplexity`: llama-perplexity's chunking, its error formula, the logits file of a KL base run, the
KL mode (a run against itself, q8_0 against f32), and the one-line errors for bad input.

The models are tiny random Qwen3 (f32 and q8_0 from the same checkpoint) and Qwen3-MoE checkpoints converted
by `strata convert`.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

from strata import StrataError
from strata.cli import main
from strata.engine import perplexity as P

N_CTX = 32


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from hf_fixtures import make_hf_model  # tests/models (on sys.path from conftest)

    from strata.gguf.convert import convert
    from strata.gguf.tokenizer_hf import make_tiny_hf_tokenizer

    root = tmp_path_factory.mktemp("ppl")
    tok = make_tiny_hf_tokenizer(root / "tok", 512)
    out = {}
    for fam in ("qwen3", "qwen3moe"):
        hf = root / fam
        make_hf_model(fam, hf, 512, seed=3, std=0.08)
        for f in tok.iterdir():
            if f.is_file():
                (hf / f.name).write_bytes(f.read_bytes())
        for t in ("f32", "q8_0") if fam == "qwen3" else ("f32",):
            out[t if fam == "qwen3" else f"moe.{t}"] = convert(hf, root / f"{fam}.{t}.gguf", t)
    return out


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    import argparse
    import inspect

    f = tmp_path_factory.mktemp("text") / "text.txt"
    f.write_text(inspect.getdoc(argparse) * 2)
    return f


def _run(capsys, *argv) -> str:
    capsys.readouterr()
    assert main(["perplexity", "--device", "cpu", "--dtype", "f32", *map(str, argv)]) == 0
    return capsys.readouterr().out


def _error(capsys, *argv) -> str:
    capsys.readouterr()
    assert main(["perplexity", "--device", "cpu", *map(str, argv)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("strata: error: ")
    return err[-1]


def test_chunking_scores_the_second_half():
    # 100 tokens, -c 16: 6 chunks (the tail of 4 dropped); logits at 8..14 predict tokens 9..15 of each chunk
    assert P.n_chunks_for(100, 16) == 6
    assert P.n_chunks_for(100, 16, 2) == 2
    assert P.n_chunks_for(32, 16) == 2
    assert P.scored(16) == (8, 7)
    assert P.scored(17) == (8, 8)  # odd: first = n_ctx // 2, up to n_ctx - 2
    toks = list(range(100, 200))
    assert P.chunk_input(toks, 2, 16, bos=1) == [1] + list(range(133, 148))
    assert P.chunk_input(toks, 2, 16, bos=None) == list(range(132, 148))
    with pytest.raises(StrataError, match="needs at least 32"):
        P.n_chunks_for(31, 16)


def test_error_formula_is_llamacpps():
    v = torch.tensor([1.0, 2.0, 4.0, 0.5])
    st = P.NllStats()
    st.add(v[:2])
    st.add(v[2:])
    mean, var = float(v.mean()), float((v * v).mean() - v.mean() ** 2)
    assert st.count == 4 and st.ppl == pytest.approx(math.exp(mean))
    assert st.ppl_err == pytest.approx(math.exp(mean) * math.sqrt(var / 3))


def test_logprob_rows_round_trip():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 301, generator=g) * 4
    logits[0] = 0.0  # a flat row: scale 0, every log-prob the same
    rows = P.encode_logprobs(logits)
    assert rows.dtype == np.dtype("<u2") and rows.shape == (5, P.row_width(301)) == (5, 306)
    lp = P.decode_logprobs(rows, 301)
    ref = torch.log_softmax(logits, -1)
    keep = ref > ref.max(dim=1, keepdim=True).values - P.FLOOR_NATS
    assert (lp - ref)[keep].abs().max() < 2e-4  # half a step of 16 nats / 65535
    assert torch.allclose(lp[0], ref[0], atol=1e-6)


def test_ppl_and_base_file(models, text_file, capsys, tmp_path):
    base = tmp_path / "base.kl"
    out = _run(capsys, "-m", models["f32"], "-f", text_file, "-c", N_CTX, "--chunks", 3,
               "--kl-divergence-base", base)
    assert re.fullmatch(r"\[1\][0-9.]+,\[2\][0-9.]+,\[3\][0-9.]+,\nFinal estimate: PPL = [0-9.]+ \+/- [0-9.]+\n",
                        out), out
    raw = base.read_bytes()
    assert raw[:8] == b"_logits_"
    n_ctx, n_vocab, n_chunk = np.frombuffer(raw[8:20], dtype="<i4")
    assert (n_ctx, n_vocab, n_chunk) == (N_CTX, 512, 3)
    assert len(raw) == 20 + 4 * N_CTX * 3 + 2 * 3 * (N_CTX - 1 - N_CTX // 2) * P.row_width(512)
    # the same numbers without saving
    assert _run(capsys, "-m", models["f32"], "-f", text_file, "-c", N_CTX, "--chunks", 3) == out


def test_kl_against_itself_and_q8(models, text_file, capsys, tmp_path):
    base = tmp_path / "base.kl"
    _run(capsys, "-m", models["f32"], "-f", text_file, "-c", N_CTX, "--chunks", 2, "--kl-divergence-base", base)

    def kl(model):
        out = _run(capsys, "-m", model, "--kl-divergence-base", base, "--kl-divergence", "-f", text_file)
        kld = float(re.search(r"Mean KLD +: +(-?[0-9.]+) \+/-", out).group(1))
        top = float(re.search(r"Same top p +: +([0-9.]+) \+/-", out).group(1))
        return kld, top

    kld, top = kl(models["f32"])
    assert abs(kld) < 1e-5 and top == 100.0  # only the file's uint16 rounding of the base log-probs
    kld_q, top_q = kl(models["q8_0"])
    assert 1e-5 < kld_q < 0.05 and top_q > 80.0
    # --chunks limits the comparison to the first chunks of the base
    out = _run(capsys, "-m", models["q8_0"], "--kl-divergence-base", base, "--kl-divergence", "--chunks", 1)
    assert re.match(r"\[1\][0-9.]+,\n", out), out


def test_bad_input(models, text_file, capsys, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("a few words only")
    assert "needs at least 64" in _error(capsys, "-m", models["f32"], "-f", short, "-c", N_CTX)
    assert "larger than the model's context of 512" in _error(capsys, "-m", models["f32"], "-f", text_file,
                                                              "-c", 4096)
    assert "-f/--file is required" in _error(capsys, "-m", models["f32"])
    missing = tmp_path / "nope.txt"
    assert "cannot read" in _error(capsys, "-m", models["f32"], "-f", missing)
    junk = tmp_path / "junk.kl"
    junk.write_bytes(b"not a logits file at all")
    assert "not a logits file" in _error(capsys, "-m", models["f32"], "--kl-divergence-base", junk,
                                         "--kl-divergence")
    # a base of another chunking, another vocabulary, another text
    base = tmp_path / "base.kl"
    _run(capsys, "-m", models["f32"], "-f", text_file, "-c", N_CTX, "--chunks", 2, "--kl-divergence-base", base)
    assert "computed with -c 32, not 64" in _error(capsys, "-m", models["f32"], "--kl-divergence-base", base,
                                                   "--kl-divergence", "-c", 64)
    # -c 0 is the model's context: said as such (it read "not 0")
    assert "computed with -c 32, not 0 (the model's context, 512): the chunks" in _error(
        capsys, "-m", models["f32"], "--kl-divergence-base", base, "--kl-divergence", "-c", 0)
    assert "another text or another tokenizer" in _error(capsys, "-m", models["f32"], "--kl-divergence-base",
                                                         base, "--kl-divergence", "-f", short)
    other = tmp_path / "other.kl"
    other.write_bytes(base.read_bytes()[:8] + np.array([N_CTX, 8192, 2], dtype="<i4").tobytes()
                      + base.read_bytes()[20:20 + 4 * 2 * N_CTX])
    with open(other, "ab") as f:  # the log-probs as long as the header says: a whole file of another model
        f.write(bytes(2 * 2 * P.scored(N_CTX)[1] * P.row_width(8192)))
    assert "another model family" in _error(capsys, "-m", models["f32"], "--kl-divergence-base", other,
                                            "--kl-divergence")
    cut = tmp_path / "cut.kl"
    cut.write_bytes(base.read_bytes()[:-100])
    assert "truncated" in _error(capsys, "-m", models["f32"], "--kl-divergence-base", cut, "--kl-divergence")


def _ppl(out: str) -> float:
    return float(re.search(r"Final estimate: PPL = ([0-9.]+)", out).group(1))


def test_pieces_and_tiered_experts_give_the_same_ppl(models, text_file, capsys):
    """A MoE model: chunks run in pieces of 5 tokens (not aligned with the scored half) and with tiered experts
    (a cache of 3 of 8 experts per layer) score what one forward per chunk with resident experts does."""
    common = ["-m", models["moe.f32"], "-f", text_file, "-c", N_CTX, "--chunks", 2]
    whole = _ppl(_run(capsys, *common))
    assert _ppl(_run(capsys, *common, "--prefill-chunk", 5)) == pytest.approx(whole, rel=1e-5)
    tiered = _run(capsys, *common, "--prefill-chunk", 5, "--experts", "tiered", "--expert-slots", 3)
    assert _ppl(tiered) == pytest.approx(whole, rel=1e-5)


def test_base_path_checked_before_computing(models, text_file, capsys, tmp_path):
    d = tmp_path / "somedir"
    d.mkdir()
    args = ("-m", models["f32"], "-f", text_file, "-c", N_CTX, "--chunks", 1, "--kl-divergence-base")

    def _error(capsys, *argv) -> str:  # the only line: the run never got as far as loading the model
        capsys.readouterr()
        assert main(["perplexity", "--device", "cpu", *map(str, argv)]) == 1
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert line.startswith("strata: error: ")
        return line
    assert "is a directory" in _error(capsys, *args, d)
    assert "nowhere does not exist" in _error(capsys, *args, tmp_path / "nowhere" / "base.kl")
    (tmp_path / "afile").write_text("x")
    assert "afile is not a directory" in _error(capsys, *args, tmp_path / "afile" / "base.kl")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "somedir"] and not list(d.iterdir())


def test_base_write_error_is_one_line_and_leaves_nothing(models, text_file, tmp_path):
    # A file size limit cuts the write short part-way, as a full disk does (root ignores permissions).
    import resource
    import signal
    import subprocess
    import sys

    def small_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG from write(), not death by signal
        resource.setrlimit(resource.RLIMIT_FSIZE, (8 << 10, 8 << 10))

    base = tmp_path / "out" / "base.kl"
    base.parent.mkdir()
    r = subprocess.run([sys.executable, "-B", "-m", "strata", "perplexity", "--device", "cpu", "--dtype", "f32",
                        "-m", str(models["f32"]), "-f", str(text_file), "-c", str(N_CTX), "--chunks", "3",
                        "--kl-divergence-base", str(base)], capture_output=True, text=True, timeout=300,
                       preexec_fn=small_files)
    assert r.returncode == 1, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"strata: error: cannot write {base}: ") and "Traceback" not in r.stderr, r.stderr
    assert list(base.parent.iterdir()) == []


def test_the_text_is_read_as_llama_perplexity_reads_it(models, text_file, capsys, tmp_path):
    """-f is scored byte for byte as llama-perplexity reads it: CRLF line ends kept (they are tokens; newline
    translation turned them into LF), one trailing newline dropped, and each byte that is not valid UTF-8 one
    U+FFFD (a truncated multi-byte character too: llama.cpp replaces it byte by byte). The base file holds the
    tokens the run scored."""
    from strata.gguf.reader import open_gguf
    from strata.gguf.tokenizer import Tokenizer

    lines = text_file.read_text().splitlines()
    raw = b"start \xe2\x82 \xff\xfe.\r\n" + "\r\n".join(lines).encode() + b"\n"
    f = tmp_path / "crlf.txt"
    f.write_bytes(raw)
    base = tmp_path / "base.kl"
    _run(capsys, "-m", models["f32"], "-f", f, "-c", N_CTX, "--kl-divergence-base", base)
    tok = Tokenizer.from_metadata(open_gguf(models["f32"]).metadata)
    want = P.tokenize(tok, "start \ufffd\ufffd \ufffd\ufffd.\r\n" + "\r\n".join(lines))
    got = np.frombuffer(base.read_bytes()[20:], dtype="<i4", count=len(want) // N_CTX * N_CTX).tolist()
    assert got == want[:len(got)] and len(got) == len(want) // N_CTX * N_CTX


def test_c_0_is_the_models_context(text_file, capsys, tmp_path):
    """-c 0 means the model's own context, as llama-perplexity reads it (it ran chunks of the default 512 instead);
    a KL run's -c 0 must match its base's chunks as any other -c. The embedded model: a context of 2048."""
    long = tmp_path / "long.txt"
    long.write_text(text_file.read_text() * 8)
    base = tmp_path / "base.kl"
    _run(capsys, "-f", long, "-c", 0, "--chunks", 1, "--kl-divergence-base", base)
    assert np.frombuffer(base.read_bytes()[8:12], dtype="<i4")[0] == 2048
    assert "computed with -c 2048, not 512" in _error(capsys, "--kl-divergence-base", base, "--kl-divergence",
                                                      "-c", 512)
    out = _run(capsys, "--kl-divergence-base", base, "--kl-divergence", "-c", 0)
    assert re.match(r"\[1\]-?[0-9.]+,\n", out), out


def test_truncated_base_refused_before_computing(models, text_file, capsys, tmp_path):
    """A base file cut short is refused from its size before the model loads (it ran every chunk the file still
    held, then failed part-way through the scores line)."""
    base = tmp_path / "base.kl"
    _run(capsys, "-m", models["f32"], "-f", text_file, "-c", N_CTX, "--chunks", 3, "--kl-divergence-base", base)
    cut = tmp_path / "cut.kl"
    cut.write_bytes(base.read_bytes()[:-100])
    capsys.readouterr()
    assert main(["perplexity", "--device", "cpu", "-m", str(models["f32"]), "--kl-divergence-base", str(cut),
                 "--kl-divergence"]) == 1
    out, err = capsys.readouterr()
    (line,) = err.strip().splitlines()
    assert out == "" and line.startswith(f"strata: error: {cut}: a truncated or damaged logits file"), (out, err)
    assert f"{len(base.read_bytes()) - 100} bytes" in line


def test_base_needs_room_on_disk(models, text_file, capsys, tmp_path, monkeypatch):
    """The base file's size is known before the first chunk: a disk without room for it is an error before the
    model loads (it computed until the disk filled). 10 kB free; 3 chunks of 32 over 512 tokens take 46 kB."""
    import shutil

    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=10_000))
    base = tmp_path / "base.kl"
    capsys.readouterr()
    assert main(["perplexity", "--device", "cpu", "-m", str(models["f32"]), "-f", str(text_file), "-c", str(N_CTX),
                 "--chunks", "3", "--kl-divergence-base", str(base)]) == 1
    out, err = capsys.readouterr()
    (line,) = err.strip().splitlines()
    want = P.base_file_bytes(N_CTX, 512, 3)
    assert out == "" and line == (f"strata: error: not enough free disk for {base}: the log-probs of 3 chunks take "
                                  f"{want / 1e6:.1f} MB, {tmp_path} has 0.0 MB free (--chunks N saves fewer)"), line
    assert not list(tmp_path.iterdir())


def test_base_is_never_an_input(models, text_file, capsys, tmp_path):
    """--kl-divergence-base FILE writes FILE: given the -f text or the model (a mistyped flag), the run is refused
    and the file kept (the text was replaced by a logits file)."""
    text = tmp_path / "text.txt"
    text.write_bytes(text_file.read_bytes())
    model = tmp_path / "m.gguf"
    model.write_bytes(models["f32"].read_bytes())
    for base, what in ((text, "-f"), (model, "the model")):
        line = _error(capsys, "-m", model, "-f", text, "-c", N_CTX, "--chunks", 1, "--kl-divergence-base", base)
        assert line == (f"strata: error: --kl-divergence-base {base} is {what} of this run: it would be "
                        "overwritten with the log-probs (give another file)"), line
    assert text.read_bytes() == text_file.read_bytes() and model.read_bytes() == models["f32"].read_bytes()


def test_llama_perplexity_batch_flag(models, text_file, capsys):
    """llama-perplexity's -b/--batch-size is taken (it was an unknown flag): the tokens per forward, as
    --prefill-chunk; the score is the same."""
    common = ["-m", models["f32"], "-f", text_file, "-c", N_CTX, "--chunks", 2]
    whole = _ppl(_run(capsys, *common))
    for flag in ("-b", "--batch-size"):
        capsys.readouterr()
        assert main(["perplexity", "--device", "cpu", "--dtype", "f32", *map(str, common), flag, "5"]) == 0
        out, err = capsys.readouterr()
        assert "5 tokens per forward" in err and _ppl(out) == pytest.approx(whole, rel=1e-5), err
    assert "--prefill-chunk must be >= 0" in _error(capsys, *common, "-b", -3)


def test_damaged_base_header_is_one_line(models, text_file, capsys, tmp_path):
    """Header counts no file could hold (a huge -c and chunk count, a negative count) are one error line (they
    were an OverflowError and a ValueError traceback, from reading that many tokens)."""
    import struct

    base = tmp_path / "base.kl"
    _run(capsys, "-m", models["f32"], "-f", text_file, "-c", N_CTX, "--chunks", 2, "--kl-divergence-base", base)
    data = base.read_bytes()
    for (n_ctx, n_vocab, n_chunk), want in (((2**31, 512, 2**30), "a truncated or damaged logits file"),
                                            ((N_CTX, 512, -3), "its header says -c 32, 512 tokens, -3 chunks")):
        bad = tmp_path / "bad.kl"
        bad.write_bytes(data[:8] + struct.pack("<Iii", n_ctx, n_vocab, n_chunk) + data[20:])
        assert want in _error(capsys, "-m", models["f32"], "--kl-divergence-base", bad, "--kl-divergence")


def test_base_written_under_a_name_of_its_own(models, text_file, capsys, tmp_path):
    """The base file is written under a temporary name of the run's own, then renamed: a BASE.tmp already there
    (another run's file in progress) is left as it is (it was truncated, filled, and renamed as the base)."""
    base = tmp_path / "base.kl"
    other = tmp_path / "base.kl.tmp"
    other.write_bytes(b"another run's file")
    _run(capsys, "-m", models["f32"], "-f", text_file, "-c", N_CTX, "--chunks", 1, "--kl-divergence-base", base)
    assert other.read_bytes() == b"another run's file" and base.read_bytes()[:8] == P.MAGIC
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base.kl", "base.kl.tmp"]


def test_scores_line_ends_when_a_run_fails(models, text_file, capsys, tmp_path):
    """A run that fails part-way ends its `[i]score,` line, so the error is said on a line of its own (it was
    written after the last score). Here the base file is cut after it was opened, as a disk gone bad would."""
    import io

    from strata.config import EngineConfig
    from strata.engine.engine import Engine
    from strata.engine.loader import load_model

    base = tmp_path / "base.kl"
    _run(capsys, "-m", models["f32"], "-f", text_file, "-c", N_CTX, "--chunks", 3, "--kl-divergence-base", base)
    b = P.BaseFile.open(str(base))
    with open(base, "r+b") as f:
        f.truncate(base.stat().st_size - 100)
    runner = P.ChunkRunner(Engine(load_model(str(models["f32"]), EngineConfig(device="cpu", dtype="float32",
                                                                              ctx_size=N_CTX)), n_slots=1))
    out = io.StringIO()
    with pytest.raises(StrataError, match="chunk 3 are missing"):
        P.run_kl(runner, b, 3, None, out=out)
    b.f.close()
    assert re.fullmatch(r"\[1\]-?[0-9.]+,\[2\]-?[0-9.]+,\n", out.getvalue()), out.getvalue()


def test_base_of_a_longer_context_names_the_file(models, capsys, tmp_path):
    """A base computed with a -c past this model's context (another model's base) is refused naming the file's
    -c, not as a "-c 1024" the user never typed."""
    base = tmp_path / "long.kl"
    with open(base, "wb") as f:
        P.write_header(f, 1024, 512, 1, [7] * 1024)
        f.write(bytes(2 * P.scored(1024)[1] * P.row_width(512)))
    assert _error(capsys, "-m", models["f32"], "--kl-divergence-base", base, "--kl-divergence") == (
        f"strata: error: {base} was computed with -c 1024, larger than {models['f32']}'s context of 512: a base "
        "from another model")
