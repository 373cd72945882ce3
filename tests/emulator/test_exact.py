"""Exact mode: emulator.functional.attention and apply_profile(..., exact=True).

The engine comparison itself (the trainer's log-probs equal the real vLLM engine's) runs in
tests/engines; here: the attention forward against the reference, padding, the backward against
an independent FP64 autograd reference, the patch's refusals and revert, decode with a KV cache,
and the whole exact path against a stand-in engine whose attention is planted."""

from __future__ import annotations

import warnings
from unittest import mock

import pytest
import torch

import emulator
from emulator import functional as F
from emulator.errors import CapabilityMismatch, ExactModeUnavailable, InexactEvidence, InputError, MachineMismatch, RegionUnavailable
from emulator.ops.attention import fp32_attention
from engineprofiles import store
from engineprofiles.models import tiny_model
from engineprofiles.regions import ATTENTION_SPEC, attention_ref
from engineprofiles.store import get_profile

from ..conftest import as_schema_version
from .helpers import assert_same_bits, on_this_machine

ENGINE = "vllm-0.32.0-cpu-inductor-bfloat16-insitu"
POINT = get_profile(ENGINE).point("attention")
OTHER = POINT.replace(probs="rounded")  # SDPA-like: the weights rounded before P.V


# The shipped profile as if probed on this machine: exact mode's emulation is tested on any machine
# (the machine rule itself is tested below with profiles of other machines).
HERE = on_this_machine(get_profile(ENGINE))


@pytest.fixture
def no_attention(tmp_path):
    """A profile file without attention: the engine profile written as schema version 1."""
    import yaml

    data = as_schema_version(yaml.safe_load(get_profile(ENGINE).to_yaml()), 1)
    f = tmp_path / "v1.yaml"
    f.write_text(yaml.safe_dump(data))
    return str(f)


def qkv(b=2, hq=4, hk=2, tq=9, tk=9, d=64, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, hq, tq, d, generator=g) * 1.5).to(dtype)
    k = (torch.randn(b, hk, tk, d, generator=g) * 1.5).to(dtype)
    v = torch.randn(b, hk, tk, d, generator=g).to(dtype)
    return q, k, v


def test_attention_equals_the_reference_per_sequence():
    q, k, v = qkv()
    out = F.attention(q, k, v, POINT, scale=0.125)
    for b in range(2):
        want = attention_ref(q[b].transpose(0, 1), k[b].transpose(0, 1), v[b].transpose(0, 1), POINT, scale=0.125)
        assert_same_bits(out[b], want.transpose(0, 1), f"row {b}")
    # and the point matters: another point gives other bits on the same inputs
    assert not torch.equal(out, F.attention(q, k, v, OTHER, scale=0.125))


def test_a_profile_name_a_profile_and_its_point_give_the_same_bits():
    q, k, v = qkv(b=1)
    a = F.attention(q, k, v, ENGINE)
    b = F.attention(q, k, v, get_profile(ENGINE))
    c = F.attention(q, k, v, POINT, scale=64 ** -0.5)
    assert_same_bits(a, b, "name vs profile")
    assert_same_bits(a, c, "profile vs point")


@pytest.mark.parametrize("side", ["left", "right"])
def test_a_padded_sequence_gives_the_bits_of_the_sequence_alone(side):
    """The engine runs each sequence alone, from its first real token: padding must not move a
    real key to another index (another lane of the lane-wise sums)."""
    q, k, v = qkv(b=1, tq=21, tk=21, seed=3)
    alone = F.attention(q, k, v, POINT)
    pad = 11
    z = lambda t: torch.zeros(1, t.shape[1], pad, t.shape[3], dtype=t.dtype)  # noqa: E731
    cat = (lambda t: torch.cat((z(t), t), 2)) if side == "left" else (lambda t: torch.cat((t, z(t)), 2))
    qp, kp, vp = cat(q), cat(k), cat(v)
    n = 21 + pad
    real = torch.zeros(n, dtype=torch.bool)
    real[pad:] = True if side == "left" else False
    if side == "right":
        real[:21] = True
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    mask = (causal & real[None, :])[None, None]
    if side == "right":  # HF lets padded query rows see every key (so softmax has no empty row)
        mask = mask.clone()
        mask[0, 0, 21:] = True
    out = F.attention(qp, kp, vp, POINT, attention_mask=mask)
    rows = slice(pad, None) if side == "left" else slice(0, 21)
    assert_same_bits(out[:, :, rows], alone, f"{side}-padded rows")
    # an additive mask says the same
    add = torch.zeros(mask.shape, dtype=torch.bfloat16).masked_fill(~mask, torch.finfo(torch.bfloat16).min)
    assert_same_bits(F.attention(qp, kp, vp, POINT, attention_mask=add), out, "additive mask")


