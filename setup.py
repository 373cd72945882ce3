"""The one build step pyproject.toml cannot declare: the shipped profiles go into the package.

``profiles/*.yaml`` at the root of the checkout is the canonical folder (each file the output of a
probe run). A wheel, and a non-editable ``pip install .``, carry a copy of it as package data in
``engineprofiles/profiles/``, where ``engineprofiles.store.shipped_dir()`` finds it outside a
checkout. An editable install copies nothing: it reads ``profiles/`` in the checkout. A build
with no profile to copy fails instead of making a wheel without them.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

SOURCE = Path(__file__).resolve().parent / "profiles"
TARGET = ("engineprofiles", "profiles")  # inside the built package tree


class build_py_with_profiles(build_py):
    def _profiles(self) -> list[Path]:
        files = sorted(p for p in SOURCE.glob("*.yaml") if p.is_file())
        if not files:
            raise SystemExit(f"error: no shipped profiles to package: {SOURCE} holds no *.yaml "
                             "(the wheel would carry none)")
        return files

    def _editable(self) -> bool:
        return bool(getattr(self, "editable_mode", False))

    def run(self) -> None:
        super().run()
        if self._editable():
            return
        files = self._profiles()
        target = Path(self.build_lib, *TARGET)
        if target.exists():
            shutil.rmtree(target)  # a profile removed from profiles/ leaves no stale copy behind
        self.mkpath(str(target))
        for f in files:
            self.copy_file(str(f), str(target / f.name))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = list(super().get_outputs(include_bytecode))
        if not self._editable():
            outputs += [str(Path(self.build_lib, *TARGET, f.name)) for f in self._profiles()]
        return outputs


setup(cmdclass={"build_py": build_py_with_profiles})
