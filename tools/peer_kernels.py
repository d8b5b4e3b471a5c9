"""llama.cpp's own expert kernels per weight format, as a reference for strata's (`tools/bench_kernels.py
--expert-formats`): bytes per second of each format against Q4_K's at the same MoE expert shapes.

    python tools/peer_kernels.py patch peers/llama.cpp/tests/test-backend-ops.cpp   # add the cases (idempotent)
    test-backend-ops perf -b CUDA0 -o MUL_MAT_ID -p "$(python tools/peer_kernels.py filter)" > perf.txt
    python tools/peer_kernels.py table perf.txt                                     # the markdown table

test-backend-ops' perf mode times one op at a time on random weights (`MUL_MAT_ID`: the experts' matmul of
`n` tokens, each through `n_used` of `n_mats` experts, with its activations' int8 rounding); its own list of cases
has no IQ2_XXS / IQ2_S / IQ3_XXS at the experts' shapes, so `patch` adds them to its perf cases. Its runs read the
same experts each time, which then sit in L2: compare with `bench_kernels.py --hot`. `tools/gpu/llamacpp_kernels.sh`
builds and runs it on the GPU machine.
"""

from __future__ import annotations

import argparse
import re
import sys

FORMATS = ("q4_K", "iq2_xxs", "iq2_s", "iq3_xxs")
# (m rows, k columns, n_used experts a token): B1's (Qwen3-30B-A3B) gate/up and down, B2's (Qwen3-Next-80B-A3B)
# and the GLM-4.5-Air-sized experts of bench_kernels' tables. n_mats is n_used x tokens: every expert a case makes
# is read (test-backend-ops quantizes its random weights on the CPU, minutes for the i-quants of a model's 128)
SHAPES = ((768, 2048, 8), (2048, 768, 8), (512, 2048, 10), (2048, 512, 10), (1536, 4096, 8), (4096, 1536, 8))
TOKENS = (1, 4)
BYTES_PER_BLOCK = {"q4_K": 144, "iq2_xxs": 66, "iq2_s": 82, "iq3_xxs": 98}  # a block of 256 weights
MARKER = "// strata: the i-quants beside Q4_K at MoE expert shapes"


def cases_source() -> str:
    types = ", ".join(f"GGML_TYPE_{f.upper() if f != 'q4_K' else 'Q4_K'}" for f in FORMATS)
    lines = [f"    {MARKER}", f"    for (int bs : {{{', '.join(map(str, TOKENS))}}}) {{",
             f"        for (ggml_type type_a : {{{types}}}) {{"]
    for m, k, used in SHAPES:
        lines.append(f"            test_cases.emplace_back(new test_mul_mat_id(type_a, GGML_TYPE_F32, {used} * bs, "
                     f"{used}, false, {m}, bs, {k}));")
    lines += ["        }", "    }", ""]
    return "\n".join(lines) + "\n"


def patch(source: str) -> str:
    """test-backend-ops.cpp with the cases at the top of its perf list (unchanged when already there)."""
    if MARKER in source:
        return source
    m = re.search(r"static std::vector<std::unique_ptr<test_case>> make_test_cases_perf\(\) \{\n"
                  r"(\s*std::vector<std::unique_ptr<test_case>> test_cases;\n)", source)
    if m is None:
        raise ValueError("no make_test_cases_perf() with its test_cases vector: another test-backend-ops layout")
    return source[:m.end()] + cases_source() + source[m.end():]


def filter_regex() -> str:
    """test-backend-ops' -p regex (searched in a case's parameters) that selects the added cases."""
    shapes = "|".join(f"n_mats=\\d+,n_used={used},b=0,m={m},n=({'|'.join(map(str, TOKENS))}),k={k}"
                      for m, k, used in SHAPES)
    return f"type_a=({'|'.join(FORMATS)}),type_b=f32,({shapes})"


LINE = re.compile(r"MUL_MAT_ID\(type_a=(\w+),type_b=f32,n_mats=(\d+),n_used=(\d+),b=\w+,m=(\d+),n=(\d+),k=(\d+)"
                  r"[^)]*\):\s+(\d+) runs -\s+([\d.]+) us/run")


def parse(text: str) -> list[dict]:
    """The perf lines of test-backend-ops' console output: one dict a case."""
    rows = []
    for m in LINE.finditer(re.sub(r"\x1b\[[0-9;]*m", "", text)):
        fmt, mats, used, rows_, n, k, runs, us = m.groups()
        if fmt not in BYTES_PER_BLOCK:
            continue
        pairs = min(int(used) * int(n), int(mats))  # distinct experts at most
        nbytes = int(used) * int(n) * int(rows_) * int(k) // 256 * BYTES_PER_BLOCK[fmt]
        rows.append({"format": fmt, "m": int(rows_), "k": int(k), "tokens": int(n), "n_used": int(used),
                     "pairs": pairs, "us": float(us), "runs": int(runs), "bytes": nbytes})
    return rows


def table(rows: list[dict]) -> str:
    """Markdown: us a call and bytes/s against Q4_K's at the same shape and token count."""
    out = ["| expert matmul (m x k, experts a call) | " + " | ".join(FORMATS) + " |",
           "|---|" + "---|" * len(FORMATS)]
    keys = sorted({(r["tokens"], r["m"], r["k"], r["n_used"]) for r in rows})
    by = {(r["tokens"], r["m"], r["k"], r["n_used"], r["format"]): r for r in rows}
    for t, m, k, used in keys:
        base = by.get((t, m, k, used, "q4_K"))
        cells = []
        for f in FORMATS:
            r = by.get((t, m, k, used, f))
            if r is None:
                cells.append("-")
            elif base is None or f == "q4_K":
                cells.append(f"{r['us']:.1f} us")
            else:
                ratio = (r["bytes"] / r["us"]) / (base["bytes"] / base["us"])
                cells.append(f"{r['us']:.1f} us, {ratio:.2f}")
        out.append(f"| {m} x {k}, {t * used} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("patch", help="add the cases to test-backend-ops.cpp in place")
    p.add_argument("path")
    sub.add_parser("filter", help="print test-backend-ops' -p regex for the cases")
    t = sub.add_parser("table", help="the markdown table from test-backend-ops' perf output")
    t.add_argument("path")
    a = ap.parse_args(argv)
    if a.cmd == "patch":
        with open(a.path) as f:
            src = f.read()
        new = patch(src)
        if new != src:
            with open(a.path, "w") as f:
                f.write(new)
        print(f"{a.path}: {'patched' if new != src else 'already patched'}")
    elif a.cmd == "filter":
        print(filter_regex())
    else:
        with open(a.path) as f:
            rows = parse(f.read())
        if not rows:
            print(f"{a.path}: no MUL_MAT_ID perf lines", file=sys.stderr)
            return 1
        print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
