#!/usr/bin/env bash
# A/B of two source trees in one command on the GPU machine: the same in-process measurement
# (tools/bench_decode.py: decode after a prompt, and a long prefill) from a baseline tree and from this tree,
# alternating A, B, A, B so that drift on the machine falls on both, same model, same flags.
#
#   tools/gpu/ab.sh make-base COMMIT            # here: the baseline tree as scratch-ab/base (git archive; ignored
#                                               # via .git/info/exclude) — carry scratch-ab to the GPU machine
#   tools/gpu/ab.sh run [ENGINE FLAGS...]       # there: ROUNDS rounds of A then B
#
# Environment (defaults in brackets): BUDGET [8] (GiB; 0: --experts resident), PROMPT [1024], GEN [128], RUNS [3]
# measured requests per setting, PREFILL [4096] tokens of the timed prefill (0: none), TEMPERATURE [0.8] (0:
# greedy), ROUNDS [2], ORDER [A B] (the sides within a round, e.g. "B A"), MODEL [scratch/b1.gguf, made when missing], OUT (set by the device tool).
# Writes $OUT/ab.jsonl (one bench_decode JSON line per setting and round, labelled A or B), $OUT/ab.txt (stderr
# of the runs) and prints a table of decode and prefill tok/s. Carry .whl (see setup.sh).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

if [[ "${1:-}" == make-base ]]; then
  commit="${2:?usage: $0 make-base COMMIT}"
  grep -qx '/scratch-ab/' .git/info/exclude 2>/dev/null || echo '/scratch-ab/' >> .git/info/exclude
  rm -rf scratch-ab/base && mkdir -p scratch-ab/base
  git archive "$commit" strata tools | tar -x -C scratch-ab/base
  rm -f scratch-ab/base/strata/data/strata-tiny.gguf  # not needed to measure B1; keeps the carry small
  echo "$commit" > scratch-ab/base/COMMIT
  du -sh scratch-ab/base
  exit 0
fi
[[ "${1:-}" == run ]] || { echo "usage: $0 make-base COMMIT | run [ENGINE FLAGS...]" >&2; exit 2; }
shift
source tools/gpu/setup.sh
[[ -d scratch-ab/base/strata ]] || { echo "ab.sh: no scratch-ab/base: run '$0 make-base COMMIT' here and carry it" >&2; exit 1; }

BUDGET="${BUDGET:-8}"
budget=(--vram-gb "$BUDGET")
[[ "$BUDGET" == 0 ]] && budget=(--experts resident)
pre=()
if [[ "${PREFILL:-4096}" != 0 ]]; then
  ctx=$(( ${PREFILL:-4096} > ${PROMPT:-1024} + ${GEN:-128} ? ${PREFILL:-4096} : ${PROMPT:-1024} + ${GEN:-128} ))
  pre=(--prefill-only "${PREFILL:-4096}" --ctx-size $(( ctx + 512 )))
fi
b1_model > "$OUT/synth.log" 2>&1 || { tail -5 "$OUT/synth.log"; exit 1; }
machine_line > "$OUT/ab.txt"
echo "A = $(cat scratch-ab/base/COMMIT), B = this tree" | tee -a "$OUT/ab.txt"
site="${PYTHONPATH%%:*}"
: > "$OUT/ab.jsonl"
for round in $(seq "${ROUNDS:-2}"); do
  for side in ${ORDER:-A B}; do
    if [[ $side == A ]]; then tree="$PWD/scratch-ab/base"; else tree="$PWD"; fi
    ( cd "$tree" && PYTHONPATH="$site:$tree" timeout "${TIMEOUT:-280}" python3 tools/bench_decode.py -m "$OLDPWD/$MODEL" \
        "${budget[@]}" --prompt-tokens "${PROMPT:-1024}" --gen "${GEN:-128}" --runs "${RUNS:-3}" \
        --temperature "${TEMPERATURE:-0.8}" "${pre[@]}" --label "$side round $round" "$@" ) \
      >> "$OUT/ab.jsonl" 2>> "$OUT/ab.txt" || echo "ab.sh: $side round $round failed (see ab.txt)" | tee -a "$OUT/ab.txt"
  done
done
python3 - "$OUT/ab.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
print(f"{'label':<12} {'decode tok/s (median, min-max)':>32} {'prefill tok/s':>14} {'hit':>6}")
for r in rows:
    d = r.get("decode_tok_s") or {}
    p = (r.get("prefill_long") or {}).get("tok_s", "")
    hit = (r.get("experts_decode") or {}).get("hit_rate", "")
    print(f"{r.get('label', '?'):<12} {d.get('median', '')!s:>12} ({d.get('min', '')}-{d.get('max', '')}) "
          f"{p!s:>14} {hit!s:>6}")
PY
