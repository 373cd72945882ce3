"""The in-situ probe checks itself: exact mode with the fitted profile against the engine, on a model
whose widths the fit never saw.

The in-situ fit runs tiny models of fixed widths; kernels pick code paths by shape (GEMM blocking,
attention tiles, Inductor's reductions), so a profile fitted there can still miss on the widths of a
user's model. Right after fitting, :func:`self_check` draws a model at random (seeded: hidden size not
a power of two, GQA groups 1-7, an MLP width off the usual grid, a prompt length that is not a tile
multiple), runs the engine on it and ``probe-engine mismatch --exact`` with the new profile, and
records each exact row's exact-match fraction in ``provenance.self_check``. Exact mode warns
(:class:`~emulator.errors.InexactEvidence`) where the rows a trainer is told to use fall short.
"""

from __future__ import annotations

import random
import tempfile
from pathlib import Path
from typing import Any, Callable

from engineprofiles.errors import EngineProfilesError
from engineprofiles.schema import Profile, SelfCheck

# vLLM's and SGLang's CPU attention kernels take these head sizes; SGLang wants MLP widths in multiples of 32.
HEAD_DIMS = (64, 128)
HIDDEN = (136, 200, 264, 328, 392, 456, 520)


def draw_model(family: str, seed: int) -> tuple[dict[str, int], int]:
    """Random widths for ``family`` (tiny_model overrides) and a prompt length, from ``seed``."""
    rng = random.Random(f"self-check:{family}:{seed}")
    kv = rng.randint(1, 2)
    size = dict(num_hidden_layers=2, hidden_size=rng.choice(HIDDEN), num_key_value_heads=kv,
                num_attention_heads=kv * rng.randint(1, 7), head_dim=rng.choice(HEAD_DIMS),
                intermediate_size=32 * rng.choice([k for k in range(9, 40) if k % 4]))
    return size, rng.randrange(17, 61, 2)


def describe(family: str, size: dict[str, int]) -> str:
    return (f"{family}: {size['num_hidden_layers']} layers, hidden {size['hidden_size']}, MLP "
            f"{size['intermediate_size']}, heads {size['num_attention_heads']}/{size['num_key_value_heads']}, "
            f"head_dim {size['head_dim']}")


def self_check(engine: str, profile: Profile, family: str, *, seed: int, env: str | None, mode: str,
               note: Callable[[str], None] = lambda m: None) -> Profile:
    """``profile`` with ``provenance.self_check`` measured (see the module's docstring)."""
    from emulator.patching.apply import check_attention_evidence

    from .mismatch import run_mismatch

    try:  # exact mode refuses this fit (its attention is short of bitwise): no engine run for a self-check
        check_attention_evidence(profile)
    except EngineProfilesError as e:
        note(f"self-check not run, the profile records none: {e}")
        return profile
    size, prompt_len = draw_model(family, seed)
    note(f"self-check: the engine and exact mode on a model the fit never saw ({describe(family, size)}, "
         f"{prompt_len}-token prompts)")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fitted.yaml"
        profile.save(path)
        try:
            rep = run_mismatch(engine, family=family, profile=str(path), prompts=2, max_tokens=12, seed=seed + 1,
                               env=env, mode=mode, exact=True, size=size, prompt_len=prompt_len, note=note)
        except EngineProfilesError as e:  # the fit stands on its own: keep it, without a self-check, and say why
            note(f"self-check failed, the profile records none: {e}")
            return profile
    rows = {n: m for n, m in rep.rows if n.startswith("exact")}
    pre = {n: m for n, m in rep.prefill_rows if n.startswith("exact")}
    check = SelfCheck(model=describe(family, size) + f", prompts of {prompt_len}+ tokens", seed=seed + 1,
                      sampled_tokens=next(iter(rows.values())).tokens if rows else 0,
                      prefill_tokens=next(iter(pre.values())).tokens if pre else 0,
                      sampled={n: float(m.exact_match) for n, m in rows.items()},
                      prefill={n: float(m.exact_match) for n, m in pre.items()})
    note(f"self-check: {check.rows()}")
    prov = profile.provenance.model_copy(update={"self_check": check})
    return profile.model_copy(update={"provenance": prov})


def self_check_summary(sc: Any) -> str:
    """One line for the probe's output."""
    best = max(sc.sampled.values(), default=0.0)
    return (f"self-check ({sc.model}): sampled {best:.2%} of {sc.sampled_tokens} tokens (best exact row), "
            f"prefill {max(sc.prefill.values(), default=0.0):.2%} of {sc.prefill_tokens} (best exact row)")
