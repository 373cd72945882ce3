"""torch.compile of a model patched by emulator.apply_profile: the compiled model computes the eager
patched model's bits, forward and backward (logits, the model's own loss, every parameter's
gradient), for each family, with the regions and in exact mode; what makes it so is checked to
matter (the region custom ops, Inductor's emulate_precision_casts); what cannot be made bit-equal
is refused with CompileUnsupported.

Shapes are tiny (compiling is the cost here: ~10 s per model on 2 cores, less from a warm cache).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch._inductor.config as inductor_config

import emulator
from emulator import functional as F
from emulator.errors import BackendError, CompileUnsupported
from emulator.ops._utils import point_from_key
from engineprofiles.models import tiny_inputs, tiny_model
from engineprofiles.store import get_profile, shipped_names

from .helpers import activations, assert_same_bits, on_this_machine

ROOT = Path(__file__).resolve().parents[2]
FAMILIES = ("qwen2", "qwen3", "llama", "mistral")
INSITU = "vllm-0.32.0-cpu-inductor-bfloat16-insitu"  # every region emulated, attention measured
TRANSFORMERS_PROFILE = next(n for n in shipped_names() if n.startswith("transformers-"))  # every region native


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch (Dynamo's caches hold guards on the models of other tests)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def batch(model, tokens=10):
    """Two sequences, the first left-padded (3 tokens), the padding ignored by the loss."""
    ids = tiny_inputs(model, tokens, batch=2, seed=tokens)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    return ids, mask, ids.masked_fill(mask == 0, -100)


def step(run, model, ids, mask, labels):
    """Loss, logits and every parameter's gradient of one training step of ``run`` (the model, or
    the compiled model) on the model's parameters."""
    model.zero_grad(set_to_none=True)
    out = run(ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach().clone(), out.logits.detach().clone(), grads


def assert_same_step(got, want, what):
    assert_same_bits(got[0], want[0], f"{what}: loss")
    assert_same_bits(got[1], want[1], f"{what}: logits")
    assert got[2].keys() == want[2].keys(), f"{what}: different parameters got gradients"
    for n in want[2]:
        assert_same_bits(got[2][n], want[2][n], f"{what}: grad of {n}")


def differing(got, want) -> list[str]:
    """What of a step differs (loss, logits, the names of the parameters whose gradient does)."""
    out = [k for k, a, b in (("loss", got[0], want[0]), ("logits", got[1], want[1])) if not torch.equal(a, b)]
    return out + [n for n in want[2] if not torch.equal(got[2][n], want[2][n])]


# -- bit-equal --------------------------------------------------------------------------------------


# Exact mode compiled in training for Qwen3 only (q/k norms: the richest stack; about 2 minutes a family on the
# 2-core AVX2 machine): the other families' compiled exact stacks are checked against the engine itself in
# tests/engines/test_exact_mode.py.
COMPILE_CASES = [*((f, False) for f in FAMILIES), ("qwen3", True)]


@pytest.mark.parametrize("family,exact", COMPILE_CASES, ids=[f"{f}-{'exact' if e else 'regions'}" for f, e in COMPILE_CASES])
def test_the_compiled_patched_model_is_bit_equal_to_the_eager_patched_model(family, exact):
    model = tiny_model(family, seed=1)
    model.train()
    b = batch(model)
    unpatched = step(model, model, *b)
    with emulator.apply_profile(model, on_this_machine(INSITU) if exact else INSITU, exact=exact) as h:
        assert h.native == ()
        want = step(model, model, *b)
        if exact:
            # with gradients exact mode runs the stack as its own graphs (the inference graph's bits, the
            # training graph's gradient): a graph break in the user's graph, which fullgraph refuses
            with pytest.raises(torch._dynamo.exc.Unsupported, match="without fullgraph=True"):
                step(torch.compile(model, fullgraph=True), model, *b)
            torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=not exact)  # regions: one graph, no region falls back to eager
        got = step(compiled, model, *b)
        assert_same_step(got, want, f"{family} {'exact' if exact else 'regions'}: compiled vs eager")
        assert_same_step(step(compiled, model, *b), want, f"{family}: compiled, second step")
    assert len(want[2]) == len(list(model.parameters()))
    assert differing(want, unpatched), "the patch changes no bit here, so this test could not see it dropped"


