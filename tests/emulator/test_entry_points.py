"""Entry points in the ecosystem's habits (issue 16): class-level patching before from_pretrained, the
profile recorded in the saved config and re-applied on load, the device check, and Liger-Kernel
(class- or instance-level) refused by name rather than silently overriding or being overridden."""

from __future__ import annotations

import json
import types
import warnings

import pytest
import torch

import emulator
from emulator.errors import PatchError
from emulator.patching import AlreadyPatched, NoRecordedProfile, UnsupportedModel, handle_of, patched_modules
from engineprofiles.errors import CapabilityMismatch, ProfileError
from engineprofiles.models import tiny_inputs, tiny_model
from engineprofiles.store import get_profile

from .helpers import assert_same_bits, assert_untouched, model_state
from .test_patching import ALL_EMULATED, FAMILIES

INSITU = "vllm-0.32.0-cpu-inductor-bfloat16-insitu"
MODULES = {"qwen2": "transformers.models.qwen2.modeling_qwen2", "qwen3": "transformers.models.qwen3.modeling_qwen3",
           "llama": "transformers.models.llama.modeling_llama", "mistral": "transformers.models.mistral.modeling_mistral"}


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def patched_logits(family, ids, profile=INSITU, **kw):
    model = tiny_model(family, seed=1)
    with emulator.apply_profile(model, profile, **kw):
        return logits(model, ids)


def family_module(family):
    import importlib

    return importlib.import_module(MODULES[family])


