# Next stop, call 2 (~6 min): --expert-prefetch A/B (off by default; the next layer's predicted misses copied
# during this layer), sampled and greedy text at 8 GiB; the CPU lane after the prefetching kernel and the leaner
# call; the all-CPU plan at 14 threads. Carry .whl.
source tools/gpu/setup.sh
[ -f scratch/q30.gguf ] || timeout 120 python3 -m strata synth qwen3-30b-a3b scratch/q30.gguf --no-report -q > $OUT/synth.log 2>&1
B="python3 tools/bench_decode.py -m scratch/q30.gguf --prompt-tokens 1024 --gen 256 --runs 3"
timeout 90 $B --vram-gb 8 --temperature 1 --cpu-plan 000000000 --label t8_sampled_noprefetch 2>/dev/null | cut -c1-1500
timeout 90 $B --vram-gb 8 --temperature 1 --cpu-plan 000000000 --expert-prefetch --label t8_sampled_prefetch 2>/dev/null | cut -c1-1700
timeout 70 $B --vram-gb 8 --cpu-plan 000000000 --expert-prefetch --label t8_prefetch 2>/dev/null | cut -c1-1700
timeout 70 python3 tools/bench_cpu_lane.py --threads 1,8,14,16 --experts 64 > $OUT/lane.log 2>&1; grep -E "native|memory" $OUT/lane.log
timeout 90 $B --vram-gb 8 --temperature 1 --sweep 012345678@14,011223344@14 --label t8_sampled_cpu 2>/dev/null | cut -c1-1300
