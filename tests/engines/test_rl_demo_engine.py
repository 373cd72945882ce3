"""The RL demonstration (engineloop.rl, scripts/rl_demo.py) against the real vLLM engine as the
rollout worker: two steps on a tiny Qwen2, the policy updated in exact mode and the new weights
loaded into the running engine. A missing engine environment is a failure, never a skip.

What it checks: after the first update the engine samples with the new weights (the exact-mode
trainer, which holds the new weights, still reproduces the engine's log-probs; with the old
weights in the engine it would not), and exact mode's mismatch is never above the profile's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import warnings

import pytest

from .envs import machine_differences, require_env

from .envs import REPO
VERSION = "0.32.0"


@pytest.mark.engine
def test_rl_demo_updates_the_engine_and_exact_mode_scores_its_batched_split_decode(tmp_path):
    """Two steps; after the first update the engine samples with the new weights (step 2's exact match: with
    the old weights in the engine the updated trainer could not reproduce its log-probs). 150-token prompts:
    vLLM's CPU attention (split-KV on by default, 2+ threads) splits the decode contexts across its threads,
    planned for each step's whole batch of 8 rollouts. The demo's exact setup splits them as the engine did,
    the rollout batch scored as sampled together (emulator.as_sampled with completion lengths), with gradients
    on (it trains in exact mode): every sampled token's log-prob is the engine's (2026-12-05, AVX512, 2
    threads: 128/128 in both steps). Run by the vLLM environment's python with --kernels engine: exact mode's
    attention is vLLM's own kernel, called for every engine step of the rollout batch. (The demo with the
    portable reference and 12-token prompts was a second engine run, dropped to fit CI (docs/development.md):
    exact mode's portable rows of a batched split decode are test_exact_mode.py's, auto's fallback
    test_exact.py's.)"""
    from engineloop.mismatch import default_profile_name

    env = require_env("vllm", VERSION)
    out, png = tmp_path / "rl.json", tmp_path / "rl.png"
    # on a machine the profile does not describe (vLLM's amx attention, say) the engine's kernel is not the
    # profile's and kernels="engine" is refused: the demo then measures with the reference (no claim)
    here = not machine_differences(default_profile_name("vllm", VERSION, "default"))
    kernels = ["--kernels", "engine"] if here else []
    r = subprocess.run([str(env / "bin" / "python"), "scripts/rl_demo.py", "--steps", "2", "--lr", "1e-2",
                        "--prompt-len", "150", *kernels, "--json", str(out)], cwd=REPO,
                       capture_output=True, text=True, timeout=1200,
                       env={k: v for k, v in os.environ.items() if k != "VLLM_CPU_ATTN_SPLIT_KV"})
    sys.stdout.write(r.stdout[-3000:] + r.stderr[-3000:])
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads(out.read_text())
    from engineloop.rl import plot  # --plot's drawing, here: the vLLM environment has no matplotlib

    plot(d, str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    steps = d["steps"]
    assert len(steps) == 2 and set(steps[0]["setups"]) == {"as-is", "profile", "exact"}
    for s in steps:
        assert s["setups"]["exact"]["k3_kl"] <= s["setups"]["profile"]["k3_kl"]
    # the demo says when its profile does not describe this machine, and claims exactness only where it does
    assert bool(d["other_machine"]) == bool(machine_differences(d["profile"])), d["other_machine"]
    att = d["engine"]["attention"]
    assert att["split_kv"] is True, att
    if att["torch_threads"] < 2:
        print(f"the engine ran with {att['torch_threads']} thread: nothing was split, the split model was not exercised")
    assert d["exact_kernels"] == ("engine" if here else "portable")
    if d["other_machine"]:
        warnings.warn(f"exact mode's bit-equality is not claimed on this machine: {d['other_machine']}", stacklevel=1)
        return
    for s in steps:  # step 2 samples after the first update
        assert s["setups"]["exact"]["exact_match"] == 1.0 and s["setups"]["exact"]["abs_dlogp_max"] == 0.0, s
