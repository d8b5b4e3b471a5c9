# Sixth stop, call 5 (~5 min): the defaults after call 4 (a ring of 2 chunk buffers; a CUDA chunk's CPU share
# priced serially; x copied to the host only for a CPU share): GPU tests; the 8 GiB protocol row (auto: decode
# + 4K prefill) and PCIe only; 16 GiB. Carry .whl.
source tools/gpu/setup.sh
( [ -f scratch/q30.gguf ] || python3 -m strata synth qwen3-30b-a3b scratch/q30.gguf --no-report -q > $OUT/synth.log 2>&1 ) &
timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider tests/experts tests/engine > $OUT/gpu_tests.log 2>&1; tail -1 $OUT/gpu_tests.log
wait
B="python3 tools/bench_decode.py -m scratch/q30.gguf --prompt-tokens 1024 --gen 256 --runs 3 --ctx-size 4608 --prefill-only 4096 --prefill-runs 3"
K="python3 -c \"import sys,json; [print(d.get('label'), d.get('plan'), d.get('slots_per_layer'), d.get('decode_tok_s'), d.get('experts_decode',{}).get('hit_rate'), d.get('prefill_long'), d.get('max_vram_gib'), d.get('device_used_gib'), (d.get('plan_tuner') or {}).get('chosen')) for d in map(json.loads, sys.stdin)]\""
timeout 110 $B --vram-gb 8 --label t8_auto 2>/dev/null | tee -a $OUT/rows.json | eval $K
timeout 90 $B --vram-gb 8 --cpu-plan 000000000 --label t8_pcie 2>/dev/null | tee -a $OUT/rows.json | eval $K
[ $SECONDS -lt 330 ] && timeout 60 $B --vram-gb 16 --runs 1 --gen 16 --label t16_auto 2>/dev/null | tee -a $OUT/rows.json | eval $K
echo "done at ${SECONDS}s"
