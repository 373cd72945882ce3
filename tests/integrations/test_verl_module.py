"""engineloop.integrations.verl, the module to name in verl's external_lib (issue 33 item 1, verl part), without
verl (not installable here): imported in a fresh process with the ENGINEPROFILES_* settings, it patches the
models built afterwards as verl's FSDP workers build them (FP32 on rank 0, on the meta device elsewhere), bit for
bit the directly patched model; bad settings fail the import."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

WORKER = r'''
import os, sys, torch
import engineloop.integrations.verl as hook          # what verl's external_lib does, before any model is built
import emulator
from accelerate import init_empty_weights
from engineprofiles.models import tiny_model, tiny_inputs

ref = tiny_model("qwen2", seed=0, dtype="float32")   # an FP32 build after the import (verl's rank 0)
state = {k: v.clone() for k, v in ref.state_dict().items()}
assert emulator.handle_of(ref) is not None, "an FP32 build (verl's rank 0) was not patched"
with init_empty_weights():                            # verl's other ranks
    meta = type(ref)(ref.config)
assert emulator.handle_of(meta) is None and any(meta in p.pending for p in hook.PATCHES)
meta.load_state_dict(state, assign=True)
ids = tiny_inputs(ref, 16, batch=2, seed=3)
with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
    a = ref(ids).logits
    b = meta(ids).logits                              # the weights arrived: patched at its first forward
assert emulator.handle_of(meta) is not None
for p in hook.PATCHES:
    p.remove()
plain = tiny_model("qwen2", seed=0, dtype="float32")
assert emulator.handle_of(plain) is None
with emulator.apply_profile(plain, os.environ["ENGINEPROFILES_PROFILE"]), torch.no_grad(), \
        torch.autocast("cpu", dtype=torch.bfloat16):
    c = plain(ids).logits
assert torch.equal(a, c) and torch.equal(b, c), "not the directly patched model's bits"
print("OK", [p.family for p in hook.PATCHES])
'''


def run(env: dict[str, str], code: str = WORKER) -> subprocess.CompletedProcess:
    import os

    full = {k: v for k, v in os.environ.items() if not k.startswith("ENGINEPROFILES_")}
    full.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=REPO,
                          env=full)


def test_the_module_patches_rank0_and_meta_device_builds_as_the_direct_patch_does():
    r = run({"ENGINEPROFILES_PROFILE": "vllm", "ENGINEPROFILES_FAMILIES": "qwen2,llama"})
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    assert "OK ['qwen2', 'llama']" in r.stdout
    assert "every qwen2, llama model built in this process is patched with vllm" in r.stderr


@pytest.mark.parametrize("env,words", [
    ({}, "set ENGINEPROFILES_PROFILE"),
    ({"ENGINEPROFILES_PROFILE": "vllm", "ENGINEPROFILES_EXACT": "yes"}, "ENGINEPROFILES_EXACT must be 0 or 1"),
    ({"ENGINEPROFILES_PROFILE": "vllm", "ENGINEPROFILES_FAMILIES": "qwen2,gpt2"}, "no family 'gpt2'"),
    ({"ENGINEPROFILES_PROFILE": "vllm", "ENGINEPROFILES_KERNELS": "engine"}, "set ENGINEPROFILES_EXACT=1"),
    ({"ENGINEPROFILES_PROFILE": "/nowhere/profile.yaml"}, "/nowhere/profile.yaml"),
    ({"ENGINEPROFILES_PROFILE": "nosuchengine"}, "nosuchengine"),
])
def test_bad_settings_fail_the_import(env, words):
    r = run(env, "import engineloop.integrations.verl")
    assert r.returncode != 0 and words in r.stderr, r.stderr[-3000:]
