# GPU tests (chunk path, server on CUDA); decode A/B of this code against the code measured in the second stop
# (scratch/old = `git archive 0dece2a strata tools/bench_decode.py`, carried) at 16 GiB for the 256/128 and 1K/256
# protocols; a profile; the 8 GiB auto plan; 4 GiB; resident. Carry .whl and scratch/old.
source tools/gpu/setup.sh
timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider tests/experts/test_tiered.py -k cuda_chunk tests/server/test_server_gpu.py > $OUT/gpu_tests.log 2>&1; tail -3 $OUT/gpu_tests.log
[ -f scratch/q30.gguf ] || timeout 150 python3 -m strata synth qwen3-30b-a3b scratch/q30.gguf --no-report -q > $OUT/synth.log 2>&1
echo "t=$SECONDS"
N="python3 tools/bench_decode.py -m scratch/q30.gguf"
O="env PYTHONPATH=/tmp/site:$PWD/scratch/old python3 scratch/old/tools/bench_decode.py -m scratch/q30.gguf"
for p in "256 128" "1024 256"; do set -- $p
  timeout 50 $N --vram-gb 16 --cpu-plan 000000000 --prompt-tokens $1 --gen $2 --runs 2 --label new16_$1 2>/dev/null | cut -c1-330
  timeout 50 $O --vram-gb 16 --cpu-plan 000000000 --prompt-tokens $1 --gen $2 --runs 2 --label old16_$1 2>/dev/null | cut -c1-330
done
echo "t=$SECONDS"
timeout 50 $N --vram-gb 16 --cpu-plan 000000000 --prompt-tokens 1024 --gen 256 --runs 1 --profile --label new16_prof > $OUT/p16.log 2> $OUT/p16.err; cut -c1-200 $OUT/p16.log; grep -A13 "ms/tok" $OUT/p16.err
echo "t=$SECONDS"
timeout 110 $N --vram-gb 8 --prompt-tokens 1024 --gen 256 --runs 3 --prefill-only 4096 --prefill-runs 3 --sweep default,012345678@8 --label t8b > $OUT/t8b.log 2>/dev/null; cut -c1-700 $OUT/t8b.log
cat ~/.cache/strata/costs/*.json 2>/dev/null | tr -d '\n ' | cut -c1-330; echo
echo "t=$SECONDS"
[ $SECONDS -lt 420 ] && timeout 60 $N --vram-gb 4 --cpu-plan 000000000 --prompt-tokens 1024 --gen 256 --runs 2 --label t4 2>/dev/null | cut -c1-450
echo "t=$SECONDS"
[ $SECONDS -lt 470 ] && timeout 60 $N --experts resident --prompt-tokens 1024 --gen 256 --runs 2 --label resident 2>/dev/null | cut -c1-250
echo "t=$SECONDS"
