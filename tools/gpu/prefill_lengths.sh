#!/usr/bin/env bash
# Prefill rate against prompt length, in process, on the GPU machine: does a long prompt's prefill hold the rate of
# a shorter one? One `tools/bench_decode.py --prefill-only N` process a length (a short warm-up request, then the
# timed prefill), the same context size and budget for every length so the expert cache gets the same slots.
#
#   LENGTHS=4096,32768,131072 MODEL=scratch/b2.gguf PRESET=qwen3-next-80b-a3b BUDGET=24 tools/gpu/prefill_lengths.sh [FLAGS...]
#
# FLAGS go to bench_decode.py (e.g. -ctk q8_0 -ctv q8_0). Environment: LENGTHS [4096,32768,131072], BUDGET [24] GiB,
# MODEL / PRESET / SYNTH_FLAGS as setup.sh (the model is made when missing), TIMEOUT [300] seconds a length.
# Writes $OUT/prefill_lengths.jsonl (one bench_decode JSON line a length), $OUT/prefill_lengths.txt (their stderr)
# and prints each length's tok/s and its ratio to the first length's.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
source tools/gpu/setup.sh
b1_model > "$OUT/synth.log" 2>&1 || { tail -5 "$OUT/synth.log"; exit 1; }
IFS=, read -r -a lengths <<< "${LENGTHS:-4096,32768,131072}"
max=0
for n in "${lengths[@]}"; do (( n > max )) && max=$n; done
machine_line > "$OUT/prefill_lengths.txt"
: > "$OUT/prefill_lengths.jsonl"
for n in "${lengths[@]}"; do
  timeout "${TIMEOUT:-300}" python3 tools/bench_decode.py -m "$MODEL" --vram-gb "${BUDGET:-24}" --prompt-tokens 256 \
      --gen 8 --runs 0 --prefill-only "$n" --ctx-size $(( max + 1024 )) --label "prefill $n" "$@" \
    >> "$OUT/prefill_lengths.jsonl" 2>> "$OUT/prefill_lengths.txt" || echo "prefill_lengths.sh: $n failed" | tee -a "$OUT/prefill_lengths.txt"
done
python3 - "$OUT/prefill_lengths.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
base = None
for r in rows:
    p = r.get("prefill_long") or {}
    if not p:
        continue
    base = base or p["tok_s"]
    print(f"{p['tokens']:>8} tokens  {p['tok_s']:>9.1f} tok/s  {p['tok_s'] / base:5.3f}x of the first  "
          f"copied {p.get('copied_gb_per_prefill', '-')} GB  peak +{r.get('prefill_peak_gib', {}).get('allocated_above_held', '-')} GiB")
PY
