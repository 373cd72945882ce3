"""verl: a module to name in verl's ``external_lib``, which verl imports on every worker before it builds a model.

    actor_rollout_ref.model.external_lib=engineloop.integrations.verl
    ENGINEPROFILES_PROFILE=vllm            # what apply_profile takes: an engine spec, a shipped name or a file
    ENGINEPROFILES_EXACT=0                 # 1: exact mode (the profile's attention too)
    ENGINEPROFILES_FAMILIES=qwen2,qwen3    # default: every family (engineprofiles.families.FAMILIES)
    ENGINEPROFILES_KERNELS=auto            # exact mode's attention: auto, engine or portable

Importing it patches each family's classes (:func:`emulator.patch_family`), so that every model of those
families built afterwards in the process is patched: the actor and the reference model, a build in FP32
(verl's rank 0) and one on the meta device (the other ranks: patched when the weights arrive, at the first
forward), under FSDP2's mixed precision. Bad settings raise here, at import, so that verl's start-up fails
instead of training unpatched; what was applied is logged once (logger ``engineloop.integrations.verl``) and
printed to stderr, since verl silences warnings while it builds its models.

Not run against verl on this project's machines (no verl wheel on their package index); what it does is what
the class patch does, tested in tests/emulator/test_entry_points.py and tests/integrations/test_verl_module.py
(the build forms above, without verl). See docs/frameworks.md.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from engineprofiles.errors import EngineProfilesError
from engineprofiles.families import FAMILIES

__all__ = ["PATCHES", "settings"]

log = logging.getLogger(__name__)

PATCHES: list[Any] = []  # the ClassPatch of each family (remove() them to undo)


class VerlSettingsError(EngineProfilesError, ValueError):
    """An ENGINEPROFILES_* variable this module cannot honour."""


def settings(env: dict[str, str] | None = None) -> dict[str, Any]:
    """The patch settings from the environment (``env``, default os.environ); VerlSettingsError for a bad one."""
    env = os.environ if env is None else env
    profile = env.get("ENGINEPROFILES_PROFILE", "").strip()
    if not profile:
        raise VerlSettingsError("engineloop.integrations.verl: set ENGINEPROFILES_PROFILE to the profile to apply "
                                "(an engine spec such as vllm or vllm==0.32.0, a shipped name or a file)")
    exact_text = env.get("ENGINEPROFILES_EXACT", "0").strip().lower()
    if exact_text not in ("0", "1", "false", "true", ""):
        raise VerlSettingsError(f"ENGINEPROFILES_EXACT must be 0 or 1; got {exact_text!r}")
    exact = exact_text in ("1", "true")
    families = [f.strip() for f in env.get("ENGINEPROFILES_FAMILIES", "").split(",") if f.strip()] or list(FAMILIES)
    bad = [f for f in families if f not in FAMILIES]
    if bad:
        raise VerlSettingsError(f"ENGINEPROFILES_FAMILIES: no family {', '.join(map(repr, bad))}; families: "
                                f"{', '.join(FAMILIES)}")
    kernels = env.get("ENGINEPROFILES_KERNELS", "auto").strip() or "auto"
    if kernels != "auto" and not exact:
        raise VerlSettingsError(f"ENGINEPROFILES_KERNELS={kernels} concerns exact mode: set ENGINEPROFILES_EXACT=1")
    return dict(profile=profile, exact=exact, families=list(dict.fromkeys(families)), kernels=kernels)


def _install() -> None:
    import emulator
    from engineprofiles.store import get_profile

    s = settings()
    # a missing file, a spec naming no engine or no shipped profile: refused now (the choice for each model is
    # made again when it is built, for its dtype and device)
    get_profile(s["profile"], dtype="bfloat16")
    for family in s["families"]:
        PATCHES.append(emulator.patch_family(family, s["profile"], exact=s["exact"], kernels=s["kernels"]))
    said = (f"engineloop.integrations.verl: every {', '.join(s['families'])} model built in this process is patched "
            f"with {s['profile']}{' in exact mode' if s['exact'] else ''}")
    log.info(said)
    print(said, file=sys.stderr)


_install()
