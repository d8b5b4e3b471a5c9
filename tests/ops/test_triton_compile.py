"""Every weight format's Triton kernels compile for the GPUs strata runs on, here on the CPU machine: Triton lowers
them to PTX and ptxas (shipped with Triton) assembles them for sm_90 (the H200 the GPU tests run on) and sm_86
(GeForce RTX 30, the consumer cards strata is for; RTX 40's sm_89 takes the same code). Triton's interpreter checks
what the kernels compute; only a compile catches what the interpreter lets through (a construct the code generator
refuses, a shape it cannot lower), so a tile waiting on its GPU test does not fail there for a reason the CPU could
have shown. (What the compiled code computes still needs the GPU: tools/gpu/gated.sh.)"""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

from gguf import GGMLQuantizationType as Q  # noqa: E402

from strata.config import triton_interpreting  # noqa: E402

ARCHS = (90, 86)


def _compile(kernel, signature: dict, constexprs: dict, arch: int):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    return triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                          target=GPUTarget("cuda", arch, 32))


@pytest.fixture(scope="module")
def compiles():
    """Skip where this Triton cannot compile for CUDA on a machine without one (no NVIDIA backend or ptxas)."""
    if triton_interpreting():
        pytest.skip("TRITON_INTERPRET is set: the kernels would not be compiled")
    from strata.ops import dequant_triton

    try:
        k = _compile(dequant_triton.KERNELS[Q.Q8_0][0], {"src": "*u8", "dst": "*fp32", "n_blocks": "i32",
                                                         "BB": "constexpr"}, {"BB": 128}, 90)
    except Exception as e:  # noqa: BLE001 - whatever this install lacks, the check cannot run here
        pytest.skip(f"Triton cannot compile for CUDA here: {type(e).__name__}: {str(e)[:200]}")
    assert k.asm.get("cubin"), "ptxas assembled nothing"
    return _compile


def _gemv_signature(x: str) -> dict:
    return {"x": x, "xq": "*i32", "w": "*u8", "slots": "*i64", "hw": "*u8", "eids": "*i64", "tab": "*fp32", "out": "*fp32",
            "P": "i32", "N": "i32", "K": "i32", "slot_bytes": "i64", "row_bytes": "i64", "QT": "constexpr",
            "BN": "constexpr", "KW": "constexpr", "EVEN": "constexpr", "GATHER": "constexpr", "HOST": "constexpr",
            "PARTS": "constexpr"}


def _formats():
    from strata.ops import expert_triton

    return sorted(expert_triton.SUPPORTED, key=int)


@pytest.mark.parametrize("arch", ARCHS)
def test_every_formats_gemv_and_glu_compile(compiles, arch):
    from strata.ops import expert_triton

    failed = []
    for qt in _formats():
        kw = 4 * expert_triton.block_len(qt)  # several blocks an iteration, as plan() gives for the decode shapes
        try:
            # the dense GEMV, and the down projection gathered from the slot pool with misses read from the host
            compiles(expert_triton._gemv_kernel, _gemv_signature("*bf16"),
                     {"QT": int(qt), "BN": 8, "KW": kw, "EVEN": True, "GATHER": False, "HOST": False, "PARTS": False},
                     arch)
            compiles(expert_triton._gemv_kernel, _gemv_signature("*fp32"),
                     {"QT": int(qt), "BN": 4, "KW": kw, "EVEN": False, "GATHER": True, "HOST": True, "PARTS": False},
                     arch)
            compiles(expert_triton._glu_kernel,
                     {"x": "*bf16", "xq": "*i32", "gate": "*u8", "up": "*u8", "slots": "*i64", "hgate": "*u8", "hup": "*u8",
                      "eids": "*i64", "tab": "*fp32", "out": "*fp32", "P": "i32", "N": "i32", "K": "i32", "R": "i32",
                      "g_slot_bytes": "i64", "u_slot_bytes": "i64", "g_row_bytes": "i64", "u_row_bytes": "i64",
                      "QG": "constexpr", "QU": "constexpr", "BN": "constexpr", "KW": "constexpr",
                      "EVEN": "constexpr", "HOST": "constexpr", "PARTS": "constexpr"},
                     {"QG": int(qt), "QU": int(qt), "BN": 8, "KW": kw, "EVEN": True, "HOST": True, "PARTS": False}, arch)
        except Exception as e:  # noqa: BLE001 - collect every format's failure, then report them together
            failed.append(f"{qt.name}: {type(e).__name__}: {str(e)[:600]}")
    assert not failed, "\n".join(failed)


