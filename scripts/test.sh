#!/usr/bin/env bash
# The test suite, as CI runs it: make the test venv and the engine environments, then pytest.
# Extra arguments go to pytest. Fails when any test fails or when no test ran (pytest exit 5).
# TEST_WORKERS=N runs the tests in N processes (pytest-xdist, one test at a time to a free worker);
# the default is one per two cores (torch and the engines use two threads each; on the 2-core machine
# two workers were slower than one: measured 2026-12-06), and 1 runs them in this process.
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
WORKERS=${TEST_WORKERS:-$(( $(nproc) / 2 ))}
[[ "$WORKERS" =~ ^[0-9]+$ ]] || { echo "error: TEST_WORKERS must be a number of processes, got '$WORKERS'" >&2; exit 2; }
PARALLEL=()
if (( WORKERS > 1 )); then PARALLEL=(-n "$WORKERS" --dist load --maxschedchunk 1); fi
set +e
"$PY" -m pytest "${PARALLEL[@]}" "$@"
rc=$?
set -e
if [[ $rc -eq 5 ]]; then
  echo "error: pytest ran no tests" >&2
  exit 1
fi
exit $rc
