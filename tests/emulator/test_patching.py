"""emulator.apply_profile: a HF model patched in place rounds where the profile says, trains
(backward, gradient checkpointing, PEFT, FSDP2), reverts bit for bit, and refuses what does not
fit without touching the model."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import emulator
from emulator import functional as F
from emulator.errors import ProfileMismatch, RegionUnavailable
from emulator.patching import (
    NATIVE, AlreadyPatched, ResidualStreamLost, UnsupportedModel, patched_modules,
)
from engineprofiles.models import tiny_inputs, tiny_model
from engineprofiles.probe.adapters.transformers import CAPTURE, TransformersAdapter, _register_capture
from engineprofiles.probe.harness import run_probe
from engineprofiles.regions import REGIONS, rmsnorm_ref, rope_cos_sin, rope_ref
from engineprofiles.rounding import round_to
from engineprofiles.schema import make_profile
from engineprofiles.store import get_profile, shipped_names

from .helpers import assert_same_bits, assert_untouched, model_state

ROOT = Path(__file__).resolve().parents[2]
FAMILIES = ("qwen2", "qwen3", "llama", "mistral")
ENGINE_PROFILES = [n for n in shipped_names() if not n.startswith("transformers-")]
TRANSFORMERS_PROFILE = next(n for n in shipped_names() if n.startswith("transformers-"))
ALL_EMULATED = "vllm-0.32.0-cpu-inductor-bfloat16"  # every region differs from HF's own


def fwd_bwd(model, ids):
    """Logits and the gradient of every parameter of one training step (loss = LM loss on ids)."""
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach().clone(), grads


def assert_same_step(a, b, what):
    assert_same_bits(a[0], b[0], f"{what}: logits")
    assert a[1].keys() == b[1].keys(), f"{what}: different parameters got gradients"
    for n in a[1]:
        assert_same_bits(a[1][n], b[1][n], f"{what}: grad of {n}")


def profile_with(base: str, **sites):
    """A profile like shipped ``base`` with some sites changed (region.site=value); synthetic."""
    prof = get_profile(base)
    points = {}
    for r, spec in REGIONS.items():
        p = dict(prof.point(r))
        p.update({k.split(".", 1)[1]: v for k, v in sites.items() if k.split(".", 1)[0] == r})
        points[r] = spec.point(p)
    return make_profile(
        engine=prof.engine.model_copy(update={"name": "synthetic"}), dtype=prof.dtype, points=points,
        provenance=dict(date="2026-12-02T00:00:00Z", probe_version="1", package_version="0.1.0", method="synthetic",
                        command="pytest"),
    )


@pytest.fixture(scope="module")
def models():
    """One tiny model per family (fresh copies are cheap; these are for read-only use)."""
    return {f: tiny_model(f, seed=1) for f in FAMILIES}


# -- what HF computes, and the identity ----------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_native_points_are_what_the_installed_transformers_computes(family, models):
    probed, _ = run_probe(TransformersAdapter(model=models[family]), seed=3, regions=list(REGIONS))
    for r in REGIONS:
        assert probed.point(r) == REGIONS[r].canonicalize(NATIVE[r]), r
        assert probed.entry(r).evidence.match_rate == 1.0
    shipped = get_profile(TRANSFORMERS_PROFILE)
    assert all(shipped.point(r) == probed.point(r) for r in REGIONS)


@pytest.mark.parametrize("family", FAMILIES)
def test_applying_the_installed_transformers_profile_changes_no_bit_of_logits_or_gradients(family):
    model = tiny_model(family, seed=1)
    model.train()
    ids = tiny_inputs(model, 24, batch=2, seed=3)
    probed, _ = run_probe(TransformersAdapter(model=model), seed=3, regions=list(REGIONS))  # installed transformers
    before = fwd_bwd(model, ids)
    with emulator.apply_profile(model, probed) as handle:
        assert handle.emulated == () and handle.native == tuple(REGIONS)
        assert_same_step(fwd_bwd(model, ids), before, "patched with the transformers profile")


@pytest.mark.parametrize("family", FAMILIES)
def test_emulating_every_region_at_the_transformers_profile_reproduces_hf_logits_bitwise(family):
    model = tiny_model(family, seed=1)
    model.train()
    ids = tiny_inputs(model, 24, batch=2, seed=3)
    hf_logits, hf_grads = fwd_bwd(model, ids)
    with emulator.apply_profile(model, TRANSFORMERS_PROFILE, skip_native=False) as handle:
        assert handle.emulated == tuple(REGIONS)
        logits, grads = fwd_bwd(model, ids)
    # The forward runs entirely through the emulator (residual path included) and is HF's, bit for
    # bit. The backward is the emulator's straight-through FP32 gradient, not HF's BF16 autograd
    # chain, so it differs by rounding noise only: every parameter gets a gradient close to HF's.
    assert_same_bits(logits, hf_logits, "logits")
    assert grads.keys() == hf_grads.keys()
    for n, g in grads.items():
        ref = hf_grads[n].float()
        assert torch.isfinite(g).all() and g.abs().max() > 0, n
        rel = float((g.float() - ref).norm() / ref.norm())
        assert rel < 2e-2, f"{n}: gradient differs from HF's by {rel:.3g} (relative)"


@pytest.mark.parametrize("profile", ENGINE_PROFILES)
@pytest.mark.parametrize("family", FAMILIES)
def test_native_regions_and_emulated_regions_compute_the_same_forward(family, profile):
    # skip_native keeps HF's module where the profile's point is HF's own; it must not change a bit.
    model = tiny_model(family, seed=2)
    ids = tiny_inputs(model, 20, batch=2, seed=4)
    with torch.no_grad():
        with emulator.apply_profile(model, profile) as h:
            kept = model(ids).logits
        with emulator.apply_profile(model, profile, skip_native=False):
            emulated = model(ids).logits
        plain = model(ids).logits
    assert_same_bits(kept, emulated, f"{profile} {h.native} native vs emulated")
    assert not torch.equal(kept, plain), "the profile should change the logits of this model"


# -- the engine's residual path -------------------------------------------------------------------


def engine_forward(model, ids, prof):
    """The engine's layer semantics, written out: layer 0 plain norm, the residual add fused into
    every later norm and the final one, the residual kept in the profile's precision."""
    act = torch.bfloat16
    dec = model.model
    h = dec.embed_tokens(ids)
    pos = torch.arange(ids.shape[1]).unsqueeze(0)
    pe = dec.rotary_emb(h, pos)
    m = residual = None
    for i, layer in enumerate(dec.layers):
        ln = layer.input_layernorm
        if i == 0:
            residual = h
            x = F.rmsnorm(h, ln.weight, ln.variance_epsilon, prof).to(act)
        else:
            x, residual = F.add_rmsnorm(m, residual, ln.weight, ln.variance_epsilon, prof)
        a, _ = layer.self_attn(hidden_states=x, position_embeddings=pe, attention_mask=None)
        ln = layer.post_attention_layernorm
        x2, residual = F.add_rmsnorm(a, residual, ln.weight, ln.variance_epsilon, prof)
        m = layer.mlp(x2)
    out, _ = F.add_rmsnorm(m, residual, dec.norm.weight, dec.norm.variance_epsilon, prof)
    return model.lm_head(out), residual.dtype


