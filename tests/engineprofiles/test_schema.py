import os
from pathlib import Path

import pytest
import yaml

from engineprofiles.errors import OutputNotWritable, ProfileError
from engineprofiles.regions import REGIONS
from engineprofiles.schema import load_profile, profile_from_yaml, write_atomic

from ..conftest import assert_as_the_tool_wrote_it, synthetic_profile


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
    from engineprofiles.schema import SCHEMA_VERSION

    path = _mutate(profile_file, tmp_path, lambda d: d.__setitem__("schema_version", SCHEMA_VERSION + 1))
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


# -- hostile input (issue 17) ------------------------------------------------------------------

SHIPPED = sorted((Path(__file__).resolve().parents[2] / "profiles").glob("*.yaml"))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_every_shipped_profile_passes_the_constraints_and_round_trips_to_the_same_bytes(path):
    """A shipped file loads, and holds what the tool writes for it (tests/conftest.py says how a file
    of an older schema version may differ)."""
    p = load_profile(path)
    assert p.canonical_name == path.stem
    assert_as_the_tool_wrote_it(path, p)


def test_there_are_shipped_profiles_to_check():
    assert len(SHIPPED) >= 5


@pytest.mark.parametrize("content", [b"\xff\xfe\x00binary\x00\x80", "engine: caf\xe9\n".encode("latin-1")],
                         ids=["binary", "latin-1"])
def test_a_binary_or_non_utf8_file_is_a_profile_error_naming_the_file(tmp_path, content):
    path = tmp_path / "bin.yaml"
    path.write_bytes(content)
    with pytest.raises(ProfileError) as e:
        load_profile(path)
    msg = str(e.value)
    assert str(path) in msg and "UTF-8" in msg


def test_control_characters_are_a_profile_error(tmp_path):
    path = tmp_path / "ctl.yaml"
    path.write_bytes(b"schema_version: 1\nengine: \x07\x01\n")
    with pytest.raises(ProfileError, match=str(path)):
        load_profile(path)


def _alias_bomb(depth: int, width: int = 9) -> str:
    """A small YAML whose engine.device expands to width**depth strings."""
    lines = ['a0: &a0 ["' + "x" * 40 + '"]']
    for i in range(1, depth + 1):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("depth", [6, 12])
def test_an_alias_bomb_in_a_string_field_is_refused_quickly_with_a_short_message(profile_file, depth):
    import time

    text = profile_file.read_text()
    bomb = _alias_bomb(depth)
    text = bomb + text.replace("  device: test-cpu", f"  device: *a{depth}")
    t0 = time.perf_counter()
    with pytest.raises(ProfileError) as e:
        profile_from_yaml(text, "bomb.yaml")
    assert time.perf_counter() - t0 < 2.0
    msg = str(e.value)
    assert len(msg) < 1000 and "bomb.yaml" in msg and "alias" in msg


def test_a_few_aliases_are_still_read(profile_file):
    # YAML anchors are legal; only expansion beyond a small limit is refused.
    text = profile_file.read_text().replace("  device: test-cpu", "  device: &d test-cpu", 1)
    text = text.replace("  torch_version: 2.13.0", "  torch_version: 2.13.0", 1)
    p = profile_from_yaml(text)
    assert p.engine.device == "test-cpu"


def test_deep_nesting_is_a_profile_error(tmp_path):
    with pytest.raises(ProfileError, match="deep"):
        profile_from_yaml("engine: " + "[" * 5000 + "]" * 5000 + "\n", "deep.yaml")


def test_an_error_echoes_a_bounded_amount_of_the_bad_value(profile_file, tmp_path):
    path = _mutate(profile_file, tmp_path, lambda d: d["engine"].__setitem__("device", ["y" * 10_000] * 20))
    with pytest.raises(ProfileError) as e:
        load_profile(path)
    assert "engine.device" in str(e.value) and len(str(e.value)) < 1000
    path = _mutate(profile_file, tmp_path, lambda d: d.__setitem__("schema_version", "z" * 10_000))
    with pytest.raises(ProfileError) as e:
        load_profile(path)
    assert "schema_version" in str(e.value) and len(str(e.value)) < 1000


