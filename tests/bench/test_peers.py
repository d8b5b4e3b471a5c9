"""The peers' plumbing: --n-cpu-moe fitted to a VRAM budget (checked against llama.cpp's measured peak VRAM in
BENCH.md), llama-bench's command line and JSON, the transformers script's command line."""

import json
from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

from strata import StrataError
from strata.bench.peers import llamacpp
from strata.bench.peers.hf import SCRIPT, hf_argv

Q = GGMLQuantizationType
GiB = 1 << 30
DATA = Path(__file__).parent / "data"


def header_only_gguf(path: Path, layers: int = 48, experts: int = 128, k: int = 8, d: int = 2048, ff: int = 768,
                     heads: int = 32, kv_heads: int = 4, head_dim: int = 128, vocab: int = 151936) -> Path:
    """A GGUF file with Qwen3-30B-A3B's tensor table (BENCH.md's B1: experts Q4_K, attention and embeddings Q8_0,
    head Q6_K) and no tensor data: everything the fit reads, in 1 MB instead of 18 GB."""
    w = GGUFWriter(str(path), "qwen3moe")
    w.add_block_count(layers)
    w.add_context_length(40960)
    w.add_embedding_length(d)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_expert_count(experts)
    w.add_expert_used_count(k)

    def info(name, shape, q):  # shape in numpy order (the contiguous dimension last)
        bs, ts = GGML_QUANT_SIZES[q]
        byte_shape = (*shape[:-1], shape[-1] // bs * ts)
        w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=q)

    info("token_embd.weight", (vocab, d), Q.Q8_0)
    info("output_norm.weight", (d,), Q.F32)
    info("output.weight", (vocab, d), Q.Q6_K)
    for i in range(layers):
        b = f"blk.{i}."
        info(b + "attn_q.weight", (heads * head_dim, d), Q.Q8_0)
        info(b + "attn_k.weight", (kv_heads * head_dim, d), Q.Q8_0)
        info(b + "attn_v.weight", (kv_heads * head_dim, d), Q.Q8_0)
        info(b + "attn_output.weight", (d, heads * head_dim), Q.Q8_0)
        for n in ("attn_q_norm", "attn_k_norm"):
            info(b + n + ".weight", (head_dim,), Q.F32)
        for n in ("attn_norm", "ffn_norm"):
            info(b + n + ".weight", (d,), Q.F32)
        info(b + "ffn_gate_inp.weight", (experts, d), Q.F32)
        info(b + "ffn_gate_exps.weight", (experts, ff, d), Q.Q4_K)
        info(b + "ffn_up_exps.weight", (experts, ff, d), Q.Q4_K)
        info(b + "ffn_down_exps.weight", (experts, d, ff), Q.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def b1(tmp_path_factory):
    return header_only_gguf(tmp_path_factory.mktemp("b1") / "qwen3-30b-a3b-synth.gguf")


def test_layer_sizes_of_b1(b1):
    s = llamacpp.layer_sizes(b1)
    assert s.n_layers == 48 and sorted(s.expert_bytes) == list(range(48))
    per_expert = s.expert_bytes[0] / 128
    assert per_expert / 1e6 == pytest.approx(2.65, abs=0.01)  # BENCH.md: 2.65 MB per expert
    total = s.dense_gpu_bytes + s.host_only_bytes + sum(s.expert_bytes.values())
    assert total / 1e9 == pytest.approx(17.99, rel=0.01)  # BENCH.md: a 17.99 GB file
    assert s.kv_bytes_per_token == 48 * 4 * 128 * 2 * 2  # K and V, f16


@pytest.mark.parametrize("n_cpu_moe, measured_gib", [(0, 17.9), (24, 9.9), (36, 6.2), (48, 2.7)])
def test_vram_estimate_matches_llamacpps_measured_peak(b1, n_cpu_moe, measured_gib):
    """BENCH.md measured llama.cpp's peak VRAM on this model with llama-bench (pp512 / tg128) at four settings;
    the fit's estimate must be within 6% of each (and never far under: an underestimate breaks the budget)."""
    est = llamacpp.layer_sizes(b1).vram(n_cpu_moe, ctx=512 + 128, overhead=int(llamacpp.DEFAULT_OVERHEAD_GIB * GiB))
    assert est / GiB == pytest.approx(measured_gib, rel=0.06)
    assert est / GiB > measured_gib * 0.98


def test_fit_n_cpu_moe_to_a_budget(b1):
    s = llamacpp.layer_sizes(b1)
    n, est = llamacpp.fit_n_cpu_moe(s, 8 * GiB, ctx=4096 + 128)
    assert est <= 8 * GiB < s.vram(n - 1, 4096 + 128, int(llamacpp.DEFAULT_OVERHEAD_GIB * GiB))  # the smallest N
    assert 28 <= n <= 34  # BENCH.md: about 30 layers' experts on the CPU at 8 GiB
    assert llamacpp.fit_n_cpu_moe(s, 40 * GiB, ctx=640)[0] == 0  # everything fits
    with pytest.raises(StrataError, match="every expert on the CPU"):
        llamacpp.fit_n_cpu_moe(s, 2 * GiB, ctx=640)


def test_fit_refuses_a_dense_model(tmp_path):
    w = GGUFWriter(str(tmp_path / "dense.gguf"), "llama")
    w.add_block_count(1)
    w.add_tensor_info("blk.0.ffn_up.weight", (64, 64), np.dtype(np.float32), 64 * 64 * 4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    with pytest.raises(StrataError, match="not a MoE model"):
        llamacpp.layer_sizes(tmp_path / "dense.gguf")


def test_llama_bench_command_lines():
    pp = llamacpp.llama_bench_argv(Path("/x/llama-bench"), "m.gguf", n_cpu_moe=30, threads=16, prompts=[512, 4096])
    s = " ".join(pp)
    for flag in ("-ngl 99", "-fa 1", "-lm none", "-t 16", "-ncmoe 30", "-p 512,4096 -n 0", "-o json", "-r 3"):
        assert flag in s
    tg = llamacpp.llama_bench_argv(Path("/x/llama-bench"), "m.gguf", n_cpu_moe=0, threads=8, gen=128,
                                   depths=[1024, 4096])
    s = " ".join(tg)
    assert "-p 0 -n 128 -d 1024,4096" in s and "-ncmoe" not in s and "-ctk" not in s
    kv = llamacpp.llama_bench_argv(Path("/x/llama-bench"), "m.gguf", n_cpu_moe=4, threads=8, gen=128, depths=[131072],
                                   cache_types=("q8_0", "q8_0"))
    assert "-ctk q8_0 -ctv q8_0" in " ".join(kv)  # the KV types the servers were given (a long context's own)


def test_parse_llama_bench_into_sweep_rows():
    """JSON as llama-bench -o json writes it (a CPU build of b11434 on the tiny model): prefill = pp L, decode =
    tg N at depth L."""
    records = json.loads((DATA / "llama-bench-tiny.json").read_text())
    lengths = sorted({r["n_prompt"] for r in records if r["n_gen"] == 0})
    gen = max(r["n_gen"] for r in records)
    suite = llamacpp.parse_llama_bench(records, lengths, gen)
    assert [r["length"] for r in suite["rows"]] == lengths
    for row in suite["rows"]:
        pp = next(r for r in records if r["n_prompt"] == row["length"] and r["n_gen"] == 0)
        tg = next(r for r in records if r["n_depth"] == row["length"] and r["n_gen"] == gen)
        assert row["prefill_tok_s"]["median"] == pytest.approx(float(np.median(pp["samples_ts"])))
        assert row["prefill_tok_s"]["n"] == len(pp["samples_ts"])
        assert row["decode_tok_s"]["median"] == pytest.approx(float(np.median(tg["samples_ts"])))
        assert min(tg["samples_ts"]) == row["decode_tok_s"]["min"]
    missing = llamacpp.parse_llama_bench(records, [lengths[0], 99999], gen)["rows"][1]
    assert missing["prefill_tok_s"]["n"] == 0  # not measured is shown as such, not as zero


def test_transformers_peer_command_line(tmp_path):
    assert SCRIPT.is_file()
    argv = hf_argv("m.gguf", tmp_path / "o.json", budget_gib=8.0, lengths=[1024, 4096], gen=32, runs=3)
    s = " ".join(argv)
    assert str(SCRIPT) in s and "--budget-gib 8.0" in s and "--lengths 1024,4096" in s and "--runs 3" in s


def test_a_fitted_peer_over_its_budget_runs_again_with_one_more_layer_on_the_cpu(b1, monkeypatch):
    """The fit's overhead is an estimate; when llama-bench's measured peak passes the budget, the peer is run again
    with one more expert layer in host memory until it fits, and the tries are reported. (llama-bench and the
    VRAM poll are stood in for: neither runs without the GPU build.)"""
    import subprocess

    runs: list[list[str]] = []

    def fake_run(argv, capture_output, text):
        runs.append(argv)
        n_gen = int(argv[argv.index("-n") + 1])
        rec = {"n_prompt": 0 if n_gen else 4096, "n_gen": n_gen, "n_depth": 1024 if n_gen else 0,
               "avg_ts": 100.0, "samples_ts": [100.0]}
        return subprocess.CompletedProcess(argv, 0, json.dumps([rec]), "")

    class Peak:  # 0.2 GiB less per layer moved to the CPU; over 8 GiB until -ncmoe reaches fitted + 2
        def __enter__(self):
            return self

        def __exit__(self, *a):
            n = int(runs[-1][runs[-1].index("-ncmoe") + 1])
            self.peak = int((8.3 - 0.2 * (n - first)) * GiB)

    sizes = llamacpp.layer_sizes(b1)
    first = llamacpp.fit_n_cpu_moe(sizes, 8 * GiB, 4096 + 256)[0]
    monkeypatch.setattr(llamacpp.subprocess, "run", fake_run)
    monkeypatch.setattr(llamacpp, "VramPeak", Peak)
    res = llamacpp.run_llama_bench(Path("llama-bench"), str(b1), budget_gib=8, lengths=[4096], gen=256, threads=4,
                                   log=lambda m: None)
    assert res["n_cpu_moe"] == first + 2 and not res["over_budget"]
    assert [t["n_cpu_moe"] for t in res["fit"]["tried"]] == [first, first + 1]
    assert len(runs) == 6  # prefill and decode, three times
    # a given N is run as given, over the budget or not
    runs.clear()
    res = llamacpp.run_llama_bench(Path("llama-bench"), str(b1), budget_gib=8, lengths=[4096], gen=256, threads=4,
                                   n_cpu_moe=first, log=lambda m: None)
    assert res["n_cpu_moe"] == first and res["over_budget"] and len(runs) == 2


def test_kv_cache_types_reach_the_peer(b1, tmp_path):
    """-ctk/-ctv (or --kv-dtype q8_0) given to the bench: llama-server gets the same types, and its fit counts its
    KV in them (q8_0: 34 bytes per 32 values, against f16's 64)."""
    import argparse

    from strata.bench.cli import peer_cache_types

    ns = argparse.Namespace
    assert peer_cache_types(ns(kv_dtype="auto", cache_type_k=None, cache_type_v=None)) is None
    assert peer_cache_types(ns(kv_dtype="q8_0", cache_type_k=None, cache_type_v=None)) == ("q8_0", "q8_0")
    assert peer_cache_types(ns(kv_dtype="bfloat16", cache_type_k="q4_0", cache_type_v=None)) == ("q4_0", "bf16")
    f16, q8 = llamacpp.layer_sizes(b1), llamacpp.layer_sizes(b1, ("q8_0", "q8_0"))
    assert q8.kv_bytes_per_token * 64 == f16.kv_bytes_per_token * 34
    srv, how = llamacpp.llamacpp_server(str(b1), tmp_path / "log", parallel=1, ctx=1024, threads=2, n_cpu_moe=30,
                                        binary=tmp_path / "llama-server", cache_types=("q8_0", "q8_0"))
    assert "-ctk q8_0 -ctv q8_0" in how and "--n-cpu-moe 30" in how


def test_a_context_past_the_trained_one_reaches_llama_server(b1, tmp_path):
    """llama-server caps a slot at the GGUF's trained context ("the slot context ... exceeds the training context
    of the model - capping") and then refuses longer prompts: past it, the bench raises the GGUF's context_length
    for it, as strata's server takes the same -c; at or under it, llama-server's argv is unchanged."""
    from strata.hub.verify import read_gguf_header

    header = read_gguf_header(b1)
    trained = int(header.arch_value("context_length"))
    key = f"{header.architecture}.context_length"
    assert llamacpp.context_override(b1, trained) == []
    assert llamacpp.context_override(b1, trained + 256) == ["--override-kv", f"{key}=int:{trained + 256}"]
    srv, how = llamacpp.llamacpp_server(str(b1), tmp_path / "log", parallel=2, ctx=trained + 256, threads=2,
                                        binary=tmp_path / "llama-server")
    assert f"-c {2 * (trained + 256)} -np 2" in how and f"--override-kv {key}=int:{trained + 256}" in how
    _, how = llamacpp.llamacpp_server(str(b1), tmp_path / "log", parallel=1, ctx=trained, threads=2,
                                      binary=tmp_path / "llama-server")
    assert "--override-kv" not in how


def test_the_peer_fit_counts_the_kv_its_servers_get():
    """llama.cpp's --n-cpu-moe is fitted for the KV its servers hold: -c where given (past the trained context:
    a 128K run was once fitted for the trained 40,960 tokens and its llama-server used 4.4 GiB over the budget), and
    a concurrency phase's context per slot times its slots."""
    from strata.bench.cli import Plan, peer_kv_tokens
    from strata.cli import build_parser

    def kv(*argv):
        args = build_parser().parse_args(["bench", *argv, "-m", "x.gguf"])
        return peer_kv_tokens(args, Plan(args), 40960)

    assert kv("sweep", "--lengths", "128K", "-c", "131328") == 131328
    assert kv("sweep", "--lengths", "1K") == 1280  # (1K + 128 generated + 64, in whole 256s)
    assert kv("sweep", "--lengths", "32K", "--gen", "128") == 33024
    conc = kv("concurrency", "--workers", "1,4")
    args = build_parser().parse_args(["bench", "concurrency", "--workers", "1,4", "-m", "x.gguf"])
    assert conc == 4 * Plan(args).conc_ctx(40960)
    assert kv("sweep", "concurrency", "--workers", "1,4", "-c", "8192") == 4 * 8192
