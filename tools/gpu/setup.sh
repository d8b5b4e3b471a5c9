# Sourced (never run) by the scripts beside it, from the repository root, on the GPU machine.
#
# That machine has torch, triton, numpy, tokenizers, jinja2, httpx, pytest ... but no package index and not the
# server stack or gguf: carry them as wheels in .whl/ (git-ignored; `../shared/device/wheels.sh nvidia-ml-py`
# fetches them here: with nvidia-ml-py `strata bench` reads VRAM through NVML instead of starting nvidia-smi beside
# the servers it times; that script leaves out sniffio, which the anthropic client imports and the machine's image
# no longer has: add it with `python3 -m pip download --no-deps -d .whl sniffio`, or the server tests fail to
# collect), and they are installed into /tmp/site at the start of every command. Also carry peers/src for the
# llama.cpp peer (bench/peers/llamacpp.sh fetch, or pack for the ~5 MB pruned copy). A working tree over the
# 64 MiB a command carries: `tools/gpu/slim.sh out` here first (and `back` before committing).
#
# Sets: PYTHONPATH (the wheels, then this tree), OUT (where results go: the device tool sets it; default
# scratch/out), MODEL (default scratch/b1.gguf) and b1_model, which makes MODEL with `strata synth` when missing.
# Scenario B1: Qwen3-30B-A3B shapes, experts Q4_K, attention Q8_0, head Q6_K (~17 GB; see docs/BENCHMARKS.md).

export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >/dev/null 2>&1 || echo "setup.sh: installing .whl/*.whl failed" >&2
  export PYTHONPATH="/tmp/site:$PWD"
  python3 -c "import sniffio" 2>/dev/null || echo "setup.sh: no sniffio here or in .whl: the anthropic client (server tests) will not import" >&2
else
  export PYTHONPATH="$PWD"
fi
export OUT="${OUT:-$PWD/scratch/out}"
export MODEL="${MODEL:-scratch/b1.gguf}"
mkdir -p "$OUT" scratch

# PRESET and SYNTH_FLAGS choose another scenario's model, e.g. B2: MODEL=scratch/b2.gguf PRESET=qwen3-next-80b-a3b;
# B3: MODEL=scratch/b3.gguf PRESET=glm-4.5-air SYNTH_FLAGS="--experts-type IQ2_XXS --experts-down-type IQ3_XXS
# --dense-type Q6_K --shared-type Q6_K" (docs/BENCHMARKS.md, "Scenarios")
b1_model() {
  [[ -f "$MODEL" ]] && return 0
  mkdir -p "$(dirname "$MODEL")"
  # shellcheck disable=SC2086  # SYNTH_FLAGS is a word list
  python3 -m strata synth "${PRESET:-qwen3-30b-a3b}" "$MODEL" --no-report -q ${SYNTH_FLAGS:-}
}

# one line describing the machine, for the logs that come back
machine_line() {
  nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.current,pcie.link.width.current \
    --format=csv,noheader 2>/dev/null | head -1
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())"
  echo "cores: $(nproc), memory: $(free -g | awk '/Mem:/ {print $2}') GiB"
}
