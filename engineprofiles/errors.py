"""Typed errors. Each message says what was wrong, where, and what to do."""


class EngineProfilesError(Exception):
    """Base class of every error this package raises on purpose."""


class UnsupportedDtype(EngineProfilesError, ValueError):
    pass


class ProfileError(EngineProfilesError, ValueError):
    """A profile file or object is malformed. The message names the file and the field."""

    def __init__(self, message: str, *, source: str | None = None, field: str | None = None):
        self.source = source
        self.field = field
        where = ": ".join(p for p in (source, field) if p)
        super().__init__(f"{where}: {message}" if where else message)


class ArgumentError(EngineProfilesError, ValueError):
    """An argument names something that does not exist here: a model family, an engine's execution
    mode, a device."""


class ProfileNotFound(EngineProfilesError, LookupError):
    pass


class PointError(EngineProfilesError, ValueError):
    """A lattice point names an unknown site or an option a site does not have."""


class OutputNotWritable(EngineProfilesError, OSError):
    """An output path cannot be written: a folder, a special file, a shipped profile without
    --ship, no permission; or the write itself failed. Nothing was changed."""


class MetricsInputError(EngineProfilesError, ValueError):
    """The log-probs (or mask, or sequence lengths) given to a mismatch metric cannot be compared:
    shapes or devices differ, a log-prob is NaN, infinite or positive, the mask is not 0/1 or
    selects no token. The message says which argument and what to pass instead."""


class MissingDependency(EngineProfilesError, ImportError):
    """An optional dependency is not installed. The message names it and the extra that installs
    it (engineprofiles.extras.install_hint: the packages, and the extra from a checkout)."""


class UnknownEngine(ProfileNotFound):
    """A profile was asked for by engine name (``"vllm"``, ``"vllm==0.32.0"``), and no profile is of
    that engine and no probe adapter knows it; or the string is no profile file or shipped name
    either. The message lists the engines and the profiles there are."""


class NoMatchingProfile(ProfileNotFound):
    """A profile was asked for by engine name, and no profile of that engine fits what must match:
    the execution mode, the model's dtype, an explicitly asked version. The message says what
    exists and how to probe the missing one."""


# -- warnings -------------------------------------------------------------------------------------


class MismatchedProfile(UserWarning):
    """A profile is used where it was not measured: another engine version, CPU vector ISA or
    device. Its sites may still hold; its evidence (match rates, exact mode's bit-exactness) may
    not. Re-probe the engine here to be sure."""


class CapabilityMismatch(MismatchedProfile):
    """The profile was probed on another CPU vector ISA (or device) than the one this model runs on:
    kernels dispatch by ISA, so its evidence may not hold here."""


class MachineMismatch(CapabilityMismatch):
    """The profile was probed on a machine whose kernel-selecting CPU features (vendor, vector ISA,
    AMX, ...; :mod:`engineprofiles.machine`) differ from this one's, or records none: the engine's
    kernels follow the machine, so bit-exactness measured there is not known here. Exact mode
    refuses such a profile unless told ``allow_other_machine=True``, then warns with this."""


class VersionMismatch(MismatchedProfile):
    """The profile was probed on another version of the engine than the one installed here."""