def test_the_backward_is_the_gradient_of_fp32_attention_checked_against_fp64_autograd():
    """Independent reference: torch autograd through FP64 softmax attention. The exact forward's
    gradient must agree to FP32 accuracy; a wrong backward (here: the gradients of q and k swapped
    roles) is caught by the same comparison."""
    q, k, v = qkv(b=2, hq=4, hk=2, tq=7, tk=7, d=64, seed=5)
    mask = torch.ones(2, 1, 7, 7, dtype=torch.bool).tril()
    mask[1, :, :, :2] = False  # row 1: left padding of 2
    mask[1, :, :2, :] = False
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = F.attention(*leaves, POINT, scale=0.125, attention_mask=mask)
    g = torch.Generator().manual_seed(9)
    w = torch.randn(out.shape, generator=g)
    (out.float() * w).sum().backward()
    ref_leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    ref = fp32_attention(*ref_leaves, 0.125, mask, dtype=torch.float64)
    (ref * w.double()).sum().backward()
    for name, a, r in zip("qkv", leaves, ref_leaves):
        err = (a.grad.double() - r.grad).abs().max().item()
        assert err <= 2e-2 * r.grad.abs().max().item(), (name, err)  # BF16 gradients: 8 bits of mantissa
    # the same check fails for a wrong gradient
    assert (leaves[0].grad.double() - ref_leaves[1].grad[:, [0, 0, 1, 1]]).abs().max().item() > \
        2e-2 * ref_leaves[1].grad.abs().max().item()


def test_attention_refuses_bad_input_with_typed_errors(no_attention):
    q, k, v = qkv(b=1)
    with pytest.raises(InputError, match="must be a tensor"):
        F.attention([1.0], k, v, POINT)
    with pytest.raises(InputError, match="Hk dividing Hq"):
        F.attention(q, k[:, :, :, :32], v, POINT)
    with pytest.raises(InputError, match="share an activation dtype"):
        F.attention(q.float(), k.float(), v.float(), POINT)
    with pytest.raises(RegionUnavailable, match="no measured attention"):
        F.attention(q, k, v, no_attention)


def test_apply_profile_exact_refuses_a_profile_without_attention_and_changes_nothing(no_attention):
    from .test_patching import assert_untouched, model_state

    model = tiny_model("qwen2", seed=0)
    before = model_state(model)
    ids = torch.randint(0, 256, (1, 9))
    with torch.no_grad():
        want = model(ids).logits
    with pytest.raises(ExactModeUnavailable, match="has none measured"):
        emulator.apply_profile(model, no_attention, exact=True)
    assert_untouched(model, before)
    with torch.no_grad():
        assert_same_bits(model(ids).logits, want, "after the refusal")


def test_apply_profile_exact_refuses_sliding_window_and_dropout():
    m = tiny_model("qwen2", seed=0)
    m.model.layers[1].self_attn.sliding_window = 8
    with pytest.raises(ExactModeUnavailable, match="sliding-window"):
        emulator.apply_profile(m, HERE, exact=True)
    m = tiny_model("mistral", seed=0, sliding_window=8)  # Mistral's window is in its config, not its attention
    assert not hasattr(m.model.layers[0].self_attn, "sliding_window")
    with pytest.raises(ExactModeUnavailable, match="sliding-window"):
        emulator.apply_profile(m, HERE, exact=True)
    m = tiny_model("llama", seed=0)
    m.model.layers[0].self_attn.attention_dropout = 0.1
    with pytest.raises(ExactModeUnavailable, match="dropout"):
        emulator.apply_profile(m, HERE, exact=True)


def test_a_profile_whose_attention_evidence_is_not_bitwise_is_refused_in_exact_mode(tmp_path):
    import yaml

    # A profile whose attention point matched only 96.8% of the engine's outputs (as the shipped trainer
    # profile did before the lattice had torch's CPU flash attention; SGLang's torch_native attention on AVX2).
    data = yaml.safe_load(store.resolve("transformers-5.19.0-cpu-eager-bfloat16").read_text())
    data["attention"]["evidence"]["match_rate"] = 0.968
    data["attention"]["evidence"]["max_ulp"] = 29344
    path = tmp_path / "inexact.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    assert get_profile(str(path)).attention.evidence.match_rate < 1.0
    model = tiny_model("qwen2", seed=0)
    with pytest.raises(ExactModeUnavailable, match=r"matched the engine on 96\.8000% .*max 29344 ULP.*refuses"):
        emulator.apply_profile(model, str(path), exact=True)
    assert emulator.handle_of(model) is None  # nothing was patched
    emulator.apply_profile(model, str(path)).remove()  # the regions alone still apply