FP32_STREAM = dict(**{"add_rmsnorm.residual_out": "fp32", "rmsnorm.output": "fp32"})


def test_mistral_hands_its_configs_sliding_window_to_the_attention_function():
    # Mistral's attention passes config.sliding_window to HF's attention function (flash attention
    # windows by it; sdpa and eager by the mask the model builds); the patched attention must too.
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    seen = []

    def recording(module, q, k, v, mask, **kw):
        seen.append(kw.get("sliding_window"))
        return sdpa_attention_forward(module, q, k, v, mask, **kw)

    AttentionInterface.register("test_recording_window", recording)
    AttentionMaskInterface.register("test_recording_window", sdpa_mask)  # the windowed mask, as for sdpa
    model = tiny_model("mistral", seed=2, sliding_window=8, attn_implementation="test_recording_window")
    ids = tiny_inputs(model, 20, batch=2, seed=4)
    with torch.no_grad():
        hf = model(ids).logits
        assert seen and set(seen) == {8}
        seen.clear()
        with emulator.apply_profile(model, TRANSFORMERS_PROFILE, skip_native=False) as h:
            assert "rope" in h.emulated  # the patched attention runs
            patched = model(ids).logits
        assert seen and set(seen) == {8}
        model.config.sliding_window = None
        full = model(ids).logits
    assert_same_bits(patched, hf, "patched vs HF, sliding window 8")
    assert not torch.equal(full, hf), "20 tokens and a window of 8: the window should change the logits"


