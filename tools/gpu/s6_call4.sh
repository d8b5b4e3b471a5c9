# Why the 4K prefill at 8 GiB fell (7,132 -> 4,750 tok/s) once the budget was held: the same prefill with the
# allocator as it now is (expandable segments, capped), with fixed segments, without the cap, and with 1 GiB of
# reserve (more room under the cap). Carry .whl.
source tools/gpu/setup.sh
[ -f scratch/q30.gguf ] || python3 -m strata synth qwen3-30b-a3b scratch/q30.gguf --no-report -q > $OUT/synth.log 2>&1
B="python3 tools/bench_decode.py -m scratch/q30.gguf --prompt-tokens 1024 --gen 16 --runs 1 --vram-gb 8 --ctx-size 4608 --cpu-plan 000000000 --prefill-only 4096 --prefill-runs 4"
K="python3 -c \"import sys,json; [print({k: d.get(k) for k in ('label','slots_per_layer','prefill_long','max_vram_gib','device_used_gib')}) for d in map(json.loads, sys.stdin)]\""
timeout 75 $B --label p_default 2>/dev/null | tee -a $OUT/p.json | eval $K
STRATA_FIXED_SEGMENTS=1 timeout 75 $B --label p_fixed 2>/dev/null | tee -a $OUT/p.json | eval $K
STRATA_ALLOC_CAP=0 timeout 75 $B --label p_nocap 2>/dev/null | tee -a $OUT/p.json | eval $K
timeout 75 $B --vram-reserve-mib 1024 --label p_reserve1g 2>/dev/null | tee -a $OUT/p.json | eval $K
