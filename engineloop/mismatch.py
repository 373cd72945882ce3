"""End-to-end log-prob mismatch between a real engine and the HF trainer.

The engine samples completions on a tiny local model (its own environment, see capture.py); the
trainer recomputes the log-probs of the sampled tokens as-is, with the engine's profile applied,
and with each region of the profile alone (the others kept at the trainer's own rounding), and,
with ``exact=True``, in exact mode (the profile's attention too). The metrics are the ones RL
frameworks log (engineprofiles.metrics).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from engineprofiles import engines
from engineprofiles.errors import EngineProfilesError
from engineprofiles.extras import require
from engineprofiles.names import check_mode_name, check_rope_scaling_name, is_safe_name
from engineprofiles.metrics import Mismatch, mismatch
from engineprofiles.families import FAMILIES
from engineprofiles.regions.attention import KVSplit, split_merge
from engineprofiles.schema import Profile, with_points
from engineprofiles.store import get_profile, shipped_names

from . import checkpoint
from .checkpoint import LOGPROB_SEMANTICS

# The residual RMSNorm region covers both call forms.
# One region at a time from the engine's profile, the rest the trainer's; an MoE family adds its
# experts (moe) as one more row, and a family with a shared expert (Qwen2-MoE) its shared expert.
ABLATIONS = {"rope": ("rope",), "swiglu": ("swiglu",), "rmsnorm": ("add_rmsnorm", "rmsnorm")}


# Model sizes other than the tiny default, as tiny_model overrides (CLI: --layers, --hidden, ...).
SIZE_FIELDS = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
               "head_dim")


@dataclass
class Report:
    engine: dict[str, Any]
    family: str
    profile_name: str
    trainer_profile_name: str
    warnings: list[str] = field(default_factory=list)
    rows: list[tuple[str, Mismatch]] = field(default_factory=list)
    prefill_rows: list[tuple[str, Mismatch]] = field(default_factory=list)
    model: dict[str, Any] = field(default_factory=dict)  # the tiny model's size (config fields)
    prompt_len: int = 12
    command: str = ""
    # The engine against itself: the fraction of sampled tokens whose decode log-prob equals the
    # log-prob its prefill gives the same token. Below 1, no trainer (one prefill) can match every
    # sampled token: the engine's decode computed them another way (e.g. vLLM's CPU attention
    # splitting long contexts across threads, VLLM_CPU_ATTN_SPLIT_KV).
    engine_decode_equals_prefill: float | None = None
    # The engine against itself in other batch compositions (--batch-check): batch_invariance's result.
    batch_check: dict[str, Any] | None = None
    # --exact: which attention the exact rows ran: "engine" (the engine's own kernel) or "portable" (the reference)
    exact_kernels: str | None = None
    # What the engine's log-probs are (raw or processed, temperature): engineloop.checkpoint.LOGPROB_SEMANTICS
    logprobs: str = LOGPROB_SEMANTICS

    def as_dict(self) -> dict[str, Any]:
        return dict(engine=self.engine, family=self.family, profile=self.profile_name,
                    trainer_profile=self.trainer_profile_name, warnings=self.warnings, model=self.model,
                    prompt_len=self.prompt_len, command=self.command, engine_logprobs=self.logprobs,
                    engine_decode_equals_prefill=self.engine_decode_equals_prefill,
                    **({"batch_check": self.batch_check} if self.batch_check is not None else {}),
                    **({"exact_kernels": self.exact_kernels} if self.exact_kernels is not None else {}),
                    sampled=[dict(trainer=n, **m.as_dict()) for n, m in self.rows],
                    prefill=[dict(trainer=n, **m.as_dict()) for n, m in self.prefill_rows])


def trainer_profile_name() -> str:
    """The shipped profile of the trainer (HF transformers, eager, BF16, CPU) of the installed
    transformers version, else of the nearest version with one (the same rule as choosing by engine
    name: engineprofiles.select), so that an engine environment with another transformers still runs."""
    import transformers

    from engineprofiles import store
    from engineprofiles.machine import this_machine
    from engineprofiles.select import Wanted, select

    here = this_machine()
    wanted = Wanted(engine="transformers", dtype="bfloat16", device="cpu", capability=here.capability,
                    installed=transformers.__version__, machine=here)
    return select([c for _, c in store.candidates()[0]], wanted).name


def trainer_warnings(tname: str) -> list[str]:
    """What a report says when the trainer's transformers has no shipped profile of its own."""
    import transformers

    if tname.startswith(f"transformers-{transformers.__version__}-"):
        return []
    return [f"the trainer is transformers {transformers.__version__}, which has no shipped profile; the trainer rows "
            f"use {tname}, the nearest version's"]


def default_profile_name(engine: str, version: str, mode: str = "default") -> str:
    """The shipped profile of ``engine`` ``version`` in ``mode`` (BF16, CPU), chosen by the rule
    ``apply_profile(model, "ENGINE==VERSION:MODE")`` uses (engineprofiles.select): this CPU's
    capability first, then in situ over op-level. Its own warnings are not raised here (the run
    says what does not fit: :func:`engine_profile`); with no shipped profile of that version and
    mode, the name such a profile would have (the caller says it is missing)."""
    from engineprofiles import store
    from engineprofiles.errors import ProfileNotFound
    from engineprofiles.machine import this_machine
    from engineprofiles.select import Wanted, select

    here = this_machine()
    wanted = Wanted(engine=engine, version=version, mode=mode, dtype="bfloat16", device="cpu",
                    capability=here.capability, machine=here)
    try:
        return select([c for _, c in store.candidates()[0]], wanted).name
    except ProfileNotFound:
        from engineprofiles.names import op_level_name

        return op_level_name(engine, version, mode)


def combine(base: Profile, other: Profile, regions: tuple[str, ...]) -> Profile:
    """``base`` with the points of ``regions`` taken from ``other``; ``regions`` may name the entries
    recorded beside the regions (attention, moe) too, which otherwise come from ``base`` as well."""
    return with_points(base, {n: other.point(n) if other.available(n) else None for n in regions},
                       evidence={n: other.entry(n).evidence for n in regions})


