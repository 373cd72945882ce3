"""Engine rounding profiles: schema, region semantics, probing, diff and the probe-engine CLI.

Depends only on torch, pydantic and pyyaml (plus typer/rich for the CLI), because it is installed
into each engine's own environment to probe it.
"""

__version__ = "0.1.0"
# Bumped whenever the probe's method changes in a way that can change a profile.
PROBE_VERSION = "1"