@pytest.mark.parametrize("change,named", [
    (dict(cpu_vendor="SomeOtherVendor"), "vendor"),
    (dict(cpu_isa=["amx_tile"]), "amx_tile"),      # an AMX machine's profile (vLLM runs its amx attention there)
    (dict(cpu_capability="AVX2"), "vector ISA"),
    (dict(cpu_flags=None, cpu_isa=None, cpu_vendor=None), "records no CPU features"),
])
def test_exact_mode_refuses_a_profile_of_another_machine_and_changes_nothing(change, named):
    from engineprofiles.machine import this_machine

    from .helpers import assert_untouched, model_state

    if change.get("cpu_isa") == ["amx_tile"]:  # toggle AMX against this machine, whichever it is
        change = dict(cpu_isa=sorted(set(this_machine().isa) ^ {"amx_tile"}))
    if change.get("cpu_capability") == "AVX2" and this_machine().capability == "AVX2":  # another ISA than this one
        change = dict(cpu_capability="AVX512")
    prof = on_this_machine(get_profile(ENGINE), **change)
    model = tiny_model("qwen2", seed=0)
    before = model_state(model)
    with pytest.raises(ExactModeUnavailable, match="would not reproduce") as e:
        emulator.apply_profile(model, prof, exact=True)
    assert named in str(e.value) and "scripts/probe.sh vllm" in str(e.value) and "allow_other_machine" in str(e.value)
    assert_untouched(model, before)
    assert emulator.handle_of(model) is None
    # the explicit override: a warning naming the same difference, and the model is patched
    with pytest.warns(MachineMismatch, match=named) as w:
        h = emulator.apply_profile(model, prof, exact=True, allow_other_machine=True)
    h.remove()
    assert all(x.filename == __file__ for x in w if issubclass(x.category, MachineMismatch))  # the caller's line
    # the regions alone make no claim about the machine's attention or GEMMs: no refusal, and no override
    emulator.apply_profile(model, prof).remove()
    with pytest.raises(InputError, match="pass exact=True with it"):
        emulator.apply_profile(model, prof, allow_other_machine=True)
    assert emulator.handle_of(model) is None


def test_exact_mode_takes_the_profile_of_this_machine_without_a_word():
    prof = on_this_machine(get_profile(ENGINE))
    with warnings.catch_warnings():
        warnings.simplefilter("error", MachineMismatch)
        h = emulator.apply_profile(tiny_model("qwen2", seed=0), prof, exact=True)
    h.remove()


def test_exact_mode_refuses_a_cpu_profile_for_a_model_on_another_device():
    model = tiny_model("qwen2", seed=0)
    prof = on_this_machine(get_profile(ENGINE))
    prof = prof.model_copy(update={"engine": prof.engine.model_copy(update={"backend": "cuda"})})
    with pytest.raises(ExactModeUnavailable, match="profile probed on cuda, the model is on cpu"):
        emulator.apply_profile(model, prof, exact=True)


def test_a_class_patch_passes_the_machine_rule_on(tmp_path):
    from transformers import Qwen2ForCausalLM

    prof = on_this_machine(get_profile(ENGINE), cpu_vendor="SomeOtherVendor")
    cfg = tiny_model("qwen2", seed=0).config
    with emulator.patch_qwen2(prof, exact=True):
        with pytest.raises(ExactModeUnavailable, match="vendor"):
            Qwen2ForCausalLM(cfg)
    with emulator.patch_qwen2(prof, exact=True, allow_other_machine=True):
        with pytest.warns(MachineMismatch):
            m = Qwen2ForCausalLM(cfg)
    assert emulator.handle_of(m) is not None
    with pytest.raises(InputError, match="pass exact=True with it"):
        emulator.patch_qwen2(prof, allow_other_machine=True)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama", "mistral"])
def test_exact_mode_patches_attention_reverts_bit_for_bit_and_decodes_like_it_prefills(family):
    model = tiny_model(family, seed=1)
    ids = torch.randint(0, 256, (1, 13), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        plain = model(ids).logits
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CapabilityMismatch)
        h = emulator.apply_profile(model, HERE, exact=True)
    assert h.exact and "attention" in h.emulated and "(exact)" in repr(h)
    with torch.no_grad():
        full = model(ids).logits
    assert not torch.equal(full, plain)
    # decode with a KV cache: each new token's logits equal the full forward's row (the engine's
    # prefill and decode agree bit for bit; so must exact mode)
    with torch.no_grad():
        out = model(ids[:, :8], use_cache=True)
        rows = [out.logits[:, -1]]
        cache = out.past_key_values
        for t in range(8, 13):
            out = model(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            rows.append(out.logits[:, -1])
    assert_same_bits(torch.stack(rows[:-1], 1), full[:, 7:12], "decoded rows vs the full forward")
    h.remove()
    with torch.no_grad():
        assert_same_bits(model(ids).logits, plain, "after remove()")


def test_exact_mode_trains():
    model = tiny_model("qwen2", seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CapabilityMismatch)
        h = emulator.apply_profile(model, HERE, exact=True)
    ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(0))
    out = model(ids, labels=ids)
    out.loss.backward()
    g = model.model.layers[0].self_attn.q_proj.weight.grad
    assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0
    h.remove()


