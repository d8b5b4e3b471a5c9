"""`strata check`: machine probing, the model footprint from GGUF tensor tables, the fit verdict."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from strata.cli import main
from strata.experts.sizing import chunk_stage_experts, prefill_bytes_per_token
from strata.hub.check import (
    DEFAULT_CTX,
    RAM_HEADROOM,
    CUDA_CONTEXT_ESTIMATE,
    VRAM_RESERVE,
    GiB,
    MiB,
    ModelFootprint,
    fit,
    kv_bytes_per_token,
    model_footprint,
)
from strata.hub.machine import CPUInfo, GPUInfo, MachineInfo, parse_cpuinfo, probe
from strata.hub.verify import GGUFHeader

from .conftest import split_set, write_gguf

X86 = """processor	: 0
vendor_id	: AuthenticAMD
model name	: AMD Ryzen 9 9950X 16-Core Processor
flags		: fpu sse4_2 avx avx2 fma f16c avx512f avx512bw avx512vl avx512_bf16 avx512_vnni
processor	: 1
model name	: ignored
"""
ARM = """processor	: 0
BogoMIPS	: 50.00
Features	: fp asimd evtstrm aes asimdhp asimddp sve i8mm bf16
CPU implementer	: 0x41
"""


def test_parse_cpuinfo():
    model, flags = parse_cpuinfo(X86)
    assert model == "AMD Ryzen 9 9950X 16-Core Processor"
    assert {"avx2", "avx512f", "avx512_bf16"} <= flags and "amx_tile" not in flags
    _, flags = parse_cpuinfo(ARM)
    assert {"asimd", "sve", "i8mm"} <= flags


def test_pcie_warnings():
    g = GPUInfo(0, "RTX 4090", 24 * GiB, 23 * GiB, pcie_gen=4, pcie_gen_max=4, pcie_width=8, pcie_width_max=16)
    (w,) = g.pcie_warnings()
    assert "x8 but can do x16" in w and "50%" in w
    assert g.pcie_gbps() == pytest.approx(4 * 1.969 * 2) and g.pcie_gbps(current=False) == pytest.approx(16 * 1.969)
    assert GPUInfo(0, "x", 1, 1, 4, 4, 16, 16).pcie_warnings() == []
    assert "gen 1, maximum gen 4" in GPUInfo(0, "x", 1, 1, 1, 4, 16, 16).pcie_warnings()[0]
    assert GPUInfo(0, "x", 1, 1).pcie_warnings() == []  # NVML could not tell: no guess


def test_probe_this_machine(tmp_path):
    m = probe(tmp_path / "not" / "yet")
    assert m.ram_total > 0 and 0 < m.ram_available <= m.ram_total
    assert m.disk_path == str(tmp_path) and m.disk_free > 0
    assert m.cpu.cores_logical and m.cpu.model
    assert m.gpus or m.gpu_note  # either GPUs or the reason there are none


def _moe_gguf(path):
    """2 MoE layers of 4 experts (f16 gate/up/down [4, 8, 16]) + dense f32 tensors."""
    f16 = np.float16
    t = {"token_embd.weight": np.zeros((32, 16), np.float32), "output_norm.weight": np.zeros(16, np.float32)}
    for i in range(2):
        t[f"blk.{i}.attn_q.weight"] = np.zeros((16, 16), np.float32)
        t[f"blk.{i}.ffn_gate_inp.weight"] = np.zeros((4, 16), np.float32)  # router: dense
        t[f"blk.{i}.ffn_gate_exps.weight"] = np.zeros((4, 8, 16), f16)
        t[f"blk.{i}.ffn_up_exps.weight"] = np.zeros((4, 8, 16), f16)
        t[f"blk.{i}.ffn_down_exps.weight"] = np.zeros((4, 16, 8), f16)
    kv = {
        "qwen3moe.block_count": 2,
        "qwen3moe.expert_count": 4,
        "qwen3moe.expert_used_count": 2,
        "qwen3moe.embedding_length": 16,
        "qwen3moe.attention.head_count": 4,
        "qwen3moe.attention.head_count_kv": 2,
        "qwen3moe.context_length": 4096,
    }
    return write_gguf(path, t, kv)


def test_model_footprint(tmp_path):
    fp = model_footprint([_moe_gguf(tmp_path / "m.gguf")])
    expert = 2 * 3 * 4 * 8 * 16 * 2  # layers x (gate, up, down) x elements x f16
    dense = 4 * (32 * 16 + 16 + 2 * (16 * 16 + 4 * 16))
    assert (fp.expert_bytes, fp.dense_bytes, fp.total_bytes) == (expert, dense, expert + dense)
    assert (fp.n_expert, fp.n_expert_used, fp.n_moe_layers, fp.n_expert_total) == (4, 2, 2, 8)
    assert fp.slot_bytes == 3 * 8 * 16 * 2  # one expert of one layer: its gate, up and down rows
    assert fp.kv_bytes_per_token == 2 * 2 * (4 + 4) * 2  # layers x kv heads x (k + v head dim) x f16
    assert fp.context_length == 4096 and fp.architecture == "qwen3moe"
    assert fp.expert_formats == {"F16": expert} and fp.dense_formats == {"F32": dense}  # bytes per format


def _header(**arch) -> GGUFHeader:
    return GGUFHeader(None, 0, 0, 32, {"general.architecture": "a", **{f"a.{k}": v for k, v in arch.items()}})


def test_kv_bytes_variants():
    # explicit key/value lengths (Qwen3: head_dim 128 while embedding/heads = 64)
    assert kv_bytes_per_token(_header(block_count=48, embedding_length=2048, **{"attention.head_count": 32,
        "attention.head_count_kv": 4, "attention.key_length": 128, "attention.value_length": 128})
    ) == 48 * 4 * 256 * 2  # fmt: skip
    # per-layer kv heads, 0 for layers without attention
    assert kv_bytes_per_token(_header(block_count=4, embedding_length=64, **{"attention.head_count": 4,
        "attention.head_count_kv": [2, 0, 0, 2]})) == 4 * 32 * 2  # fmt: skip
    # hybrid: one attention layer in four
    assert kv_bytes_per_token(_header(block_count=48, embedding_length=2048, full_attention_interval=4, **{
        "attention.head_count": 16, "attention.head_count_kv": 2, "attention.key_length": 256,
        "attention.value_length": 256})) == 12 * 2 * 512 * 2  # fmt: skip
    # MLA: compressed latent + rope part
    assert kv_bytes_per_token(_header(block_count=61, embedding_length=7168, **{"attention.head_count": 128,
        "attention.kv_lora_rank": 512, "rope.dimension_count": 64})) == 61 * 576 * 2  # fmt: skip


def _machine(vram_free=None, ram_avail=64 * GiB, ram_total=64 * GiB) -> MachineInfo:
    gpus = [GPUInfo(0, "GPU", 24 * GiB, vram_free, 4, 4, 16, 16)] if vram_free is not None else []
    return MachineInfo(gpus, None if gpus else "none", ram_total, ram_avail, CPUInfo("cpu", 8, 16), "/", 100 * GiB)


# A Qwen3-30B-A3B-shaped footprint: 48 MoE layers x 128 experts.
QWEN = ModelFootprint(
    files=["q.gguf"], architecture="qwen3moe", total_bytes=int(17.5 * GiB), dense_bytes=int(1.5 * GiB),
    expert_bytes=16 * GiB, n_expert=128, n_expert_used=8, n_moe_layers=48, slot_bytes=16 * GiB // (48 * 128),
    kv_bytes_per_token=48 * 4 * 256 * 2, context_length=40960,
)  # fmt: skip


STAGING = 16 * QWEN.slot_bytes  # max(2 * top-k, 8) experts
PER_SLOT = 16 * GiB // 128  # one slot per layer holds one expert of each of the 48 layers


def test_fit_gpu():
    f = fit(QWEN, _machine(vram_free=8 * GiB), ctx=32768)
    kv = 32768 * 98304
    need = int(1.5 * GiB) + kv + VRAM_RESERVE + STAGING + CUDA_CONTEXT_ESTIMATE
    assert (f.mode, f.ok, f.kv_bytes, f.vram_needed, f.vram_budget) == ("gpu", True, kv, need, 8 * GiB)
    spare = 8 * GiB - need
    chunk = 2 * chunk_stage_experts(spare, QWEN.slot_bytes, 128) * QWEN.slot_bytes  # the prefill chunk buffers
    assert chunk == 2 * (spare // 16 // QWEN.slot_bytes) * QWEN.slot_bytes  # a sixteenth of the spare each
    assert f.slots == (spare - chunk) // PER_SLOT == 12
    assert f.slots_share == pytest.approx(12 / 128)
    assert f.ram_needed == 16 * GiB + RAM_HEADROOM
    # a budget past the whole model: every expert gets a slot, no more
    assert fit(QWEN, _machine(vram_free=8 * GiB), 4096, vram_budget=40 * GiB).slots == 128
    assert fit(QWEN, _machine(vram_free=8 * GiB)).ctx == 8192  # the engine's default context


def test_fit_gpu_leaves_room_for_a_prefill_chunk():
    """As the engine on a GPU: a 4096-token prefill chunk's activations come out of the budget (hidden 2048,
    top-8: 238 KB a token, 0.91 GiB), so a 4K prompt streams each uncached expert once."""
    import dataclasses

    from strata.experts.sizing import PREFILL_TARGET, prefill_bytes_per_token

    q = dataclasses.replace(QWEN, d_model=2048)
    assert prefill_bytes_per_token(2048, 8) == 2048 * 116 and PREFILL_TARGET == 4096
    f0, f = fit(QWEN, _machine(vram_free=8 * GiB), ctx=8192), fit(q, _machine(vram_free=8 * GiB), ctx=8192)
    from strata.experts.sizing import prefill_chunk_for

    chunk = prefill_chunk_for(8 * GiB - f0.vram_needed, 2048 * 116)  # a third of what is left holds 4096 tokens
    assert chunk == 4096 and f.vram_needed - f0.vram_needed == chunk * 2048 * 116
    assert (f.prefill_chunk, f.prefill_bytes) == (chunk, chunk * 2048 * 116)
    assert f.slots < f0.slots
    short = fit(q, _machine(), 8192, vram_budget=2 * GiB)
    assert not short.ok and "256-token prefill chunk" in short.reasons[0]


def test_fit_vram_short_says_what_fits():
    f = fit(QWEN, _machine(vram_free=8 * GiB), ctx=65536, vram_budget=6 * GiB)
    assert not f.ok and f.slots == 0 and "VRAM: needs" in f.reasons[0]
    max_ctx = (6 * GiB - int(1.5 * GiB) - VRAM_RESERVE - STAGING - CUDA_CONTEXT_ESTIMATE) // 98304
    assert f"-c {max_ctx // 256 * 256} fits" in " ".join(f.fixes)
    assert fit(QWEN, _machine(), max_ctx // 256 * 256, vram_budget=6 * GiB).ok
    assert not fit(QWEN, _machine(), max_ctx + 1, vram_budget=6 * GiB).ok


def test_fit_vram_short_names_the_compact_kv_type_that_fits():
    """A context whose f16 KV overflows the budget: the first compact type (q8_0, else q4_0) that holds it is named,
    and with it the model fits."""
    import dataclasses

    per = {"q8_0": 98304 * 34 // 64, "q4_0": 98304 * 18 // 64}  # a block of 32 values: 34 and 18 bytes for f16's 64
    q = dataclasses.replace(QWEN, kv_compact_bytes=per)
    for ctx, want in ((40960, "q8_0"), (65536, "q4_0")):
        f = fit(q, _machine(), ctx, vram_budget=6 * GiB)
        assert not f.ok
        hint = next(x for x in f.fixes if "compact KV" in x)
        assert f"-ctk {want} -ctv {want}" in hint, f.fixes
        assert fit(dataclasses.replace(q, kv_bytes_per_token=per[want]), _machine(), ctx, vram_budget=6 * GiB).ok
    # none named where even q4_0 cannot hold it
    assert not any("compact KV" in x for x in fit(q, _machine(), 262144, vram_budget=6 * GiB).fixes)


def test_footprint_counts_the_compact_kv_types():
    from pathlib import Path

    from strata.hub.check import model_footprint
    from strata.models.default import default_model_path

    fp = model_footprint([Path(default_model_path())])
    assert fp.kv_compact_bytes["q4_0"] < fp.kv_compact_bytes["q8_0"] < fp.kv_bytes_per_token


def test_engine_sizing_constants():
    from strata.config import EngineConfig, ExpertConfig

    assert VRAM_RESERVE == ExpertConfig().vram_reserve_mib * MiB
    assert EngineConfig().ctx_size == 0 and DEFAULT_CTX == 8192


def test_fit_ram_short():
    f = fit(QWEN, _machine(vram_free=24 * GiB, ram_avail=12 * GiB, ram_total=16 * GiB), ctx=8192)
    assert not f.ok and "RAM: needs 18.00 GiB" in f.reasons[0]
    assert "more RAM" in f.fixes[0]
    f = fit(QWEN, _machine(vram_free=24 * GiB, ram_avail=12 * GiB, ram_total=32 * GiB), ctx=8192)
    assert "close other programs" in f.fixes[0]


def test_fit_cpu_only():
    f = fit(QWEN, _machine(ram_avail=21 * GiB), ctx=8192)
    assert f.mode == "cpu" and f.ok and f.ram_needed == int(17.5 * GiB) + 8192 * 98304 + RAM_HEADROOM
    assert not fit(QWEN, _machine(ram_avail=16 * GiB), ctx=8192).ok


def test_a_context_past_the_trained_one_is_noted_with_or_without_a_gpu():
    """-c past the model's trained context runs (as llama.cpp runs it, with a warning): the verdict says it, on a
    CPU alone as with a GPU."""
    import dataclasses

    fp = dataclasses.replace(QWEN, context_length=4096)
    for machine in (_machine(), _machine(vram_free=24 * GiB)):
        f = fit(fp, machine, ctx=8192)
        assert f.ok and any("beyond the model's trained context of 4096" in n for n in f.notes), (f.mode, f.notes)
        assert not any("trained" in n for n in fit(fp, machine, ctx=4096).notes)


def test_fit_few_slots_noted():
    need = QWEN.dense_bytes + 4096 * 98304 + VRAM_RESERVE + STAGING + CUDA_CONTEXT_ESTIMATE
    f = fit(QWEN, _machine(), 4096, vram_budget=need + 6 * PER_SLOT)  # 3/4 of a slot go to the chunk buffers
    assert f.ok and f.slots == 5 and "fewer than the 8 experts each token uses" in f.notes[0]


def test_check_cli(tmp_path, capsys):
    m = _moe_gguf(tmp_path / "m.gguf")
    assert main(["check", "-m", str(m), "--vram-gb", "4", "-c", "1024", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fit"]["ok"] and out["fit"]["slots"] == 4 and out["model"]["n_expert"] == 4
    assert out["machine"]["ram_total"] > 0
    assert out["model"]["expert_formats"] == {"F16": 2 * 3 * 4 * 8 * 16 * 2}
    assert main(["check", "-m", str(m), "--vram-gb", "0.5"]) == 1  # below the reserve alone
    text = capsys.readouterr().out
    assert "verdict: it cannot run" in text and "would fit with:" in text
    assert "expert formats: F16 " in text and "dense formats: F32 " in text
    assert main(["check"]) == 0
    text = capsys.readouterr().out
    assert "RAM" in text and "SIMD" in text
    from strata.ops import cpu_native

    assert ("native kernel: built" in text) == (cpu_native.load() is not None)
    assert main(["check", "-m", "acme/absent:Q4_K_M", "--models-dir", str(tmp_path)]) == 1
    assert "strata pull acme/absent:Q4_K_M" in capsys.readouterr().err


def test_megabyte_constants():
    assert MiB * 1024 == GiB and VRAM_RESERVE == 700 * MiB


@pytest.mark.gpu
def test_probe_gpu():
    pytest.importorskip("pynvml")
    import torch

    m = probe(".")
    assert len(m.gpus) >= torch.cuda.device_count() >= 1, m.gpu_note
    g = m.gpus[0]
    assert 0 < g.vram_free <= g.vram_total
    if g.pcie_width_max is not None:  # NVML reports PCIe on discrete cards (not on SXM/NVLink-only boards)
        assert 1 <= (g.pcie_width or 0) <= g.pcie_width_max


def test_the_default_prefill_chunk_shrinks_on_a_small_budget():
    """4096 tokens while their activations take at most a third of what the chunk and the cache share; fewer, in
    multiples of 256 and never under 256, below that (the engine and `strata check` size it alike)."""
    from strata.experts.sizing import prefill_chunk_for

    bpt = prefill_bytes_per_token(2048, 8)
    assert prefill_chunk_for(3 * 4096 * bpt, bpt) == 4096 and prefill_chunk_for(10 * GiB, bpt) == 4096
    assert prefill_chunk_for(3 * 1000 * bpt, bpt) == 768
    assert prefill_chunk_for(0, bpt) == prefill_chunk_for(-GiB, bpt) == 256


def test_chunk_stage_sizing():
    """A chunk buffer: a sixteenth of what the cache would get, at most 256 MiB, at least one expert; a size set
    by hand (STRATA_CHUNK_STAGE_MIB) is taken as it is, past the share rule; the ring splits two buffers' worth."""
    from strata.experts.sizing import chunk_ring

    e = 2_650_000  # a B1 expert
    assert chunk_stage_experts(int(3.4 * GiB), e, 128) == int(3.4 * GiB / 16 // e)  # ~86
    assert chunk_stage_experts(100 * GiB, e, 128) == 256 * MiB // e  # the cap
    assert chunk_stage_experts(0, e, 128) == 1
    assert chunk_stage_experts(int(3.4 * GiB), e, 128, size_mib=280) == 280 * MiB // e  # past a sixteenth
    assert chunk_stage_experts(int(3.4 * GiB), e, 128, size_mib=10_000) == 128  # never more than the experts
    assert chunk_ring(79) == (2, 79) and chunk_ring(79, 8) == (8, 19) and chunk_ring(1, 8) == (2, 1)


def test_no_gpu_message_names_no_package_when_there_is_no_device(monkeypatch):
    """Without an NVIDIA device, `strata check` says so instead of suggesting NVML's Python binding."""
    import builtins

    from strata.hub import machine

    real_import = builtins.__import__

    def no_pynvml(name, *a, **k):
        if name == "pynvml":
            raise ImportError(name)
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_pynvml)
    monkeypatch.setattr(machine, "_nvidia_device_present", lambda: False)
    gpus, why = machine.probe_gpus()
    assert gpus == [] and why == "no NVIDIA GPU found"
    monkeypatch.setattr(machine, "_nvidia_device_present", lambda: True)
    gpus, why = machine.probe_gpus()
    assert gpus == [] and "nvidia-ml-py" in why


