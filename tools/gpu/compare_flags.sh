#!/usr/bin/env bash
# Engine settings side by side, in process, on the GPU machine: the same tools/bench_decode.py measurement (decode
# after a prompt, optionally a long prefill) of this tree under each quoted set of engine flags, the sets in turn
# and then again in reverse order (drift on the machine falls on all of them), one model load each.
#
#   tools/gpu/compare_flags.sh "" "--chunk-buffer-loan on"
#   tools/gpu/compare_flags.sh "" "--expert-prefetch" "--expert-prefetch --expert-prefetch-programs 32"
#   BUDGET=0 tools/gpu/compare_flags.sh "" "--no-decode-ahead"
#
# Every set also gets the COMMON flags (default: `--decode-misses staged --cpu-plan 000000000`, so that no plan
# trials run inside the timed requests; COMMON="" leaves the engine's defaults). Environment (defaults in brackets):
# BUDGET [8] (GiB; 0: --experts resident), PROMPT [1024], GEN [128], RUNS [3], TEMPERATURE [0.8], PREFILL [0]
# (tokens of a timed long prefill; 0: none), ROUNDS [2] (the second in reverse order), MODEL [scratch/b1.gguf, made
# when missing], TIMEOUT [240] s per measurement, OUT (set by the device tool). Writes $OUT/flags.jsonl (one
# bench_decode JSON line per set and round, labelled with its flags) and $OUT/flags.txt (their stderr), and prints
# a table. Carry .whl (see setup.sh).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
(( $# )) || { sed -n '2,17p' "$0"; exit 2; }
source tools/gpu/setup.sh

BUDGET="${BUDGET:-8}"
budget=(--vram-gb "$BUDGET")
[[ "$BUDGET" == 0 ]] && budget=(--experts resident)
read -r -a common <<< "${COMMON---decode-misses staged --cpu-plan 000000000}"
[[ "$BUDGET" == 0 ]] && common=()  # (no tiers: nothing to stage or plan)
pre=()
if [[ "${PREFILL:-0}" != 0 ]]; then
  ctx=$(( ${PREFILL} > ${PROMPT:-1024} + ${GEN:-128} ? ${PREFILL} : ${PROMPT:-1024} + ${GEN:-128} ))
  pre=(--prefill-only "$PREFILL" --ctx-size $(( ctx + 512 )))
fi
b1_model > "$OUT/synth.log" 2>&1 || { tail -5 "$OUT/synth.log"; exit 1; }
machine_line > "$OUT/flags.txt"
: > "$OUT/flags.jsonl"
sets=("$@")
for round in $(seq "${ROUNDS:-2}"); do
  order=("${sets[@]}")
  if (( round % 2 == 0 )); then  # every other round in reverse
    order=(); for (( i=${#sets[@]}-1; i>=0; i-- )); do order+=("${sets[$i]}"); done
  fi
  for flags in "${order[@]}"; do
    read -r -a extra <<< "$flags"
    label="${flags:-(defaults)}"
    timeout "${TIMEOUT:-240}" python3 tools/bench_decode.py -m "$MODEL" "${budget[@]}" "${common[@]}" \
      --prompt-tokens "${PROMPT:-1024}" --gen "${GEN:-128}" --runs "${RUNS:-3}" \
      --temperature "${TEMPERATURE:-0.8}" "${pre[@]}" --label="$label" "${extra[@]}" \
      >> "$OUT/flags.jsonl" 2>> "$OUT/flags.txt" || echo "compare_flags.sh: '$label' round $round failed (see flags.txt)" | tee -a "$OUT/flags.txt"
  done
done
python3 - "$OUT/flags.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
print(f"{'flags':<48} {'decode tok/s (median, min-max)':>32} {'prefill tok/s':>14} {'hit':>6} {'slots':>6}")
for r in rows:
    d = r.get("decode_tok_s") or {}
    p = (r.get("prefill_long") or {}).get("tok_s", "")
    hit = (r.get("experts_decode") or {}).get("hit_rate", "")
    hit = f"{hit:.3f}" if isinstance(hit, float) else hit
    print(f"{r.get('label', '?'):<48} {d.get('median', '')!s:>12} ({d.get('min', '')}-{d.get('max', '')}) "
          f"{p!s:>14} {hit!s:>6} {r.get('slots_per_layer', '')!s:>6}")
PY
