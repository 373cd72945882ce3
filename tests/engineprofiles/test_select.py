"""Choosing a profile by engine name: the pure choice over synthetic candidates (no engines, no
files, nothing read from this machine)."""

import random

import pytest

from engineprofiles.errors import (
    CapabilityMismatch,
    EngineProfilesError,
    MismatchedProfile,
    NoMatchingProfile,
    ProfileNotFound,
    UnknownEngine,
    VersionMismatch,
)
from engineprofiles.select import Candidate, Spec, Wanted, engine_version_hint, parse_spec, select, version_key


def C(version="0.32.0", mode="inductor", method="op-level", capability="AVX512", dtype="bfloat16", backend="cpu",
      engine="vllm", date="2026-12-04T00:00:00Z"):
    suffix = "-insitu" if method == "in-situ" else ""
    name = f"{engine}-{version}-{backend}-{mode}-{dtype}{suffix}-{capability}"
    return Candidate(name=name, engine=engine, version=version, mode=mode, dtype=dtype, backend=backend,
                     capability=capability, method=method, date=date)


# What the shipped profiles look like: two vLLM versions, compiled (op-level and in situ) and eager.
SHIPPED = [C("0.28.0"), C("0.28.0", method="in-situ"), C("0.32.0", mode="eager"), C("0.32.0"),
           C("0.32.0", method="in-situ"), C("0.5.23", mode="eager", engine="sglang"),
           C("5.19.0", mode="eager", engine="transformers")]


def W(engine="vllm", **kw):
    kw.setdefault("capability", "AVX512")
    return Wanted(engine=engine, **kw)


def pick(cands, wanted):
    s = select(cands, wanted)
    for _ in range(3):  # the order of the candidates does not matter
        shuffled = list(cands)
        random.Random(len(shuffled)).shuffle(shuffled)
        assert select(shuffled, wanted) == s
    return s


def test_default_is_the_engines_default_mode_the_newest_version_and_in_situ_over_op_level():
    s = pick(SHIPPED, W())
    assert s.candidate == C("0.32.0", method="in-situ")
    assert not s.mismatches
    text = s.message()
    assert s.name in text and "inductor" in text and "newest" in text and "in-situ" in text and "AVX512" in text


def test_eager_mode_is_asked_with_a_colon_and_compiled_names_inductor():
    assert pick(SHIPPED, W(mode="eager")).candidate == C("0.32.0", mode="eager")
    assert pick(SHIPPED, W(mode="compiled")).candidate == C("0.32.0", method="in-situ")
    assert pick(SHIPPED, W(mode="inductor")).candidate == C("0.32.0", method="in-situ")  # a recorded execution mode
    assert pick(SHIPPED, W("sglang")).candidate.engine == "sglang"  # SGLang's default is eager


def test_a_mode_without_a_profile_is_an_error_naming_the_modes_there_are():
    with pytest.raises(NoMatchingProfile, match="torch-compile.*in mode eager"):
        select(SHIPPED, W("sglang", mode="compiled"))
    with pytest.raises(NoMatchingProfile, match="vllm:MODE"):
        select(SHIPPED, W(mode="turbo"))


def test_the_installed_version_wins_over_the_newest_and_its_local_part_is_ignored():
    s = pick(SHIPPED, W(installed="0.28.0+cpu"))
    assert s.candidate == C("0.28.0", method="in-situ") and not s.mismatches
    assert "installed" in s.message()


@pytest.mark.parametrize("installed,expected,side", [("0.30.1", "0.28.0", "below"), ("0.40", "0.32.0", "below"),
                                                     ("0.27.5", "0.28.0", "above")])
def test_an_installed_version_without_a_profile_takes_the_nearest_with_a_version_warning(installed, expected, side):
    s = pick(SHIPPED, W(installed=installed))
    assert s.candidate == C(expected, method="in-situ")
    [(category, text)] = s.mismatches
    assert category is VersionMismatch and issubclass(category, MismatchedProfile)
    assert s.name in text and installed in text and side in text and "probe" in text