def _shifted_logsumexp(x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """SGLang's prompt log-probs (sglang.srt.layers.logprob_processor on CPU): (x - max) - logsumexp(x - max)."""
    mx = x.amax(-1)
    lse = torch.logsumexp(x - mx[:, None], -1)
    return (x.gather(-1, tokens[:, None])[:, 0] - mx) - lse


LOGPROB_FORMULAS = {
    "log_softmax": lambda x, t: torch.log_softmax(x, -1).gather(-1, t[:, None])[:, 0],
    "shifted_logsumexp": _shifted_logsumexp,
    # SGLang's sampler (temperature 1, as the capture samples): log(softmax(x)), two roundings
    "log_of_softmax": lambda x, t: torch.log(torch.softmax(x, -1)).gather(-1, t[:, None])[:, 0],
}


def sequence_logprobs(model, seq: dict[str, Any], formula: str = "log_softmax") -> tuple[torch.Tensor, torch.Tensor]:
    """Trainer log-probs of the sampled tokens and of every prompt+completion token (teacher forced);
    ``formula``: how log-probs are taken from the FP32 logits (the trainer's own: log_softmax)."""
    ids = torch.tensor(seq["prompt"] + seq["completion"]).unsqueeze(0)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    lp = LOGPROB_FORMULAS[formula](logits[:-1], ids[0, 1:])
    n_prompt = len(seq["prompt"])
    return lp[n_prompt - 1:], lp


def decoded_logprobs(model, seq: dict[str, Any], formulas: tuple[str, ...] = ("log_softmax",)) -> list[torch.Tensor]:
    """Trainer log-probs of the sampled tokens computed as the engine sampled them: the prompt in one
    forward, then the completion one token at a time with the KV cache (each step a forward of one
    token). An engine's decode can differ from its own prefill (other kernel shapes, e.g. a matmul of
    one row); this is the trainer's forward of the same shapes. One tensor per formula of
    :data:`LOGPROB_FORMULAS` (how the log-prob is taken from each step's FP32 logits)."""
    prompt, completion = seq["prompt"], seq["completion"]
    out: list[list[torch.Tensor]] = [[] for _ in formulas]
    with torch.no_grad():
        res = model(input_ids=torch.tensor([prompt]), use_cache=True)
        for t, tok in enumerate(completion):
            row = res.logits[0, -1:].float()
            for o, f in zip(out, formulas):
                o.append(LOGPROB_FORMULAS[f](row, torch.tensor([tok]))[0])
            if t + 1 < len(completion):
                res = model(input_ids=torch.tensor([[tok]]), past_key_values=res.past_key_values, use_cache=True)
    return [torch.stack(o) for o in out]


class CaptureError(EngineProfilesError, ValueError):
    """A capture file is missing, is not one engineloop.capture wrote, or lacks what the fit needs."""


CAPTURE_KEYS = ("prompt", "completion", "sample_logprobs", "prompt_logprobs", "layers")


def load_capture(path: str | Path) -> dict[str, Any]:
    """A capture written by ``engineloop.capture`` (or the stand-in), loaded with
    ``torch.load(weights_only=True)``: tensors, numbers, strings and containers only, so a file
    from elsewhere cannot run code while it loads."""
    p = Path(path)
    if not p.is_file():
        what = "does not exist" if not p.exists() else "is not a regular file"
        raise CaptureError(f"capture file {p} {what}; pass a file written by `python -m engineloop.capture` "
                           "(probe-engine mismatch/--in-situ write one when run without --capture)")
    try:
        cap = torch.load(p, weights_only=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - torch raises many kinds for a file that is not a capture
        msg = " ".join(str(e).split())
        msg = msg if len(msg) <= 240 else msg[:237] + "..."
        raise CaptureError(
            f"{p} is not a capture file written by engineloop.capture: torch.load(weights_only=True) refused it "
            f"({type(e).__name__}: {msg}); captures are loaded without running code from the file"
        ) from None
    eng = cap.get("engine") if isinstance(cap, dict) else None
    seqs = cap.get("sequences") if isinstance(cap, dict) else None
    if not isinstance(eng, dict) or not isinstance(seqs, list) or not seqs:
        raise CaptureError(f"{p} is not a capture: it needs an 'engine' mapping and a non-empty 'sequences' list")
    for k in ("name", "version"):
        if not is_safe_name(eng.get(k)):
            raise CaptureError(f"{p}: engine.{k} must be a plain name (letters, digits, . _ + -), got {eng.get(k)!r:.80}")
    for i, seq in enumerate(seqs):
        missing = [k for k in CAPTURE_KEYS if not isinstance(seq, dict) or k not in seq]
        if missing:
            raise CaptureError(f"{p}: sequence {i} lacks {', '.join(missing)}")
    return cap


def save_model(model, path: Path) -> None:
    """``save_pretrained`` without transformers' progress bar (one line of noise per engine run)."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(path)
    finally:
        if was:
            hf_logging.enable_progress_bar()


class EngineRunFailed(EngineProfilesError, RuntimeError):
    """The engine's capture run did not finish: ``cause`` names why (``missing-standin``, ``port-in-use``,
    ``timeout``, ``engine-crash``, ``failed``), ``log`` is the file that holds its whole output."""

    def __init__(self, message: str, cause: str, log: Path | None):
        super().__init__(message)
        self.cause, self.log = cause, log


TIMEOUT_VAR = "ENGINEPROFILES_CAPTURE_TIMEOUT"
DEFAULT_TIMEOUT_S = 1800.0  # an engine run on a tiny model takes 1-3 minutes on 2 cores

# What the capture's log says, most specific first: (cause, pattern in the log, what it means).
_CAUSES = (
    ("missing-standin", re.compile(re.escape("[capture] error: missing-standin:")),
     "the sgl_kernel stand-in is not installed in the engine's environment"),
    ("port-in-use", re.compile(r"address already in use|port.{0,60}(already in use|is not available)|EADDRINUSE",
                               re.IGNORECASE), "a port the engine binds is in use"),
)


def _capture_timeout() -> float:
    raw = os.environ.get(TIMEOUT_VAR)
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        t = float(raw)
    except ValueError:
        t = -1.0
    if not t > 0:
        raise EngineProfilesError(f"${TIMEOUT_VAR} must be a positive number of seconds; got {raw!r}")
    return t


def _classify(text: str, code: int) -> tuple[str, str]:
    for cause, pattern, what in _CAUSES:
        if pattern.search(text):
            return cause, what
    if code < 0 or code == 137 or "SIGQUIT received" in text or "Traceback (most recent call last)" in text:
        return "engine-crash", "the engine crashed (its traceback, if any, is in the log)"
    return "failed", "the capture ended with an error"


def _kill_group(proc: subprocess.Popen) -> None:
    """End the capture and the engine processes it started (its own process group)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    proc.wait()


def run_capture(engine: str, model_dir: Path, out: Path, *, prompts: int, max_tokens: int, seed: int,
                env: str | None, note: Callable[[str], None], mode: str = "default",
                prompt_len: int = 12, batch_check: bool = False) -> dict[str, Any]:
    """Run ``python -m engineloop.capture`` in the engine's environment and load what it wrote.

    Its whole output goes to a log file (kept, and named in the error, when the run fails or times
    out; removed when it succeeds and when it is interrupted: Ctrl-C once left it behind, unmentioned).
    A run that takes longer than ``$ENGINEPROFILES_CAPTURE_TIMEOUT`` seconds (default 1800) is killed
    with every engine process it started. Failures raise :class:`EngineRunFailed` naming
    the cause: the SGLang stand-in missing, a port in use, a timeout, an engine crash."""
    from . import runner

    timeout = _capture_timeout()
    # Inside the engine's own environment (scripts/probe.sh runs there) capture with this python.
    py = Path(sys.executable) if (runner.engine_importable(engine) and env is None) else runner.find_engine_python(engine, env)
    note(f"running {engine} from {py.parent.parent.name} on {model_dir.name} (engine start-up takes minutes)")
    cmd = [str(py), "-m", "engineloop.capture", engine, "--model", str(model_dir), "--out", str(out),
           "--prompts", str(prompts), "--max-tokens", str(max_tokens), "--seed", str(seed), "--mode", mode,
           "--prompt-len", str(prompt_len)] + (["--batch-check"] if batch_check else [])
    fd, name = tempfile.mkstemp(prefix=f"engineprofiles-{engine}-capture-", suffix=".log")
    log = Path(name)
    keep = False  # the log stays only where an error names it (a failed or timed-out run)
    try:
        with os.fdopen(fd, "w") as lf:
            lf.write(f"$ {' '.join(cmd)}\n")
            lf.flush()
            try:
                proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        start_new_session=True)
            except OSError as e:
                raise EngineProfilesError(f"cannot run {py} ({e.strerror or e}); is it the python of an environment "
                                          "made by scripts/engine_env.sh?") from None
            try:
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                keep = True
                raise EngineRunFailed(
                    f"{engine} capture timed out: the engine did not finish within {timeout:g} s (${TIMEOUT_VAR}) and "
                    f"was stopped; its output is in {log}", "timeout", log) from None
            except BaseException:  # Ctrl-C: leave no engine process behind (and, below, no log nobody is told of)
                _kill_group(proc)
                raise
        if code != 0:
            text = log.read_text(errors="replace")
            cause, what = _classify(text, code)
            lines = [ln for ln in text.splitlines() if ln.strip() and "Ignore import error" not in ln]
            tail = "\n".join(lines[-12:]) or "(no output: is it the python of an engine environment?)"
            hint = ""
            if cause == "missing-standin":
                hint = f"; make the environment again with `{runner.install_hint(engine)}`"
            how = f"killed by signal {-code}" if code < 0 else f"exit {code}"
            keep = True
            raise EngineRunFailed(f"{engine} capture with {py} failed ({how}): {cause}: {what}{hint}. Full log: {log}\n"
                                  f"{tail}", cause, log)
    finally:
        if not keep:
            log.unlink(missing_ok=True)
    return load_capture(out)