def test_kv_bytes_follow_the_cache_types():
    """-ctk/-ctv: q8_0 stores 32 values in 34 bytes, q4_0 in 18 (the last block of a row padded)."""
    h = _header(block_count=48, embedding_length=2048, **{"attention.head_count": 32, "attention.head_count_kv": 4,
                                                          "attention.key_length": 128, "attention.value_length": 128})
    assert kv_bytes_per_token(h, "q8_0", "q8_0") == 48 * 4 * 2 * 4 * 34
    assert kv_bytes_per_token(h, "q8_0", "f32") == 48 * 4 * (4 * 34 + 128 * 4)
    assert kv_bytes_per_token(h, "q4_0", "q4_0") == 48 * 4 * 2 * 4 * 18
    mla = _header(block_count=61, embedding_length=7168, **{"attention.head_count": 128,
                                                            "attention.kv_lora_rank": 512, "rope.dimension_count": 64})
    assert kv_bytes_per_token(mla, "q8_0", "f16") == 61 * 18 * 34  # the latent follows -ctk


def test_a_pipeline_split_is_judged_per_stage(tmp_path, capsys):
    """`strata check -pp 2`: each stage's layers counted exactly (the embedding with the first, the head and norm
    with the last), the KV by its share of the layers, one verdict per stage; a bad split is one line."""
    from strata.hub.check import stage_footprints

    m = _moe_gguf(tmp_path / "m.gguf")
    whole = model_footprint([m])
    (l0, s0), (l1, s1) = stage_footprints([m], 2)
    assert (l0, l1) == (range(0, 1), range(1, 2))
    assert s0.expert_bytes + s1.expert_bytes == whole.expert_bytes and s0.n_moe_layers == s1.n_moe_layers == 1
    embed, norm = 32 * 16 * 4, 16 * 4
    layer = 16 * 16 * 4 + 4 * 16 * 4
    # tied head (no output.weight): the embedding is on both ends
    assert s0.dense_bytes == layer + embed and s1.dense_bytes == layer + embed + norm
    assert s0.kv_bytes_per_token + s1.kv_bytes_per_token == whole.kv_bytes_per_token
    assert main(["check", "-m", str(m), "--vram-gb", "4", "-c", "1024", "-pp", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and [s["layers"] for s in out["stages"]] == [[0, 0], [1, 1]]
    assert all(s["fit"]["slots"] == 4 for s in out["stages"])
    assert main(["check", "-m", str(m), "--vram-gb", "0.5", "-pp", "2"]) == 1
    assert "stage 1: layers 1-1" in capsys.readouterr().out
    assert main(["check", "-m", str(m), "-pp", "2", "--layer-split", "2,1"]) != 0
    assert "--layer-split 2,1" in capsys.readouterr().err


def test_a_missing_native_kernel_is_a_warning():
    cpu = CPUInfo("cpu", 8, 16, native_kernel="no C compiler found (install cc or gcc, or set CC)")
    m = MachineInfo([], "none", 32 * GiB, 30 * GiB, cpu, "/", 100 * GiB)
    assert any("native CPU kernel is unavailable (no C compiler found" in w for w in m.warnings())
    assert MachineInfo([], "none", 32 * GiB, 30 * GiB, CPUInfo("cpu", 8, 16, native_kernel=""), "/", 100 * GiB
                       ).warnings() == []


def test_fit_counts_a_recurrent_state_twice_on_a_gpu():
    """A hybrid model (qwen3next's delta-net) on a GPU: its state per sequence, and the copy the decode step
    launched ahead sets aside (strata.engine.ahead); in RAM alone, once; with a KV window (no step ahead), once."""
    import dataclasses

    state = 75 * 2**20
    h = dataclasses.replace(QWEN, state_bytes_per_slot=state)
    ctx = 8192
    gpu, plain = fit(h, _machine(vram_free=24 * GiB), ctx), fit(QWEN, _machine(vram_free=24 * GiB), ctx)
    assert gpu.kv_bytes - plain.kv_bytes == 2 * state
    cpu, cpu0 = fit(h, _machine(), ctx), fit(QWEN, _machine(), ctx)
    assert cpu.kv_bytes - cpu0.kv_bytes == state
    w, w0 = fit(h, _machine(vram_free=24 * GiB), ctx, kv_window=2048), fit(QWEN, _machine(vram_free=24 * GiB), ctx,
                                                                           kv_window=2048)
    assert w.kv_bytes - w0.kv_bytes == state


def test_a_cut_off_model_file_is_broken_not_fit(tmp_path, capsys):
    """A GGUF whose tensor data is cut off loads nowhere; check says so (the loader's own words: which tensor
    ends where) and exits 1, where it used to judge the tensor table alone and say "it runs"."""
    from strata.models.default import default_model_path

    whole = default_model_path().read_bytes()
    cut = tmp_path / "tiny.gguf"
    cut.write_bytes(whole[: len(whole) * 3 // 4])
    for json_flag in ([], ["--json"]):
        assert main(["check", "-m", str(cut), *json_flag]) == 1
        out, err = capsys.readouterr()
        assert "it runs" not in out and '"ok": true' not in out
        assert re.fullmatch(r"strata: error: tiny\.gguf: tensor \S+ ends at byte \d+ but the file has "
                            rf"{len(whole) * 3 // 4} bytes \(truncated\)\n", err), err
    (tmp_path / "whole.gguf").write_bytes(whole)
    assert main(["check", "-m", str(tmp_path / "whole.gguf")]) == 0
    assert "verdict: it runs" in capsys.readouterr().out


def test_a_cut_off_shard_of_a_split_model_is_named(tmp_path, capsys):
    files = split_set(tmp_path, "M", 3, 4096)
    first, second = (tmp_path / name for name in sorted(files)[:2])
    assert main(["check", "-m", str(first), "--json"]) == 0
    capsys.readouterr()
    second.write_bytes(files[second.name][:-100])
    assert main(["check", "-m", str(first)]) == 1
    err = capsys.readouterr().err
    assert f"{second.name}: tensor blk.2.ffn_down_exps.weight ends at byte" in err and "(truncated)" in err


def test_check_plans_the_kv_a_cpu_alone_stores():
    """With no GPU and no budget, `strata check` counts the KV the engine keeps on a CPU (its float32 activations'
    dtype), not a GPU's 16-bit one: the RAM it plans is what a run takes."""
    import subprocess
    import sys

    import torch

    from strata.config import EngineConfig
    from strata.engine.loader import load_model
    from strata.models.default import default_model_path

    if torch.cuda.is_available():
        pytest.skip("a machine with a GPU plans for the GPU's KV")
    path = str(default_model_path(warn=False))
    r = subprocess.run([sys.executable, "-m", "strata", "check", "-m", path, "--json"], capture_output=True,
                       text=True, timeout=120)
    planned = json.loads(r.stdout)["model"]["kv_bytes_per_token"]
    kv = load_model(path, EngineConfig(model=path, device="cpu")).model.new_kv_cache(1, 16)
    stored = sum(t.numel() * t.element_size() for t in [*kv.k, *(kv.v or [])] if t is not None) // 16
    assert planned == stored


def test_an_unknown_architecture_cannot_run(tmp_path, capsys):
    """A well-formed GGUF of an architecture the engine has no family for: the loader's error, exit 1, never
    "it runs" (check used to judge its sizes alone)."""
    path = write_gguf(tmp_path / "frob.gguf", {"token_embd.weight": np.zeros((64, 64), np.float32)}, arch="frobnicator")
    for json_flag in ([], ["--json"]):
        assert main(["check", "-m", str(path), *json_flag]) == 1
        out, err = capsys.readouterr()
        assert "it runs" not in out and '"ok": true' not in out
        assert err.startswith("strata: error: frob.gguf: unknown model architecture 'frobnicator' (strata runs: ")
        assert err.count("\n") == 1 and "qwen3moe" in err


@pytest.mark.parametrize("flags, says", [
    (["--vram-gb", "-1"], "--vram-gb must be positive"),
    (["--vram-gb", "0"], "--vram-gb must be positive"),
    (["-c", "-5"], "--ctx-size must be >= 0, got -5"),
    (["-pp", "0"], "--pipeline-parallel-size must be >= 1, got 0"),
    (["--kv-vram-tokens", "-3", "--vram-gb", "8"], "--kv-vram-tokens -3: expected a positive number"),
])
def test_flags_the_engine_refuses_are_refused(flags, says, capsys):
    """A budget, context or stage count the engine would refuse at start-up got a verdict ("it runs" for -c -5,
    a -1 GiB budget judged short by 2.65 GiB)."""
    from strata.models.default import default_model_path

    assert main(["check", "-m", str(default_model_path(warn=False)), *flags]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith(f"strata: error: {says}") and err.count("\n") == 1
