import os
import stat

import pytest
from typer.testing import CliRunner

from engineloop.cli import app
from engineprofiles.regions import REGIONS
from engineprofiles.schema import make_profile
from engineprofiles import store
from engineprofiles.store import ENV_VAR

from .helpers import evil_capture

runner = CliRunner()


@pytest.fixture
def shipped(tmp_path, monkeypatch, profile):
    d = tmp_path / "profiles"
    profile.save(d / f"{profile.canonical_name}.yaml")
    monkeypatch.setenv(ENV_VAR, str(d))
    return d, profile.canonical_name


def test_validate_accepts_a_good_profile_by_path_and_by_shipped_name(shipped):
    d, name = shipped
    r = runner.invoke(app, ["validate", str(d / f"{name}.yaml"), name])
    assert r.exit_code == 0, r.output
    assert r.output.count("ok") == 2


def test_validate_fails_with_the_reason_for_a_bad_profile(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("schema_version: 9\n")
    r = runner.invoke(app, ["validate", str(bad)])
    assert r.exit_code == 1
    assert "schema_version" in r.output and str(bad) in r.output


def test_show_prints_every_region_site_and_evidence(shipped):
    d, name = shipped
    r = runner.invoke(app, ["show", name], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    for word in ("rope", "cos_sin", "swiglu", "silu", "add_rmsnorm", "residual_out", "rmsnorm", "evidence", "100%"):
        assert word in r.output


def test_show_unknown_profile_lists_shipped_names_and_exits_2(shipped):
    d, name = shipped
    r = runner.invoke(app, ["show", "no-such-profile"])
    assert r.exit_code == 2
    assert "no-such-profile" in r.output and name in r.output


def test_list_shows_engine_version_backend_dtype(shipped):
    d, name = shipped
    r = runner.invoke(app, ["list"], env={"COLUMNS": "250"})
    assert r.exit_code == 0, r.output
    for word in ("synthetic", "0.0", "cpu", "eager", "bfloat16"):
        assert word in r.output


def test_list_says_when_nothing_is_shipped(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_VAR, str(tmp_path))
    r = runner.invoke(app, ["list"])
    assert r.exit_code == 0 and "no shipped profiles" in r.output


def test_list_shows_capability_and_method_and_never_cuts_a_name_when_piped(shipped, tmp_path):
    d, name = shipped
    long_name = "vllm-0.32.0rc1-cpu-inductor-bfloat16-insitu-a-name-longer-than-the-terminal-is-wide"
    (d / f"{long_name}.yaml").write_bytes((d / f"{name}.yaml").read_bytes())
    for columns in ("40", "80", "250"):
        r = runner.invoke(app, ["list"], env={"COLUMNS": columns})  # CliRunner's stdout is no terminal: piped
        assert r.exit_code == 0, r.output
        lines = r.output.splitlines()
        for n in (name, long_name):
            assert any(n in line for line in lines), (columns, n, r.output)
        header = next(line for line in lines if "name" in line and "engine" in line)
        for col in ("capability", "method", "mode", "dtype"):
            assert col in header, (columns, header)
        row = next(line for line in lines if name in line)
        assert "synthetic" in row.split(name, 1)[1] and "-" in row  # the method; no capability recorded: -


def test_list_json_is_a_list_json_load_accepts(shipped):
    import json

    from engineprofiles.schema import SCHEMA_VERSION

    d, name = shipped
    (d / "zz-broken.yaml").write_text("schema_version: 9\n")
    r = runner.invoke(app, ["list", "--json"], env={"COLUMNS": "40"})
    assert r.exit_code == 0, r.output
    rows = json.loads(r.output)
    assert [x["name"] for x in rows] == [name, "zz-broken"]
    good, bad = rows
    assert {k: good[k] for k in ("engine", "version", "mode", "dtype", "device", "capability", "method", "schema")} == {
        "engine": "synthetic", "version": "0.0", "mode": "eager", "dtype": "bfloat16", "device": "cpu",
        "capability": None, "method": "synthetic", "schema": SCHEMA_VERSION}
    assert good["path"] == str(d / f"{name}.yaml")
    assert "schema_version" in bad["error"] and bad["path"] == str(d / "zz-broken.yaml")


def test_list_json_of_the_shipped_profiles_names_each_ones_capability(monkeypatch):
    import json

    monkeypatch.delenv(ENV_VAR, raising=False)
    r = runner.invoke(app, ["list", "--json"])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.output)
    assert rows and all("error" not in x and x["capability"] and x["method"] in ("op-level", "in-situ") for x in rows)
    assert any(x["name"].endswith("-insitu") and x["method"] == "in-situ" for x in rows)


def test_list_json_of_an_empty_folder_is_an_empty_list(tmp_path, monkeypatch):
    import json

    monkeypatch.setenv(ENV_VAR, str(tmp_path))
    r = runner.invoke(app, ["list", "--json"])
    assert r.exit_code == 0 and json.loads(r.output) == []


def test_show_and_diff_take_an_engine_name(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    r = runner.invoke(app, ["show", "vllm:eager"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert "vllm" in r.output and "eager" in r.output
    r = runner.invoke(app, ["show", "vlm"])
    assert r.exit_code == 2 and "'vlm'" in r.output and "vllm" in r.output


# -- hostile input (issue 17) ----------------------------------------------------------------------

BINARY = b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe binary \x80\x81"


def _markup_profile(tmp_path):
    """A valid profile whose strings are rich markup (and one that would close a tag never opened)."""
    points = {n: s.all_points()[0] for n, s in REGIONS.items()}
    evidence = {n: {"match_rate": 0.5, "runner_up": "[bold]ru[/bold] [/]", "path": "[/bold] path",
                    "notes": ["[red]note[/red] [/]"], "tied_with": ["[/x]"], "ambiguous": True} for n in REGIONS}
    p = make_profile(
        engine=dict(name="markup", version="1.0", backend="cpu", device="[/bold] x", torch_version="[/] t",
                    execution_mode="eager", settings={"[/k]": "[/v]", "k": ["[/a]", "[b]"]}),
        dtype="bfloat16", points=points, evidence=evidence,
        provenance=dict(date="2026-12-02T00:00:00Z", probe_version="[/]", package_version="[/]",
                        method="synthetic", command="[/bold] cmd"),
    )
    path = tmp_path / "[red]markup[/red].yaml"
    p.save(path)
    return path


def test_validate_reports_every_file_and_a_binary_one_clearly(shipped, tmp_path):
    d, name = shipped
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(BINARY)
    r = runner.invoke(app, ["validate", name, str(binary), name])
    assert r.exit_code == 1, r.output
    assert r.output.count("ok") == 2 and "invalid" in r.output and "UTF-8" in r.output
    assert r.exception is None or isinstance(r.exception, SystemExit)


def test_diff_show_and_apply_of_a_binary_file_are_errors_with_exit_2(shipped, tmp_path):
    d, name = shipped
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(BINARY)
    for args in (["diff", name, str(binary)], ["diff", str(binary), name], ["show", str(binary)],
                 ["transformers", "--apply", str(binary), "-o", str(tmp_path / "out")]):
        r = runner.invoke(app, args)
        assert r.exit_code == 2, (args, r.output)
        assert "error:" in r.output and "UTF-8" in r.output, (args, r.output)
        assert isinstance(r.exception, SystemExit), (args, r.exception)


def test_list_marks_a_binary_shipped_file_invalid_and_lists_the_others(shipped):
    d, name = shipped
    (d / "zz-binary.yaml").write_bytes(BINARY)
    r = runner.invoke(app, ["list"], env={"COLUMNS": "250"})
    assert r.exit_code == 0, r.output
    assert "zz-binary" in r.output and "invalid" in r.output and "synthetic" in r.output


def test_validate_refuses_a_profile_with_a_duplicate_key(shipped, tmp_path):
    d, name = shipped
    dup = tmp_path / "dup.yaml"
    dup.write_text((d / f"{name}.yaml").read_text() + "dtype: float16\n")
    r = runner.invoke(app, ["validate", str(dup)])
    assert r.exit_code == 1 and "duplicate key 'dtype'" in r.output, r.output


def test_profile_strings_with_rich_markup_are_printed_literally(shipped, tmp_path):
    d, name = shipped
    path = _markup_profile(tmp_path)
    for args, code in ((["diff", name, str(path)], 1), (["diff", str(path), name, "-f", "markdown"], 1),
                       (["show", str(path)], 0), (["validate", str(path)], 0)):
        r = runner.invoke(app, args, env={"COLUMNS": "250"})
        assert r.exit_code == code, (args, r.output, r.exception)
        assert r.exception is None or isinstance(r.exception, SystemExit), (args, r.exception)
    r = runner.invoke(app, ["show", str(path)], env={"COLUMNS": "250"})
    for literal in ("[/bold] x", "[/] t", "[red]note[/red] [/]", "[/bold] cmd", "[/k]=[/v]"):
        assert literal in r.output, literal
    r = runner.invoke(app, ["diff", name, str(path)], env={"COLUMNS": "250"})
    assert "[/bold] x" in r.output and "[red]markup[/red].yaml" in r.output


def test_list_prints_markup_in_shipped_profiles_literally(shipped, tmp_path):
    d, name = shipped
    path = _markup_profile(tmp_path)
    (d / "markup.yaml").write_bytes(path.read_bytes())
    r = runner.invoke(app, ["list"], env={"COLUMNS": "250"})
    assert r.exit_code == 0, (r.output, r.exception)
    assert "markup" in r.output


def test_an_error_about_a_path_with_markup_is_printed_literally(tmp_path):
    (tmp_path / "[").mkdir()
    bad = tmp_path / "[" / "bold]bad.yaml"  # the path reads .../[/bold]bad.yaml
    bad.write_text("schema_version: 9\n")
    r = runner.invoke(app, ["show", str(bad)])
    assert r.exit_code == 2 and "[/bold]bad.yaml" in r.output, (r.output, r.exception)
    r = runner.invoke(app, ["validate", str(bad)])
    assert r.exit_code == 1 and "[/bold]bad.yaml" in r.output, (r.output, r.exception)


# -- mismatch: everything checked before the engine runs -------------------------------------------


@pytest.fixture
def no_run(monkeypatch):
    called = []
    monkeypatch.setattr("engineloop.mismatch.run_mismatch", lambda *a, **k: called.append(1))
    return called


def _refused(r, *words):
    assert r.exit_code == 2, (r.output, r.exception)
    assert isinstance(r.exception, SystemExit), r.exception
    assert "error:" in r.output
    said = " ".join(r.output.split())  # rich wraps long lines
    for w in words:
        assert w in said, (w, r.output)


def test_mismatch_output_paths_are_checked_before_the_run(tmp_path, no_run):
    fifo = tmp_path / "f"
    os.mkfifo(fifo)
    afile = tmp_path / "file"
    afile.write_text("x")
    for args in (["--json", str(fifo)], ["--plot", str(fifo)], ["--json", str(afile / "m.json")],
                 ["--plot", str(afile / "m.png")], ["--json", "/proc/engineprofiles-m.json"], ["--json", str(tmp_path)]):
        _refused(runner.invoke(app, ["mismatch", *args]), "cannot write")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and not no_run


def test_mismatch_plot_without_matplotlib_fails_before_the_run(tmp_path, no_run, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    _refused(runner.invoke(app, ["mismatch", "--plot", str(tmp_path / "m.png")]), "matplotlib")
    assert not no_run


def test_mismatch_unknown_family_fails_before_the_run(no_run):
    _refused(runner.invoke(app, ["mismatch", "--family", "gpt2"]), "gpt2")
    assert not no_run


def test_mismatch_unknown_rope_scaling_fails_before_the_run(no_run):
    _refused(runner.invoke(app, ["mismatch", "--family", "llama", "--rope-scaling", "ntk"]), "unknown RoPE scaling 'ntk'")
    assert not no_run


@pytest.mark.parametrize("command", [["mismatch"], ["vllm", "--in-situ", "-o", "-"]], ids=["mismatch", "in-situ"])
def test_a_missing_text_or_code_running_capture_is_an_error_line(tmp_path, command):
    text = tmp_path / "cap.txt"
    text.write_text("not a capture\n")
    _refused(runner.invoke(app, [*command, "--capture", str(tmp_path / "absent.pt")]), "does not exist")
    _refused(runner.invoke(app, [*command, "--capture", str(text)]), "not a capture file")
    _refused(runner.invoke(app, [*command, "--capture", str(tmp_path)]), "not a regular file")
    evil, marker = evil_capture(tmp_path)
    _refused(runner.invoke(app, [*command, "--capture", str(evil)]), "weights_only")
    assert not marker.exists()


# -- optional dependencies: a command that needs an extra names it before doing anything ------------


def _without_transformers(monkeypatch):
    from engineprofiles import extras

    # A module that does not exist stands for transformers: find_spec finds nothing, as it would
    # in a base install.
    monkeypatch.setitem(extras.EXTRAS, "insitu", ("no_such_module_engineprofiles_test", "triton"))


def test_mismatch_without_the_insitu_extra_names_it_before_the_run(monkeypatch, no_run):
    _without_transformers(monkeypatch)
    _refused(runner.invoke(app, ["mismatch"]), "no_such_module_engineprofiles_test", "engineprofiles[insitu]")
    assert not no_run


def test_in_situ_without_the_insitu_extra_names_it_before_the_engine_runs(monkeypatch, tmp_path):
    from engineloop import mismatch

    ran = []
    monkeypatch.setattr(mismatch, "run_capture", lambda *a, **k: ran.append(1))
    _without_transformers(monkeypatch)
    _refused(runner.invoke(app, ["vllm", "--in-situ", "-o", str(tmp_path)]), "engineprofiles[insitu]")
    assert not ran


def test_apply_without_the_emulator_extra_is_an_error_line_naming_it(monkeypatch, tmp_path):
    import sys

    from engineprofiles import extras

    # emulator.ops checks Triton when it is first imported: import it afresh, with Triton "missing".
    monkeypatch.setitem(extras.EXTRAS, "emulator", ("no_such_module_engineprofiles_test",))
    for name in [m for m in sys.modules if m == "emulator" or m.startswith("emulator.")]:
        monkeypatch.delitem(sys.modules, name)
    _refused(runner.invoke(app, ["transformers", "--apply", "vllm-0.32.0-cpu-inductor-bfloat16-insitu", "--quick",
                                 "-o", str(tmp_path)]), "engineprofiles[emulator]")


@pytest.mark.parametrize("data", ["batch-vllm-0.32.0-qwen2-long.json", "batch-sglang-0.5.23-qwen2.json"])
def test_a_mismatch_report_fits_an_80_column_terminal_and_is_whole_when_piped(data):
    """In an 80-column terminal the mismatch tables take fewer columns (never every column cut to "…");
    piped, every column at full width."""
    import io
    from pathlib import Path

    from rich.console import Console

    from engineloop import tables
    from engineloop.cli import _print_fitted

    rep = tables.load_mismatch(Path(__file__).resolve().parents[2] / "docs" / "data" / data)
    term = Console(file=io.StringIO(), width=80, force_terminal=True, color_system=None)
    _print_fitted(term, tables.mismatch_table(rep), tables.mismatch_table(rep, narrow=True))
    text = term.file.getvalue()
    table_lines = [ln for ln in text.splitlines() if ln.startswith(("┃", "│"))]
    assert table_lines and all(len(ln) <= 80 for ln in text.splitlines())
    assert not any("…" in ln for ln in table_lines), text
    assert "exact" in text and "|dlogp| max" in text and "every column with --json" in text
    piped = Console(file=io.StringIO(), width=80, force_terminal=False, color_system=None)
    _print_fitted(piped, tables.mismatch_table(rep), tables.mismatch_table(rep, narrow=True))
    text = piped.file.getvalue()
    header = next(ln for ln in text.splitlines() if "trainer" in ln and "PPL ratio" in ln)
    assert "…" not in header and all(c in header for c in tables.COLUMNS)


@pytest.mark.parametrize("family,entry", [("qwen3_moe", "moe"), ("qwen2_moe", "shared_expert")])
def test_mismatch_exact_refuses_a_profile_without_the_moe_blocks_entries_before_the_engine_runs(family, entry,
                                                                                                   tmp_path):
    import yaml

    data = yaml.safe_load(store.resolve("vllm-0.32.0-cpu-inductor-bfloat16").read_text())
    data[entry]["sites"] = None
    data[entry]["evidence"] = {"status": "unavailable", "reason": "not probed (test)"}
    path = tmp_path / "no-entry.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    r = runner.invoke(app, ["mismatch", "vllm", "--family", family, "--exact", "--profile", str(path),
                            "--allow-other-machine", "--env", str(tmp_path / "no-such-env")])
    _refused(r, f"has no measured {entry} entry", "refused before the engine runs")