@pytest.mark.parametrize("profile", [*ENGINE_PROFILES, "fp32-residual-stream"])
@pytest.mark.parametrize("family", FAMILIES)
def test_patched_layers_run_the_engines_residual_path(family, profile):
    prof = profile_with(ALL_EMULATED, **FP32_STREAM) if profile == "fp32-residual-stream" else get_profile(profile)
    model = tiny_model(family, seed=5, num_hidden_layers=3)
    ids = tiny_inputs(model, 17, batch=2, seed=6)
    with torch.no_grad(), emulator.apply_profile(model, prof, skip_native=False):
        out = model(ids, output_hidden_states=True)
        want, stream = engine_forward(model, ids, prof)
    assert_same_bits(out.logits, want, "patched model vs the engine's layer semantics")
    # Between layers the hidden state is m + residual in the residual's precision.
    assert [h.dtype for h in out.hidden_states[1:-1]] == [stream] * 2
    fp32_stream = prof.point("add_rmsnorm")["residual_out"] == "fp32"  # e.g. the in-situ vLLM profiles
    assert stream == (torch.float32 if fp32_stream else torch.bfloat16)


def test_qwen3_qk_norm_hands_its_fp32_output_to_rope():
    prof = profile_with(ALL_EMULATED, **FP32_STREAM)
    model = tiny_model("qwen3", seed=7)
    _register_capture()
    attn = model.model.layers[0].self_attn
    g = torch.Generator().manual_seed(8)
    x = torch.randn(1, 9, model.config.hidden_size, generator=g).to(torch.bfloat16)
    pos = torch.arange(9).unsqueeze(0) * 997
    with torch.no_grad(), emulator.apply_profile(model, prof):
        old, attn.config._attn_implementation = attn.config._attn_implementation, CAPTURE
        try:
            attn(hidden_states=x, position_embeddings=model.model.rotary_emb(x, pos), attention_mask=None)
        finally:
            attn.config._attn_implementation = old
        q = attn.__dict__.pop("_engineprofiles_qk")[0].transpose(1, 2)
        qn = rmsnorm_ref(attn.q_proj(x).view(1, 9, -1, attn.head_dim), attn.q_norm.weight, 1e-6, prof.point("rmsnorm"),
                         dtype=torch.bfloat16)
    assert qn.dtype == torch.float32
    cos, sin = rope_cos_sin(pos, attn.head_dim, model.config.rope_parameters["rope_theta"])
    assert_same_bits(q, rope_ref(qn, cos, sin, prof.point("rope"), dtype=torch.bfloat16), "q after norm + rope")
    rounded_first = rope_ref(round_to(qn, torch.bfloat16).to(torch.bfloat16), cos, sin, prof.point("rope"))
    assert not torch.equal(q, rounded_first), "the test inputs cannot tell an FP32 hand-off from a rounded one"


def test_a_later_layer_fed_a_foreign_hidden_state_refuses_to_guess():
    model = tiny_model("qwen2", seed=1)
    with emulator.apply_profile(model, ALL_EMULATED):
        x = torch.randn(1, 5, model.config.hidden_size).to(torch.bfloat16)
        pos = torch.arange(5).unsqueeze(0)
        with pytest.raises(ResidualStreamLost, match="model.layers.1"):
            model.model.layers[1](x, position_ids=pos, position_embeddings=model.model.rotary_emb(x, pos))
        with pytest.raises(ResidualStreamLost, match="model.norm"):
            model.model.norm(x)


def test_the_stash_holds_nothing_after_a_forward():
    model = tiny_model("llama", seed=1)
    ids = tiny_inputs(model, 16)
    with emulator.apply_profile(model, ALL_EMULATED) as h:
        with torch.no_grad():
            model(ids)
        assert len(h._stashes[0]) == 0
        model.train()
        out = model(ids, labels=ids)
        out.loss.backward()
        del out
        model(ids[:, :4])  # the next forward drops whatever the last one left
        assert len(h._stashes[0]) == 0


# -- training ------------------------------------------------------------------------------------


@pytest.mark.parametrize("reentrant", [True, False])
def test_gradient_checkpointing_recomputes_the_same_bits(reentrant):
    model = tiny_model("qwen3", seed=1)
    model.train()
    ids = tiny_inputs(model, 24, batch=2, seed=3)
    with emulator.apply_profile(model, profile_with(ALL_EMULATED, **FP32_STREAM)):
        plain = fwd_bwd(model, ids)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        assert all(layer.gradient_checkpointing for layer in model.model.layers)
        checkpointed = fwd_bwd(model, ids)
        model.gradient_checkpointing_disable()
    assert_same_step(checkpointed, plain, f"gradient checkpointing (use_reentrant={reentrant})")


