#!/usr/bin/env python
"""Exploration demo: run SGLang's offline engine (sglang.Engine) on CPU with a tiny,
locally built Qwen2 model, and report which path each probed layer took inside the engine.

    .engines/sglang-0.5.23/bin/python scripts/_explore_sglang_engine.py [--keep DIR]

What it shows (sglang 0.5.23, 2-core AMD host without AMX):
- With SGLANG_USE_CPU_ENGINE=1 the engine imports `sgl_kernel` unconditionally
  (sglang/kernels/ops/kvcache/cache_move.py: `if _is_cpu: from sgl_kernel import
  copy_all_layer_kv_cache_cpu`).  PyPI has only CUDA builds of sgl_kernel (sglang-kernel),
  with no CPU ops; the CPU build is made from SGLang's source tree.  This script therefore
  puts a stub `sgl_kernel` package on PYTHONPATH whose functions raise when called.  For
  Qwen2/Llama-style models none of them is called: if one were, generation would fail loudly.
- It attaches forward hooks through the engine's own `forward_hooks` server argument (the
  model lives in the scheduler subprocess) and records, for RMSNorm / SiluAndMul /
  RotaryEmbedding, the dispatch target (`_forward_method`), dtypes and shapes.
Startup takes about 1 minute (mostly the tokenizer-manager process importing SGLang).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import textwrap
import time

STUB = '''\
"""Stub sgl_kernel: any attribute is a function that raises when called."""
__version__ = "0.0.0-stub"
def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    def _missing(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel stub: {name} was called")
    _missing.__name__ = name
    return _missing
'''

HOOKS = '''\
import json, torch
def factory(config):
    path = config["out"]
    def hook(module, inputs, output):
        fm = getattr(module, "_forward_method", None)
        outs = output if isinstance(output, tuple) else (output,)
        rec = {"cls": type(module).__name__,
               "forward_method": getattr(fm, "__name__", str(fm)),
               "in": [f"{t.dtype}{tuple(t.shape)}" for t in inputs if isinstance(t, torch.Tensor)],
               "out": [f"{t.dtype}{tuple(t.shape)}" for t in outs if isinstance(t, torch.Tensor)],
               "compiling": torch.compiler.is_compiling()}
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\\n")
    return hook
'''


def build_tiny_qwen2(path: str) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    # intermediate_size a multiple of 32: on CPU SGLang pads intermediate_size up to a
    # multiple of tp_size*32 (configs/update_config.py), which would change the MLP shapes.
    cfg = Qwen2Config(vocab_size=512, hidden_size=256, intermediate_size=704,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=64, max_position_embeddings=512, rms_norm_eps=1e-6,
                      rope_theta=10000.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.05 * torch.randn_like(p))
            else:
                p.copy_(0.02 * torch.randn_like(p))
    model.to(torch.bfloat16).save_pretrained(path)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--keep", help="use/keep this directory instead of a temp dir")
    args = ap.parse_args()
    work = args.keep or tempfile.mkdtemp(prefix="sglang-engine-")
    os.makedirs(os.path.join(work, "stub", "sgl_kernel"), exist_ok=True)
    with open(os.path.join(work, "stub", "sgl_kernel", "__init__.py"), "w") as f:
        f.write(STUB)
    with open(os.path.join(work, "stub", "sglprobe_hooks.py"), "w") as f:
        f.write(HOOKS)
    stub_dir = os.path.join(work, "stub")
    # The scheduler and detokenizer run in subprocesses: PYTHONPATH reaches them.
    os.environ["PYTHONPATH"] = stub_dir + os.pathsep + os.environ.get("PYTHONPATH", "")
    sys.path.insert(0, stub_dir)
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

    model_dir = os.path.join(work, "tiny-qwen2")
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        build_tiny_qwen2(model_dir)
    hooks_out = os.path.join(work, "hooks.jsonl")
    if os.path.exists(hooks_out):
        os.remove(hooks_out)

    import sglang as sgl

    hooks = [{
        "name": "probe",
        "target_modules": ["model.layers.0.input_layernorm",
                           "model.layers.0.post_attention_layernorm",
                           "model.layers.0.mlp.act_fn",
                           "model.layers.0.self_attn.rotary_emb",
                           "model.norm"],
        "hook_factory": "sglprobe_hooks:factory",
        "config": {"out": hooks_out},
    }]
    t = time.time()
    llm = sgl.Engine(model_path=model_dir, device="cpu", dtype="bfloat16",
                     skip_tokenizer_init=True, max_total_tokens=2048,
                     disable_overlap_schedule=True, log_level="warning",
                     forward_hooks=hooks)
    print(f"engine up in {time.time() - t:.0f}s")
    try:
        out = llm.generate(input_ids=[[1, 2, 3, 4, 5, 6, 7, 8]],
                           sampling_params={"max_new_tokens": 4, "temperature": 0},
                           return_logprob=True, logprob_start_len=0)
        meta = out[0]["meta_info"]
        print("output_ids:", out[0]["output_ids"])
        print("prompt logprobs (logprob, token, None):", meta["input_token_logprobs"][:4], "...")
        print("output logprobs:", meta["output_token_logprobs"])
    finally:
        llm.shutdown()

    seen = {}
    with open(hooks_out) as f:
        for line in f:
            rec = json.loads(line)
            key = (rec["cls"], rec["forward_method"], tuple(rec["in"]), rec["compiling"])
            seen[key] = seen.get(key, 0) + 1
    print("\nlayer calls inside the engine (class, dispatch target, inputs, under compile): count")
    for (cls, fm, ins, comp), n in sorted(seen.items()):
        print(f"  {cls:16s} {fm:16s} {', '.join(ins):60s} compiling={comp}: {n}")
    print(textwrap.dedent(f"""
        work dir: {work}
        note: --enable-torch-compile fails on this host: the torch_native attention backend
        (the fallback when AMX is absent) has no init_cpu_graph_state for CPUGraphRunner."""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
