# Next stop, call 2 of the warm pair (~8 min; right after s9_build.sh, same carry): llama.cpp held to a true
# 8 GiB (-ncmoe re-fitted while its measured peak passes the budget) and strata's 8 GiB protocol row (auto: greedy
# decode and the 4K prefill), in one call; then chunk buffers that hold a whole layer's uncached experts (B1 at
# 8 GiB: 105 x 2.65 MB; by default a sixteenth of the cache's share, 79): the next layer's copies would then land
# in the buffer this layer does not read, at the cost of about one cache slot a layer.
source tools/gpu/setup.sh
[ -x peers/llama.cpp/build/bin/llama-bench ] || { echo "no llama-bench: the machine was not warm"; exit 1; }
timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/experts -k "chunk or budget" > $OUT/gpu_tests.log 2>&1; tail -1 $OUT/gpu_tests.log
[ -f scratch/q30.gguf ] || python3 -m strata synth qwen3-30b-a3b scratch/q30.gguf --no-report -q > $OUT/synth.log 2>&1
L="bash bench/peers/llamacpp.sh bench scratch/q30.gguf"
timeout 150 $L 8 --lengths 4096 --gen 0 --reps 3 --ubatch 4096 > $OUT/ll8p.log 2>&1; tail -4 $OUT/ll8p.log
mkdir -p $OUT/p && cp peers/results/*.json $OUT/p/ 2>/dev/null
timeout 110 $L 8 --lengths 1024 --gen 256 --reps 3 --ubatch 4096 > $OUT/ll8d.log 2>&1; tail -4 $OUT/ll8d.log
cp peers/results/*.json $OUT/ 2>/dev/null
B="python3 tools/bench_decode.py -m scratch/q30.gguf --prompt-tokens 1024 --gen 256 --runs 3 --vram-gb 8 --ctx-size 4608"
timeout 120 $B --prefill-only 4096 --prefill-runs 3 --label t8_auto 2>/dev/null | tee $OUT/t8.json | cut -c1-1200
[ $SECONDS -lt 480 ] && STRATA_CHUNK_STAGE_MIB=280 timeout 110 $B --prefill-only 4096 --prefill-runs 3 --label t8_auto_buf280 2>/dev/null | tee $OUT/t8b.json | cut -c1-1200
echo "done at ${SECONDS}s"
