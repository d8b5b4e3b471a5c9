# Seventh stop, call 5 (~5 min): the native kernel's threads spinning between layers (GOMP_SPINCOUNT set by
# strata before the kernel library loads) and the third-to-the-CPU plan, on sampled text at 8 GiB; greedy auto.
source tools/gpu/setup.sh
( python3 -m strata synth qwen3-30b-a3b scratch/q30.gguf --no-report -q > $OUT/synth.log 2>&1 ) &
python3 -c "import torch, os; print([l.split()[-1] for l in open('/proc/self/maps') if 'gomp' in l][:1])"
wait
B="python3 tools/bench_decode.py -m scratch/q30.gguf --prompt-tokens 1024 --gen 256 --runs 3 --vram-gb 8 --ctx-size 1536"
S="$B --temperature 0.8 --no-cpu-plan-tune"
timeout 90 $S --cpu-plan 000000000 --label s8_pcie 2>/dev/null | tee $OUT/a.json | cut -c1-420
timeout 90 $S --cpu-plan 011223344 --cpu-threads 14 --label s8_half14 2>/dev/null | tee $OUT/b.json | cut -c1-420
timeout 90 $S --cpu-plan 000111222 --cpu-threads 14 --label s8_third14 2>/dev/null | tee $OUT/c.json | cut -c1-420
timeout 100 $B --temperature 0.8 --label s8_auto 2>/dev/null | tee $OUT/d.json | cut -c1-420; grep -o '"plan_tuner.\{300\}' $OUT/d.json
timeout 80 $B --label g8_auto 2>/dev/null | tee $OUT/e.json | cut -c1-420; grep -o '"plan_tuner.\{300\}' $OUT/e.json
echo "done at ${SECONDS}s"
