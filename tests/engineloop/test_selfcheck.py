"""The in-situ probe's self-check (engineloop.selfcheck): the random model it draws, what the profile
records, and exact mode's warning when the check fell short. The engine run itself is exercised by
the shipped in-situ profiles (each carries its self-check) and tests/engines."""

from __future__ import annotations

import warnings

import pytest

from engineloop.selfcheck import draw_model
from engineprofiles.schema import SelfCheck, profile_from_yaml
from engineprofiles.store import get_profile

ENGINE = "vllm-0.32.0-cpu-inductor-bfloat16-insitu"


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_the_self_check_model_is_off_the_grid_and_the_same_for_a_seed(family):
    seen = set()
    for seed in range(40):
        size, prompt_len = draw_model(family, seed)
        assert (size, prompt_len) == draw_model(family, seed)
        h, heads, kv = size["hidden_size"], size["num_attention_heads"], size["num_key_value_heads"]
        assert h & (h - 1) != 0, "a power-of-two hidden size is the grid the fit already ran"
        assert heads % kv == 0 and 1 <= heads // kv <= 7
        assert size["intermediate_size"] % 32 == 0 and size["intermediate_size"] % 128 != 0
        assert prompt_len % 2 == 1  # never a multiple of a tile
        seen.add((h, heads // kv, size["head_dim"]))
    assert len(seen) > 10  # the draw varies


def with_check(prof, **rates):
    sc = SelfCheck(model="qwen3: 2 layers, hidden 328", seed=1, sampled_tokens=24, prefill_tokens=80,
                   sampled={"exact": rates.get("exact", 1.0), "exact, decoded": rates.get("decoded", 1.0)},
                   prefill={"exact": rates.get("prefill", 1.0)})
    return prof.model_copy(update={"provenance": prof.provenance.model_copy(update={"self_check": sc})})


def test_a_self_check_is_written_and_read_back_and_older_profiles_load_without_one():
    prof = get_profile(ENGINE)
    checked = with_check(prof, exact=0.5)
    text = checked.to_yaml()
    assert "self_check:" in text and profile_from_yaml(text) == checked
    assert profile_from_yaml(text).to_yaml() == text
    bare = prof.model_copy(update={"provenance": prof.provenance.model_copy(update={"self_check": None})})
    assert "self_check" not in bare.to_yaml()


def test_the_rows_a_trainer_uses_decide_whether_the_self_check_is_exact():
    prof = get_profile(ENGINE)
    assert with_check(prof).provenance.self_check.exact
    # the plain one-prefill row may miss where the engine's decode is not its prefill: the decoded row counts
    assert with_check(prof, exact=0.4).provenance.self_check.exact
    assert not with_check(prof, exact=0.4, decoded=0.9).provenance.self_check.exact
    assert not with_check(prof, prefill=0.99).provenance.self_check.exact


def test_exact_mode_warns_when_the_self_check_fell_short():
    import emulator
    from emulator.errors import InexactEvidence
    from engineprofiles.models import tiny_model

    from ..emulator.helpers import on_this_machine

    prof = on_this_machine(ENGINE)
    with pytest.warns(InexactEvidence, match=r"self-check.*prefill exact 97\.00%"):
        emulator.apply_profile(tiny_model("qwen2", seed=0), with_check(prof, prefill=0.97), exact=True).remove()
    with warnings.catch_warnings():
        warnings.simplefilter("error", InexactEvidence)
        emulator.apply_profile(tiny_model("qwen2", seed=0), with_check(prof), exact=True).remove()
