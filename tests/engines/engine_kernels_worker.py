"""Runs INSIDE vLLM's environment (tests/engines/test_engine_kernels.py), where vLLM is importable in the
trainer's process: exact mode with the engine's own attention kernel (kernels="engine") against the
portable reference (kernels="portable") on tiny models of random widths (seeded), as one forward over
left-padded batches, and scored as sampled with vLLM's split-KV decode (kv_split, as_sampled: one request
alone, and a batch sampled together, whole and as a micro-batch), and a gradient. Prints one JSON object: per case whether the logits are bit-equal, what the handle says ran,
the control (a perturbed attention point differs), and the seconds of each backend's forward.

    python -m tests.engines.engine_kernels_worker SEED
"""

from __future__ import annotations

import json
import random
import sys
import time
import warnings

import torch

VERSION = "0.32.0"  # the profile: this machine's (the test asserts the refusal where none describes it)


def _logits(model, ids, mask=None):
    with torch.no_grad():
        return model(ids, attention_mask=mask).logits


def _count_kernel_calls() -> list[int]:
    """Count the calls of the engine kernel exact mode loaded (ops.attention.ENGINE_KERNELS)."""
    from emulator.ops import attention

    calls = [0]
    fn = attention.ENGINE_KERNELS.get("vllm")
    if fn is not None:
        def counted(*a, **k):
            calls[0] += 1
            return fn(*a, **k)

        attention.ENGINE_KERNELS["vllm"] = counted
    return calls


def main(seed: int, families: tuple[str, ...] = ("qwen2", "qwen3", "llama")) -> dict:
    import emulator
    from engineprofiles.models import tiny_model
    from engineprofiles.regions.attention import KVSplit
    from engineprofiles.schema import with_points
    from engineloop.mismatch import default_profile_name
    from engineprofiles.store import get_profile

    warnings.simplefilter("ignore")
    prof = get_profile(default_profile_name("vllm", VERSION))
    rng = random.Random(seed)
    out = {"cases": []}
    for family in families:
        kv_heads = rng.choice([1, 2])
        heads = kv_heads * rng.choice([1, 2, 3])
        head_dim = rng.choice([64, 128])
        hidden = heads * (head_dim if family == "qwen2" else rng.choice([32, 48, 64]))  # HF: heads divide hidden
        model = tiny_model(family, seed=rng.randrange(1000), num_attention_heads=heads, num_key_value_heads=kv_heads,
                           head_dim=head_dim, hidden_size=hidden, intermediate_size=256).eval()
        lengths = [rng.randrange(8, 40) for _ in range(3)]
        width = max(lengths)
        ids = torch.randint(1, model.config.vocab_size, (3, width), generator=torch.Generator().manual_seed(seed))
        mask = torch.zeros(3, width, dtype=torch.long)
        for b, n in enumerate(lengths):  # left padding, as a rollout batch
            mask[b, width - n:] = 1
        case = dict(family=family, heads=heads, kv_heads=kv_heads, head_dim=head_dim, hidden=hidden, lengths=lengths)
        got = {}
        for kernels in ("engine", "portable"):
            with emulator.apply_profile(model, prof, exact=True, kernels=kernels) as h:
                case[f"{kernels} ran"] = h.kernels
                calls = _count_kernel_calls()
                got[kernels] = _logits(model, ids, mask)  # the first call compiles the stack
                case[f"{kernels} kernel calls"] = calls[0]
                t = time.perf_counter()
                again = _logits(model, ids, mask)
                case[f"{kernels} s"] = time.perf_counter() - t
                case[f"{kernels} repeatable"] = bool(torch.equal(again, got[kernels]))
        case["padded batch equal"] = bool(torch.equal(got["engine"], got["portable"]))
        # vLLM's split-KV decode, one request sampled alone: prompt in one prefill, then decode steps over
        # long enough contexts that the scheduler splits them across the 2 threads (the rows it splits counted)
        n = rng.randrange(200, 260)
        one = torch.randint(1, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(seed + 7))
        prompt = rng.randrange(140, 180)
        case["split rows"] = len(KVSplit(threads=2).sampled_rows(prompt, list(range(n)), heads, kv_heads))
        sampled = {}
        for kernels in ("engine", "portable"):
            with emulator.apply_profile(model, prof, exact=True, kernels=kernels, kv_split=2), \
                    emulator.as_sampled(prompt):
                sampled[kernels] = _logits(model, one)
        case["sampled split-KV equal"] = bool(torch.equal(sampled["engine"], sampled["portable"]))
        if family == "qwen2":  # a rollout batch sampled together: each decode step's split planned for the batch
            case.update(_sampled_together(model, prof, rng, seed, heads, kv_heads))
        # the control: the portable reference at another attention point gives other bits here
        att = prof.point("attention")
        other = with_points(prof, {"attention": att.replace(probs="rounded" if att["probs"] == "fp32" else "fp32")})
        with emulator.apply_profile(model, other, exact=True, kernels="portable", allow_other_machine=True):
            case["perturbed differs"] = not torch.equal(_logits(model, ids, mask), got["engine"])
        # a gradient flows through the engine's kernel (the FP32 attention backward)
        with emulator.apply_profile(model, prof, exact=True, kernels="engine"):
            model.zero_grad()
            model(ids[:1], labels=ids[:1]).loss.backward()
            grad = model.model.layers[0].self_attn.q_proj.weight.grad
            case["gradient finite"] = bool(grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0)
        out["cases"].append(case)
    return out


def _sampled_together(model, prof, rng, seed: int, heads: int, kv_heads: int) -> dict:
    """Three requests vLLM sampled together (left-padded in one forward, and request 1 alone as a micro-batch:
    as_sampled(..., rows=[1])) through the engine's kernel and the portable reference."""
    import emulator
    from engineprofiles.regions.attention import KVSplit, SampledBatch

    ps = [rng.randrange(140, 180) for _ in range(3)]
    cs = [rng.randrange(20, 60) for _ in range(3)]
    ns = [p + c for p, c in zip(ps, cs)]
    width = max(ns)
    ids = torch.randint(1, model.config.vocab_size, (3, width), generator=torch.Generator().manual_seed(seed + 11))
    mask = torch.zeros(3, width, dtype=torch.long)
    for b, n in enumerate(ns):
        mask[b, width - n:] = 1
    batch = SampledBatch(tuple(ps), tuple(cs))
    split = sum(len(KVSplit(threads=2).sampled_rows(ps[i], list(range(ns[i])), heads, kv_heads, batch=batch, index=i))
                for i in range(3))
    got, out = {}, {"together lengths": [ps, cs], "together split rows": split}
    for kernels in ("engine", "portable"):
        with emulator.apply_profile(model, prof, exact=True, kernels=kernels, kv_split=2):
            calls = _count_kernel_calls()
            with emulator.as_sampled(ps, cs):
                full = _logits(model, ids, mask)
            with emulator.as_sampled(ps, cs, rows=[1]):
                one = _logits(model, ids[1:2, width - ns[1]:])
            got[kernels] = (full, one)
            out[f"together {kernels} kernel calls"] = calls[0]
    out["together equal"] = bool(torch.equal(got["engine"][0], got["portable"][0]))
    out["together micro-batch equal"] = bool(torch.equal(got["engine"][1], got["portable"][1]))
    return out


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]), tuple(sys.argv[2:]) or ("qwen2", "qwen3", "llama"))))
