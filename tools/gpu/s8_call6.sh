# Sixth stop, call 6 (~3 min): where the default 8 GiB 4K prefill's time goes now (timeline: kernels, copies,
# overlap, idle) and one more sample of its speed. Carry .whl.
source tools/gpu/setup.sh
python3 -m strata synth qwen3-30b-a3b scratch/q30.gguf --no-report -q > $OUT/synth.log 2>&1
B="python3 tools/bench_decode.py -m scratch/q30.gguf --prompt-tokens 1024 --runs 1 --gen 16 --ctx-size 4608 --vram-gb 8 --prefill-only 4096 --prefill-runs 3"
timeout 75 $B --trace-prefill --trace-out /tmp/tr.json.gz --label t8_trace 2>/dev/null | python3 -c "import sys,json; d=json.loads(sys.stdin.read()); print(d['plan'], d['prefill_long'], d['device_used_gib'])"
timeout 40 python3 tools/trace_timeline.py /tmp/tr.json.gz | head -24
echo "done at ${SECONDS}s"
