#!/usr/bin/env bash
# Probe a real engine in its own environment and print the profile (a summary: one row per region;
# the whole of it is the file, `probe-engine show FILE`; pass --yaml to print the YAML too).
#
#   scripts/probe.sh ENGINE [VERSION] [--ship] [probe-engine options...]
#
# ENGINE: an engine of engineprofiles/engines.py: vllm | sglang (in their environments, made by
# scripts/engine_env.sh; VERSION defaults to the record's) or transformers (the dev venv).
# The profile is written to out/<engine>-<version>-<backend>-<mode>-<dtype>.yaml, or with --ship
# into profiles/ (the shipped profiles are produced exactly this way, never typed by hand).
#
# On a GPU machine: make the engine's CUDA environment yourself (its CUDA wheel), point --env at it
# and pass --device cuda, e.g.  scripts/probe.sh vllm 0.32.0 --env /path/to/venv --device cuda
set -euo pipefail
REPO=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd)
[[ $# -ge 1 ]] || { echo "usage: $0 ENGINE [VERSION] [--ship] [probe-engine options]" >&2; exit 2; }
ENGINE=$1; shift
# the engine's record: its default version, empty where it runs in the dev venv (the standard library only)
VERSION=$(cd "$REPO" && python3 -S -m engineprofiles.engines "$ENGINE") || exit 2
OWN_ENV=$VERSION
if [[ $# -ge 1 && "$1" != -* ]]; then VERSION=$1; shift; fi
OUT="out"
ARGS=()
for a in "$@"; do
  # probe-engine writes into profiles/ only with --ship too
  if [[ "$a" == "--ship" ]]; then OUT="profiles"; ARGS+=("--ship"); else ARGS+=("$a"); fi
done
cd "$REPO"
mkdir -p "$OUT"
if [[ -z "$OWN_ENV" ]]; then
  PY=$("$REPO/scripts/dev_env.sh")
else
  PY=$("$REPO/scripts/engine_env.sh" "$ENGINE" "$VERSION")
fi
export ENGINEPROFILES_COMMAND="scripts/probe.sh $ENGINE${VERSION:+ $VERSION} $*"
ENGINEPROFILES_REEXEC=1 exec "$PY" -m engineloop.cli "$ENGINE" -o "$OUT/" "${ARGS[@]}"
