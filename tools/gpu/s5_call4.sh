# Call 4 (~5 min): the 8 GiB protocol with the per-miss tuner (greedy, as BENCH.md's protocol), and the same with
# sampled text (--temperature 1: the synthetic model's greedy text repeats and flatters the cache; sampled text
# routes near uniformly, the cache's worst case): plans PCIe only / half / all-CPU at 14 threads, tuned auto;
# 16 GiB sampled. Carry .whl.
source tools/gpu/setup.sh
[ -f scratch/q30.gguf ] || timeout 120 python3 -m strata synth qwen3-30b-a3b scratch/q30.gguf --no-report -q > $OUT/synth.log 2>&1
B="python3 tools/bench_decode.py -m scratch/q30.gguf --prompt-tokens 1024 --gen 256 --runs 3"
timeout 90 $B --vram-gb 8 --label t8_auto 2>$OUT/auto.err | cut -c1-1500
timeout 150 $B --vram-gb 8 --temperature 1 --sweep 000000000,011223344@14,012345678@14 --label t8_sampled 2>$OUT/samp.err | cut -c1-1300
timeout 100 $B --vram-gb 8 --temperature 1 --label t8_sampled_auto 2>$OUT/sauto.err | cut -c1-1500
timeout 60 $B --vram-gb 16 --temperature 1 --cpu-plan 000000000 --label t16_sampled 2>/dev/null | cut -c1-1300
