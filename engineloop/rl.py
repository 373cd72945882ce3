"""A small RL loop on CPU with a real engine as the rollout worker: what the mismatch does to the
quantities an RL update uses, step by step, for the trainer as-is, with the engine's profile, and
in exact mode.

Each step: the engine (kept running, engineloop.rollout_worker) samples a group of completions per
prompt with the current policy weights and returns their log-probs; the trainer re-scores the same
tokens three ways (as-is, profile, exact) and the mismatch metrics of each are recorded
(engineprofiles.metrics.rollout_corr: k3 KL, exact-match fraction, |dlogp| max, and the spread of
the token importance ratios exp(logp_trainer - logp_engine), which an on-policy update assumes to
be exactly 1); then one policy-gradient step (GRPO-style group-normalized advantages on a toy
reward) is taken with the trainer in one of the three setups, and the new weights are loaded
into the engine in place. The toy reward is the fraction of sampled tokens whose id is in the
lowest eighth of the vocabulary: learnable in a few steps by a tiny random model.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from engineprofiles.errors import EngineProfilesError

SETUPS = ("as-is", "profile", "exact")


class EngineWorker:
    """The rollout worker process (engineloop.rollout_worker in the engine's environment)."""

    def __init__(self, engine: str, model_dir: Path, *, mode: str = "default", seed: int = 0, env: str | None = None,
                 log: Path | None = None):
        from . import runner

        py = Path(sys.executable) if (runner.engine_importable(engine) and env is None) else runner.find_engine_python(engine, env)
        self.log_path = log or Path(tempfile.mkstemp(prefix="rollout-worker-", suffix=".log")[1])
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [str(py), "-m", "engineloop.rollout_worker", engine, "--model", str(model_dir), "--mode", mode,
             "--seed", str(seed)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True)
        self.hello = self._read()

    def _read(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            tail = "\n".join(self.log_path.read_text(errors="replace").splitlines()[-15:])
            raise EngineProfilesError(f"the rollout worker exited (code {code}); its log {self.log_path} ends:\n{tail}")
        rep = json.loads(line)
        if not rep.get("ok"):
            raise EngineProfilesError(f"the rollout worker refused a request: {rep.get('error')} (log: {self.log_path})")
        return rep

    def request(self, **req) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.request(op="quit")
            except (EngineProfilesError, BrokenPipeError, OSError):
                pass
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()


def completion_logprobs(model, ids: torch.Tensor, n_prompt: int) -> torch.Tensor:
    """Log-probs [B, T] of the completion tokens ids[:, n_prompt:] under ``model`` (with grad if enabled)."""
    logits = model(input_ids=ids).logits[:, n_prompt - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, n_prompt:].unsqueeze(-1))[..., 0]


def toy_reward(completions: torch.Tensor, vocab: int) -> torch.Tensor:
    return (completions < vocab // 8).float().mean(-1)


def ratio_spread(logp_engine: torch.Tensor, logp_train: torch.Tensor) -> dict[str, float]:
    r = torch.exp(logp_train.double() - logp_engine.double())
    return {"is_ratio_std": float(r.std()), "is_ratio_max_dev": float((r - 1).abs().max())}


@dataclass
class StepRecord:
    step: int
    reward: float
    setups: dict[str, dict[str, float]] = field(default_factory=dict)  # setup -> metrics


@dataclass
class DemoResult:
    engine: dict[str, Any]
    profile: str
    train_with: str
    family: str
    steps: list[StepRecord] = field(default_factory=list)
    cpu_capability: str = ""
    command: str = ""
    other_machine: list[str] = field(default_factory=list)  # why exact mode's bits are not claimed here
    exact_kernels: str = ""  # exact mode's attention: "engine" (the engine's own kernel) or "portable"

    def as_dict(self) -> dict[str, Any]:
        return dict(engine=self.engine, profile=self.profile, train_with=self.train_with, family=self.family,
                    cpu_capability=self.cpu_capability, command=self.command, other_machine=self.other_machine,
                    exact_kernels=self.exact_kernels,
                    steps=[dict(step=s.step, reward=s.reward, setups=s.setups) for s in self.steps])


def run_demo(engine: str = "vllm", *, family: str = "qwen2", steps: int = 8, prompts: int = 2, group: int = 4,
             prompt_len: int = 12, max_tokens: int = 16, lr: float = 3e-3, seed: int = 0, mode: str = "default",
             train_with: str = "exact", profile: str | None = None, env: str | None = None, kernels: str = "auto",
             note: Callable[[str], None] = lambda m: None) -> DemoResult:
    from engineprofiles import engines
    from engineprofiles.models import tiny_model

    from .mismatch import check_kernels_option, save_model

    if train_with not in SETUPS:
        raise EngineProfilesError(f"--train-with must be one of {', '.join(SETUPS)}; got {train_with!r}")
    check_kernels_option(kernels, True, engines.get(engine), "the demo", "scripts/rl_demo.py ...")
    if min(steps, prompts, group, prompt_len, max_tokens) < 1:
        raise EngineProfilesError("steps, prompts, group, prompt length and max tokens must be positive")
    model = tiny_model(family, seed=seed)
    vocab = model.config.vocab_size
    with tempfile.TemporaryDirectory() as tmp:
        wd = Path(tmp)
        save_model(model, wd / "policy")
        note(f"starting {engine} as the rollout worker (engine start-up takes a while)")
        worker = EngineWorker(engine, wd / "policy", mode=mode, seed=seed, log=wd / "worker.log")
        try:
            res, setups, kv_split = _demo_setups(worker, engine, mode, profile, train_with, family, note, kernels)
            opt = torch.optim.Adam(model.parameters(), lr=lr)
            g = torch.Generator().manual_seed(seed)
            for step in range(steps):
                batch = [torch.randint(1, vocab, (prompt_len,), generator=g).tolist() for _ in range(prompts)]
                out = worker.request(op="generate", prompts=batch, n=group, max_tokens=max_tokens,
                                     seed=seed * 100003 + step * 1009, temperature=1.0)
                comp = torch.tensor(out["completions"])
                lp_engine = torch.tensor(out["logprobs"], dtype=torch.float32)
                ids = torch.cat([torch.tensor(batch).repeat_interleave(group, 0), comp], 1)
                reward = toy_reward(comp, vocab)
                rec = StepRecord(step, float(reward.mean()))
                model.eval()
                for name, setup in setups.items():
                    rec.setups[name] = _demo_score(model, setup, name == train_with, ids, comp, prompt_len, lp_engine,
                                                   reward.view(prompts, group), kv_split, bool(res.other_machine), opt,
                                                   kernels, res)
                opt.step()
                res.steps.append(rec)
                note(f"step {step + 1}/{steps}: reward {rec.reward:.3f}; k3 KL "
                     + ", ".join(f"{n} {v['k3_kl']:.1e}" for n, v in rec.setups.items())
                     + "; exact match " + ", ".join(f"{n} {v['exact_match']:.0%}" for n, v in rec.setups.items()))
                torch.save(model.state_dict(), wd / "weights.pt")
                worker.request(op="sync", weights=str(wd / "weights.pt"))
        finally:
            worker.close()
    return res


def _demo_setups(worker: EngineWorker, engine: str, mode: str, profile: str | None, train_with: str, family: str,
                 note: Callable[[str], None], kernels: str = "auto") -> tuple[DemoResult, dict[str, Any], Any]:
    """The demo's result so far, its setups (name: None for as-is, else (profile, exact)) and exact mode's
    split-KV plan, for the engine the worker runs."""
    from engineprofiles.machine import record
    from engineprofiles.store import get_profile

    from .mismatch import default_profile_name, engine_kv_split, machine_differences

    version = worker.hello["version"]
    prof_name = profile or default_profile_name(engine, version, mode)
    prof = get_profile(prof_name)
    setups: dict[str, Any] = {"as-is": None, "profile": (prof, False)}
    if prof.available("attention"):
        setups["exact"] = (prof, True)
    elif train_with == "exact":
        raise EngineProfilesError(f"{prof_name} has no measured attention: exact mode is unavailable; "
                                  "pass --train-with profile")
    elif kernels != "auto":
        raise EngineProfilesError(f"--kernels {kernels} chooses exact mode's attention, and {prof_name} has no "
                                  "measured attention (no exact setup): leave --kernels out")
    # vLLM's CPU attention splits long decode contexts across its threads, planned for each step's
    # whole batch: exact mode splits them as it did, scoring each rollout batch as sampled together
    att = worker.hello.get("attention") or {}
    kv_split = engine_kv_split(dict(name=engine, attention=att), prof) if "exact" in setups else None
    if kv_split is not None:
        note(f"exact mode splits attention as the engine does: split-KV on, {kv_split.threads} threads")
    res = DemoResult(engine=dict(name=engine, version=version, mode=mode, attention=att), profile=prof_name,
                     train_with=train_with, family=family, cpu_capability=torch.backends.cpu.get_cpu_capability())
    # A demo measures: on a machine the profile does not describe, exact mode runs its point anyway
    # (allow_other_machine) and the result says why its bits are not claimed here.
    res.other_machine = machine_differences(dict(attention=att, machine=record()), prof) if "exact" in setups else []
    if res.other_machine:
        note("exact mode on a machine the profile does not describe (measured, not claimed): "
             + "; ".join(res.other_machine))
    return res, setups, kv_split


def _demo_score(model, setup, train_now: bool, ids, comp, prompt_len: int, lp_engine, grouped, kv_split,
                other_machine: bool, opt, kernels: str = "auto", res: DemoResult | None = None) -> dict[str, float]:
    """One setup's scores of a step's rollouts against the engine's log-probs (``grouped``: the rewards,
    prompt by group); the setup that trains takes its policy-gradient step's gradients here. ``kernels``: exact
    mode's attention (apply_profile's option; which ran goes to ``res.exact_kernels``)."""
    from emulator import as_sampled
    from emulator.patching import apply_profile
    from engineprofiles.metrics import rollout_corr

    split = kv_split if setup and setup[1] else None
    handle = apply_profile(model, setup[0], exact=setup[1], kv_split=split, allow_other_machine=other_machine and setup[1],
                           **({"kernels": kernels} if setup[1] else {})) if setup else None
    if handle is not None and handle.exact and res is not None:
        res.exact_kernels = handle.kernels
    try:
        # the rows are the engine's batch, in the order it was given them (prompt-major)
        sampled = as_sampled([prompt_len] * len(ids), [comp.shape[1]] * len(ids)) if split else contextlib.nullcontext()
        with torch.set_grad_enabled(train_now), sampled:
            lp = completion_logprobs(model, ids, prompt_len)
        m = rollout_corr(lp_engine, lp.detach())
        scores = {k.split("/")[-1]: v for k, v in m.items()
                  if k.split("/")[-1] in ("k3_kl", "exact_match", "abs_dlogp_max", "ppl_ratio", "chi2_token")}
        scores.update(ratio_spread(lp_engine, lp.detach()))
        if train_now:
            adv = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)).view(-1)
            loss = -(adv[:, None] * lp).mean()
            opt.zero_grad()
            loss.backward()
    finally:
        if handle is not None:
            handle.remove()
    return scores