# -- class-level patching ---------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_a_class_patch_patches_every_model_of_its_family_built_afterwards(family, tmp_path):
    from transformers import AutoModelForCausalLM

    ids = tiny_inputs(tiny_model(family, seed=1), 12, seed=2)
    want = patched_logits(family, ids)
    saved = tiny_model(family, seed=1)
    plain = logits(saved, ids)
    saved.save_pretrained(tmp_path)
    mod = family_module(family)
    prefix = {"qwen2": "Qwen2", "qwen3": "Qwen3", "llama": "Llama", "mistral": "Mistral"}[family]
    base = getattr(mod, f"{prefix}PreTrainedModel")
    init = getattr(mod, f"{prefix}ForCausalLM").__dict__["__init__"]
    other = next(f for f in FAMILIES if f != family)
    patch = getattr(emulator, f"patch_{family}")(INSITU)
    try:
        built = tiny_model(family, seed=1)  # from_config
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
        bystander = tiny_model(other, seed=1)  # another family: left alone
        for what, model in (("from_config", built), ("from_pretrained", loaded)):
            h = handle_of(model)
            assert h is not None and h.model is model and h.profile == get_profile(INSITU), what
            assert_same_bits(logits(model, ids), want, f"class patch, {what}")
        assert handle_of(bystander) is None
        assert [h.model for h in patch.handles] == [built, loaded]
        with pytest.raises(AlreadyPatched):
            emulator.apply_profile(built, INSITU)
    finally:
        patch.remove()
    assert not patch.active and "from_pretrained" not in base.__dict__
    assert getattr(mod, f"{prefix}ForCausalLM").__dict__["__init__"] is init
    after = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert handle_of(after) is None
    assert_same_bits(logits(after, ids), plain, "built after remove(): plain")
    assert_same_bits(logits(built, ids), want, "a model patched before remove() stays patched")
    patch.remove(instances=True)
    assert handle_of(built) is None and not dict(patched_modules(built))
    assert_same_bits(logits(built, ids), plain, "remove(instances=True) unpatches it")


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_a_model_built_on_the_meta_device_is_patched_when_its_weights_arrive(family):
    """verl's FSDP workers build the actor on the meta device on every rank but 0
    (accelerate.init_empty_weights) and load the weights afterwards: the class patch patches such a
    model at its first forward once the weights are there (or at patch.apply_pending()), to the bits
    of the directly patched model, and refuses a forward while they are still missing. It once
    skipped them silently: handle_of(model) None, no warning."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    ref = tiny_model(family, seed=1)
    ids = tiny_inputs(ref, 12, seed=2)
    want = patched_logits(family, ids)
    state = ref.state_dict()
    with getattr(emulator, f"patch_{family}")(INSITU) as patch:
        with init_empty_weights():  # parameters on the meta device, buffers (RoPE's inv_freq) real
            first = AutoModelForCausalLM.from_config(ref.config, dtype=torch.bfloat16)
            second = AutoModelForCausalLM.from_config(ref.config, dtype=torch.bfloat16)
        assert handle_of(first) is None and patch.pending == [first, second] and "2 pending" in repr(patch)
        with pytest.raises(PatchError, match="meta device.*load its weights first"):
            logits(first, ids)
        assert patch.pending == [first, second]  # still pending, nothing half-done
        # the weights arrive as HF's loader assigns them; the first forward patches it
        first.load_state_dict(state, assign=True)
        first.eval()
        assert_same_bits(logits(first, ids), want, "meta build, patched at its first forward")
        assert handle_of(first) is not None and handle_of(first).model is first and patch.pending == [second]
        # the weights arrive as FSDP's loaders put them (to_empty, then the state and the buffers)
        second.to_empty(device="cpu")
        second.load_state_dict(state)
        for (name, buf), (_, src) in zip(second.named_buffers(), ref.named_buffers()):
            buf.copy_(src)
        second.eval()
        made = patch.apply_pending()
        assert [h.model for h in made] == [second] and not patch.pending
        assert_same_bits(logits(second, ids), want, "meta build, patched by apply_pending()")
        assert [h.model for h in patch.handles] == [first, second]
        with init_empty_weights():
            third = AutoModelForCausalLM.from_config(ref.config, dtype=torch.bfloat16)
        third.load_state_dict(state, assign=True)
        with torch.no_grad():  # compiled before its first forward: the patch still comes first
            assert_same_bits(torch.compile(third.eval())(ids).logits, want, "meta build, compiled")
        assert handle_of(third) is not None
    # built under the patch but loaded after remove(): still patched; remove(instances=True) drops it
    with getattr(emulator, f"patch_{family}")(INSITU) as patch:
        with init_empty_weights():
            late = AutoModelForCausalLM.from_config(ref.config, dtype=torch.bfloat16)
            dropped = AutoModelForCausalLM.from_config(ref.config, dtype=torch.bfloat16)
    late.load_state_dict(state, assign=True)
    assert_same_bits(logits(late.eval(), ids), want, "patched after the class patch was removed")
    patch.remove(instances=True)
    dropped.load_state_dict(state, assign=True)
    assert handle_of(dropped) is None and not patch.pending
    assert_same_bits(logits(dropped.eval(), ids), logits(ref, ids), "remove(instances=True): plain")


def test_a_class_patch_passes_its_options_and_raises_a_refusal_where_the_model_is_built():
    ids = tiny_inputs(tiny_model("qwen3", seed=1), 10)
    with emulator.patch_family("qwen3", "sglang-0.5.23-cpu-eager-bfloat16", skip_native=False) as patch:
        model = tiny_model("qwen3", seed=1)
        assert handle_of(model).native == () and handle_of(model).skip_native is False
        with pytest.raises(UnsupportedModel, match="rope_type 'longrope'"):
            tiny_model("qwen3", seed=1, rope_parameters={
                "rope_type": "longrope", "factor": 4.0, "rope_theta": 1e6, "original_max_position_embeddings": 4096,
                "short_factor": [1.0] * 32, "long_factor": [2.0] * 32})
    assert not patch.active
    assert_same_bits(logits(model, ids), patched_logits("qwen3", ids, "sglang-0.5.23-cpu-eager-bfloat16"),
                     "skip_native=False gives the same forward")
    with pytest.raises(UnsupportedModel, match="no model family 'gemma'"):
        emulator.patch_family("gemma", INSITU)


# -- the profile recorded in the config ------------------------------------------------------------


def test_a_patch_records_nothing_in_the_config_unless_asked():
    """record=False (the default) leaves the config alone, for every shipped engine's profile (a plan once
    took the engine's record for the record= option)."""
    for spec in ("vllm", "sglang", ALL_EMULATED):
        model = tiny_model("qwen2", seed=1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            handle = emulator.apply_profile(model, spec)
        assert not hasattr(model.config, "emulator_profile"), spec
        handle.remove()


def test_a_recorded_profile_is_saved_with_the_model_and_reapplied_on_load(tmp_path):
    from transformers import AutoModelForCausalLM

    prof = get_profile(ALL_EMULATED)
    model = tiny_model("llama", seed=1)
    ids = tiny_inputs(model, 12, seed=5)
    plain = logits(model, ids)
    handle = emulator.apply_profile(model, prof, skip_native=False, record=True)
    want = logits(model, ids)
    model.save_pretrained(tmp_path)
    rec = json.loads((tmp_path / "config.json").read_text())["emulator_profile"]
    assert rec["name"] == prof.canonical_name and rec["skip_native"] is False and rec["exact"] is False
    handle.remove()
    assert not hasattr(model.config, "emulator_profile"), "remove() takes the record out of the config"
    # Plain HF loading does not patch (transformers knows nothing of the record) ...
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert handle_of(loaded) is None
    assert_same_bits(logits(loaded, ids), plain, "loaded plainly")
    found, options = emulator.recorded_profile(loaded)
    assert found == prof and options == {"skip_native": False, "exact": False, "kernels": "auto"}
    # ... apply_recorded_profile does, with the recorded options.
    with emulator.apply_recorded_profile(loaded) as h:
        assert h.profile == prof and h.skip_native is False
        assert_same_bits(logits(loaded, ids), want, "re-applied from the config")
    assert_same_bits(logits(loaded, ids), plain, "after remove()")
    assert loaded.config.emulator_profile["name"] == prof.canonical_name, "the loaded record stays"
    # A class patch without a profile applies each model's recorded one.
    with emulator.patch_llama() as patch:
        again = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
        assert handle_of(again).profile == prof
        assert_same_bits(logits(again, ids), want, "class patch with the recorded profile")
        with pytest.warns(NoRecordedProfile, match="left unpatched"):
            bare = tiny_model("llama", seed=1)
        assert handle_of(bare) is None and len(patch.handles) == 1


def test_a_model_without_a_record_or_with_a_broken_one_says_so():
    model = tiny_model("qwen2", seed=1)
    state = model_state(model)
    assert emulator.recorded_profile(model) is None
    with pytest.raises(UnsupportedModel, match="records no profile"):
        emulator.apply_recorded_profile(model)
    model.config.emulator_profile = {"profile": "schema_version: 99\n"}
    with pytest.raises(ProfileError):
        emulator.apply_recorded_profile(model)
    with emulator.apply_profile(model, get_profile(ALL_EMULATED), record=True):
        good = dict(model.config.emulator_profile)
    model.config.emulator_profile = dict(good, kernels="fast")
    with pytest.raises(ProfileError, match="kernels must be one of auto, engine, portable, got 'fast'"):
        emulator.apply_recorded_profile(model)
    del good["kernels"]  # a record written before the option: the default
    model.config.emulator_profile = good
    assert emulator.recorded_profile(model)[1]["kernels"] == "auto"
    model.config.emulator_profile = "vllm"
    with pytest.raises(ProfileError, match="not a recorded profile"):
        emulator.apply_recorded_profile(model)
    assert_untouched(model, state)


# -- the profile's device ----------------------------------------------------------------------------


def test_a_profile_probed_on_another_device_than_the_models_warns():
    prof = get_profile(INSITU)
    cuda = prof.model_copy(update={"engine": prof.engine.model_copy(update={"backend": "cuda"})})
    model = tiny_model("qwen2", seed=1)
    with pytest.warns(CapabilityMismatch, match="probed on cuda, the model is on cpu") as w:
        emulator.apply_profile(model, cuda).remove()
    assert all(x.filename == __file__ for x in w if issubclass(x.category, CapabilityMismatch))
    with warnings.catch_warnings():
        warnings.simplefilter("error", CapabilityMismatch)  # the same device: no warning
        emulator.apply_profile(model, prof).remove()
        with pytest.raises(CapabilityMismatch):  # and the way to make it an error
            emulator.apply_profile(model, cuda)
    assert handle_of(model) is None


# -- Liger-Kernel -------------------------------------------------------------------------------------
# Liger is not a dependency (its kernels need a GPU); what its patches do is reproduced: the class-level
# apply_liger_kernel_to_qwen2() replaces modeling_qwen2.Qwen2RMSNorm, Qwen2MLP and apply_rotary_pos_emb
# by its own; apply_liger_kernel_to_qwen2(model=...) binds its forwards on the instances
# (module.__dict__["forward"] = LigerRMSNorm.forward.__get__(module)).


def liger_classes():
    from transformers.models.qwen2 import modeling_qwen2 as m

    class LigerRMSNorm(m.Qwen2RMSNorm):
        pass

    class LigerSwiGLUMLP(m.Qwen2MLP):
        pass

    def liger_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        return m.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)

    LigerRMSNorm.__module__ = "liger_kernel.transformers.rms_norm"
    LigerSwiGLUMLP.__module__ = "liger_kernel.transformers.swiglu"
    liger_rotary_pos_emb.__module__ = "liger_kernel.transformers.rope"
    return m, dict(Qwen2RMSNorm=LigerRMSNorm, Qwen2MLP=LigerSwiGLUMLP, apply_rotary_pos_emb=liger_rotary_pos_emb)