def test_a_peft_lora_model_is_patched_by_module_class():
    import peft  # a test dependency (scripts/requirements-dev.txt): missing is a failure, not a skip
    base = tiny_model("qwen3", seed=1)
    ids = tiny_inputs(base, 16, batch=2, seed=2)
    with torch.no_grad(), emulator.apply_profile(base, ALL_EMULATED):
        want = base(ids).logits
    cfg = peft.LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj", "gate_proj", "down_proj"], lora_dropout=0.0)
    model = peft.get_peft_model(tiny_model("qwen3", seed=1), cfg)
    model.train()
    before = fwd_bwd(model, ids)
    with emulator.apply_profile(model, ALL_EMULATED) as h:
        assert any(p.startswith("base_model.model.model.layers.1") for p in h.modules)
        with torch.no_grad():
            assert_same_bits(model(ids).logits, want, "LoRA (B = 0) on the patched model")
        _, grads = fwd_bwd(model, ids)
        lora = [n for n in grads if "lora_" in n]
        assert len(lora) == 2 * 5 * model.config.num_hidden_layers
        assert all(grads[n].abs().max() > 0 for n in lora if "lora_B" in n)
    assert_same_step(fwd_bwd(model, ids), before, "PEFT model after remove()")


def test_fsdp2_fully_shard_on_cpu_over_gloo_gives_the_unsharded_bits(tmp_path):
    out = tmp_path / "fsdp.pt"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "tests.emulator.fsdp_worker", "qwen3", ALL_EMULATED, str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"FSDP2 run failed:\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    got = torch.load(out)
    from .fsdp_worker import batch

    model = tiny_model("qwen3", seed=1)
    model.train()
    ids = batch(model)
    with emulator.apply_profile(model, ALL_EMULATED) as h:
        want = fwd_bwd(model, ids)
    for order in ("patch-then-shard", "shard-then-patch"):
        assert got[order]["emulated"] == h.emulated == tuple(REGIONS)
        assert_same_step((got[order]["logits"], got[order]["grads"]), want, f"FSDP2 ({order})")


def test_generation_with_a_kv_cache_runs_on_a_patched_model():
    model = tiny_model("qwen2", seed=1)
    ids = tiny_inputs(model, 8)
    with emulator.apply_profile(model, ALL_EMULATED):
        out = model.generate(ids, max_new_tokens=4, do_sample=False)
        full = model(out[:, :-1]).logits.argmax(-1)[:, ids.shape[1] - 1:]
    assert out.shape == (1, 12)
    # Greedy decoding picked, at each step, the argmax of the patched model on its own prefix.
    assert torch.equal(full, out[:, ids.shape[1]:])


# -- revert --------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_remove_restores_the_original_model_bit_for_bit(family):
    model = tiny_model(family, seed=1)
    model.train()
    ids = tiny_inputs(model, 24, batch=2, seed=3)
    state = model_state(model)
    before = fwd_bwd(model, ids)
    # Every region emulated, an FP32 residual stream, FP32 q/k norm outputs: every binding and hook.
    handle = emulator.apply_profile(model, profile_with(ALL_EMULATED, **FP32_STREAM), skip_native=False)
    assert handle.active and len(dict(patched_modules(model))) == len(handle.modules)
    fwd_bwd(model, ids)
    handle.remove()
    handle.remove()  # idempotent
    assert not handle.active and not dict(patched_modules(model))
    assert_untouched(model, state)
    assert_same_step(fwd_bwd(model, ids), before, "after remove()")


def test_the_handle_is_a_context_manager_and_says_what_it_patched():
    model = tiny_model("qwen3", seed=1)
    with emulator.apply_profile(model, "sglang-0.5.23-cpu-eager-bfloat16") as h:
        assert isinstance(h, emulator.PatchHandle)
        assert h.emulated == ("add_rmsnorm", "rmsnorm") and h.native == ("rope", "swiglu")
        assert "model.layers.0.self_attn.q_norm" in h.modules and "model.norm" in h.modules
        assert "sglang-0.5.23" in repr(h) and "active" in repr(h)
    assert not dict(patched_modules(model))


# -- choosing the profile by engine name (issue 14) ------------------------------------------------


