#!/usr/bin/env bash
# Create (or reuse) an RL framework's own virtual environment under <repo>/.frameworks/, with the project
# installed into it (editable), as scripts/engine_env.sh does for the engines.
#
#   usage: scripts/framework_env.sh FRAMEWORK VERSION      (FRAMEWORK: trl)
#
# The venv lives at <repo>/.frameworks/FRAMEWORK-VERSION; a marker file `.ready` is written there only after
# every step succeeded (a venv without it is rebuilt). Its packages: scripts/requirements-FRAMEWORK.txt and
# FRAMEWORK==VERSION. Progress goes to stderr; the last line on stdout is the venv's python path.
# verl is not offered yet: verl 0.9.1 installs from PyPI with the local torch but pins transformers < 5.11, below
# the floor emulator.patching accepts (5.17; see docs/frameworks.md).
set -euo pipefail

SCRIPT_DIR=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=scripts/_steps.sh
source "$SCRIPT_DIR/_steps.sh"
STEPS_NAME=framework_env
log() { steps_log "$*"; }
die() { local rc=$1; shift; log "ERROR: $*"; exit "$rc"; }

[[ $# -eq 2 ]] || die 2 "usage: $0 FRAMEWORK VERSION   (FRAMEWORK: trl)"
FRAMEWORK=$1
VERSION=$2
case "$FRAMEWORK" in
  trl) ;;
  verl) die 2 "verl: not offered yet: verl 0.9.1 pins transformers < 5.11, below the 5.17 this project's patching accepts; only trl is offered (see docs/frameworks.md)" ;;
  *) die 2 "unknown framework '$FRAMEWORK' (expected trl)" ;;
esac
[[ "$VERSION" =~ ^[0-9A-Za-z.+_-]+$ ]] || die 2 "bad version string '$VERSION'"

REPO=$(cd -- "$SCRIPT_DIR/.." && pwd)
REQS="$SCRIPT_DIR/requirements-$FRAMEWORK.txt"
VENV="$REPO/.frameworks/$FRAMEWORK-$VERSION"
PY="$VENV/bin/python"
MARKER="$VENV/.ready"
STEPS_NAME="framework_env $FRAMEWORK-$VERSION"
STEPS_LOG="$REPO/.frameworks/$FRAMEWORK-$VERSION.log"  # outside the venv: it outlives a failed build
BASE_PYTHON=${FRAMEWORK_ENV_PYTHON:-python3.11}
command -v "$BASE_PYTHON" >/dev/null 2>&1 || BASE_PYTHON=python3
PIP=("$PY" -m pip --disable-pip-version-check)
# What the ready venv was made from: a changed requirements file or pyproject.toml rebuilds it.
WANT=$(cat "$REQS" "$REPO/pyproject.toml" | sha256sum | cut -d' ' -f1)

mkdir -p "$REPO/.frameworks" "$REPO/.engines"
if command -v flock >/dev/null 2>&1; then
  exec 9>"$REPO/.frameworks/.$FRAMEWORK-$VERSION.lock"
  flock 9
fi
if [[ -f "$MARKER" && -x "$PY" && "$(cat "$MARKER")" == "$WANT" ]]; then
  log "reusing ready venv $VENV"
  echo "$PY"
  exit 0
fi
if [[ -d "$VENV" ]]; then
  log "found a venv not ready or made from other requirements: removing $VENV"
  rm -rf -- "$VENV"
fi

steps_begin
step "step 1/4: creating venv $VENV with $($BASE_PYTHON --version 2>&1)" "$BASE_PYTHON" -m venv "$VENV"
step "step 2/4: installing $FRAMEWORK==$VERSION and scripts/requirements-$FRAMEWORK.txt (about a minute)" \
  "${PIP[@]}" install "${LAZY_BYTECODE[@]}" -r "$REQS" "$FRAMEWORK==$VERSION"
# one editable build of the checkout at a time (the environments are made side by side)
step "step 3/4: installing the project (editable, --no-deps) from $REPO" \
  locked "$REPO/.engines/.project-install.lock" "${PIP[@]}" install --no-deps -e "$REPO"
step "step 4/4: checking that $FRAMEWORK and the project import" \
  "$PY" -c "import $FRAMEWORK, torch, trl.trainer.grpo_trainer, transformers, emulator.patching, engineloop.integrations; print('$FRAMEWORK', $FRAMEWORK.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
echo "$WANT" > "$MARKER"
log "ready: $VENV"
echo "$PY"