def liger_forward():
    def forward(self, hidden_states):
        return hidden_states

    forward.__module__ = "liger_kernel.transformers.rms_norm"
    return forward


@pytest.mark.parametrize("built", ["after", "before"])
def test_liger_class_level_patch_is_refused_by_name(built, monkeypatch):
    m, replaced = liger_classes()
    before = tiny_model("qwen2", seed=1) if built == "before" else None
    for name, obj in replaced.items():
        monkeypatch.setattr(m, name, obj)
    model = before if before is not None else tiny_model("qwen2", seed=1)
    if built == "after":
        assert type(model.model.norm).__name__ == "LigerRMSNorm"
    state = model_state(model)
    with pytest.raises(UnsupportedModel, match=r"Liger-Kernel's class-level patch.*Qwen2RMSNorm \(now liger_kernel"):
        emulator.apply_profile(model, INSITU)
    assert_untouched(model, state)
    # In either order with a class patch of ours: the refusal comes where the model is built.
    with emulator.patch_qwen2(INSITU):
        with pytest.raises(UnsupportedModel, match="Liger-Kernel"):
            tiny_model("qwen2", seed=1)
    # Another family's module is not concerned.
    with emulator.apply_profile(tiny_model("llama", seed=1), INSITU):
        pass


def test_liger_instance_level_patch_is_refused_before_and_after_apply_profile():
    model = tiny_model("qwen2", seed=1)
    ids = tiny_inputs(model, 8)
    norm = model.model.norm
    norm.__dict__["forward"] = liger_forward().__get__(norm, type(norm))  # before apply_profile
    state = model_state(model)
    with pytest.raises(UnsupportedModel, match="model.norm .*by Liger-Kernel"):
        emulator.apply_profile(model, INSITU)
    assert_untouched(model, state)
    del norm.__dict__["forward"]
    with emulator.apply_profile(model, INSITU):
        want = logits(model, ids)
        mlp = model.model.layers[1].mlp
        saved = mlp.__dict__["forward"]
        mlp.__dict__["forward"] = liger_forward().__get__(mlp, type(mlp))  # after: Liger overrides ours
        with pytest.raises(UnsupportedModel, match=r"model.layers.1.mlp: its forward was replaced.*liger_kernel"):
            logits(model, ids)
        with pytest.raises(UnsupportedModel, match=r"model.layers.1.mlp: its forward was replaced"):
            logits(torch.compile(model), ids)  # compiled: the same error, not Dynamo's
        torch._dynamo.reset()
        mlp.__dict__["forward"] = saved
        assert_same_bits(logits(model, ids), want, "with the patch's forward back")
