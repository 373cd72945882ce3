#!/usr/bin/env bash
# Run every end-to-end mismatch measurement that docs/mismatch.md shows (vLLM in the loop, its
# default compiled mode and enforce_eager, the tiny models and wider ones with longer prompts,
# with the exact-mode rows; SGLang's CPU engine on the tiny models), write docs/data/*.json, then
# regenerate docs/mismatch.md.
# Then the batch checks (--batch-check: the engine against itself in other batch compositions), short
# and long prompts, vLLM with and without split-KV attention, SGLang: docs/data/batch-*.json.
# The MoE families (qwen3_moe: vLLM's fused-MoE experts, SGLang's native MoE, on the tiny model and a
# wider one; qwen2_moe: its shared expert, vLLM on the tiny model).
# Takes ~40 minutes on a 2-core CPU (each run starts the engine). --wide-only: only the wider models;
# --batch-only: only the batch checks (--batch-vllm-only: vLLM's); --moe-only: only the MoE runs; --split-only: the wider models with vLLM's
# default split-KV attention; --avx2-only: vLLM's AVX2 build,
# emulated on an AVX-512 host (scripts/emulate_cpu.sh avx2; the trainer then loads the -avx2 profile).
set -euo pipefail
REPO=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
PY=$(scripts/dev_env.sh)
V=${VLLM_VERSION:-0.32.0}
D=docs/data
mkdir -p "$D"
run() {  # name, then probe-engine mismatch options
  local name=$1; shift
  echo "== $name: probe-engine mismatch vllm --exact $*" >&2
  ENGINEPROFILES_COMMAND="${PREFIX:-}probe-engine mismatch vllm --exact $*" \
    $WRAP "$PY" -m engineloop.cli mismatch vllm --exact --json "$D/mismatch-vllm-$V-$name.json" "$@" >/dev/null
}
WRAP=
batch() {  # engine, name, then probe-engine mismatch options
  local engine=$1 name=$2; shift 2
  local ver=$V; [[ $engine == sglang ]] && ver=${SGLANG_VERSION:-0.5.23}
  echo "== batch $name: ${PREFIX:-}probe-engine mismatch $engine --batch-check $*" >&2
  ENGINEPROFILES_COMMAND="${PREFIX:-}probe-engine mismatch $engine --batch-check $*" \
    "$PY" -m engineloop.cli mismatch "$engine" --batch-check --json "$D/batch-$engine-$ver-$name.json" "$@" >/dev/null
}
LONG=(--prompts 6 --prompt-len 150 --max-tokens 24)
batch_vllm() {  # with --exact: exact mode against the batched decode runs too
  batch vllm qwen2 --family qwen2 --exact
  batch vllm qwen2-long --family qwen2 --exact "${LONG[@]}"
  VLLM_CPU_ATTN_SPLIT_KV=0 PREFIX="VLLM_CPU_ATTN_SPLIT_KV=0 " batch vllm qwen2-long-nosplit --family qwen2 --exact "${LONG[@]}"
  batch vllm qwen3-long-eager --family qwen3 --mode eager --exact "${LONG[@]}"
}
batch_all() {
  batch_vllm
  batch sglang qwen2 --family qwen2
  batch sglang qwen2-long --family qwen2 "${LONG[@]}"
}
sglang_run() {  # name, then probe-engine mismatch options
  local name=$1; shift
  local S=${SGLANG_VERSION:-0.5.23}
  echo "== $name: probe-engine mismatch sglang --exact $*" >&2
  ENGINEPROFILES_COMMAND="probe-engine mismatch sglang --exact $*" \
    "$PY" -m engineloop.cli mismatch sglang --exact --json "$D/mismatch-sglang-$S-$name.json" "$@" >/dev/null
}
WIDE=(--layers 4 --hidden 512 --intermediate 1024 --prompt-len 200 --max-tokens 32)
moe_all() {
  run qwen3_moe --family qwen3_moe
  run qwen3_moe-eager --family qwen3_moe --mode eager
  VLLM_CPU_ATTN_SPLIT_KV=0 PREFIX="VLLM_CPU_ATTN_SPLIT_KV=0 " run qwen3_moe-wide-nosplit --family qwen3_moe "${WIDE[@]}" \
    --heads 8 --kv-heads 2 --head-dim 128
  sglang_run qwen3_moe --family qwen3_moe
  # Qwen2-MoE: a shared expert beside the routed ones, top-k weights not renormalized. (SGLang 0.5.23 cannot
  # run it on a CPU without AMX: its block gates the shared expert with a Triton GPU kernel.)
  run qwen2_moe --family qwen2_moe
  run qwen2_moe-eager --family qwen2_moe --mode eager
}
if [[ "${1:-}" == --moe-only ]]; then
  moe_all
  "$PY" scripts/make_mismatch_docs.py
  exit 0