def test_exact_mode_against_a_stand_in_engine_with_planted_attention(tmp_path):
    """The whole exact path without a real engine: the stand-in runs the HF model under the engine
    profile with its attention computed at the profile's attention point; mismatch's exact rows
    must be bit-exact while the non-exact rows are not."""
    from engineloop.mismatch import run_mismatch
    from engineloop.standin import capture_from_trainer

    model = tiny_model("qwen2", seed=0)
    cap = capture_from_trainer(model, get_profile(ENGINE), prompts=2, attention=POINT)
    f = tmp_path / "cap.pt"
    torch.save(cap, f)
    here = tmp_path / "here.yaml"
    HERE.save(here)
    rep = run_mismatch("vllm", family="qwen2", profile=str(here), capture_file=str(f), exact=True)
    rows, pre = dict(rep.rows), dict(rep.prefill_rows)
    assert rows["exact"].exact_match == 1.0 and rows["exact"].abs_dlogp_max == 0.0
    assert pre["exact"].exact_match == 1.0
    assert rows["+ engine profile"].exact_match < 1.0  # SDPA is not the planted attention
    # a wrong attention point in the profile is caught: the exact rows are no longer exact
    cap2 = capture_from_trainer(model, get_profile(ENGINE), prompts=2, attention=OTHER)
    torch.save(cap2, f)
    rep2 = run_mismatch("vllm", family="qwen2", profile=str(here), capture_file=str(f), exact=True)
    assert dict(rep2.prefill_rows)["exact"].exact_match < 1.0


def test_exact_mode_for_an_inductor_engine_compiles_the_stack_and_keeps_its_gradient(monkeypatch):
    """Exact mode for vLLM's compiled CPU build runs the decoder stack as one torch.compile graph (the
    norms inline, as the engine's graph has them). Its gradient is the one of the stack run eagerly
    (norms compiled one at a time): the same backward formulas, summed in other orders, so equal to
    BF16 precision, not bitwise."""
    import emulator.patching.forwards as fw

    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))

    def grads(model):
        model.zero_grad(set_to_none=True)
        out = model(ids, labels=ids)
        out.loss.backward()
        return out.logits.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}

    model = tiny_model("qwen2", seed=4, num_hidden_layers=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CapabilityMismatch)
        h = emulator.apply_profile(model, HERE, exact=True)
    assert "model" in h.modules  # the stack's own forward is bound: the compiled graph
    got_logits, got = grads(model)
    h.remove()
    monkeypatch.setattr(fw, "compiled_stack", lambda cls_forward: (lambda self, *a, **k: cls_forward(self, *a, **k)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CapabilityMismatch)
        h = emulator.apply_profile(model, HERE, exact=True)
    want_logits, want = grads(model)
    h.remove()
    assert torch.isfinite(got_logits).all()
    for name, g in want.items():
        assert g.abs().max() > 0, name
        err, scale = float((got[name].double() - g.double()).abs().max()), float(g.double().abs().max())
        assert err <= 2.0**-5 * scale, f"d {name}: {err:.3g} > 2**-5 * {scale:.3g}"


def test_exact_mode_with_gradients_gives_the_inference_graphs_bits():
    """With gradients the compiled stack's training graph fuses the norms otherwise than the inference
    graph the engine ran (it saves activations for the backward): exact mode takes the outputs' bits from
    the inference graph and their gradient from the training graph, so a training forward's logits equal
    a no-grad forward's bit for bit (the RL demo's loss is then on the rollout's own log-probs)."""
    import emulator.patching.forwards as fw

    model = tiny_model("qwen2", seed=0)
    ids = torch.randint(1, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CapabilityMismatch)
        h = emulator.apply_profile(model, HERE, exact=True)
    try:
        with torch.no_grad():
            want = model(ids).logits
        out = model(ids, labels=ids)
        assert_same_bits(out.logits.detach(), want, "logits with gradients vs without")
        out.loss.backward()
        g = model.model.layers[0].mlp.down_proj.weight.grad
        assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0
        with mock.patch.object(fw, "_needs_grad", lambda *a: False):  # the training graph's own bits
            own = model(ids).logits.detach()
        if torch.equal(own, want):
            warnings.warn("the training graph gave the inference graph's bits here: the test cannot tell", stacklevel=1)
    finally:
        h.remove()


def test_exact_mode_says_when_the_stack_cannot_be_one_graph_and_still_trains():
    """Gradient checkpointing breaks the compiled stack's graph (HF's checkpoint call): exact mode then
    runs the stack eagerly (norms compiled one at a time) and says so once per model, not silently."""
    from emulator.errors import StackNotCompiled

    model = tiny_model("qwen2", seed=0)
    ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CapabilityMismatch)
        h = emulator.apply_profile(model, HERE, exact=True)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model(ids, labels=ids).loss.backward()  # one graph: no warning
    assert not [w for w in seen if issubclass(w.category, StackNotCompiled)]
    model.gradient_checkpointing_enable()
    model.train()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            model(ids, labels=ids).loss.backward()
    said = [w for w in seen if issubclass(w.category, StackNotCompiled)]
    assert len(said) == 1 and "gradient checkpointing" in str(said[0].message), [str(w.message) for w in seen]
    g = model.model.layers[0].self_attn.q_proj.weight.grad
    assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0
    h.remove()


# -- kv_split: vLLM's CPU split-KV decode (VLLM_CPU_ATTN_SPLIT_KV=1) --------------------------------


