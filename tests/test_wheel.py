"""The wheel works outside the checkout: scripts/wheel_smoke.sh builds it, installs it into a clean
venv in a temporary folder (torch pinned to the local CPU build, as scripts/dev_env.sh does) and,
from a folder outside the checkout with no ENGINEPROFILES_* variable set, lists the shipped
profiles, checks that the commands needing an extra name it, and patches a tiny Qwen2 model with
a shipped vLLM profile (apply_profile, a forward pass, remove).

How it fails when the profiles are not packaged: the script's step 4 compares the wheel's
``engineprofiles/profiles/*.yaml`` with ``profiles/*.yaml`` byte for byte and exits 1 naming the
missing files ("lacks [...]"), so this test fails with the script's log tail (checked once by
building with setup.py's cmdclass removed). Were that check gone, step 6 would fail the same way:
`probe-engine list` would list none of them. With an empty ``profiles/``, setup.py refuses to
build (step 3).

About a minute on a 2-core CPU with pip's downloads cached: most of it installs torch, Triton
and transformers into the venv.
"""

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_wheel_carries_the_profiles_and_works_outside_the_checkout():
    r = subprocess.run(["bash", str(ROOT / "scripts" / "wheel_smoke.sh")], cwd=ROOT, capture_output=True, text=True,
                       errors="replace", timeout=1800)
    assert r.returncode == 0, f"scripts/wheel_smoke.sh failed (exit {r.returncode}):\n{r.stderr[-6000:]}"
    assert "step 9/9" in r.stderr and "the wheel works outside the checkout" in r.stderr, r.stderr
