# Next stop, call 1 (~9 min): llama.cpp built here and run at 8 GiB and unlimited (prefill 4K, decode 256 at depth
# 1024: the issue-3 protocol), strata's 8 GiB protocol row and resident row in the same call. Carry .whl (gguf)
# and peers/src/llama.cpp-11434-pruned.tar.xz (`bash bench/peers/llamacpp.sh pack`); move
# strata/data/strata-tiny.gguf out of the tree for the call (64 MiB limit).
source tools/gpu/setup.sh
JOBS=16 TARGETS=llama-bench timeout 330 bash bench/peers/llamacpp.sh build > $OUT/build.log 2>&1; tail -1 $OUT/build.log
[ -f scratch/q30.gguf ] || timeout 120 python3 -m strata synth qwen3-30b-a3b scratch/q30.gguf --no-report -q > $OUT/synth.log 2>&1
L="bash bench/peers/llamacpp.sh bench scratch/q30.gguf"
timeout 70 $L 8 --lengths 4096 --gen 0 --reps 2 --ubatch 4096 > $OUT/ll8p.log 2>&1; tail -2 $OUT/ll8p.log
timeout 70 $L 8 --lengths 1024 --gen 256 --reps 2 --ubatch 4096 > $OUT/ll8d.log 2>&1; tail -2 $OUT/ll8d.log
timeout 40 $L 999 --lengths 1024 --gen 256 --reps 2 --ubatch 4096 > $OUT/llres.log 2>&1; tail -2 $OUT/llres.log
cp peers/results/*.json $OUT/ 2>/dev/null
B="python3 tools/bench_decode.py -m scratch/q30.gguf --prompt-tokens 1024 --gen 256"
timeout 80 $B --runs 3 --vram-gb 8 --cpu-plan 000000000 --prefill-only 4096 --prefill-runs 3 --label t8 2>/dev/null | cut -c1-700
timeout 40 $B --runs 2 --experts resident --label resident 2>/dev/null | cut -c1-250