def test_attention_with_kv_split_is_the_reference_with_it_eager_and_compiled():
    from engineprofiles.regions.attention import KVSplit

    split = KVSplit(threads=4)
    q, k, v = qkv(b=2, hq=8, hk=2, tq=1, tk=300, seed=12)  # seed 12: the split changes an output element
    assert split.plan(1, 300, 8, 2)  # the decode row is split
    out = F.attention(q, k, v, POINT, scale=0.125, kv_split=split)
    assert not torch.equal(out, F.attention(q, k, v, POINT, scale=0.125)), "the split changed nothing here"
    for b in range(2):
        want = attention_ref(q[b].transpose(0, 1), k[b].transpose(0, 1), v[b].transpose(0, 1), POINT, scale=0.125,
                             kv_split=split)
        assert_same_bits(out[b], want.transpose(0, 1), f"row {b}")
    compiled = torch.compile(lambda q, k, v: F.attention(q, k, v, POINT, scale=0.125, kv_split=split), fullgraph=True)
    assert_same_bits(compiled(q, k, v), out, "compiled (the custom op carries the split)")
    with pytest.raises(InputError, match="kv_split must be a KVSplit"):
        F.attention(q, k, v, POINT, scale=0.125, kv_split=4)


def test_apply_profile_kv_split_refuses_bad_input_and_changes_nothing():
    from .helpers import assert_untouched, model_state

    model = tiny_model("qwen2", seed=0)
    before = model_state(model)
    for bad, exc, msg in ((dict(exact=False, kv_split=2), InputError, "pass exact=True"),
                          (dict(exact=True, kv_split=0), InputError, "positive integer"),
                          (dict(exact=True, kv_split="2"), InputError, "thread count"),
                          (dict(exact=True, kv_split=2,
                                profile=on_this_machine(get_profile("sglang-0.5.23-cpu-eager-bfloat16-insitu"))),
                           ExactModeUnavailable, "vLLM's CPU attention scheduler")):
        prof = bad.pop("profile", HERE)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CapabilityMismatch)
            with pytest.raises(exc, match=msg):
                emulator.apply_profile(model, prof, **bad)
        assert_untouched(model, before)