def _expected_vllm_choice():
    """What apply_profile(model, "vllm") should pick among the shipped profiles on this machine with
    vLLM not installed: the newest version's compiled (inductor) BF16 CPU profile, in situ; and
    whether it was probed on this CPU's capability (else a CapabilityMismatch warning)."""
    from engineprofiles.select import Candidate, version_key
    from engineprofiles.store import shipped_profiles

    here = torch.backends.cpu.get_cpu_capability()
    vllm = [Candidate.of(n, p) for n, p in shipped_profiles()]
    vllm = [c for c in vllm if c.engine == "vllm" and c.mode == "inductor" and c.backend == "cpu" and c.dtype == "bfloat16"]
    newest = max((c.version for c in vllm), key=version_key)
    newest_here = [c for c in vllm if c.version == newest and c.capability == here]
    pool = newest_here or [c for c in vllm if c.version == newest]
    insitu = [c for c in pool if c.method == "in-situ"]
    [chosen] = insitu or pool
    return chosen.name, bool(newest_here)


@pytest.mark.parametrize("capability", [None, "AVX2", "AVX512"], ids=["this-cpu", "as-AVX2", "as-AVX512"])
def test_apply_profile_of_an_engine_name_patches_with_the_shipped_profile_that_fits(capability, monkeypatch, caplog):
    import logging
    import warnings

    from engineprofiles import store
    from engineprofiles.errors import CapabilityMismatch, MismatchedProfile

    monkeypatch.delenv(store.ENV_VAR, raising=False)
    monkeypatch.setattr(store, "installed_version", lambda engine: None)  # as where vLLM is not installed
    if capability is not None:  # this machine as if it had another vector ISA
        monkeypatch.setattr("torch.backends.cpu.get_cpu_capability", lambda: capability)
    name, probed_here = _expected_vllm_choice()
    cap = torch.backends.cpu.get_cpu_capability()  # this machine's, or the one it is made to report
    assert name.endswith("-insitu") or name.endswith(f"-insitu-{cap.lower()}"), (name, cap)
    model = tiny_model("qwen2", seed=1)
    ids = tiny_inputs(model, 12)
    with caplog.at_level(logging.INFO, logger="engineprofiles.select"), warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with emulator.apply_profile(model, "vllm") as h:
            with torch.no_grad():
                got = model(ids).logits
    assert h.profile == get_profile(name)
    w = [x for x in w if issubclass(x.category, MismatchedProfile)]
    assert [x.category for x in w] == ([] if probed_here else [CapabilityMismatch])
    assert all(x.filename == __file__ and name in str(x.message) for x in w)
    assert any(f"{name} chosen for 'vllm'" in r.getMessage() for r in caplog.records)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", CapabilityMismatch)
        with emulator.apply_profile(model, name):
            assert_same_bits(model(ids).logits, got, "the chosen profile by its name")


def test_apply_profile_of_an_engine_name_takes_the_models_dtype(tmp_path, monkeypatch):
    from engineprofiles import store
    from engineprofiles.errors import NoMatchingProfile, UnknownEngine

    monkeypatch.setattr(store, "installed_version", lambda engine: None)
    monkeypatch.setattr("torch.backends.cpu.get_cpu_capability", lambda: "AVX512")
    d = tmp_path / "profiles"
    for dtype in ("bfloat16", "float16"):
        p = get_profile(ALL_EMULATED)
        p.model_copy(update={"dtype": dtype}).save(d / f"{dtype}.yaml")
    monkeypatch.setenv(store.ENV_VAR, str(d))
    model = tiny_model("llama", seed=1, dtype="float16")
    with emulator.apply_profile(model, "vllm") as h:
        assert h.profile.dtype == "float16"
    # FP32 weights are mixed precision's master weights: the compute dtype is autocast's, else unknown
    # (bfloat16 preferred).
    model = tiny_model("llama", seed=1, dtype="float32")
    with emulator.apply_profile(model, "vllm") as h:
        assert h.profile.dtype == "bfloat16"
    with torch.autocast("cpu", dtype=torch.float16), emulator.apply_profile(model, "vllm") as h:
        assert h.profile.dtype == "float16"
    model = tiny_model("llama", seed=1, dtype="float64")
    state = model_state(model)
    with pytest.raises(NoMatchingProfile, match="float64 .the model's dtype.*bfloat16, float16"):
        emulator.apply_profile(model, "vllm")
    with pytest.raises(UnknownEngine, match="'vlm'"):
        emulator.apply_profile(model, "vlm")
    assert_untouched(model, state)


# -- refusals: each leaves the model untouched ----------------------------------------------------


