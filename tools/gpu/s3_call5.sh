# The server on CUDA (its wheels complete) and the 8 GiB default plan with the corrected tuner.
source tools/gpu/setup.sh
timeout 50 python3 -m pytest -q -m gpu -p no:cacheprovider tests/server/test_server_gpu.py > $OUT/server.log 2>&1; tail -2 $OUT/server.log
[ -f scratch/q30.gguf ] || timeout 60 python3 -m strata synth qwen3-30b-a3b scratch/q30.gguf --no-report -q > $OUT/synth.log 2>&1
timeout 70 python3 tools/bench_decode.py -m scratch/q30.gguf --prompt-tokens 1024 --gen 256 --runs 2 --vram-gb 8 --label t8_tuned 2>/dev/null | cut -c1-1200
echo "t=$SECONDS"
