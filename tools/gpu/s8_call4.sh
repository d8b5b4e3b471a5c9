# Sixth stop, call 4 (~5 min): the chunk copies issued by one _foreach_copy_ a batch; the ring's size (8, 4, 2
# buffers: STRATA_CHUNK_RING) on the 8 GiB PCIe-only 4K prefill; auto's 4K prefill (its CPU pairs and learned
# price) with and without OMP_WAIT_POLICY=passive; then the 8 GiB protocol row (auto). Carry .whl.
source tools/gpu/setup.sh
( [ -f scratch/q30.gguf ] || python3 -m strata synth qwen3-30b-a3b scratch/q30.gguf --no-report -q > $OUT/synth.log 2>&1 ) &
timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/experts -k chunk > $OUT/gpu_tests.log 2>&1; tail -1 $OUT/gpu_tests.log
wait
B="python3 tools/bench_decode.py -m scratch/q30.gguf --prompt-tokens 1024 --gen 256 --runs 3 --ctx-size 4608 --vram-gb 8 --prefill-only 4096 --prefill-runs 3"
P="$B --runs 1 --gen 16"
K="python3 -c \"import sys,json; [print(d.get('label'), d.get('plan'), d.get('decode_tok_s'), d.get('prefill_long'), d.get('device_used_gib'), (d.get('plan_tuner') or {}).get('chosen')) for d in map(json.loads, sys.stdin)]\""
for r in 8 4 2; do STRATA_CHUNK_RING=$r timeout 50 $P --cpu-plan 000000000 --label pcie_ring$r 2>/dev/null | tee -a $OUT/rows.json | eval $K; done
timeout 60 $P --label auto 2>/dev/null | tee -a $OUT/rows.json | eval $K
OMP_WAIT_POLICY=passive timeout 60 $P --label auto_passive 2>/dev/null | tee -a $OUT/rows.json | eval $K
[ $SECONDS -lt 420 ] && timeout 110 $B --label t8_auto 2>/dev/null | tee -a $OUT/rows.json | eval $K
echo "done at ${SECONDS}s"
