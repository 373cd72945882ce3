import json

import pytest
from typer.testing import CliRunner

from engineloop.cli import app
from engineprofiles.diff import diff_profiles
from engineprofiles.regions import REGIONS

from ..conftest import synthetic_profile

runner = CliRunner()


def _pair(tmp_path, change_region=None, change_site=None):
    pts = {n: s.all_points()[-1] for n, s in REGIONS.items()}
    a = synthetic_profile(pts)
    if change_region:
        pts = dict(pts)
        p = pts[change_region]
        flipped = "fp32" if p[change_site] == "rounded" else "rounded"
        pts[change_region] = REGIONS[change_region].canonicalize(p.replace(**{change_site: flipped}))
    b = synthetic_profile(pts, version="0.1")
    pa, pb = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.save(pa)
    b.save(pb)
    return a, b, pa, pb


def test_identical_sites_exit_0_even_when_provenance_differs(tmp_path):
    a, b, pa, pb = _pair(tmp_path)
    d = diff_profiles(a, b)
    assert d.exit_code == 0 and not d.site_differences
    assert ("engine.version", "0.0", "0.1") in d.context
    r = runner.invoke(app, ["diff", str(pa), str(pb)], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert "all rounding sites agree" in r.output and "engine.version" in r.output


@pytest.mark.parametrize("region,site", [(n, c.name) for n, s in REGIONS.items() for c in s.sites])
def test_each_changed_site_is_reported_and_exits_1(tmp_path, region, site):
    a, b, pa, pb = _pair(tmp_path, region, site)
    d = diff_profiles(a, b, "a", "b")
    assert [(r.region, r.name) for r in d.site_differences] == [(region, site)]
    r = runner.invoke(app, ["diff", str(pa), str(pb), "--format", "json"])
    assert r.exit_code == 1
    data = json.loads(r.output)
    assert not data["sites_agree"]
    assert [x["name"] for x in data["rows"] if not x["same"]] == [site]


def test_markdown_format_marks_the_difference(tmp_path):
    a, b, pa, pb = _pair(tmp_path, "swiglu", "silu")
    r = runner.invoke(app, ["diff", str(pa), str(pb), "-f", "markdown"])
    assert r.exit_code == 1
    assert "| swiglu | silu |" in r.output and "**differs**" in r.output and "1 rounding site(s) differ" in r.output


def test_variant_differences_are_shown_but_do_not_fail(tmp_path):
    pts = {n: s.all_points()[-1] for n, s in REGIONS.items()}
    a = synthetic_profile(pts)
    pts2 = dict(pts, rmsnorm=pts["rmsnorm"].replace(rstd="rsqrt" if pts["rmsnorm"]["rstd"] != "rsqrt" else "divide"))
    b = synthetic_profile(pts2)
    d = diff_profiles(a, b)
    assert d.exit_code == 0 and [r.name for r in d.variant_differences] == ["rstd"]


def test_unavailable_region_counts_as_a_difference(tmp_path):
    import yaml

    from engineprofiles.schema import profile_from_yaml

    a = synthetic_profile()
    data = yaml.safe_load(a.to_yaml())
    data["regions"]["rope"] = {"sites": None, "evidence": {"status": "unavailable", "reason": "no kernel"}}
    b = profile_from_yaml(yaml.safe_dump(data, sort_keys=False))
    d = diff_profiles(a, b)
    assert d.exit_code == 1 and d.site_differences[0].kind == "availability"


def test_diff_errors_exit_2(tmp_path):
    r = runner.invoke(app, ["diff", "nope-a", "nope-b"])
    assert r.exit_code == 2 and "nope-a" in r.output
    a, b, pa, pb = _pair(tmp_path)
    r = runner.invoke(app, ["diff", str(pa), str(pb), "--format", "xml"])
    assert r.exit_code == 2 and "--format" in r.output
