#!/usr/bin/env bash
# Run a command as it would run on a CPU of a lower capability, on this host:
#
#   scripts/emulate_cpu.sh avx2 scripts/probe.sh vllm 0.32.0 --ship
#   scripts/emulate_cpu.sh avx2 .venv/bin/probe-engine mismatch vllm --exact
#
# avx2: torch's ATen kernels and Inductor's generated code at AVX2 (ATEN_CPU_CAPABILITY=avx2),
# oneDNN capped at AVX2 (ONEDNN_MAX_CPU_ISA=AVX2), and, in an engine capture, vLLM's AVX2 kernel
# library (engineloop.capture answers torch.cpu._is_avx512_supported() False when
# ENGINEPROFILES_EMULATE_CPU is set). Inductor gets its own cache folder: its cache is not keyed by
# the capability, and code generated for AVX-512 vector widths crashes when compiled for AVX2.
#
# An emulation is not the machine: what a real AVX2 CPU runs may still differ (a library that
# checks the CPU itself). Profiles probed this way record it (engine.settings.cpu_emulated).
set -euo pipefail
[[ $# -ge 2 ]] || { echo "usage: $0 avx2 COMMAND [ARGS...]" >&2; exit 2; }
CAP=$1; shift
case "$CAP" in
  avx2) ;;
  *) echo "emulate_cpu.sh: only avx2 can be emulated (got '$CAP')" >&2; exit 2 ;;
esac
grep -qw avx2 /proc/cpuinfo || { echo "emulate_cpu.sh: this CPU has no AVX2" >&2; exit 2; }
HOST=$(grep -qw avx512f /proc/cpuinfo && echo AVX512 || echo AVX2)
export ENGINEPROFILES_EMULATE_CPU=$CAP ENGINEPROFILES_HOST_CAPABILITY=$HOST
export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
export TORCHINDUCTOR_CACHE_DIR="${TMPDIR:-/tmp}/torchinductor_$(id -un)_emulated_$CAP"
exec "$@"
