#!/usr/bin/env bash
# The GPU tests (`pytest -m gpu`) on the GPU machine, from the repository root; CI has no GPU and skips them.
#
#   tools/gpu/test.sh                              # every GPU test under tests/
#   tools/gpu/test.sh tests/experts -k "chunk"     # any pytest arguments instead of the default `tests`
#
# Environment: TIMEOUT (seconds for pytest, default 540: a command has 10 minutes on the device tool), OUT (the
# log's folder; set by the device tool). Writes $OUT/gpu_tests.log (the whole pytest output, the machine first)
# and prints its last lines. Carry .whl (see setup.sh). Exit status: pytest's (124 when it ran out of time).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
source tools/gpu/setup.sh

args=("$@")
(( ${#args[@]} )) || args=(tests)
log="$OUT/gpu_tests.log"
machine_line > "$log"
timeout "${TIMEOUT:-540}" python3 -m pytest -q -m gpu -p no:cacheprovider "${args[@]}" >> "$log" 2>&1
rc=$?
tail -25 "$log"
(( rc == 124 )) && echo "test.sh: pytest ran past ${TIMEOUT:-540} s: narrow the paths or -k" >&2
exit $rc
