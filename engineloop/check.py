"""probe-engine check: re-probe the installed engine a profile was measured on, and say whether it
still rounds where the profile says.

What is re-probed is read from the profile: the engine, its version (the installed one must be the
same), the execution mode, dtype and device, the probe's seed (the same inputs, so on the same CPU
code path the same bits), whether it was a --quick sweep, and which regions it measured (a region
or attention recorded as "not probed" is neither probed nor compared). The comparison is by lattice
point: every region's sites and formula variants, and attention's (schema version 2), must equal
the profile's; evidence (match rates, flags), the engine's settings and the provenance are shown
beside them but decide nothing. Only op-level profiles are checked: an in-situ profile is refused
(its fit runs the whole engine on tiny models for minutes; check the op-level profile it starts
from, or re-fit with ``probe-engine vllm --in-situ`` and ``probe-engine diff``).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional

from engineprofiles.errors import EngineProfilesError
from engineprofiles import engines
from engineprofiles.families import FAMILIES
from engineprofiles.names import BESIDE_NAMES, REGION_NAMES

if TYPE_CHECKING:
    from engineprofiles.diff import Diff, Row
    from engineprofiles.schema import Profile

NOT_PROBED = "not probed"  # how the probe (and schema migration) mark a region or attention it did not measure


class CheckRefused(EngineProfilesError):
    """A profile that ``check`` cannot re-probe: fitted in situ, synthetic, of a patched model, of
    an engine no adapter knows, or with nothing measured. The message says what to do instead."""


class InstalledVersionDiffers(EngineProfilesError):
    """The installed engine is another version than the profile's: another engine, not a drift of
    this one. ``probe-engine check`` exits 1 with this message, without probing."""

    def __init__(self, engine: str, installed: str, wanted: str, where: str):
        self.engine, self.installed, self.wanted = engine, installed, wanted
        super().__init__(
            f"installed {engine} version {installed} ({where}) differs from the profile's {wanted}: the profile "
            f"describes another engine. Check in the {engine} {wanted} environment (--env), or probe the installed "
            f"one (`probe-engine {engine} --op-level -o DIR`) and compare with `probe-engine diff`"
        )


@dataclass(frozen=True)
class Plan:
    """How to re-probe what a profile measured: the arguments of the op-level probe."""

    engine: str
    version: str
    mode: str  # the probe's --mode (default, compiled, eager)
    dtype: str
    device: str
    seed: int
    quick: bool
    regions: Optional[tuple[str, ...]]  # None: every region and attention
    family: Optional[str]  # transformers: the model family whose modules were probed

    def describe(self) -> str:
        what = f"mode {self.mode}, {self.dtype}, {self.device}, seed {self.seed}"
        if self.quick:
            what += ", quick sweep"
        if self.family:
            what += f", family {self.family}"
        if self.regions is not None:
            what += f", only {', '.join(self.regions)}"
        return f"{self.engine} {self.version} ({what})"


def _probe_mode(engine: str, execution_mode: str) -> Optional[str]:
    """The probe's --mode that records ``execution_mode`` (the inverse of the adapters' naming)."""
    e = engines.ENGINES.get(engine)
    for mode, recorded in (e.execution_modes.items() if e else ()):
        if recorded == execution_mode:
            if mode in e.modes:
                return mode
            return "default" if e.default_mode == mode else None
    return None


def skipped(profile: Profile) -> list[str]:
    """The regions (and the entries beside them) the profile records as not probed: left out of the check."""
    return [name for name, _, e in profile.entries()
            if e.evidence.status == "unavailable" and (e.evidence.reason or "").startswith(NOT_PROBED)]


def plan_for(profile: Profile, name: str) -> Plan:
    e, pv = profile.engine, profile.provenance
    if pv.method == "in-situ":
        op_level = profile.canonical_name.removesuffix("-insitu")
        raise CheckRefused(
            f"{name} was fitted in situ (provenance.method in-situ): check re-probes op-level only. Check the op-level "
            f"profile its fit starts from ({op_level}), or re-fit with `probe-engine {e.name} --in-situ -o DIR` "
            f"(minutes) and compare with `probe-engine diff {name} DIR/{profile.canonical_name}.yaml`"
        )
    if pv.method != "op-level":
        raise CheckRefused(f"{name} is a {pv.method} profile (provenance.method), not measured on an engine: there is "
                           "nothing to re-probe")
    if e.name not in engines.ENGINES:
        raise CheckRefused(f"{name} is a profile of {e.name!r}, which no probe adapter knows (engines: "
                           f"{', '.join(engines.ENGINES)})")
    mode = _probe_mode(e.name, e.execution_mode)
    if mode is None:
        hint = (" (a model patched by `probe-engine transformers --apply`: re-run that command and compare with "
                "`probe-engine diff`)" if e.execution_mode == "patched" else "")
        raise CheckRefused(f"{name}: {e.name}'s execution mode {e.execution_mode!r} is no mode the probe runs "
                           f"({', '.join(engines.get(e.name).modes)}){hint}")
    if e.backend not in ("cpu", "cuda"):
        raise CheckRefused(f"{name} was probed on backend {e.backend}; the probe runs on cpu or cuda")
    family = None
    if e.name == "transformers":
        family = str(e.settings.get("family", "qwen2"))
        if family not in FAMILIES:
            raise CheckRefused(f"{name}: engine.settings.family {family!r} is no model family the probe knows "
                               f"({', '.join(FAMILIES)})")
    skip = skipped(profile)
    if len(skip) == len(REGION_NAMES) + len(BESIDE_NAMES):
        raise CheckRefused(f"{name} records no region, no attention and no MoE experts as measured: there is nothing "
                           "to compare")
    regions = None if not skip else tuple(n for n in (*REGION_NAMES, *BESIDE_NAMES) if n not in skip)
    try:
        quick = "--quick" in shlex.split(pv.command)
    except ValueError:
        quick = "--quick" in pv.command.split()
    return Plan(engine=e.name, version=e.version, mode=mode, dtype=profile.dtype, device=e.backend,
                seed=pv.seed if pv.seed is not None else 0, quick=quick, regions=regions, family=family)


def one_engine(plans: list[tuple[str, Plan]]) -> tuple[str, str]:
    """The engine and version all ``plans`` share (one environment runs them)."""
    engine, version = plans[0][1].engine, plans[0][1].version
    for n, p in plans[1:]:
        if (p.engine, p.version) != (engine, version):
            raise CheckRefused(f"{plans[0][0]} is of {engine} {version}, {n} of {p.engine} {p.version}: check the "
                               "profiles of one engine version per run")
    return engine, version


def public_version(v: str) -> str:
    return v.split("+", 1)[0]


# -- the probe ------------------------------------------------------------------------------------------


def reprobe(plan: Plan, progress: Callable[[str], None]) -> Profile:
    """Probe the installed engine as ``plan`` says, in this process (the engine must be importable).
    Raises :class:`InstalledVersionDiffers` before probing when the engine is another version."""
    import time

    from engineprofiles import rounding
    from engineprofiles.probe.adapters import make_adapter
    from engineprofiles.probe.harness import run_probe

    t0 = time.perf_counter()
    dt = rounding.act_dtype(plan.dtype)
    adapter = make_adapter(plan.engine, plan.mode, dt, plan.device, plan.family)
    info = adapter.info()
    if info.version != plan.version:
        raise InstalledVersionDiffers(plan.engine, info.version, plan.version, "its __version__")
    cap = info.settings.get("cpu_capability")
    progress(f"{plan.engine} {info.version} loaded in {time.perf_counter() - t0:.1f}s"
             + (f" (CPU capability {cap})" if cap else ""))
    profile, _ = run_probe(adapter, dtype=plan.dtype, device=plan.device, seed=plan.seed, quick=plan.quick,
                           regions=None if plan.regions is None else list(plan.regions), progress=progress)
    return profile


# -- the comparison -----------------------------------------------------------------------------------


@dataclass
class Outcome:
    name: str
    path: str
    diff: Optional[Diff] = None  # None: not probed (another version is installed)
    notes: list[str] = field(default_factory=list)
    reason: Optional[str] = None  # why there is no diff

    @property
    def differences(self) -> list[Row]:
        return [] if self.diff is None else [r for r in self.diff.rows if not r.same]

    @property
    def exit_code(self) -> int:
        return 1 if self.diff is None or self.differences else 0

    def verdict(self) -> str:
        if self.diff is None:
            return f"differs: {self.name}: {self.reason}"
        n = len(self.differences)
        if n == 0:
            compared = ", ".join(dict.fromkeys(r.region for r in self.diff.rows))
            return (f"ok: {self.name}: the installed engine rounds as the profile says (compared {compared}: every "
                    "site and formula variant agrees)")
        what = "; ".join(f"{r.region}.{r.name}: {r.a} -> {r.b}" if r.kind != "availability" else
                         f"{r.region}: {r.a} -> {r.b}" for r in self.differences)
        return f"drift: {self.name}: {n} point component(s) differ (profile -> now): {what}"

    def as_dict(self) -> dict:
        import json

        return {
            "profile": self.name,
            "path": self.path,
            "exit_code": self.exit_code,
            "points_agree": None if self.diff is None else not self.differences,
            "differences": [dict(region=r.region, name=r.name, kind=r.kind, profile=r.a, now=r.b)
                            for r in self.differences],
            "notes": self.notes,
            "reason": self.reason,
            "diff": None if self.diff is None else json.loads(self.diff.to_json()),
        }


def compare(expected: Profile, probed: Profile, name: str, path: str = "", now_name: str = "installed now") -> Outcome:
    """The profile against the engine's probe now: the diff rows of every compared region and of
    attention (regions the profile did not probe left out); any row that differs is drift."""
    from engineprofiles.diff import diff_profiles

    d = diff_profiles(expected, probed, name, now_name)
    skip = skipped(expected)
    d.rows = [r for r in d.rows if r.region not in skip]
    notes = [f"{s}: not compared (the profile records: {_reason(expected, s)})" for s in skip]
    if expected.engine.backend == "cpu":
        here = probed.engine.settings.get("cpu_capability")
        there = expected.engine.settings.get("cpu_capability")
        if here != there:
            notes.append(
                f"this machine's CPU capability is {here}, the profile's {there or 'not recorded'}: kernels dispatch "
                "by vector ISA, so the profile's evidence belongs to another CPU code path; compared all the same")
    if probed.provenance.probe_version != expected.provenance.probe_version:
        notes.append(f"the probe is version {probed.provenance.probe_version}, the profile's "
                     f"{expected.provenance.probe_version}: a difference may come from the probe, not the engine")
    return Outcome(name=name, path=path, diff=d, notes=notes)


def _reason(p: Profile, region: str) -> str:
    return p.entry(region).evidence.reason or ""


def load_named(args: list[str], note: Callable[[str], None]) -> list[tuple[str, object, Profile]]:
    """``probe-engine check``'s arguments loaded: (the name to show and pass on, its file, the profile);
    an engine spec (``vllm==0.32.0``) becomes the shipped profile it chooses, said through ``note``."""
    from engineprofiles import store
    from engineprofiles.schema import load_profile

    loaded = []
    for arg in args:
        if store.names_engine(arg):
            _, chosen = store.choose(arg)
            name = chosen.candidate.name
            note(f"{arg}: {name}")
            path = store.resolve(name)
        else:
            name, path = arg, store.resolve(arg)
        loaded.append((name, path, load_profile(path)))
    return loaded


def run_checks(loaded: list[tuple[str, object, Profile]], plans: list[tuple[str, Plan]], engine: str, version: str,
               installed: Optional[str], where: str, progress: Callable[[str], None],
               say: Callable[[str], None]) -> list[Outcome]:
    """Re-probe each distinct plan once and compare every profile of it; an installed engine of another
    version than the profiles' gives each an Outcome saying so (nothing probed)."""
    if installed is not None and public_version(installed) != public_version(version):
        e = InstalledVersionDiffers(engine, installed, version, where)
        return [Outcome(name=n, path=str(path), reason=str(e)) for n, path, _ in loaded]
    groups: dict = {}
    for (name, path, p), (_, plan) in zip(loaded, plans):
        groups.setdefault(plan, []).append((name, path, p))
    outcomes = []
    for plan, members in groups.items():
        say(f"checking {', '.join(n for n, _, _ in members)}: re-probing {plan.describe()}")
        probed = reprobe(plan, progress)
        for name, path, p in members:
            outcomes.append(compare(p, probed, name, str(path), f"{engine} {probed.engine.version} now"))
    return outcomes
