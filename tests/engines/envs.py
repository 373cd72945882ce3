"""The engine environments the engine tests run: a missing one is a failure, never a skip."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def require_env(engine: str, version: str) -> Path:
    """The ready environment of ``engine`` ``version`` under .engines/, or the test fails saying how to make it."""
    env = REPO / ".engines" / f"{engine}-{version}"
    if not (env / ".ready").exists():
        pytest.fail(f"the {engine} {version} environment is missing: run `scripts/engine_env.sh {engine} {version}` "
                    "(scripts/test.sh does this). Engine tests are not skipped.", pytrace=False)
    return env
