# Next stop, call 2 (~5 min): is the 4K prefill's next-layer prefetch waiting for this layer's compute? Two
# chunk buffers of 79 experts hold a layer's ~100 uncached experts only by using both. Timelines of the default
# and of layer-sized buffers (STRATA_CHUNK_STAGE_MIB=280: 105 experts each), 8 GiB, PCIe only; then the plain
# timed prefill of each. Carry .whl; move strata/data/strata-tiny.gguf out of the tree for the call.
source tools/gpu/setup.sh
[ -f scratch/q30.gguf ] || python3 -m strata synth qwen3-30b-a3b scratch/q30.gguf --no-report -q > $OUT/synth.log 2>&1
B="python3 tools/bench_decode.py -m scratch/q30.gguf --prompt-tokens 1024 --gen 16 --runs 1 --vram-gb 8 --ctx-size 4608 --cpu-plan 000000000 --no-cpu-plan-tune --prefill-only 4096 --prefill-runs 3"
for mib in default 280; do
  E=$([ $mib = default ] && echo "" || echo "STRATA_CHUNK_STAGE_MIB=$mib")
  env $E timeout 90 $B --trace-prefill --trace-out /tmp/tr_$mib.json.gz --label buf_$mib 2>/dev/null \
    | python3 -c "import sys,json; d=json.loads(sys.stdin.read()); print(d['label'], d['slots_per_layer'], d['prefill_long'], d['device_used_gib'])"
  timeout 40 python3 tools/trace_timeline.py /tmp/tr_$mib.json.gz | head -24 | tee $OUT/timeline_$mib.txt
done
echo "done at ${SECONDS}s"
