# GPU checks of what landed CPU-tested only, then 4K prefill at 8 GiB through the chunk buffers (B1).
# Carry .whl with gguf and the server stack (fastapi, starlette, uvicorn, pydantic*, annotated_*, typing_inspection,
# openai, jiter, httpx2/httpcore2); move strata/data/strata-tiny.gguf out of the tree for the call (64 MiB limit).
source tools/gpu/setup.sh
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
timeout 170 python3 -m pytest -x -q -m gpu -p no:cacheprovider tests/experts/test_tiered.py tests/experts/test_tiered_graphed.py \
  tests/engine/test_graphs.py tests/server/test_server_gpu.py tests/ops/test_prefill_ops_gpu.py > $OUT/gpu_tests.log 2>&1
tail -4 $OUT/gpu_tests.log
[ -f scratch/q30.gguf ] || timeout 150 python3 -m strata synth qwen3-30b-a3b scratch/q30.gguf --no-report -q > $OUT/synth.log 2>&1
P="python3 tools/bench_decode.py -m scratch/q30.gguf --prompt-tokens 256 --gen 16 --runs 0 --prefill-only 4096 --prefill-runs 3 --vram-gb 8"
timeout 80 $P --cpu-plan 000000000 --label pre_pcie_96 --trace-prefill > $OUT/pre96.log 2> $OUT/pre96.err; cat $OUT/pre96.log
STRATA_CHUNK_STAGE_MIB=256 timeout 60 $P --cpu-plan 000000000 --label pre_pcie_256 > $OUT/pre256.log 2> $OUT/pre256.err; cat $OUT/pre256.log
STRATA_CHUNK_STAGE_MIB=32 timeout 60 $P --cpu-plan 000000000 --label pre_pcie_32 > $OUT/pre32.log 2> $OUT/pre32.err; cat $OUT/pre32.log
timeout 150 $P --label pre_auto > $OUT/preauto.log 2> $OUT/preauto.err; cat $OUT/preauto.log; grep -i "plan\|cost" $OUT/preauto.err | head -5
cat ~/.cache/strata/costs/*.json 2>/dev/null | tr -d '\n' | cut -c1-600; echo
grep -B2 -A30 "Self CUDA" $OUT/pre96.err | cut -c1-150 | head -45
