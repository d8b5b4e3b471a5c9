# GPU call: new kernels (tests + micro-benchmarks), resident graphed decode + 4K prefill, 8 GiB sweeps, profile.
source tools/gpu/setup.sh
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/ops tests/layers tests/quant tests/experts tests/engine tests/models/test_parity_gpu.py 2>&1 | tail -25 > $OUT/gpu_tests.log; tail -4 $OUT/gpu_tests.log
[ -f tools/bench_kernels.py ] && timeout 70 python3 tools/bench_kernels.py > $OUT/kernels.log 2>&1; tail -20 $OUT/kernels.log
[ -f tools/bench_prefill_ops.py ] && timeout 70 python3 tools/bench_prefill_ops.py > $OUT/prefill_ops.log 2>&1; tail -12 $OUT/prefill_ops.log
[ -f scratch/q30.gguf ] || timeout 120 python3 -m strata synth qwen3-30b-a3b scratch/q30.gguf --no-report -q > $OUT/synth.log 2>&1
B="python3 tools/bench_decode.py -m scratch/q30.gguf --prompt-tokens 256 --gen 128 --runs 2"
timeout 100 $B --experts resident --prefill-only 4096 --label resident > $OUT/res.log 2> $OUT/res.err; grep '^{' $OUT/res.log | cut -c1-400
timeout 240 $B --vram-gb 8 --sweep default,000000000,001122334,011223344,012345678,012345678@8,012345678@14,011223344@14 --label t8 > $OUT/t8.log 2> $OUT/t8.err; grep '^{' $OUT/t8.log | cut -c1-460
timeout 100 $B --vram-gb 8 --profile --label t8_prof > $OUT/t8p.log 2> $OUT/t8p.err; grep '^{' $OUT/t8p.log | cut -c1-200; grep -v repacking $OUT/t8p.err | grep -A14 "ms/tok"
grep -h "expert cache\|plan" $OUT/t8.err | head -3
