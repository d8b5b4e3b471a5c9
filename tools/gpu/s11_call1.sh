# Next stop, call 1 (~7 min): speculative decoding with n-gram drafts on the GPU. The GPU tests of the drafts
# (graphed tiered steps between eager verify steps) and the chunk path; then B1 at 8 GiB and all resident,
# greedy and sampled, --draft-max 0 against 8 (bench_decode's prompt is a source file repeated: drafts are
# found). Carry .whl; move strata/data/strata-tiny.gguf out of the tree for the call (64 MiB limit).
source tools/gpu/setup.sh
( python3 -m strata synth qwen3-30b-a3b scratch/q30.gguf --no-report -q > $OUT/synth.log 2>&1 ) &
timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/experts tests/engine -k "drafts or chunk or graph" > $OUT/gpu_tests.log 2>&1; tail -1 $OUT/gpu_tests.log
wait
B="python3 tools/bench_decode.py -m scratch/q30.gguf --prompt-tokens 1024 --gen 256 --runs 3 --ctx-size 1536"
for v in "8 0" "8 8" "0 0" "0 8"; do set -- $v
  VG=$([ $1 = 0 ] && echo "--experts resident" || echo "--vram-gb $1")
  timeout 100 $B $VG --draft-max $2 --label "g_vram$1_draft$2" 2>/dev/null | tee $OUT/g$1_$2.json | cut -c1-330
done
timeout 100 $B --vram-gb 8 --temperature 0.8 --draft-max 8 --label s_vram8_draft8 2>/dev/null | tee $OUT/s8_8.json | cut -c1-330
echo "done at ${SECONDS}s"
