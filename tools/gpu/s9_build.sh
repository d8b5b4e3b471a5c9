# Next stop, call 1 of a warm pair (~6-9 min): llama.cpp built alone (next to the model's synthesis it ran past
# 330 s), and the B1 model. Issue s9_bench.sh within the machine's 30 s idle release so it finds both (ignored
# build outputs stay on a warm machine). Carry .whl and peers/src/llama.cpp-11434-pruned.tar.xz; move
# strata/data/strata-tiny.gguf out of the tree for the call (64 MiB limit).
source tools/gpu/setup.sh
( python3 -m strata synth qwen3-30b-a3b scratch/q30.gguf --no-report -q > $OUT/synth.log 2>&1 ) &
JOBS=16 TARGETS=llama-bench timeout 540 bash bench/peers/llamacpp.sh build > $OUT/build.log 2>&1; tail -2 $OUT/build.log
wait; ls -la peers/llama.cpp/build/bin/ scratch/ | head; echo "done at ${SECONDS}s"
