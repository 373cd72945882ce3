"""engineloop.mismatch helpers that need no engine run."""

from pathlib import Path

import pytest

from engineprofiles.store import get_profile


def test_engine_kv_split_follows_the_capture_and_the_kernel_build():
    from engineloop.mismatch import engine_kv_split
    from engineprofiles.regions.attention import KVSplit

    att = dict(split_kv=True, torch_threads=4)
    avx512, avx2 = (get_profile(n) for n in ("vllm-0.32.0-cpu-inductor-bfloat16-insitu",
                                              "vllm-0.32.0-cpu-inductor-bfloat16-insitu-avx2"))
    assert engine_kv_split(dict(name="vllm", attention=att), avx512) == KVSplit(threads=4, merge="fma")
    assert engine_kv_split(dict(name="vllm", attention=att), avx2) == KVSplit(threads=4, merge="mul_add")
    for eng in (dict(name="vllm", attention=dict(att, split_kv=False)), dict(name="vllm", attention=dict(att, torch_threads=1)),
                dict(name="sglang", attention=att), dict(name="vllm"), dict(name="vllm", attention=dict(split_kv=True))):
        assert engine_kv_split(eng, avx512) is None, eng


# -- exact mode's machine rule against captures of other machines -------------------------------------

AMX_DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "amx"


def amx_capture(family: str = "qwen2") -> Path:
    f = AMX_DATA / f"amx-vllm-0.32.0-{family}.pt"
    if not f.exists():
        pytest.fail(f"{f} is missing: the AMX captures live in shared/data/amx beside the repository (CI copies "
                    "shared/ there). They are not skipped.", pytrace=False)
    return f


def test_machine_differences_name_what_the_capture_ran_on():
    from engineloop.mismatch import check_machine, machine_differences
    from engineprofiles.errors import EngineProfilesError
    from engineprofiles.machine import this_machine

    here = get_profile("vllm-0.32.0-cpu-inductor-bfloat16-insitu")
    here = here.model_copy(update={"engine": here.engine.model_copy(
        update={"settings": {**here.engine.settings, **this_machine().settings(), "attention_isa": "vec"}})})
    same = dict(machine=this_machine().settings(), attention=dict(isa="vec"))
    assert machine_differences(same, here) == [] and check_machine(same, here, False) == []
    amx = dict(same, attention=dict(isa="amx"))
    assert machine_differences(amx, here) == ["the engine's attention ISA: amx, the profile's vec"]
    old = dict(attention=dict(isa="vec"))  # a capture made before captures recorded the machine
    assert "records no CPU features" in " ".join(machine_differences(old, here))
    with pytest.raises(EngineProfilesError, match="--allow-other-machine"):
        check_machine(amx, here, False)
    (w,) = check_machine(amx, here, True)
    assert "not expected to be bit-exact" in w and "amx" in w


def test_mismatch_exact_refuses_a_capture_of_an_amx_machine_and_says_why(tmp_path):
    # An AMX machine's capture (shared/data/amx): vLLM ran its amx attention there, which no shipped profile
    # records; --exact refuses, naming it, before any trainer row; --allow-other-machine computes the rows
    # with the reason in the report's warnings.
    import json
    import subprocess
    import sys

    cap = amx_capture()
    base = [sys.executable, "-m", "engineloop.cli", "mismatch", "vllm", "--family", "qwen2", "--exact",
            "--capture", str(cap)]
    r = subprocess.run(base, capture_output=True, text=True, timeout=600)
    assert r.returncode == 2, r.stdout + r.stderr
    said = " ".join(r.stderr.split())  # the error line is wrapped to the terminal's width
    assert "attention ISA: amx" in said and "--allow-other-machine" in said, r.stderr
    assert "Traceback" not in r.stderr
    out = tmp_path / "m.json"
    r = subprocess.run([*base, "--allow-other-machine", "--json", str(out)], capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    d = json.loads(out.read_text())
    assert any("--allow-other-machine" in w and "amx" in w for w in d["warnings"]), d["warnings"]
    exact = {x["trainer"]: x for x in d["sampled"]}["exact"]
    assert exact["exact_match"] < 1.0  # the vec attention's point is not the amx kernel's bits


def test_mismatch_kernels_option_is_checked_before_the_engine_runs():
    """--kernels takes apply_profile's values, with --exact; 'engine' where this python imports no vLLM (the test
    venv) is refused naming the engine environment's python; the exact rows say which attention ran
    (tests/engines/test_exact_mode.py runs --kernels engine in vLLM's environment)."""
    import subprocess
    import sys

    base = [sys.executable, "-m", "engineloop.cli", "mismatch", "vllm"]
    for args, said in ((["--exact", "--kernels", "fast"], "--kernels must be one of auto, engine, portable"),
                       (["--kernels", "portable"], "pass it with --exact"),
                       (["--exact", "--kernels", "engine"], "is not importable by this python"),
                       (["sglang", "--exact", "--kernels", "engine"], "has no kernel exact mode can call")):
        cmd = base[:-1] + args if args[0] == "sglang" else base + args
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert r.returncode == 2 and said in " ".join(r.stderr.split()), (args, r.stderr)
        assert "Traceback" not in r.stderr
