# Seventh stop, call 3 (warm, after s9_bench.sh): sampled text at 8 GiB with and without --expert-prefetch.
source tools/gpu/setup.sh
[ -f scratch/q30.gguf ] || python3 -m strata synth qwen3-30b-a3b scratch/q30.gguf --no-report -q > $OUT/synth.log 2>&1
B="python3 tools/bench_decode.py -m scratch/q30.gguf --prompt-tokens 1024 --gen 256 --runs 3 --vram-gb 8 --ctx-size 1536 --temperature 0.8"
timeout 150 $B --label s8_sampled 2>/dev/null | tee $OUT/s8.json | cut -c1-900
timeout 150 $B --expert-prefetch --label s8_sampled_prefetch 2>/dev/null | tee $OUT/s8p.json | cut -c1-900
timeout 150 $B --temperature 0 --expert-prefetch --label g8_prefetch 2>/dev/null | tee $OUT/g8p.json | cut -c1-900
echo "done at ${SECONDS}s"