@pytest.mark.parametrize("arch", ARCHS)
def test_every_dequantizer_compiles(compiles, arch):
    import inspect

    from strata.ops import dequant_triton

    failed = []
    for qt, (kernel, _, _, bb) in sorted(dequant_triton.KERNELS.items(), key=lambda kv: int(kv[0])):
        sig = {"src": "*u8", "dst": "*bf16", "n_blocks": "i32"}
        sig.update({name: "*fp32" for name in dequant_triton.TABLES.get(qt, ())})  # the codebooks' pointers
        sig["BB"] = "constexpr"
        names = list(sig)
        params = list(inspect.signature(kernel.fn).parameters)
        sig = dict(zip(params, (sig[n] for n in names)))  # (the kernels name their table arguments their own way)
        try:
            compiles(kernel, sig, {params[-1]: bb}, arch)
        except Exception as e:  # noqa: BLE001
            failed.append(f"{qt.name}: {type(e).__name__}: {str(e)[:600]}")
    assert not failed, "\n".join(failed)



DP4A = """
import sys, triton, triton.language as tl
from strata.ops import dp4a_triton
SEL = sys.argv[2] == "sel"  # (as parts, with IQ2_XXS's weights by byte permutes)
PARTS = sys.argv[2] == "parts" or SEL  # (with the signs computed, the K-quants' tiles too)
SIGNS = sys.argv[2] == "signs" or PARTS
WIDE = sys.argv[2] == "wide" or SIGNS
dp4a_triton.C_DP4A = tl.constexpr(True)  # before any kernel is hashed in this process
dp4a_triton.C_KQ = tl.constexpr(not WIDE or PARTS)
dp4a_triton.C_WIDE = tl.constexpr(WIDE)
dp4a_triton.C_ASIGN = tl.constexpr(SIGNS)
dp4a_triton.C_PARTS = tl.constexpr(PARTS)
dp4a_triton.C_SEL = tl.constexpr(SEL)
from gguf import GGMLQuantizationType as Q
from strata.ops import expert_triton
from tests.ops.test_triton_compile import _compile, _gemv_signature
IQ = (Q.IQ2_XXS, Q.IQ2_S, Q.IQ3_XXS)
loads = {}
for qt in IQ if WIDE and not PARTS else IQ + (Q.Q4_K, Q.Q8_0, Q.Q6_K, Q.Q5_K, Q.Q2_K, Q.Q3_K):
    k = _compile(expert_triton._gemv_kernel, _gemv_signature("*fp32"),
                 {"QT": int(qt), "BN": 8, "KW": 512, "EVEN": False, "GATHER": True, "HOST": True,
                  "PARTS": PARTS and qt in IQ + (Q.Q8_0,)}, int(sys.argv[1]))
    ptx = k.asm["ptx"]
    assert "dp4a.s32.s32" in ptx, qt.name
    # (the table's word pairs as 64-bit loads: the grid entries of IQ2_XXS / IQ2_S, the sign words of IQ2_XXS / IQ3_XXS;
    # the kernel's own 64-bit loads, slots and expert ids, are 2)
    if qt in IQ:
        wide = ptx.count("ld.global.b64")
        assert (wide > 2) == (WIDE and not (SIGNS and qt == Q.IQ3_XXS) and not (SEL and qt != Q.IQ3_XXS)), (qt.name, wide)
        loads[qt] = wide
        assert ("prmt.b32" in ptx) == (SEL and qt != Q.IQ3_XXS), qt.name
if SIGNS:  # (their sign words computed: IQ2_XXS keeps its grid pairs' wide loads, IQ3_XXS reads no pair)
    assert loads[Q.IQ3_XXS] == 2, loads
print("ok")
"""


@pytest.mark.parametrize("wide", ["", "wide", "signs", "parts", "sel"])
@pytest.mark.parametrize("arch", ARCHS)
def test_dp4a_tiles_compile(compiles, arch, wide):
    """The Q8_0 / Q4_K / IQ2_XXS / IQ2_S / IQ3_XXS tiles that multiply four weights at a time (strata.ops.dp4a_triton,
    off until their GPU test passes) compile, and their PTX multiplies with dp4a. In a process of its own: a kernel's
    hash, and with it what Triton's cache hands back, keeps the flags it read first."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, *sys.path])}
    r = subprocess.run([sys.executable, "-c", DP4A, str(arch), wide or "narrow"], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