def test_a_duplicate_key_is_refused_naming_the_key_and_both_lines(profile_file, tmp_path):
    text = profile_file.read_text()
    first = text.splitlines().index("dtype: bfloat16") + 1
    path = tmp_path / "dup.yaml"
    path.write_text(text + "dtype: float16\n")
    last = len(path.read_text().splitlines())
    with pytest.raises(ProfileError) as e:
        load_profile(path)
    msg = str(e.value)
    assert str(path) in msg and "duplicate key 'dtype'" in msg and f"line {first}" in msg and f"line {last}" in msg


def test_a_duplicate_key_in_a_nested_mapping_is_refused(profile_file, tmp_path):
    text = profile_file.read_text().replace("  device: test-cpu\n", "  device: test-cpu\n  device: other\n", 1)
    with pytest.raises(ProfileError, match="duplicate key 'device'"):
        profile_from_yaml(text)


@pytest.mark.parametrize(
    "where, value",
    [
        (("regions", "rope", "evidence", "match_rate"), 7.5),
        (("regions", "rope", "evidence", "match_rate"), -1.0),
        (("regions", "rope", "evidence", "match_rate"), float("nan")),
        (("regions", "rope", "evidence", "runner_up_match_rate"), 1.5),
        (("regions", "rope", "evidence", "max_ulp"), -3),
        (("regions", "rope", "evidence", "elements"), -1),
        (("provenance", "date"), "not a date"),
        (("provenance", "date"), "2026-13-45T00:00:00Z"),
        (("provenance", "duration_s"), -2.0),
        (("engine", "name"), "../../etc/evil"),
        (("engine", "name"), ""),
        (("engine", "name"), ".hidden"),
        (("engine", "version"), "1/../../x"),
        (("engine", "execution_mode"), "eager/../../x"),
    ],
)
def test_out_of_range_or_unsafe_values_are_refused_naming_the_field(profile_file, tmp_path, where, value):
    def set_(d):
        for k in where[:-1]:
            d = d[k]
        d[where[-1]] = value

    path = _mutate(profile_file, tmp_path, set_)
    with pytest.raises(ProfileError, match=".".join(where)):
        load_profile(path)


def test_a_per_shape_match_rate_out_of_range_is_refused(profile_file, tmp_path):
    path = _mutate(profile_file, tmp_path, lambda d: d["regions"]["rope"]["evidence"].__setitem__(
        "per_shape", [{"shape": "s", "winner": "w", "match_rate": 2.0}]))
    with pytest.raises(ProfileError, match="per_shape"):
        load_profile(path)


# -- writing --------------------------------------------------------------------------------------


def test_write_atomic_refuses_a_fifo_and_leaves_it_a_fifo(tmp_path):
    import stat

    fifo = tmp_path / "f"
    os.mkfifo(fifo)
    with pytest.raises(OutputNotWritable, match="not a regular file"):
        write_atomic(fifo, "x\n")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]


@pytest.mark.parametrize("dev", ["/dev/null", "/dev/full"])
def test_write_atomic_refuses_a_device_and_leaves_it_a_device(dev):
    import stat

    if not os.path.exists(dev):
        pytest.fail(f"{dev} is missing on this machine")
    before = os.lstat(dev)
    with pytest.raises(OutputNotWritable, match="not a regular file"):
        write_atomic(Path(dev), "x\n")
    after = os.lstat(dev)
    assert stat.S_ISCHR(after.st_mode) and after.st_rdev == before.st_rdev and after.st_mode == before.st_mode


def test_write_atomic_refuses_a_folder(tmp_path):
    (tmp_path / "d").mkdir()
    with pytest.raises(OutputNotWritable):
        write_atomic(tmp_path / "d", "x\n")
    assert (tmp_path / "d").is_dir()


