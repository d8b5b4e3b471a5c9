# Next stop, call 2 (~8.5 min): GPU tests; the 8 GiB PCIe-only row with the 4K prefill; sampled text with and
# without --expert-prefetch (PCIe only); 16 GiB; where the memory goes; a traced 4K prefill. Carry .whl.
source tools/gpu/setup.sh
( [ -f scratch/q30.gguf ] || python3 -m strata synth qwen3-30b-a3b scratch/q30.gguf --no-report -q > $OUT/synth.log 2>&1 ) &
timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider tests/experts tests/engine > $OUT/gpu_tests.log 2>&1; tail -2 $OUT/gpu_tests.log
wait
B="python3 tools/bench_decode.py -m scratch/q30.gguf --prompt-tokens 1024 --gen 256 --runs 3"
timeout 80 $B --vram-gb 8 --ctx-size 4608 --cpu-plan 000000000 --prefill-only 4096 --prefill-runs 3 --label t8_pcie 2>/dev/null | tee $OUT/t8p.json | cut -c1-1500
timeout 80 $B --vram-gb 8 --ctx-size 1536 --temperature 1 --cpu-plan 000000000 --label t8_sampled 2>/dev/null | tee $OUT/t8s.json | cut -c1-1000
timeout 80 $B --vram-gb 8 --ctx-size 1536 --temperature 1 --cpu-plan 000000000 --expert-prefetch --label t8_sampled_prefetch 2>/dev/null | tee $OUT/t8sp.json | cut -c1-1000
timeout 60 $B --vram-gb 16 --ctx-size 4608 --cpu-plan 000000000 --prefill-only 4096 --label t16 2>/dev/null | cut -c1-1200
timeout 60 python3 tools/gpu/memdiag.py -m scratch/q30.gguf --vram-gb 8 --ctx-size 4608 --cpu-plan 000000000 > $OUT/mem.log 2>$OUT/mem.err; cut -c1-330 $OUT/mem.log
# where a 4K prefill's time goes at 8 GiB (torch.profiler: top ops by GPU and by host time; stderr)
timeout 70 $B --vram-gb 8 --ctx-size 4608 --cpu-plan 000000000 --runs 1 --gen 16 --prefill-only 4096 --trace-prefill --label trace 2>$OUT/trace.err | cut -c1-300; grep -A40 -i "top" $OUT/trace.err | head -80
