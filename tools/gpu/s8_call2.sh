# Sixth stop, call 2 (~8 min): GPU tests; where a 4K prefill's time goes at 8 GiB, as timelines (kernels, copies,
# their overlap, the idle gaps: tools/trace_timeline.py), PCIe-only and auto plans, and all experts resident as
# the baseline, in one call. Carry .whl.
source tools/gpu/setup.sh
( [ -f scratch/q30.gguf ] || python3 -m strata synth qwen3-30b-a3b scratch/q30.gguf --no-report -q > $OUT/synth.log 2>&1 ) &
timeout 110 python3 -m pytest -q -m gpu -p no:cacheprovider tests/experts tests/engine > $OUT/gpu_tests.log 2>&1; tail -2 $OUT/gpu_tests.log
wait
B="python3 tools/bench_decode.py -m scratch/q30.gguf --prompt-tokens 1024 --runs 1 --gen 16 --ctx-size 4608 --prefill-only 4096 --prefill-runs 3 --trace-prefill"
for v in "pcie --vram-gb 8 --cpu-plan 000000000" "auto --vram-gb 8" "resident"; do
  set -- $v; n=$1; shift
  [ $SECONDS -lt 470 ] && timeout 100 $B "$@" --label t_$n --trace-out $OUT/tr_$n.json.gz 2>$OUT/$n.err | tee $OUT/$n.json | cut -c1-900
  python3 tools/trace_timeline.py $OUT/tr_$n.json.gz 2>&1 | tee $OUT/tl_$n.txt | head -40
  echo "$n done at ${SECONDS}s"
done
