# Call 5 (~3 min): admissions from the staging slots (no second PCIe copy): the graphed GPU tests, then 8 GiB
# PCIe-only sampled (the uniform-routing case, 21 swaps/token before) and greedy. Carry .whl.
source tools/gpu/setup.sh
( [ -f scratch/q30.gguf ] || python3 -m strata synth qwen3-30b-a3b scratch/q30.gguf --no-report -q > $OUT/synth.log 2>&1 ) &
timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider tests/experts/test_tiered_graphed.py tests/experts/test_tiered.py > $OUT/gpu_tests.log 2>&1; tail -2 $OUT/gpu_tests.log
wait
B="python3 tools/bench_decode.py -m scratch/q30.gguf --prompt-tokens 1024 --gen 256 --runs 3 --vram-gb 8"
timeout 70 $B --temperature 1 --cpu-plan 000000000 --label t8_sampled_promote 2>/dev/null | cut -c1-1400
timeout 60 $B --cpu-plan 000000000 --label t8_promote 2>/dev/null | cut -c1-1400
