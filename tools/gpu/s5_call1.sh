# Call 1 (~8 min): the machine's CPU, the native kernel's tests there, the server on CUDA, the CPU lane per kernel
# and thread count, the 8 GiB protocol with the tuned auto plan and the CPU thread sweep. Carry .whl.
source tools/gpu/setup.sh
lscpu > $OUT/lscpu.txt; grep -E "Model name|^CPU\(s\)|Thread|NUMA node0" $OUT/lscpu.txt; grep -o "avx512[a-z_]*\|amx[a-z_]*\|avx_vnni" $OUT/lscpu.txt | sort -u | tr '\n' ' '; echo
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/experts/test_cpu_lane.py > $OUT/native_tests.log 2>&1; tail -2 $OUT/native_tests.log
timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/server/test_server_gpu.py > $OUT/server.log 2>&1; tail -2 $OUT/server.log
[ -f scratch/q30.gguf ] || timeout 120 python3 -m strata synth qwen3-30b-a3b scratch/q30.gguf --no-report -q > $OUT/synth.log 2>&1
timeout 70 python3 tools/bench_cpu_lane.py --threads 1,4,8,14,16 --experts 64 > $OUT/lane.log 2>&1; grep -v float32 $OUT/lane.log | tail -30
B="python3 tools/bench_decode.py -m scratch/q30.gguf --prompt-tokens 1024 --gen 256 --runs 3 --vram-gb 8"
timeout 90 $B --label t8_auto 2>$OUT/auto.err | cut -c1-1200
timeout 200 $B --sweep 000000000,012345678@4,012345678@8,012345678@14,012345678@16,011223344@8 --label t8 2>$OUT/sweep.err | cut -c1-500
