# GPU call: llama.cpp built here and run at the same budgets as strata, in the same call (B1).
source tools/gpu/setup.sh
nproc > $OUT/nproc.txt
JOBS=16 TARGETS=llama-bench timeout 330 bash bench/peers/llamacpp.sh build > $OUT/build.log 2>&1; tail -2 $OUT/build.log
[ -f scratch/q30.gguf ] || timeout 120 python3 -m strata synth qwen3-30b-a3b scratch/q30.gguf --no-report -q > $OUT/synth.log 2>&1
L="bash bench/peers/llamacpp.sh bench scratch/q30.gguf"
timeout 100 $L 8 --lengths 4096 --gen 128 --reps 2 --ubatch 4096 > $OUT/ll8.log 2>&1; tail -4 $OUT/ll8.log; cp peers/results/*.json $OUT/ 2>/dev/null
B="python3 tools/bench_decode.py -m scratch/q30.gguf --prompt-tokens 256 --gen 128 --runs 2"
timeout 75 $B --vram-gb 8 --label t8 > $OUT/t8.log 2> /dev/null; cut -c1-400 $OUT/t8.log
timeout 60 $L 999 --lengths 4096 --gen 128 --reps 2 --ubatch 4096 > $OUT/llfull.log 2>&1; tail -4 $OUT/llfull.log; cp peers/results/*.json $OUT/ 2>/dev/null
timeout 40 $B --experts resident --label resident > $OUT/res.log 2> /dev/null; cut -c1-300 $OUT/res.log