def test_exact_mode_with_kv_split_decodes_as_the_split_engine_and_records_it():
    """Decode steps over a context long enough to split: the split changes some logits (the engine's
    split decode is not its prefill), the prompt's forward is unchanged (no row of a 40-token prefill
    is split), and the split is recorded with the profile."""
    from engineprofiles.regions.attention import KVSplit

    model = tiny_model("qwen2", seed=1)
    ids = torch.randint(0, 256, (1, 140), generator=torch.Generator().manual_seed(2))

    def decode(kv_split):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CapabilityMismatch)
            h = emulator.apply_profile(model, HERE, exact=True, kv_split=kv_split, record=kv_split is not None)
        try:
            with torch.no_grad():
                out = model(ids[:, :40], use_cache=True)
                rows, cache, prompt = [], out.past_key_values, out.logits
                for t in range(40, 140):
                    out = model(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
                    cache = out.past_key_values
                    rows.append(out.logits[:, -1])
            recorded = emulator.patching.entry.recorded_profile(model) if kv_split is not None else None
            return prompt, torch.stack(rows, 1), recorded
        finally:
            h.remove()

    p0, plain, _ = decode(None)
    p1, split, recorded = decode(4)
    assert_same_bits(p1, p0, "the prompt's forward")
    differ = (split != plain).any(-1)[0]
    assert differ.any(), "no decode step changed: the split was not computed"
    assert not differ[:8].any(), "a context of 40-48 keys is not split by 4 threads"
    assert recorded[1]["kv_split"] == KVSplit(threads=4) and recorded[1]["exact"] is True


def test_a_thread_count_for_kv_split_merges_as_the_profiles_kernel():
    """kv_split=N takes the chunk merge of the profile's kernel: FMAs for vLLM's AVX-512 build, separate
    multiplies and adds for its AVX2 build (whose attention point has qk_dot mul_add); an explicit KVSplit
    is taken as given."""
    from emulator.patching.apply import plan_patch
    from engineprofiles.regions.attention import KVSplit

    model = tiny_model("qwen2")
    avx2 = on_this_machine(get_profile("vllm-0.32.0-cpu-inductor-bfloat16-insitu-avx2"))
    assert avx2.point("attention")["qk_dot"] == "mul_add" and HERE.point("attention")["qk_dot"] != "mul_add"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert plan_patch(model, HERE, exact=True, kv_split=2).kv_split == KVSplit(threads=2, merge="fma")
        assert plan_patch(model, avx2, exact=True, kv_split=2).kv_split == KVSplit(threads=2, merge="mul_add")
        given = KVSplit(threads=3, merge="fma")
        assert plan_patch(model, avx2, exact=True, kv_split=given).kv_split == given


def _decode_rows(model, ids, prompt):
    """The logits of every sampled position computed as the engine sampled them: the prompt in one forward,
    then one token at a time with the KV cache."""
    with torch.no_grad():
        out = model(ids[:, :prompt], use_cache=True)
        rows, cache = [out.logits[:, -1]], out.past_key_values
        for t in range(prompt, ids.shape[1] - 1):
            out = model(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            rows.append(out.logits[:, -1])
    return torch.stack(rows, 1)


def test_one_forward_as_sampled_gives_the_split_decode_rows():
    """emulator.as_sampled: one forward over prompt + completion with kv_split gives the logits the
    split decode steps give, bit for bit (without it the full forward's rows differ: a prefill is not
    split like decode steps); padded rows of a batch too, each with its own prompt length."""
    model = tiny_model("qwen2", seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CapabilityMismatch)
        h = emulator.apply_profile(model, HERE, exact=True, kv_split=4)
    try:
        # inputs whose logits the split changes on this machine (the GEMMs around attention follow the CPU: a
        # split that moves an attention output by an ULP may round away downstream), else the test cannot tell
        for seed in range(4, 10):
            g = torch.Generator().manual_seed(seed)
            ids = torch.randint(0, 256, (1, 150), generator=g)
            want = _decode_rows(model, ids, 90)
            with torch.no_grad():
                plain = model(ids).logits[:, 89:149]
            if not torch.equal(plain, want):
                break
        else:
            pytest.fail("the split changed no logit of six inputs: the test cannot tell")
        with torch.no_grad(), emulator.as_sampled(90):
            got = model(ids).logits[:, 89:149]
        assert_same_bits(got, want, "one forward as sampled vs the decode steps")
        # a left-padded batch: the second row's prompt is 70 tokens after 10 pads
        other = torch.randint(0, 256, (1, 140), generator=g)
        want2 = _decode_rows(model, other, 70)
        batch = torch.cat([ids, torch.cat([torch.zeros(1, 10, dtype=ids.dtype), other], 1)])
        mask = torch.ones_like(batch)
        mask[1, :10] = 0
        pos = (mask.cumsum(1) - 1).clamp(min=0)  # the real tokens' positions, as the engine numbers them
        with torch.no_grad(), emulator.as_sampled([90, 70]):
            out = model(batch, attention_mask=mask, position_ids=pos).logits
        assert_same_bits(out[:1, 89:149], want, "batch row 0")
        assert_same_bits(out[1:, 79:149], want2, "batch row 1 (left-padded)")
        with pytest.raises(InputError, match="3 prompt lengths for a batch of 2"):
            with torch.no_grad(), emulator.as_sampled([90, 70, 5]):
                model(batch, attention_mask=mask, position_ids=pos)
        for bad in (0, [], [3, -1], 2.5, [True]):
            with pytest.raises(InputError, match="positive integers"):
                with emulator.as_sampled(bad):
                    pass
    finally:
        h.remove()


def test_as_sampled_together_scores_an_engine_batch_and_its_micro_batches():
    """as_sampled(prompt_lengths, completion_lengths): the rows are one engine batch decoded together, each
    decode step split by the plan of the whole step (KVSplit.plan_batch; checked against vLLM's batched
    decode in tests/engines). The split then differs from each sequence sampled alone; a micro-batch
    (rows=) gives its rows the same bits as the whole batch; bad input is refused."""
    model = tiny_model("qwen2", seed=1)
    g = torch.Generator().manual_seed(5)  # seed 5: the batch's plan changes some logits (2 rows)
    prompts, completions = [150, 130, 170], [24, 12, 24]
    seqs = [torch.randint(0, 256, (1, p + c), generator=g) for p, c in zip(prompts, completions)]
    width = max(s.shape[1] for s in seqs)
    batch = torch.cat([torch.cat([torch.zeros(1, width - s.shape[1], dtype=s.dtype), s], 1) for s in seqs])
    mask = torch.ones_like(batch)
    for i, s in enumerate(seqs):
        mask[i, :width - s.shape[1]] = 0
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CapabilityMismatch)
        h = emulator.apply_profile(model, HERE, exact=True, kv_split=2)
    try:
        with torch.no_grad():
            with emulator.as_sampled(prompts, completions):
                together = model(batch, attention_mask=mask, position_ids=pos).logits
            with emulator.as_sampled(prompts):
                alone = model(batch, attention_mask=mask, position_ids=pos).logits
            changed = 0
            for i, (s, p, c) in enumerate(zip(seqs, prompts, completions)):
                rows = slice(width - c - 1, width - 1)  # the rows that give the completion's log-probs
                with emulator.as_sampled(prompts, completions, rows=[i]):
                    one = model(s).logits
                assert_same_bits(one[:, -c - 1:-1], together[i:i + 1, rows], f"request {i} as a micro-batch")
                changed += int((together[i, rows] != alone[i, rows]).any(-1).sum())
            assert changed, "no completion row differs from the sequences sampled alone: the test cannot tell"
            for kw, msg in ((dict(prompt_lengths=prompts, rows=[0]), "give completion_lengths"),
                            (dict(prompt_lengths=prompts, completion_lengths=[3, 4]), "one prompt length per request"),
                            (dict(prompt_lengths=150, completion_lengths=[3]), "one prompt length per request"),
                            (dict(prompt_lengths=prompts, completion_lengths=completions, rows=[3]), "indices of the 3"),
                            (dict(prompt_lengths=prompts, completion_lengths=[1, 0, 2]), "positive integers")):
                with pytest.raises(InputError, match=msg):
                    with emulator.as_sampled(**kw):
                        pass
            with pytest.raises(InputError, match="1 requests of the engine batch for a forward of 3 rows"):
                with emulator.as_sampled(prompts, completions, rows=[1]):
                    model(batch, attention_mask=mask, position_ids=pos)
    finally:
        h.remove()


# -- batches as users send them, on models of any width ------------------------------------------------

def random_widths(rng):
    """A model config off the usual grid: hidden not a power of two, GQA groups 1-7, MLP width odd."""
    kv = rng.randint(1, 3)
    group = rng.randint(1, 7)
    head_dim = rng.choice([32, 64, 96])
    return dict(num_key_value_heads=kv, num_attention_heads=kv * group, head_dim=head_dim,
                hidden_size=rng.choice([72, 136, 200, 328, 520]), intermediate_size=rng.randrange(97, 1100, 2),
                num_hidden_layers=rng.randint(1, 3))


@pytest.mark.parametrize("seed", range(4))
def test_a_padded_batch_of_mixed_lengths_gives_each_row_its_bits_alone_or_is_refused(seed):
    """Exact mode on random widths: left-padded rows of different lengths in one forward give each
    sequence the logits it has alone, bit for bit, wherever exact mode accepts the model; where it
    refuses, this machine's linear layers really do change a row with the number of rows."""
    import random

    from emulator.patching.gemm import row_variant_linears

    rng = random.Random(seed)
    family = rng.choice(["qwen2", "qwen3", "llama"])
    model = tiny_model(family, seed=seed, **random_widths(rng))
    variant = row_variant_linears(model, torch.bfloat16)
    if variant:  # said, and no padded batch can be claimed here
        with pytest.warns(InexactEvidence, match="how many tokens share the GEMM") as w:
            emulator.apply_profile(model, HERE, exact=True).remove()
        assert all(x.filename == __file__ for x in w if "share the GEMM" in str(x.message))  # the caller's line
        return
    lengths = sorted(rng.sample(range(3, 40), 3))
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, model.config.vocab_size, (n,), generator=g) for n in lengths]
    width = max(lengths)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s):], mask[i, width - len(s):] = s, 1
    with emulator.apply_profile(model, HERE, exact=True), torch.no_grad():
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        batch = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        for i, s in enumerate(seqs):
            alone = model(input_ids=s[None]).logits[0]
            assert_same_bits(batch[i, width - len(s):], alone, f"{family} row {i} ({len(s)} tokens of {width})")


