"""Mixed precision as trainers run it (issue 16): the profile's dtype is the compute dtype, whatever the
master weights are stored in. FP32 master weights under torch.autocast(bfloat16) (HF/TRL ``bf16=True``)
and under FSDP2's MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32) (verl's default),
with and without cast_forward_inputs, compute bit for bit what the same model stored in bfloat16
computes (the weights rounded to nearest even, as ``.to(torch.bfloat16)`` rounds them)."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch

import emulator
from emulator.errors import ProfileMismatch
from emulator.patching import ResidualStreamLost
from emulator.patching import carry as carry_mod
from engineprofiles.models import tiny_inputs, tiny_model
from engineprofiles.regions import REGIONS

from .helpers import assert_same_bits, on_this_machine
from .test_patching import ALL_EMULATED, FP32_STREAM, ROOT, profile_with

FAMILIES = ("qwen2", "qwen3", "llama", "mistral")
INSITU = "vllm-0.32.0-cpu-inductor-bfloat16-insitu"  # an FP32 residual stream: the cast hazard
# Every hazard at once: an FP32 residual stream between layers, Qwen3's q/k norms handing FP32 to RoPE,
# and RoPE with FP32 cos/sin (a cast of them would round them).
HAZARDS = dict(**FP32_STREAM, **{"rope.cos_sin": "fp32"})


def master_and_bf16(family, **kw):
    """An FP32 model (the master weights) and the same model stored in bfloat16: its parameters
    rounded to nearest even, its buffers (RoPE's FP32 inv_freq) as they are."""
    master = tiny_model(family, seed=1, dtype="float32", **kw)
    ref = copy.deepcopy(master)
    for p in ref.parameters():
        p.data = p.data.to(torch.bfloat16)
    assert not all(torch.equal(p.to(torch.bfloat16).float(), p) for p in master.parameters()), \
        "the master weights should not be representable in bfloat16 (else rounding them is not tested)"
    return master, ref


def step(model, ids, autocast=False):
    """Logits, hidden states after each layer, loss and every parameter's gradient of one training step
    (the backward outside autocast, as torch recommends and HF's Trainer does)."""
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(ids, labels=ids, output_hidden_states=True)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return out.logits.detach(), [h.detach() for h in out.hidden_states[1:]], out.loss.detach(), grads


@pytest.mark.parametrize("profile", [INSITU, "hazards"])
@pytest.mark.parametrize("family", FAMILIES)
def test_autocast_over_fp32_master_weights_computes_the_bf16_models_bits(family, profile):
    prof = profile_with(ALL_EMULATED, **HAZARDS) if profile == "hazards" else profile
    master, ref = master_and_bf16(family)
    master.train(), ref.train()
    ids = tiny_inputs(ref, 16, batch=2, seed=3)
    with emulator.apply_profile(ref, prof, skip_native=False):
        want = step(ref, ids)
    with emulator.apply_profile(master, prof) as h:
        assert h.emulated == tuple(REGIONS) and h.native == ()  # FP32 weights: every region emulated
        got = step(master, ids, autocast=True)
    assert_same_bits(got[0], want[0], "logits")
    for i, (g, w) in enumerate(zip(got[1], want[1])):
        assert_same_bits(g, w, f"hidden state after layer {i}")
    assert_same_bits(got[2], want[2], "loss")
    # Every gradient is the BF16 model's (in FP32, the master weights' dtype), but the embedding's:
    # autocast does not cast an embedding, so its gradient rows are summed over repeated tokens in
    # FP32 where the BF16 model sums them in BF16 (a different rounding, not a site of the profile).
    for n, g in got[3].items():
        assert g.dtype == torch.float32, n
        if n == "model.embed_tokens.weight":
            ref_g = want[3][n].float()
            assert float((g - ref_g).norm() / ref_g.norm()) < 1e-2, "embedding gradient far from the BF16 model's"
            continue
        assert_same_bits(g, want[3][n].float(), f"grad of {n}")


def test_a_forward_that_computes_in_fp32_is_refused_with_what_to_do():
    master, _ = master_and_bf16("qwen2")
    ids = tiny_inputs(master, 8)
    with emulator.apply_profile(master, INSITU):
        with pytest.raises(ProfileMismatch, match=r"computes in float32.*torch.autocast.*MixedPrecisionPolicy"):
            with torch.no_grad():
                master(ids)
        with torch.autocast("cpu", dtype=torch.float16), torch.no_grad():  # autocast to another dtype
            with pytest.raises(ProfileMismatch, match="computes in float32"):
                master(ids)
        with torch.no_grad():  # compiled, the same error (not Dynamo's)
            with pytest.raises(ProfileMismatch, match="computes in float32"):
                torch.compile(master)(ids)
    torch._dynamo.reset()


def cast_floating_inputs(module, args, kwargs):
    """What FSDP2's MixedPrecisionPolicy(cast_forward_inputs=True) does before a layer's forward: cast
    every floating tensor among its inputs to the parameters' dtype."""
    def cast(t):
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.bfloat16:
            return t.to(torch.bfloat16)
        if isinstance(t, tuple):
            return tuple(cast(x) for x in t)
        return t

    return cast(args), {k: cast(v) for k, v in kwargs.items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_cast_of_the_residual_stream_and_of_cos_sin_between_layers_changes_no_bit(family, monkeypatch):
    prof = profile_with(ALL_EMULATED, **HAZARDS)
    model = tiny_model(family, seed=1, num_hidden_layers=3)
    model.train()
    ids = tiny_inputs(model, 16, batch=2, seed=3)
    with emulator.apply_profile(model, prof):
        want = step(model, ids)
        assert want[1][0].dtype == torch.float32  # the stream between layers is FP32: a cast rounds it
        hooks = [layer.register_forward_pre_hook(cast_floating_inputs, with_kwargs=True) for layer in model.model.layers]
        got = step(model, ids)
        assert_same_bits(got[0], want[0], "logits with the layers' inputs cast")
        assert want[3].keys() == got[3].keys()
        for n in want[3]:  # the gradient too: the stream's gradient is carried at full precision
            assert_same_bits(got[3][n], want[3][n], f"grad of {n}")
        # Without recognizing the cast, the stream would be lost (the check above is not vacuous).
        monkeypatch.setattr(carry_mod.Stash, "_cast_of", lambda self, t: None)
        with pytest.raises(ResidualStreamLost):
            step(model, ids)
        monkeypatch.undo()
        for hk in hooks:
            hk.remove()


def _hook_changing_the_stream(module, args, kwargs):
    (h, *rest) = args
    return (h.to(torch.bfloat16) * 1.5, *rest), kwargs  # other values than a cast gives


def test_a_stream_changed_other_than_by_a_cast_is_still_refused():
    model = tiny_model("qwen2", seed=1)
    ids = tiny_inputs(model, 8)
    with emulator.apply_profile(model, profile_with(ALL_EMULATED, **FP32_STREAM)):
        model.model.layers[1].register_forward_pre_hook(_hook_changing_the_stream, with_kwargs=True)
        with pytest.raises(ResidualStreamLost, match="model.layers.1"), torch.no_grad():
            model(ids)


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_fsdp2_mixed_precision_over_fp32_master_weights_gives_the_bf16_models_bits(world, tmp_path):
    prof = profile_with(ALL_EMULATED, **HAZARDS)
    path = prof.save(tmp_path / "hazards.yaml")
    out = tmp_path / "fsdp_mp.pt"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "tests.emulator.fsdp_mp_worker", "qwen3", str(path), str(out), str(world)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"FSDP2 run failed:\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    got = torch.load(out)
    from .fsdp_mp_worker import SETUPS, batch

    master, ref = master_and_bf16("qwen3")
    ref.train()
    ids = batch(ref)
    with emulator.apply_profile(ref, prof, skip_native=False):
        want = step(ref, ids)
    assert sorted(got) == sorted(SETUPS)
    for setup, g in got.items():
        what = f"FSDP2 world {world}, cast_forward_inputs={setup[0]}, {setup[1]}"
        assert g["param_dtypes"] == {"torch.float32"}, what  # FP32 master weights
        assert g["emulated"] == tuple(REGIONS), what
        assert_same_bits(g["logits"], want[0], f"{what}: logits")
        for i, (a, b) in enumerate(zip(g["hidden"], want[1])):
            assert_same_bits(a, b, f"{what}: hidden state after layer {i}")
        assert_same_bits(g["loss"], want[2], f"{what}: loss")
        # param_dtype=bf16 computes every gradient in BF16 (the embedding's too: FSDP2 casts its weight),
        # reduce_dtype=fp32 averages the ranks' equal gradients exactly.
        for n, w in want[3].items():
            assert_same_bits(g["grads"][n], w.float(), f"{what}: grad of {n}")


# Exact mode's decoder stack is one graph under autocast too (its first call asks for the hidden
# states: transformers' lazily installed capture hooks once broke that graph): a StackNotCompiled
# warning fails the test.
@pytest.mark.filterwarnings("error::emulator.errors.StackNotCompiled")
@pytest.mark.parametrize("family", ["qwen3", "qwen2"])  # qwen2: biased q/k/v projections (an opaque op when traced)
@pytest.mark.parametrize("exact", [False, True], ids=["regions", "exact"])
def test_exact_mode_and_torch_compile_under_autocast_compute_the_bf16_models_bits(exact, family):
    master, ref = master_and_bf16(family)
    master.train(), ref.train()
    ids = tiny_inputs(ref, 12, batch=2, seed=3)
    with emulator.apply_profile(ref, on_this_machine(INSITU) if exact else INSITU, skip_native=False, exact=exact):
        want = step(ref, ids)
    with emulator.apply_profile(master, on_this_machine(INSITU) if exact else INSITU, exact=exact):
        eager = step(master, ids, autocast=True)
        compiled = step(torch.compile(master), ids, autocast=True)
    torch._dynamo.reset()
    for what, got in (("eager", eager), ("compiled", compiled)):
        assert_same_bits(got[0], want[0], f"{what}: logits")
        assert_same_bits(got[2], want[2], f"{what}: loss")
    assert len(compiled[3]) == len(eager[3])
    for n, g in compiled[3].items():  # compiled: the eager master's gradients, bit for bit
        n = n.removeprefix("_orig_mod.")
        assert_same_bits(g, eager[3][n], f"compiled vs eager under autocast: grad of {n}")