def test_an_unsupported_model_is_refused_with_the_supported_families():
    from transformers import GemmaConfig, GemmaForCausalLM

    cfg = GemmaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    model = GemmaForCausalLM(cfg).to(torch.bfloat16)
    state = model_state(model)
    with pytest.raises(UnsupportedModel) as e:
        emulator.apply_profile(model, ALL_EMULATED)
    for text in ("GemmaForCausalLM", "qwen2", "Qwen2.5", "qwen3", "llama", "LlamaModel", "mistral", "MistralModel"):
        assert text in str(e.value)
    assert_untouched(model, state)
    with pytest.raises(UnsupportedModel):
        emulator.apply_profile(torch.nn.Linear(4, 4), ALL_EMULATED)


@pytest.mark.parametrize("bad", [None, "Qwen2ForCausalLM", 5, torch.zeros(2)], ids=["None", "str", "int", "tensor"])
def test_something_that_is_not_a_model_is_refused_with_a_typed_error(bad):
    with pytest.raises(UnsupportedModel, match="torch.nn.Module"):
        emulator.apply_profile(bad, "vllm-0.32.0-cpu-inductor-bfloat16")


@pytest.mark.parametrize("bad", [None, 5, REGIONS["rope"].all_points()[0], {"dtype": "bfloat16"}],
                         ids=["None", "int", "Point", "dict"])
def test_a_profile_argument_of_the_wrong_type_is_refused_and_the_model_untouched(bad):
    model = tiny_model("qwen2", seed=1)
    before = model_state(model)
    with pytest.raises(ProfileMismatch, match="a Profile, a path or a shipped name"):
        emulator.apply_profile(model, bad)
    assert_untouched(model, before)


def test_a_binary_profile_file_is_a_profile_error_and_the_model_untouched(tmp_path):
    from engineprofiles.errors import ProfileError

    model = tiny_model("qwen2", seed=1)
    before = model_state(model)
    f = tmp_path / "p.yaml"
    f.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe")
    with pytest.raises(ProfileError, match="UTF-8"):
        emulator.apply_profile(model, f)
    assert_untouched(model, before)


def test_a_profile_of_another_dtype_is_refused():
    # (FP32 weights are accepted as mixed precision's master weights: test_mixed_precision.py.)
    for dtype in ("float16", "float64"):
        model = tiny_model("llama", seed=1, dtype=dtype)
        state = model_state(model)
        with pytest.raises(ProfileMismatch, match=rf"{dtype}.*bfloat16"):
            emulator.apply_profile(model, ALL_EMULATED)
        assert_untouched(model, state)
    model = tiny_model("llama", seed=1)
    fp16 = get_profile(ALL_EMULATED).model_copy(update={"dtype": "float16"})
    state = model_state(model)
    with pytest.raises(ProfileMismatch, match="float16"):
        emulator.apply_profile(model, fp16)
    assert_untouched(model, state)


def test_a_profile_with_an_unavailable_region_is_refused():
    prof = get_profile(ALL_EMULATED)
    points = {r: prof.point(r) for r in REGIONS}
    points["swiglu"] = None
    bad = make_profile(engine=prof.engine, dtype="bfloat16", points=points,
                       evidence={"swiglu": {"reason": "no SiluAndMul kernel on this device"}},
                       provenance=prof.provenance)
    model = tiny_model("qwen2", seed=1)
    state = model_state(model)
    with pytest.raises(RegionUnavailable, match="swiglu.*no SiluAndMul kernel"):
        emulator.apply_profile(model, bad)
    assert_untouched(model, state)


@pytest.mark.parametrize("change", ["rope_type", "attention_scaling", "replaced_mlp", "gelu", "instance_forward"])
def test_a_model_the_patch_cannot_reproduce_is_refused(change):
    if change == "rope_type":
        model = tiny_model("qwen2", seed=1, rope_parameters={
            "rope_type": "longrope", "factor": 4.0, "rope_theta": 1e6, "original_max_position_embeddings": 4096,
            "short_factor": [1.0] * 32, "long_factor": [2.0] * 32})
        match = "rope_type 'longrope' is not supported .*two sets of frequencies.*supported: default, linear, llama3"
    else:
        model = tiny_model("qwen2", seed=1, **({"hidden_act": "gelu"} if change == "gelu" else {}))
        match = {"attention_scaling": "attention_scaling", "replaced_mlp": r"model.layers.1.mlp is a Sequential",
                 "gelu": "hidden_act is 'gelu'", "instance_forward": "per-instance forward"}[change]
    if change == "attention_scaling":
        model.model.rotary_emb.attention_scaling = 0.5
    if change == "replaced_mlp":
        model.model.layers[1].mlp = torch.nn.Sequential()
    if change == "instance_forward":
        mlp = model.model.layers[1].mlp
        mlp.forward = mlp.forward  # what accelerate's hooks do: a bound forward on the instance
    state = model_state(model)
    with pytest.raises(UnsupportedModel, match=match):
        emulator.apply_profile(model, ALL_EMULATED)
    assert_untouched(model, state)


