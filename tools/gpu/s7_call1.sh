# Next stop, call 1 (~9.5 min): llama.cpp built here and held to a true 8 GiB (its fit re-run with one more
# expert layer on the CPU while the measured peak passes the budget), then strata's protocol row at 8 GiB in the
# same call (auto plan, the 4K prefill; the chunk path's host work cut and the split's CPU share bounded since
# the last measurement). Carry .whl and peers/src/llama.cpp-11434-pruned.tar.xz; strata/data/strata-tiny.gguf
# out of the tree (64 MiB limit).
source tools/gpu/setup.sh
( [ -f scratch/q30.gguf ] || python3 -m strata synth qwen3-30b-a3b scratch/q30.gguf --no-report -q > $OUT/synth.log 2>&1 ) &
JOBS=14 TARGETS=llama-bench timeout 330 bash bench/peers/llamacpp.sh build > $OUT/build.log 2>&1; tail -1 $OUT/build.log; echo "build done at ${SECONDS}s"
wait
L="bash bench/peers/llamacpp.sh bench scratch/q30.gguf"
timeout 100 $L 8 --lengths 4096 --gen 0 --reps 2 --ubatch 4096 > $OUT/ll8p.log 2>&1; tail -3 $OUT/ll8p.log; cp peers/results/*.json $OUT/ 2>/dev/null; mkdir -p $OUT/p && mv $OUT/*.json $OUT/p/ 2>/dev/null
timeout 80 $L 8 --lengths 1024 --gen 256 --reps 2 --ubatch 4096 > $OUT/ll8d.log 2>&1; tail -3 $OUT/ll8d.log; cp peers/results/*.json $OUT/ 2>/dev/null
echo "llama.cpp done at ${SECONDS}s"
B="python3 tools/bench_decode.py -m scratch/q30.gguf --prompt-tokens 1024 --gen 256 --runs 3 --vram-gb 8 --ctx-size 4608"
[ $SECONDS -lt 480 ] && timeout 100 $B --prefill-only 4096 --prefill-runs 3 --label t8_auto 2>$OUT/t8.err | tee $OUT/t8.json | cut -c1-1500
echo "strata done at ${SECONDS}s"
