"""The profile: where one engine rounds, in each region, with the evidence and how it was made.

A profile is data (YAML); nothing in the model code branches on engine names. Loading is strict:
an unknown key, a wrong type, an unknown site or option, a missing region or an unsupported schema
version raises :class:`ProfileError` naming the file, the field and what is allowed. Dumping is
canonical: ``dump(load(text)) == text`` for every profile this package writes.
"""

from __future__ import annotations

import datetime as _dt
import os
from pathlib import Path
from typing import Annotated, Any, Literal, Optional

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, create_model, model_validator

from . import safeyaml
from .errors import ProfileError
from .files import write_atomic
from .names import SAFE_NAME
from .regions import ATTENTION_SPEC, BESIDE, MOE_SPEC, REGIONS, SHARED_EXPERT_SPEC, Point, RegionSpec

# 2: the ``attention`` entry (what exact mode consumes). 3: the evidence's ``scope``. 4: the ``moe``
# entry (a sparse MoE block's experts). 5: the ``shared_expert`` entry (a sparse MoE block's shared
# expert). Older files load migrated (:func:`migrate`); this package writes the current version only.
SCHEMA_VERSION = 5
SUPPORTED_SCHEMA_VERSIONS = (1, 2, 3, 4, 5)
V1_ATTENTION_REASON = "not probed: the profile was written with schema version 1, before attention was measured; re-probe"
V3_MOE_REASON = ("not probed: the profile was written with schema version 3, before the MoE experts were probed; "
                 "re-probe")
V4_SHARED_REASON = ("not probed: the profile was written with schema version 4, before the MoE shared expert was "
                    "probed; re-probe")
# The version each entry beside the regions came with (an older profile records it as not probed) and
# the version the evidence's scope came with: what the emulator's messages and the tests' older files read.
ENTRY_SINCE = {"attention": 2, "moe": 4, "shared_expert": 5}
SCOPE_SINCE = 3

Precision = Literal["fp32", "rounded"]
SettingValue = Optional[str | int | float | bool | list[str]]

# The parts of a profile's canonical name (and so of a file name): a safe name, never a path.
NAME_PATTERN = f"^{SAFE_NAME}$"
Name = Annotated[str, Field(pattern=NAME_PATTERN)]
Rate = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
Count = Annotated[int, Field(ge=0)]
Seed = Annotated[int, Field(ge=0, le=2**63 - 1)]  # a torch.Generator's seed (probe-engine takes 0 .. 2**31 - 1)
# Settings that become part of the canonical name (and so of a file name): a plain name, never a list or a path.
NAMED_SETTINGS = ("cpu_capability",)


def _iso_time(v: str) -> str:
    try:
        t = _dt.datetime.fromisoformat(v)
    except ValueError:
        raise ValueError("must be an ISO 8601 time with a time zone, e.g. 2026-12-02T15:33:21Z") from None
    if t.tzinfo is None:
        raise ValueError("must name its time zone (UTC: a trailing Z)")
    return v


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class EngineInfo(StrictModel):
    name: Name = Field(description="engine name: vllm, sglang, transformers, ...")
    version: Name
    backend: Literal["cpu", "cuda", "rocm", "xpu"]
    device: str = Field(description="the device the probe ran on, as the OS or driver names it")
    torch_version: str
    execution_mode: Name = Field(description="how the engine ran the regions: eager, inductor, custom-op, ...")
    settings: dict[str, SettingValue] = Field(default_factory=dict, description="engine settings that affect numerics")

    @model_validator(mode="after")
    def _named_settings(self) -> "EngineInfo":
        import re

        for key in NAMED_SETTINGS:
            v = self.settings.get(key)
            if v is not None and not (isinstance(v, str) and re.fullmatch(SAFE_NAME, v)):
                raise ValueError(
                    f"settings.{key} must be a plain name (letters, digits and . _ + -, starting with a letter or digit, "
                    f"at most 64 characters; it becomes part of the profile's name and file name), got "
                    f"{safeyaml.short(v)}")
        return self


