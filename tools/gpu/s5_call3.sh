# Call 3 (~6 min): the graphed-decode GPU tests (the staged copies on their own stream), the 8 GiB rows with the
# step-time distribution (PCIe only, recording a routing profile; auto with the mean-scoring tuner), the cache
# layout from that profile on other prompts (no profile / uniform filled from it / --cache-layout profile), the
# --profile breakdown, and the 16 / 4 GiB rows. Carry .whl.
source tools/gpu/setup.sh
( [ -f scratch/q30.gguf ] || python3 -m strata synth qwen3-30b-a3b scratch/q30.gguf --no-report -q > $OUT/synth.log 2>&1 ) &
timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/experts > $OUT/gpu_tests.log 2>&1; tail -2 $OUT/gpu_tests.log
wait
B="python3 tools/bench_decode.py -m scratch/q30.gguf --prompt-tokens 1024 --gen 256"
timeout 60 $B --runs 3 --vram-gb 8 --cpu-plan 000000000 --expert-profile-save scratch/q30.prof --label t8 2>$OUT/t8.err | cut -c1-1100
timeout 90 $B --runs 3 --vram-gb 8 --label t8_auto 2>$OUT/auto.err | cut -c1-1300
for v in "none|" "uniform|--expert-profile scratch/q30.prof" "profile|--expert-profile scratch/q30.prof --cache-layout profile"; do
  timeout 60 $B --runs 3 --vram-gb 8 --cpu-plan 000000000 --salt 500 ${v#*|} --label "t8_layout_${v%%|*}" 2>>$OUT/layout.err | cut -c1-700
done
timeout 50 $B --runs 1 --vram-gb 8 --cpu-plan 000000000 --profile --label t8_prof > $OUT/p8.log 2> $OUT/p8.err; cut -c1-300 $OUT/p8.log; grep -A14 "ms/tok" $OUT/p8.err
timeout 60 $B --runs 2 --vram-gb 16 --cpu-plan 000000000 --label t16 2>/dev/null | cut -c1-800
timeout 70 $B --runs 2 --vram-gb 4 --cpu-plan 000000000 --label t4 2>/dev/null | cut -c1-800