@pytest.mark.parametrize("seed", range(3))
def test_packed_sequences_give_each_sequence_its_bits_alone(seed):
    """Packed rows as verl's remove-padding and TRL's padding-free send them: several sequences in one batch
    row, position_ids restarting at each, no attention mask, no KV cache (HF then builds a block-diagonal causal
    mask). Each sequence gets the logits it has alone, bit for bit, on random widths, without and with
    gradients (the training forward's outputs are the inference graph's)."""
    import random

    from emulator.patching.gemm import row_variant_linears

    rng = random.Random(100 + seed)
    family = rng.choice(["qwen2", "qwen3", "llama"])
    widths = random_widths(rng)
    widths["hidden_size"] -= widths["hidden_size"] % widths["num_attention_heads"]  # Llama's config asks for it
    model = tiny_model(family, seed=seed, **widths)
    if row_variant_linears(model, torch.bfloat16):  # said, and no packed row can be claimed here
        with pytest.warns(InexactEvidence, match="how many tokens share the GEMM"):
            emulator.apply_profile(model, HERE, exact=True).remove()
        return
    g = torch.Generator().manual_seed(seed)
    rows = [[torch.randint(0, model.config.vocab_size, (rng.randint(2, 30),), generator=g)
             for _ in range(rng.randint(2, 4))] for _ in range(2)]
    width = max(sum(len(s) for s in r) for r in rows)
    rows = [r + [torch.randint(0, model.config.vocab_size, (width - sum(len(s) for s in r),), generator=g)]
            if sum(len(s) for s in r) < width else r for r in rows]  # the rest of a row: one more sequence
    ids = torch.stack([torch.cat(r) for r in rows])
    pos = torch.stack([torch.cat([torch.arange(len(s)) for s in r]) for r in rows])
    with emulator.apply_profile(model, HERE, exact=True):
        with torch.no_grad():
            packed = model(input_ids=ids, position_ids=pos, use_cache=False).logits
            alone = [[model(input_ids=s[None], use_cache=False).logits[0] for s in r] for r in rows]
        model.train()
        trained = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        trained.float().logsumexp(-1).sum().backward()
        model.eval()
    for name, out in (("no grad", packed), ("with gradients", trained)):
        for b, r in enumerate(rows):
            start = 0
            for i, s in enumerate(r):
                assert_same_bits(out[b, start:start + len(s)].detach(), alone[b][i],
                                 f"{family} {name}: row {b} sequence {i} ({len(s)} tokens at {start})")
                start += len(s)
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_packed_attention_is_each_sequence_alone_and_other_masks_are_refused():
    q, k, v = qkv(b=1, tq=17, tk=17, seed=5)
    cuts = [0, 6, 13, 17]
    mask = torch.block_diag(*(torch.ones(b - a, b - a, dtype=torch.bool).tril() for a, b in zip(cuts, cuts[1:])))
    out = F.attention(q, k, v, POINT, attention_mask=mask[None, None])
    for a, b in zip(cuts, cuts[1:]):
        alone = F.attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], POINT)
        assert_same_bits(out[:, :, a:b], alone, f"packed sequence {a}:{b}")
    # must-fail control: the whole row causal (what a KV cache's mask gives) mixes the sequences
    assert not torch.equal(F.attention(q, k, v, POINT)[:, :, 6:], out[:, :, 6:])
    i = torch.arange(17)
    window = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < 8)  # a sliding window: early keys drop out
    with pytest.raises(InputError, match="sees a key its last query does not"):
        F.attention(q, k, v, POINT, attention_mask=window[None, None])
    from engineprofiles.regions.attention import KVSplit

    with emulator.as_sampled(17), pytest.raises(InputError, match="this row packs 3"):
        F.attention(q, k, v, POINT, attention_mask=mask[None, None], kv_split=KVSplit(threads=2))


