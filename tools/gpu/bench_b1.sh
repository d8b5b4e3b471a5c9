# Scenario B1 on the GPU machine: Qwen3-30B-A3B shapes, Q4_K experts / Q8_0 dense / Q6_K head (strata synth).
# Decode: 1K-token prompt, greedy, 1 warm-up + runs measured (median); prefill 4K uncached.
source tools/gpu/setup.sh
[ -f scratch/q30.gguf ] || timeout 120 python3 -m strata synth qwen3-30b-a3b scratch/q30.gguf --no-report -q
B="python3 tools/bench_decode.py -m scratch/q30.gguf --prompt-tokens 1024 --gen ${GEN:-128} --runs ${RUNS:-3} --prefill-only 4096"
for v in "--experts resident --label unlimited" "--vram-gb 16 --label 16GiB" "--vram-gb 8 --profile --label 8GiB" \
         "--vram-gb 8 --cpu-plan 000000000 --label 8GiB-plan-000000000" "--vram-gb 8 --cpu-plan 011223344 --label 8GiB-plan-011223344" \
         "--vram-gb 8 --cpu-threads 8 --label 8GiB-8thr"; do
  timeout 150 $B $v 2>&1 | grep -v "pinning\|repacking" | tail -14 | tee -a $OUT/b1.log
done
