# GPU call 1: GPU tests, CPU lane bandwidth, synth B1, resident decode.
source tools/gpu/setup.sh
nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv > $OUT/nvidia.txt
python3 -c "import torch;print(torch.__version__, torch.cuda.get_device_name())" | tee -a $OUT/nvidia.txt
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/quant tests/models/test_parity_gpu.py tests/experts tests/hub 2>&1 | tail -40 > $OUT/gpu_tests.log; tail -5 $OUT/gpu_tests.log
timeout 90 python3 tools/bench_cpu_lane.py --threads 4,8,14,16 > $OUT/cpu_lane.log 2>&1; tail -25 $OUT/cpu_lane.log
[ -f scratch/q30.gguf ] || timeout 120 python3 -m strata synth qwen3-30b-a3b scratch/q30.gguf --no-report -q > $OUT/synth.log 2>&1; tail -3 $OUT/synth.log; ls -la scratch/
timeout 150 python3 tools/bench_decode.py -m scratch/q30.gguf --experts resident --prompt-tokens 1024 --gen 64 --runs 2 --label resident 2>&1 | tail -5 | tee $OUT/decode.log
