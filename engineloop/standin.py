"""A trainer-side stand-in for an engine: the HF model itself, patched with a chosen profile,
producing a capture in the same format as the real engine runner. Used to test the in-situ fit
and the mismatch report without an engine (a planted profile must be recovered)."""

from __future__ import annotations

from typing import Any

import torch

STANDIN_IMPL = "engineprofiles_standin"


def capture_from_trainer(model, profile=None, *, prompts: int = 2, length: int = 12, completion: int = 6,
                         seed: int = 0, attention=None, modules: bool = False) -> dict[str, Any]:
    """``attention``: a point of the attention lattice the stand-in's attention computes (as an
    engine's kernel would); default: HF's SDPA. ``modules``: also record what an eager engine
    shows (each layer's residual stream, norm outputs and MLP output, and the final hidden states;
    see engineloop.localize)."""
    from contextlib import nullcontext

    from .localize import MODULE_TENSORS, tracing
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from .capture import prompts_for

    calls: list[dict[str, torch.Tensor]] = []

    def planted(module, query, key, value, attention_mask, scaling=None, **kwargs):
        from engineprofiles.regions import attention_ref

        outs = [attention_ref(query[b].transpose(0, 1), key[b].transpose(0, 1), value[b].transpose(0, 1), attention,
                              scale=scaling) for b in range(query.shape[0])]
        return torch.stack(outs), None

    def recording(module, query, key, value, attention_mask, **kwargs):
        run = planted if attention is not None else sdpa_attention_forward
        out, w = run(module, query, key, value, attention_mask, **kwargs)
        calls.append({"q": query[0].transpose(0, 1).detach().clone(), "k": key[0].transpose(0, 1).detach().clone(),
                      "v": value[0].transpose(0, 1).detach().clone(), "out": out[0].detach().clone()})
        return out, w

    ALL_ATTENTION_FUNCTIONS.register(STANDIN_IMPL, recording)
    handle = None
    if profile is not None:
        from emulator.patching import apply_profile

        handle = apply_profile(model, profile)
    old = model.config._attn_implementation
    g = torch.Generator().manual_seed(seed + 1)
    seqs = []
    try:
        model.config._attn_implementation = STANDIN_IMPL
        for prompt in prompts_for(prompts, model.config.vocab_size, seed, length):
            comp = torch.randint(1, model.config.vocab_size, (completion,), generator=g).tolist()
            ids = torch.tensor(prompt + comp).unsqueeze(0)
            calls.clear()
            with torch.no_grad(), (tracing(model) if modules else nullcontext({})) as rec:
                logits = model(input_ids=ids).logits[0].float()
            lp = torch.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:].unsqueeze(-1))[:, 0]
            seqs.append(dict(prompt=prompt, completion=comp, sample_logprobs=lp[len(prompt) - 1:].tolist(),
                             prompt_logprobs=[None] + lp.tolist(), layers=list(calls), hidden=rec.get("final_norm"),
                             modules=[{n: rec[f"L{i}.{n}"] for n in MODULE_TENSORS} for i in range(len(calls))]
                             if modules else None))
    finally:
        model.config._attn_implementation = old
        if handle is not None:
            handle.remove()
    import transformers

    from engineprofiles.machine import record

    return dict(engine=dict(name="transformers", version=transformers.__version__, compilation_mode="eager",
                            mode="stand-in", machine=record(),
                            attention=dict(scale=float(model.model.layers[0].self_attn.scaling))),
                sequences=seqs, seed=seed)
