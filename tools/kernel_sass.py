"""Instructions a weight in the GPU code of the fused expert kernel's tiles, counted on a machine without a GPU.

    python tools/kernel_sass.py --formats Q4_K,IQ2_XXS,IQ2_S,IQ3_XXS --tiles dp4a
    python tools/kernel_sass.py --formats Q4_K,Q8_0 --kq-tiles dp4a
    python tools/kernel_sass.py --formats IQ2_XXS --tiles lookup --bn 8 --kw 512 --warps 1 --ops

Triton compiles the gathered GEMV (`strata.ops.expert_triton._gemv_kernel`, the down projection's kernel) for the
format, ptxas assembles it for --arch, and nvdisasm (both shipped with Triton) lists its machine code; the count is
the instructions of the K loop's body, times the threads, over the weights one iteration decodes (BN rows x KW):
lane-instructions a weight. A tile whose speed is set by instruction issue (Q4_K's, on an H200: ~1 TB/s, a fifth of
HBM) runs at about the inverse ratio; it says nothing of memory stalls, so a GPU has the last word
(`tools/bench_kernels.py --expert-formats`). --tiles picks the 2- and 3-bit formats' tiles (lookup, packed, dp4a),
--kq-tiles Q8_0's and Q4_K's (float, dp4a); --ops prints the loop's opcodes by count.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default="Q4_K,IQ2_XXS,IQ2_S,IQ3_XXS")
    ap.add_argument("--tiles", choices=("lookup", "packed", "dp4a", "dp4a-wide", "dp4a-signs", "dp4a-sel"),
                    default="lookup",
                    help="the IQ2_XXS / IQ2_S / IQ3_XXS tiles")
    ap.add_argument("--kq-tiles", choices=("float", "dp4a"), default="float", help="the Q8_0 / Q4_K tiles")
    ap.add_argument("--bn", type=int, default=8, help="rows a program (default 8, the decode plan's for Q4_K)")
    ap.add_argument("--kw", type=int, default=512, help="weights of a row an iteration (default 512)")
    ap.add_argument("--warps", type=int, default=1)
    ap.add_argument("--arch", type=int, default=90, help="SM version (90: H100 / H200, 86: RTX 30, 89: RTX 40)")
    ap.add_argument("--parts", action="store_true", help="the dp4a tiles' sums after the loop (dp4a_triton.parts)")
    ap.add_argument("--ops", action="store_true", help="the loop's opcodes by count")
    ap.add_argument("--order", action="store_true",
                    help="the loop's global loads (L), barriers (|), shared stores / loads (t / s), dp4a (d) and popc (p) "
                         "in program order: where a layout conversion or a wait sits")
    ap.add_argument("--dump", action="store_true", help="the loop's instructions themselves")
    a = ap.parse_args()

    import triton
    import triton.language as tl
    import torch
    from gguf import GGMLQuantizationType as Q
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from strata.ops import dp4a_triton, iquant_triton

    # before any kernel is hashed: a kernel keeps the flags it read first
    dp4a_triton.C_DP4A = tl.constexpr(a.tiles.startswith("dp4a"))
    dp4a_triton.C_WIDE = tl.constexpr(a.tiles in ("dp4a-wide", "dp4a-signs", "dp4a-sel"))
    dp4a_triton.C_ASIGN = tl.constexpr(a.tiles in ("dp4a-signs", "dp4a-sel"))
    dp4a_triton.C_SEL = tl.constexpr(a.tiles == "dp4a-sel")
    dp4a_triton.C_KQ = tl.constexpr(a.kq_tiles == "dp4a")
    dp4a_triton.C_PARTS = tl.constexpr(a.parts)
    iquant_triton.C_PACKED = tl.constexpr(a.tiles == "packed")
    from strata.ops import expert_triton

    sig = {"x": "*fp32", "xq": "*i32", "w": "*u8", "slots": "*i64", "hw": "*u8", "eids": "*i64", "tab": "*fp32",
           "out": "*fp32", "P": "i32", "N": "i32", "K": "i32", "slot_bytes": "i64", "row_bytes": "i64",
           "QT": "constexpr", "BN": "constexpr", "KW": "constexpr", "EVEN": "constexpr", "GATHER": "constexpr",
           "HOST": "constexpr", "PARTS": "constexpr"}
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    line = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*)")
    print(f"sm_{a.arch}, {a.tiles} / {a.kq_tiles} tiles, BN {a.bn} x KW {a.kw}, {a.warps} warp(s); triton {triton.__version__}")
    for name in a.formats.split(","):
        qt = Q[name.strip()]
        k = triton.compile(ASTSource(fn=expert_triton._gemv_kernel, signature=sig,
                                     constexprs={"QT": int(qt), "BN": a.bn, "KW": a.kw, "EVEN": True,
                                                 "GATHER": True, "HOST": False,
                                                 "PARTS": a.parts and dp4a_triton.parted((qt,), torch.zeros(1, dtype=torch.int32))}),
                           target=GPUTarget("cuda", a.arch, 32), options={"num_warps": a.warps})
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(k.asm["cubin"])
            f.flush()
            sass = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout
        labels, instrs, cur = {}, [], None
        for ln in sass.splitlines():
            if ln.startswith(".L_x_"):
                cur = ln.split(":")[0]
            m = line.match(ln)
            if m:
                addr = int(m.group(1), 16)
                if cur is not None:
                    labels.setdefault(cur, addr)
                    cur = None
                instrs.append((addr, m.group(2)))
        # the K loop: the longest backward branch
        loop = (0, -1)
        for addr, text in instrs:
            m = re.search(r"BRA\s+`?\(?(\.L_x_\d+)", text)
            if m and m.group(1) in labels and labels[m.group(1)] < addr:
                if addr - labels[m.group(1)] > loop[1] - loop[0]:
                    loop = (labels[m.group(1)], addr)
        body = [t for addr, t in instrs if loop[0] <= addr <= loop[1]]
        if not body:
            print(f"{qt.name:8s} no loop found ({len(instrs)} instructions)")
            continue
        per_weight = len(body) * 32 * a.warps / (a.bn * a.kw)
        print(f"{qt.name:8s} {len(body):5d} instructions a warp an iteration, {per_weight:5.2f} a weight")
        if a.order:
            marks = {"LDG": "L", "BAR": "|", "STS": "t", "LDS": "s", "IDP": "d", "POPC": "p"}
            print("         " + "".join(marks.get(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0], "") for t in body))
        if a.dump:
            print("\n".join("         " + t for t in body))
        if a.ops:
            ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body)
            print("         " + ", ".join(f"{op} {n}" for op, n in ops.most_common(16)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
