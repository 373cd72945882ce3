#!/usr/bin/env bash
# The test suite, as CI runs it: make the test venv and the engine environments, then pytest.
# Extra arguments go to pytest. Fails when any test fails or when no test ran (pytest exit 5).
# Without arguments it runs the engine tests (marker `engine`: real engines, one at a time, as each engine takes
# the machine's threads) and, beside them in a second pytest process, the other tests (TEST_WORKERS processes,
# pytest-xdist; default 1): the engine tests keep about one core of the 2-core machine busy (load average 1.1-1.5
# through them, 2026-12-07, AVX2), so the others run in the rest. Their output follows the engine tests' (it
# is written to a file meanwhile, named at the start). With arguments, one pytest run of exactly those
# (TEST_WORKERS processes where given).
set -euo pipefail
REPO=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
# Python writes the bytecode of what the tests import on first import (the environments are then installed without
# pip's compile of every module: scripts/_steps.sh, LAZY_BYTECODE); a PYTHONDONTWRITEBYTECODE of the caller's would
# make every process compile its imports from source again.
unset PYTHONDONTWRITEBYTECODE
# Real engines are probed by tests/engines: their environments are part of the set-up (every engine
# version a shipped profile names: the patched trainer is checked against each), and TRL's
# (tests/integrations runs GRPO steps in it). The five environments are made side by side (each says its
# steps on stderr, prefixed with its name); any failure stops here.
pids=()
trap 'kill "${pids[@]}" 2>/dev/null' EXIT  # a failure here leaves no build running behind
scripts/engine_env.sh vllm 0.32.0 >/dev/null & pids+=($!)
scripts/engine_env.sh vllm 0.28.0 >/dev/null & pids+=($!)
scripts/engine_env.sh sglang 0.5.23 >/dev/null & pids+=($!)
scripts/framework_env.sh trl 1.13.0 >/dev/null & pids+=($!)
PY=$(scripts/dev_env.sh)
for pid in "${pids[@]}"; do
  wait "$pid" || { echo "error: an engine or framework environment failed (its log is named above)" >&2; exit 1; }
done
trap - EXIT
WORKERS=${TEST_WORKERS:-1}
[[ "$WORKERS" =~ ^[0-9]+$ && "$WORKERS" -ge 1 ]] || { echo "error: TEST_WORKERS must be a number of processes (1 or more), got '$WORKERS'" >&2; exit 2; }
PARALLEL=()
if (( WORKERS > 1 )); then PARALLEL=(-n "$WORKERS" --dist load --maxschedchunk 1); fi

run_pytest() {  # pytest's exit status, with 5 (no test ran) turned into a failure
  local rc=0
  "$PY" -m pytest "$@" || rc=$?
  if [[ $rc -eq 5 ]]; then
    echo "error: pytest ran no tests ($*)" >&2
    return 1
  fi
  return $rc
}

if [[ $# -gt 0 ]]; then
  run_pytest "${PARALLEL[@]}" "$@"
  exit $?
fi
OTHERS_LOG=$(mktemp -t engineprofiles-tests-others.XXXXXX)
echo "== the engine tests, one at a time; beside them the other tests ($WORKERS process(es)), whose output" \
     "follows (meanwhile in $OTHERS_LOG)" >&2
run_pytest -m "not engine" "${PARALLEL[@]}" >"$OTHERS_LOG" 2>&1 &
others=$!
trap 'pkill -P "$others" 2>/dev/null; kill "$others" 2>/dev/null' EXIT  # an interrupted run leaves no tests behind
rc=0
run_pytest -m engine || rc=$?
orc=0
wait "$others" || orc=$?
trap - EXIT
echo "== the other tests (exit $orc):" >&2
cat "$OTHERS_LOG"
rm -f "$OTHERS_LOG"
if [[ $rc -eq 0 ]]; then rc=$orc; fi
exit $rc
