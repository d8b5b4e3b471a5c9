# GPU call: the tiered chunk path (grouped) -- correctness, then a 4K prefill at 8 GiB.
source tools/gpu/setup.sh
timeout 40 python3 -m pytest -x -q -m gpu -p no:cacheprovider tests/experts/test_tiered.py -k "chunk_path or matches_resident" 2>&1 | tail -3
[ -f scratch/q30.gguf ] || timeout 60 python3 -m strata synth qwen3-30b-a3b scratch/q30.gguf --no-report -q > /dev/null 2>&1
timeout 60 python3 tools/bench_decode.py -m scratch/q30.gguf --prompt-tokens 64 --gen 4 --runs 1 --vram-gb 8 --prefill-only 4096 --label t8_prefill 2>/dev/null | cut -c1-200