def test_applying_twice_is_an_error_and_keeps_the_first_patch():
    model = tiny_model("qwen3", seed=1)
    ids = tiny_inputs(model, 12)
    for first in (ALL_EMULATED, TRANSFORMERS_PROFILE):  # the second patches no forward at all
        with emulator.apply_profile(model, first) as h:
            with torch.no_grad():
                want = model(ids).logits
            state = model_state(model)
            for second in (first, "sglang-0.5.23-cpu-eager-bfloat16"):
                with pytest.raises(AlreadyPatched, match="remove"):
                    emulator.apply_profile(model, second)
            assert_untouched(model, state)
            with torch.no_grad():
                assert_same_bits(model(ids).logits, want, "first patch after a refused second one")
            assert h.active


def test_a_model_whose_rope_frequencies_were_rounded_gets_the_engines_fp32_frequencies():
    # model.to(torch.bfloat16) rounds HF's FP32 inv_freq buffer; engines use FP32 frequencies, so
    # the patch runs RoPE from rope_theta even where HF's RoPE has the profile's rounding sites.
    model = tiny_model("llama", seed=1)
    ids = tiny_inputs(model, 64, seed=2)
    pos = torch.arange(64).unsqueeze(0) * 600  # positions where rounded frequencies matter
    with torch.no_grad():
        want = model(ids, position_ids=pos).logits
        model.to(torch.bfloat16)
        assert model.model.rotary_emb.inv_freq.dtype == torch.bfloat16
        assert not torch.equal(model(ids, position_ids=pos).logits, want)
        with emulator.apply_profile(model, TRANSFORMERS_PROFILE) as h:
            assert h.emulated == ("rope",)
            assert_same_bits(model(ids, position_ids=pos).logits, want, "FP32 frequencies restored by the patch")


# -- scaled RoPE (rope_type llama3, linear, yarn) ----------------------------------------------------

ROPE_SCALED = {
    "llama3": dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192),
    "linear": dict(rope_type="linear", rope_theta=500000.0, factor=3.0),
    "yarn": dict(rope_type="yarn", rope_theta=500000.0, factor=4.0, original_max_position_embeddings=10240),
}
ENGINE_INSITU = "vllm-0.32.0-cpu-inductor-bfloat16-insitu"


def _scaled(family, scaling, **kw):
    return tiny_model(family, seed=1, rope_parameters=dict(ROPE_SCALED[scaling]), **kw)


@pytest.mark.parametrize("scaling", sorted(ROPE_SCALED))
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_scaled_rope_at_the_transformers_profile_is_hfs_forward_bit_for_bit(family, scaling):
    model = _scaled(family, scaling)
    ids = tiny_inputs(model, 48, seed=2)
    pos = torch.arange(48).unsqueeze(0) * 700  # long-range positions, where the scaled frequencies matter
    with torch.no_grad():
        hf = model(ids, position_ids=pos).logits
        assert not torch.equal(hf, tiny_model(family, seed=1)(ids, position_ids=pos).logits), "scaling changes nothing"
        with emulator.apply_profile(model, TRANSFORMERS_PROFILE) as h:
            assert h.emulated == ()  # HF's frequencies are the trainer's own: nothing to change
        with emulator.apply_profile(model, TRANSFORMERS_PROFILE, skip_native=False) as h:
            assert "rope" in h.emulated
            assert_same_bits(model(ids, position_ids=pos).logits, hf, f"{scaling}: emulated at HF's own point")


