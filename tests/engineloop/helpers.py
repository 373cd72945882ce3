"""Shared test inputs of the engine-in-the-loop tests."""

from __future__ import annotations

import os
from pathlib import Path


def evil_capture(tmp_path: Path) -> tuple[Path, Path]:
    """A torch.save file that runs code (makes the folder ``marker``) when loaded with
    weights_only=False: (the file, the marker)."""
    import torch

    marker = tmp_path / "code-ran"

    class Evil:
        def __reduce__(self):
            return (os.mkdir, (str(marker),))

    f = tmp_path / "evil.pt"
    torch.save({"engine": Evil(), "sequences": []}, f)
    return f, marker