def test_an_asked_version_must_exist():
    assert pick(SHIPPED, W(version="0.28")).candidate == C("0.28.0", method="in-situ")  # 0.28 is 0.28.0
    assert pick(SHIPPED, W(version="0.28.0", installed="0.32.0")).candidate.version == "0.28.0"  # asked beats installed
    with pytest.raises(NoMatchingProfile, match=r"no vllm 0\.30\.0 profile.*versions there: 0\.28\.0, 0\.32\.0"):
        select(SHIPPED, W(version="0.30.0"))


def test_the_machines_capability_comes_before_the_method_and_a_mismatch_warns():
    cands = [C(method="in-situ", capability="AVX512"), C(method="op-level", capability="AVX2")]
    assert pick(cands, W(capability="AVX2")).candidate == cands[1]
    assert pick(cands, W(capability="AVX512")).candidate == cands[0]
    only = [C(method="in-situ", capability="AVX512")]
    s = pick(only, W(capability="AVX2"))
    assert s.candidate == only[0]
    [(category, text)] = s.mismatches
    assert category is CapabilityMismatch
    assert s.name in text and "AVX2" in text and "AVX512" in text
    assert not pick(only, W(capability=None)).mismatches  # unknown capability: nothing to compare


def test_the_version_comes_before_the_capability():
    cands = [C("0.32.0", capability="AVX512"), C("0.28.0", capability="AVX2")]
    s = pick(cands, W(capability="AVX2"))
    assert s.candidate.version == "0.32.0" and [c for c, _ in s.mismatches] == [CapabilityMismatch]
    assert pick(cands, W(capability="AVX2", installed="0.28.0")).candidate == cands[1]


def test_the_models_dtype_must_match_and_bfloat16_is_preferred_when_unknown():
    cands = [C(dtype="bfloat16"), C(dtype="float16")]
    assert pick(cands, W(dtype="float16")).candidate.dtype == "float16"
    assert pick(cands, W()).candidate.dtype == "bfloat16"
    with pytest.raises(NoMatchingProfile, match="float32.*bfloat16"):
        select(SHIPPED, W(dtype="float32"))
    with pytest.raises(NoMatchingProfile, match="--dtype float16"):
        select(SHIPPED, W(dtype="float16"))


def test_a_cuda_model_takes_a_cuda_profile_else_a_cpu_one_with_a_warning():
    cuda = C("0.28.0", backend="cuda", capability=None)
    s = pick(SHIPPED + [cuda], W(device="cuda", capability=None))
    assert s.candidate == cuda and not s.mismatches  # the device comes before the newest version
    s = pick(SHIPPED, W(device="cuda", capability=None))
    assert s.candidate == C("0.32.0", method="in-situ")
    [(category, text)] = s.mismatches
    assert category is CapabilityMismatch and "cuda" in text and s.name in text
    # a CPU model prefers the CPU profile over a newer CUDA one
    assert pick(SHIPPED + [C("0.40.0", backend="cuda")], W()).candidate == C("0.32.0", method="in-situ")


def test_an_unknown_engine_is_a_typed_error_listing_the_engines_and_profiles():
    with pytest.raises(UnknownEngine) as e:
        select(SHIPPED, W("vlm"))
    assert isinstance(e.value, ProfileNotFound) and isinstance(e.value, EngineProfilesError)
    msg = str(e.value)
    assert "'vlm'" in msg and "sglang, transformers, vllm" in msg and C(method="in-situ").name in msg
    with pytest.raises(UnknownEngine):
        select([], W("vlm"))


def test_a_known_engine_without_any_profile_is_a_no_candidate_error():
    with pytest.raises(NoMatchingProfile, match="no sglang profile in /x.*probe-engine sglang"):
        select([C()], W("sglang"), where=" in /x")
    with pytest.raises(NoMatchingProfile):
        select([], W())


def test_an_engine_of_ones_own_probes_is_chosen_in_any_mode_by_default():
    mine = C("1.0", mode="custom-op", engine="myengine")
    assert pick(SHIPPED + [mine], W("myengine")).candidate == mine


