"""An engine and a model family are each added in one place (docs/ARCHITECTURE.md's recipes): a dummy
engine through its record (engineprofiles.engines) and its adapter, a dummy family through its record
(engineprofiles.families), and every layer sees them: the CLI's checks and commands, the probe, profile
selection, the tiny models and the trainer's patch."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from engineprofiles import engines, families
from engineprofiles.errors import ArgumentError

from . import toy_engine

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def toy():
    record = toy_engine.register()
    yield record
    engines.unregister(record.name)


def test_a_registered_engine_is_checked_probed_and_chosen_through_its_record(toy, tmp_path, monkeypatch):
    import torch

    from engineprofiles.names import check_mode_name, execution_mode, op_level_name
    from engineprofiles.probe.adapters import make_adapter
    from engineprofiles.probe.harness import run_probe
    from engineprofiles.store import choose

    assert check_mode_name("toy", "fused") == "fused"
    with pytest.raises(ArgumentError, match="toy mode must be one of default, fused"):
        check_mode_name("toy", "eager")
    assert execution_mode("toy") == "toy-fused"
    assert op_level_name("toy", "1.0") == "toy-1.0-cpu-toy-fused-bfloat16"
    adapter = make_adapter("toy", "default", torch.bfloat16, "cpu")
    assert isinstance(adapter, toy_engine.ToyAdapter)
    profile, _ = run_probe(adapter, regions=["swiglu"], quick=True)
    assert profile.engine.name == "toy" and profile.engine.execution_mode == "toy-fused"
    assert profile.point("swiglu") == toy_engine.POINTS["swiglu"]  # the probe found the toy's SwiGLU
    (tmp_path / f"{profile.canonical_name}.yaml").write_text(profile.to_yaml())
    monkeypatch.setenv("ENGINEPROFILES_DIR", str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no toy installed here: a version warning
        chosen, sel = choose("toy")
    assert chosen.canonical_name == profile.canonical_name and "the engine's default: fused" in " ".join(sel.reasons)
    engines.unregister("toy")
    with pytest.raises(ArgumentError, match="unknown engine 'toy'"):
        check_mode_name("toy", "fused")


def test_a_registered_engine_is_a_probe_engine_command(tmp_path):
    code = ("import sys; from tests.engineprofiles import toy_engine; toy_engine.register(); "
            "from engineloop.cli import main; sys.argv[0] = 'probe-engine'; main()")
    helped = subprocess.run([sys.executable, "-c", code, "toy", "--help"], cwd=REPO, capture_output=True, text=True,
                            env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"}, timeout=120)
    assert helped.returncode == 0 and "Probe the toy engine" in helped.stdout and "default, fused" in helped.stdout, \
        helped.stdout + helped.stderr
    r = subprocess.run([sys.executable, "-c", code, "toy", "--region", "swiglu", "--quick", "-o", str(tmp_path)],
                       cwd=REPO, capture_output=True, text=True, env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"},
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    from engineprofiles.schema import load_profile

    (written,) = tmp_path.glob("*.yaml")
    assert written.name == "toy-1.0-cpu-toy-fused-bfloat16.yaml"
    assert load_profile(written).point("swiglu") == toy_engine.POINTS["swiglu"]
    bare = subprocess.run([sys.executable, "-m", "engineloop.cli", "toy", "--help"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert bare.returncode != 0  # not registered: no such command


@pytest.fixture
def family_table():
    """The family table as found, order included (other tests print it: docs/bad-input.md lists the families in
    registration order), put back after the test."""
    saved = dict(families.FAMILIES)
    yield families.FAMILIES
    families.FAMILIES.clear()
    families.FAMILIES.update(saved)


def test_a_registered_family_is_built_checked_and_patched_through_its_record(family_table):
    import torch

    from emulator import apply_profile
    from engineprofiles.models import tiny_model
    from engineprofiles.names import check_family_name

    qwen2 = families.FAMILIES["qwen2"]
    # The dummy family: Qwen2's modules under another name, with its own RoPE base and depth (Qwen2 is
    # taken out meanwhile, so that the dummy is the one family whose classes the model has).
    dummy = families.Family("dummy", "a test's dummy", qwen2.module, qwen2.prefix, qk_norm=False, config=qwen2.config,
                            rope_theta=10000.0, tiny_fields=dict(num_hidden_layers=1))
    del family_table["qwen2"]
    families.register(dummy)
    assert check_family_name("dummy") == "dummy"
    with pytest.raises(ArgumentError, match="unknown model family 'qwen2'"):
        check_family_name("qwen2")
    model = tiny_model("dummy", seed=0)
    assert model.config.num_hidden_layers == 1 and model.config.rope_parameters["rope_theta"] == 10000.0
    ids = torch.arange(12).view(1, 12)
    with torch.no_grad():
        before = model(ids).logits
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            handle = apply_profile(model, "vllm")
        after = model(ids).logits
    assert handle.family.name == "dummy"
    assert not torch.equal(before, after)  # patched: the engine's rounding, not HF's
    handle.remove()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)


def test_the_scripts_read_the_engine_records(capsys):
    """scripts/probe.sh takes an engine's default version (and whether it has an environment) from its record,
    through ``python3 -S -m engineprofiles.engines`` (the standard library only: no venv needed yet)."""
    repo = Path(__file__).resolve().parents[2]
    for name, rec in engines.ENGINES.items():
        out = subprocess.run(["python3", "-S", "-m", "engineprofiles.engines", name], cwd=repo, capture_output=True,
                             text=True, check=True).stdout
        assert out == (rec.default_version or "") + "\n"
    r = subprocess.run([str(repo / "scripts/probe.sh"), "nosuchengine"], capture_output=True, text=True)
    assert r.returncode == 2 and "unknown engine 'nosuchengine'; engines: vllm, sglang" in r.stderr
