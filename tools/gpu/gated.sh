#!/usr/bin/env bash
# The kernels and paths that a GPU takes only once their GPU test has passed there (each behind a flag in its
# module: docs/BENCHMARKS.md, "Waiting on the GPU machine"): runs each one's GPU tests, prints PASS / FAIL and the
# flag to set for each pass, and with APPLY=1 sets the passing flags in this working tree (on the GPU machine's
# copy: measure with them in the same command, then set them in the repository by hand). An entry is
# "test paths|file|sed substitution"; once its flag is set in the repository the entry keeps only its tests, as a
# GPU regression set.
#
#   tools/gpu/gated.sh                   # test only
#   APPLY=1 tools/gpu/gated.sh && BUDGET=0 tools/gpu/compare_flags.sh ""    # test, enable what passed, measure
#
# Environment: TIMEOUT (seconds per test group, default 240), PENDING (1: only the entries whose flag is not set
# yet, i.e. those naming a file: the regression set is skipped), OUT (set by the device tool). Writes
# $OUT/gated.log (every pytest output), $OUT/gated.txt (the verdicts) and scratch/gated-apply.sh (the passing
# flags as sed commands: a later command on the same warm machine runs `bash scratch/gated-apply.sh` to measure
# with them, since each command gets a fresh copy of the tracked files). Carry .whl (see setup.sh).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
source tools/gpu/setup.sh

# test paths | file | python (sed -E) substitution that enables it
GATED=(
  # (taken on the GPU after passing on an H200; kept here as their GPU regression set)
  "tests/ops/test_decode_attention_kv.py||"
  # (also: a verify step's queries in one launch of the decode split kernel)
  "tests/layers/test_verify_rows.py||"
  # (also: a verify step's K/V rows written by the rotary kernel, SwiGLU's silu(g) * u in one launch)
  "tests/engine/test_graphed_verify.py tests/ops/test_fused_interpret.py||"
  # (also: the decode attention's dynamic splits and lean tiles)
  "tests/ops/test_decode_attention.py||"
  "tests/ops/test_fused_interpret.py tests/layers/test_kv_fold_wiring.py||"
  "tests/ops/test_route_interpret.py||"
  # (tests/ops/test_qgemv.py, tests/experts/test_expert_triton.py and tests/ops/test_prefill_ops_gpu.py run in the
  # gated entries at the end; test_qgemv.py also holds the dense GEMV of 2-8 rows of x with each block decoded once:
  # passed, but kept off, slower, see qgemv.py)
  "tests/layers/test_causal_bias.py||"
  "tests/experts/test_staged_prefetch.py tests/experts/test_budget_long_prompt.py||"
  # (also taken after passing on an H200: the IQ4_NL tile, the gated delta-net decode step in two launches, the
  # IQ2_XXS / IQ3_XXS / IQ2_S prompt-chunk dequantizers, the MTP block's graphed forwards, the prefill loan)
  "tests/ops/test_deltanet_interpret.py||"
  "tests/engine/test_mtp.py||"
  "tests/experts/test_prefill_loan.py||"
  # (not gated: fixes checked on an H200) the direct path's prefetch fork joined before the profiler's cuts; a
  # hybrid model's tiered steps under graphs, and its decode steps launched ahead
  "tests/experts/test_tiered_direct.py tests/models/test_qwen3next.py||"
  # (also taken after passing on an H200: a MoE layer's cache lookups and a prefetch's map and record in one launch
  # each, the decode step's ~15 small torch launches a layer around the staging; the engine tests run both ways)
  "tests/ops/test_host_stage.py tests/experts/test_tiered_direct.py tests/experts/test_staged_prefetch.py||"
  # (taken after passing on an H200: the Q2_K / Q3_K, Q4_0 / Q4_1 / Q5_0 / Q5_1 and IQ2_XS / IQ3_S / IQ1_S / IQ1_M
  # tiles of the fused expert kernels and the decode GEMV, and their prompt-chunk dequantizers; dense weights in the
  # lookup formats through the one-row GEMV; the IQ2_XXS / IQ2_S / IQ3_XXS dp4a tiles)
  "tests/experts/test_expert_triton.py tests/ops/test_prefill_ops_gpu.py||"
  "tests/ops/test_qgemv.py tests/experts/test_dp4a.py||"
  # (taken after passing on an H200: the i-quants' dp4a tiles reading their table word pairs as 64-bit words)
  "tests/experts/test_dp4a.py::test_cuda_dp4a_tiles[wide]||"
  # (taken after passing on an H200, with the whole GPU suite but two float32 tests the flag takes no path in: Q8_0's
  # and the K-quants' dp4a tiles, which every half-precision dense GEMV, LM head and K-quant expert then takes)
  "tests/experts/test_dp4a.py::test_cuda_dp4a_tiles[kq] tests/ops/test_qgemv.py tests/quant/test_quant_matmul.py tests/experts/test_tiered_direct.py||"
  # (taken after passing on an H100 and timed against the gathered signs there: IQ2_XXS's and IQ3_XXS's dp4a tiles
  # with their signs computed from the index)
  "tests/experts/test_dp4a.py::test_cuda_dp4a_tiles[signs]||"
  # (taken after passing on an H100 and timed there: Q8_0's and the i-quants' dp4a tiles summed once after the loop)
  "tests/experts/test_dp4a.py::test_cuda_dp4a_tiles[parts] tests/ops/test_qgemv.py tests/experts/test_expert_triton.py||"
  # (taken after passing on an H100 and timed there: IQ2_XXS's and IQ2_S's dp4a tiles with their weights made by
  # byte permutes, selector tables instead of the grid's magnitudes)
  "tests/experts/test_dp4a.py::test_cuda_dp4a_tiles[sel]||"
)

log="$OUT/gated.log"
verdicts="$OUT/gated.txt"
machine_line > "$log"
: > "$verdicts"
apply=scratch/gated-apply.sh
echo "# written by tools/gpu/gated.sh: the flags whose GPU tests passed on this machine" > "$apply"
for entry in "${GATED[@]}"; do
  IFS='|' read -r tests file sub <<< "$entry"
  [[ "${PENDING:-0}" == 1 && -z "$file" ]] && continue
  # shellcheck disable=SC2086  # tests is a word list
  timeout "${TIMEOUT:-240}" python3 -m pytest -q -m gpu -p no:cacheprovider $tests > "$OUT/gated.one" 2>&1
  rc=$?
  cat "$OUT/gated.one" >> "$log"
  # (every test skipped, as without a GPU, is no pass)
  if (( rc == 0 )) && tail -1 "$OUT/gated.one" | grep -q " passed"; then
    line="PASS  $tests"
    if [[ -n "$file" ]]; then
      line+="  ->  $file: ${sub}"
      printf 'sed -E -i %q %q\n' "$sub" "$file" >> "$apply"
      if [[ "${APPLY:-0}" == 1 ]]; then
        sed -E -i "$sub" "$file" && line+="  (applied here)"
      fi
    fi
  elif (( rc == 0 )); then
    line="SKIP  $tests  (no GPU test ran: no GPU?)"
  else
    line="FAIL  $tests  (pytest exit $rc: see gated.log)"
  fi
  echo "$line" | tee -a "$verdicts"
done
rm -f "$OUT/gated.one"
