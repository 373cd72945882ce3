"""Copies of a patched model (issue 16): ``copy.deepcopy`` gives a patched model with its own residual
stream state and its own handle, and a TRL ``create_reference_model``-style copy (deepcopy,
requires_grad False, eval) computes the patched model's bits."""

from __future__ import annotations

import copy

import pytest
import torch

import emulator
from emulator.patching import AlreadyPatched, ResidualStreamLost, handle_of, patched_modules
from engineprofiles.models import tiny_inputs, tiny_model

from .helpers import assert_same_bits, model_state
from .test_patching import ALL_EMULATED, FP32_STREAM, fwd_bwd, profile_with

FAMILIES = ("qwen2", "qwen3", "llama", "mistral")
INSITU = "vllm-0.32.0-cpu-inductor-bfloat16-insitu"


def create_reference_model(model):
    """What trl.create_reference_model does (without TRL's sharing of layers)."""
    ref = copy.deepcopy(model)
    for p in ref.parameters():
        p.requires_grad = False
    return ref.eval()


@pytest.mark.parametrize("family", FAMILIES)
def test_a_deepcopy_of_a_patched_model_is_patched_with_its_own_state_and_handle(family):
    model = tiny_model(family, seed=1)
    model.train()
    ids = tiny_inputs(model, 16, batch=2, seed=3)
    plain = fwd_bwd(model, ids)
    handle = emulator.apply_profile(model, profile_with(ALL_EMULATED, **FP32_STREAM))
    want = fwd_bwd(model, ids)
    clone = copy.deepcopy(model)
    mine = handle_of(clone)
    assert mine is not None and mine is not handle and mine.copy_of is handle and handle_of(model) is handle
    assert mine.profile == handle.profile and mine.emulated == handle.emulated and mine.model is clone
    assert sorted(n for n, _ in patched_modules(clone)) == sorted(n for n, _ in patched_modules(model))
    # Its own stream: the copy's layers put nothing into the original's stash, and the other way round.
    assert clone.model.layers[1]._emulator_stash is not model.model.layers[1]._emulator_stash
    assert clone.model.layers[1]._emulator_stash is clone.model.norm._emulator_stash
    got = fwd_bwd(clone, ids)
    for n in want[1]:
        assert_same_bits(got[1][n], want[1][n], f"copy: grad of {n}")
    assert_same_bits(got[0], want[0], "copy: logits")
    # Applying again to the copy is an error that names how to get its handle.
    with pytest.raises(AlreadyPatched, match="handle_of"):
        emulator.apply_profile(clone, ALL_EMULATED)
    # Removing the original's patch leaves the copy patched, and the other way round.
    handle.remove()
    assert_same_bits(fwd_bwd(model, ids)[0], plain[0], "original after its remove()")
    assert_same_bits(fwd_bwd(clone, ids)[0], want[0], "copy after the original's remove()")
    before = model_state(tiny_model(family, seed=1))
    mine.remove()
    mine.remove()  # idempotent
    assert handle_of(clone) is None and not dict(patched_modules(clone))
    assert model_state(clone)[0] == before[0], "the copy's remove() left something of the patch behind"
    after = fwd_bwd(clone, ids)
    assert_same_bits(after[0], plain[0], "copy after its own remove()")
    for n in plain[1]:
        assert_same_bits(after[1][n], plain[1][n], f"copy after remove(): grad of {n}")
    # ... and it can be patched again.
    with emulator.apply_profile(clone, ALL_EMULATED):
        assert handle_of(clone) is not None


@pytest.mark.parametrize("family", FAMILIES)
def test_a_trl_style_reference_model_of_a_patched_model_computes_the_patched_bits(family):
    model = tiny_model(family, seed=1)
    ids = tiny_inputs(model, 16, batch=2, seed=4)
    with emulator.apply_profile(model, INSITU):
        model.train()
        ref = create_reference_model(model)
        assert not ref.training and not any(p.requires_grad for p in ref.parameters())
        with torch.no_grad():
            model.eval()
            want = model(ids).logits
            model.train()
        # The policy trains while the reference scores: interleaved forwards do not mix their streams.
        out = model(ids, labels=ids)
        with torch.no_grad():
            got = ref(ids).logits
        out.loss.backward()
        assert_same_bits(got, want, "reference model's logits")
        with torch.no_grad():
            assert_same_bits(ref(ids).logits, want, "reference model's logits, again")
    with torch.no_grad():
        assert_same_bits(ref(ids).logits, want, "reference model after the policy's patch is removed")


def test_a_deepcopy_of_a_patched_model_compiles_to_its_eager_bits():
    model = tiny_model("qwen3", seed=1)
    ids = tiny_inputs(model, 12)
    with emulator.apply_profile(model, INSITU):
        clone = copy.deepcopy(model)
    with torch.no_grad():
        want = clone(ids).logits
        assert_same_bits(torch.compile(clone)(ids).logits, want, "compiled copy")
        torch._dynamo.reset()
        assert_same_bits(torch.compile(clone, fullgraph=True)(ids).logits, want, "compiled copy, fullgraph")
    handle_of(clone).remove()
    torch._dynamo.reset()


def test_a_lost_residual_stream_under_torch_compile_is_the_projects_error():
    # Raised where torch.compile traces, an error becomes Dynamo's generic "Observed exception"
    # unless it is raised outside the graph: the patch raises its own.
    model = tiny_model("qwen2", seed=1)
    with emulator.apply_profile(model, ALL_EMULATED):
        x = torch.randn(1, 5, model.config.hidden_size).to(torch.bfloat16)
        pos = torch.arange(5).unsqueeze(0)
        pe = model.model.rotary_emb(x, pos)
        layer = torch.compile(model.model.layers[1])
        with pytest.raises(ResidualStreamLost, match="model.layers.1"), torch.no_grad():
            layer(x, position_ids=pos, position_embeddings=pe)
        with pytest.raises(ResidualStreamLost, match="model.norm"), torch.no_grad():
            torch.compile(model.model.norm)(x)
    torch._dynamo.reset()
