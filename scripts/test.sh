#!/usr/bin/env bash
# The test suite, as CI runs it: make the test venv and the engine environments, then pytest.
# Extra arguments go to pytest. Fails when any test fails or when no test ran (pytest exit 5).
# Without arguments it runs in two phases: the engine tests (marker `engine`: real engines, one at a time, as
# each engine takes the machine's threads), then the rest in TEST_WORKERS processes (pytest-xdist; default 2:
# on the 2-core AVX2 machine, 2026-12-07, nine exact-mode tests took 229 s with two workers against 305 s in
# one; most of a test's time is single-threaded tracing and compiling). TEST_WORKERS=1 runs them in this
# process. With arguments, one pytest run of exactly those (TEST_WORKERS processes where given).
set -euo pipefail
REPO=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
# Real engines are probed by tests/engines: their environments are part of the set-up (every engine
# version a shipped profile names: the patched trainer is checked against each). The four environments
# are made side by side (each says its steps on stderr, prefixed with its name); any failure stops here.
pids=()
trap 'kill "${pids[@]}" 2>/dev/null' EXIT  # a failure here leaves no build running behind
scripts/engine_env.sh vllm 0.32.0 >/dev/null & pids+=($!)
scripts/engine_env.sh vllm 0.28.0 >/dev/null & pids+=($!)
scripts/engine_env.sh sglang 0.5.23 >/dev/null & pids+=($!)
PY=$(scripts/dev_env.sh)
for pid in "${pids[@]}"; do
  wait "$pid" || { echo "error: an engine environment failed (its log is named above)" >&2; exit 1; }
done
trap - EXIT
WORKERS=${TEST_WORKERS:-2}
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
  if [[ -z "${TEST_WORKERS:-}" ]]; then PARALLEL=(); fi
  run_pytest "${PARALLEL[@]}" "$@"
  exit $?
fi
rc=0
echo "== phase 1/2: the engine tests (one at a time)" >&2
run_pytest -m engine || rc=$?
echo "== phase 2/2: the other tests ($WORKERS processes)" >&2
run_pytest -m "not engine" "${PARALLEL[@]}" || rc=$?
exit $rc
