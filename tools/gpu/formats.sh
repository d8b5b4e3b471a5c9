#!/usr/bin/env bash
# The weight formats on the GPU machine in one call: the gated GPU tests (tools/gpu/gated.sh, APPLY=1: the flags
# of the tiles, GEMV and dequantizers whose tests pass are set in this working copy), then the fused expert
# kernel's bytes per second per format against Q4_K (tools/bench_kernels.py --expert-formats; the IQ2_XXS / IQ2_S /
# IQ3_XXS lookup tiles beside their dp4a tiles, and Q8_0's and Q4_K's float and dp4a tiles), then, with DECODE=1,
# a B1-shaped model in llama.cpp's Q3_K_M expert mix (Q3_K gate/up, Q4_K down) decoded in process at BUDGET GiB
# beside the same model in Q4_K (tools/bench_decode.py, sampled). docs/BENCHMARKS.md, "Waiting on the GPU machine",
# lists what each step settles.
#
#   tools/gpu/formats.sh                                   # gated tests + kernel speeds
#   DECODE=1 tools/gpu/formats.sh                          # and the two decodes (two synths of ~15-18 GB)
#
# Environment (defaults in brackets): FORMATS [Q4_K,Q2_K,Q3_K,Q4_0,Q5_0,Q5_1,IQ2_XS,IQ3_S,IQ1_S,IQ1_M,IQ4_XS]
# (the first is the baseline), DECODE [0], BUDGET [8], OUT (set by the device tool). Writes $OUT/gated.log,
# $OUT/gated.txt, $OUT/kernels.txt and, with DECODE=1, $OUT/decode-*.json. Carry .whl (see setup.sh).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
source tools/gpu/setup.sh

APPLY=1 bash tools/gpu/gated.sh
machine_line > "$OUT/kernels.txt"
timeout 300 python3 tools/bench_kernels.py \
  --expert-formats "${FORMATS:-Q4_K,Q2_K,Q3_K,Q4_0,Q5_0,Q5_1,IQ2_XS,IQ3_S,IQ1_S,IQ1_M,IQ4_XS}" >> "$OUT/kernels.txt" 2>&1
# the 2- and 3-bit formats' dp4a tiles (strata.ops.dp4a_triton) against their lookup tiles, one process each
for tiles in lookup dp4a dp4a-wide dp4a-signs; do
  echo "== --iq-tiles $tiles" >> "$OUT/kernels.txt"
  timeout 200 python3 tools/bench_kernels.py --expert-formats Q4_K,IQ2_XXS,IQ2_S,IQ3_XXS --iq-tiles "$tiles" \
    >> "$OUT/kernels.txt" 2>&1
done
# Q8_0's and Q4_K's dp4a tiles against their float tiles: the default set (the B1 decode GEMVs and expert kernel)
for tiles in float dp4a; do
  echo "== --kq-tiles $tiles" >> "$OUT/kernels.txt"
  timeout 200 python3 tools/bench_kernels.py --kq-tiles "$tiles" >> "$OUT/kernels.txt" 2>&1
done
grep -E "^==|expert ffn|gemv|of Q4_K|total" "$OUT/kernels.txt"

if [[ "${DECODE:-0}" == 1 ]]; then
  for mix in "q4k:--experts-type Q4_K" "q3km:--experts-type Q3_K --experts-down-type Q4_K"; do
    name="${mix%%:*}"
    model="scratch/b1-$name.gguf"
    # shellcheck disable=SC2086  # the flags are a word list
    [[ -f "$model" ]] || python3 -m strata synth qwen3-30b-a3b "$model" --no-report -q ${mix#*:} \
      || { echo "synth of $name failed"; continue; }
    timeout 240 python3 tools/bench_decode.py -m "$model" --vram-gb "${BUDGET:-8}" --prompt-tokens 1024 --gen 128 \
      --runs 2 --temperature 0.8 --decode-misses staged --label "b1-$name-${BUDGET:-8}gib" \
      > "$OUT/decode-$name.json" 2> "$OUT/decode-$name.log"
    cut -c1-400 "$OUT/decode-$name.json"
    rm -f "$model"  # (the machine's disk holds few of these)
  done
fi
