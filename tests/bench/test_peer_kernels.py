"""tools/peer_kernels.py: the cases it adds to llama.cpp's test-backend-ops, the regex that selects them, and the
table from its perf output."""

import re

import pytest

from tools import peer_kernels as pk

SNIPPET = """static std::vector<std::unique_ptr<test_case>> make_test_cases_eval() {
    std::vector<std::unique_ptr<test_case>> test_cases;
}
static std::vector<std::unique_ptr<test_case>> make_test_cases_perf() {
    std::vector<std::unique_ptr<test_case>> test_cases;

    for (int bs : {1, 4}) {}
    return test_cases;
}
"""


def test_patch_adds_the_cases_to_the_perf_list_once():
    out = pk.patch(SNIPPET)
    perf = out.index("make_test_cases_perf")
    assert out.index(pk.MARKER) > perf and out.index(pk.MARKER) < out.index("return test_cases")
    assert out.count("new test_mul_mat_id(type_a, GGML_TYPE_F32, 8 * bs, 8, false, 768, bs, 2048)") == 1
    assert "GGML_TYPE_IQ2_XXS" in out and "GGML_TYPE_Q4_K" in out
    assert pk.patch(out) == out
    with pytest.raises(ValueError, match="make_test_cases_perf"):
        pk.patch("int main() {}")


def test_filter_selects_the_added_cases_only():
    rx = re.compile(pk.filter_regex())
    assert rx.search("type_a=iq2_xxs,type_b=f32,n_mats=128,n_used=8,b=0,m=768,n=1,k=2048,amax=1.000000,m_v=0")
    assert rx.search("type_a=q4_K,type_b=f32,n_mats=40,n_used=10,b=0,m=2048,n=4,k=512,amax=1.000000,m_v=0")
    assert not rx.search("type_a=q8_0,type_b=f32,n_mats=128,n_used=8,b=0,m=768,n=1,k=2048,amax=1.000000,m_v=0")
    assert not rx.search("type_a=iq2_xxs,type_b=f32,n_mats=128,n_used=8,b=0,m=768,n=32,k=2048,amax=1.000000,m_v=0")


def test_table_gives_bytes_per_second_against_q4_k():
    line = ("  MUL_MAT_ID(type_a={},type_b=f32,n_mats=128,n_used=8,b=0,m=768,n=1,k=2048,amax=1.000000,m_v=0):"
            "        {} runs - {} us/run - 25.17 MFLOP/run - \x1b[1;34m  2.10 TFLOPS\x1b[0m\n")
    text = line.format("q4_K", 16384, "10.00") + line.format("iq2_xxs", 16384, "8.00") + "  other noise\n"
    rows = pk.parse(text)
    assert [r["format"] for r in rows] == ["q4_K", "iq2_xxs"]
    assert rows[0]["bytes"] == 8 * 768 * 2048 // 256 * 144
    tab = pk.table(rows)
    # IQ2_XXS: 66 / 144 of the bytes in 0.8 of the time
    assert f"8.0 us, {66 / 144 / 0.8:.2f}" in tab
    assert "| 768 x 2048, 8 | 10.0 us |" in tab