class ShapeResult(StrictModel):
    shape: str
    winner: str
    match_rate: Rate


class Evidence(StrictModel):
    status: Literal["measured", "unavailable"] = "measured"
    reason: Optional[str] = None
    # 3: what match_rate and elements count. "region": this region's own outputs (op-level probes,
    # attention calls). "whole-model": every captured tensor of whole models under the fitted
    # profile (the in-situ fit changes the regions jointly), the same figures for every region.
    scope: Literal["region", "whole-model"] = Field(
        "region", description="what match_rate counts: the region's own outputs, or a whole model's captured tensors")
    path: Optional[str] = Field(None, description="the engine code path that was probed")
    match_rate: Optional[Rate] = Field(None, description="fraction of output elements the winner matches bitwise")
    runner_up: Optional[str] = None
    runner_up_match_rate: Optional[Rate] = None
    max_ulp: Optional[Count] = Field(None, description="largest ULP distance of the winner's mismatches")
    elements: Optional[Count] = None
    shapes: list[str] = Field(default_factory=list)
    ambiguous: bool = False
    tied_with: list[str] = Field(default_factory=list)
    indistinguishable: list[str] = Field(
        default_factory=list, description="variants never told apart from the winner on the probe inputs"
    )
    shape_dependent: bool = False
    nondeterministic: bool = False
    per_shape: list[ShapeResult] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _reason_when_unavailable(self) -> "Evidence":
        if self.status == "unavailable" and not self.reason:
            raise ValueError("an unavailable region needs a reason")
        return self


def _entry_model(spec: RegionSpec) -> type[StrictModel]:
    sites = create_model(
        f"{spec.name}_sites",
        __base__=StrictModel,
        # a site added after profiles were shipped takes its default where a profile has none (Choice.default)
        **{c.name: (Literal[c.options], Field(... if c.default is None else c.default, description=c.doc))
           for c in spec.sites},  # type: ignore[valid-type]
    )
    variants = create_model(
        f"{spec.name}_variants",
        __base__=StrictModel,
        **{c.name: (Literal[c.options], Field(c.options[0] if c.default is None else c.default, description=c.doc))
           for c in spec.variants},  # type: ignore[valid-type]
    )

    def _check(self: Any) -> Any:
        if self.evidence.status == "measured" and self.sites is None:
            raise ValueError("a measured region needs its sites")
        return self

    model = create_model(
        f"{spec.name}_entry",
        __base__=StrictModel,
        __validators__={"_check": model_validator(mode="after")(_check)},
        sites=(Optional[sites], ...),
        variants=(variants, Field(default_factory=variants)),
        evidence=(Evidence, Field(default_factory=Evidence)),
    )
    return model


def _dump_choices(spec: RegionSpec, values: Any) -> dict[str, str]:
    """An entry's sites or variants as written: every one, except a site or variant the spec added after
    profiles were shipped (``Choice.default``) while it holds that default, the meaning a file without it
    has (attention's ``output: nearest``), so that those files load and dump to the same bytes."""
    return {k: v for k, v in values.model_dump().items() if v != spec.choice(k).default}


ENTRY_MODELS = {name: _entry_model(spec) for name, spec in REGIONS.items()}
Regions = create_model(
    "Regions", __base__=StrictModel, **{name: (model, ...) for name, model in ENTRY_MODELS.items()}  # type: ignore[arg-type]
)
AttentionEntry = _entry_model(ATTENTION_SPEC)
MoeEntry = _entry_model(MOE_SPEC)
SharedExpertEntry = _entry_model(SHARED_EXPERT_SPEC)


