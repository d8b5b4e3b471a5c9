# The auto plan's 4K prefill at 8 GiB after the split's change (the CPU takes only experts within the token
# counts its cost was measured at) beside PCIe only, one load each. Carry .whl.
source tools/gpu/setup.sh
[ -f scratch/q30.gguf ] || python3 -m strata synth qwen3-30b-a3b scratch/q30.gguf --no-report -q > $OUT/synth.log 2>&1
B="python3 tools/bench_decode.py -m scratch/q30.gguf --prompt-tokens 1024 --gen 16 --runs 1 --vram-gb 8 --ctx-size 4608 --prefill-only 4096 --prefill-runs 3"
timeout 100 $B --label p_auto 2>/dev/null | cut -c1-200
