#!/usr/bin/env python
"""A small RL loop on CPU with the real vLLM engine as the rollout worker (engineloop.rl): per step,
the k3 KL and the importance-ratio spread between the engine's log-probs and the trainer's, for the
trainer as-is, with the engine's profile and in exact mode; the policy is updated with one of them.

    .venv/bin/python scripts/rl_demo.py --steps 8 --json docs/data/rl-demo.json --plot docs/rl-demo.png

Needs the vLLM environment (scripts/engine_env.sh vllm) and matplotlib for --plot.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engineloop.rl import SETUPS, main_summary, plot, run_demo  # noqa: E402
from engineprofiles.errors import EngineProfilesError  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", default="vllm", choices=["vllm"])
    ap.add_argument("--family", default="qwen2", choices=["qwen2", "qwen3", "llama"])
    ap.add_argument("--mode", default="default", choices=["default", "eager"], help="the engine's execution mode")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=2, help="prompts per step")
    ap.add_argument("--group", type=int, default=4, help="completions sampled per prompt")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=12)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train-with", default="exact", choices=SETUPS, help="the trainer setup whose gradient updates the policy")
    ap.add_argument("--profile", help="profile to apply (default: the engine's shipped one for its version and mode)")
    ap.add_argument("--env", help="engine environment (venv, python or version)")
    ap.add_argument("--kernels", default="auto", choices=["auto", "engine", "portable"],
                    help="exact mode's attention: engine (the engine's own kernel: run this script with the engine "
                    "environment's python; refused otherwise), portable (the reference the probe fits), auto (the "
                    "engine's where it loads and is the one the profile records)")
    ap.add_argument("--json", type=Path, help="write the per-step numbers here")
    ap.add_argument("--plot", type=Path, help="draw the per-step k3 KL, importance-ratio spread and reward here (PNG)")
    a = ap.parse_args()
    if a.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError as e:
            print(f"error: --plot needs matplotlib ({e})", file=sys.stderr)
            return 2
    t0 = time.perf_counter()
    try:
        res = run_demo(a.engine, family=a.family, steps=a.steps, prompts=a.prompts, group=a.group,
                       prompt_len=a.prompt_len, max_tokens=a.max_tokens, lr=a.lr, seed=a.seed, mode=a.mode,
                       train_with=a.train_with, profile=a.profile, env=a.env, kernels=a.kernels,
                       note=lambda m: print(f"  [{time.perf_counter() - t0:6.1f}s] {m}", file=sys.stderr, flush=True))
    except EngineProfilesError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    res.command = shlex.join(["scripts/rl_demo.py", *sys.argv[1:]])
    print(main_summary(res))
    d = res.as_dict()
    if a.json:
        from engineprofiles.files import write_atomic

        write_atomic(a.json, json.dumps(d, indent=2))
        print(f"wrote {a.json}", file=sys.stderr)
    if a.plot:
        plot(d, str(a.plot))
        print(f"wrote {a.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
