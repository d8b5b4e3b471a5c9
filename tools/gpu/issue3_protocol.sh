# The issue-3 protocol on B1 in one call (~9 min on a warm machine; split at the marked line on a cold one):
# decode with a 1K prompt and 256 generated tokens, median of 3 after a warm-up, at 8 GiB for each plan and CPU
# thread count, 4/16 GiB and unlimited, the --profile breakdown, and 4K prefill at 8 GiB (grouped chunk path).
# Carry .whl with gguf and, for the server test, fastapi/starlette/uvicorn/pydantic*/annotated_types/
# typing_inspection/openai/jiter/distro (../shared/device/wheels.sh); with those the tree is over the 64 MiB a call
# carries unless strata/data/strata-tiny.gguf is moved out of the working tree for the call.
source tools/gpu/setup.sh
# GPU checks of what landed unmeasured: batched graphs, the server on CUDA, the tiered grouped chunk path
timeout 120 python3 -m pytest -x -q -m gpu -p no:cacheprovider tests/engine/test_graphs.py tests/server/test_server_gpu.py \
  tests/experts/test_tiered.py tests/experts/test_tiered_graphed.py 2>&1 | tail -3
[ -f scratch/q30.gguf ] || timeout 120 python3 -m strata synth qwen3-30b-a3b scratch/q30.gguf --no-report -q > $OUT/synth.log 2>&1
B="python3 tools/bench_decode.py -m scratch/q30.gguf --prompt-tokens 1024 --gen 256 --runs 3"
timeout 200 $B --vram-gb 8 --prefill-only 4096 \
  --sweep default,000000000,001122334,011223344,012345678@4,012345678@8,012345678@14,012345678@16 \
  --label t8 > $OUT/t8.log 2> $OUT/t8.err; cut -c1-500 $OUT/t8.log
# ---- split here on a cold machine ----
timeout 100 $B --vram-gb 8 --temperature 1.0 --label t8_sampled > $OUT/t8s.log 2>/dev/null; cut -c1-500 $OUT/t8s.log
timeout 100 $B --vram-gb 8 --profile --label t8_prof > $OUT/t8p.log 2> $OUT/t8p.err; grep -A14 "ms/tok" $OUT/t8p.err
for gb in 4 16; do timeout 90 $B --vram-gb $gb --prefill-only 4096 --label t$gb > $OUT/t$gb.log 2>/dev/null; cut -c1-400 $OUT/t$gb.log; done
timeout 90 $B --experts resident --prefill-only 32768 -c 34000 --label resident > $OUT/res.log 2>/dev/null; cut -c1-300 $OUT/res.log
