"""Choosing a profile by engine name: ``apply_profile(model, "vllm")``.

A profile can be asked for by what it must fit instead of by file or shipped name::

    ENGINE[==VERSION][:MODE]        vllm   vllm==0.32.0   vllm:eager   vllm==0.28.0:compiled   sglang

:func:`select` is the choice itself, a pure function of the candidate profiles (:class:`Candidate`,
one per profile file) and what is wanted (:class:`Wanted`); it warns and logs nothing and reads
nothing from the machine, so it is tested without engines. ``engineprofiles.store.choose`` gathers
the candidates (the shipped profiles, or ``$ENGINEPROFILES_DIR``), the installed engine version and
this CPU's capability, calls it, logs the choice and issues its warnings.

What must match (else :class:`NoMatchingProfile`): the engine (an engine no profile has and no
probe adapter knows is :class:`UnknownEngine`); the execution mode (``default`` is the engine's
default, :data:`engineprofiles.engines.ENGINES` (each ``default_mode``): vLLM compiled, i.e. ``inductor``; ``:eager``
asks for another); the model's activation dtype when it is known (else bfloat16 is preferred); an
explicitly asked version.

What is preferred, in this order, with a :class:`MismatchedProfile` warning when only a mismatched
profile exists:

1. the device: a profile probed on the model's device type (cpu, cuda), else another
   (:class:`CapabilityMismatch`);
2. the version: the engine version installed in this Python (its distribution's metadata; the
   engine is not imported), else, when it is not installed, the newest version with a profile.
   When the installed version has no profile, the nearest one: the newest below it, else the
   oldest above it (:class:`VersionMismatch`);
3. on CPU, this machine's CPU capability (``torch.backends.cpu.get_cpu_capability()``, recorded in
   profiles as ``engine.settings.cpu_capability``; :class:`CapabilityMismatch`); then a profile that
   records this machine's kernel-selecting features (:mod:`engineprofiles.machine`: vendor, AMX, ...;
   said in the reasons, since exact mode refuses another machine's profile anyway);
4. the method: in-situ (fitted on whole models in the running engine) over op-level over synthetic;
5. the newest probe date, then the name (so the choice is deterministic).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Sequence

from .errors import CapabilityMismatch, MismatchedProfile, NoMatchingProfile, UnknownEngine, VersionMismatch
from .machine import Machine, differences
from . import engines
from .names import ACT_DTYPE_NAMES, SAFE_NAME

if TYPE_CHECKING:
    from .schema import Profile

SPEC_SYNTAX = "ENGINE[==VERSION][:MODE]"
# Engine names carry no dot (so ``name.yaml`` and ``vllm-0.32.0`` are never taken for one); versions
# are the plain names profiles record; modes are an engine's mode (compiled, eager, default) or an
# execution mode a profile records (inductor, torch-compile, ...).
_SPEC = re.compile(rf"(?P<engine>[A-Za-z][A-Za-z0-9_-]{{0,63}})(?:==(?P<version>{SAFE_NAME}))?"
                   r"(?::(?P<mode>[A-Za-z][A-Za-z0-9_-]{0,63}))?")
# Methods from most to least preferred: in-situ profiles are fitted on whole models in the running
# engine (fusion across layers), op-level ones on each region compiled alone.
METHOD_ORDER = ("in-situ", "op-level", "synthetic")


@dataclass(frozen=True)
class Spec:
    """A profile asked for by engine: ``vllm``, ``vllm==0.32.0``, ``vllm:eager``."""

    engine: str
    version: Optional[str] = None
    mode: str = "default"

    def __str__(self) -> str:
        return self.engine + (f"=={self.version}" if self.version else "") + (
            f":{self.mode}" if self.mode != "default" else "")


def parse_spec(text: str) -> Optional[Spec]:
    """The :class:`Spec` ``text`` writes, or None when it is not one (a path, a file name)."""
    m = _SPEC.fullmatch(text) if isinstance(text, str) else None
    if m is None:
        return None
    return Spec(m["engine"], m["version"], m["mode"] or "default")


def engine_version_hint(text: str) -> Optional[str]:
    """For ``vllm-0.32.0`` (an engine and a version joined by a dash, which is no shipped name):
    how to ask for it, ``vllm==0.32.0``."""
    m = re.fullmatch(r"([A-Za-z][A-Za-z0-9_]*)-(v?[0-9][A-Za-z0-9.+_]*)", text) if isinstance(text, str) else None
    if m is None or m[1] not in engines.ENGINES:
        return None
    return f"{m[1]}=={m[2]}"


@dataclass(frozen=True)
class Candidate:
    """What choosing needs to know of one profile file."""

    name: str  # the file's stem: what `probe-engine list` shows, what get_profile takes
    engine: str
    version: str
    mode: str  # engine.execution_mode
    dtype: str
    backend: str  # cpu, cuda, rocm, xpu
    capability: Optional[str] = None  # engine.settings.cpu_capability
    method: str = "op-level"
    date: str = ""
    schema: int = 2
    device_name: str = ""
    emulated: Optional[str] = None  # engine.settings.cpu_emulated: the capability was emulated on another CPU
    machine: Machine = field(default_factory=Machine)  # the kernel-selecting CPU features it records

    @classmethod
    def of(cls, name: str, profile: "Profile") -> "Candidate":
        e = profile.engine
        cap = e.settings.get("cpu_capability")
        emu = e.settings.get("cpu_emulated")
        return cls(name=name, engine=e.name, version=e.version, mode=e.execution_mode, dtype=profile.dtype,
                   backend=e.backend, capability=None if cap is None else str(cap), method=profile.provenance.method,
                   date=profile.provenance.date, schema=profile.schema_version, device_name=e.device,
                   emulated=None if emu is None else str(emu), machine=Machine.of(e.settings))

    def as_dict(self) -> dict[str, object]:
        """The fields `probe-engine list --json` prints (``device`` is the device type, cpu or cuda,
        as ``--device`` names it; ``device_name`` the probe machine's device as the OS names it)."""
        return {"name": self.name, "engine": self.engine, "version": self.version, "mode": self.mode,
                "dtype": self.dtype, "device": self.backend, "device_name": self.device_name,
                "capability": self.capability, "method": self.method, "schema": self.schema, "date": self.date}


@dataclass(frozen=True)
class Wanted:
    """What the chosen profile should fit. ``installed``: the engine version installed in this
    Python (None: not installed); ``dtype``: the model's (None: unknown, bfloat16 preferred);
    ``device``: the model's device type; ``capability``: this CPU's (None: unknown); ``machine``:
    this CPU's kernel-selecting features (:mod:`engineprofiles.machine`; None: unknown)."""

    engine: str
    version: Optional[str] = None
    mode: str = "default"
    dtype: Optional[str] = None
    device: str = "cpu"
    capability: Optional[str] = None
    installed: Optional[str] = None
    machine: Optional[Machine] = None  # this CPU's kernel-selecting features (None: unknown)

    @classmethod
    def of(cls, spec: Spec, **kw: object) -> "Wanted":
        return cls(engine=spec.engine, version=spec.version, mode=spec.mode, **kw)  # type: ignore[arg-type]

    @property
    def spec(self) -> str:
        return str(Spec(self.engine, self.version, self.mode))


@dataclass(frozen=True)
class Selection:
    """The chosen candidate, why (one phrase per criterion), and the warnings it deserves
    (category, message): empty when it matches everything asked."""

    candidate: Candidate
    wanted: Wanted
    reasons: tuple[str, ...]
    mismatches: tuple[tuple[type[MismatchedProfile], str], ...] = field(default=())

    @property
    def name(self) -> str:
        return self.candidate.name

    def message(self) -> str:
        return f"profile {self.name} chosen for {self.wanted.spec!r}: " + "; ".join(self.reasons)


# -- versions ---------------------------------------------------------------------------------------

_PRE_RELEASE = {"dev": 0, "a": 1, "alpha": 1, "b": 2, "beta": 2, "c": 3, "rc": 3, "pre": 3, "preview": 3}
_POST_RELEASE = ("post", "r", "rev")


def version_key(version: str) -> tuple:
    """An order on engine versions: release numbers (``0.32`` = ``0.32.0``), pre-releases before the
    release, post-releases after; a local part (``+cpu``, as vLLM's CPU build may report) ignored."""
    public = version.split("+", 1)[0].lower()
    m = re.fullmatch(r"v?(\d+(?:\.\d+)*)[._-]?([a-z]*)[._-]?(\d*)(.*)", public)
    if m is None:
        return (0, (), 0, 0, public)
    release = tuple(int(x) for x in m[1].split("."))
    while len(release) > 1 and release[-1] == 0:
        release = release[:-1]
    tag = m[2]
    rank = 4 if not tag else 5 if tag in _POST_RELEASE else _PRE_RELEASE.get(tag, 4)
    return (1, release, rank, int(m[3] or 0), m[4])


def same_version(a: str, b: str) -> bool:
    return version_key(a) == version_key(b)


# -- modes ------------------------------------------------------------------------------------------


def execution_mode(engine: str, mode: str) -> tuple[Optional[str], str]:
    """The execution mode a profile must record for ``mode`` of ``engine`` and a phrase saying why;
    None: any (``default`` of an engine this package has no adapter for)."""
    record = engines.ENGINES.get(engine)
    table = record.execution_modes if record else None
    if mode == "default":
        if record is None:
            return None, "any mode (no default is known for this engine)"
        return table[record.default_mode], f"the engine's default: {record.default_mode}"
    if table is not None and mode in table:
        return table[mode], f"{mode}, as asked"
    return mode, "as asked"


# -- the choice -------------------------------------------------------------------------------------


def _listing(values: Sequence[str]) -> str:
    return ", ".join(sorted(set(values))) or "none"


def _versions(values: Sequence[str]) -> str:
    return ", ".join(sorted(set(values), key=version_key)) or "none"


def select(candidates: Sequence[Candidate], wanted: Wanted, *, where: str = "") -> Selection:
    """The candidate that best fits ``wanted`` (see the module's docstring for the order).

    ``where``: where the candidates came from, for messages (e.g. ``" in /path/profiles"``).
    Raises :class:`UnknownEngine` for an engine no candidate has and no adapter knows, and
    :class:`NoMatchingProfile` when no candidate of the engine fits what must match."""
    w = wanted
    st = _Steps(w, where)
    pool = _of_engine(candidates, w, where)
    # must match: mode, dtype, an asked version
    pool, mode = st.mode(pool)
    pool = st.dtype(pool, mode)
    if w.version is not None:
        fit = [c for c in pool if same_version(c.version, w.version)]
        if not fit:
            raise NoMatchingProfile(
                f"no {w.engine} {w.version} profile{where} in mode {mode or 'any'}, {_listing([c.dtype for c in pool])}; "
                f"versions there: {_versions([c.version for c in pool])}. Probe it: scripts/probe.sh {w.engine} "
                f"{w.version}"
            )
        pool = fit
    # preferred: device, version, CPU capability, this machine, method
    pool = st.device(pool)
    pool, target = st.version(pool)
    pool = st.capability(pool, target)
    pool = st.machine(pool, target)
    chosen = st.method(pool)
    if chosen.emulated:
        st.reasons.append(f"its CPU capability was emulated, not measured on such a CPU ({chosen.emulated}); "
                          f"`probe-engine check {chosen.name}` re-probes it here")
    mismatches = [(cat, f"profile {chosen.name} chosen for {w.spec!r}: {text}") for cat, text in st.mismatches]
    return Selection(chosen, w, tuple(st.reasons), tuple(mismatches))


def _of_engine(candidates: Sequence[Candidate], w: Wanted, where: str) -> list[Candidate]:
    pool = [c for c in candidates if c.engine == w.engine]
    if pool:
        return pool
    with_profiles = sorted({c.engine for c in candidates})
    if w.engine not in engines.ENGINES:
        names = ", ".join(sorted(c.name for c in candidates)) or "none"
        raise UnknownEngine(
            f"no profile file, shipped profile or engine named {w.engine!r}; engines with profiles{where}: "
            f"{', '.join(with_profiles) or 'none'} (probe-engine probes {', '.join(engines.ENGINES)}); profiles: {names}. "
            f"Name a profile by engine as {SPEC_SYNTAX}, e.g. vllm, vllm==0.32.0 or vllm:eager"
        )
    raise NoMatchingProfile(
        f"no {w.engine} profile{where} (profiles there are of: {', '.join(with_profiles) or 'none'}); "
        f"probe it with `probe-engine {w.engine}`"
    )


class _Steps:
    """The steps of :func:`select` after the engine, each narrowing the pool and saying why
    (``reasons``), and what fits only partly (``mismatches``: the warning category and its text)."""

    def __init__(self, w: Wanted, where: str):
        self.w, self.where = w, where
        self.reasons: list[str] = []
        self.mismatches: list[tuple[type[MismatchedProfile], str]] = []

    def mode(self, pool: list[Candidate]) -> tuple[list[Candidate], str | None]:
        w, where = self.w, self.where
        mode, why = execution_mode(w.engine, w.mode)
        if mode is not None:
            fit = [c for c in pool if c.mode == mode]
            if not fit:
                record = engines.ENGINES.get(w.engine)
                choices = ", ".join(sorted(record.execution_modes if record else ())) or "the modes listed"
                raise NoMatchingProfile(
                    f"no {w.engine} profile{where} in execution mode {mode} ({why}); {w.engine} profiles there are "
                    f"in mode {_listing([c.mode for c in pool])}: ask for one with '{w.engine}:MODE' ({choices}), or "
                    f"probe this mode (`probe-engine {w.engine} --mode ...`)"
                )
            pool = fit
        self.reasons.append(f"mode {mode} ({why})" if mode is not None else why)
        return pool, mode

    def dtype(self, pool: list[Candidate], mode: str | None) -> list[Candidate]:
        w, where = self.w, self.where
        if w.dtype is None:
            fit = [c for c in pool if c.dtype == "bfloat16"]
            pool = fit or pool
            self.reasons.append("dtype bfloat16 (preferred; the model's dtype is not known)" if fit else
                                f"dtype {_listing([c.dtype for c in pool])} (the model's dtype is not known)")
            return pool
        fit = [c for c in pool if c.dtype == w.dtype]
        if not fit:
            todo = (f"or probe the engine with `--dtype {w.dtype}`" if w.dtype in ACT_DTYPE_NAMES else
                    f"profiles are measured in activation dtypes ({', '.join(ACT_DTYPE_NAMES)}) only")
            raise NoMatchingProfile(
                f"no {w.engine} profile{where} in {w.dtype} (the model's dtype) in mode {mode or 'any'}; there are "
                f"{_listing([c.dtype for c in pool])} ones: load the model in one of those dtypes; {todo}"
            )
        self.reasons.append(f"dtype {w.dtype} (the model's)")
        return fit

    def device(self, pool: list[Candidate]) -> list[Candidate]:
        w, where = self.w, self.where
        fit = [c for c in pool if c.backend == w.device]
        if fit:
            self.reasons.append(f"device {w.device} (the model's)")
            return fit
        probed = _listing([c.backend for c in pool])
        self.mismatches.append((CapabilityMismatch,
                                f"no {w.engine} profile{where} was probed on {w.device}, the model's device; using one "
                                f"probed on {probed}: the engine's {w.device} kernels may round elsewhere. Probe the "
                                f"engine on {w.device} (`probe-engine {w.engine} --device {w.device}`)"))
        self.reasons.append(f"device {probed} (none probed on {w.device})")
        return pool

    def version(self, pool: list[Candidate]) -> tuple[list[Candidate], str]:
        w, where = self.w, self.where
        versions = sorted({c.version for c in pool}, key=version_key)
        if w.version is not None:
            target = pool[0].version
            self.reasons.append(f"version {w.version}, as asked")
        elif w.installed is not None:
            exact = [v for v in versions if same_version(v, w.installed)]
            if exact:
                target = exact[-1]
                self.reasons.append(f"version {target} (installed here)")
            else:
                below = [v for v in versions if version_key(v) < version_key(w.installed)]
                target = below[-1] if below else versions[0]
                self.mismatches.append((VersionMismatch,
                                        f"{w.engine} {w.installed} is installed here, and no {w.engine} profile{where} "
                                        f"is of that version (there: {', '.join(versions)}); using {target}, the "
                                        f"nearest {'below' if below else 'above'} it. Its sites may differ from the "
                                        f"installed engine's: probe it (scripts/probe.sh {w.engine} "
                                        f"{w.installed.split('+', 1)[0]})"))
                self.reasons.append(f"version {target} (nearest to the installed {w.installed}, which has no profile)")
        else:
            target = versions[-1]
            self.reasons.append(f"version {target} (the newest with a profile; {w.engine} is not installed in this "
                                "Python)")
        return [c for c in pool if same_version(c.version, target)], target

    def capability(self, pool: list[Candidate], target: str) -> list[Candidate]:
        w, where = self.w, self.where
        if not (w.device == "cpu" and w.capability is not None and all(c.backend == "cpu" for c in pool)):
            return pool
        fit = [c for c in pool if c.capability == w.capability]
        if fit:
            self.reasons.append(f"CPU capability {w.capability} (this machine's)")
            return fit
        probed = _listing([c.capability or "unrecorded" for c in pool])
        self.mismatches.append((CapabilityMismatch,
                                f"no {w.engine} {target} profile{where} was probed on CPU capability {w.capability} "
                                f"(this machine's); using one probed on {probed}: the engine's kernels dispatch by "
                                f"vector ISA, so its evidence (match rates, exact mode's bit-exactness) may not hold "
                                f"here. Probe the engine on this machine (scripts/probe.sh {w.engine} {target})"))
        self.reasons.append(f"CPU capability {probed} (none probed on this machine's {w.capability})")
        return pool

    def machine(self, pool: list[Candidate], target: str) -> list[Candidate]:
        w = self.w
        if not (w.device == "cpu" and w.machine is not None and w.machine.known
                and all(c.backend == "cpu" for c in pool)):
            return pool
        # Exact mode refuses a profile of another machine (the engine's kernels follow it); the regions'
        # sites hold there, so for them this is a preference, said in the reasons, not a warning.
        fit = [c for c in pool if not differences(c.machine, w.machine)]
        if fit:
            self.reasons.append(f"this machine's CPU features ({w.machine.describe()})")
            return fit
        self.reasons.append(f"probed on another machine than this one ({w.machine.describe()}): exact mode refuses "
                            f"it; probe this machine (scripts/probe.sh {w.engine} {target})")
        return pool

    def method(self, pool: list[Candidate]) -> Candidate:
        def rank(c: Candidate) -> int:
            return METHOD_ORDER.index(c.method) if c.method in METHOD_ORDER else len(METHOD_ORDER)

        best = min(rank(c) for c in pool)
        methods = {c.method for c in pool}
        pool = sorted((c for c in pool if rank(c) == best), key=lambda c: (c.date, c.name))
        method = pool[0].method
        if method == "in-situ":
            self.reasons.append("in-situ (fitted on whole models in the running engine"
                                + ("; preferred over op-level)" if len(methods) > 1 else ")"))
        else:
            self.reasons.append(method)
        return pool[-1]
