# The protocol rows at 8 GiB under the held budget (a 4K chunk's activations now counted as torch reserves them):
# greedy auto with the 4K prefill, PCIe only, sampled auto. Carry .whl.
source tools/gpu/setup.sh
[ -f scratch/q30.gguf ] || python3 -m strata synth qwen3-30b-a3b scratch/q30.gguf --no-report -q > $OUT/synth.log 2>&1
B="python3 tools/bench_decode.py -m scratch/q30.gguf --prompt-tokens 1024 --gen 256 --runs 3"
timeout 95 $B --vram-gb 8 --ctx-size 4608 --prefill-only 4096 --prefill-runs 3 --label t8_auto 2>$OUT/t8.err | tee $OUT/t8.json | cut -c1-1400
timeout 75 $B --vram-gb 8 --ctx-size 4608 --cpu-plan 000000000 --prefill-only 4096 --prefill-runs 3 --label t8_pcie 2>/dev/null | tee $OUT/t8p.json | cut -c1-1400
timeout 80 $B --vram-gb 8 --ctx-size 1536 --temperature 1 --label t8_sampled_auto 2>/dev/null | tee $OUT/t8s.json | cut -c1-1000
