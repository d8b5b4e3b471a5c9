#!/usr/bin/env bash
# The headline bench on the GPU machine: scenario B1 (Qwen3-30B-A3B shapes, made by `strata synth`) through
# strata's server and llama.cpp's llama-server under one VRAM budget, sampled text, 1 and 4 clients:
#
#   strata bench sweep concurrency -m $MODEL --device cuda --vram-gb $BUDGET --vs llamacpp \
#       --temperature $TEMPERATURE --workers $WORKERS --lengths $LENGTHS ...
#
# It writes the run folder `strata bench` makes, $OUT/<date>-$NAME/ (results.json, results.md, sweep.png,
# concurrency.png), ready to commit as docs/benchmarks/<date>-$NAME/, and the servers' logs beside it as
# $OUT/logs-$NAME.tar.gz (not for committing).
#
#   tools/gpu/bench_b1.sh prepare             # llama.cpp (llama-bench + llama-server, CUDA) and the B1 model, side by side
#   tools/gpu/bench_b1.sh run [FLAGS...]      # the bench; FLAGS go to `strata bench` (e.g. --draft-max 8)
#   tools/gpu/bench_b1.sh all [FLAGS...]      # both in one command (only if one command's time allows)
#
# On the device tool: carry .whl and peers/src (see setup.sh). A warm machine keeps scratch/ and
# peers/llama.cpp/build between calls, so `prepare` and `run` can be two calls issued back to back.
#
# Environment (defaults in brackets):
#   BUDGET       VRAM budget of each whole process, GiB [8]; 0: no budget (strata --experts resident, llama.cpp with
#                every layer's experts on the GPU)
#   TEMPERATURE  sampling temperature, same sampler chain for both servers [0.8]; 0: greedy
#   WORKERS      concurrent clients, comma-separated [1,4]
#   LENGTHS      sweep prompt lengths [1K,4K]; a 32K row is best its own call: LENGTHS=32K SUITES=sweep
#   RUNS GEN     measured runs per length [3], tokens generated per run [128]
#   SUITES       strata bench suites [sweep concurrency]
#   NAME         the run folder's name [b1-<BUDGET>gib-vs-llamacpp]
#   MODEL        the GGUF file [scratch/b1.gguf, made when missing]
#   TIMEOUT      seconds for the bench itself [540]; JOBS for the llama.cpp build [16]
#   PEER         llamacpp [default], or none: strata alone (no llama.cpp build needed; `run` only, after the
#                model exists: `source tools/gpu/setup.sh; b1_model`)
#   PACK         1: the run folder comes back as one $OUT/<date>-$NAME.tar.gz (the device tool returns at most 8
#                files a command, and a run folder with its logs and the machine line is 7: two runs in one
#                command need PACK=1) [0]
#   OUT          where results go (set by the device tool) [scratch/out]
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
source tools/gpu/setup.sh

BUDGET="${BUDGET:-8}"
NAME="${NAME:-b1-${BUDGET}gib-vs-llamacpp}"
SERVER_BIN=peers/llama.cpp/build/bin/llama-server

prepare() {
  local t0=$SECONDS
  ( b1_model > "$OUT/synth.log" 2>&1; echo "synth rc=$?" >> "$OUT/synth.log" ) &
  JOBS="${JOBS:-16}" bash bench/peers/llamacpp.sh build > "$OUT/build.log" 2>&1
  local rc=$?
  wait
  tail -3 "$OUT/build.log"; tail -1 "$OUT/synth.log"
  ls -la "$MODEL" "$SERVER_BIN" peers/llama.cpp/build/bin/llama-bench 2>&1
  echo "prepare: llama.cpp build exit status $rc, $((SECONDS - t0)) s"
  [[ $rc == 0 && -f "$MODEL" ]]
}

run() {
  [[ -f "$MODEL" ]] || { echo "bench_b1.sh: no $MODEL: run '$0 prepare' first (on this warm machine)" >&2; return 1; }
  local vs=(--vs llamacpp)
  if [[ "${PEER:-llamacpp}" == none ]]; then
    vs=()
  else
    [[ -x "$SERVER_BIN" ]] || { echo "bench_b1.sh: no $SERVER_BIN: run '$0 prepare' first" >&2; return 1; }
  fi
  local budget=(--vram-gb "$BUDGET")
  [[ "$BUDGET" == 0 ]] && budget=(--experts resident)
  # one work folder per run name: a second run in the same command keeps the first one's folder
  local work="scratch/bench-runs/$NAME"
  rm -rf "$work" && mkdir -p "$work"
  machine_line | tee "$OUT/machine.txt"
  # shellcheck disable=SC2086  # SUITES is a word list
  timeout "${TIMEOUT:-540}" python3 -m strata bench ${SUITES:-sweep concurrency} -m "$MODEL" --device cuda \
    "${budget[@]}" "${vs[@]}" --temperature "${TEMPERATURE:-0.8}" --workers "${WORKERS:-1,4}" \
    --lengths "${LENGTHS:-1K,4K}" --runs "${RUNS:-3}" --gen "${GEN:-128}" --name "$NAME" --out "$work" "$@" \
    > "$OUT/bench.log" 2>&1
  local rc=$?
  tail -40 "$OUT/bench.log"
  local dir
  dir="$(find "$work" -mindepth 1 -maxdepth 1 -type d | head -1)"
  if [[ -n "$dir" ]]; then
    # the logs stay out of the folder that is committed (and the device tool brings back 8 files at most)
    [[ -d "$dir/logs" ]] && tar -czf "$OUT/logs-$NAME.tar.gz" -C "$dir" logs && rm -rf "$dir/logs"
    if [[ "${PACK:-0}" == 1 ]]; then
      tar -czf "$OUT/$(basename "$dir").tar.gz" -C "$work" "$(basename "$dir")"
      echo "run folder: $OUT/$(basename "$dir").tar.gz ($(ls "$dir" | tr '\n' ' '))"
    else
      cp -r "$dir" "$OUT/"
      echo "run folder: $OUT/$(basename "$dir") ($(ls "$dir" | tr '\n' ' '))"
    fi
  fi
  (( rc == 124 )) && echo "bench_b1.sh: the bench ran past ${TIMEOUT:-540} s: fewer LENGTHS, RUNS or WORKERS" >&2
  return $rc
}

cmd="${1:-}"; shift || true
case "$cmd" in
  prepare) prepare ;;
  run) run "$@" ;;
  all) prepare && run "$@" ;;
  *) sed -n '2,35p' "$0"; exit 2 ;;
esac