class SelfCheck(StrictModel):
    """What exact mode with this profile reproduced of the engine on a model the fit never saw (widths
    drawn at random), measured right after an in-situ probe (engineloop.selfcheck): each exact row of
    ``probe-engine mismatch --exact``, the fraction of tokens whose log-prob equals the engine's."""

    model: str = Field(description="the model the engine and the trainer ran: family and widths")
    seed: Seed
    sampled_tokens: Count
    prefill_tokens: Count
    sampled: dict[str, Rate] = Field(description="exact rows over the sampled tokens: row -> exact-match fraction")
    prefill: dict[str, Rate] = Field(description="exact rows over the re-scored prompts: row -> exact-match fraction")

    @property
    def exact(self) -> bool:
        """Whether some way a user is told to score the tokens matched every one: the best sampled row
        (one forward as sampled, decoded as the engine decoded, through the engine's log-prob formula)
        and the best prefill row (the plain re-score, or through the engine's log-prob formula)."""
        return max(self.sampled.values(), default=0.0) == 1.0 and max(self.prefill.values(), default=0.0) == 1.0

    def rows(self) -> str:
        """Every row's rate, for messages."""
        return ", ".join([f"{n} {r:.2%}" for n, r in self.sampled.items()]
                         + [f"prefill {n} {r:.2%}" for n, r in self.prefill.items()])


class Provenance(StrictModel):
    date: Annotated[str, AfterValidator(_iso_time)] = Field(description="ISO 8601 time of the probe run (UTC)")
    probe_version: str
    package_version: str
    method: Literal["op-level", "in-situ", "synthetic"]
    command: str
    host: Optional[str] = None
    seed: Optional[Seed] = None
    duration_s: Optional[Annotated[float, Field(ge=0.0, allow_inf_nan=False)]] = None
    # Added after schema version 5 without a version bump: optional, absent in older files.
    self_check: Optional[SelfCheck] = Field(
        None, description="exact mode against the engine on a model of random widths, measured after an in-situ fit")


