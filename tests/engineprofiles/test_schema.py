import os

import pytest
import yaml

from engineprofiles.errors import ProfileError
from engineprofiles.regions import REGIONS
from engineprofiles.schema import load_profile, profile_from_yaml, write_atomic

from ..conftest import synthetic_profile


def _mutate(profile_file, tmp_path, fn, name="bad.yaml"):
    data = yaml.safe_load(profile_file.read_text())
    fn(data)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_dump_then_load_gives_the_same_profile_and_bytes(profile_file):
    text = profile_file.read_text()
    p = load_profile(profile_file)
    assert p.to_yaml() == text
    assert profile_from_yaml(p.to_yaml()) == p


def test_yaml_lists_sites_before_evidence_and_regions_before_provenance(profile_file):
    text = profile_file.read_text()
    assert text.index("regions:") < text.index("provenance:")
    rope = text[text.index("  rope:"):text.index("  swiglu:")]
    assert rope.index("sites:") < rope.index("variants:") < rope.index("evidence:")


def test_every_region_point_survives_a_round_trip():
    for i in range(max(len(s.all_points()) for s in REGIONS.values())):
        pts = {n: s.all_points()[i % len(s.all_points())] for n, s in REGIONS.items()}
        p = synthetic_profile(pts)
        q = profile_from_yaml(p.to_yaml())
        assert {n: q.point(n) for n in REGIONS} == pts


def test_unavailable_region_round_trips_and_refuses_point():
    pts = {n: s.all_points()[0] for n, s in REGIONS.items()}
    p = synthetic_profile(pts)
    data = yaml.safe_load(p.to_yaml())
    data["regions"]["rope"] = {"sites": None, "evidence": {"status": "unavailable", "reason": "no rotary op here"}}
    q = profile_from_yaml(yaml.safe_dump(data, sort_keys=False))
    assert not q.available("rope") and q.available("swiglu")
    assert profile_from_yaml(q.to_yaml()) == q
    with pytest.raises(ProfileError, match="unavailable"):
        q.point("rope")


def test_syntax_error_names_file_and_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("schema_version: 1\nengine: [unclosed\n")
    with pytest.raises(ProfileError) as e:
        load_profile(path)
    msg = str(e.value)
    assert str(path) in msg and "line" in msg and "YAML syntax error" in msg


def test_unknown_key_names_file_field_and_allowed_keys(profile_file, tmp_path):
    path = _mutate(profile_file, tmp_path, lambda d: d["engine"].__setitem__("colour", "blue"))
    with pytest.raises(ProfileError) as e:
        load_profile(path)
    msg = str(e.value)
    assert str(path) in msg and "engine.colour" in msg and "allowed keys here" in msg and "execution_mode" in msg


def test_wrong_type_names_file_and_field(profile_file, tmp_path):
    path = _mutate(profile_file, tmp_path, lambda d: d["regions"]["rope"]["evidence"].__setitem__("match_rate", "high"))
    with pytest.raises(ProfileError) as e:
        load_profile(path)
    msg = str(e.value)
    assert str(path) in msg and "regions.rope.evidence.match_rate" in msg and "'high'" in msg


def test_unknown_site_names_the_sites_the_region_has(profile_file, tmp_path):
    path = _mutate(profile_file, tmp_path, lambda d: d["regions"]["swiglu"]["sites"].__setitem__("gate", "fp32"))
    with pytest.raises(ProfileError) as e:
        load_profile(path)
    msg = str(e.value)
    assert str(path) in msg and "regions.swiglu.sites.gate" in msg and "unknown site 'gate'" in msg and "silu" in msg


def test_unknown_precision_names_the_allowed_ones(profile_file, tmp_path):
    path = _mutate(profile_file, tmp_path, lambda d: d["regions"]["rope"]["sites"].__setitem__("cos_sin", "bf16"))
    with pytest.raises(ProfileError) as e:
        load_profile(path)
    msg = str(e.value)
    assert "regions.rope.sites.cos_sin" in msg and "'fp32'" in msg and "'rounded'" in msg and "'bf16'" in msg


def test_future_schema_version_is_refused(profile_file, tmp_path):
    path = _mutate(profile_file, tmp_path, lambda d: d.__setitem__("schema_version", 2))
    with pytest.raises(ProfileError) as e:
        load_profile(path)
    msg = str(e.value)
    assert str(path) in msg and "schema_version" in msg and "not supported" in msg and "upgrade" in msg


def test_missing_region_is_refused_with_the_list_of_regions(profile_file, tmp_path):
    path = _mutate(profile_file, tmp_path, lambda d: d["regions"].pop("swiglu"))
    with pytest.raises(ProfileError) as e:
        load_profile(path)
    msg = str(e.value)
    assert str(path) in msg and "regions.swiglu" in msg and "missing region" in msg and "unavailable" in msg


def test_missing_site_is_refused(profile_file, tmp_path):
    path = _mutate(profile_file, tmp_path, lambda d: d["regions"]["add_rmsnorm"]["sites"].pop("residual_out"))
    with pytest.raises(ProfileError, match="regions.add_rmsnorm.sites.residual_out: missing site"):
        load_profile(path)


def test_measured_region_without_sites_and_unavailable_without_reason_are_refused(profile_file, tmp_path):
    path = _mutate(profile_file, tmp_path, lambda d: d["regions"]["rope"].__setitem__("sites", None))
    with pytest.raises(ProfileError, match="regions.rope: .*needs its sites"):
        load_profile(path)
    path = _mutate(profile_file, tmp_path, lambda d: d["regions"]["rope"]["evidence"].__setitem__("status", "unavailable"))
    with pytest.raises(ProfileError, match="needs a reason"):
        load_profile(path)


def test_not_a_mapping_and_unreadable_file_are_refused(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ProfileError, match="mapping"):
        load_profile(path)
    with pytest.raises(ProfileError, match="cannot read"):
        load_profile(tmp_path / "absent.yaml")


def test_write_atomic_leaves_no_partial_file_on_failure(tmp_path, monkeypatch):
    target = tmp_path / "out.yaml"
    target.write_text("old\n")

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(OSError):
        write_atomic(target, "new\n")
    assert target.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["out.yaml"]
