"""A real engine kept running as an RL rollout worker: it samples with the current policy weights,
returns each sampled token's log-prob, and takes new weights between steps (what an RL framework's
rollout worker does). Runs inside the engine's environment; ``engineloop.rl.EngineWorker`` starts
it and talks to it.

Protocol: one JSON object per line on stdin, one JSON reply per line on the process's original
stdout (the engine's own prints are sent to stderr, so replies are never mixed with its logs):

    {"op": "sync", "weights": PATH}     load a torch.save'd state dict (HF parameter names) in place
    {"op": "generate", "prompts": [[ids...]...], "n": N, "max_tokens": T, "seed": S, "temperature": 1.0}
        -> {"completions": [[ids...]...], "logprobs": [[float...]...]}   (N per prompt, prompt-major: the
           order the requests were given to the engine, in one call, every completion T tokens)

The first reply (ready) also says the engine's thread count and whether its CPU attention splits
decode contexts across them (``attention``: ``torch_threads``, ``split_kv``).
    {"op": "quit"}

Every reply has ``"ok": true``, or ``"ok": false`` and ``"error"``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any


def _log(msg: str) -> None:
    print(f"[rollout-worker] {msg}", file=sys.stderr, flush=True)


def start_vllm(model_dir: str, mode: str, seed: int):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process: apply_model reaches the live model
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    kw: dict[str, Any] = {"enforce_eager": True} if mode == "eager" else {}
    from .capture import content_addressed  # the compile cache's key (see there)

    return LLM(model=content_addressed(model_dir), skip_tokenizer_init=True, dtype="bfloat16",
               distributed_executor_backend="uni", max_model_len=512, seed=seed, **kw)


def sync(llm, path: str) -> int:
    """Load new weights in place through vLLM's own reload path (``reload_weights``: its CPU
    backend repacks linear weights after loading, so plain ``load_weights`` into the live model
    cannot be used twice)."""
    import torch

    state = torch.load(path, weights_only=True, map_location="cpu")
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(list(state.items())),
                                                 "is_checkpoint_format": True})
    return len(state)


def generate(llm, req: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams

    n = int(req.get("n", 1))
    prompts = req["prompts"]
    sps = [SamplingParams(max_tokens=int(req["max_tokens"]), temperature=float(req.get("temperature", 1.0)),
                          seed=int(req["seed"]) + i, logprobs=0, detokenize=False, ignore_eos=True)
           for i in range(len(prompts) * n)]
    inputs = [{"prompt_token_ids": p} for p in prompts for _ in range(n)]
    outs = llm.generate(inputs, sps, use_tqdm=False)
    comps, lps = [], []
    for o in outs:
        c = o.outputs[0]
        comps.append(list(c.token_ids))
        lps.append([d[t].logprob for d, t in zip(c.logprobs, c.token_ids)])
    return {"completions": comps, "logprobs": lps}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="a real engine as an RL rollout worker (JSON lines on stdin/stdout)")
    ap.add_argument("engine", choices=["vllm"])
    ap.add_argument("--model", required=True)
    ap.add_argument("--mode", default="default", choices=["default", "eager"])
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    reply_fd = os.dup(1)
    os.dup2(2, 1)  # the engine's prints go to stderr; replies to the original stdout only
    reply = os.fdopen(reply_fd, "w", buffering=1)
    t0 = time.perf_counter()
    llm = start_vllm(a.model, a.mode, a.seed)
    import vllm

    import torch

    # what exact mode needs to split attention as the engine does (vLLM's CPU split-KV decode)
    attention = dict(torch_threads=torch.get_num_threads(),
                     split_kv=bool(getattr(vllm.envs, "VLLM_CPU_ATTN_SPLIT_KV", False)))
    reply.write(json.dumps({"ok": True, "ready": True, "engine": "vllm", "version": vllm.__version__,
                            "attention": attention, "seconds": time.perf_counter() - t0}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            op = req.get("op")
            if op == "quit":
                reply.write(json.dumps({"ok": True}) + "\n")
                break
            if op == "sync":
                out: dict[str, Any] = {"loaded": sync(llm, req["weights"])}
            elif op == "generate":
                out = generate(llm, req)
            else:
                raise ValueError(f"unknown op {op!r}; ops: sync, generate, quit")
            reply.write(json.dumps({"ok": True, **out}) + "\n")
        except Exception as e:  # noqa: BLE001 - reported to the driver, which raises it there
            _log(f"request failed: {type(e).__name__}: {e}")
            reply.write(json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}"}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
