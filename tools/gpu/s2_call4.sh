# GPU call: B1 with graphs + new kernels: tests, resident, 8 GiB plans + 4K prefill, profile, 16 and 4 GiB.
source tools/gpu/setup.sh
timeout 100 python3 -m pytest -x -q -m gpu -p no:cacheprovider tests/engine/test_graphs.py tests/experts/test_tiered_graphed.py tests/ops/test_fused_interpret.py tests/layers tests/models/test_parity_gpu.py tests/ops/test_prefill_ops_gpu.py 2>&1 | grep -v "^  File\|^    " | tail -12 > $OUT/gpu_tests.log; tail -4 $OUT/gpu_tests.log
[ -f scratch/q30.gguf ] || timeout 120 python3 -m strata synth qwen3-30b-a3b scratch/q30.gguf --no-report -q > $OUT/synth.log 2>&1
B="python3 tools/bench_decode.py -m scratch/q30.gguf --prompt-tokens 256 --gen 128 --runs 2"
timeout 80 $B --experts resident --prefill-only 4096 --label resident > $OUT/res.log 2> $OUT/res.err; grep '^{' $OUT/res.log | cut -c1-300; grep -v repack $OUT/res.err | grep -i error | tail -3
timeout 170 $B --vram-gb 8 --sweep default,000000000,011223344,012345678 --prefill-only 4096 --label t8 > $OUT/t8.log 2> $OUT/t8.err; grep '^{' $OUT/t8.log | cut -c1-560; grep -v repack $OUT/t8.err | grep -i "error\|plan" | tail -3
timeout 75 $B --vram-gb 8 --profile --label t8_prof > $OUT/t8p.log 2> $OUT/t8p.err; grep '^{' $OUT/t8p.log | cut -c1-120; grep -A14 "ms/tok" $OUT/t8p.err
timeout 60 $B --vram-gb 16 --label t16 > $OUT/t16.log 2> $OUT/t16.err; grep '^{' $OUT/t16.log | cut -c1-460
timeout 60 $B --vram-gb 4 --label t4 > $OUT/t4.log 2> $OUT/t4.err; grep '^{' $OUT/t4.log | cut -c1-460
