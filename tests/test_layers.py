"""Every import points down the layers: engineprofiles (profiles, region semantics, op-level
probing) <- emulator (kernels, model patching) <- engineloop (engine in the loop, CLI).

Every import statement counts, at module level or inside a function (a lazy import does not hide
an upward dependency), and so do ``importlib.import_module`` calls with a literal name.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("engineprofiles", "emulator", "engineloop")  # bottom to top


def _imports(path: Path, package: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``path``, a module of ``package``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    here = parts if path.name == "__init__.py" else parts[:-1]  # the package the module lives in
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.append((node.lineno, mod))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            name = node.args[0].value
            if name.startswith(".") and len(node.args) > 1:
                name = ".".join(here) + name
            found.append((node.lineno, name.lstrip(".")))
    return found


def _modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def upward_imports() -> list[str]:
    bad = []
    for level, package in enumerate(LAYERS):
        above = LAYERS[level + 1:]
        for path in _modules(package):
            for line, mod in _imports(path, package):
                top = mod.split(".")[0]
                if top in above:
                    bad.append(f"{path.relative_to(ROOT)}:{line} ({package}) imports {mod} ({top} is above it)")
    return bad


def test_no_lower_layer_imports_an_upper_one():
    bad = upward_imports()
    assert not bad, "imports that point up the layers:\n" + "\n".join(bad)


def test_the_layer_check_sees_relative_lazy_and_importlib_imports(tmp_path, monkeypatch):
    # The check must fail on each kind of upward import it claims to see.
    pkg = tmp_path / "engineprofiles"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "m.py").write_text(
        "import os\n"
        "def f():\n    from emulator.patching import apply_profile\n"
        "def g():\n    import engineloop.cli\n"
        "def h():\n    import importlib\n    importlib.import_module('emulator.functional')\n"
        "from ..store import x\n"
    )
    for other in ("emulator", "engineloop"):
        (tmp_path / other).mkdir()
    monkeypatch.setattr(__import__(__name__, fromlist=["ROOT"]), "ROOT", tmp_path)
    bad = upward_imports()
    assert len(bad) == 3, bad
    assert any("emulator.patching" in b for b in bad) and any("engineloop.cli" in b for b in bad)
    assert any("emulator.functional" in b for b in bad)
    # relative imports resolve inside the package (not reported)
    assert ("engineprofiles.store" in {m for _, m in _imports(pkg / "sub" / "m.py", "engineprofiles")})


@pytest.mark.parametrize("package", LAYERS)
def test_each_layer_has_modules(package):
    assert _modules(package), f"{package}/ has no modules: the layer check would pass vacuously"


MAX_FUNCTION_LINES = 80


def long_functions(root: Path, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """``file:line name (n lines)`` of every function (nested ones included) longer than ``limit``."""
    out = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > limit:
                    out.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name} ({n} lines)")
    return out


@pytest.mark.parametrize("package", ["engineprofiles", "emulator", "engineloop"])
def test_no_function_is_longer_than_80_lines(package):
    assert long_functions(ROOT / package) == []


def test_the_length_check_sees_a_long_function(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "m.py").write_text("def f():\n" + "    x = 1\n" * 80 + "\n\ndef g():\n    pass\n")
    assert long_functions(pkg) == ["pkg/m.py:1 f (81 lines)"]