@pytest.mark.parametrize("scaling", sorted(ROPE_SCALED))
def test_scaled_rope_patched_rotary_embedding_hands_on_the_engines_fp32_cos_sin(scaling):
    from engineprofiles.regions import RopeFrequencies

    model = _scaled("llama", scaling)
    rot = model.model.rotary_emb
    x = torch.zeros(1, dtype=torch.float32)  # HF's rotary embedding returns cos/sin in x's dtype
    pos = torch.arange(0, 50000, 13).unsqueeze(0)
    hf_cos, hf_sin = rot(x, pos)
    want = RopeFrequencies.from_parameters(model.config.head_dim, ROPE_SCALED[scaling]).cos_sin(pos)
    with emulator.apply_profile(model, ENGINE_INSITU) as h:
        assert "rope" in h.emulated
        cos, sin = rot(x, pos)
    half = cos.shape[-1] // 2
    assert cos.dtype == torch.float32
    assert_same_bits(cos[..., :half], want[0], "cos") and assert_same_bits(sin[..., :half], want[1], "sin")
    if scaling in ("llama3", "yarn"):  # HF computes the engines' llama3 and YaRN cos/sin (YaRN's scaled)
        assert_same_bits(cos, hf_cos, "HF's cos") and assert_same_bits(sin, hf_sin, "HF's sin")
    else:  # HF divides the frequencies by the factor (3), the engines the position: they round apart
        assert not torch.equal(cos, hf_cos)


def test_a_llama3_model_whose_frequencies_were_rounded_gets_the_engines_fp32_llama3_frequencies():
    model = _scaled("llama", "llama3")
    ids = tiny_inputs(model, 48, seed=2)
    pos = torch.arange(48).unsqueeze(0) * 700
    with torch.no_grad():
        want = model(ids, position_ids=pos).logits
        model.to(torch.bfloat16)
        assert not torch.equal(model(ids, position_ids=pos).logits, want)
        with emulator.apply_profile(model, TRANSFORMERS_PROFILE) as h:
            assert h.emulated == ("rope",)
            assert_same_bits(model(ids, position_ids=pos).logits, want, "FP32 llama3 frequencies restored")


def test_a_yarn_model_for_an_sglang_profile_scales_cos_sin_as_sglang_does():
    """SGLang 0.5.23 ignores YaRN's attention_factor (its factor's own mscale: measured on its rotary cache,
    tests/engines/test_rope_scaling_engine.py); the trainer follows the profile's engine, HF's own RoPE is
    then replaced."""
    from engineprofiles.regions import RopeFrequencies

    params = dict(ROPE_SCALED["yarn"], attention_factor=1.25)
    model = tiny_model("llama", seed=1, rope_parameters=params)
    rot = model.model.rotary_emb
    assert rot.attention_scaling == 1.25
    x, pos = torch.zeros(1, dtype=torch.float32), torch.arange(0, 5000, 7).unsqueeze(0)
    hf_cos, _ = rot(x, pos)
    sg = RopeFrequencies.from_parameters(model.config.head_dim, params, attention_factor=False)
    assert sg.mscale != 1.25
    with emulator.apply_profile(model, "sglang-0.5.23-cpu-eager-bfloat16") as h:
        assert "rope" in h.emulated
        cos, _ = rot(x, pos)
    assert_same_bits(cos[..., : cos.shape[-1] // 2], sg.cos_sin(pos)[0], "SGLang's cos")
    assert not torch.equal(cos, hf_cos)


@pytest.mark.parametrize("profile,engine", [("vllm-0.32.0-cpu-inductor-bfloat16-insitu", "vllm"),
                                            ("sglang-0.5.23-cpu-eager-bfloat16", "sglang")])
def test_a_dynamic_rope_model_rotates_by_the_profile_engines_fixed_base(profile, engine):
    from engineprofiles.regions import RopeFrequencies

    params = dict(rope_type="dynamic", rope_theta=500000.0, factor=2.0)
    model = tiny_model("llama", seed=1, rope_parameters=params)
    rot = model.model.rotary_emb
    x, pos = torch.zeros(1, dtype=torch.float32), torch.arange(0, 4000, 9).unsqueeze(0)
    want = RopeFrequencies.from_parameters(model.config.head_dim, params, dynamic=engine,
                                           max_position_embeddings=model.config.max_position_embeddings)
    with emulator.apply_profile(model, profile, skip_native=False) as h:
        assert "rope" in h.emulated
        cos, sin = rot(x, pos)
    half = cos.shape[-1] // 2
    assert_same_bits(cos[..., :half], want.cos_sin(pos)[0], f"{engine}'s cos")
    # HF's convention (a transformers profile): its own base within the original context, where HF's rotary
    # embedding gives the same cos/sin; beyond it HF rescales, which the emulator refuses to guess
    hf_cos, _ = rot(x, pos)
    with emulator.apply_profile(model, TRANSFORMERS_PROFILE, skip_native=False) as h:
        assert "rope" in h.emulated
        assert_same_bits(rot(x, pos)[0], hf_cos, "HF's own cos within the original context")
        with pytest.raises(ValueError, match="rescales its frequencies"):
            rot(x, torch.tensor([[0, model.config.max_position_embeddings]]))
