# GPU call: graph tests, B1 synth, resident eager vs --cuda-graphs, kernel profile, tiered 8 GiB baseline.
source tools/gpu/setup.sh
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_graphs.py tests/ops 2>&1 | tail -15 > $OUT/gpu_tests.log; tail -3 $OUT/gpu_tests.log
[ -f scratch/q30.gguf ] || timeout 120 python3 -m strata synth qwen3-30b-a3b scratch/q30.gguf --no-report -q > $OUT/synth.log 2>&1; ls -la scratch/
B="python3 tools/bench_decode.py -m scratch/q30.gguf --prompt-tokens 256 --gen 96 --runs 2"
timeout 120 $B --experts resident --label resident_eager 2>&1 | tail -3 | tee $OUT/r_eager.log
timeout 120 $B --experts resident --cuda-graphs --label resident_graphs 2>&1 | tail -3 | tee $OUT/r_graphs.log
timeout 120 python3 tools/gpu/profile_decode.py scratch/q30.gguf > $OUT/profile.log 2>&1; head -40 $OUT/profile.log
timeout 150 $B --vram-gb 8 --label tiered8 2>&1 | tail -3 | tee $OUT/t8.log