fi
avx2_all() {
  grep -qw avx512f /proc/cpuinfo || { echo "--avx2-only: AVX2 is emulated on an AVX-512 host; this one has none" >&2; exit 2; }
  WRAP="scripts/emulate_cpu.sh avx2" PREFIX="scripts/emulate_cpu.sh avx2 " run qwen2-avx2 --family qwen2
  export VLLM_CPU_ATTN_SPLIT_KV=0
  local P="VLLM_CPU_ATTN_SPLIT_KV=0 scripts/emulate_cpu.sh avx2 "
  WRAP="scripts/emulate_cpu.sh avx2" PREFIX="$P" run qwen2-wide-nosplit-avx2 --family qwen2 "${WIDE[@]}" --heads 4 --kv-heads 2 --head-dim 128
  WRAP="scripts/emulate_cpu.sh avx2" PREFIX="$P" run qwen3-wide-nosplit-avx2 --family qwen3 "${WIDE[@]}" --heads 8 --kv-heads 2 --head-dim 128
  WRAP="scripts/emulate_cpu.sh avx2" PREFIX="$P" run llama-wide-nosplit-avx2 --family llama "${WIDE[@]}" --heads 8 --kv-heads 8 --head-dim 64
  unset VLLM_CPU_ATTN_SPLIT_KV
}
# vLLM's default split-KV attention (VLLM_CPU_ATTN_SPLIT_KV=1): decode contexts of 200+ keys are split across
# the engine's threads; exact mode splits them as it did ('exact, decoded'). Both modes, the three families,
# and the emulated AVX2 build (its merge without FMAs).
# (vLLM's Qwen2 takes head_dim = hidden / heads; Qwen3 and Llama read head_dim from the config)
split_all() {
  run qwen2-wide --family qwen2 "${WIDE[@]}" --heads 4 --kv-heads 2 --head-dim 128
  run qwen2-wide-eager --family qwen2 --mode eager "${WIDE[@]}" --heads 4 --kv-heads 2 --head-dim 128
  run qwen3-wide --family qwen3 "${WIDE[@]}" --heads 8 --kv-heads 2 --head-dim 128
  run qwen3-wide-eager --family qwen3 --mode eager "${WIDE[@]}" --heads 8 --kv-heads 2 --head-dim 128
  run llama-wide --family llama "${WIDE[@]}" --heads 8 --kv-heads 8 --head-dim 64
  run llama-wide-eager --family llama --mode eager "${WIDE[@]}" --heads 8 --kv-heads 8 --head-dim 64
  if grep -qw avx512f /proc/cpuinfo; then
    WRAP="scripts/emulate_cpu.sh avx2" PREFIX="scripts/emulate_cpu.sh avx2 " run qwen2-wide-avx2 --family qwen2 \
      "${WIDE[@]}" --heads 4 --kv-heads 2 --head-dim 128
  else
    echo "the AVX2 (emulated) split run is left out: this host has no AVX-512" >&2
  fi
}
if [[ "${1:-}" == --split-only ]]; then
  split_all
  "$PY" scripts/make_mismatch_docs.py
  exit 0
fi
if [[ "${1:-}" == --avx2-only ]]; then
  avx2_all
  "$PY" scripts/make_mismatch_docs.py
  exit 0
