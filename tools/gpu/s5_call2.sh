# Call 2 (~9 min): llama.cpp built here and run at 8 GiB and unlimited (the issue-3 protocol: 4K prefill with
# -ub 4096, decode 256 at depth 1024), strata's 8 GiB and resident rows in the same call; then, while time is left,
# the native kernel's tests and the CPU lane with the 512-bit Q4_K path. Carry .whl and
# peers/src/llama.cpp-11434-pruned.tar.xz; strata/data/strata-tiny.gguf out of the tree (64 MiB limit).
source tools/gpu/setup.sh
( [ -f scratch/q30.gguf ] || python3 -m strata synth qwen3-30b-a3b scratch/q30.gguf --no-report -q > $OUT/synth.log 2>&1 ) &
JOBS=14 TARGETS=llama-bench timeout 330 bash bench/peers/llamacpp.sh build > $OUT/build.log 2>&1; tail -1 $OUT/build.log; echo "build done at ${SECONDS}s"
wait
L="bash bench/peers/llamacpp.sh bench scratch/q30.gguf"
timeout 70 $L 8 --lengths 4096 --gen 0 --reps 2 --ubatch 4096 > $OUT/ll8p.log 2>&1; tail -2 $OUT/ll8p.log
timeout 70 $L 8 --lengths 1024 --gen 256 --reps 2 --ubatch 4096 > $OUT/ll8d.log 2>&1; tail -2 $OUT/ll8d.log
timeout 40 $L 999 --lengths 1024 --gen 256 --reps 2 --ubatch 4096 > $OUT/llres.log 2>&1; tail -2 $OUT/llres.log
cp peers/results/*.json $OUT/ 2>/dev/null; echo "llama.cpp done at ${SECONDS}s"
B="python3 tools/bench_decode.py -m scratch/q30.gguf --prompt-tokens 1024 --gen 256"
timeout 80 $B --runs 3 --vram-gb 8 --cpu-plan 000000000 --prefill-only 4096 --prefill-runs 3 --label t8 2>$OUT/t8.err | cut -c1-900
timeout 40 $B --runs 2 --experts resident --label resident 2>$OUT/res.err | cut -c1-400
echo "strata done at ${SECONDS}s"
[ $SECONDS -lt 520 ] && timeout 40 python3 -m pytest -q -p no:cacheprovider tests/experts/test_cpu_lane.py > $OUT/native_tests.log 2>&1; tail -2 $OUT/native_tests.log
[ $SECONDS -lt 540 ] && timeout 45 python3 tools/bench_cpu_lane.py --threads 1,14,16 --experts 64 > $OUT/lane.log 2>&1; grep -E "native|int4|memory" $OUT/lane.log