def plot(result: dict[str, Any], path: str) -> None:
    """Per-step k3 KL and importance-ratio spread of each setup, and the reward, as a PNG."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from engineprofiles.files import write_atomic

    steps = [s["step"] + 1 for s in result["steps"]]
    names = list(result["steps"][0]["setups"])
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    floor = 1e-12  # a log axis cannot show 0: exact-mode zeros are drawn at the floor and labelled
    for name in names:
        for ax, key in ((axes[0], "k3_kl"), (axes[1], "is_ratio_std")):
            ys = [max(s["setups"][name][key], floor) for s in result["steps"]]
            ax.plot(steps, ys, marker="o", label=name)
    for ax, title in ((axes[0], "k3 KL(engine || trainer) per step"),
                      (axes[1], "std of token importance ratios per step")):
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_title(title, fontsize=10)
        ax.axhline(floor, color="grey", lw=0.5, ls=":")
        ax.text(steps[0], floor * 1.6, "0 (bit-equal)", fontsize=8, color="grey")
        ax.legend(fontsize=8)
    axes[2].plot(steps, [s["reward"] for s in result["steps"]], marker="o", color="black")
    axes[2].set_xlabel("step")
    axes[2].set_title(f"toy reward (policy trained with: {result['train_with']})", fontsize=10)
    e = result["engine"]
    fig.suptitle(f"{e['name']} {e['version']} ({e['mode']} mode) rollouts re-scored by the HF trainer, "
                 f"tiny {result['family']}, {result['cpu_capability']}", fontsize=10)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    write_atomic(Path(path), buf.getvalue())


def main_summary(result: DemoResult) -> str:
    lines = [f"{'step':>4} {'reward':>7}  " + "  ".join(f"{n + ' k3 KL':>16} {n + ' exact':>12} {n + ' IS std':>14}"
                                                       for n in result.steps[0].setups)]
    for s in result.steps:
        lines.append(f"{s.step + 1:>4} {s.reward:>7.3f}  " + "  ".join(
            f"{v['k3_kl']:>16.2e} {v['exact_match']:>12.1%} {v['is_ratio_std']:>14.2e}" for v in s.setups.values()))
    return "\n".join(lines)
