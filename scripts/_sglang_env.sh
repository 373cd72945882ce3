#!/usr/bin/env bash
# Install SGLang (CPU use) into a virtual environment.  Called by scripts/engine_env.sh:
#
#   usage: scripts/_sglang_env.sh VERSION VENV_DIR
#
# Creates VENV_DIR if it has no python yet, then (idempotently: pinned installs are no-ops
# once satisfied):
#   1. torch==2.14.1 torchvision==0.29.1  (both lie on local disk; a CUDA build of torch
#      that runs on the CPU.  SGLang imports torchvision unconditionally, and PyPI's
#      torchvision breaks next to the CPU-only torch 2.13.0, so this pair is used.)
#   2. sglang==VERSION with --no-deps  (its metadata pins torch 2.14.1 plus dozens of CUDA
#      packages: flashinfer, sglang-kernel, deep-gemm, ...; none of them is usable here).
#   3. The explicit pinned list below: the pure-Python packages that SGLang's layer modules
#      (sglang.srt.layers.{layernorm,activation,rotary_embedding}) import, the tool's own
#      deps (pydantic pyyaml typer rich transformers) at versions SGLang's metadata admits,
#      and the packages the offline engine (sglang.Engine) imports.
#   4. An import check with SGLANG_USE_CPU_ENGINE=1.
# It does not write the `.ready` marker: engine_env.sh owns that.
#
# Pins were found for sglang 0.5.23 by importing the modules and adding what was missing
# (2026-12, Python 3.11, x86_64).  Another SGLang version may need a different list:
# SGLANG_ENV_EXTRA="pkg==ver ..." adds packages without editing this file.
set -euo pipefail

SCRIPT_DIR=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=scripts/_steps.sh
source "$SCRIPT_DIR/_steps.sh"
STEPS_NAME=${STEPS_NAME:-_sglang_env}
FIRST=${STEPS_FIRST:-1}
TOTAL=${STEPS_TOTAL:-4}
log() { steps_log "$*"; }
die() { local rc=$1; shift; log "ERROR: $*"; exit "$rc"; }
n() { echo "step $((FIRST + $1))/$TOTAL"; }

[[ $# -eq 2 ]] || die 2 "usage: $0 VERSION VENV_DIR"
VERSION=$1
VENV=$2
PY="$VENV/bin/python"
BASE_PYTHON=${ENGINE_ENV_PYTHON:-python3.11}
command -v "$BASE_PYTHON" >/dev/null 2>&1 || BASE_PYTHON=python3

[[ "$VERSION" == "0.5.23" ]] \
  || log "warning: the pinned list was made for sglang 0.5.23, not $VERSION; it may need changes"

TORCH_PKGS=(torch==2.14.1 torchvision==0.29.1)

# Layer-module imports (and what they pull in), with the versions SGLang 0.5.23 pins where
# it pins one (transformers, tokenizers, sentencepiece, compressed-tensors, apache-tvm-ffi).
LAYER_PKGS=(
  transformers==5.19.0 tokenizers==0.23.2 huggingface_hub==1.33.0 safetensors==0.8.0
  hf-xet==1.8.0 regex==2026.11.19 tqdm==4.70.1 packaging==26.4
  pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  pyyaml==6.0.4 typer==0.29.2 click==8.5.1 shellingham==1.5.4 annotated-doc==0.0.7
  rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2 Pygments==2.21.0
  orjson==3.13.0 psutil==7.2.2 pybase64==1.5.1 msgspec==0.23.0 pyzmq==27.3.0 dill==0.4.1
  requests==2.34.2 urllib3==2.8.0 idna==3.20 certifi==2026.10.19.post1
  charset-normalizer==3.5.3
  httpx==0.29.0 httpcore==1.0.9 h11==0.16.0 anyio==4.16.0 starlette==1.10.0
  aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 attrs==26.1.0
  frozenlist==1.8.0 multidict==7.2.1 propcache==0.5.4 yarl==1.25.1
  ipython==9.18.1 ipython_pygments_lexers==1.1.1 asttokens==3.0.2 executing==2.3.0
  jedi==0.20.1 parso==0.8.7 matplotlib-inline==0.2.2 pexpect==4.9.0 ptyprocess==0.7.0
  prompt_toolkit==3.0.53 wcwidth==0.9.4 pure_eval==0.2.4 stack-data==0.6.3
  traitlets==5.16.1
  sentencepiece==0.2.1 apache-tvm-ffi==0.1.11 compressed-tensors==0.18.0 loguru==0.7.3
  gguf==0.19.0
)

# What the offline engine (sglang.Engine) imports on top (openai pinned as SGLang pins it).
# The engine still needs an `sgl_kernel` module on CPU, which PyPI does not have (see
# docs/ARCHITECTURE.md, "What exploration taught"); the layer modules do not.
ENGINE_PKGS=(
  fastapi==0.165.0 uvicorn==0.55.0 uvloop==0.23.0 setproctitle==1.3.8 einops==0.8.2
  openai==2.8.0 distro==1.9.0 jiter==0.19.0 sniffio==1.3.1 opentelemetry-api==1.45.2
  partial-json-parser==0.2.1.1.post7 xgrammar==0.2.7
)

# shellcheck disable=SC2206
EXTRA_PKGS=(${SGLANG_ENV_EXTRA:-})

if [[ -z "${STEPS_LOG:-}" ]]; then
  STEPS_LOG="$(dirname -- "$VENV")/$(basename -- "$VENV").log"
  steps_begin
fi
if [[ ! -x "$PY" ]]; then
  mkdir -p "$(dirname -- "$VENV")"
  step "creating venv $VENV with $($BASE_PYTHON --version 2>&1)" "$BASE_PYTHON" -m venv "$VENV"
fi
PIP=("$PY" -m pip --disable-pip-version-check)

step "$(n 0): ${TORCH_PKGS[*]} (about 5.5 GB in the venv; from local disk)" \
  "${PIP[@]}" install "${LAZY_BYTECODE[@]}" "${TORCH_PKGS[@]}"

step "$(n 1): sglang==$VERSION --no-deps" "${PIP[@]}" install "${LAZY_BYTECODE[@]}" --no-deps "sglang==$VERSION"

# The resolver complains that sglang's own (CUDA) requirements are unmet; that is expected,
# so its exit status is what counts, not its "dependency conflicts" message.
step "$(n 2): ${#LAYER_PKGS[@]} + ${#ENGINE_PKGS[@]} pinned packages" \
  "${PIP[@]}" install "${LAZY_BYTECODE[@]}" "${TORCH_PKGS[@]}" "${LAYER_PKGS[@]}" "${ENGINE_PKGS[@]}" ${EXTRA_PKGS[@]+"${EXTRA_PKGS[@]}"}

step "$(n 3): import check (SGLANG_USE_CPU_ENGINE=1)" env SGLANG_USE_CPU_ENGINE=1 "$PY" -W ignore -c '
import torch, torchvision, sglang
import sglang.srt.layers.layernorm, sglang.srt.layers.activation
import sglang.srt.layers.rotary_embedding
import pydantic, yaml, typer, rich, transformers
print(f"sglang {sglang.__version__}  torch {torch.__version__}  transformers {transformers.__version__}")
'
