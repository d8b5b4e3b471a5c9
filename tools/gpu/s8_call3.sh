# Sixth stop, call 3 (~6 min): the chunk ring (copies wait only for their buffer's last reader) and the chunk
# CPU share priced by measurement, measured: GPU tests; the 8 GiB protocol row (auto: decode + 4K prefill) and
# PCIe only; all resident as the baseline; a traced PCIe-only 4K prefill's timeline; 16 GiB. Carry .whl.
source tools/gpu/setup.sh
( [ -f scratch/q30.gguf ] || python3 -m strata synth qwen3-30b-a3b scratch/q30.gguf --no-report -q > $OUT/synth.log 2>&1 ) &
timeout 110 python3 -m pytest -q -m gpu -p no:cacheprovider tests/experts tests/engine > $OUT/gpu_tests.log 2>&1; tail -2 $OUT/gpu_tests.log
wait
B="python3 tools/bench_decode.py -m scratch/q30.gguf --prompt-tokens 1024 --gen 256 --runs 3 --ctx-size 4608 --prefill-only 4096 --prefill-runs 3"
K="python3 -c \"import sys,json; [print({k: d.get(k) for k in ('label','plan','slots_per_layer','decode_tok_s','experts_decode','prefill_long','max_vram_gib','device_used_gib')}, '\n', (d.get('plan_tuner') or {}).get('chosen')) for d in map(json.loads, sys.stdin)]\""
timeout 110 $B --vram-gb 8 --label t8_auto 2>$OUT/auto.err | tee -a $OUT/rows.json | eval $K
timeout 90 $B --vram-gb 8 --cpu-plan 000000000 --label t8_pcie 2>/dev/null | tee -a $OUT/rows.json | eval $K
timeout 60 $B --runs 1 --gen 16 --label resident 2>/dev/null | tee -a $OUT/rows.json | eval $K
[ $SECONDS -lt 400 ] && timeout 60 $B --vram-gb 16 --cpu-plan 000000000 --runs 1 --gen 16 --label t16_pcie 2>/dev/null | tee -a $OUT/rows.json | eval $K
[ $SECONDS -lt 470 ] && timeout 80 $B --vram-gb 8 --cpu-plan 000000000 --runs 1 --gen 16 --prefill-runs 2 --trace-prefill --trace-out /tmp/tr.json.gz --label trace 2>/dev/null | eval $K
python3 tools/trace_timeline.py /tmp/tr.json.gz > $OUT/timeline.json 2>&1; head -30 $OUT/timeline.json
echo "done at ${SECONDS}s"