class Profile(StrictModel):
    schema_version: int
    engine: EngineInfo
    dtype: Literal["bfloat16", "float16"]
    regions: Regions  # type: ignore[valid-type]
    # Attention as the engine computes it (prefill and decode): not one of the regions the profile
    # aligns, but what exact mode needs. ``evidence.status: unavailable`` with a reason when the
    # probe did not measure it.
    attention: AttentionEntry  # type: ignore[valid-type]
    # The experts of a sparse MoE block as the engine runs them (its fused-MoE path): the SwiGLU
    # expert MLP with its GEMMs and the weighted sum over the top-k experts. Unavailable, with the
    # reason, where the engine has no such path on the device or it was not probed.
    moe: MoeEntry  # type: ignore[valid-type]
    # The shared expert of a sparse MoE block (Qwen2-MoE) and its sum with the routed experts'
    # output, as the engine runs them; unavailable, with the reason, where not probed.
    shared_expert: SharedExpertEntry  # type: ignore[valid-type]
    provenance: Provenance

    # -- access ---------------------------------------------------------------------------
    def entry(self, region: str) -> Any:
        """The entry of a region, or of ``attention`` / ``moe`` / ``shared_expert`` (beside the regions)."""
        if region in BESIDE:
            return getattr(self, region)
        return getattr(self.regions, region)

    def entries(self) -> list[tuple[str, RegionSpec, Any]]:
        """(name, spec, entry) of every region, then those beside them: what diff and show walk through."""
        return [(n, s, self.entry(n)) for n, s in (*REGIONS.items(), *BESIDE.items())]

    def available(self, region: str) -> bool:
        return self.entry(region).evidence.status == "measured"

    def point(self, region: str) -> Point:
        """The lattice point this profile assigns to ``region`` (or to an entry beside the regions)."""
        if region in BESIDE:
            e = self.entry(region)
            if e.sites is None:
                raise ProfileError(f"{region} was not measured in this profile ({e.evidence.reason})", field=region)
            return BESIDE[region].point(e.sites.model_dump(), e.variants.model_dump())
        e = self.entry(region)
        if e.sites is None:
            raise ProfileError(
                f"region {region} is unavailable in this profile ({e.evidence.reason})", field=f"regions.{region}"
            )
        return REGIONS[region].point(e.sites.model_dump(), e.variants.model_dump())

    @property
    def canonical_name(self) -> str:
        """``engine-version-backend-mode-dtype``, then ``-insitu`` for an in-situ profile, then the CPU
        capability in lower case when it is recorded and is not AVX512 (``-avx2``): the shipped
        CPU profiles were first probed on AVX512 and keep their names; one engine version can ship
        a profile per capability where they differ."""
        e = self.engine
        suffix = "-insitu" if self.provenance.method == "in-situ" else ""
        cap = e.settings.get("cpu_capability")
        if e.backend == "cpu" and cap is not None and str(cap) != "AVX512":
            suffix += f"-{str(cap).lower()}"
        return f"{e.name}-{e.version}-{e.backend}-{e.execution_mode}-{self.dtype}{suffix}"

    # -- YAML -----------------------------------------------------------------------------
    def to_yaml(self) -> str:
        data = self.model_dump(mode="json", exclude_defaults=True)
        data["schema_version"] = self.schema_version
        # Keep every region's sites visible even when they equal a default (not a late site's: _dump_choices).
        for name, spec in REGIONS.items():
            data["regions"].setdefault(name, {})
            entry = self.entry(name)
            data["regions"][name] = {
                "sites": None if entry.sites is None else _dump_choices(spec, entry.sites),
                "variants": _dump_choices(spec, entry.variants),
                "evidence": entry.evidence.model_dump(mode="json", exclude_defaults=True),
            }
        for name, spec in BESIDE.items():
            e = self.entry(name)
            data[name] = {
                "sites": None if e.sites is None else _dump_choices(spec, e.sites),
                "variants": _dump_choices(spec, e.variants),
                "evidence": e.evidence.model_dump(mode="json", exclude_defaults=True),
            }
        ordered = {k: data[k] for k in ("schema_version", "engine", "dtype", "regions", *BESIDE, "provenance")}
        return yaml.safe_dump(ordered, sort_keys=False, default_flow_style=False, width=100, allow_unicode=True)

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the YAML atomically: a failure leaves no half-written file."""
        return write_atomic(Path(path), self.to_yaml())


# -- parsing with messages that name the file and the field ------------------------------------


def _allowed_here(loc: tuple[Any, ...]) -> str:
    """What is allowed at ``loc``, for messages about unknown keys."""
    if len(loc) >= 3 and loc[0] in BESIDE and loc[1] in ("sites", "variants"):
        spec = BESIDE[loc[0]]
        names = spec.site_names if loc[1] == "sites" else spec.variant_names
        kind = "site" if loc[1] == "sites" else "variant"
        return f"unknown {kind} {loc[2]!r} of {loc[0]}; its {kind}s are: {', '.join(names)}"
    if len(loc) >= 4 and loc[0] == "regions" and loc[2] in ("sites", "variants") and loc[1] in REGIONS:
        spec = REGIONS[loc[1]]
        names = spec.site_names if loc[2] == "sites" else spec.variant_names
        kind = "site" if loc[2] == "sites" else "variant"
        return f"unknown {kind} {loc[3]!r} of region {loc[1]}; its {kind}s are: {', '.join(names) or '(none)'}"
    if len(loc) == 2 and loc[0] == "regions":
        return f"unknown region {loc[1]!r}; regions are: {', '.join(REGIONS)}"
    model: Any = Profile
    for part in loc[:-1]:
        field = model.model_fields.get(part) if hasattr(model, "model_fields") else None
        if field is None:
            return f"unknown key {loc[-1]!r}"
        ann = field.annotation
        model = next((a for a in getattr(ann, "__args__", (ann,)) if hasattr(a, "model_fields")), ann)
    allowed = ", ".join(getattr(model, "model_fields", {}).keys())
    return f"unknown key {loc[-1]!r}; allowed keys here: {allowed}"


def _format_error(err: dict[str, Any]) -> tuple[str, str]:
    loc = tuple(p for p in err["loc"] if not isinstance(p, str) or not p.startswith("function-after"))
    loc = tuple(p if not isinstance(p, str) or len(p) <= 60 else p[:57] + "..." for p in loc)  # keys come from the file
    field = ".".join(str(p) for p in loc) or "(top level)"
    kind = err["type"]
    if kind == "extra_forbidden":
        return field, _allowed_here(loc)
    if kind == "missing":
        if len(loc) == 2 and loc[0] == "regions":
            return field, (
                f"missing region {loc[1]!r}: a profile lists every region ({', '.join(REGIONS)}); "
                "one an engine cannot run is recorded with evidence.status: unavailable and a reason"
            )
        if len(loc) == 4 and loc[2] == "sites":
            return field, f"missing site {loc[3]!r} of region {loc[1]}"
        if loc == ("attention",):
            return field, ("missing attention entry: a version 2 profile records attention, measured or with "
                           "evidence.status: unavailable and a reason")
        if loc == ("moe",):
            return field, ("missing moe entry: a version 4 profile records the MoE experts, measured or with "
                           "evidence.status: unavailable and a reason")
        if loc == ("shared_expert",):
            return field, ("missing shared_expert entry: a version 5 profile records the MoE shared expert, measured "
                           "or with evidence.status: unavailable and a reason")
        if len(loc) == 3 and loc[0] in BESIDE and loc[1] == "sites":
            return field, f"missing site {loc[2]!r} of {loc[0]}"
        return field, "required field is missing"
    got = err.get("input")
    if kind == "value_error":  # a model's own check: its message says what it got
        return field, str(err["msg"]).removeprefix("Value error, ")
    if kind == "string_pattern_mismatch":
        return field, (
            f"must be a plain name (letters, digits and . _ + -, starting with a letter or digit, at most 64 "
            f"characters; it becomes part of file names), got {safeyaml.short(got)}"
        )
    shown = safeyaml.short(got) if not isinstance(got, dict) else "a mapping"
    return field, f"{err['msg']} (got {shown})"


def profile_from_data(data: Any, source: str = "<profile>") -> Profile:
    if data is None:
        raise ProfileError("empty: no YAML document (only blanks or comments); a profile is a YAML mapping", source=source)
    if not isinstance(data, dict):
        raise ProfileError(f"a profile is a YAML mapping, got {type(data).__name__}", source=source)
    version = data.get("schema_version")
    if version is None:
        raise ProfileError("missing schema_version", source=source, field="schema_version")
    # An integer, as written (2.0 == 2 in Python, but the schema's integers are strict: 5.0 was refused, 2.0 not).
    if type(version) is not int or version not in SUPPORTED_SCHEMA_VERSIONS:
        raise ProfileError(
            f"schema version {safeyaml.short(version)} is not supported by this engineprofiles (supports the integers "
            f"{', '.join(map(str, SUPPORTED_SCHEMA_VERSIONS))}); upgrade engineprofiles or re-probe",
            source=source,
            field="schema_version",
        )
    if version < SCHEMA_VERSION:
        data = migrate(data, source)
    try:
        return Profile.model_validate(data)
    except ValidationError as e:
        errors = [_format_error(err) for err in e.errors()]
        field, msg = errors[0]
        more = f" (and {len(errors) - 1} more: {'; '.join(f for f, _ in errors[1:4])})" if len(errors) > 1 else ""
        raise ProfileError(msg + more, source=source, field=field) from None


def migrate(data: dict[str, Any], source: str = "<profile>") -> dict[str, Any]:
    """An older profile as the current version. 1 -> 2: the same regions, attention recorded as not
    measured. 2 -> 3: the regions' evidence of an in-situ profile gets ``scope: whole-model`` (what
    its figures always were: the whole model's, written into every region), any other ``region``.
    3 -> 4: the MoE experts recorded as not probed. 4 -> 5: the MoE shared expert recorded as not probed."""
    version = data.get("schema_version")
    if version == 1:
        if "attention" in data:
            raise ProfileError("schema version 1 has no attention entry (it came with version 2); set schema_version: 2 "
                               "or remove the entry", source=source, field="attention")
        data = {**data, "schema_version": 2,
                "attention": {"sites": None, "evidence": {"status": "unavailable", "reason": V1_ATTENTION_REASON}}}
        version = 2
    if version == 2:
        regions = data.get("regions")
        in_situ = isinstance(data.get("provenance"), dict) and data["provenance"].get("method") == "in-situ"
        if isinstance(regions, dict):
            migrated = {}
            for name, entry in regions.items():
                ev = entry.get("evidence") if isinstance(entry, dict) else None
                if isinstance(ev, dict) and "scope" in ev:
                    raise ProfileError(f"schema version 2 has no evidence scope (it came with version 3); set "
                                       "schema_version: 3 or remove it", source=source,
                                       field=f"regions.{name}.evidence.scope")
                if in_situ and isinstance(ev, dict) and ev.get("status", "measured") == "measured":
                    entry = {**entry, "evidence": {**ev, "scope": "whole-model"}}
                migrated[name] = entry
            data = {**data, "regions": migrated}
        data = {**data, "schema_version": 3}
        version = 3
    if version == 3:
        if "moe" in data:
            raise ProfileError("schema version 3 has no moe entry (it came with version 4); set schema_version: 4 "
                               "or remove the entry", source=source, field="moe")
        data = {**data, "schema_version": 4,
                "moe": {"sites": None, "evidence": {"status": "unavailable", "reason": V3_MOE_REASON}}}
        version = 4
    if version == 4:
        if "shared_expert" in data:
            raise ProfileError("schema version 4 has no shared_expert entry (it came with version 5); set "
                               "schema_version: 5 or remove the entry", source=source, field="shared_expert")
        data = {**data, "schema_version": 5,
                "shared_expert": {"sites": None, "evidence": {"status": "unavailable", "reason": V4_SHARED_REASON}}}
    return data


def as_version(data: dict[str, Any], version: int) -> dict[str, Any]:
    """A current profile's YAML data as schema ``version`` wrote it (the inverse of :func:`migrate`, for
    tests and tools that make older files): no entry that came after ``version`` (:data:`ENTRY_SINCE`),
    no evidence scope before :data:`SCOPE_SINCE`."""
    import copy

    if version not in SUPPORTED_SCHEMA_VERSIONS:
        raise ValueError(f"schema version {version} is not one of {SUPPORTED_SCHEMA_VERSIONS}")
    data = copy.deepcopy(data)
    data["schema_version"] = version
    for entry, since in ENTRY_SINCE.items():
        if version < since:
            data.pop(entry, None)
    if version < SCOPE_SINCE:
        for entry in [*data.get("regions", {}).values(), *(data[e] for e in ENTRY_SINCE if e in data)]:
            (entry.get("evidence") or {}).pop("scope", None)
    return data


def profile_from_yaml(text: str, source: str = "<string>") -> Profile:
    """Parse a profile from YAML text: duplicate keys, deep nesting and alias expansion beyond a
    small limit are refused (:mod:`engineprofiles.safeyaml`), then the schema is checked."""
    try:
        data = safeyaml.load(text)
    except safeyaml.Refused as e:
        raise ProfileError(e.message, source=source, field=f"line {e.line}" if e.line else None) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else None
        problem = getattr(e, "problem", None) or str(e)
        problem = problem if len(problem) <= 300 else problem[:297] + "..."
        raise ProfileError(f"YAML syntax error: {problem}", source=source, field=where) from None
    return profile_from_data(data, source)


def load_profile(path: str | os.PathLike[str]) -> Profile:
    p = Path(path)
    try:
        text = safeyaml.read_text(p)
    except safeyaml.NotText as e:
        raise ProfileError(f"cannot read profile: {e}", source=str(p)) from None
    except OSError as e:
        raise ProfileError(f"cannot read profile: {e.strerror or e}", source=str(p)) from None
    return profile_from_yaml(text, str(p))


def with_points(profile: Profile, points: dict[str, Point | None], *, evidence: dict[str, Evidence] | None = None,
                method: str = "synthetic") -> Profile:
    """``profile`` with the points of the entries named in ``points`` (regions, and those beside them;
    None: unavailable) replaced, with ``evidence`` where given, every other entry kept with its evidence:
    what a fit, an ablation or a neighbour tries. The provenance says ``method`` (default: synthetic)."""
    evidence = evidence or {}
    chosen: dict[str, Any] = {}
    for name, _, entry in profile.entries():
        if name in points:
            default = {} if points[name] is not None else {"reason": "not in this combination"}
            chosen[name] = (points[name], evidence.get(name, default))
        else:
            chosen[name] = (profile.point(name) if profile.available(name) else None, entry.evidence)
    return make_profile(
        engine=profile.engine, dtype=profile.dtype, points={n: chosen[n][0] for n in REGIONS},
        evidence={n: chosen[n][1] for n in REGIONS},
        beside={n: chosen[n] for n in BESIDE},
        provenance=profile.provenance.model_copy(update={"method": method}),
    )


def make_profile(
    *,
    engine: EngineInfo | dict[str, Any],
    dtype: str,
    points: dict[str, Point | None],
    evidence: dict[str, Evidence | dict[str, Any]] | None = None,
    provenance: Provenance | dict[str, Any],
    attention: Point | None = None,
    attention_evidence: Evidence | dict[str, Any] | None = None,
    moe: Point | None = None,
    moe_evidence: Evidence | dict[str, Any] | None = None,
    beside: dict[str, tuple[Point | None, Evidence | dict[str, Any] | None]] | None = None,
) -> Profile:
    """Build a profile from lattice points (``None`` for an unavailable region) and evidence.
    ``attention`` and ``moe``: their points, or None (then ``attention_evidence`` / ``moe_evidence``
    say why, default: not probed). ``beside``: (point, evidence) of any entry beside the regions
    (``attention``, ``moe``, ``shared_expert``), over the keyword arguments; an entry given nowhere
    is recorded as not probed."""
    given = {"attention": (attention, attention_evidence), "moe": (moe, moe_evidence), **(beside or {})}
    unknown = set(given) - set(BESIDE)
    if unknown:
        raise ProfileError(f"no entry {sorted(unknown)[0]!r} beside the regions; they are: {', '.join(BESIDE)}")
    evidence = evidence or {}
    regions: dict[str, Any] = {}
    for name, spec in REGIONS.items():
        if name not in points:
            raise ProfileError(f"no point given for region {name}", field=f"regions.{name}")
        p = points[name]
        ev = evidence.get(name, {})
        ev = ev.model_dump() if isinstance(ev, Evidence) else dict(ev)
        if p is None:
            ev.setdefault("status", "unavailable")
            regions[name] = {"sites": None, "evidence": ev}
        else:
            regions[name] = {"sites": spec.site_part(p), "variants": spec.variant_part(p), "evidence": ev}
    entries: dict[str, Any] = {}
    for name, spec in BESIDE.items():
        point, ev_in = given.get(name, (None, None))
        bev = ev_in.model_dump() if isinstance(ev_in, Evidence) else dict(ev_in or {})
        if point is None:
            bev.setdefault("status", "unavailable")
            bev.setdefault("reason", "not probed")
            entries[name] = {"sites": None, "evidence": bev}
        else:
            entries[name] = {"sites": spec.site_part(point), "variants": spec.variant_part(point), "evidence": bev}
    data = {
        "schema_version": SCHEMA_VERSION,
        "engine": engine.model_dump() if isinstance(engine, EngineInfo) else engine,
        "dtype": dtype,
        "regions": regions,
        **entries,
        "provenance": provenance.model_dump() if isinstance(provenance, Provenance) else provenance,
    }
    return profile_from_data(data, "<make_profile>")