fi
if [[ "${1:-}" == --batch-vllm-only ]]; then
  batch_vllm
  "$PY" scripts/make_mismatch_docs.py
  exit 0
fi
if [[ "${1:-}" == --batch-only ]]; then
  batch_all
  "$PY" scripts/make_mismatch_docs.py
  exit 0
fi
if [[ "${1:-}" != --wide-only ]]; then
  for f in qwen2 qwen3 llama mistral; do
    run "$f" --family "$f"
    run "$f-eager" --family "$f" --mode eager
  done
  # scaled RoPE (rope_parameters): Llama 3.1's llama3 scaling, linear with factor 3, YaRN with factor 4,
  # dynamic (NTK) with factor 2
  for r in llama3 linear yarn dynamic; do
    run "llama-$r" --family llama --rope-scaling "$r"
  done
fi
split_all
# vLLM's CPU attention splits long decode contexts across threads by default; with the split off
# its decode equals its prefill, and so can the trainer's.
export VLLM_CPU_ATTN_SPLIT_KV=0
PREFIX="VLLM_CPU_ATTN_SPLIT_KV=0 " run qwen2-wide-nosplit --family qwen2 "${WIDE[@]}" --heads 4 --kv-heads 2 --head-dim 128
PREFIX="VLLM_CPU_ATTN_SPLIT_KV=0 " run qwen2-wide-eager-nosplit --family qwen2 --mode eager "${WIDE[@]}" --heads 4 --kv-heads 2 --head-dim 128
PREFIX="VLLM_CPU_ATTN_SPLIT_KV=0 " run qwen3-wide-nosplit --family qwen3 "${WIDE[@]}" --heads 8 --kv-heads 2 --head-dim 128
PREFIX="VLLM_CPU_ATTN_SPLIT_KV=0 " run qwen3-wide-eager-nosplit --family qwen3 --mode eager "${WIDE[@]}" --heads 8 --kv-heads 2 --head-dim 128
PREFIX="VLLM_CPU_ATTN_SPLIT_KV=0 " run llama-wide-nosplit --family llama "${WIDE[@]}" --heads 8 --kv-heads 8 --head-dim 64
PREFIX="VLLM_CPU_ATTN_SPLIT_KV=0 " run llama-wide-eager-nosplit --family llama --mode eager "${WIDE[@]}" --heads 8 --kv-heads 8 --head-dim 64
# Qwen2-0.5B's widths, 8 layers, 300-token prompts: the engine's decode differs from its own prefill even with
# split-KV off (other kernel shapes); exact mode's 'exact, decoded' row re-scores as the engine decoded.
PREFIX="VLLM_CPU_ATTN_SPLIT_KV=0 " run qwen2-896-nosplit --family qwen2 --layers 8 --hidden 896 --intermediate 4864 \
  --heads 14 --kv-heads 2 --head-dim 64 --prompt-len 300 --max-tokens 32
# linear RoPE scaling (factor 3) where positions are long enough (~350+) for the engines' convention (the
# position divided) and HF's (the frequency divided) to give different BF16 cos/sin
PREFIX="VLLM_CPU_ATTN_SPLIT_KV=0 " run llama-linear-long-nosplit --family llama --rope-scaling linear --prompt-len 460 --max-tokens 24
unset VLLM_CPU_ATTN_SPLIT_KV
# SGLang's CPU engine (its default mode: eager layers, torch_native attention)
if [[ "${1:-}" != --wide-only ]]; then
  for f in qwen2 qwen3 llama mistral; do
    sglang_run "$f" --family "$f"
  done
  sglang_run llama-llama3 --family llama --rope-scaling llama3
  sglang_run llama-yarn --family llama --rope-scaling yarn
  sglang_run llama-dynamic --family llama --rope-scaling dynamic
fi
moe_all
batch_all
if grep -qw avx512f /proc/cpuinfo; then avx2_all; else echo "AVX2 (emulated) runs left out: this host has no AVX-512" >&2; fi
"$PY" scripts/make_mismatch_docs.py
