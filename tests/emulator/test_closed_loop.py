"""The closed loop: the transformers probe, run on a model patched with an engine's profile, reports
that engine's rounding sites (library and `probe-engine transformers --apply`)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

import emulator
from engineloop.cli import app
from engineprofiles.models import tiny_model
from engineprofiles.probe.adapters.transformers import TransformersAdapter
from engineprofiles.probe.harness import run_probe
from engineprofiles.regions import REGIONS
from engineprofiles.schema import load_profile
from engineprofiles.store import get_profile, shipped_names

FAMILIES = ("qwen2", "qwen3", "llama", "mistral")
cli = CliRunner()


def _distinct_engine_profiles() -> list[str]:
    """One shipped engine profile per distinct set of region points (the closed loop reads only those):
    profiles that differ in provenance or attention alone would run the same probe again."""
    first: dict[tuple, str] = {}
    for name in shipped_names():
        if not name.startswith("transformers-"):
            prof = get_profile(name)
            first.setdefault(tuple((r, prof.point(r)) for r in REGIONS), name)
    return list(first.values())


ENGINE_PROFILES = _distinct_engine_profiles()


def assert_reports(got, prof):
    """``got`` (a probe result) names ``prof``'s sites in every region, unambiguously, bit for bit."""
    for r in REGIONS:
        spec, ev = REGIONS[r], got.entry(r).evidence
        want = spec.canonicalize(prof.point(r))
        if r == "rmsnorm" and want["output"] == "fp32":
            # The probe reads plain RMSNorm through the first layer's input norm, which feeds a matmul:
            # an FP32 output (handed on to RoPE by Qwen3's q/k norms) is rounded there, as in the engine.
            want = spec.canonicalize(want.replace(output="rounded"))
        assert spec.site_part(got.point(r)) == spec.site_part(want), (r, got.point(r).label(), want.label())
        variants = " ".join(f"{k}={v}" for k, v in spec.variant_part(want).items())
        assert got.point(r) == want or variants in ev.indistinguishable, (r, got.point(r).label(), want.label())
        assert ev.match_rate == 1.0 and ev.max_ulp == 0, (r, ev.match_rate)
        assert not (ev.ambiguous or ev.shape_dependent or ev.nondeterministic), (r, ev)


@pytest.mark.parametrize("profile", ENGINE_PROFILES)
@pytest.mark.parametrize("family", FAMILIES)
def test_probing_a_model_patched_with_an_engine_profile_reports_its_sites(family, profile):
    prof = get_profile(profile)
    model = tiny_model(family, seed=2)
    # the regions a profile patches (attention is exact mode's, fitted against the engine in its own tests)
    with emulator.apply_profile(model, prof):
        got, _ = run_probe(TransformersAdapter(model=model, label=prof.canonical_name), seed=5, regions=list(REGIONS))
    assert_reports(got, prof)
    assert got.engine.execution_mode == "patched" and got.engine.settings["patched_with"] == prof.canonical_name
    # Unpatched, the same probe reports HF's own sites, which differ from the engine's somewhere.
    plain = _unpatched(family)
    assert any(plain[r] != got.point(r) for r in REGIONS)


_PLAIN: dict[str, dict] = {}


def _unpatched(family: str) -> dict:
    """The region points the probe reports on the unpatched tiny model of ``family`` (one probe per family)."""
    if family not in _PLAIN:
        plain, _ = run_probe(TransformersAdapter(model=tiny_model(family, seed=2)), seed=5, regions=list(REGIONS))
        _PLAIN[family] = {r: plain.point(r) for r in REGIONS}
    return _PLAIN[family]


def test_probe_engine_transformers_apply_probes_a_patched_tiny_model(tmp_path):
    name = "vllm-0.32.0-cpu-inductor-bfloat16"
    out = tmp_path / "closed-loop.yaml"
    regions = [a for r in REGIONS for a in ("--region", r)]
    r = cli.invoke(app, ["transformers", "--apply", name, "--family", "qwen3", *regions, "-o", str(out)],
                   env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    got = load_profile(out)
    assert_reports(got, get_profile(name))
    assert got.engine.settings["family"] == "qwen3" and got.engine.settings["patched_with"] == name


def test_probe_engine_transformers_apply_reports_a_refused_patch(tmp_path):
    fp16 = tmp_path / "fp16.yaml"
    get_profile("sglang-0.5.23-cpu-eager-bfloat16").model_copy(update={"dtype": "float16"}).save(fp16)
    r = cli.invoke(app, ["transformers", "--apply", str(fp16), "-o", str(tmp_path)], env={"COLUMNS": "200"})
    assert r.exit_code == 2 and "float16" in r.output and "bfloat16" in r.output, r.output
    r = cli.invoke(app, ["transformers", "--apply", "no-such-profile", "-o", str(tmp_path)], env={"COLUMNS": "200"})
    assert r.exit_code == 2 and "no-such-profile" in r.output, r.output
    assert not list(tmp_path.glob("transformers-*.yaml"))
