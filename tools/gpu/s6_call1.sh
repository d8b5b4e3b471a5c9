# Next stop, call 1 (~6 min): the budget rows again under the budget accounting that counts the CUDA context and
# a 4096-token prefill chunk (this stop's rows used ~0.5-0.9 GiB past --vram-gb): `device_used_gib` must stay at
# or under the budget. Greedy (the protocol) and sampled text, 8 GiB with the 4K prefill; 16 and 4 GiB. Carry .whl.
source tools/gpu/setup.sh
( [ -f scratch/q30.gguf ] || python3 -m strata synth qwen3-30b-a3b scratch/q30.gguf --no-report -q > $OUT/synth.log 2>&1 ) &
timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider tests/experts tests/engine > $OUT/gpu_tests.log 2>&1; tail -2 $OUT/gpu_tests.log
wait
B="python3 tools/bench_decode.py -m scratch/q30.gguf --prompt-tokens 1024 --gen 256 --runs 3"
timeout 100 $B --vram-gb 8 --prefill-only 4096 --prefill-runs 3 --label t8_auto 2>$OUT/t8.err | cut -c1-1800
timeout 60 $B --vram-gb 8 --cpu-plan 000000000 --label t8_pcie 2>/dev/null | cut -c1-1500
timeout 90 $B --vram-gb 8 --temperature 1 --label t8_sampled_auto 2>/dev/null | cut -c1-1800
timeout 60 $B --vram-gb 16 --cpu-plan 000000000 --prefill-only 4096 --label t16 2>/dev/null | cut -c1-1500
timeout 70 $B --vram-gb 4 --cpu-plan 000000000 --label t4 2>/dev/null | cut -c1-1500
