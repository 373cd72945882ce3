"""Region and activation-dtype names, and their checks, without torch.

`probe-engine vllm` checks its arguments here, then hands over to the engine's environment; loading
torch first would cost ~2 s for nothing. ``engineprofiles.rounding`` builds its dtype table from
these names and ``engineprofiles.regions`` checks region names with them;
tests/engineprofiles/probe/test_cli_probe.py checks that the region specs come in this order.
"""

from __future__ import annotations

from .errors import PointError, UnsupportedDtype

REGION_NAMES = ("rope", "swiglu", "add_rmsnorm", "rmsnorm")
ACT_DTYPE_NAMES = ("bfloat16", "float16")


def check_region_name(name: str) -> str:
    if name not in REGION_NAMES:
        raise PointError(f"unknown region {name!r}; regions are {', '.join(REGION_NAMES)}")
    return name


def check_dtype_name(name: str) -> str:
    if name not in ACT_DTYPE_NAMES:
        raise UnsupportedDtype(f"activation dtype {name!r} is not supported; use one of {sorted(ACT_DTYPE_NAMES)}")
    return name