def test_write_atomic_writes_through_a_symlink_and_keeps_it(tmp_path):
    real = tmp_path / "real.yaml"
    real.write_text("old\n")
    link = tmp_path / "link.yaml"
    link.symlink_to(real)
    write_atomic(link, "new\n")
    assert link.is_symlink() and real.read_text() == "new\n"


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604])
def test_write_atomic_keeps_the_mode_of_the_file_it_replaces(tmp_path, mode):
    target = tmp_path / "out.yaml"
    target.write_text("old\n")
    os.chmod(target, mode)
    write_atomic(target, "new\n")
    assert target.read_text() == "new\n"
    assert os.stat(target).st_mode & 0o7777 == mode


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_write_atomic_honours_the_umask_for_a_new_file(tmp_path, umask):
    old = os.umask(umask)
    try:
        write_atomic(tmp_path / "new.yaml", "x\n")
    finally:
        os.umask(old)
    assert os.stat(tmp_path / "new.yaml").st_mode & 0o777 == 0o666 & ~umask


def _writer_blocked_in_the_write(tmp_path, disposition: str, sleep_s: float):
    """A child process stopped inside write_atomic (in fsync, with the temporary file written),
    with SIGTERM/SIGHUP set to ``disposition`` ("default" or "ignore") as a shell would leave them."""
    import subprocess
    import sys
    import time

    target = tmp_path / "out.yaml"
    target.write_text("old\n")
    ready = tmp_path / "ready"
    code = f"""
import os, signal, time
from pathlib import Path
import engineprofiles.schema as s
for sig in (signal.SIGTERM, signal.SIGHUP):  # as the shell left them, whatever this test runs under (nohup)
    signal.signal(sig, signal.SIG_DFL if {disposition!r} == "default" else signal.SIG_IGN)
def slow(fd):
    Path({str(ready)!r}).write_text("1")
    time.sleep({sleep_s})
os.fsync = slow
s.write_atomic(Path({str(target)!r}), "new\\n")
"""
    proc = subprocess.Popen([sys.executable, "-c", code])
    t0 = time.time()
    while not ready.exists() and time.time() - t0 < 60 and proc.poll() is None:
        time.sleep(0.05)
    assert ready.exists(), "the writer never reached the write"
    return proc, target


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
def test_a_signal_during_the_write_leaves_no_temporary_file(tmp_path, sig):
    import signal

    proc, target = _writer_blocked_in_the_write(tmp_path, "default", 30)
    proc.send_signal(getattr(signal, sig))
    rc = proc.wait(timeout=30)
    assert rc == -getattr(signal, sig)  # it still ends by the signal
    assert target.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.yaml", "ready"]


def test_an_ignored_sighup_during_the_write_stays_ignored(tmp_path):
    import signal

    proc, target = _writer_blocked_in_the_write(tmp_path, "ignore", 1)
    proc.send_signal(signal.SIGHUP)
    assert proc.wait(timeout=30) == 0
    assert target.read_text() == "new\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.yaml", "ready"]


def test_canonical_name_carries_the_cpu_capability_except_avx512():
    """One engine version ships a profile per CPU capability where they differ; AVX512's names (the
    first probed) carry none, nor do profiles without a recorded capability or of another backend."""
    assert synthetic_profile().canonical_name == "synthetic-0.0-cpu-eager-bfloat16"
    assert synthetic_profile(settings={"cpu_capability": "AVX512"}).canonical_name == "synthetic-0.0-cpu-eager-bfloat16"
    assert synthetic_profile(settings={"cpu_capability": "AVX2"}).canonical_name == "synthetic-0.0-cpu-eager-bfloat16-avx2"
    assert synthetic_profile(backend="cuda", settings={"cpu_capability": "AVX2"}).canonical_name == \
        "synthetic-0.0-cuda-eager-bfloat16"
    insitu = synthetic_profile(settings={"cpu_capability": "AVX2"})
    insitu = insitu.model_copy(update={"provenance": insitu.provenance.model_copy(update={"method": "in-situ"})})
    assert insitu.canonical_name == "synthetic-0.0-cpu-eager-bfloat16-insitu-avx2"