def test_exact_mode_says_when_linear_layers_rows_depend_on_the_row_count(monkeypatch):
    """The must-fail control of the row check: a linear kernel that rounds differently above 64 rows (as
    oneDNN's AMX path measured on an Intel Xeon) is named in an InexactEvidence warning."""
    from emulator.patching import gemm

    real = torch.nn.functional.linear

    def blocked(x, w, b=None):
        y = real(x, w, b)
        if x.dim() == 2 and x.shape[0] > 64:  # another blocking: the last bit of one column moves
            y = y.clone()
            y[:, 0] = torch.nextafter(y[:, 0], torch.full_like(y[:, 0], float("inf")))
        return y

    monkeypatch.setattr(gemm, "_CACHE", {})
    monkeypatch.setattr(torch.nn.functional, "linear", blocked)
    model = tiny_model("qwen2", seed=0)
    with pytest.warns(InexactEvidence, match=r"model\.layers\.0\.self_attn\.q_proj .*rows differ"):
        emulator.apply_profile(model, HERE, exact=True).remove()


# -- kernels= (the engine's own attention kernel; tests/engines/test_engine_kernels.py runs it) ----------


def test_engine_kernels_without_the_engine_are_refused_and_auto_falls_back_with_a_log_line(caplog):
    """vLLM is not importable in the test venv: kernels='engine' refuses before anything changes, naming why;
    'auto' runs the portable reference and logs why; the handle says which runs; a bad value is refused."""
    import logging

    from emulator.errors import ExactModeUnavailable
    from emulator.patching.handle import handle_of
    from engineprofiles.models import tiny_model

    model = tiny_model("qwen2", seed=3)
    with pytest.raises(ExactModeUnavailable, match="kernels='engine': vllm is not installed"):
        emulator.apply_profile(model, HERE, exact=True, kernels="engine")  # (HERE: the profile made this machine's)
    assert handle_of(model) is None
    with caplog.at_level(logging.INFO, logger="emulator"):
        with emulator.apply_profile(model, HERE, exact=True) as h:
            assert h.kernels == "portable"
    assert any("portable attention reference" in r.getMessage() and "vllm is not installed" in r.getMessage()
               for r in caplog.records), caplog.text
    with emulator.apply_profile(model, ENGINE) as h:
        assert h.kernels == ""  # not exact mode: no attention of the engine's
    with pytest.raises(InputError, match="kernels must be one of auto, engine, portable"):
        emulator.apply_profile(model, HERE, exact=True, kernels="fast")
    with pytest.raises(InputError, match="pass exact=True"):
        emulator.apply_profile(model, ENGINE, kernels="engine")
    assert handle_of(model) is None
    # The option travels: recorded in the config (record=True) and given by a class patch.
    with emulator.apply_profile(model, HERE, exact=True, kernels="portable", record=True) as h:
        assert h.kernels_option == "portable" and model.config.emulator_profile["kernels"] == "portable"
        assert emulator.recorded_profile(model)[1]["kernels"] == "portable"
    with pytest.raises(InputError, match="patch_family: kernels must be one of auto, engine, portable"):
        emulator.patch_qwen2(HERE, kernels="engine")  # not exact mode
    with pytest.raises(InputError, match="patch_family: kernels must be"):
        emulator.patch_qwen2(HERE, exact=True, kernels="fast")
    with emulator.patch_qwen2(HERE, exact=True, kernels="portable") as patch:
        other = tiny_model("qwen2", seed=4)
        assert handle_of(other).kernels_option == "portable" and handle_of(other).kernels == "portable"
    assert len(patch.handles) == 1
