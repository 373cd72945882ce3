"""probe-engine show --json, show piped at full width, and probe-engine plot MISMATCH.json -o FILE.png
(issue 16, part 5)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from engineloop.cli import app
from engineprofiles.store import get_profile, shipped_dir

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[2]
SAVED = sorted((ROOT / "docs" / "data").glob("mismatch-*.json"))
INSITU = "vllm-0.32.0-cpu-inductor-bfloat16-insitu"


def _refused(r, *words):
    assert r.exit_code == 2, (r.output, r.exception)
    assert isinstance(r.exception, SystemExit), r.exception
    assert "error:" in r.output and "Traceback" not in r.output
    said = " ".join(r.output.split()).replace("/ ", "/")  # the error line wraps at the terminal's width
    for w in words:
        assert w in said or w in r.output.replace("\n", ""), (w, r.output)


# -- show --------------------------------------------------------------------------------------------


def test_show_json_is_the_profile_as_loaded():
    r = runner.invoke(app, ["show", INSITU, "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    path = shipped_dir() / f"{INSITU}.yaml"
    assert d["name"] == INSITU and d["requested"] == INSITU and Path(d["path"]) == path
    # The profile as loaded: the file's content in the current schema (an older file is migrated on load).
    prof = get_profile(path)
    assert d["profile"] == yaml.safe_load(prof.to_yaml())
    assert d["profile"]["schema_version"] == prof.schema_version
    on_disk = yaml.safe_load(path.read_text())
    assert d["profile"]["engine"] == on_disk["engine"] and d["profile"]["dtype"] == on_disk["dtype"]
    for region, entry in on_disk["regions"].items():
        assert d["profile"]["regions"][region]["sites"] == entry["sites"], region


def test_show_json_of_an_engine_name_says_which_profile_was_chosen():
    r = runner.invoke(app, ["show", "vllm:eager", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["requested"] == "vllm:eager" and d["path"] is None
    assert d["profile"] == yaml.safe_load(get_profile(d["name"]).to_yaml())
    assert d["profile"]["engine"]["execution_mode"] == "eager"


def test_show_json_of_what_is_no_profile_is_an_error_line(tmp_path):
    bad = tmp_path / "p.yaml"
    bad.write_text("not: a profile\n")
    _refused(runner.invoke(app, ["show", str(bad), "--json"]), str(bad))


def test_show_piped_cuts_no_name_and_folds_no_site(tmp_path):
    long = tmp_path / ("a-profile-whose-file-name-is-longer-than-any-terminal-line-" * 3 + ".yaml")
    long.write_text((shipped_dir() / f"{INSITU}.yaml").read_text())
    r = runner.invoke(app, ["show", str(long)])  # CliRunner's output is not a terminal
    assert r.exit_code == 0, r.output
    assert str(long) in r.output.splitlines()[0]
    runner_up = get_profile(INSITU).entry("rope").evidence.runner_up
    assert runner_up and runner_up in r.output, "a runner-up point folded across lines when piped"


# -- plot --------------------------------------------------------------------------------------------


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", data[16:24])


@pytest.mark.parametrize("saved", [SAVED[0], SAVED[-1]], ids=lambda p: p.stem)
def test_plot_redraws_a_saved_mismatch_result(saved, tmp_path):
    assert len(SAVED) >= 2, "docs/data holds the saved mismatch results"
    out = tmp_path / "m.png"
    r = runner.invoke(app, ["plot", str(saved), "-o", str(out)])
    assert r.exit_code == 0, r.output
    w, h = _png_size(out)
    assert w >= 1200 and h >= 500, (w, h)


def test_plot_draws_sampled_and_prefill_exact_match_and_k3(monkeypatch, tmp_path):
    # What is drawn, read back from the figure before it is saved.
    import matplotlib.figure

    from engineloop import tables

    seen = {}

    def savefig(fig, buf, **kw):
        seen["axes"] = [(ax.get_title(loc="left"), ax.get_xlabel(), ax.get_xscale(),
                         [t.get_text() for t in ax.get_yticklabels()], [t.get_text() for t in ax.texts])
                        for ax in fig.axes]
        buf.write(b"png")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    saved = next(p for p in SAVED if p.stem == "mismatch-vllm-0.32.0-qwen2")
    rep = tables.load_mismatch(str(saved))
    tables.mismatch_plot(rep, str(tmp_path / "m.png"))
    axes = seen["axes"]
    assert len(axes) == 4
    data = json.loads(saved.read_text())
    for row, key in enumerate(("sampled", "prefill")):
        exact, kl = axes[2 * row], axes[2 * row + 1]
        names = [r["trainer"] for r in data[key]]
        assert key.replace("sampled", "sampled tokens").replace("prefill", "re-scored in one prefill") in exact[0]
        assert f"{data[key][0]['tokens']} tokens" in exact[0]
        assert "exact match" in exact[1] and exact[2] == "linear" and exact[3] == names[::-1]
        assert "k3 KL" in kl[1] and kl[2] == "log"
        for r, label in zip(data[key][::-1], kl[4]):
            assert label == (f"{r['k3_kl']:.1e}" if r["k3_kl"] > 0 else "0 (bit-exact)")
        assert [tables.pct(r["exact_match"]) for r in data[key][::-1]] == exact[4]


def test_plot_refuses_what_is_not_a_mismatch_result(tmp_path):
    good = json.loads(SAVED[0].read_text())
    cases = {
        "absent.json": None,
        "text.json": b"not json",
        "binary.json": b"\x89PNG\r\n\x1a\n\x00\xff",
        "list.json": json.dumps([1, 2]).encode(),
        "no-prefill.json": json.dumps({k: v for k, v in good.items() if k != "prefill"}).encode(),
        "bad-row.json": json.dumps({**good, "sampled": [{"trainer": "x", "tokens": 3}]}).encode(),
        "bad-number.json": json.dumps({**good, "sampled": [{**good["sampled"][0], "k3_kl": "high"}]}).encode(),
        "no-engine.json": json.dumps({k: v for k, v in good.items() if k != "engine"}).encode(),
    }
    words = {"absent.json": "no such file", "text.json": "invalid JSON", "binary.json": "not UTF-8",
             "list.json": "JSON object", "no-prefill.json": "'prefill'", "bad-row.json": "missing",
             "bad-number.json": "k3_kl", "no-engine.json": "'engine'"}
    for name, content in cases.items():
        f = tmp_path / name
        if content is not None:
            f.write_bytes(content)
        out = tmp_path / f"{name}.png"
        _refused(runner.invoke(app, ["plot", str(f), "-o", str(out)]), name, words[name])
        assert not out.exists()


def test_plot_without_matplotlib_names_the_extra_before_reading_anything(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # find_spec finds nothing, as in a base install
    out = tmp_path / "m.png"
    _refused(runner.invoke(app, ["plot", str(tmp_path / "absent.json"), "-o", str(out)]),
             "matplotlib", "engineprofiles[plot]")
    assert not out.exists()


def test_plot_output_is_checked_like_every_output(tmp_path):
    afile = tmp_path / "file"
    afile.write_text("x")
    _refused(runner.invoke(app, ["plot", str(SAVED[0]), "-o", str(afile / "m.png")]), "cannot write")
    r = runner.invoke(app, ["plot", str(SAVED[0])])  # -o is required: typer's usage error
    assert r.exit_code == 2 and "Missing option" in r.output and "--output" in r.output
