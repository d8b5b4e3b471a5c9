#!/usr/bin/env bash
# Where the time goes, in process (no server), on the GPU machine: one engine setting of the B1 model through
# tools/bench_decode.py with
#   --profile          the per-token decode breakdown (attention, router, cache hits, PCIe copies, CPU lane, waits)
#   --trace-prefill    one long prefill under torch.profiler: the top ops by GPU and by host time, and a Chrome
#                      trace that tools/trace_timeline.py turns into compute / copy / overlap / idle time
#
#   tools/gpu/profile.sh                          # B1 at 8 GiB, default engine settings
#   BUDGET=0 tools/gpu/profile.sh                 # everything resident
#   tools/gpu/profile.sh --cpu-plan 000000000     # any engine flags (strata serve's) are passed on
#
# Environment (defaults in brackets): BUDGET [8] (GiB; 0: --experts resident), PROMPT [1024] prompt tokens before
# the timed decode, GEN [128] tokens timed, RUNS [2], PREFILL [4096] tokens of the traced prefill (0: none),
# MODEL [scratch/b1.gguf, made when missing], TIMEOUT [480] s, OUT (set by the device tool).
# Writes $OUT/profile.json (bench_decode's JSON line: decode/prefill tok/s, expert statistics, VRAM used),
# $OUT/profile.txt (the breakdown and the op tables) and $OUT/timeline.txt. Carry .whl (see setup.sh).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
source tools/gpu/setup.sh

BUDGET="${BUDGET:-8}"
PREFILL="${PREFILL:-4096}"
budget=(--vram-gb "$BUDGET")
[[ "$BUDGET" == 0 ]] && budget=(--experts resident)
trace=()
if [[ "$PREFILL" != 0 ]]; then
  trace=(--prefill-only "$PREFILL" --trace-prefill --trace-out scratch/prefill_trace.json.gz)
  ctx=$(( PREFILL > ${PROMPT:-1024} + ${GEN:-128} ? PREFILL : ${PROMPT:-1024} + ${GEN:-128} ))
  trace+=(--ctx-size $(( ctx + 512 )))
fi

b1_model > "$OUT/synth.log" 2>&1 || { tail -5 "$OUT/synth.log"; exit 1; }
machine_line > "$OUT/profile.txt"
timeout "${TIMEOUT:-480}" python3 tools/bench_decode.py -m "$MODEL" "${budget[@]}" --profile \
  --prompt-tokens "${PROMPT:-1024}" --gen "${GEN:-128}" --runs "${RUNS:-2}" "${trace[@]}" --label "profile-$BUDGET" "$@" \
  > "$OUT/profile.json" 2>> "$OUT/profile.txt"
rc=$?
cut -c1-600 "$OUT/profile.json"
grep -v "pinning\|repacking" "$OUT/profile.txt" | head -60
if [[ $rc == 0 && "$PREFILL" != 0 ]]; then
  python3 tools/trace_timeline.py scratch/prefill_trace.json.gz > "$OUT/timeline.txt" 2>&1
  head -30 "$OUT/timeline.txt"
fi
exit $rc
