"""Region, activation-dtype, family, mode and device names, and their checks, without torch.

`probe-engine vllm` checks its arguments here, then hands over to the engine's environment; loading
torch first would cost ~2 s for nothing. ``engineprofiles.rounding`` builds its dtype table from
these names and ``engineprofiles.regions`` checks region names with them;
tests/engineprofiles/probe/test_cli_probe.py checks that the region specs come in this order.
"""

from __future__ import annotations

import re

from . import engines, families
from .errors import ArgumentError, PointError, UnsupportedDtype

REGION_NAMES = ("rope", "swiglu", "add_rmsnorm", "rmsnorm")
# Probed like the regions and recorded beside them (engineprofiles.regions.BESIDE).
BESIDE_NAMES = ("attention", "moe", "shared_expert")
ACT_DTYPE_NAMES = ("bfloat16", "float16")
# The model families (engineprofiles.families.FAMILIES; these are the shipped ones, for help texts), and
# those whose MLPs are sparse MoE blocks (their experts are the profile's moe entry; Qwen2-MoE's blocks
# also have a shared expert, the profile's shared_expert entry).
FAMILY_NAMES = tuple(families.FAMILIES)
MOE_FAMILY_NAMES = families.moe_families()
# The RoPE scalings a tiny model can carry (engineprofiles.models.ROPE_SCALINGS; CLI --rope-scaling).
ROPE_SCALING_NAMES = ("llama3", "linear", "yarn", "dynamic")
# Engines: their modes, execution modes, distributions and the rest are in engineprofiles.engines.
DEVICE_PATTERN = r"cpu|cuda(:[0-9]+)?"
# A profile's engine name, version and execution mode become parts of file names: plain names only.
SAFE_NAME = r"[A-Za-z0-9][A-Za-z0-9._+-]{0,63}"


def execution_mode(engine: str, mode: str = "default") -> str:
    """The execution mode a profile of ``engine`` run in ``mode`` records (``default``: the engine's
    default mode): ``execution_mode("vllm") == "inductor"``."""
    return engines.get(engine).execution_mode(mode)


def op_level_name(engine: str, version: str, mode: str = "default", dtype: str = "bfloat16",
                  backend: str = "cpu") -> str:
    """The name of the op-level profile of ``engine`` ``version`` in ``mode`` (Profile.canonical_name's
    rule, without a capability suffix)."""
    return f"{engine}-{version}-{backend}-{execution_mode(engine, mode)}-{dtype}"


def check_region_name(name: str) -> str:
    if name not in REGION_NAMES:
        raise PointError(f"unknown region {name!r}; regions are {', '.join(REGION_NAMES)}")
    return name


def check_probe_region_name(name: str) -> str:
    """A name ``--region`` accepts: a region, or an entry probed beside them (attention, moe)."""
    if name not in REGION_NAMES + BESIDE_NAMES:
        raise ArgumentError(f"unknown region {name!r}; --region takes {', '.join(REGION_NAMES + BESIDE_NAMES)}")
    return name


def check_rope_scaling_name(name: str) -> str:
    if name not in ROPE_SCALING_NAMES:
        raise ArgumentError(f"unknown RoPE scaling {name!r}; scalings: {', '.join(ROPE_SCALING_NAMES)}")
    return name


def check_family_name(name: str) -> str:
    if name not in families.FAMILIES:
        raise ArgumentError(f"unknown model family {name!r}; families: {', '.join(families.FAMILIES)}")
    return name


def check_mode_name(engine: str | None, mode: str) -> str:
    """``mode`` when ``engine`` takes it (None: when some engine does, before the engine is known)."""
    modes = engines.get(engine).modes if engine else engines.all_modes()
    if mode not in modes:
        raise ArgumentError(f"{engine + ' mode' if engine else '--mode'} must be one of {', '.join(modes)}; got {mode!r}")
    return mode


def check_device_name(device: str) -> str:
    if not re.fullmatch(DEVICE_PATTERN, device):
        raise ArgumentError(f"unknown device {device!r}; probe on cpu or cuda (cuda:N for another GPU)")
    return device


def is_safe_name(name: object) -> bool:
    """A plain name (letters, digits, . _ + -; not a path, not hidden), usable in a file name."""
    return isinstance(name, str) and re.fullmatch(SAFE_NAME, name) is not None


def check_dtype_name(name: str) -> str:
    if name not in ACT_DTYPE_NAMES:
        raise UnsupportedDtype(f"activation dtype {name!r} is not supported; use one of {sorted(ACT_DTYPE_NAMES)}")
    return name
