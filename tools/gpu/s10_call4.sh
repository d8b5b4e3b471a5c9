# Seventh stop, call 4 (~5 min): why the CPU lane loses on sampled text at 8 GiB. The native kernel at a
# decode's cadence, next to PCIe copies and torch's own thread pool (tools/host_lane_overlap.py); then sampled
# decode with a fixed mixed plan, its thread pool spinning longer between layers or not.
source tools/gpu/setup.sh
( python3 -m strata synth qwen3-30b-a3b scratch/q30.gguf --no-report -q > $OUT/synth.log 2>&1 ) &
timeout 120 python3 tools/host_lane_overlap.py --threads 8,14,16 --per-call 1,2,4 > $OUT/overlap.log 2>&1; cat $OUT/overlap.log | cut -c1-400
wait
B="python3 tools/bench_decode.py -m scratch/q30.gguf --prompt-tokens 1024 --gen 256 --runs 3 --vram-gb 8 --ctx-size 1536 --temperature 0.8 --no-cpu-plan-tune"
timeout 100 $B --cpu-plan 000000000 --label s8_pcie 2>/dev/null | tee $OUT/a.json | cut -c1-700
timeout 100 $B --cpu-plan 011223344 --cpu-threads 14 --label s8_mixed14 2>/dev/null | tee $OUT/b.json | cut -c1-700
GOMP_SPINCOUNT=20000000 timeout 100 $B --cpu-plan 011223344 --cpu-threads 14 --label s8_mixed14_spin 2>/dev/null | tee $OUT/c.json | cut -c1-700
timeout 100 $B --cpu-plan 011223344 --cpu-threads 14 --profile --label s8_mixed14_prof 2>$OUT/d.err | tee $OUT/d.json | cut -c1-300; tail -14 $OUT/d.err
echo "done at ${SECONDS}s"
