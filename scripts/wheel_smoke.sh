#!/usr/bin/env bash
# Build the wheel and use it outside the checkout: a clean venv in a temporary folder, torch pinned
# as scripts/requirements-dev.txt pins it (the local CPU build, as scripts/dev_env.sh installs it),
# then, from a folder outside the checkout with none of the ENGINEPROFILES_* variables set:
#   - the base install (no extra): `probe-engine list` lists every shipped profile from the copy
#     inside the installed package; the commands that need an extra say which one;
#   - with the `insitu` extra: apply_profile(tiny_model("qwen2"), <a shipped vLLM profile>), a
#     forward pass, and handle.remove() giving back the unpatched bits.
# One line per step on stderr (pip's output goes to the log, named with its last lines when a step
# fails); exits non-zero on the first failure. pip's cache is used as configured (PIP_CACHE_DIR).
#
#   WHEEL_SMOKE_PYTHON  the python that makes the venv (default python3.11, else python3)
#   WHEEL_SMOKE_KEEP=1  keep the temporary folder (it is always kept when a step fails)
set -euo pipefail
REPO=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=scripts/_steps.sh
source "$REPO/scripts/_steps.sh"
STEPS_NAME=wheel_smoke
BASE_PYTHON=${WHEEL_SMOKE_PYTHON:-python3.11}
command -v "$BASE_PYTHON" >/dev/null 2>&1 || BASE_PYTHON=python3

WORK=$(mktemp -d "${TMPDIR:-/tmp}/wheel_smoke.XXXXXX")
STEPS_LOG="$WORK/smoke.log"
cleanup() {
  local rc=$?
  if [[ $rc -eq 0 && -z "${WHEEL_SMOKE_KEEP:-}" ]]; then
    rm -rf -- "$WORK"
  else
    steps_log "kept $WORK"
  fi
}
trap cleanup EXIT

SRC="$WORK/src" DIST="$WORK/dist" VENV="$WORK/venv" OUTSIDE="$WORK/outside"
CONSTRAINTS="$REPO/scripts/requirements-dev.txt"  # the same pins as the test venv: torch==2.13.0 (the local CPU build)
PROFILE=vllm-0.32.0-cpu-inductor-bfloat16-insitu
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
mkdir -p "$SRC" "$DIST" "$OUTSIDE"

# Everything the smoke runs: no variable that points into the checkout (or anywhere else).
outside() {
  (cd "$OUTSIDE" && env -u PYTHONPATH -u PYTHONHOME -u VIRTUAL_ENV -u ENGINEPROFILES_DIR -u ENGINEPROFILES_ENGINES \
    -u ENGINEPROFILES_REEXEC -u ENGINEPROFILES_COMMAND -u EMULATOR_BACKEND COLUMNS=250 "$@")
}

copy_sources() {
  # The files git knows (tracked, or new and not ignored): no build/, .venv or .engines goes along.
  if git -C "$REPO" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    (cd "$REPO" && git ls-files -z --cached --others --exclude-standard |
      while IFS= read -r -d '' f; do [[ -e "$f" ]] && printf '%s\0' "$f"; done |
      tar --null -cf - -T -) | tar -xf - -C "$SRC"
  else
    tar -C "$REPO" --exclude=.venv --exclude=.engines --exclude=build --exclude=dist --exclude='*.egg-info' \
      --exclude=__pycache__ --exclude=out -cf - . | tar -xf - -C "$SRC"
  fi
}

check_wheel_holds_the_profiles() {
  "$VENV/bin/python" - "$REPO/profiles" "$DIST" <<'EOF'
import sys, zipfile
from pathlib import Path
canonical, dist = Path(sys.argv[1]), Path(sys.argv[2])
wheels = sorted(dist.glob("engineprofiles-*.whl"))
assert len(wheels) == 1, f"expected one wheel in {dist}, found {[w.name for w in wheels]}"
want = {p.name: p.read_bytes() for p in canonical.glob("*.yaml")}
assert want, f"no profiles in {canonical}"
with zipfile.ZipFile(wheels[0]) as z:
    got = {n.rsplit("/", 1)[1]: z.read(n) for n in z.namelist()
           if n.startswith("engineprofiles/profiles/") and n.endswith(".yaml")}
missing = sorted(set(want) - set(got))
extra = sorted(set(got) - set(want))
differ = sorted(n for n in set(want) & set(got) if want[n] != got[n])
assert not (missing or extra or differ), (
    f"{wheels[0].name}: engineprofiles/profiles/ lacks {missing}, has extra {extra}, differs in {differ} "
    f"(against {canonical})")
print(f"{wheels[0].name} holds the {len(want)} shipped profiles, byte for byte")
EOF
}

