#!/usr/bin/env bash
# The test suite, as CI runs it: make the test venv and the engine environments, then pytest.
# Extra arguments go to pytest. Fails when any test fails or when no test ran (pytest exit 5).
set -euo pipefail
REPO=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
PY=$(scripts/dev_env.sh)
# Real engines are probed by tests/engines: their environments are part of the set-up.
# (every engine version a shipped profile names: the patched trainer is checked against each).
scripts/engine_env.sh vllm 0.32.0 >/dev/null
scripts/engine_env.sh vllm 0.28.0 >/dev/null
scripts/engine_env.sh sglang 0.5.23 >/dev/null
set +e
"$PY" -m pytest "$@"
rc=$?
set -e
if [[ $rc -eq 5 ]]; then
  echo "error: pytest ran no tests" >&2
  exit 1
fi
exit $rc
