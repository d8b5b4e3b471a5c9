# GPU tests of what landed CPU-tested only, 4K prefill at 8 GiB after the host-cost fixes, then the issue-3 decode
# protocol at 8 GiB (1K prompt, 256 tokens, median of 3 after a warm-up) over plans and CPU threads, then other
# budgets while the call has time. Carry .whl (gguf, server stack, sniffio, distro); strata-tiny.gguf moved out.
source tools/gpu/setup.sh
timeout 130 python3 -m pytest -q -m gpu -p no:cacheprovider tests/experts/test_tiered.py tests/experts/test_tiered_graphed.py \
  tests/engine/test_graphs.py tests/ops/test_prefill_ops_gpu.py > $OUT/gpu_tests.log 2>&1; tail -3 $OUT/gpu_tests.log
timeout 70 python3 -m pytest -q -m gpu -p no:cacheprovider tests/server/test_server_gpu.py > $OUT/gpu_server.log 2>&1; tail -3 $OUT/gpu_server.log
[ -f scratch/q30.gguf ] || { /usr/bin/time -f "synth %e s" timeout 150 python3 -m strata synth qwen3-30b-a3b scratch/q30.gguf --no-report -q > $OUT/synth.log 2>&1; tail -1 $OUT/synth.log; }
echo "t=$SECONDS"
P="python3 tools/bench_decode.py -m scratch/q30.gguf --prompt-tokens 256 --gen 16 --runs 0 --prefill-only 4096 --prefill-runs 3 --vram-gb 8"
timeout 70 $P --cpu-plan 000000000 --label pre_pcie --trace-prefill > $OUT/pre.log 2> $OUT/pre.err; cat $OUT/pre.log
echo "t=$SECONDS"
B="python3 tools/bench_decode.py -m scratch/q30.gguf --prompt-tokens 1024 --gen 256 --runs 3"
timeout 240 $B --vram-gb 8 --prefill-only 4096 --prefill-runs 3 \
  --sweep 000000000,default,000000000,011223344,012345678@16,012345678@14,012345678@8,012345678@4 \
  --label t8 > $OUT/t8.log 2> $OUT/t8.err; cut -c1-420 $OUT/t8.log
echo "t=$SECONDS"
for gb in 16 4; do [ $SECONDS -lt 500 ] && timeout 45 $B --runs 2 --vram-gb $gb --cpu-plan 000000000 --label t$gb > $OUT/t$gb.log 2>/dev/null; cut -c1-400 $OUT/t$gb.log; done
echo "t=$SECONDS"
grep -B2 -A24 "Self CUDA" $OUT/pre.err | cut -c1-150 | head -30
grep -A12 "Self CPU time total" $OUT/pre.err | tail -14 | cut -c1-120
