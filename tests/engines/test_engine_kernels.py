"""Exact mode through the engine's own attention kernel (apply_profile(..., exact=True, kernels="engine")),
where the engine is importable in the trainer's process: here vLLM's environment, which has the
trainer's packages too (transformers, Triton). The kernel's rows must be the portable reference's bit for
bit wherever the lattice covers the engine's kernel (this machine's profile): one forward over a
left-padded batch of random lengths on tiny models of random widths (seeded), a sequence scored as
vLLM sampled it with its split-KV decode, and a rollout batch scored as sampled together (whole, and one
request as a micro-batch: the requests the forward does not hold go into the engine's calls as zeros). A
must-fail control: the reference at a perturbed attention point differs. The engine's kernel must actually run (its calls are counted).

A missing engine environment is a failure, never a skip.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from .envs import REPO, exact_refused_here, require_env

VERSION = "0.32.0"


@pytest.mark.engine
# Qwen2 of random widths (seeded), about 3 minutes on the 2-core AVX2 machine; the other families go through the
# engine's kernel in tests/engines/test_exact_mode.py (ENGINE_KERNEL_CASES). The worker takes families as
# arguments: `python -m tests.engines.engine_kernels_worker SEED qwen2 qwen3 llama` runs all three.
@pytest.mark.parametrize("seed", [0])
def test_exact_mode_with_vllms_kernel_is_the_portable_reference_bit_for_bit(seed):
    env = require_env("vllm", VERSION)
    if exact_refused_here("vllm", VERSION, ["--family", "qwen2", "--exact"]):
        return
    r = subprocess.run([str(env / "bin" / "python"), "-m", "tests.engines.engine_kernels_worker", str(seed), "qwen2"],
                       cwd=REPO, capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, r.stderr[-4000:]
    cases = json.loads(r.stdout.strip().splitlines()[-1])["cases"]
    assert len(cases) == 1
    for c in cases:
        print(c)
        assert c["engine ran"] == "engine" and c["portable ran"] == "portable", c
        assert c["engine kernel calls"] > 0 and c["portable kernel calls"] == 0, c  # the kernel ran, or not
        assert c["padded batch equal"] and c["sampled split-KV equal"], c
        assert c["split rows"] > 0, c  # the sampled sequence's decode was split: the split path ran
        assert c["engine repeatable"] and c["portable repeatable"], c
        assert c["perturbed differs"], c  # the comparison can fail
        assert c["gradient finite"], c
    together = cases[0]  # qwen2: a rollout batch sampled together, whole and as a micro-batch
    assert together["together engine kernel calls"] > 0 and together["together portable kernel calls"] == 0, together
    assert together["together split rows"] > 0, together  # the batch's plan split decode steps
    assert together["together equal"] and together["together micro-batch equal"], together
