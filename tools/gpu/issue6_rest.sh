# The B1 rows still missing from docs/BENCHMARKS.md, llama.cpp and strata in the same call (~9 min):
# 16 GiB decode, 4K prefill at 8 GiB for both, 32K prefill unlimited for both. Needs the pruned llama.cpp
# source (bench/peers/llamacpp.sh pack) carried as peers/src/llama.cpp-11434-pruned.tar.xz.
source tools/gpu/setup.sh
JOBS=16 TARGETS=llama-bench timeout 330 bash bench/peers/llamacpp.sh build > $OUT/build.log 2>&1; tail -1 $OUT/build.log
[ -f scratch/q30.gguf ] || timeout 120 python3 -m strata synth qwen3-30b-a3b scratch/q30.gguf --no-report -q > $OUT/synth.log 2>&1
L="bash bench/peers/llamacpp.sh bench scratch/q30.gguf"
timeout 80 $L 16 --lengths 4096 --gen 128 --reps 2 --ubatch 4096 > $OUT/ll16.log 2>&1; tail -3 $OUT/ll16.log
timeout 60 $L 999 --lengths 32768 --gen 0 --reps 1 --ubatch 4096 > $OUT/ll32k.log 2>&1; tail -3 $OUT/ll32k.log
cp peers/results/*.json $OUT/ 2>/dev/null
B="python3 tools/bench_decode.py -m scratch/q30.gguf --prompt-tokens 256 --gen 128 --runs 2"
timeout 70 $B --vram-gb 16 --label t16 > $OUT/t16.log 2>/dev/null; cut -c1-400 $OUT/t16.log
timeout 70 $B --vram-gb 8 --prefill-only 4096 --label t8 > $OUT/t8.log 2>/dev/null; cut -c1-400 $OUT/t8.log
timeout 60 $B --experts resident --prefill-only 32768 -c 34000 --label res > $OUT/res.log 2>/dev/null; cut -c1-300 $OUT/res.log
