# Next stop, call 2 (~7 min): the server on CUDA (carry .whl with the whole server stack: fastapi, starlette,
# uvicorn, pydantic*, annotated_*, typing_inspection, openai, jiter, httpx2, httpcore2, sniffio, distro,
# opentelemetry_api, truststore); the CPU lane's kernels (native vs int4) per thread count; the 8 GiB protocol with
# the tuned auto plan and the CPU thread sweep in one call, native and int4 lanes.
source tools/gpu/setup.sh
timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/server/test_server_gpu.py > $OUT/server.log 2>&1; tail -2 $OUT/server.log
[ -f scratch/q30.gguf ] || timeout 120 python3 -m strata synth qwen3-30b-a3b scratch/q30.gguf --no-report -q > $OUT/synth.log 2>&1
B="python3 tools/bench_decode.py -m scratch/q30.gguf --prompt-tokens 1024 --gen 256 --runs 3 --vram-gb 8"
timeout 60 python3 tools/bench_cpu_lane.py --threads 4,8,14,16 --experts 64 2>&1 | grep -v "float32" | tail -24
timeout 90 $B --label t8_auto 2>/dev/null | cut -c1-1200
timeout 200 $B --sweep 000000000,012345678@4,012345678@8,012345678@14,012345678@16,011223344@8 --label t8 2>/dev/null | cut -c1-500
