# Next stop, call 3 (~6 min): the int4 CPU lane against the native one (same sweep as call 2), the 8 GiB profile
# after the leaner hand-off (this stop's profile: CPU wait 4.86 ms of 23.9), and the 16 / 4 GiB rows.
source tools/gpu/setup.sh
[ -f scratch/q30.gguf ] || timeout 120 python3 -m strata synth qwen3-30b-a3b scratch/q30.gguf --no-report -q > $OUT/synth.log 2>&1
B="python3 tools/bench_decode.py -m scratch/q30.gguf --prompt-tokens 1024 --gen 256"
timeout 120 $B --runs 3 --vram-gb 8 --cpu-kernel int4 --sweep 012345678@4,012345678@8,012345678@16 --label t8_int4 2>/dev/null | cut -c1-500
timeout 50 $B --runs 1 --vram-gb 8 --cpu-plan 000000000 --profile --label t8_prof > $OUT/p8.log 2> $OUT/p8.err; cut -c1-300 $OUT/p8.log; grep -A13 "ms/tok" $OUT/p8.err
timeout 60 $B --runs 2 --vram-gb 16 --prefill-only 4096 --prefill-runs 3 --label t16 2>/dev/null | cut -c1-700
timeout 70 $B --runs 2 --vram-gb 4 --prefill-only 4096 --prefill-runs 3 --label t4 2>/dev/null | cut -c1-700
