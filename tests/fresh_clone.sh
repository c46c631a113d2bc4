#!/usr/bin/env bash
# What a newcomer does, on this machine: clone the repository's committed HEAD into a temporary folder, make a fresh
# venv, and run the README's test command there (or the make target given: `tests/fresh_clone.sh test-all`).
# `--busy` keeps both cores busy with two Python loops meanwhile, as a user's data loader workers or a second job do.
# Prints the clone's commit and the command's time; exits with the command's status; removes the folder after.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
busy=0
if [ "${1:-}" = "--busy" ]; then busy=1; shift; fi
target=${1:-test}
work=$(mktemp -d "${TMPDIR:-/tmp}/lz-fresh-clone-XXXXXX")
loops=()
cleanup() {
  for pid in ${loops[@]+"${loops[@]}"}; do kill "$pid" 2>/dev/null || true; done  # bash < 4.4: empty under set -u
  rm -rf "$work"
}
trap cleanup EXIT
git clone --quiet "$repo" "$work/lightning_zero"
python3 -m venv "$work/venv"
cd "$work/lightning_zero"
echo "fresh clone of $(git rev-parse --short HEAD) in $work; make $target$([ $busy = 1 ] && echo ', both cores busy')"
if [ $busy = 1 ]; then
  for _ in 1 2; do
    python3 -c 'import time
end = time.monotonic() + 3 * 3600
while time.monotonic() < end: pass' &
    loops+=($!)
  done
fi
start=$(date +%s)
status=0
PATH="$work/venv/bin:$PATH" make PYTHON="$work/venv/bin/python" "$target" || status=$?
echo "make $target in the fresh clone: exit $status after $(( $(date +%s) - start )) s"
exit $status
