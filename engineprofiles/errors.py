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


class MissingDependency(EngineProfilesError, ImportError):
    """An optional dependency is not installed. The message names it and the extra that installs
    it (``pip install 'engineprofiles[EXTRA]'``)."""
