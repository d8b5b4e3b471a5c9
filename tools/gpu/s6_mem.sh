# Where the device memory goes under --vram-gb 8 (stage by stage; with and without the allocator's expandable
# segments), then the 8 GiB rows again: auto with the 4K prefill (its CPU share now at the lane's full threads),
# sampled auto (the tuner's evidence), PCIe-only 4K prefill. Contexts as llama-bench sizes them. Carry .whl.
source tools/gpu/setup.sh
( [ -f scratch/q30.gguf ] || python3 -m strata synth qwen3-30b-a3b scratch/q30.gguf --no-report -q > $OUT/synth.log 2>&1 ) ; ls -la scratch
M="python3 tools/gpu/memdiag.py -m scratch/q30.gguf --vram-gb 8 --cpu-plan 000000000"
timeout 80 $M > $OUT/mem_default.log 2>$OUT/mem_default.err; cat $OUT/mem_default.log | cut -c1-400
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 80 $M > $OUT/mem_expand.log 2>$OUT/mem_expand.err; cat $OUT/mem_expand.log | cut -c1-400
B="python3 tools/bench_decode.py -m scratch/q30.gguf --prompt-tokens 1024 --gen 256 --runs 3"
timeout 100 $B --vram-gb 8 --ctx-size 4608 --prefill-only 4096 --prefill-runs 3 --label t8_auto 2>$OUT/t8.err | cut -c1-2500
timeout 90 $B --vram-gb 8 --ctx-size 1536 --temperature 1 --label t8_sampled_auto 2>/dev/null | cut -c1-2500
timeout 80 $B --vram-gb 8 --ctx-size 4608 --cpu-plan 000000000 --prefill-only 4096 --prefill-runs 3 --label t8_pcie 2>/dev/null | cut -c1-1500
