#!/usr/bin/env bash
# Run commands on the GPU machine with everything they write to $OUT packed into one archive: the device tool
# brings back at most 8 files a command, and a command that runs the gated tests, a bench and a profile writes
# more (the rest is left out). Each argument is one shell command line, run in turn from the repository root with
# OUT set to a work folder; their output and exit status go to the folder's commands.log. The archive is written
# even when a command runs past its time (a command's own `timeout` ends it; LIMIT ends them all).
#
#   tools/gpu/packed.sh "APPLY=1 tools/gpu/gated.sh" "tools/gpu/profile.sh" "python3 tools/bench_kernels.py"
#
# Environment: OUT (set by the device tool), LIMIT (seconds for all the commands together, default 560: the
# device tool's 600 less the packing), NAME (the archive's name without .tar.gz, default results).
# Writes $OUT/$NAME.tar.gz (the folder `$NAME/`) and prints commands.log's last lines. Carry .whl (see setup.sh).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
source tools/gpu/setup.sh

dest="$OUT"
name="${NAME:-results}"
work="$(mktemp -d)/$name"
mkdir -p "$work"
log="$work/commands.log"
machine_line > "$log"

run_all() {
  local t0 rc
  for cmd in "$@"; do
    t0=$SECONDS
    echo "== $cmd" >> "$log"
    OUT="$work" bash -c "$cmd" >> "$log" 2>&1
    rc=$?
    echo "== exit $rc after $((SECONDS - t0)) s" >> "$log"
  done
}

export -f run_all machine_line
export work log
timeout "${LIMIT:-560}" bash -c 'run_all "$@"' _ "$@" || echo "== stopped at LIMIT ${LIMIT:-560} s" >> "$log"
tar -czf "$dest/$name.tar.gz" -C "$(dirname "$work")" "$name"
tail -20 "$log"
echo "packed: $dest/$name.tar.gz ($(du -sh "$work" | cut -f1) unpacked)"
