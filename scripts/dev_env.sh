#!/usr/bin/env bash
# Create (or update) the development/test virtual environment at <repo>/.venv and install the
# project into it (editable). Progress to stderr, one line per step (pip's own output goes to
# .venv.log, named with its last lines when a step fails); prints the venv's python as the last line.
set -euo pipefail
REPO=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=scripts/_steps.sh
source "$REPO/scripts/_steps.sh"
STEPS_NAME=dev_env
STEPS_LOG="$REPO/.venv.log"
VENV="$REPO/.venv"
BASE_PYTHON=${DEV_ENV_PYTHON:-python3.11}
command -v "$BASE_PYTHON" >/dev/null 2>&1 || BASE_PYTHON=python3

STAMP="$VENV/.requirements.sha"
WANT=$(cat "$REPO/scripts/requirements-dev.txt" "$REPO/pyproject.toml" | sha256sum | cut -d' ' -f1)
if [[ ! -x "$VENV/bin/python" || ! -f "$STAMP" || "$(cat "$STAMP")" != "$WANT" ]]; then
  steps_begin
  if [[ ! -x "$VENV/bin/python" ]]; then
    step "step 1/3: creating $VENV with $($BASE_PYTHON --version 2>&1)" "$BASE_PYTHON" -m venv "$VENV"
  fi
  step "step 2/3: installing the test requirements (scripts/requirements-dev.txt)" \
    "$VENV/bin/python" -m pip --disable-pip-version-check install "${LAZY_BYTECODE[@]}" -r "$REPO/scripts/requirements-dev.txt"
  mkdir -p "$REPO/.engines"  # the lock of editable builds of the checkout (scripts/engine_env.sh takes it too)
  step "step 3/3: installing the project (editable)" \
    locked "$REPO/.engines/.project-install.lock" "$VENV/bin/python" -m pip --disable-pip-version-check install \
    --no-deps -e "$REPO"
  echo "$WANT" > "$STAMP"
fi
echo "$VENV/bin/python"