def test_evidence_scope_says_what_the_rates_count_and_version_2_in_situ_files_migrate_to_whole_model():
    """Schema 3: ``scope`` is ``region`` (the region's own outputs) or ``whole-model`` (an in-situ fit's
    figures, the same for every region). A version 2 file has none: an in-situ one loads as
    whole-model (what its figures were), any other as region; a version 2 file that has one is
    refused (it came with 3)."""
    from engineprofiles.store import get_profile

    op = get_profile("vllm-0.32.0-cpu-inductor-bfloat16")
    insitu = get_profile("vllm-0.32.0-cpu-inductor-bfloat16-insitu")
    assert {op.entry(n).evidence.scope for n in REGIONS} == {"region"}
    assert {insitu.entry(n).evidence.scope for n in REGIONS} == {"whole-model"}
    assert insitu.attention.evidence.scope == "region"  # attention's fit is per attention call
    for prof, want in ((op, "region"), (insitu, "whole-model")):
        data = yaml.safe_load(prof.to_yaml())
        data["schema_version"] = 2
        data.pop("moe")  # came with version 4
        data.pop("shared_expert")  # came with version 5
        for n in REGIONS:
            data["regions"][n]["evidence"].pop("scope", None)
        back = profile_from_yaml(yaml.safe_dump(data), "v2.yaml")
        assert back.schema_version == 5 and {back.entry(n).evidence.scope for n in REGIONS} == {want}
        assert ("whole-model" in back.to_yaml()) == (want == "whole-model")
    data = yaml.safe_load(insitu.to_yaml())
    data["schema_version"] = 2
    data.pop("moe")
    data.pop("shared_expert")
    with pytest.raises(ProfileError, match="scope") as e:
        profile_from_yaml(yaml.safe_dump(data), "v2-with-scope.yaml")
    assert "v2-with-scope.yaml" in str(e.value)


def test_an_unknown_scope_is_refused(profile_file, tmp_path):
    path = _mutate(profile_file, tmp_path, lambda d: d["regions"]["rope"]["evidence"].__setitem__("scope", "layer"))
    with pytest.raises(ProfileError) as e:
        load_profile(path)
    assert "scope" in str(e.value)


def test_version_3_files_migrate_with_the_moe_experts_not_probed_and_a_version_3_file_with_moe_is_refused():
    """Schema 4 adds the ``moe`` entry (a sparse MoE block's experts). A version 3 file loads with it
    recorded as not probed; one that has the entry is refused (it came with 4); a version 4 file
    without it is refused naming the entry."""
    from engineprofiles.store import get_profile

    prof = get_profile("vllm-0.32.0-cpu-inductor-bfloat16")
    data = yaml.safe_load(prof.to_yaml())
    data["schema_version"] = 3
    data.pop("moe")
    data.pop("shared_expert")
    back = profile_from_yaml(yaml.safe_dump(data), "v3.yaml")
    assert back.schema_version == 5 and not back.available("moe") and not back.available("shared_expert")
    assert "schema version 3" in back.moe.evidence.reason
    with pytest.raises(ProfileError, match="not measured"):
        back.point("moe")
    data["schema_version"] = 3
    data["moe"] = yaml.safe_load(prof.to_yaml())["moe"]
    with pytest.raises(ProfileError, match="came with version 4") as e:
        profile_from_yaml(yaml.safe_dump(data), "v3-with-moe.yaml")
    assert "v3-with-moe.yaml" in str(e.value)
    data["schema_version"] = 4
    data.pop("moe")
    with pytest.raises(ProfileError, match="missing moe entry"):
        profile_from_yaml(yaml.safe_dump(data), "v4-without-moe.yaml")