def test_ties_go_to_the_newest_probe_then_the_name():
    old, new = C(date="2026-01-01T00:00:00Z"), C(date="2026-12-31T00:00:00Z")
    assert pick([old, new], W()).candidate == new


@pytest.mark.parametrize("text,spec", [
    ("vllm", Spec("vllm")), ("vllm==0.32.0", Spec("vllm", "0.32.0")), ("vllm:eager", Spec("vllm", mode="eager")),
    ("vllm==0.32.0+cpu:compiled", Spec("vllm", "0.32.0+cpu", "compiled")), ("sglang", Spec("sglang")),
    ("no-such-profile", Spec("no-such-profile")),
])
def test_spec_syntax(text, spec):
    assert parse_spec(text) == spec
    assert str(spec) == text


@pytest.mark.parametrize("text", ["", "vllm-0.32.0", "p.yaml", "dir/vllm", "/abs", "vllm==", "vllm:", "vllm==a/b",
                                  "vllm-0.32.0-cpu-inductor-bfloat16", "vllm==0.32:eager:x", "=vllm", "vllm 0.32"])
def test_paths_file_names_and_dashed_versions_are_not_specs(text):
    assert parse_spec(text) is None


def test_an_engine_and_version_joined_by_a_dash_gets_a_hint():
    assert engine_version_hint("vllm-0.32.0") == "vllm==0.32.0"
    assert engine_version_hint("vllm-0.32.0-cpu-eager-bfloat16") is None
    assert engine_version_hint("foo-1.0") is None


def test_version_order():
    order = ["0.5.23", "0.9", "0.10.0", "0.32.0rc1", "0.32.0", "0.32.0.post1", "0.33.0.dev0", "0.33"]
    assert sorted(order, key=version_key) == order
    assert version_key("0.32") == version_key("0.32.0") == version_key("0.32.0+cpu") == version_key("v0.32.0")


def test_a_profile_of_an_emulated_capability_says_so_when_chosen():
    from dataclasses import replace

    avx2 = replace(C(method="in-situ", capability="AVX2"), emulated="AVX2 emulated on a host with AVX512: ...")
    s = pick(SHIPPED + [avx2], W(capability="AVX2"))
    assert s.candidate == avx2 and not s.mismatches
    assert "emulated" in s.message() and "probe-engine check" in s.message()
    assert "emulated" not in pick(SHIPPED + [avx2], W()).message()  # AVX512: the measured one, no such note


def test_a_profile_of_this_machine_comes_before_one_of_another_machine_and_the_method():
    from engineprofiles.machine import Machine

    amd = Machine("AuthenticAMD", ("avx2", "avx512_bf16", "avx512f"), ("avx2", "avx512", "avx512_bf16"), "AVX512")
    amx = Machine("GenuineIntel", ("amx_bf16", "amx_tile", "avx2", "avx512_bf16", "avx512f"),
                  ("amx_tile", "avx2", "avx512", "avx512_bf16"), "AVX512")
    in_situ_amd = Candidate(**{**C(method="in-situ").__dict__, "name": "amd-insitu", "machine": amd})
    op_amx = Candidate(**{**C().__dict__, "name": "amx-op", "machine": amx})
    cands = [in_situ_amd, op_amx]
    s = pick(cands, W(machine=amx))
    assert s.candidate == op_amx and any("this machine's CPU features" in r for r in s.reasons)
    assert pick(cands, W(machine=amd)).candidate == in_situ_amd
    # no profile of this machine: the usual order decides, and the reasons say exact mode refuses it
    other = Machine("GenuineIntel", ("avx2",), ("avx2",), "AVX512")
    s = pick(cands, W(machine=other))
    assert s.candidate == in_situ_amd and not s.mismatches
    assert any("exact mode refuses it" in r for r in s.reasons)
    # a machine that is not known (capability given by hand) changes nothing
    assert pick(cands, W()).candidate == in_situ_amd
