#!/usr/bin/env bash
# Create (or update) the development/test virtual environment at <repo>/.venv and install the
# project into it (editable). Progress to stderr; prints the venv's python as the last line.
set -euo pipefail
REPO=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd)
VENV="$REPO/.venv"
BASE_PYTHON=${DEV_ENV_PYTHON:-python3.11}
command -v "$BASE_PYTHON" >/dev/null 2>&1 || BASE_PYTHON=python3
log() { printf '[dev_env] %s\n' "$*" >&2; }

if [[ ! -x "$VENV/bin/python" ]]; then
  log "creating $VENV with $($BASE_PYTHON --version 2>&1)"
  "$BASE_PYTHON" -m venv "$VENV" >&2
fi
STAMP="$VENV/.requirements.sha"
WANT=$(cat "$REPO/scripts/requirements-dev.txt" "$REPO/pyproject.toml" | sha256sum | cut -d' ' -f1)
if [[ ! -f "$STAMP" || "$(cat "$STAMP")" != "$WANT" ]]; then
  log "installing test requirements (scripts/requirements-dev.txt)"
  "$VENV/bin/python" -m pip --disable-pip-version-check install -q -r "$REPO/scripts/requirements-dev.txt" >&2
  log "installing the project (editable)"
  "$VENV/bin/python" -m pip --disable-pip-version-check install -q --no-deps -e "$REPO" >&2
  echo "$WANT" > "$STAMP"
fi
echo "$VENV/bin/python"