def test_version_4_files_migrate_with_the_shared_expert_not_probed_and_a_version_4_file_with_it_is_refused():
    """Schema 5 adds the ``shared_expert`` entry (a sparse MoE block's shared expert). A version 4
    file loads with it recorded as not probed, its moe entry kept; one that has the entry is refused
    (it came with 5); a version 5 file without it is refused naming the entry."""
    from engineprofiles.store import get_profile

    prof = get_profile("vllm-0.32.0-cpu-inductor-bfloat16")
    data = yaml.safe_load(prof.to_yaml())
    shared = data.pop("shared_expert")
    data["schema_version"] = 4
    back = profile_from_yaml(yaml.safe_dump(data), "v4.yaml")
    assert back.schema_version == 5 and not back.available("shared_expert")
    assert "schema version 4" in back.shared_expert.evidence.reason
    assert back.available("moe") == prof.available("moe") and back.moe == prof.moe
    with pytest.raises(ProfileError, match="not measured"):
        back.point("shared_expert")
    data["shared_expert"] = shared
    with pytest.raises(ProfileError, match="came with version 5") as e:
        profile_from_yaml(yaml.safe_dump(data), "v4-with-shared.yaml")
    assert "v4-with-shared.yaml" in str(e.value)
    data["schema_version"] = 5
    data.pop("shared_expert")
    with pytest.raises(ProfileError, match="missing shared_expert entry"):
        profile_from_yaml(yaml.safe_dump(data), "v5-without-shared.yaml")


_LATE_SITE = """
import dataclasses, sys
from engineprofiles import regions
from engineprofiles.regions.base import site
spec = regions.REGIONS["swiglu"]
late = site("late_test", "a site added after profiles were shipped", default={default!r})
regions.REGIONS["swiglu"] = dataclasses.replace(spec, sites=spec.sites + (late,))
from engineprofiles.errors import ProfileError
from engineprofiles.schema import SCHEMA_VERSION, load_profile, with_points
from engineprofiles.store import shipped_dir
import yaml
for path in sorted(shipped_dir().glob("*.yaml")):
    try:
        p = load_profile(path)
    except ProfileError as e:
        print("REFUSED", path.name, e)
        continue
    text = path.read_text()
    if p.available("swiglu"):
        assert p.point("swiglu")["late_test"] == {default!r}, path
    if yaml.safe_load(text)["schema_version"] == SCHEMA_VERSION:
        assert p.to_yaml() == text, path  # the same bytes: the late site at its default is not written
    if p.available("swiglu"):  # a profile that holds another option writes it
        other = with_points(p, {{"swiglu": p.point("swiglu").replace(late_test="fp32")}})
        assert "late_test: fp32" in other.to_yaml()
    print("LOADED", path.name)
"""


def test_a_site_added_with_a_default_loads_every_shipped_profile_and_keeps_their_bytes():
    """Adding a site to a region (docs/ARCHITECTURE.md's recipe) with the meaning older profiles have
    (``site(..., default=...)``) breaks no shipped profile: each loads with the site at its default and
    is written to the same bytes; without a default every one that measured the region is refused."""
    import subprocess
    import sys

    from engineprofiles.store import shipped_dir

    n = len(list(shipped_dir().glob("*.yaml")))
    r = subprocess.run([sys.executable, "-c", _LATE_SITE.format(default="rounded")], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("LOADED") == n and "REFUSED" not in r.stdout, r.stdout
    # the control: the same site without a default (a required field) refuses the shipped profiles
    required = _LATE_SITE.format(default="rounded").replace(', default="rounded")', ")").replace(
        ", default='rounded')", ")")
    r = subprocess.run([sys.executable, "-c", required], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "late_test" in r.stdout and r.stdout.count("REFUSED") >= n - 1, r.stdout