@pytest.mark.parametrize("scaling", ["llama3", "linear", "yarn"])
def test_a_compiled_patched_model_with_scaled_rope_is_bit_equal_to_the_eager_one(scaling):
    # The patched rotary embedding's cos/sin are an opaque op under torch.compile; its arguments carry
    # the scaling (a compiled op computing default frequencies would differ at these positions).
    rope = {"llama3": dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                           high_freq_factor=4.0, original_max_position_embeddings=8192),
            "linear": dict(rope_type="linear", rope_theta=500000.0, factor=3.0),
            "yarn": dict(rope_type="yarn", rope_theta=500000.0, factor=4.0, original_max_position_embeddings=10240)
            }[scaling]
    model = tiny_model("llama", seed=1, rope_parameters=rope)
    model.train()
    ids, mask, labels = batch(model, 12)
    pos = (torch.arange(12) * 900).unsqueeze(0).expand(2, -1)

    def run_step(run, model=model):
        model.zero_grad(set_to_none=True)
        out = run(ids, attention_mask=mask, labels=labels, position_ids=pos)
        out.loss.backward()
        return (out.loss.detach().clone(), out.logits.detach().clone(),
                {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
    with emulator.apply_profile(model, INSITU) as h:
        assert "rope" in h.emulated
        want = run_step(model)
        assert_same_step(run_step(torch.compile(model, fullgraph=True)), want, f"{scaling}: compiled vs eager")
    plain = tiny_model("llama", seed=1)  # default RoPE
    plain.train()
    with emulator.apply_profile(plain, INSITU):
        assert differing(run_step(plain, plain), want), "the scaling changes no bit here"


def test_a_new_sequence_length_recompiles_to_the_same_bits():
    model = tiny_model("qwen2", seed=1)
    model.train()
    with emulator.apply_profile(model, INSITU):
        compiled = torch.compile(model)
        for tokens in (10, 7, 13):  # the second length recompiles with dynamic shapes
            b = batch(model, tokens)
            assert_same_step(step(compiled, model, *b), step(model, model, *b), f"{tokens} tokens")


def test_layers_compiled_one_by_one_are_bit_equal():
    # Per-block compilation (as torchtitan does): each layer's input comes from outside its graph.
    model = tiny_model("qwen3", seed=1)
    model.train()
    b = batch(model)
    with emulator.apply_profile(model, INSITU):
        want = step(model, model, *b)
        for layer in model.model.layers:
            layer.compile()
        got = step(model, model, *b)
        for layer in model.model.layers:
            layer._compiled_call_impl = None
    assert_same_step(got, want, "layers compiled one by one")


@pytest.mark.parametrize("how", ["wrapper", "layers"])
def test_a_model_compiled_before_it_is_patched_recompiles_with_the_patch(how):
    model = tiny_model("qwen2", seed=1)
    model.train()
    b = batch(model)
    if how == "wrapper":
        run = torch.compile(model)
    else:
        for layer in model.model.layers:
            layer.compile()
        run = model
    plain = step(run, model, *b)  # compiled without the patch
    with emulator.apply_profile(run, INSITU):  # the wrapper too: its modules are the model's
        got = step(run, model, *b)
        for layer in model.model.layers:
            layer._compiled_call_impl = None
        want = step(model, model, *b)
    assert_same_step(got, want, f"compiled ({how}) before patching")
    assert differing(got, plain)


# -- what makes it bit-equal, checked to matter -----------------------------------------------------


def test_compiling_the_region_code_without_its_custom_ops_is_not_bit_equal(monkeypatch):
    # With the regions traced into the graph (their autograd Functions instead of the custom ops),
    # Inductor compiles the references' reductions and transcendentals its own way. Qwen3 (its q/k norms too): on
    # the AVX2 machine a traced Qwen2 compiled to eager's bits (tiny, and hidden 256; 2026-12-07), Qwen3 did not.
    from emulator.ops.rmsnorm import AddRMSNormFunction, RMSNormFunction
    from emulator.ops.rope import RoPEFunction
    from emulator.ops.swiglu import SwiGLUFunction

    model = tiny_model("qwen3", seed=1)
    model.train()
    b = batch(model, 64)
    with emulator.apply_profile(model, INSITU):
        want = step(model, model, *b)
        assert_same_step(step(torch.compile(model), model, *b), want, "with the custom ops")
        torch._dynamo.reset()
        monkeypatch.setattr(F, "swiglu_op", lambda g, u, key, act, be: SwiGLUFunction.apply(
            g, u, point_from_key(key), act, be))
        monkeypatch.setattr(F, "rmsnorm_op", lambda x, w, eps, key, act, be: RMSNormFunction.apply(
            x, w, eps, point_from_key(key), act, be))
        monkeypatch.setattr(F, "add_rmsnorm_op", lambda x, r, w, eps, key, act, be: AddRMSNormFunction.apply(
            x, r, w, eps, point_from_key(key), act, be))
        monkeypatch.setattr(F, "rope_op", lambda x, c, s, key, st, act, be: RoPEFunction.apply(
            x, c, s, point_from_key(key), st, act, be))
        traced = step(torch.compile(model), model, *b)
    assert differing(traced, want), "compiling the regions' code gave eager's bits: this test cannot tell"


def test_inductor_must_round_like_eager_and_the_patch_holds_it_so():
    model = tiny_model("llama", seed=1)
    model.train()
    b = batch(model)
    before = inductor_config.emulate_precision_casts
    with emulator.apply_profile(model, INSITU) as h1:
        assert inductor_config.emulate_precision_casts is True
        want = step(model, model, *b)
        # Inductor's default keeps BF16 intermediates in FP32 (e.g. the sum of an activation's
        # gradients); the patch refuses that configuration when it traces ...
        with pytest.raises(Exception, match="emulate_precision_casts") as err:
            torch.compile(model, options={"emulate_precision_casts": False})(*b[:1])
        assert isinstance(getattr(err.value, "inner_exception", err.value), CompileUnsupported)
        # ... and it would indeed not be bit-equal (the check bypassed here).
        torch._dynamo.reset()
        import emulator.patching.opaque as opaque

        saved = opaque.check_compile_settings
        opaque.check_compile_settings = lambda: None
        try:
            with inductor_config.patch(emulate_precision_casts=False):
                loose = step(torch.compile(model), model, *b)
        finally:
            opaque.check_compile_settings = saved
        assert differing(loose, want), "Inductor's default rounding gave eager's bits: this test cannot tell"
        other = tiny_model("qwen2", seed=2)
        with emulator.apply_profile(other, INSITU):  # a second patch: held until the last is removed
            pass
        assert inductor_config.emulate_precision_casts is True
    assert not h1.active and inductor_config.emulate_precision_casts == before


def test_removing_the_handle_after_compiling_recompiles_the_plain_model():
    # The compiled model guards on the patched forwards: after remove() it compiles the plain model
    # again (with Inductor's own rounding, emulate_precision_casts as it was before the patch).
    model = tiny_model("llama", seed=1)
    ids = tiny_inputs(model, 10)
    compiled = torch.compile(model)
    with torch.no_grad():
        handle = emulator.apply_profile(model, INSITU)
        patched = compiled(ids).logits
        assert_same_bits(patched, model(ids).logits, "compiled while patched")
        handle.remove()
        after = compiled(ids).logits
        plain = tiny_model("llama", seed=1)
        assert_same_bits(after, torch.compile(plain)(ids).logits, "after remove(): the plain model, compiled")
    assert not torch.equal(after, patched)


# -- refused ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["model", "layer", "fullgraph"])
def test_compiling_a_patch_that_leaves_regions_to_hf_is_refused(how):
    model = tiny_model("qwen2", seed=1)
    ids = tiny_inputs(model, 8)
    with emulator.apply_profile(model, TRANSFORMERS_PROFILE) as h, torch.no_grad():
        assert set(h.native) == {"rope", "swiglu", "add_rmsnorm", "rmsnorm"}
        if how == "layer":
            model.model.layers[1].compile()
            run = model
        else:
            run = torch.compile(model, fullgraph=how == "fullgraph")
        error = torch._dynamo.exc.Unsupported if how == "fullgraph" else CompileUnsupported
        with pytest.raises(error, match="skip_native=False"):
            run(ids)
        model.model.layers[1]._compiled_call_impl = None
    with emulator.apply_profile(model, TRANSFORMERS_PROFILE, skip_native=False), torch.no_grad():
        want = model(ids).logits
        assert_same_bits(torch.compile(model)(ids).logits, want, "skip_native=False compiles")


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("how", ["model", "layers"])
def test_compiling_with_gradient_checkpointing_is_refused(how, reentrant):
    model = tiny_model("qwen2", seed=1)
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    b = batch(model)
    with emulator.apply_profile(model, INSITU):
        if how == "layers":
            for layer in model.model.layers:
                layer.compile()
            run = model
        else:
            run = torch.compile(model)
        with pytest.raises(CompileUnsupported, match="gradient checkpointing"):
            step(run, model, *b)
        for layer in model.model.layers:
            layer._compiled_call_impl = None


@pytest.mark.parametrize("what", ["flex_attention", "dropout"])
def test_attention_the_compiled_patch_cannot_reproduce_is_refused(what):
    model = tiny_model("llama", seed=1)
    if what == "dropout":
        model.config.attention_dropout = 0.1
        for layer in model.model.layers:
            layer.self_attn.attention_dropout = 0.1
        model.train()
    else:
        model.config._attn_implementation = what
    with emulator.apply_profile(model, INSITU):
        with pytest.raises(CompileUnsupported, match="dropout" if what == "dropout" else "sdpa"):
            torch.compile(model)(tiny_inputs(model, 8))


# -- the functional API under torch.compile ------------------------------------------------------


def _region_calls(backend: str):
    """Each region's functional call on small inputs, at the in-situ profile's points (a Point, not
    the Profile: reading a profile's schema is not traceable, a graph break)."""
    prof = get_profile(INSITU)
    pt = {r: prof.point(r) for r in ("rope", "swiglu", "rmsnorm", "add_rmsnorm", "attention")}
    g = torch.Generator().manual_seed(7)
    bf = torch.bfloat16
    x = activations((2, 5, 4, 16), bf, g, specials=False).requires_grad_()
    gate, up = (activations((3, 40), bf, g, specials=False).requires_grad_() for _ in range(2))
    h, r = (activations((6, 48), bf, g).requires_grad_() for _ in range(2))
    w = (1 + 0.1 * torch.randn(48, generator=g)).to(bf).requires_grad_()
    pos = torch.arange(5)
    angles = pos[:, None] * 0.3 ** torch.arange(8)
    cos, sin = angles.cos().float(), angles.sin().float()
    q = activations((1, 4, 6, 16), bf, g, specials=False).requires_grad_()
    k, v = (activations((1, 2, 6, 16), bf, g, specials=False).requires_grad_() for _ in range(2))
    return {
        "rope": (lambda x: F.rope(x, cos, sin, pt["rope"]), (x,)),
        "swiglu": (lambda a, b: F.swiglu(a, b, pt["swiglu"]), (gate, up)),
        "rmsnorm": (lambda h, w: F.rmsnorm(h, w, 1e-6, pt["rmsnorm"]), (h, w)),
        "add_rmsnorm": (lambda h, r, w: F.add_rmsnorm(h, r, w, 1e-6, pt["add_rmsnorm"]), (h, r, w)),
        "attention": (lambda q, k, v: F.attention(q, k, v, pt["attention"]), (q, k, v)),
    }


def _run(fn, inputs):
    for t in inputs:
        t.grad = None
    out = fn(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    torch.autograd.backward(outs, [torch.linspace(-2, 2, o.numel()).reshape(o.shape).to(o.dtype) for o in outs])
    return [o.detach() for o in outs] + [t.grad.clone() for t in inputs]


@pytest.mark.parametrize("backend", ["reference", "reference-portable", "triton"])
def test_each_region_compiled_is_bit_equal_forward_and_backward(backend):
    with F.use_backend(backend):
        for region, (fn, inputs) in _region_calls(backend).items():
            want = _run(fn, inputs)
            got = _run(torch.compile(fn, fullgraph=True), inputs)
            for i, (a, b) in enumerate(zip(got, want)):
                assert_same_bits(a, b, f"{region} ({backend}) output/grad {i}")


def test_compiled_code_refuses_to_run_under_another_backend_than_it_was_traced_with():
    fn, inputs = _region_calls("reference")["swiglu"]
    compiled = torch.compile(fn, fullgraph=True)
    with F.use_backend("reference"):
        compiled(*inputs)
    with F.use_backend("reference-portable"), pytest.raises(BackendError, match="torch.compiler.reset"):
        compiled(*inputs)


# -- FSDP2 ------------------------------------------------------------------------------------------


def test_fsdp2_sharded_patched_model_compiled_gives_the_unsharded_eager_bits(tmp_path):
    out = tmp_path / "fsdp.pt"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "tests.emulator.fsdp_worker", "qwen2", INSITU, str(out), "compile"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"FSDP2 run failed:\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    got = torch.load(out)
    from .fsdp_worker import batch as fsdp_batch

    model = tiny_model("qwen2", seed=1)
    model.train()
    ids = fsdp_batch(model)
    with emulator.apply_profile(model, INSITU):
        model.zero_grad(set_to_none=True)
        o = model(ids, labels=ids)
        o.loss.backward()
    for order in ("patch-then-shard", "shard-then-patch"):
        assert_same_bits(got[order]["loss"], o.loss.detach(), f"FSDP2 compiled ({order}): loss")
        assert_same_bits(got[order]["logits"], o.logits.detach(), f"FSDP2 compiled ({order}): logits")
        for n, p in model.named_parameters():
            assert_same_bits(got[order]["grads"][n], p.grad, f"FSDP2 compiled ({order}): grad of {n}")


@pytest.mark.parametrize("region", ["add_rmsnorm", "rmsnorm"])
def test_the_norms_compiled_with_their_sites_as_flags_are_the_reference_compiled_at_each_point(region):
    """The reference-inductor backend compiles each norm once for all its FP32/rounded sites (a bool
    tensor, ``torch.where``), not once per point: its bits must be the reference compiled at that point
    (Inductor's order of the squares' sum). Points, widths, token counts and the residual's dtype drawn
    at random (seeded); the control: a flag flipped against the point differs."""
    import random

    from torch._dynamo import config as dynamo_config

    from emulator.ops import rmsnorm as ops
    from engineprofiles.regions import REGIONS, add_rmsnorm_ref, rmsnorm_ref

    rng = random.Random(17)
    ref = add_rmsnorm_ref if region == "add_rmsnorm" else rmsnorm_ref
    per_point = torch.compile(ref, dynamic=True, fullgraph=True)
    flagged = ops._ref(ref, "reference-inductor")
    points = rng.sample(list(REGIONS[region].all_points()), 6)
    g = torch.Generator().manual_seed(3)
    differed = 0
    with dynamo_config.patch(cache_size_limit=1024, accumulated_cache_size_limit=4096):
        for p in points:
            m, n = rng.choice([1, 3, 17, 41, 130]), rng.choice([64, 128, 328, 896, 1000])
            x = (torch.randn(m, n, generator=g) * 3).bfloat16()
            w = (1 + 0.1 * torch.randn(n, generator=g)).bfloat16()
            args = (x, w) if region == "rmsnorm" else (
                x, (torch.randn(m, n, generator=g) * 5).to(rng.choice([torch.bfloat16, torch.float32])), w)
            want = per_point(*args, 1e-6, p, math="torch", dtype=torch.bfloat16)
            got = flagged(*args, 1e-6, p, math="torch", dtype=torch.bfloat16)
            for i, (a, b) in enumerate(zip(*((got, want) if region == "add_rmsnorm" else ((got,), (want,))))):
                assert_same_bits(a, b, f"{p.label()} [{m}, {n}] output {i}")
            site = "normalized"
            other = p.replace(**{site: "fp32" if p[site] == "rounded" else "rounded"})
            moved = flagged(*args, 1e-6, other, math="torch", dtype=torch.bfloat16)
            a, b = (moved[0], want[0]) if region == "add_rmsnorm" else (moved, want)
            differed += not torch.equal(a.float(), b.float())
    assert differed >= len(points) - 1  # the flags are read (a point's rounding site moves the bits)
