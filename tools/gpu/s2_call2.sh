# GPU call: graphed tiered decode -- GPU tests, plans at 8 GiB, profile.
source tools/gpu/setup.sh
timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/experts/test_tiered_graphed.py tests/engine/test_graphs.py tests/experts/test_tiered.py 2>&1 | tail -15 > $OUT/gpu_tests.log; tail -3 $OUT/gpu_tests.log
[ -f scratch/q30.gguf ] || timeout 120 python3 -m strata synth qwen3-30b-a3b scratch/q30.gguf --no-report -q > $OUT/synth.log 2>&1
B="python3 tools/bench_decode.py -m scratch/q30.gguf --prompt-tokens 256 --gen 128 --runs 2"
timeout 260 $B --vram-gb 8 --cuda-graphs --sweep-plans default,000000000,001122334,011223344,012345678 --label t8g > $OUT/t8g.log 2> $OUT/t8g.err; grep '^{' $OUT/t8g.log | cut -c1-420
timeout 150 $B --vram-gb 8 --cuda-graphs --profile --label t8g_prof > $OUT/t8p.log 2> $OUT/t8p.err; grep '^{' $OUT/t8p.log | cut -c1-300; grep -v repacking $OUT/t8p.err | tail -22