check_list() {
  local listing
  listing=$(outside "$VENV/bin/probe-engine" list)
  printf '%s\n' "$listing"
  local site
  site=$(outside "$VENV/bin/python" -c 'from engineprofiles import store; print(store.shipped_dir())')
  [[ "$site" == "$VENV"/lib/*/site-packages/engineprofiles/profiles ]] ||
    { echo "shipped_dir() is $site, not the copy installed with the package in $VENV"; return 1; }
  local f n bad=0
  for f in "$REPO"/profiles/*.yaml; do
    n=$(basename "$f" .yaml)
    grep -qF -- "$n" <<<"$listing" || { echo "probe-engine list does not list $n"; bad=1; }
  done
  if grep -q "invalid" <<<"$listing"; then echo "probe-engine list shows an invalid profile"; bad=1; fi
  outside "$VENV/bin/probe-engine" show "$PROFILE" >/dev/null || { echo "probe-engine show $PROFILE failed"; bad=1; }
  return $bad
}

# expect_failure TEXT CMD...: CMD fails and its output names TEXT; a probe-engine command fails
# cleanly (an error: line, exit 2), not with a traceback.
expect_failure() {
  local text=$1; shift
  local out rc=0
  out=$(outside "$@" 2>&1) || rc=$?
  printf '%s\n(exit %s)\n' "$out" "$rc"
  if [[ $rc -eq 0 ]]; then
    echo "expected a failure of: $*"; return 1
  fi
  if [[ "$1" == */probe-engine ]] && { [[ $rc -ne 2 ]] || grep -q "Traceback" <<<"$out"; }; then
    echo "expected an error: line and exit 2 from: $*"; return 1
  fi
  grep -qF -- "$text" <<<"$out" || { echo "the message does not name '$text'"; return 1; }
}

check_missing_extras() {
  expect_failure "engineprofiles[insitu]" "$VENV/bin/probe-engine" mismatch vllm
  expect_failure "engineprofiles[emulator]" "$VENV/bin/python" -c "import emulator; emulator.apply_profile"
  # No engine environment: the message says where it looked and how to point elsewhere.
  expect_failure "ENGINEPROFILES_ENGINES" "$VENV/bin/probe-engine" vllm --op-level -o "$OUTSIDE"
}

check_apply_profile() {
  outside "$VENV/bin/python" - "$VENV" "$PROFILE" <<'EOF'
import sys
venv, name = sys.argv[1], sys.argv[2]
import torch
import emulator, engineprofiles
from engineprofiles.models import tiny_model
from engineprofiles.store import shipped_names

for m in (emulator, engineprofiles):
    assert m.__file__.startswith(venv), f"{m.__name__} imported from {m.__file__}, not from {venv}"
assert name in shipped_names(), f"{name} is not shipped: {shipped_names()}"
model = tiny_model("qwen2")
ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    before = model(ids).logits
    handle = emulator.apply_profile(model, name)
    patched = model(ids).logits
    handle.remove()
    after = model(ids).logits
assert patched.shape == before.shape and torch.isfinite(patched.float()).all(), "the patched forward pass is broken"
assert torch.equal(before, after), "handle.remove() did not give back the unpatched bits"
print(f"apply_profile(tiny_model('qwen2'), {name!r}): {handle!r}; logits {tuple(patched.shape)} "
      f"{'differ from' if not torch.equal(before, patched) else 'equal'} the unpatched ones; removed: bits restored")
EOF
}

steps_begin
T0=$SECONDS
step "step 1/9: copying the checkout's files to $SRC" copy_sources
step "step 2/9: creating a clean venv with $($BASE_PYTHON --version 2>&1)" "$BASE_PYTHON" -m venv "$VENV"
step "step 3/9: building the wheel (pip wheel --no-deps)" "${PIP[@]}" wheel --no-deps -w "$DIST" "$SRC"
WHEEL=$(ls "$DIST"/engineprofiles-*.whl)
step "step 4/9: checking that the wheel holds profiles/*.yaml as engineprofiles/profiles/" check_wheel_holds_the_profiles
step "step 5/9: installing the wheel, base dependencies only (torch pinned by $(basename "$CONSTRAINTS"))" \
  "${PIP[@]}" install "${LAZY_BYTECODE[@]}" -c "$CONSTRAINTS" "$WHEEL"
step "step 6/9: probe-engine list/show from $OUTSIDE list every shipped profile" check_list
step "step 7/9: commands that need an extra (or an engine environment) say which" check_missing_extras
step "step 8/9: installing the wheel with the insitu extra (transformers, triton)" \
  "${PIP[@]}" install "${LAZY_BYTECODE[@]}" -c "$CONSTRAINTS" "$WHEEL[insitu]"
step "step 9/9: apply_profile(tiny_model('qwen2'), '$PROFILE') and a forward pass" check_apply_profile
steps_log "the wheel works outside the checkout ($((SECONDS - T0)) s)"
