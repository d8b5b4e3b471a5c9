# Seventh stop, call 6 (~4 min): GOMP_SPINCOUNT now set by strata at import (torch's OpenMP runtime, shared with
# the CPU lane's kernel, reads it when torch loads): sampled text at 8 GiB, fixed plans, no env by hand.
source tools/gpu/setup.sh
( python3 -m strata synth qwen3-30b-a3b scratch/q30.gguf --no-report -q > $OUT/synth.log 2>&1 ) &
python3 -c "import strata, os; print('GOMP_SPINCOUNT', os.environ.get('GOMP_SPINCOUNT'))"
wait
B="python3 tools/bench_decode.py -m scratch/q30.gguf --prompt-tokens 1024 --gen 256 --runs 3 --vram-gb 8 --ctx-size 1536"
S="$B --temperature 0.8 --no-cpu-plan-tune"
timeout 70 $S --cpu-plan 000000000 --label s8_pcie 2>/dev/null | tee $OUT/a.json | cut -c1-300
timeout 80 $S --cpu-plan 011223344 --cpu-threads 14 --label s8_half14 2>/dev/null | tee $OUT/b.json | cut -c1-300
timeout 80 $S --cpu-plan 000111222 --cpu-threads 14 --label s8_third14 2>/dev/null | tee $OUT/c.json | cut -c1-300
timeout 80 $S --cpu-plan 012345678 --cpu-threads 14 --label s8_cpu14 2>/dev/null | tee $OUT/d.json | cut -c1-300
echo "done at ${SECONDS}s"