# An MoE model's experts (config fields), reported beside its size; a shared expert's width where the
# family has one (Qwen2-MoE).
MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob")
SHARED_EXPERT_FIELDS = ("shared_expert_intermediate_size",)


def model_fields(model: Any, cap: dict[str, Any] | None = None) -> dict[str, Any]:
    """The model's size (:data:`SIZE_FIELDS`), an MoE model's experts (:data:`MOE_FIELDS`) and,
    when its RoPE is scaled, its rope_parameters; ``checkpoint``, the folder, where the capture ran one."""
    out: dict[str, Any] = {k: getattr(model.config, k, None) for k in SIZE_FIELDS}
    if cap is not None and cap.get("checkpoint"):
        out = {"checkpoint": cap["checkpoint"]["path"], **out}
    if getattr(model.config, "num_experts", None):
        out.update({k: getattr(model.config, k) for k in MOE_FIELDS})
        out.update({k: getattr(model.config, k) for k in SHARED_EXPERT_FIELDS if hasattr(model.config, k)})
    rope = dict(getattr(model.config, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") != "default":
        out["rope_parameters"] = rope
    return out


def _check_model_options(family: str, size: dict[str, int] | None, rope_scaling: str | None, mode: str,
                         model_path: str | None) -> dict[str, int]:
    """The model options of an engine-in-the-loop run, checked; the tiny model's size overrides."""
    if family not in FAMILIES:
        raise EngineProfilesError(f"unknown model family {family!r}; families: {', '.join(FAMILIES)}")
    if rope_scaling is not None:
        check_rope_scaling_name(rope_scaling)
    check_mode_name(None, mode)
    size = dict(size or {})
    bad = sorted(set(size) - set(SIZE_FIELDS))
    if bad:
        raise EngineProfilesError(f"unknown model size field(s) {', '.join(bad)}; fields: {', '.join(SIZE_FIELDS)}")
    if family == "qwen2" and "head_dim" in size:
        hidden, heads = size.get("hidden_size", 256), size.get("num_attention_heads", 4)
        if size["head_dim"] * heads != hidden:
            raise EngineProfilesError(
                f"qwen2: head_dim {size['head_dim']} x {heads} heads != hidden {hidden}; vLLM's Qwen2 derives the head "
                "dim from hidden / heads, so the engine would run another model: make them agree")
    if model_path is not None and (size or rope_scaling):
        raise EngineProfilesError("--model runs the checkpoint as it is: the tiny model's size and --rope-scaling "
                                  "options do not apply")
    return size


def _check_capture(cap: dict[str, Any], capture_file: str, *, size: dict[str, int], family: str,
                   rope_scaling: str | None, batch_check: bool, model_path: str | None) -> dict[str, int]:
    """A capture file checked against the run's options (its model: the tiny model's size, family, RoPE
    scaling, or the checkpoint; its batch check); the size it was captured at."""
    recorded = cap.get("checkpoint")
    if recorded is not None and not (isinstance(recorded, dict) and isinstance(recorded.get("path"), str)):
        raise EngineProfilesError(f"{capture_file}: its field 'checkpoint' is not a checkpoint record (path, config "
                                  "hash, weight files)")
    if recorded is not None and model_path is None:
        raise EngineProfilesError(f"{capture_file} was captured on the checkpoint {recorded.get('path')}: pass "
                                  "--model with that folder")
    if model_path is not None and recorded is None:
        raise EngineProfilesError(f"{capture_file} was captured on the tool's tiny model, not a checkpoint: leave "
                                  "--model out")
    if model_path is not None and not checkpoint.same_checkpoint(recorded, model_path):
        raise EngineProfilesError(f"{capture_file} was captured on another checkpoint ({recorded.get('path')}: "
                                  f"its config or weight files differ from {model_path}'s)")
    recorded = cap.get("model_size")
    if recorded is not None:
        if size and size != recorded:
            raise EngineProfilesError(f"{capture_file} was captured on a model of size {recorded}; the size options "
                                      f"ask for {size}: leave them out with --capture")
        size = dict(recorded)
    if cap.get("family", family) != family:
        raise EngineProfilesError(f"{capture_file} was captured on a {cap['family']} model, not {family}")
    if cap.get("rope_scaling") != rope_scaling:
        got, want = (f"RoPE scaling {x}" if x else "default RoPE" for x in (cap.get("rope_scaling"), rope_scaling))
        raise EngineProfilesError(f"{capture_file} was captured on a model with {got}, not {want}")
    if batch_check and "batch_check" not in cap:
        raise EngineProfilesError(f"{capture_file} holds no batch check: capture it with --batch-check "
                                  "(probe-engine mismatch ... --batch-check --save-capture FILE)")
    return size


def model_and_capture(engine: str, family: str, *, size: dict[str, int] | None, capture_file: str | None,
                      save_capture: str | None, prompts: int, max_tokens: int, seed: int, env: str | None,
                      workdir: str | None, note: Callable[[str], None], mode: str, prompt_len: int,
                      what: str = "the mismatch run (the trainer side: HF models patched by the emulator)",
                      batch_check: bool = False, rope_scaling: str | None = None, model_path: str | None = None):
    """The tiny trainer model and the engine's capture on the same weights: a capture file's (its
    recorded size, family and RoPE scaling checked against the options), or a new engine run (kept in
    ``save_capture``). What ``probe-engine mismatch`` and ``localize`` start from. ``rope_scaling``:
    the tiny model's RoPE scaling (engineprofiles.models.ROPE_SCALINGS; None: default RoPE). ``model_path``:
    a checkpoint folder instead of the tiny model (engineloop.checkpoint; ``family`` must be its family)."""
    size = _check_model_options(family, size, rope_scaling, mode, model_path)
    require("insitu", what)
    from engineprofiles.models import tiny_model

    if capture_file:
        cap = load_capture(capture_file)
        size = _check_capture(cap, capture_file, size=size, family=family, rope_scaling=rope_scaling,
                              batch_check=batch_check, model_path=model_path)
    if model_path is not None:
        if not capture_file:
            checkpoint.check_context(model_path, prompt_len=prompt_len, prompts=prompts, max_tokens=max_tokens,
                                     batch_check=batch_check)
        model = checkpoint.load_checkpoint(model_path)
    else:
        model = tiny_model(family, seed=seed, rope_scaling=rope_scaling, **size).eval()
    if not capture_file:
        with tempfile.TemporaryDirectory() as tmp:
            wd = Path(workdir or tmp)
            if model_path is not None:  # the engine loads the checkpoint where it is
                model_dir = Path(model_path).resolve()
            else:
                model_dir = wd / f"tiny-{family}"
                save_model(model, model_dir)
            cap = run_capture(engine, model_dir, wd / "capture.pt", prompts=prompts, max_tokens=max_tokens,
                              seed=seed, env=env, note=note, mode="eager" if mode == "eager" else "default",
                              prompt_len=prompt_len, batch_check=batch_check)
            cap["model_size"], cap["family"], cap["rope_scaling"] = size, family, rope_scaling
            if model_path is not None:
                cap["checkpoint"] = checkpoint.fingerprint(model_path)
            if workdir:
                torch.save(cap, wd / "capture.pt")  # with the model's size, for --capture
        if save_capture:
            from engineprofiles.files import write_atomic_with

            write_atomic_with(save_capture, lambda f: torch.save(cap, f))  # the project's atomic writer
            note(f"capture saved to {save_capture} (reuse it with --capture)")
    return model, cap


def engine_profile(engine: str, cap: dict[str, Any], profile: str | None, *, capture_file: str | None, mode: str,
                   exact: bool) -> tuple[str, Profile, list[str]]:
    """The profile to apply for this capture (``profile``, or the engine's shipped one for the
    capture's version and mode) and the warnings it earns (another engine or version, another CPU
    capability). ``exact``: the profile must have the engine's attention measured."""
    eng = cap["engine"]
    cap_mode = eng.get("mode", "default")
    if capture_file and mode == "eager" and cap_mode != "eager":
        raise EngineProfilesError(f"{capture_file} was captured in the engine's {cap_mode} mode, not eager")
    prof_name = profile or default_profile_name(engine, eng["version"], cap_mode)
    if profile is None and prof_name not in shipped_names():
        raise EngineProfilesError(f"no shipped profile {prof_name} for {engine} {eng['version']}; pass --profile")
    prof = get_profile(prof_name)
    warnings = []
    # Before any trainer row: exact mode reproduces the engine its profile describes, so a profile of the other
    # engine the loop runs is refused (a capture the trainer made itself, as tests plant, takes any profile).
    if exact and prof.engine.name != eng["name"] and {prof.engine.name, eng["name"]} <= set(engines.loop_engines()):
        raise EngineProfilesError(
            f"--exact: profile {prof_name} is a profile of {prof.engine.name}, but the "
            f"{'capture ' + str(capture_file) if capture_file else 'capture'} comes from {eng['name']} {eng['version']}: "
            f"exact mode reproduces the engine its profile describes; pass a {eng['name']} profile")
    if prof.engine.name != eng["name"] or prof.engine.version != eng["version"]:
        warnings.append(
            f"profile {prof_name} is from {prof.engine.name} {prof.engine.version}, "
            f"but the samples come from {eng['name']} {eng['version']}"
        )
    if exact and not prof.available("attention"):
        raise EngineProfilesError(
            f"--exact needs the engine's attention in the profile, and {prof_name} has none measured "
            f"({prof.attention.evidence.reason}); re-probe it (`scripts/probe.sh {engine} {eng['version']} --ship`)")
    here = torch.backends.cpu.get_cpu_capability()
    probed = prof.engine.settings.get("cpu_capability")
    if probed is not None and probed != here:
        warnings.append(f"profile {prof_name} was probed on CPU capability {probed}; this machine is {here}")
    return prof_name, prof, warnings


def machine_differences(eng: dict[str, Any] | None, prof: Profile) -> list[str]:
    """Why exact mode cannot claim the captured engine's bits with ``prof``: what differs between the
    machine the profile records and the one the capture's engine ran on (its ``machine`` record, its
    attention ISA) or the one the trainer runs on (this one; alone when ``eng`` is None, before the
    engine ran). Empty when all three are one machine."""
    from engineprofiles.machine import Machine, differences, this_machine

    recorded = Machine.of(prof.engine.settings)
    out = [f"the trainer's machine: {d}" for d in differences(recorded, this_machine())]
    if eng is None:
        return out
    if eng.get("machine") is not None:
        out += [f"the engine's machine: {d}" for d in differences(recorded, Machine.of(eng["machine"]))]
    elif recorded.known:
        out.append("the engine's machine: the capture records no CPU features (made before captures did)")
    isa, probed_isa = (eng.get("attention") or {}).get("isa"), prof.engine.settings.get("attention_isa")
    if isa is not None and probed_isa is not None and str(isa) != str(probed_isa):
        out.append(f"the engine's attention ISA: {isa}, the profile's {probed_isa}")
    return out


def check_kernels_option(kernels: str, exact: bool, record: engines.Engine, program: str, run: str) -> None:
    """--kernels: one of apply_profile's values, with --exact; 'engine' only where this process imports the engine
    (checked again, kernel and ISA, when exact mode is applied). ``program`` and ``run``: the command that takes the
    option, and its arguments after the engine environment's python, for the hint."""
    import importlib.util
    import sys

    from emulator.patching.apply import KERNELS

    if kernels not in KERNELS:
        raise EngineProfilesError(f"--kernels must be one of {', '.join(KERNELS)}; got {kernels!r}")
    if kernels != "auto" and not exact:
        raise EngineProfilesError("--kernels chooses exact mode's attention: pass it with --exact")
    if kernels == "engine" and (record.exact_attention is None or importlib.util.find_spec(record.module) is None):
        why = ("has no kernel exact mode can call" if record.exact_attention is None
               else f"is not importable by this python ({sys.executable})")
        raise EngineProfilesError(f"--kernels engine runs {record.title}'s own attention kernel in this process, and "
                                  f"{record.name} {why}: run {program} with the engine environment's python "
                                  f"(e.g. .engines/{record.name}-{record.default_version}/bin/python {run}), or pass "
                                  "--kernels portable")


def check_machine(eng: dict[str, Any] | None, prof: Profile, allow_other_machine: bool) -> list[str]:
    """Exact mode's machine rule for a capture: raises (naming what differs) unless
    ``allow_other_machine``; then returns the warnings the report carries."""
    diffs = machine_differences(eng, prof)
    if not diffs:
        return []
    what = (f"profile {prof.canonical_name} (probed on {prof.engine.device}) does not describe the machine here: "
            + "; ".join(diffs))
    if not allow_other_machine:
        raise EngineProfilesError(
            f"--exact: {what}. The engine's kernels follow the machine, so exact mode refuses this: probe the engine "
            f"on the machine it ran on (`scripts/probe.sh {prof.engine.name} {prof.engine.version}`) and pass that "
            "profile, or add --allow-other-machine to compute the exact rows anyway (then they show what the profile's "
            "point gives on this capture, not a claim)")
    return [f"exact rows with --allow-other-machine: {what}; they are not expected to be bit-exact"]


def engine_kv_split(eng: dict[str, Any], prof: Profile) -> KVSplit | None:
    """The split-KV plan of the captured engine (vLLM on CPU with ``VLLM_CPU_ATTN_SPLIT_KV=1`` and
    more than one thread, as its capture records), for exact mode; None where it split nothing.
    The AVX2 build merges the chunks with separate multiplies and adds (its kernel has no FMA
    contraction, the profile's ``qk_dot`` says ``mul_add``), the AVX-512 build with FMAs."""
    att = eng.get("attention") or {}
    threads = att.get("torch_threads")
    record = engines.ENGINES.get(eng.get("name"))
    if record is None or not record.split_kv or not att.get("split_kv") or not isinstance(threads, int) or threads < 2:
        return None
    return KVSplit(threads=threads, merge=split_merge(prof.point("attention")) if prof.available("attention") else "fma")


def run_mismatch(engine: str = "vllm", *, family: str = "qwen2", profile: str | None = None, prompts: int = 4,
                 max_tokens: int = 16, seed: int = 0, env: str | None = None, workdir: str | None = None,
                 capture_file: str | None = None, note: Callable[[str], None] = lambda m: None,
                 mode: str = "default", exact: bool = False, size: dict[str, int] | None = None,
                 prompt_len: int = 12, save_capture: str | None = None, batch_check: bool = False,
                 rope_scaling: str | None = None, allow_other_machine: bool = False, kernels: str = "auto",
                 model_path: str | None = None) -> Report:
    """``mode``: the engine's default (vLLM on CPU: compiled) or ``eager`` (enforce_eager). ``exact``: add the
    ``exact`` rows (apply_profile(..., exact=True)). ``size``: tiny_model overrides (:data:`SIZE_FIELDS`);
    ``prompt_len``: length of the first prompt. ``batch_check``: the engine also scores the sequences in other batch
    compositions (:func:`batch_invariance`). ``rope_scaling``: the tiny model's RoPE scaling (ROPE_SCALINGS).
    ``allow_other_machine``: compute the exact rows although the profile's machine is not the one the engine or the
    trainer ran on (:func:`check_machine`; refused otherwise). ``kernels``: exact mode's attention (apply_profile's
    option: the engine's own kernel where this process imports it, or the portable reference). ``model_path``: a
    checkpoint folder instead of the tiny model (engineloop.checkpoint)."""
    model, cap = model_and_capture(engine, family, size=size, capture_file=capture_file, save_capture=save_capture,
                                   prompts=prompts, max_tokens=max_tokens, seed=seed, env=env, workdir=workdir,
                                   note=note, mode=mode, prompt_len=prompt_len, batch_check=batch_check,
                                   rope_scaling=rope_scaling, model_path=model_path)

    eng = cap["engine"]
    prof_name, prof, warnings = engine_profile(engine, cap, profile, capture_file=capture_file, mode=mode, exact=exact)
    tname = trainer_profile_name()
    trainer = get_profile(tname)
    warnings += trainer_warnings(tname)
    if exact:
        warnings += check_machine(eng, prof, allow_other_machine)
    report = Report(engine=eng, family=family, profile_name=prof_name, trainer_profile_name=tname, warnings=warnings,
                    model=model_fields(model, cap), prompt_len=len(cap["sequences"][0]["prompt"]))
    variants: list[tuple[str, Profile | None]] = [("as-is", None), ("+ engine profile", prof)]
    ablations = dict(ABLATIONS, **({"moe": ("moe",)} if FAMILIES[family].moe else {}),
                     **({"shared_expert": ("shared_expert",)} if FAMILIES[family].shared_expert else {}))
    for label, regs in ablations.items():
        variants.append((f"+ {label} only", combine(trainer, prof, regs)))
    kv_split = engine_kv_split(eng, prof) if exact else None
    if kv_split is not None:
        note(f"exact mode splits attention as the engine did: split-KV on, {kv_split.threads} threads")
        isa = (eng.get("attention") or {}).get("isa")
        if isa not in (None, "vec"):
            report.warnings.append(
                f"the engine's attention ran its {isa} ISA; exact mode's split-KV plan (KVSplit) was measured for "
                "the vec ISA (8 query heads per iteration, keys aligned to 32): its split rows may not be the engine's")
    seqs = cap["sequences"]
    le = torch.tensor([x for s in seqs for x in s["sample_logprobs"]], dtype=torch.float32)
    lpre = torch.tensor([x for s in seqs for x in s["prompt_logprobs"][1:]], dtype=torch.float32)
    for label, p in variants:
        note(f"trainer: {label}")
        samp, full = zip(*_patched(model, p, lambda: [sequence_logprobs(model, s) for s in seqs]))
        report.rows.append((label, mismatch(le, torch.cat(samp))))
        report.prefill_rows.append((label, mismatch(lpre, torch.cat(full))))
    exact_prefill: list[tuple[str, Mismatch]] = []
    batch_exact: list[dict[str, Any]] | None = None
    if exact:
        from emulator.patching import apply_profile

        # one patch for every exact row: its compiled stack's graphs (prefill, decode steps, as sampled) belong to
        # the patch, so they are traced once and reused across the rows (a patch per row traced them again)
        with apply_profile(model, prof, exact=True, kv_split=kv_split, allow_other_machine=allow_other_machine,
                           kernels=kernels) as handle:
            exact_prefill = _exact_rows(report, model, eng, seqs, le, lpre, handle, note)
            if batch_check:
                note("trainer: exact, against the engine's batched decode runs")
                batch_exact = _batch_exact_rows(model, cap)
    _diagnosis_rows(report, model, prof, seqs, lpre)
    report.prefill_rows += exact_prefill  # after the diagnosis row, as it reads
    _decode_against_prefill(report, eng, seqs, kv_split)
    if batch_check:
        report.batch_check = _batch_check(report, cap, batch_exact)
    return report


def _batch_check(report: Report, cap: dict[str, Any], exact_rows: list[dict[str, Any]] | None) -> dict[str, Any]:
    """The batch check's result (:func:`batch_invariance`, with the exact rows where --exact computed them: with
    split-KV off as_sampled changes nothing, then they are exact mode against a batch-invariant engine); a warning
    in ``report`` where the engine's log-probs change with the batch."""
    bc = batch_invariance(cap)
    if exact_rows is not None:
        bc["exact"] = exact_rows
    if not bc["batch_invariant"]:
        bad = [r["composition"] for r in bc["rows"] if r["exact_match"] < 1.0 or r.get("diverged")]
        split = cap["engine"].get("attention", {}).get("split_kv")
        report.warnings.append(
            f"the engine's log-probs change with the batch: {', '.join(bad)} differ from the same sequences scored "
            "alone; a trainer must score each sequence as it was batched (see the batch check)"
            + ("; vLLM's CPU attention splits decode contexts across threads by the batch's shape "
               "(VLLM_CPU_ATTN_SPLIT_KV=1): measured batch-invariant with VLLM_CPU_ATTN_SPLIT_KV=0 (docs/mismatch.md); "
               "exact mode scores a batched decode as sampled together (emulator.as_sampled(prompt_lengths, "
               "completion_lengths); with --exact, the batch check's exact rows)"
               if split else ""))
    return bc


def _patched(model, prof: Profile | None, fn: Callable[[], Any]) -> Any:
    """``fn()`` with ``model`` patched by ``prof`` (None: as it is)."""
    from emulator.patching import apply_profile

    handle = apply_profile(model, prof) if prof is not None else None
    try:
        return fn()
    finally:
        if handle is not None:
            handle.remove()


def _exact_rows(report: Report, model, eng: dict[str, Any], seqs: list[dict[str, Any]], le: torch.Tensor,
                lpre: torch.Tensor, handle, note: Callable[[str], None]) -> list[tuple[str, Mismatch]]:
    """The exact rows, ``model`` patched in exact mode (``handle``): each sequence re-scored in one forward
    ('exact'); the sampled tokens re-scored as the engine produced them (decode steps); with split-KV, each
    sequence in one forward as sampled. An engine whose sampler takes its log-probs by another formula (SGLang:
    log(softmax(x))) says so in its capture: that row too. Returns the prefill rows that follow the diagnosis row
    (the exact logits through the engine's own prompt log-prob formula, where it records one)."""
    note("trainer: exact")
    samp, full = zip(*[sequence_logprobs(model, s) for s in seqs])
    report.exact_kernels = handle.kernels
    note("exact mode's attention: " + ("the engine's own kernel" if report.exact_kernels == "engine"
                                       else "the portable reference"))
    report.rows.append(("exact", mismatch(le, torch.cat(samp))))
    report.prefill_rows.append(("exact", mismatch(lpre, torch.cat(full))))
    sampler = eng.get("decode_logprob_formula")
    formulas = ("log_softmax",) + ((sampler,) if sampler in LOGPROB_FORMULAS and sampler != "log_softmax" else ())
    note("trainer: exact, decoded")
    per_seq = [decoded_logprobs(model, s, formulas) for s in seqs]
    report.rows.append(("exact, decoded", mismatch(le, torch.cat([d[0] for d in per_seq]))))
    if handle.kv_split is not None:
        # one forward per sequence, as a trainer scores it, with the completion's rows split as the engine's
        # decode steps split them (emulator.as_sampled)
        from emulator import as_sampled

        note("trainer: exact, one forward as sampled")
        rows = []
        for s in seqs:
            with as_sampled(len(s["prompt"])):
                rows.append(sequence_logprobs(model, s)[0])
        report.rows.append(("exact, one forward as sampled", mismatch(le, torch.cat(rows))))
    if len(formulas) > 1:
        report.rows.append(("exact, decoded, engine's log-prob formula", mismatch(le, torch.cat([d[1] for d in per_seq]))))
    formula = eng.get("logprob_formula")
    if formula not in LOGPROB_FORMULAS:
        return []
    full = torch.cat([sequence_logprobs(model, s, formula)[1] for s in seqs])
    return [("exact, engine's log-prob formula", mismatch(lpre, full))]


def _diagnosis_rows(report: Report, model, prof: Profile, seqs: list[dict[str, Any]], lpre: torch.Tensor) -> None:
    """With the profile and the engine's own attention outputs (teacher forced), what is left is everything
    outside attention: if that row is exact, attention explains the rest."""
    if all(lay is not None for s in seqs for lay in s["layers"]):
        from emulator.functional import use_backend

        from .fit import teacher_forced_logprobs

        # the trainer's norms as the in-situ fit and exact mode run them for an Inductor engine
        backend = "reference-inductor" if prof.engine.execution_mode == "inductor" else "reference"

        def forced() -> torch.Tensor:
            with use_backend(backend):
                return torch.cat([teacher_forced_logprobs(model, s) for s in seqs])

        report.prefill_rows.append(("+ profile + engine attention", mismatch(lpre, _patched(model, prof, forced))))


def _decode_against_prefill(report: Report, eng: dict[str, Any], seqs: list[dict[str, Any]],
                            kv_split: KVSplit | None) -> None:
    """Whether the engine's own decode log-probs of the sampled tokens equal its prefill's (a warning,
    naming the split-KV decode where that explains it, when they do not)."""
    dec = torch.tensor([x for sq in seqs for x in sq["sample_logprobs"]], dtype=torch.float32)
    pre = torch.tensor([x for sq in seqs for x in sq["prompt_logprobs"][len(sq["prompt"]):]], dtype=torch.float32)
    if not (dec.numel() and dec.shape == pre.shape):
        return
    report.engine_decode_equals_prefill = float((dec == pre).float().mean())
    if report.engine_decode_equals_prefill == 1.0:
        return
    split = eng.get("attention", {}).get("split_kv")
    why = eng.get("decode_logprobs_note")
    report.warnings.append(
        f"the engine's own decode and prefill log-probs of the sampled tokens agree on only "
        f"{report.engine_decode_equals_prefill:.2%} of them: no single trainer forward can match both (a "
        "re-score in one prefill matches the prefill; --exact also decodes the sampled tokens one at a time "
        "as the engine did: row 'exact, decoded')"
        + (" (vLLM's CPU attention splits long decode contexts across threads with VLLM_CPU_ATTN_SPLIT_KV=1; "
           f"exact mode splits them as it did, from the {kv_split.threads} threads the capture records, and "
           "row 'exact, one forward as sampled' scores each sequence in one forward with its completion rows "
           "split as the decode steps were: emulator.as_sampled)"
           if split and kv_split is not None else
           " (vLLM's CPU attention splits long decode contexts across threads with VLLM_CPU_ATTN_SPLIT_KV=1; "
           "--exact splits them as it did)" if split else "")
        + (f" ({why})" if why else ""))


def _batch_exact_rows(model, cap: dict[str, Any]) -> list[dict[str, Any]]:
    """Exact mode (``model`` patched in it) against the engine's decode runs with several requests in one call (the
    batch check's "decoded together" runs): each sequence scored in one forward with its completion rows split as
    the engine's decode steps split them, as sampled alone (``as_sampled(prompt length)``, what a trainer that
    ignores the batch computes) and as sampled together with its batch (``as_sampled(prompt lengths, completion
    lengths, rows=[i])``: the split plan of each step's whole batch)."""
    from emulator import as_sampled

    prompts = [s["prompt"] for s in cap["sequences"]]
    out = []
    for run in cap["batch_check"]["runs"]:
        if run["kind"] != "decode" or len(run["calls"]) != 1 or len(run["calls"][0]) < 2:
            continue
        order = run["calls"][0]  # the requests in the order the engine was given them
        ps = [len(prompts[i]) for i in order]
        cs = [len(run["completions"][i]) for i in order]
        ref = torch.tensor([x for i in order for x in run["logprobs"][i]], dtype=torch.float32)
        alone, together = [], []
        for j, i in enumerate(order):
            seq = dict(prompt=prompts[i], completion=run["completions"][i])
            with as_sampled(ps[j]):
                alone.append(sequence_logprobs(model, seq)[0])
            with as_sampled(ps, cs, rows=[j]):
                together.append(sequence_logprobs(model, seq)[0])
        for label, got in (("exact, one forward as sampled alone", alone),
                           ("exact, one forward as sampled together", together)):
            m = mismatch(ref, torch.cat(got))
            out.append(dict(composition=run["name"], trainer=label, completion_lengths=cs, tokens=m.tokens,
                            exact_match=m.exact_match, abs_dlogp_max=m.abs_dlogp_max, k3_kl=m.k3_kl))
    return out


def _compare(ref: list[float], got: list[float]) -> tuple[int, int, float]:
    """Tokens compared, tokens bit-equal, max |difference| of two log-prob lists of one sequence."""
    a = torch.tensor(ref, dtype=torch.float64)
    b = torch.tensor(got, dtype=torch.float64)
    if a.shape != b.shape:
        raise CaptureError(f"batch check: {len(got)} log-probs where the sequence has {len(ref)}")
    d = (a - b).abs()
    return a.numel(), int((a == b).sum()), float(d.max()) if d.numel() else 0.0


def batch_invariance(cap: dict[str, Any]) -> dict[str, Any]:
    """Whether the engine gives the same log-probs to the same sequences in other batch compositions.

    Prefill runs are compared token for token with each sequence scored alone (the capture's own
    prompt log-probs). A decode run (greedy) is compared with the run it names as its ``reference``
    (the prompts decoded alone) on the tokens both decoded alike, up to the first that differs
    (``diverged`` counts the sequences whose tokens went another way). ``batch_invariant``: every
    compared log-prob bit-equal and no decoded sequence diverged. Each row keeps the tokens of every
    engine forward of its run, which shows whether the sequences really shared a forward."""
    bc = cap.get("batch_check")
    if not isinstance(bc, dict) or not isinstance(bc.get("runs"), list) or not bc["runs"]:
        raise CaptureError("the capture holds no batch check (capture with --batch-check)")
    seqs = cap["sequences"]
    by_name = {r["name"]: r for r in bc["runs"]}
    rows = []
    for run in bc["runs"]:
        if run["kind"] == "decode" and "reference" not in run:
            continue  # the reference of the decode runs
        if len(run["logprobs"]) != len(seqs):
            raise CaptureError(f"batch check: run {run['name']!r} holds {len(run['logprobs'])} sequences, the capture "
                               f"{len(seqs)}")
        n = eq = diverged = 0
        worst = 0.0
        for i, got in enumerate(run["logprobs"]):
            if run["kind"] == "prefill":
                ref = [float(x) for x in seqs[i]["prompt_logprobs"][1:]]
            else:
                base = by_name.get(run["reference"])
                if base is None:
                    raise CaptureError(f"batch check: run {run['name']!r} names a reference run {run['reference']!r} "
                                       "the capture does not hold")
                mine, theirs = run["completions"][i], base["completions"][i]
                same = next((k for k, (x, y) in enumerate(zip(mine, theirs)) if x != y), min(len(mine), len(theirs)))
                diverged += same < min(len(mine), len(theirs))  # a staggered run stops some sequences early
                ref, got = [float(x) for x in base["logprobs"][i][:same]], got[:same]
            k, e, m = _compare(ref, [float(x) for x in got])
            n, eq, worst = n + k, eq + e, max(worst, m)
        rows.append(dict(composition=run["name"], kind=run["kind"], tokens=n, equal=eq,
                         exact_match=eq / n if n else 1.0, abs_dlogp_max=worst,
                         requests_per_call=[len(c) for c in run["calls"]], forward_tokens=list(run["forward_tokens"]),
                         **({"diverged": diverged, "reference": run["reference"]} if run["kind"] == "decode" else {})))
    return dict(batch_invariant=all(r["equal"] == r["tokens"] and not r.get("diverged") for r in rows),
                max_num_seqs=bc.get("max_num_seqs"), prefix_caching=bc.get("prefix_caching"), rows=rows)
