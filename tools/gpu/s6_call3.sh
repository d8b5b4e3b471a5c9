# The budget held: expandable segments, torch's allocator capped at the budget less what lies outside it, a 4K
# prefill chunk's activations as measured (328 KB a token for B1). GPU tests; the memory stages; the 8 GiB rows
# (greedy auto and PCIe with the 4K prefill, sampled auto), 16 and 4 GiB. Contexts as llama-bench sizes them.
source tools/gpu/setup.sh
( [ -f scratch/q30.gguf ] || python3 -m strata synth qwen3-30b-a3b scratch/q30.gguf --no-report -q > $OUT/synth.log 2>&1 ) &
timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider tests/experts tests/engine > $OUT/gpu_tests.log 2>&1; tail -3 $OUT/gpu_tests.log
wait
timeout 60 python3 tools/gpu/memdiag.py -m scratch/q30.gguf --vram-gb 8 --ctx-size 4608 --cpu-plan 000000000 > $OUT/mem.log 2>$OUT/mem.err; cut -c1-330 $OUT/mem.log; tail -3 $OUT/mem.err
B="python3 tools/bench_decode.py -m scratch/q30.gguf --prompt-tokens 1024 --gen 256 --runs 3"
timeout 95 $B --vram-gb 8 --ctx-size 4608 --prefill-only 4096 --prefill-runs 3 --label t8_auto 2>$OUT/t8.err | cut -c1-3000
timeout 70 $B --vram-gb 8 --ctx-size 4608 --cpu-plan 000000000 --prefill-only 4096 --prefill-runs 3 --label t8_pcie 2>/dev/null | cut -c1-1500
timeout 85 $B --vram-gb 8 --ctx-size 1536 --temperature 1 --label t8_sampled_auto 2>/dev/null | cut -c1-3000
timeout 60 $B --vram-gb 16 --ctx-size 4608 --cpu-plan 000000000 --prefill-only 4096 --label t16 2>/dev/null | cut -c1-1500
timeout 50 $B --vram-gb 4 --ctx-size 1536 --cpu-plan 000000000 --runs 2 --label t4 2>/dev/null | cut -c1-1500
