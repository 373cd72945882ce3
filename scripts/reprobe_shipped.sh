#!/usr/bin/env bash
# Re-probe every shipped profile on this machine, with the command each records (provenance.command),
# the op-level profiles first (the in-situ fits start from them). The emulated-AVX2 profile is
# re-probed under scripts/emulate_cpu.sh avx2 where this host has AVX-512.
#
#   scripts/reprobe_shipped.sh [NAME_SUBSTRING]     e.g. scripts/reprobe_shipped.sh vllm-0.32.0
#
# Profiles record the machine they were probed on (engineprofiles.machine): run this on the machine
# class the shipped profiles are meant for, and say which one in the commit.
set -euo pipefail
REPO=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
FILTER=${1:-}
PY=$(scripts/dev_env.sh)
mapfile -t ROWS < <("$PY" - "$FILTER" <<'PY'
import sys
from engineprofiles.store import shipped_profiles
rows = []
for name, p in shipped_profiles():
    if sys.argv[1] and sys.argv[1] not in name:
        continue
    rank = 0 if p.provenance.method != "in-situ" else 1
    emu = str(p.engine.settings.get("cpu_capability", "")).lower() if p.engine.settings.get("cpu_emulated") else ""
    rows.append((rank, name, emu, p.provenance.command))
for rank, name, emu, cmd in sorted(rows):
    print(f"{name}|{emu}|{cmd}")
PY
)
for row in "${ROWS[@]}"; do
  IFS="|" read -r name emu cmd <<<"$row"
  [[ "$cmd" == scripts/probe.sh\ * ]] || { echo "skip $name: its command is not scripts/probe.sh ($cmd)" >&2; continue; }
  read -r -a argv <<<"$cmd"
  echo "== $name: ${emu:+scripts/emulate_cpu.sh $emu }$cmd" >&2
  if [[ -n "$emu" ]]; then
    scripts/emulate_cpu.sh "$emu" "${argv[@]}" >/dev/null
  else
    "${argv[@]}" >/dev/null
  fi
done
