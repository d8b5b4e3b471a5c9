# Last call of the third stop: GPU tests of the split-key decode attention, the chunk buffers sized from the
# budget and the server on CUDA; resident decode with the new attention against SDPA (same call); the 8 GiB
# protocol with the tuned auto plan, PCIe only and the CPU lane at 4 threads; a profile; 16 and 4 GiB.
source tools/gpu/setup.sh
timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/ops/test_decode_attention.py tests/engine/test_graphs.py \
  tests/experts/test_tiered.py tests/server/test_server_gpu.py > $OUT/gpu_tests.log 2>&1; tail -3 $OUT/gpu_tests.log
[ -f scratch/q30.gguf ] || timeout 150 python3 -m strata synth qwen3-30b-a3b scratch/q30.gguf --no-report -q > $OUT/synth.log 2>&1
echo "t=$SECONDS"
B="python3 tools/bench_decode.py -m scratch/q30.gguf --prompt-tokens 1024 --gen 256"
timeout 50 $B --runs 2 --experts resident --label resident_split 2>/dev/null | cut -c1-200
STRATA_DECODE_ATTN=sdpa timeout 50 $B --runs 2 --experts resident --label resident_sdpa 2>/dev/null | cut -c1-200
echo "t=$SECONDS"
timeout 150 $B --runs 3 --vram-gb 8 --prefill-only 4096 --prefill-runs 3 --sweep default,000000000,012345678@4 \
  --label t8 > $OUT/t8.log 2> $OUT/t8.err; cut -c1-900 $OUT/t8.log
echo "t=$SECONDS"
timeout 50 $B --runs 1 --vram-gb 8 --cpu-plan 000000000 --profile --label t8_prof > $OUT/p8.log 2> $OUT/p8.err; cut -c1-300 $OUT/p8.log; grep -A13 "ms/tok" $OUT/p8.err
echo "t=$SECONDS"
[ $SECONDS -lt 380 ] && timeout 45 $B --runs 2 --vram-gb 16 --cpu-plan 000000000 --prefill-only 4096 --label t16 2>/dev/null | cut -c1-600
echo "t=$SECONDS"
[ $SECONDS -lt 430 ] && timeout 55 $B --runs 2 --vram-gb 4 --cpu-plan 000000000 --prefill-only 4096 --label t4 2>/dev/null | cut -c1-600
echo "t=$SECONDS"
