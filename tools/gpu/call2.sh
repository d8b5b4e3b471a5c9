# GPU call 2: kernels' tests, decode resident vs tiered at 8 GiB, with profile.
source tools/gpu/setup.sh
timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/ops tests/experts/test_tiered.py 2>&1 | tail -15 > $OUT/gpu_tests2.log; tail -4 $OUT/gpu_tests2.log
[ -f scratch/q30.gguf ] || timeout 120 python3 -m strata synth qwen3-30b-a3b scratch/q30.gguf --no-report -q
B="python3 tools/bench_decode.py -m scratch/q30.gguf --prompt-tokens 1024 --gen 128 --runs 2"
timeout 120 $B --experts resident --label resident 2>&1 | tail -3 | tee $OUT/decode2.log
timeout 200 $B --vram-gb 8 --profile --label tiered-8g 2>&1 | tail -30 | tee -a $OUT/decode2.log
timeout 100 $B --vram-gb 8 --cpu-plan 00000000 --gen 64 --label tiered-8g-allpcie 2>&1 | tail -2 | tee -a $OUT/decode2.log
