#!/usr/bin/env bash
# strata's fused expert kernel and llama.cpp's own MUL_MAT_ID per weight format, on the GPU machine in one call:
# the i-quants' bytes per second against Q4_K's at the experts' shapes (docs/BENCHMARKS.md, "The GPU lane per weight
# format"). llama.cpp's test-backend-ops builds in the background (its perf cases patched in by
# tools/peer_kernels.py) while tools/bench_kernels.py times strata's kernel at each shape, cold (a pool of experts
# larger than L2, as a decode step reads them) and hot (the same experts every call, as test-backend-ops times);
# then test-backend-ops runs.
#
#   tools/gpu/llamacpp_kernels.sh
#
# Environment: SHAPES [2048,768,8 2048,768,32 2048,512,10 2048,512,40 4096,1536,8 4096,1536,32] (d,ff,P),
# HOT_SHAPES [2048,768,8 2048,768,32 4096,1536,8], FORMATS [Q4_K,IQ2_XXS,IQ2_S,IQ3_XXS] (the first the baseline),
# PEER [1] (0: strata's side only; build: strata's side and llama.cpp's build, not its run; run: llama.cpp's run
# only, on a warm machine that built it). Writes $OUT/strata-kernels.txt, $OUT/llamacpp-build.log,
# $OUT/llamacpp-kernels.txt and $OUT/llamacpp-kernels.md. Carry .whl and peers/src (see setup.sh).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
source tools/gpu/setup.sh

FORMATS="${FORMATS:-Q4_K,IQ2_XXS,IQ2_S,IQ3_XXS}"
PEER="${PEER:-1}"
if [[ "$PEER" == 1 || "$PEER" == build ]]; then
  bash bench/peers/llamacpp.sh unpack && python3 tools/peer_kernels.py patch peers/llama.cpp/tests/test-backend-ops.cpp
  (TARGETS=test-backend-ops TESTS=ON nice -n 19 bash bench/peers/llamacpp.sh build > "$OUT/llamacpp-build.log" 2>&1;
   echo "build rc=$?" >> "$OUT/llamacpp-build.log") &
  build_pid=$!
fi
[[ "$PEER" == run ]] || machine_line > "$OUT/strata-kernels.txt"
[[ "$PEER" == run ]] || for s in ${SHAPES:-2048,768,8 2048,768,32 2048,512,10 2048,512,40 4096,1536,8 4096,1536,32}; do
  timeout 240 python3 tools/bench_kernels.py --expert-formats "$FORMATS" --expert-shape "$s" >> "$OUT/strata-kernels.txt" 2>&1
done
[[ "$PEER" == run ]] || for s in ${HOT_SHAPES:-2048,768,8 2048,768,32 4096,1536,8}; do
  timeout 240 python3 tools/bench_kernels.py --hot --expert-formats "$FORMATS" --expert-shape "$s" >> "$OUT/strata-kernels.txt" 2>&1
done
[[ "$PEER" == run ]] || grep -E "expert ffn|bytes/s" "$OUT/strata-kernels.txt"
if [[ "$PEER" == 1 || "$PEER" == build ]]; then
  wait "$build_pid"
  tail -3 "$OUT/llamacpp-build.log"
fi
if [[ "$PEER" == 1 || "$PEER" == run ]]; then
  bin=peers/llama.cpp/build/bin/test-backend-ops
  if [[ -x "$bin" ]]; then
    "$bin" perf -b CUDA0 -o MUL_MAT_ID -p "$(python3 tools/peer_kernels.py filter)" > "$OUT/llamacpp-kernels.txt" 2>&1
    python3 tools/peer_kernels.py table "$OUT/llamacpp-kernels.txt" | tee "$OUT/llamacpp-kernels.md"
  fi
fi
