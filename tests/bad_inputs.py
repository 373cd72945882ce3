"""The bad-input sweep (issue 15): every bad input this project is handed, what it does, and that
it damages nothing.

Each :class:`Case` names a category (profile file, CLI, apply_profile, functional ops), says in one
line what the bad input is, runs it in a fresh temporary folder, and states the outcome it must
have: a typed exception (:class:`Raises`), a CLI exit with an ``error:`` line and no traceback
(:class:`CliExit`), a result bit for bit equal to the torch reference of
:mod:`engineprofiles.regions` (:data:`BITWISE`), or a documented success (:class:`Succeeds`).
Every case also checks that nothing was damaged: files in its folder (bytes, mode, kind, no
leftover temporary file), the model a refused ``apply_profile`` was given (parameter bits, no
bound forward or hook, logits), the tensors an op was given.

Used by tests/test_bad_input.py (one test per case, and the test that docs/bad-input.md is
current) and by scripts/make_bad_input_docs.py (which writes docs/bad-input.md). The cases run
with ``$ENGINEPROFILES_DIR`` pointing at an empty folder, so no outcome depends on which profiles
are shipped; CLI cases run in-process with typer's CliRunner (as tests/engineloop/test_cli.py
does), except the SIGINT cases, which need a process to interrupt. No case can start an engine:
the engine hand-over and the mismatch run are replaced by a function that fails the case.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable
from unittest import mock

# The emulator's kernels read TRITON_INTERPRET when they are defined; tests/emulator/conftest.py
# refuses to run after they were defined without it: define them the same way, so that this module
# can be imported before or after it.
from .interpreted import import_emulator_interpreted

import_emulator_interpreted()
import emulator.functional as F  # noqa: E402
from engineprofiles.schema import SCHEMA_VERSION  # noqa: E402

FUTURE = SCHEMA_VERSION + 1  # a schema version this package does not know yet

import torch  # noqa: E402
import yaml  # noqa: E402

import emulator  # noqa: E402
from emulator.errors import (  # noqa: E402
    AlreadyPatched, ExactModeUnavailable, InputError, ProfileMismatch, RegionUnavailable, UnsupportedModel,
)
from engineprofiles.errors import OutputNotWritable, ProfileError, ProfileNotFound  # noqa: E402
from engineprofiles.models import tiny_config, tiny_inputs, tiny_model  # noqa: E402
from engineprofiles.regions import (  # noqa: E402
    ADD_SPEC, ATTENTION_SPEC, PLAIN_SPEC, REGIONS, ROPE_SPEC, SWIGLU_SPEC, add_rmsnorm_ref, rmsnorm_ref, rope_cos_sin,
    rope_ref, swiglu_ref,
)
from engineprofiles.schema import make_profile  # noqa: E402
from engineprofiles.store import ENV_VAR, get_profile  # noqa: E402

from engineloop.mismatch import run_capture as _RUN_CAPTURE  # noqa: E402  (the real ones: _no_engines replaces them)
from engineloop.mismatch import run_mismatch as _RUN_MISMATCH  # noqa: E402

from .conftest import synthetic_profile  # noqa: E402
from .emulator.helpers import activations, assert_same_bits, model_state  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "bad-input.md"
CATEGORIES = ("profile file", "CLI", "apply_profile", "functional ops")
EPS = 1e-6
BF16, FP16 = torch.bfloat16, torch.float16


# -- expected outcomes ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Raises:
    """This exception class exactly (not a subclass, not a base), its message containing ``fragment``."""

    error: type[BaseException]
    fragment: str


@dataclass(frozen=True)
class CliExit:
    """The command exits with ``code`` and prints no traceback; the first line starting with
    ``prefix`` (``error:``; ``invalid`` for validate) contains ``fragment``. ``prefix`` None: no
    such line is expected (an interrupted command)."""

    code: int
    fragment: str = ""
    prefix: str | None = "error:"


@dataclass(frozen=True)
class Bitwise:
    """Returns, and the result equals the torch reference bit for bit (NaN where it has NaN)."""


BITWISE = Bitwise()


@dataclass(frozen=True)
class Succeeds:
    """Returns normally (exit 0 for a command); what happened contains ``fragment``."""

    fragment: str


Expect = Raises | CliExit | Bitwise | Succeeds


@dataclass
class Result:
    error: str | None = None  # the exception's class name; None: the call returned
    error_class: type | None = None
    message: str = ""
    exit_code: int | None = None  # commands only
    output: str = ""
    traceback: str = ""  # an unexpected exception, or a traceback a command printed
    equal: bool | None = None  # Bitwise: equal to the reference
    detail: str = ""  # what happened (what was returned, what the command did)
    checked: str = ""  # what the damage check compared
    damage: list[str] = field(default_factory=list)  # what it found changed


@dataclass(frozen=True)
class Case:
    id: str
    category: str
    bad_input: str  # one line, for the table
    run: Callable[["Ctx"], Result]
    expect: Expect
    in_docs: bool = True  # False: the outcome depends on the machine; ``note`` says how, in the docs
    note: str = ""


@dataclass(frozen=True)
class Ctx:
    base: Path  # the case's temporary folder
    work: Path  # the folder the case's files live in (damage-checked)
    shipped: Path  # $ENGINEPROFILES_DIR while the case runs: empty


# -- damage checks --------------------------------------------------------------------------------


def snapshot(folder: Path) -> dict[str, tuple]:
    """(kind, mode, sha256 of the bytes of a regular file) of everything under ``folder``."""
    snap = {}
    for p in sorted(folder.rglob("*")):
        st = os.lstat(p)
        try:
            digest = hashlib.sha256(p.read_bytes()).hexdigest() if stat.S_ISREG(st.st_mode) else None
        except PermissionError:  # a case's unreadable file, where this process is not root: its kind and mode
            digest = "unreadable"
        snap[str(p.relative_to(folder))] = (stat.S_IFMT(st.st_mode), st.st_mode & 0o7777, digest)
    return snap


def file_damage(before: dict[str, tuple], after: dict[str, tuple], may_change: tuple[str, ...] = ()) -> list[str]:
    """What changed between two snapshots; files in ``may_change`` may get new bytes (not a new
    kind or mode)."""
    out = [f"new file {n} (a leftover?)" for n in sorted(set(after) - set(before))]
    out += [f"{n} disappeared" for n in sorted(set(before) - set(after))]
    for n in sorted(set(before) & set(after)):
        (k0, m0, d0), (k1, m1, d1) = before[n], after[n]
        if k0 != k1:
            out.append(f"{n} changed kind")
        if m0 != m1:
            out.append(f"{n} changed mode {m0:o} -> {m1:o}")
        if d0 != d1 and n not in may_change:
            out.append(f"{n} changed bytes")
    return out


FILES_UNCHANGED = "files unchanged (bytes, mode, kind; no new file)"


def _same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> str | None:
    try:
        assert_same_bits(got, want, what)
    except AssertionError as e:
        return str(e)
    return None


def model_damage(model: torch.nn.Module, before: tuple, ids: torch.Tensor | None, logits: torch.Tensor | None) -> list[str]:
    mods, params = model_state(model)
    out = [] if mods == before[0] else ["a module got a bound forward, a hook or another class"]
    for n, p in params.items():
        if n not in before[1]:
            out.append(f"new state entry {n}")
        elif (bad := _same_bits(p, before[1][n], n)) is not None:
            out.append(bad)
    if ids is not None and logits is not None and (bad := _same_bits(_logits(model, ids), logits, "logits")):
        out.append(bad)
    return out


MODEL_UNCHANGED = "model unchanged (parameter bits, no bound forward or hook, logits bitwise)"


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


# -- running a case -------------------------------------------------------------------------------


def _call(fn: Callable[[], Any]) -> tuple[Any, Result]:
    """Run the call under test; an Exception is the outcome, not a failure of the harness."""
    try:
        return fn(), Result()
    except Exception as e:  # noqa: BLE001 - recorded and judged by check()
        tb = "" if type(e).__module__.split(".")[0] in ("emulator", "engineprofiles") else traceback.format_exc()
        return None, Result(error=type(e).__name__, error_class=type(e), message=str(e), traceback=tb)


_RESULTS: dict[str, Result] = {}


@contextlib.contextmanager
def _no_engines():
    """A case that would start an engine (a regression in an early check) fails instead."""

    def refuse(*a: Any, **k: Any) -> Any:
        raise AssertionError("bad-input sweep: this input reached an engine run; it must be refused before")

    with mock.patch("engineloop.runner.reexec_in", refuse), mock.patch("engineloop.runner.find_engine_python", refuse), \
            mock.patch("engineloop.mismatch.run_mismatch", refuse), mock.patch("engineloop.mismatch.run_capture", refuse):
        yield


def scrub(text: str, ctx: Ctx) -> str:
    for path, name in ((ctx.work, "<tmp>"), (ctx.shipped, "<shipped>"), (ctx.base, "<case>")):
        for p in {str(path), os.path.realpath(path)}:
            text = text.replace(p, name)
    return text


def run_case(case: Case) -> Result:
    """The case's result (run once per process; the sweep test and the docs test share it)."""
    if case.id in _RESULTS:
        return _RESULTS[case.id]
    base = Path(tempfile.mkdtemp(prefix=f"bad-input-{case.id}-"))
    ctx = Ctx(base=base, work=base / "work", shipped=base / "shipped")
    ctx.work.mkdir()
    ctx.shipped.mkdir()
    saved = {k: os.environ.get(k) for k in (ENV_VAR, "COLUMNS", "EMULATOR_BACKEND")}
    os.environ[ENV_VAR] = str(ctx.shipped)
    os.environ["COLUMNS"] = "1000"  # rich: one line per message
    os.environ.pop("EMULATOR_BACKEND", None)
    try:
        with _no_engines():
            r = case.run(ctx)
        for name in ("message", "output", "detail", "traceback"):
            setattr(r, name, scrub(getattr(r, name), ctx))
        r.damage = [scrub(d, ctx) for d in r.damage]
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        for p in (base, *base.rglob("*")):  # a read-only folder a case made
            if p.is_dir() and not p.is_symlink():
                os.chmod(p, 0o755)
        shutil.rmtree(base)
    _RESULTS[case.id] = r
    return r


def check(case: Case, r: Result) -> list[str]:
    """Where the result differs from the case's expected outcome, or damage was found."""
    e = case.expect
    out = [f"damage: {d}" for d in r.damage]
    if not r.checked:
        out.append("no damage check ran")
    if isinstance(e, Raises):
        if r.error_class is not e.error:
            out.append(f"expected {e.error.__name__}, got {r.error or 'no exception'}: {r.message}")
        elif e.fragment not in r.message:
            out.append(f"expected {e.fragment!r} in the message, got {r.message!r}")
    elif isinstance(e, CliExit):
        if r.exit_code != e.code:
            out.append(f"expected exit {e.code}, got {r.exit_code}")
        if r.traceback:
            out.append("a traceback")
        if e.prefix is not None:
            line = said(r, e.prefix)
            if line is None:
                out.append(f"no line starting with {e.prefix!r}")
            elif e.fragment not in line:
                out.append(f"expected {e.fragment!r} in {line!r}")
        elif e.fragment not in r.output:
            out.append(f"expected {e.fragment!r} in the output")
    elif isinstance(e, Bitwise):
        if r.error:
            out.append(f"expected a result, got {r.error}: {r.message}")
        elif r.equal is not True:
            out.append(f"not bitwise equal to the reference: {r.detail}")
    else:
        if r.error or r.exit_code not in (None, 0):
            out.append(f"expected success, got {r.error or f'exit {r.exit_code}'}: {r.message or r.output[-500:]}")
        elif e.fragment not in r.detail:
            out.append(f"expected {e.fragment!r} in {r.detail!r}")
    return out


def explain(case: Case, r: Result, problems: list[str]) -> str:
    lines = [f"{case.id} ({case.bad_input}):", *(f"  - {p}" for p in problems)]
    if r.traceback:
        lines.append(r.traceback[-3000:])
    if r.output:
        lines.append("output:\n" + r.output[-2000:])
    return "\n".join(lines)


def said(r: Result, prefix: str) -> str | None:
    return next((ln.strip() for ln in r.output.splitlines() if ln.strip().startswith(prefix)), None)


# -- profile files --------------------------------------------------------------------------------

BINARY = b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe binary \x80\x81"


def good_yaml() -> str:
    return synthetic_profile().to_yaml()


def _mutated(fn: Callable[[dict], None]) -> str:
    data = yaml.safe_load(good_yaml())
    fn(data)
    return yaml.safe_dump(data, sort_keys=False)


def _write(ctx: Ctx, name: str, content: str | bytes) -> Path:
    p = ctx.work / name
    p.write_bytes(content.encode() if isinstance(content, str) else content)
    return p


def unavailable_profile() -> Any:
    points = {n: s.all_points()[-1] for n, s in REGIONS.items()}
    points["swiglu"] = None
    return make_profile(
        engine=dict(name="synthetic", version="0.0", backend="cpu", device="test-cpu", torch_version="2.13.0",
                    execution_mode="eager"),
        dtype="bfloat16", points=points,
        evidence={"swiglu": {"status": "unavailable", "reason": "SiluAndMul has no kernel on this device"}},
        provenance=dict(date="2026-12-02T00:00:00Z", probe_version="1", package_version="0.1.0", method="synthetic",
                        command="pytest"),
    )


def _load(make: Callable[[Ctx], Any]) -> Callable[[Ctx], Result]:
    """engineprofiles.store.get_profile (what the CLI, apply_profile and the ops call) on what
    ``make`` puts in the folder."""

    def run(ctx: Ctx) -> Result:
        target = make(ctx)
        before = snapshot(ctx.work)
        _, r = _call(lambda: get_profile(target))
        r.damage, r.checked = file_damage(before, snapshot(ctx.work)), FILES_UNCHANGED
        return r

    return run


def _file(name: str, content: str | bytes) -> Callable[[Ctx], Path]:
    return lambda ctx: _write(ctx, name, content)


def _folder(ctx: Ctx) -> Path:
    (ctx.work / "profile.yaml").mkdir()
    return ctx.work / "profile.yaml"


def _fifo(ctx: Ctx) -> Path:
    os.mkfifo(ctx.work / "profile.yaml")
    return ctx.work / "profile.yaml"


def _save(make_target: Callable[[Ctx], Path]) -> Callable[[Ctx], Result]:
    """Profile.save (write_atomic) to what ``make_target`` makes."""

    def run(ctx: Ctx) -> Result:
        target = make_target(ctx)
        before = snapshot(ctx.work)
        _, r = _call(lambda: synthetic_profile().save(target))
        r.damage, r.checked = file_damage(before, snapshot(ctx.work)), FILES_UNCHANGED
        return r

    return run


def _save_over_existing(ctx: Ctx) -> Result:
    target = _write(ctx, "p.yaml", "old\n")
    os.chmod(target, 0o640)
    before = snapshot(ctx.work)
    _, r = _call(lambda: synthetic_profile().save(target))
    r.damage = file_damage(before, snapshot(ctx.work), may_change=("p.yaml",))
    if target.read_text() != good_yaml():
        r.damage.append("p.yaml does not hold the new profile")
    r.checked = "p.yaml replaced in place: mode kept, no temporary file left"
    r.detail = f"replaced atomically; mode {os.stat(target).st_mode & 0o777:o} kept"
    return r


def _child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def _default_sigint() -> None:
    """In the child before exec: SIGINT unblocked and at its default disposition (Python then installs
    its KeyboardInterrupt handler)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _interrupt(ctx: Ctx, argv: list[str]) -> tuple[int, str, str, bool]:
    """Run ``python -c ...`` (argv), wait until it writes ctx.base/ready (it is then blocked where
    the case wants it), send SIGINT; (exit code, stdout, stderr, whether it got there)."""
    ready = ctx.base / "ready"
    out, err = ctx.base / "stdout", ctx.base / "stderr"
    with open(out, "w") as fo, open(err, "w") as fe:
        # The child starts with SIGINT's default disposition, unblocked, whatever this process inherited or
        # a library set here (a full CI run once saw every SIGINT case's child ignore the signal; alone they
        # passed): the cases are about what the code does with a signal, not about the test's parent.
        proc = subprocess.Popen([sys.executable, "-c", *argv], cwd=ROOT, env=_child_env(), stdout=fo, stderr=fe,
                                preexec_fn=_default_sigint)
        t0 = time.monotonic()
        while not ready.exists() and proc.poll() is None and time.monotonic() - t0 < 120:
            time.sleep(0.02)
        reached = ready.exists()
        if reached:
            proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode, out.read_text(), err.read_text(), reached


_WRITE_CHILD = """
import os, sys, time
from pathlib import Path
from engineprofiles.files import write_atomic
ready, target = Path(sys.argv[1]), Path(sys.argv[2])
def block(fd):  # the temporary file is written, not yet renamed over the target
    ready.write_text("1")
    time.sleep(120)
os.fsync = block
try:
    write_atomic(target, "new\\n")
except KeyboardInterrupt:
    print("raised KeyboardInterrupt")
    sys.exit(0)
print("returned")
"""


def _sigint_write_atomic(ctx: Ctx) -> Result:
    target = _write(ctx, "p.yaml", "old\n")
    os.chmod(target, 0o640)
    before = snapshot(ctx.work)
    rc, out, err, reached = _interrupt(ctx, [_WRITE_CHILD, str(ctx.base / "ready"), str(target)])
    r = Result(output=err)
    if "raised KeyboardInterrupt" in out:
        r.error, r.error_class, r.detail = "KeyboardInterrupt", KeyboardInterrupt, "re-raised to the caller after clean-up"
    elif not reached or rc != 0:
        r.traceback = f"the writer {'never reached the write' if not reached else f'exited {rc}'}:\n{err[-2000:]}"
    r.damage = file_damage(before, snapshot(ctx.work))
    r.checked = "old file intact (bytes, mode), no temporary file left"
    return r


# -- the CLI --------------------------------------------------------------------------------------


def _cli(args: Callable[[Ctx], list[str]], setup: Callable[[Ctx], Any] | None = None,
         in_work: bool = False) -> Callable[[Ctx], Result]:
    """``probe-engine ARGS`` in-process (typer's CliRunner, as tests/engineloop/test_cli.py runs it);
    ``in_work``: in the case's folder (for relative paths)."""

    def run(ctx: Ctx) -> Result:
        from typer.testing import CliRunner

        from engineloop.cli import app

        if setup is not None:
            setup(ctx)
        argv = args(ctx)  # (it may make the files it names)
        before = _snapshots(ctx)
        cwd = os.getcwd()
        if in_work:
            os.chdir(ctx.work)
        try:
            res = CliRunner().invoke(app, argv)
        finally:
            os.chdir(cwd)
        r = _cli_result(res)
        r.damage, r.checked = _damage(ctx, before), FILES_UNCHANGED
        return r

    return run


def _snapshots(ctx: Ctx) -> tuple[dict[str, tuple], dict[str, tuple]]:
    """The case's folder and its folder of shipped profiles (a shipped profile is damage too)."""
    return snapshot(ctx.work), snapshot(ctx.shipped)


def _damage(ctx: Ctx, before: tuple[dict[str, tuple], dict[str, tuple]], may_change: tuple[str, ...] = ()) -> list[str]:
    work, shipped = _snapshots(ctx)
    return file_damage(before[0], work, may_change) + [f"<shipped>/{d}" for d in file_damage(before[1], shipped)]


def _cli_result(res: Any) -> Result:
    r = Result(exit_code=res.exit_code, output=res.output)
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        r.traceback = "".join(traceback.format_exception(*res.exc_info))
    elif "Traceback (most recent call last)" in res.output:
        r.traceback = res.output
    return r


def _apply_profile_files(ctx: Ctx) -> None:
    _write(ctx, "bin.yaml", BINARY)
    unavailable_profile().save(ctx.work / "unavailable.yaml")


def _probe_over_existing(ctx: Ctx) -> Result:
    from typer.testing import CliRunner

    from engineloop.cli import app

    target = _write(ctx, "p.yaml", "old\n")
    os.chmod(target, 0o640)
    before = snapshot(ctx.work)
    res = CliRunner().invoke(app, ["transformers", "--quick", "--region", "swiglu", "-o", str(target)])
    r = _cli_result(res)
    r.damage = file_damage(before, snapshot(ctx.work), may_change=("p.yaml",))
    new = target.read_text()
    if not new.startswith("schema_version:"):
        r.damage.append("p.yaml does not hold a profile")
    r.checked = "p.yaml replaced in place: mode kept, no temporary file left"
    r.detail = f"exit {res.exit_code}; the profile replaced p.yaml atomically, mode {os.stat(target).st_mode & 0o777:o} kept"
    return r


_CLI_CHILD = """
import os, sys, time
from pathlib import Path
ready, where = Path(sys.argv[1]), sys.argv[2]
def block(*a, **k):
    ready.write_text("1")
    time.sleep(120)
if where == "probe":  # interrupted while it measures: no profile yet
    import engineprofiles.probe.harness as harness
    harness.run_probe = block
else:  # interrupted inside the write: the temporary file written, not yet renamed
    import engineloop.runner as runner
    write_profile = runner.write_profile
    def blocked_write(*a, **k):
        os.fsync = block
        return write_profile(*a, **k)
    runner.write_profile = blocked_write
sys.argv = ["probe-engine", *sys.argv[3:]]
from engineloop.cli import _main_exit_fast
_main_exit_fast()
"""


def _sigint_cli(where: str, existing: bool) -> Callable[[Ctx], Result]:
    """`python -m engineloop.cli transformers --quick --region swiglu -o p.yaml`, SIGINT while it
    probes or while it writes the file."""

    def run(ctx: Ctx) -> Result:
        target = ctx.work / "p.yaml"
        if existing:
            _write(ctx, "p.yaml", "old\n")
            os.chmod(target, 0o640)
        before = snapshot(ctx.work)
        rc, out, err, reached = _interrupt(ctx, [_CLI_CHILD, str(ctx.base / "ready"), where, "transformers", "--quick",
                                                 "--region", "swiglu", "-o", str(target)])
        r = Result(exit_code=rc, output=out + err)
        if "Traceback (most recent call last)" in err:
            r.traceback = err
        r.detail = f"SIGINT while it {'probed' if where == 'probe' else 'wrote the file'}" if reached else \
            f"it never got to the {where}"
        r.damage = file_damage(before, snapshot(ctx.work))
        if not reached:
            r.damage.append(r.detail)
        r.checked = "old file intact (bytes, mode), no temporary file left" if existing else \
            "no file written, no temporary file left"
        return r

    return run


def _read_only_folder(ctx: Ctx) -> list[str]:
    """A folder this process cannot create files in: chmod 555, or, where that does not stop it
    (root), /proc (tests/engineloop/test_cli_probe.py uses it the same way)."""
    ro = ctx.work / "read-only"
    ro.mkdir()
    os.chmod(ro, 0o555)
    try:
        fd, tmp = tempfile.mkstemp(dir=ro)
    except OSError:
        return ["transformers", "--quick", "--region", "swiglu", "-o", str(ro / "p.yaml")]
    os.close(fd)
    os.unlink(tmp)
    return ["transformers", "--quick", "--region", "swiglu", "-o", "/proc/engineprofiles-bad-input.yaml"]


SAVED_RESULT = ROOT / "docs" / "data" / "mismatch-vllm-0.32.0-qwen2.json"  # a result of mismatch --json


def _result(ctx: Ctx, name: str = "s.json") -> Path:
    return _write(ctx, name, SAVED_RESULT.read_bytes())


def _result_with(mutate: Callable[[dict], None]) -> Callable[[Ctx], list[str]]:
    """``plot s.json -o <case>/m.png`` of the saved result changed by ``mutate`` (written with json.dumps:
    float('inf') as Infinity, NaN as NaN, as Python's json reads them)."""

    def args(ctx: Ctx) -> list[str]:
        import json

        data = json.loads(SAVED_RESULT.read_text())
        mutate(data)
        return ["plot", str(_write(ctx, "s.json", json.dumps(data))), "-o", str(ctx.base / "m.png")]

    return args


def _row(field: str, value: Any, key: str = "sampled") -> Callable[[dict], None]:
    return lambda d: d[key][0].update({field: value})


def _many_rows(d: dict) -> None:
    d["sampled"] = [dict(d["sampled"][0], trainer=f"trainer row {i}") for i in range(1000)]


def _plot_drawn(mutate: Callable[[dict], None]) -> Callable[[Ctx], Result]:
    """``plot`` of the saved result changed by ``mutate``, which it must draw: the PNG's size (bounded) and
    the note it printed, if any."""

    def run(ctx: Ctx) -> Result:
        import io

        from PIL import Image

        argv = _result_with(mutate)(ctx)
        r = _cli(lambda ctx: argv)(ctx)
        png = ctx.base / "m.png"
        if r.exit_code == 0 and png.exists():
            w, h = Image.open(io.BytesIO(png.read_bytes())).size
            note = next((ln.strip() for ln in r.output.splitlines() if ln.strip().startswith("note:")), "no note")
            r.detail = f"a {w}x{h} px PNG; {note}"
            if w * h > 2000 * 4000:
                r.damage.append(f"the canvas is {w}x{h} px")
        return r

    return run


def _shipped_profile(ctx: Ctx) -> Path:
    p = ctx.shipped / "vllm-0.32.0-cpu-eager-bfloat16.yaml"
    synthetic_profile().save(p)
    return p


def _cli_stdout(args: Callable[[Ctx], list[str]], judge: Callable[[bytes, str], str],
                report: bool = False) -> Callable[[Ctx], Result]:
    """``probe-engine ARGS`` run in the case's folder (a file named ``-`` would appear there), its stdout
    apart from its stderr; ``judge(stdout, stderr)`` says what stdout holds. ``report``: the mismatch
    run replaced by a saved result (docs/data), as if the engine had run."""

    def run(ctx: Ctx) -> Result:
        from typer.testing import CliRunner

        from engineloop import tables
        from engineloop.cli import app

        argv = args(ctx)
        before = _snapshots(ctx)
        rep = tables.load_mismatch(str(SAVED_RESULT))
        cwd = os.getcwd()
        os.chdir(ctx.work)
        try:
            with mock.patch("engineloop.mismatch.run_mismatch", lambda *a, **k: rep) if report else \
                    contextlib.nullcontext():
                res = CliRunner().invoke(app, argv)
        finally:
            os.chdir(cwd)
        r = _cli_result(res)
        if res.exit_code == 0:
            r.detail = judge(res.stdout_bytes, res.stderr)
        r.damage, r.checked = _damage(ctx, before), "files unchanged (bytes, mode, kind; no new file: none named -)"
        return r

    return run


def _png_on_stdout(out: bytes, err: str) -> str:
    return (f"stdout is a PNG of {len(out)} bytes, nothing else" if out.startswith(b"\x89PNG\r\n\x1a\n")
            and out.endswith(b"IEND\xaeB`\x82") else f"stdout is not a PNG alone: {out[:40]!r}")


def _json_on_stdout(out: bytes, err: str) -> str:
    import json

    try:
        data = json.loads(out)
    except ValueError as e:
        return f"stdout is not JSON alone ({e}): {out[:80]!r}"
    where = "the table on stderr" if "exact match" in err or "trainer" in err else "no table on stderr"
    return f"stdout is the JSON alone ({len(data['sampled'])} sampled rows); {where}"


HOSTILE = ("\x1b[2J", "\x1b]0;", "\x07", "\x9b", "\u202e", "\x1b[5m")  # clear screen, set title, bell, CSI, RTL, blink


def _hostile(d: dict) -> None:
    d["provenance"]["command"] = "probe-engine \x1b[2J\x1b]0;PWNED\x07 done"
    d["engine"]["device"] = "cpu \x9b31m\u202eevil"
    d["regions"]["swiglu"]["evidence"].setdefault("notes", []).append("note \x1b[5m blink")


def _hostile_profile(ctx: Ctx) -> Path:
    """A valid profile whose provenance.command, engine.device and a note hold terminal escapes."""
    p = ctx.work / "evil.yaml"
    p.write_text(_mutated(_hostile))
    return p


def _hostile_report() -> Any:
    """A saved mismatch result whose engine fields and warnings (from the engine's capture) hold terminal escapes."""
    from engineloop import tables

    rep = tables.load_mismatch(str(SAVED_RESULT))
    rep.engine = {**rep.engine, "version": "0.32.0 \x1b[2J", "device": "cpu \x9b31m\u202eevil"}
    rep.warnings = [*rep.warnings, "\x1b]0;PWNED\x07 and \x1b[5m blink"]
    return rep


def _cli_terminal(args: Callable[[Ctx], list[str]], terminal: bool = False,
                  report: Callable[[], Any] | None = None) -> Callable[[Ctx], Result]:
    """``probe-engine ARGS`` (as :func:`_cli`); what it printed, stdout and stderr, must hold none of the
    HOSTILE sequences, and show them escaped. ``terminal``: stdout taken for a terminal (rich styles it).
    ``report``: the mismatch run replaced by the result it makes."""

    def run(ctx: Ctx) -> Result:
        from rich.console import Console

        from engineprofiles.text import install

        argv = args(ctx)
        before = _snapshots(ctx)
        console = install(Console(force_terminal=True, width=200)) if terminal else None
        rep = report() if report is not None else None
        with mock.patch("engineloop.cli.out", console) if terminal else contextlib.nullcontext(), \
                mock.patch("engineloop.mismatch.run_mismatch", lambda *a, **k: rep) if report else contextlib.nullcontext():
            r = _cli(lambda ctx: argv)(ctx)
        text = r.output
        passed = [repr(h) for h in HOSTILE if h in text]
        shown = [h for h in ("\\x1b[2J", "\\x1b]0;PWNED\\x07", "\\x9b31m\\u202eevil", "\\x1b[5m") if h in text]
        r.detail = (f"passed through to the terminal: {', '.join(passed)}" if passed else
                    f"no control character reached the terminal; shown escaped: {', '.join(shown) or 'none'}")
        r.damage, r.checked = _damage(ctx, before), FILES_UNCHANGED
        return r

    return run


NOBODY = 65534  # the unprivileged user the permission cases run as, where the tests run as root


@contextlib.contextmanager
def _unprivileged():
    """Within it, this process acts as a user whom mode bits stop: itself, or where it is root, nobody
    (effective uid and gid 65534, no supplementary groups: what ``setpriv --reuid=65534 --regid=65534
    --clear-groups`` gives, in-process so that the interpreter's own files, which nobody may not read
    here, are not needed); yields who that is."""
    if os.geteuid() != 0:
        yield f"uid {os.geteuid()}"
        return
    groups = os.getgroups()
    os.setgroups([])
    os.setegid(NOBODY)
    os.seteuid(NOBODY)
    try:
        yield f"nobody (uid {NOBODY}; the tests run as root)"
    finally:
        os.seteuid(0)
        os.setegid(0)
        os.setgroups(groups)


def _cli_unprivileged(args: Callable[[Ctx], list[str]], warm: tuple[str, ...]) -> Callable[[Ctx], Result]:
    """``probe-engine ARGS`` (in-process, as :func:`_cli`) run by a user whom permissions stop
    (:func:`_unprivileged`). ``args`` makes the files and locks them; the case's folders are opened to
    that user (mode 755), and ``<case>/out`` (mode 777) takes what it may write. ``warm``: the modules
    the command imports, imported first (nobody may not read this interpreter's library here)."""

    def run(ctx: Ctx) -> Result:
        import importlib

        from typer.testing import CliRunner

        from engineloop.cli import app

        for m in warm:
            importlib.import_module(m)
        for d in (ctx.base, ctx.work):
            os.chmod(d, 0o755)
        out = ctx.base / "out"
        out.mkdir()
        os.chmod(out, 0o777)
        argv = args(ctx)
        before = snapshot(ctx.work)
        try:
            with _unprivileged() as who:
                res = CliRunner().invoke(app, argv)
        except OSError as e:  # say so: the case cannot run unprivileged here
            r = Result(traceback=f"could not act as an unprivileged user ({e}); the permission cases need a user "
                                 "whom mode bits stop")
        else:
            r = _cli_result(res)
            r.detail = f"run as {who}"
        r.damage, r.checked = file_damage(before, snapshot(ctx.work)), FILES_UNCHANGED
        return r

    return run


def _locked_folder_profile(ctx: Ctx) -> list[str]:
    locked = ctx.work / "locked"
    locked.mkdir()
    synthetic_profile().save(locked / "p.yaml")
    os.chmod(locked, 0o000)
    return ["show", str(locked / "p.yaml")]


def _unreadable_result(ctx: Ctx) -> list[str]:
    os.chmod(_write(ctx, "m.json", "{}\n"), 0o000)
    return ["plot", str(ctx.work / "m.json"), "-o", str(ctx.base / "out" / "m.png")]


LONG_NAME = "v" * 300


def _under_a_file(ctx: Ctx, name: str = "p.yaml") -> str:
    f = ctx.work / "file"
    if not f.exists():
        f.write_text("x\n")
    return str(f / name)


def _save_capture(setup: Callable[[Ctx], tuple[Path, tuple[str, ...]]], interrupt: bool = False) -> Callable[[Ctx], Result]:
    """What ``mismatch``/``localize --save-capture PATH`` do after the engine ran
    (engineloop.mismatch.model_and_capture, the engine's capture stubbed): ``setup`` makes the folder and
    returns PATH and the files whose bytes may change. ``interrupt``: a KeyboardInterrupt (Ctrl-C) in the
    middle of torch.save."""

    def run(ctx: Ctx) -> Result:
        from engineloop import mismatch as M

        target, may_change = setup(ctx)
        before = snapshot(ctx.work)
        fake = {"engine": {"name": "vllm", "version": "0.0", "mode": "eager"}, "sequences": []}
        save = torch.save

        def interrupted(obj: Any, f: Any, *a: Any, **k: Any) -> None:
            f.write(b"half a capture")
            raise KeyboardInterrupt

        with mock.patch.object(M, "run_capture", lambda *a, **k: dict(fake)), \
                mock.patch("torch.save", interrupted if interrupt else save):
            try:
                _, r = _call(lambda: M.model_and_capture(
                    "vllm", "qwen2", size=None, capture_file=None, save_capture=str(target), prompts=1, max_tokens=1,
                    seed=0, env=None, workdir=None, note=lambda m: None, mode="eager", prompt_len=4))
            except KeyboardInterrupt:
                r = Result(error="KeyboardInterrupt", error_class=KeyboardInterrupt,
                           detail="re-raised to the caller after clean-up")
        r.damage = file_damage(before, snapshot(ctx.work), may_change=may_change)
        if not interrupt and r.error is None:
            got = torch.load(target, weights_only=False)
            if got.get("family") != "qwen2":
                r.damage.append(f"{target.name} does not hold the capture")
            what = {p: os.lstat(ctx.work / p) for p in sorted(before) if os.path.lexists(ctx.work / p)}
            r.detail = "; ".join(
                f"{p} {'a symlink still' if stat.S_ISLNK(st.st_mode) else f'mode {st.st_mode & 0o777:o}'}"
                f"{', the capture' if p in may_change else ', untouched'}" for p, st in what.items())
        r.checked = (f"bytes changed only in {', '.join(may_change)}; modes and kinds kept; no temporary file left"
                     if may_change else "old file intact (bytes, mode), no temporary file left")
        return r

    return run


def _capture_log_interrupted(ctx: Ctx) -> Result:
    """Ctrl-C while ``mismatch``/``localize`` wait for the engine's capture (engineloop.mismatch.run_capture,
    the real one, with the engine process faked: its wait() raises KeyboardInterrupt): the engine's
    capture log (engineprofiles-vllm-capture-*.log in the temporary folder, here the case's folder) must
    not be left behind, and the engine's process group is killed."""
    from engineloop import mismatch as M

    killed: list[Any] = []

    class Engine:  # what subprocess.Popen would start
        pid = -1

        def __init__(self, *a: Any, **k: Any) -> None:
            pass

        def wait(self, timeout: float | None = None) -> int:
            assert list(ctx.work.glob("engineprofiles-vllm-capture-*.log")), "the log is made before the engine starts"
            raise KeyboardInterrupt

    before = snapshot(ctx.work)
    with mock.patch.object(M.subprocess, "Popen", Engine), mock.patch.object(M, "_kill_group", killed.append), \
            mock.patch("engineloop.runner.engine_importable", lambda *a: False), \
            mock.patch("engineloop.runner.find_engine_python", lambda *a: Path(sys.executable)), \
            mock.patch("tempfile.tempdir", str(ctx.work)):
        try:
            _, r = _call(lambda: _RUN_CAPTURE("vllm", ctx.base / "model", ctx.base / "capture.pt", prompts=1,
                                              max_tokens=1, seed=0, env=None, note=lambda m: None))
        except KeyboardInterrupt:
            r = Result(error="KeyboardInterrupt", error_class=KeyboardInterrupt,
                       detail="re-raised to the caller; the engine's process group killed" if killed else
                       "re-raised, but the engine's process group was not killed")
    r.damage = file_damage(before, snapshot(ctx.work))
    if not killed:
        r.damage.append("the engine's process group was not killed")
    r.checked = "no capture log left in the temporary folder; the engine's processes killed"
    return r


def _capture_over_existing(ctx: Ctx) -> tuple[Path, tuple[str, ...]]:
    target = _write(ctx, "out.pt", "old capture\n")
    os.chmod(target, 0o600)
    os.chmod(_write(ctx, "out.pt.tmp", "someone else's file\n"), 0o644)
    return target, ("out.pt",)


def _capture_symlink(ctx: Ctx) -> tuple[Path, tuple[str, ...]]:
    _write(ctx, "real.pt", "old capture\n")
    os.chmod(ctx.work / "real.pt", 0o640)
    os.symlink("real.pt", ctx.work / "out.pt")
    return ctx.work / "out.pt", ("real.pt",)


def _capture_interrupted(ctx: Ctx) -> tuple[Path, tuple[str, ...]]:
    target = _write(ctx, "out.pt", "old capture\n")
    os.chmod(target, 0o600)
    return target, ()


# -- apply_profile --------------------------------------------------------------------------------


def _qwen2(dtype: str = "bfloat16", **overrides: Any) -> Callable[[], torch.nn.Module]:
    return lambda: tiny_model("qwen2", seed=1, dtype=dtype, **overrides)


def _gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return GPT2LMHeadModel(cfg).to(BF16).eval()


def _with_instance_forward() -> torch.nn.Module:
    model = tiny_model("qwen2", seed=1)
    mlp = model.model.layers[1].mlp
    mlp.forward = mlp.forward  # what accelerate's hooks leave: a bound forward on the instance
    return model


def _apply(make_model: Callable[[], Any], profile: Callable[[Ctx], Any], **kw: Any) -> Callable[[Ctx], Result]:
    """apply_profile(model, profile); the model must come back untouched when it is refused."""

    def run(ctx: Ctx) -> Result:
        model = make_model()
        prof = profile(ctx)
        is_model = isinstance(model, torch.nn.Module)
        if is_model:
            ids = tiny_inputs(model, 8, seed=2)
            before, logits = model_state(model), _logits(model, ids)
        files = snapshot(ctx.work)
        handle, r = _call(lambda: emulator.apply_profile(model, prof, **kw))
        if handle is not None:
            r.detail = repr(handle)
            handle.remove()
        r.damage = file_damage(files, snapshot(ctx.work))
        if is_model:
            r.damage += model_damage(model, before, ids, logits)
            r.checked = MODEL_UNCHANGED
        else:
            r.checked = FILES_UNCHANGED
        return r

    return run


def _profile_obj(ctx: Ctx) -> Any:
    return synthetic_profile()


def _apply_recorded(tamper: Callable[[dict], None]) -> Callable[[Ctx], Result]:
    """apply_recorded_profile(model) of a model whose config.emulator_profile (a record apply_profile(...,
    record=True) wrote) was changed by ``tamper``; a refusal leaves the model untouched."""

    def run(ctx: Ctx) -> Result:
        model = tiny_model("qwen2", seed=1)
        handle = emulator.apply_profile(model, synthetic_profile(), record=True)
        rec = dict(model.config.emulator_profile)
        handle.remove()
        tamper(rec)
        model.config.emulator_profile = rec
        ids = tiny_inputs(model, 8, seed=2)
        before, logits = model_state(model), _logits(model, ids)
        got, r = _call(lambda: emulator.apply_recorded_profile(model))
        if got is not None:
            r.detail = repr(got)
            got.remove()
        r.damage, r.checked = model_damage(model, before, ids, logits), MODEL_UNCHANGED
        return r

    return run


def _mismatch_trainer_rows(args: Callable[[Ctx], list[str]], cap: dict) -> Callable[[Ctx], Result]:
    """``probe-engine ARGS`` (as :func:`_cli`) with the real run_mismatch, the tiny model and ``cap`` given
    as the capture (engineloop.mismatch.model_and_capture stubbed), and every trainer row failing the case:
    what the command refuses must be refused before the trainer runs."""

    def run(ctx: Ctx) -> Result:
        from engineloop import mismatch as M

        def no_rows(*a: Any, **k: Any) -> Any:
            raise AssertionError("bad-input sweep: a trainer row ran before the refusal")

        with mock.patch.object(M, "run_mismatch", _RUN_MISMATCH), mock.patch.object(M, "sequence_logprobs", no_rows), \
                mock.patch.object(M, "model_and_capture", lambda *a, **k: (tiny_model("qwen2", seed=0), dict(cap))):
            return _cli(args)(ctx)

    return run


VLLM_CAPTURE = {"engine": {"name": "vllm", "version": "0.32.0", "mode": "default",
                           "attention": {"split_kv": True, "torch_threads": 4, "isa": "vec"}},
                "sequences": [{"prompt": [1, 2, 3], "completion": [4], "sample_logprobs": [-1.0],
                               "prompt_logprobs": [None, -1.0, -1.0]}]}


def _settings(**kw: Any) -> Callable[[dict], None]:
    return lambda d: d["engine"].setdefault("settings", {}).update(kw)


def _double_apply(ctx: Ctx) -> Result:
    model = tiny_model("qwen2", seed=1)
    ids = tiny_inputs(model, 8, seed=2)
    plain = model_state(model), _logits(model, ids)
    first = emulator.apply_profile(model, synthetic_profile())
    before, logits = model_state(model), _logits(model, ids)
    _, r = _call(lambda: emulator.apply_profile(model, synthetic_profile()))
    r.damage = model_damage(model, before, ids, logits)  # the first patch is still there, as it was
    if not first.active:
        r.damage.append("the first patch is no longer active")
    first.remove()
    r.damage += model_damage(model, plain[0], ids, plain[1])  # and its remove() still restores the model
    r.checked = "first patch kept (bound forwards, logits bitwise); its remove() restores the model bitwise"
    return r


def _remove_twice(ctx: Ctx) -> Result:
    model = tiny_model("qwen2", seed=1)
    ids = tiny_inputs(model, 8, seed=2)
    before, logits = model_state(model), _logits(model, ids)
    handle = emulator.apply_profile(model, synthetic_profile())
    _logits(model, ids)
    handle.remove()
    _, r = _call(handle.remove)
    if not r.error:
        r.detail = "the second remove() does nothing"
    r.damage = model_damage(model, before, ids, logits)
    r.checked = "model restored (parameter bits, no bound forward or hook, logits bitwise)"
    return r


def _meta_model(ctx: Ctx) -> Result:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config("qwen2"), dtype=BF16)
    mods = model_state(model)[0]
    handle, r = _call(lambda: emulator.apply_profile(model, synthetic_profile()))
    if handle is not None:
        handle.remove()
    r.damage = [] if model_state(model)[0] == mods else ["a module got a bound forward, a hook or another class"]
    if not all(p.is_meta for p in model.parameters()):
        r.damage.append("a parameter left the meta device")
    r.checked = "model unchanged (still on meta; no bound forward or hook)"
    return r


def _exact_padding_row(ctx: Ctx) -> Result:
    """Exact mode on a batch whose row 1 is padding only (attention_mask[1] = 0): the other rows must
    keep the bits of the same batch without that row."""
    import warnings

    from engineprofiles.errors import MismatchedProfile

    model = tiny_model("qwen2", seed=1)
    ids = torch.randint(0, 256, (3, 10), generator=_gen(3))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # a left-padded row beside it
    mask[1] = 0
    plain = model_state(model), _logits(model, ids)
    with warnings.catch_warnings():  # a profile of another machine: its bits here are no claim, the rows' are
        warnings.simplefilter("ignore", MismatchedProfile)
        handle = emulator.apply_profile(model, str(ROOT / "profiles" / "vllm-0.32.0-cpu-eager-bfloat16.yaml"),
                                        exact=True, allow_other_machine=True)
    try:
        with torch.no_grad():
            out, r = _call(lambda: model(ids, attention_mask=mask).logits)
            if r.error is None:
                alone = model(ids[[0, 2]], attention_mask=mask[[0, 2]]).logits
                bad = _same_bits(out[[0, 2]], alone, "rows 0 and 2")
                r.detail = bad or (f"returns {_describe(out)}; rows 0 and 2 bit for bit those of the batch without "
                                   "row 1")
    finally:
        handle.remove()
    r.damage = model_damage(model, plain[0], ids, plain[1])
    r.checked = "model restored by remove() (parameter bits, no bound forward or hook, logits bitwise)"
    return r


# -- functional ops -------------------------------------------------------------------------------

P_SWIGLU = SWIGLU_SPEC.point(silu="rounded", silu_formula="fused")
P_PLAIN = PLAIN_SPEC.point(normalized="rounded", output="rounded", rstd="rsqrt")
P_ADD = ADD_SPEC.point(variance_input="rounded", normalize_input="rounded", normalized="rounded",
                       residual_out="rounded", rstd="rsqrt")
P_ADD_FP32 = ADD_SPEC.point(variance_input="fp32", normalize_input="fp32", normalized="fp32", residual_out="fp32",
                            rstd="rsqrt")
P_ROPE = ROPE_SPEC.point(cos_sin="rounded", products="rounded", fma="none")
P_ATTENTION = ATTENTION_SPEC.all_points()[0]


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _describe(out: Any) -> str:
    outs = out if isinstance(out, tuple) else (out,)
    return ", ".join(f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}" for t in outs)


def _op(make: Callable[[], tuple[Callable[..., Any], Callable[..., Any] | None, list[Any]]]) -> Callable[[Ctx], Result]:
    """make() -> (op, reference or None, inputs): op(*inputs) on the ``reference`` backend (torch
    math, the CPU default), compared bit for bit with reference(*inputs) when there is one; the
    inputs must come back unchanged."""

    def run(ctx: Ctx) -> Result:
        op, ref, inputs = make()
        before = [t.clone() if isinstance(t, torch.Tensor) else t for t in inputs]
        with F.use_backend("reference"):
            out, r = _call(lambda: op(*inputs))
        if r.error is None:
            r.detail = f"returns {_describe(out)}" if ref is None else _describe(out)
            if ref is not None:
                want = ref(*inputs)
                got, want = (out, want) if isinstance(out, tuple) else ((out,), (want,))
                bad = [b for i, (g, w) in enumerate(zip(got, want)) if (b := _same_bits(g, w, f"output {i}"))]
                r.equal = not bad and len(got) == len(want)
                r.detail = "; ".join(bad) if bad else r.detail
        for i, (t, t0) in enumerate(zip(inputs, before)):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            if t.is_floating_point():
                if b := _same_bits(t, t0, f"input {i}"):
                    r.damage.append(b)
            elif not torch.equal(t, t0):
                r.damage.append(f"input {i} changed")
        r.checked = "inputs unchanged (bits)"
        return r

    return run


def _x(shape: tuple[int, ...], dtype: torch.dtype = BF16, seed: int = 0, specials: bool = False, scale: float = 3.0):
    return activations(shape, dtype, _gen(seed), scale=scale, specials=specials)


def _w(n: int, dtype: torch.dtype = BF16) -> torch.Tensor:
    return (1 + 0.1 * torch.randn(n, generator=_gen(9))).to(dtype)


def _swiglu(gate: torch.Tensor, up: torch.Tensor, point: Any = P_SWIGLU):
    return lambda: (lambda g, u: F.swiglu(g, u, point), lambda g, u: swiglu_ref(g, u, point), [gate, up])


def _rmsnorm(x: torch.Tensor, w: torch.Tensor, point: Any = P_PLAIN):
    return lambda: (lambda x, w: F.rmsnorm(x, w, EPS, point), lambda x, w: rmsnorm_ref(x, w, EPS, point), [x, w])


def _add_rmsnorm(x: torch.Tensor, res: torch.Tensor, w: torch.Tensor, point: Any = P_ADD):
    return lambda: (lambda x, r, w: F.add_rmsnorm(x, r, w, EPS, point),
                    lambda x, r, w: add_rmsnorm_ref(x, r, w, EPS, point), [x, res, w])


def _rope(x: torch.Tensor, rot: int, style: str = "neox", point: Any = P_ROPE):
    cos, sin = rope_cos_sin(torch.arange(x.shape[-3]) * 37, rot)  # [seq, rot/2]
    return lambda: (lambda x, c, s: F.rope(x, c, s, point, style=style),
                    lambda x, c, s: rope_ref(x, *_heads_axis(x, c, s), point, style=style), [x, cos, sin])


def _heads_axis(x: torch.Tensor, *cs: torch.Tensor) -> list[torch.Tensor]:
    """[seq, rot/2] as [1.., seq, 1, rot/2] for x [..., seq, heads, dim] (rope_ref broadcasts from the left)."""
    return [t.reshape(*(1,) * (x.dim() - 3), t.shape[0], 1, t.shape[-1]) for t in cs]


def _no_ref(op: Callable[..., Any], *inputs: Any):
    """An op call with no reference to compare with (it must raise, or its outcome is described)."""
    return lambda: (op, None, list(inputs))


def _overflow_fp16() -> torch.Tensor:
    t = _x((4, 33), FP16, seed=3)
    t[0, :4] = 300.0  # 300 * 300 = 9e4 > 65504: the product overflows FP16
    return t


def _sum_overflows(dtype: torch.dtype, big: float) -> tuple[torch.Tensor, torch.Tensor]:
    x, res = _x((4, 33), dtype, seed=4), _x((4, 33), dtype, seed=5)
    x[0, :3] = big  # x + residual overflows the activation dtype (FP16), or FP32 (BF16's range)
    res[0, :3] = big
    return x, res


def _fused_halves() -> tuple[torch.Tensor, torch.Tensor]:
    gu = _x((3, 5, 2 * 151), seed=6, specials=True)
    return gu[..., :151], gu[..., 151:]


def _every_other_token() -> torch.Tensor:
    return _x((2, 6, 151), seed=7, specials=True)[:, ::2]


def _transposed_heads() -> torch.Tensor:
    return _x((2, 4, 5, 64), seed=8, specials=True).transpose(1, 2)  # [batch, seq, heads, dim] from HF's layout


def _qkv(b: int = 1, hq: int = 2, hk: int = 1, tq: int = 3, tk: int = 3, d: int = 8) -> list[torch.Tensor]:
    return [_x((b, hq, tq, d), seed=10), _x((b, hk, tk, d), seed=11), _x((b, hk, tk, d), seed=12)]


def _as_sampled(*args: Any, batch: int | None = None, **kw: Any) -> Callable[..., Any]:
    """Enter emulator.as_sampled(*args, **kw); with ``batch``, run exact attention on that many rows in it
    (vLLM's CPU kernel point, split-KV on two threads)."""
    from engineprofiles.probe.attention import KERNEL_STARTS
    from engineprofiles.regions.attention import KVSplit

    def call(*inputs: Any) -> Any:
        with emulator.as_sampled(*args, **kw):
            if batch is None:
                return None
            point = dict(KERNEL_STARTS)["vLLM's CPU attention kernel"]
            return F.attention(*inputs, point, kv_split=KVSplit(threads=2))

    return call


# -- the cases ------------------------------------------------------------------------------------

PF, CLI, AP, OPS = CATEGORIES


def _cases() -> list[Case]:
    c: list[Case] = []

    def add(id: str, category: str, bad_input: str, run: Callable[[Ctx], Result], expect: Expect, **kw: Any) -> None:
        c.append(Case(id, category, bad_input, run, expect, **kw))

    # profile files, read with get_profile (what the CLI, apply_profile and the ops call)
    add("file-malformed-yaml", PF, "malformed YAML (an unclosed flow list)",
        _load(_file("p.yaml", "schema_version: 2\nengine: [unclosed\n")), Raises(ProfileError, "YAML syntax error"))
    add("file-empty", PF, "an empty file", _load(_file("p.yaml", "")), Raises(ProfileError, "empty"))
    add("file-only-comments", PF, "a file of blank lines and comments",
        _load(_file("p.yaml", "# nothing here\n\n   \n")), Raises(ProfileError, "empty"))
    add("file-list", PF, "a list-shaped document (a YAML sequence)",
        _load(_file("p.yaml", "- schema_version: 2\n- dtype: bfloat16\n")), Raises(ProfileError, "got list"))
    add("file-scalar", PF, "a bare string as the whole document",
        _load(_file("p.yaml", "vllm-0.32.0-cpu-eager-bfloat16\n")), Raises(ProfileError, "got str"))
    add("file-unknown-key", PF, "an unknown top-level key",
        _load(lambda ctx: _write(ctx, "p.yaml", good_yaml() + "colour: blue\n")),
        Raises(ProfileError, "unknown key 'colour'"))
    add("file-unknown-site", PF, "an unknown site in a region",
        _load(lambda ctx: _write(ctx, "p.yaml", _mutated(lambda d: d["regions"]["swiglu"]["sites"].update(gate="fp32")))),
        Raises(ProfileError, "unknown site 'gate'"))
    add("file-future-version", PF, f"a future schema_version ({FUTURE})",
        _load(lambda ctx: _write(ctx, "p.yaml", _mutated(lambda d: d.update(schema_version=FUTURE)))),
        Raises(ProfileError, "not supported"))
    add("file-version-string", PF, "schema_version as a string ('2')",
        _load(lambda ctx: _write(ctx, "p.yaml", _mutated(lambda d: d.update(schema_version="2")))),
        Raises(ProfileError, "not supported"))
    add("file-version-float", PF, "schema_version as a float (2.0; 5.0 was refused, 2.0 read as 2)",
        _load(lambda ctx: _write(ctx, "p.yaml", good_yaml().replace("schema_version: 5", "schema_version: 2.0"))),
        Raises(ProfileError, "not supported"))
    add("file-cpu-capability-list", PF, "engine.settings.cpu_capability a list ([AVX512, '../../x y']; it becomes part "
        "of the profile's name)", _load(_file("p.yaml", _mutated(_settings(cpu_capability=["AVX512", "../../x y"])))),
        Raises(ProfileError, "settings.cpu_capability must be a plain name"))
    add("file-cpu-capability-path", PF, "engine.settings.cpu_capability '../x y' (a path, a space)",
        _load(_file("p.yaml", _mutated(_settings(cpu_capability="../x y")))),
        Raises(ProfileError, "settings.cpu_capability must be a plain name"))
    add("file-seed-huge", PF, "provenance.seed 10**30",
        _load(_file("p.yaml", _mutated(lambda d: d["provenance"].update(seed=10**30)))),
        Raises(ProfileError, "provenance.seed: Input should be less than or equal to 9223372036854775807"))
    add("file-seed-float", PF, "provenance.seed 1.0e+30 (a float)",
        _load(_file("p.yaml", _mutated(lambda d: d["provenance"].update(seed=1e30)))),
        Raises(ProfileError, "provenance.seed: Input should be a valid integer"))
    add("file-duplicate-key", PF, "a duplicate key (dtype twice)",
        _load(lambda ctx: _write(ctx, "p.yaml", good_yaml() + "dtype: float16\n")), Raises(ProfileError, "duplicate key"))
    add("file-directory", PF, "a folder where the profile file should be", _load(_folder),
        Raises(ProfileNotFound, "is a folder"))
    add("file-fifo", PF, "a FIFO where the profile file should be (reading it must not block)", _load(_fifo),
        Raises(ProfileNotFound, "not a regular file"))
    add("file-binary", PF, "a binary file (PNG bytes)", _load(_file("p.yaml", BINARY)), Raises(ProfileError, "UTF-8"))
    add("file-too-large", PF, "a file over 1 MiB", _load(_file("p.yaml", "# " + "x" * (1 << 20) + "\n")),
        Raises(ProfileError, "larger than"))
    add("file-absent", PF, "a path where nothing exists", _load(lambda ctx: ctx.work / "absent.yaml"),
        Raises(ProfileNotFound, "no profile file or shipped profile"))
    add("file-bytes-path", PF, "a bytes path instead of a str or Path", _load(lambda ctx: b"p.yaml"),
        Raises(ProfileError, "got bytes"))
    add("file-name-too-long", PF, "a 300-character profile name", _load(lambda ctx: LONG_NAME),
        Raises(ProfileNotFound, "the name is too long for a file"))
    add("file-path-too-long", PF, "a 5000-character path ('x/' 2500 times)", _load(lambda ctx: "x/" * 2500),
        Raises(ProfileNotFound, "the name is too long for a file"))
    add("file-engine-spec-too-long", PF, "an engine spec with a 1000-digit version ('vllm==0.32.0' + '9' * 1000)",
        _load(lambda ctx: "vllm==0.32.0" + "9" * 1000), Raises(ProfileNotFound, "the name is too long for a file"))
    # profile files, written with Profile.save (write_atomic)
    add("file-save-under-a-file", PF, "saving to a path below a regular file (unwritable, even for root)",
        _save(lambda ctx: Path(_under_a_file(ctx))), Raises(OutputNotWritable, "a folder on its path is a file"))
    add("file-save-to-a-folder", PF, "saving to a path that is a folder", _save(_folder),
        Raises(OutputNotWritable, "a folder, not a regular file"))
    add("file-save-to-a-fifo", PF, "saving to a FIFO (it must stay a FIFO)", _save(_fifo),
        Raises(OutputNotWritable, "a FIFO, not a regular file"))
    add("file-save-over-existing", PF, "saving over an existing file with mode 640", _save_over_existing,
        Succeeds("replaced atomically; mode 640 kept"))
    add("file-save-sigint", PF, "SIGINT while write_atomic writes over an existing file (a real signal, in a child "
        "process blocked in the write)", _sigint_write_atomic, Raises(KeyboardInterrupt, ""))

    # the CLI
    add("cli-show-malformed", CLI, "`show` of a malformed YAML file",
        _cli(lambda ctx: ["show", str(_write(ctx, "p.yaml", "engine: [unclosed\n"))]), CliExit(2, "YAML syntax error"))
    add("cli-show-empty", CLI, "`show` of an empty file", _cli(lambda ctx: ["show", str(_write(ctx, "p.yaml", ""))]),
        CliExit(2, "empty"))
    add("cli-show-list", CLI, "`show` of a list-shaped YAML file",
        _cli(lambda ctx: ["show", str(_write(ctx, "p.yaml", "- 1\n- 2\n"))]), CliExit(2, "got list"))
    add("cli-show-unknown-key", CLI, "`show` of a profile with an unknown key",
        _cli(lambda ctx: ["show", str(_write(ctx, "p.yaml", good_yaml() + "colour: blue\n"))]),
        CliExit(2, "unknown key 'colour'"))
    add("cli-show-future-version", CLI, f"`show` of a profile with schema_version {FUTURE}",
        _cli(lambda ctx: ["show", str(_write(ctx, "p.yaml", _mutated(lambda d: d.update(schema_version=FUTURE))))]),
        CliExit(2, "not supported"))
    add("cli-show-directory", CLI, "`show` of a folder", _cli(lambda ctx: ["show", str(_folder(ctx))]),
        CliExit(2, "is a folder"))
    add("cli-show-binary", CLI, "`show` of a binary file", _cli(lambda ctx: ["show", str(_write(ctx, "p.yaml", BINARY))]),
        CliExit(2, "UTF-8"))
    add("cli-show-unknown-name", CLI, "`show` of a name that is no file and no shipped profile",
        _cli(lambda ctx: ["show", "vllm-9.9.9-cpu-eager-bfloat16"]), CliExit(2, "no profiles are shipped in <shipped>"))
    add("cli-show-name-too-long", CLI, "`show` of a 300-character name", _cli(lambda ctx: ["show", LONG_NAME]),
        CliExit(2, "the name is too long for a file"))
    add("cli-validate-name-too-long", CLI, "`validate` of a 300-character name (validate exits 1 for an invalid profile)",
        _cli(lambda ctx: ["validate", LONG_NAME]), CliExit(1, "the name is too long for a file", prefix="invalid"))
    add("cli-diff-name-too-long", CLI, "`diff` of a 300-character name (exit 1 would say the profiles differ)",
        _cli(lambda ctx: ["diff", LONG_NAME, LONG_NAME]), CliExit(2, "the name is too long for a file"))
    add("cli-check-name-too-long", CLI, "`check` of a 300-character name (exit 1 would say the engine drifted)",
        _cli(lambda ctx: ["check", LONG_NAME]), CliExit(2, "the name is too long for a file"))
    add("cli-show-locked-folder", CLI, "`show` of a profile in a mode-000 folder, run by a user whom it stops",
        _cli_unprivileged(_locked_folder_profile, ("yaml", "engineprofiles.render", "engineprofiles.select")),
        CliExit(2, "Permission denied"))
    add("cli-plot-unreadable", CLI, "`plot` of a mode-000 JSON file, run by a user whom it stops",
        _cli_unprivileged(_unreadable_result, ("engineloop.tables", "engineloop.mismatch",
                                                "engineprofiles.metrics")), CliExit(2, "cannot read it (Permission denied)"))
    add("cli-validate-directory", CLI, "`validate` of a folder (validate exits 1 for an invalid profile)",
        _cli(lambda ctx: ["validate", str(_folder(ctx))]), CliExit(1, "is a folder", prefix="invalid"))
    add("cli-diff-bad-format", CLI, "`diff -f xml`",
        _cli(lambda ctx: ["diff", str(ctx.work / "a.yaml"), str(ctx.work / "a.yaml"), "-f", "xml"],
             lambda ctx: synthetic_profile().save(ctx.work / "a.yaml")),
        CliExit(2, "--format must be table, markdown or json"))
    add("cli-output-under-a-file", CLI, "`-o` below a regular file (unwritable, even for root)",
        _cli(lambda ctx: ["transformers", "--quick", "-o", _under_a_file(ctx)]),
        CliExit(2, "a folder on its path is a file"))
    add("cli-output-read-only-folder", CLI, "`-o` into a read-only folder (chmod 555; as root, /proc)",
        _cli(_read_only_folder), CliExit(2, "not writable"), in_docs=False,
        note="The test expects exit 2 and an `error:` line saying `not writable` either way: a user whom chmod stops "
        "gets `... <tmp>/read-only is not writable (Permission denied)`; root, whom chmod does not stop, is given "
        "`-o /proc/engineprofiles-bad-input.yaml` instead (`/proc is not writable (No such file or directory)`).")
    add("cli-output-fifo", CLI, "`-o` a FIFO (it must stay a FIFO)",
        _cli(lambda ctx: ["transformers", "--quick", "-o", str(_fifo(ctx))]), CliExit(2, "not a regular file"))
    add("cli-output-existing", CLI, "`-o` an existing file with mode 640", _probe_over_existing,
        Succeeds("replaced p.yaml atomically, mode 640 kept"))
    add("cli-sigint-probe", CLI, "SIGINT while `python -m engineloop.cli transformers --quick -o p.yaml` probes",
        _sigint_cli("probe", existing=False), CliExit(130, prefix=None))
    add("cli-sigint-write", CLI, "SIGINT while the same command writes over an existing p.yaml (mode 640)",
        _sigint_cli("write", existing=True), CliExit(130, prefix=None))
    add("cli-family-gpt2", CLI, "`transformers --family gpt2`",
        _cli(lambda ctx: ["transformers", "--family", "gpt2", "-o", str(ctx.work)]), CliExit(2, "unknown model family"))
    add("cli-dtype-float32", CLI, "`transformers --dtype float32`",
        _cli(lambda ctx: ["transformers", "--dtype", "float32", "-o", str(ctx.work)]),
        CliExit(2, "activation dtype 'float32' is not supported"))
    add("cli-region-unknown", CLI, "`transformers --region mlp`",
        _cli(lambda ctx: ["transformers", "--region", "mlp", "-o", str(ctx.work)]), CliExit(2, "unknown region"))
    add("cli-device-unknown", CLI, "`transformers --device tpu`",
        _cli(lambda ctx: ["transformers", "--device", "tpu", "-o", str(ctx.work)]), CliExit(2, "unknown device"))
    add("cli-apply-binary", CLI, "`transformers --apply` a binary file",
        _cli(lambda ctx: ["transformers", "--apply", str(ctx.work / "bin.yaml"), "-o", str(ctx.work / "out.yaml")],
             _apply_profile_files), CliExit(2, "UTF-8"))
    add("cli-apply-directory", CLI, "`transformers --apply` a folder",
        _cli(lambda ctx: ["transformers", "--apply", str(_folder(ctx)), "-o", str(ctx.work / "out.yaml")]),
        CliExit(2, "is a folder"))
    add("cli-apply-unavailable-region", CLI, "`transformers --apply` a profile that records a region as unavailable",
        _cli(lambda ctx: ["transformers", "--apply", str(ctx.work / "unavailable.yaml"), "-o", str(ctx.work / "out.yaml")],
             _apply_profile_files), CliExit(2, "records region swiglu as unavailable"))
    add("cli-in-situ-quick", CLI, "`vllm --in-situ --quick` (refused before any engine starts)",
        _cli(lambda ctx: ["vllm", "--in-situ", "--quick", "-o", "-"]), CliExit(2, "op-level options"))
    add("cli-mismatch-family", CLI, "`mismatch --family gpt2` (refused before any engine starts)",
        _cli(lambda ctx: ["mismatch", "--family", "gpt2"]), CliExit(2, "unknown model family"))
    add("cli-mismatch-json-under-a-file", CLI, "`mismatch --json` below a regular file",
        _cli(lambda ctx: ["mismatch", "--json", _under_a_file(ctx, "m.json")]), CliExit(2, "cannot write"))
    # outputs never clobber an input, each other, or a shipped profile; '-' is stdout
    # plot checks values, not only types, and bounds its canvas
    add("cli-plot-k3-infinity", CLI, "`plot` of a result whose k3_kl is Infinity",
        _cli(_result_with(_row("k3_kl", float("inf")))), CliExit(2, "sampled[0].k3_kl: a finite number is expected"))
    add("cli-plot-exact-match-nan", CLI, "`plot` of a result whose exact_match is NaN (prefill row)",
        _cli(_result_with(_row("exact_match", float("nan"), "prefill"))),
        CliExit(2, "prefill[0].exact_match: a finite number is expected"))
    add("cli-plot-exact-match-5", CLI, "`plot` of a result whose exact_match is 5.0",
        _cli(_result_with(_row("exact_match", 5.0))), CliExit(2, "a fraction from 0 to 1 is expected, got 5.0"))
    add("cli-plot-negative-tokens", CLI, "`plot` of a result with -3 tokens in a row",
        _cli(_result_with(_row("tokens", -3))), CliExit(2, "sampled[0].tokens: a positive whole number"))
    add("cli-plot-negative-dlogp", CLI, "`plot` of a result with abs_dlogp_max -1",
        _cli(_result_with(_row("abs_dlogp_max", -1.0))), CliExit(2, "a number >= 0 is expected"))
    add("cli-plot-warnings-number", CLI, "`plot` of a result whose warnings is 5",
        _cli(_result_with(lambda d: d.update(warnings=5))), CliExit(2, "field 'warnings': a list of strings"))
    add("cli-plot-deep-json", CLI, "`plot` of a JSON nested 100,000 deep",
        _cli(lambda ctx: ["plot", str(_write(ctx, "s.json", '{"sampled": ' + "[" * 100_000 + "]" * 100_000 + "}")),
                          "-o", str(ctx.base / "m.png")]), CliExit(2, "nested too deep"))
    add("cli-plot-folder", CLI, "`plot` of a folder",
        _cli(lambda ctx: ["plot", str(_folder(ctx)), "-o", str(ctx.base / "m.png")]), CliExit(2, "a folder"))
    add("cli-plot-mathtext-label", CLI, "`plot` of a result with the trainer label '$\\frac{$' (mathtext)",
        _plot_drawn(_row("trainer", "$\\frac{$")), Succeeds("PNG; no note"))
    add("cli-plot-1000-rows", CLI, "`plot` of a result with 1,000 valid sampled rows", _plot_drawn(_many_rows),
        Succeeds("a 1560x3192 px PNG; note: the PNG draws the first 30 rows of each panel"))
    add("cli-plot-over-its-input", CLI, "`plot s.json -o s.json` (the PNG over the result it draws)",
        _cli(lambda ctx: ["plot", str(_result(ctx)), "-o", str(ctx.work / "s.json")]),
        CliExit(2, "which this command reads"))
    add("cli-plot-over-its-input-spelled-otherwise", CLI, "`plot s.json -o ./link.json`, a symlink to s.json, "
        "given as a relative path with ./",
        _cli(lambda ctx: (_result(ctx), os.symlink("s.json", ctx.work / "link.json"),
                          ["plot", str(ctx.work / "s.json"), "-o", "./link.json"])[-1], in_work=True),
        CliExit(2, "which this command reads"))
    add("cli-plot-over-a-shipped-profile", CLI, "`plot m.json -o <shipped>/vllm-0.32.0-cpu-eager-bfloat16.yaml` (plot "
        "has no --ship)",
        _cli(lambda ctx: ["plot", str(_result(ctx)), "-o", str(_shipped_profile(ctx))]),
        CliExit(2, "in the folder of shipped profiles"))
    add("cli-mismatch-json-over-capture", CLI, "`mismatch --capture c.pt --json c.pt` (refused before the run)",
        _cli(lambda ctx: ["mismatch", "--capture", str(_write(ctx, "c.pt", "a capture\n")), "--json",
                          str(ctx.work / "c.pt")]), CliExit(2, "which this command reads"))
    add("cli-mismatch-json-and-plot-one-file", CLI, "`mismatch --json x --plot ./x` (refused before the run)",
        _cli(lambda ctx: ["mismatch", "--json", str(ctx.work / "x"), "--plot", f"{ctx.work}/./x"]),
        CliExit(2, "are the same file"))
    add("cli-mismatch-json-and-save-capture-one-file", CLI, "`mismatch --save-capture out.pt --json out.pt`",
        _cli(lambda ctx: ["mismatch", "--save-capture", str(ctx.work / "out.pt"), "--json", str(ctx.work / "out.pt")]),
        CliExit(2, "are the same file"))
    add("cli-mismatch-both-to-stdout", CLI, "`mismatch --json - --plot -`",
        _cli(lambda ctx: ["mismatch", "--json", "-", "--plot", "-"]), CliExit(2, "both write to stdout"))
    add("cli-probe-over-its-apply", CLI, "`transformers --apply p.yaml -o p.yaml` (the probe over the profile it applies)",
        _cli(lambda ctx: ["transformers", "--quick", "--apply", str(ctx.work / "p.yaml"), "-o", str(ctx.work / "p.yaml")],
             lambda ctx: synthetic_profile().save(ctx.work / "p.yaml")), CliExit(2, "which this command reads"))
    add("cli-plot-to-stdout", CLI, "`plot s.json -o -` (redirected)",
        _cli_stdout(lambda ctx: ["plot", str(_result(ctx)), "-o", "-"], _png_on_stdout),
        Succeeds("stdout is a PNG of"))
    add("cli-mismatch-json-to-stdout", CLI, "`mismatch --json -` (the run replaced by a saved result)",
        _cli_stdout(lambda ctx: ["mismatch", "--json", "-"], _json_on_stdout, report=True),
        Succeeds("stdout is the JSON alone"))
    # strings from a file never drive the terminal
    add("cli-show-terminal-escapes", CLI, "`show` of a profile whose provenance.command, engine.device and a note "
        "hold terminal escapes (clear screen, window title, CSI, right-to-left override, blink), piped",
        _cli_terminal(lambda ctx: ["show", str(_hostile_profile(ctx))]),
        Succeeds("no control character reached the terminal; shown escaped: \\x1b[2J, \\x1b]0;PWNED\\x07, "
                 "\\x9b31m\\u202eevil, \\x1b[5m"))
    add("cli-show-terminal-escapes-on-a-terminal", CLI, "the same `show` on a terminal (rich styles the output)",
        _cli_terminal(lambda ctx: ["show", str(_hostile_profile(ctx))], terminal=True),
        Succeeds("no control character reached the terminal; shown escaped: \\x1b[2J, \\x1b]0;PWNED\\x07, "
                 "\\x9b31m\\u202eevil, \\x1b[5m"))
    add("cli-diff-terminal-escapes", CLI, "`diff` of that profile and a plain one (the differing strings are shown)",
        _cli_terminal(lambda ctx: ["diff", str(_write(ctx, "good.yaml", good_yaml())), str(_hostile_profile(ctx))]),
        Succeeds("no control character reached the terminal; shown escaped: \\x9b31m\\u202eevil"))
    add("cli-mismatch-terminal-escapes", CLI, "`mismatch` whose capture's engine version and warnings hold terminal "
        "escapes (the run replaced by such a result), on a terminal",
        _cli_terminal(lambda ctx: ["mismatch"], terminal=True, report=_hostile_report),
        Succeeds("no control character reached the terminal; shown escaped: \\x1b[2J, \\x1b[5m"))
    # every option checked before any engine or trainer work
    add("cli-mismatch-bad-profile-spec", CLI, "`mismatch vllm --mode eager --profile 'vllm=='` (an engine spec without "
        "its version; refused before the engine runs)",
        _cli(lambda ctx: ["mismatch", "vllm", "--mode", "eager", "--profile", "vllm=="]),
        CliExit(2, "write ENGINE[==VERSION][:MODE]"))
    add("cli-localize-bad-profile-spec", CLI, "`localize --profile 'vllm=='` (refused before the engine runs)",
        _cli(lambda ctx: ["localize", "--profile", "vllm=="]), CliExit(2, "no profile file or shipped profile named"))
    add("cli-mismatch-invalid-profile-file", CLI, "`mismatch --profile p.yaml` of a profile with an unknown key "
        "(refused before the engine runs)",
        _cli(lambda ctx: ["mismatch", "--profile", str(_write(ctx, "p.yaml", _mutated(lambda d: d.update(extra=1))))]),
        CliExit(2, "unknown key 'extra'"))
    add("cli-mismatch-exact-other-engine-profile", CLI, "`mismatch vllm --exact --profile` an SGLang profile (refused "
        "before the engine runs)",
        _cli(lambda ctx: ["mismatch", "vllm", "--exact", "--profile", str(_write(ctx, "sglang.yaml", _mutated(
            lambda d: d["engine"].update(name="sglang"))))]), CliExit(2, "but the engine that samples is vllm"))
    add("cli-mismatch-seed-too-large", CLI, "`mismatch --seed 99999999999999999999999` (refused before the engine runs)",
        _cli(lambda ctx: ["mismatch", "--seed", "99999999999999999999999"]),
        CliExit(2, "--seed must be an integer from 0 to 2147483647"))
    add("cli-localize-seed-negative", CLI, "`localize --seed -1`",
        _cli(lambda ctx: ["localize", "--seed", "-1"]), CliExit(2, "--seed must be an integer from 0 to 2147483647"))
    add("cli-probe-seed-too-large", CLI, "`transformers --quick --seed 99999999999999999999999`",
        _cli(lambda ctx: ["transformers", "--quick", "--seed", "99999999999999999999999", "-o", str(ctx.work / "p.yaml")]),
        CliExit(2, "--seed must be an integer from 0 to 2147483647"))
    add("cli-show-empty-name", CLI, "`show ''` ('' was called a folder)", _cli(lambda ctx: ["show", ""]),
        CliExit(2, "the profile name is empty"))
    add("cli-mismatch-exact-capture-other-engine", CLI, "`mismatch --capture <a vLLM capture> --exact --profile` an "
        "SGLang profile (refused before any trainer row, naming the engines; it complained of a kv_split after them)",
        _mismatch_trainer_rows(lambda ctx: ["mismatch", "--capture", str(_write(ctx, "c.pt", "a capture\n")), "--exact",
                                            "--profile", str(_write(ctx, "sglang.yaml", _mutated(
                                                lambda d: d["engine"].update(name="sglang"))))], VLLM_CAPTURE),
        CliExit(2, "is a profile of sglang, but the capture <tmp>/c.pt comes from vllm 0.32.0"))
    add("cli-save-capture-over-existing", CLI, "`--save-capture out.pt` over a mode-600 out.pt, beside an unrelated "
        "out.pt.tmp", _save_capture(_capture_over_existing),
        Succeeds("out.pt mode 600, the capture; out.pt.tmp mode 644, untouched"))
    add("cli-save-capture-symlink", CLI, "`--save-capture out.pt` where out.pt is a symlink to real.pt",
        _save_capture(_capture_symlink), Succeeds("out.pt a symlink still, untouched; real.pt mode 640, the capture"))
    add("cli-save-capture-interrupted", CLI, "Ctrl-C (KeyboardInterrupt) inside torch.save of `--save-capture out.pt` "
        "over an existing out.pt", _save_capture(_capture_interrupted, interrupt=True), Raises(KeyboardInterrupt, ""))

    add("cli-capture-log-interrupted", CLI, "Ctrl-C (KeyboardInterrupt) while `mismatch`/`localize` wait for the "
        "engine's capture (the engine process faked)", _capture_log_interrupted, Raises(KeyboardInterrupt, ""))

    # apply_profile
    prof = _profile_obj
    add("apply-gpt2", AP, "a tiny GPT-2 (built from a config): a family apply_profile does not patch",
        _apply(_gpt2, prof), Raises(UnsupportedModel, "no decoder model of a supported family"))
    add("apply-fp64-model", AP, "an FP64 model with a BF16 profile", _apply(_qwen2("float64"), prof),
        Raises(ProfileMismatch, "torch.float64, but profile"))
    add("apply-fp32-model", AP, "an FP32 model with a BF16 profile (mixed precision's master weights)",
        _apply(_qwen2("float32"), prof), Succeeds("emulated: rope, swiglu, add_rmsnorm, rmsnorm; native: none"))
    add("apply-fp16-profile", AP, "a BF16 model with an FP16 profile",
        _apply(_qwen2(), lambda ctx: synthetic_profile().model_copy(update={"dtype": "float16"})),
        Raises(ProfileMismatch, "measured in float16"))
    add("apply-twice", AP, "apply_profile on a model already patched", _double_apply,
        Raises(AlreadyPatched, "applying twice is an error"))
    add("apply-remove-twice", AP, "handle.remove() twice", _remove_twice, Succeeds("the second remove() does nothing"))
    add("apply-meta-model", AP, "a model on the meta device (no data)", _meta_model,
        Raises(UnsupportedModel, "meta device"))
    add("apply-not-a-model", AP, "a state_dict instead of a model", _apply(lambda: _qwen2()().state_dict(), prof),
        Raises(UnsupportedModel, "torch.nn.Module"))
    add("apply-instance-forward", AP, "a model whose MLP has a per-instance forward (as accelerate hooks leave)",
        _apply(_with_instance_forward, prof), Raises(UnsupportedModel, "per-instance forward"))
    add("apply-rope-scaling", AP, "a model with dynamic (NTK) RoPE scaling",
        _apply(_qwen2(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}), prof),
        Raises(UnsupportedModel, "rope_type 'dynamic' needs the engine whose convention it follows"))
    add("apply-rope-longrope", AP, "a model with LongRoPE scaling (two sets of frequencies)",
        _apply(_qwen2(rope_parameters={"rope_type": "longrope", "factor": 4.0, "rope_theta": 1e6,
                                       "original_max_position_embeddings": 4096, "short_factor": [1.0] * 32,
                                       "long_factor": [2.0] * 32}), prof),
        Raises(UnsupportedModel, "rope_type 'longrope' is not supported"))
    add("apply-profile-directory", AP, "a folder as the profile", _apply(_qwen2(), _folder),
        Raises(ProfileNotFound, "is a folder"))
    add("apply-profile-binary", AP, "a binary file as the profile", _apply(_qwen2(), _file("p.yaml", BINARY)),
        Raises(ProfileError, "UTF-8"))
    add("apply-profile-name-too-long", AP, "a 300-character profile name", _apply(_qwen2(), lambda ctx: LONG_NAME),
        Raises(ProfileNotFound, "the name is too long for a file"))
    add("apply-profile-list", AP, "a list-shaped YAML file as the profile",
        _apply(_qwen2(), _file("p.yaml", "- 1\n")), Raises(ProfileError, "got list"))
    add("apply-profile-point", AP, "a lattice Point instead of a profile", _apply(_qwen2(), lambda ctx: P_SWIGLU),
        Raises(ProfileMismatch, "emulator.functional takes it"))
    add("apply-unavailable-region", AP, "a profile that records a region as unavailable",
        _apply(_qwen2(), lambda ctx: unavailable_profile()), Raises(RegionUnavailable, "records region swiglu"))
    add("apply-exact-without-attention", AP, "exact=True with a profile without measured attention",
        _apply(_qwen2(), prof, exact=True), Raises(ExactModeUnavailable, "exact mode needs the engine's attention"))
    add("apply-kv-split-without-exact", AP, "kv_split (the engine's split-KV threads) without exact=True",
        _apply(_qwen2(), prof, kv_split=2), Raises(InputError, "kv_split is part of exact mode's attention"))
    add("apply-kv-split-zero-threads", AP, "kv_split=0 threads",
        _apply(_qwen2(), prof, exact=True, kv_split=0), Raises(InputError, "a positive integer"))
    add("apply-recorded-name-contradicts", AP, "apply_recorded_profile of a config record whose name is not its "
        "profile's (vllm-0.32.0-cpu-eager-bfloat16 over a synthetic profile's YAML)",
        _apply_recorded(lambda rec: rec.update(name="vllm-0.32.0-cpu-eager-bfloat16")),
        Raises(ProfileError, "the record names its profile 'vllm-0.32.0-cpu-eager-bfloat16'"))
    add("apply-profile-empty-name", AP, "an empty string as the profile ('' was called a folder)",
        _apply(_qwen2(), lambda ctx: ""), Raises(ProfileNotFound, "the profile name is empty"))
    add("apply-recorded-too-large", AP, "apply_recorded_profile of a config record whose profile YAML is 5 MB (a "
        "valid profile and a long comment: too large, not an alias bomb)",
        _apply_recorded(lambda rec: rec.update(profile=rec["profile"] + "# " + "x" * (5 << 20) + "\n")),
        Raises(ProfileError, "larger than the limit of 1048576 bytes"))
    add("apply-recorded-kv-split-not-exact", AP, "apply_recorded_profile of a config record with exact: false and a "
        "kv_split (edited by hand)",
        _apply_recorded(lambda rec: rec.update(exact=False, kv_split={"threads": 4})),
        Raises(ProfileError, "Qwen2Config.emulator_profile: kv_split: kv_split is recorded with exact: false"))
    add("apply-exact-padding-row", AP, "exact=True on a batch with a row that is padding only (attention_mask[1] = 0)",
        _exact_padding_row, Succeeds("rows 0 and 2 bit for bit those of the batch without row 1"))

    # functional ops: defined results, bit for bit the reference's
    add("op-swiglu-empty", OPS, "swiglu on zero tokens (0, 151)", _op(_swiglu(_x((0, 151)), _x((0, 151)))), BITWISE)
    add("op-swiglu-odd-width-specials", OPS, "swiglu, width 151, with NaN, ±Inf, ±0, subnormals and ties",
        _op(_swiglu(_x((4, 151), seed=1, specials=True), _x((4, 151), seed=2, specials=True))), BITWISE)
    add("op-swiglu-non-contiguous", OPS, "swiglu on the two halves of a fused gate_up output (strided views)",
        _op(_swiglu(*_fused_halves())), BITWISE)
    add("op-swiglu-fp16-overflow", OPS, "swiglu in FP16 where gate * up overflows FP16 (300 * 300)",
        _op(_swiglu(_overflow_fp16(), _overflow_fp16())), BITWISE)
    add("op-rmsnorm-empty", OPS, "rmsnorm on zero tokens (0, 151)", _op(_rmsnorm(_x((0, 151)), _w(151))), BITWISE)
    add("op-rmsnorm-hidden-zero", OPS, "rmsnorm of zero-width rows (3, 0)", _op(_rmsnorm(_x((3, 0)), _w(0))), BITWISE)
    add("op-rmsnorm-odd-width-specials", OPS, "rmsnorm, width 151, with NaN, ±Inf, subnormals and huge values",
        _op(_rmsnorm(_x((4, 151), seed=3, specials=True), _w(151))), BITWISE)
    add("op-rmsnorm-non-contiguous", OPS, "rmsnorm of every other token (a strided view)",
        _op(_rmsnorm(_every_other_token(), _w(151))), BITWISE)
    add("op-add-rmsnorm-fp16-overflow", OPS, "add_rmsnorm in FP16 where x + residual overflows FP16",
        _op(_add_rmsnorm(*_sum_overflows(FP16, 60000.0), _w(33, FP16))), BITWISE)
    add("op-add-rmsnorm-fp32-overflow", OPS, "add_rmsnorm in BF16 where x + residual overflows FP32 (3e38 + 3e38), "
        "FP32 residual stream", _op(_add_rmsnorm(*_sum_overflows(BF16, 3e38), _w(33), P_ADD_FP32)), BITWISE)
    add("op-add-rmsnorm-specials", OPS, "add_rmsnorm with NaN, ±Inf and subnormals, FP32 residual in",
        _op(_add_rmsnorm(_x((4, 151), seed=4, specials=True), _x((4, 151), seed=5, specials=True).float(), _w(151))),
        BITWISE)
    add("op-rope-empty", OPS, "rope on zero tokens", _op(_rope(_x((0, 2, 64)), 64)), BITWISE)
    add("op-rope-odd-head-dim", OPS, "rope, head_dim 7, rotary dim 6 (the odd lane passes through), with specials",
        _op(_rope(_x((5, 3, 7), seed=6, specials=True), 6)), BITWISE)
    add("op-rope-non-contiguous", OPS, "rope of a transposed (non-contiguous) view, interleaved style",
        _op(_rope(_transposed_heads(), 64, "interleaved")), BITWISE)
    # functional ops: refused with a typed error
    x8, w8 = _x((2, 8)), _w(8)
    add("op-swiglu-int", OPS, "swiglu of int32 tensors",
        _op(_no_ref(lambda g, u: F.swiglu(g, u, P_SWIGLU), torch.ones(2, 8, dtype=torch.int32), x8)),
        Raises(InputError, "must be float32, bfloat16 or float16"))
    add("op-swiglu-fp32", OPS, "swiglu of FP32 gate and up (no activation dtype to round to)",
        _op(_no_ref(lambda g, u: F.swiglu(g, u, P_SWIGLU), x8.float(), x8.float())),
        Raises(InputError, "bfloat16 or both float16"))
    add("op-swiglu-mixed-dtypes", OPS, "swiglu of a BF16 gate and an FP16 up",
        _op(_no_ref(lambda g, u: F.swiglu(g, u, P_SWIGLU), x8, x8.half())),
        Raises(InputError, "bfloat16 or both float16"))
    add("op-swiglu-fp16-with-bf16-profile", OPS, "swiglu of FP16 tensors with a BF16 profile",
        _op(_no_ref(lambda g, u: F.swiglu(g, u, synthetic_profile()), x8.half(), x8.half())),
        Raises(ProfileMismatch, "measured in bfloat16"))
    add("op-swiglu-shapes", OPS, "swiglu of gate (2, 8) and up (1, 8) (broadcastable, not equal)",
        _op(_no_ref(lambda g, u: F.swiglu(g, u, P_SWIGLU), x8, x8[:1])), Raises(InputError, "the same shape"))
    add("op-swiglu-list", OPS, "swiglu of a Python list", _op(_no_ref(lambda u: F.swiglu([[1.0]], u, P_SWIGLU), x8)),
        Raises(InputError, "must be a tensor, got list"))
    add("op-swiglu-devices", OPS, "swiglu of a CPU gate and a meta up",
        _op(_no_ref(lambda g, u: F.swiglu(g, u, P_SWIGLU), x8, x8.to("meta"))), Raises(InputError, "on one device"))
    add("op-swiglu-profile-none", OPS, "swiglu with profile None",
        _op(_no_ref(lambda g, u: F.swiglu(g, u, None), x8, x8)), Raises(ProfileMismatch, "got NoneType"))
    add("op-rmsnorm-wrong-point", OPS, "rmsnorm with a point of region add_rmsnorm",
        _op(_no_ref(lambda x, w: F.rmsnorm(x, w, EPS, P_ADD), x8, w8)), Raises(ProfileMismatch, "region 'rmsnorm'"))
    add("op-rmsnorm-weight-shape", OPS, "rmsnorm with a weight of 7 for rows of 8",
        _op(_no_ref(lambda x, w: F.rmsnorm(x, w, EPS, P_PLAIN), x8, _w(7))), Raises(InputError, "weight must have shape"))
    add("op-rmsnorm-weight-fp64", OPS, "rmsnorm with an FP64 weight",
        _op(_no_ref(lambda x, w: F.rmsnorm(x, w, EPS, P_PLAIN), x8, w8.double())),
        Raises(InputError, "weight must be float32, bfloat16 or float16"))
    add("op-rmsnorm-eps-negative", OPS, "rmsnorm with eps = -1",
        _op(_no_ref(lambda x, w: F.rmsnorm(x, w, -1.0, P_PLAIN), x8, w8)), Raises(InputError, "eps must be"))
    add("op-rmsnorm-eps-nan", OPS, "rmsnorm with eps = NaN",
        _op(_no_ref(lambda x, w: F.rmsnorm(x, w, float("nan"), P_PLAIN), x8, w8)), Raises(InputError, "eps must be"))
    add("op-rmsnorm-scalar", OPS, "rmsnorm of a 0-dim tensor",
        _op(_no_ref(lambda x, w: F.rmsnorm(x, w, EPS, P_PLAIN), x8[0, 0], _w(1))), Raises(InputError, "got a scalar"))
    add("op-add-rmsnorm-residual-shape", OPS, "add_rmsnorm with a residual of another shape",
        _op(_no_ref(lambda x, r, w: F.add_rmsnorm(x, r, w, EPS, P_ADD), x8, x8[:1], w8)),
        Raises(InputError, "residual must have x's shape"))
    cos, sin = rope_cos_sin(torch.arange(2), 16)
    add("op-rope-too-few-lanes", OPS, "rope with cos/sin for 16 lanes and head_dim 8",
        _op(_no_ref(lambda x, c, s: F.rope(x, c, s, P_ROPE), _x((2, 1, 8)), cos, sin)), Raises(InputError, "cos/sin cover"))
    add("op-rope-lead-dims", OPS, "rope with cos/sin for 2 positions and x of 3",
        _op(_no_ref(lambda x, c, s: F.rope(x, c, s, P_ROPE), _x((3, 1, 16)), cos, sin)),
        Raises(InputError, "do not broadcast"))
    add("op-rope-style", OPS, "rope with style 'gptj'",
        _op(_no_ref(lambda x, c, s: F.rope(x, c, s, P_ROPE, style="gptj"), _x((2, 1, 16)), cos, sin)),
        Raises(InputError, "style must be one of"))
    add("op-rope-int-cos", OPS, "rope with int64 cos/sin",
        _op(_no_ref(lambda x, c, s: F.rope(x, c, s, P_ROPE), _x((2, 1, 16)), cos.long(), sin.long())),
        Raises(InputError, "cos must be float32"))
    add("op-attention-mask-shape", OPS, "attention with a [1, 1, 2, 2] mask for 3 queries and 3 keys",
        _op(_no_ref(lambda q, k, v, m: F.attention(q, k, v, P_ATTENTION, attention_mask=m), *_qkv(),
                    torch.ones(1, 1, 2, 2, dtype=torch.bool))), Raises(InputError, "attention_mask must be"))
    add("op-attention-mask-heads", OPS, "attention with a per-head mask [1, 2, 3, 3]",
        _op(_no_ref(lambda q, k, v, m: F.attention(q, k, v, P_ATTENTION, attention_mask=m), *_qkv(),
                    torch.ones(1, 2, 3, 3, dtype=torch.bool))), Raises(InputError, "shared by the heads"))
    add("op-attention-mask-list", OPS, "attention with a Python list as the mask",
        _op(_no_ref(lambda q, k, v: F.attention(q, k, v, P_ATTENTION, attention_mask=[[True]]), *_qkv())),
        Raises(InputError, "attention_mask must be a tensor"))
    add("op-attention-scale", OPS, "attention with scale='x'",
        _op(_no_ref(lambda q, k, v: F.attention(q, k, v, P_ATTENTION, scale="x"), *_qkv())),
        Raises(InputError, "scale must be a number"))
    add("op-attention-no-keys", OPS, "attention of 3 queries over zero keys",
        _op(_no_ref(lambda q, k, v: F.attention(q, k, v, P_ATTENTION), *_qkv(tk=0))), Raises(InputError, "Tk = 0"))
    add("op-attention-heads", OPS, "attention with 3 key heads for 2 query heads",
        _op(_no_ref(lambda q, k, v: F.attention(q, k, v, P_ATTENTION), *_qkv(hq=2, hk=3))),
        Raises(InputError, "Hk dividing Hq"))
    add("op-as-sampled-rows-without-completions", OPS, "as_sampled(prompt_lengths, rows=[0]) without completion "
        "lengths", _op(_no_ref(_as_sampled([3], rows=[0]))), Raises(InputError, "give completion_lengths too"))
    add("op-as-sampled-completion-count", OPS, "as_sampled with 2 prompt lengths and 1 completion length",
        _op(_no_ref(_as_sampled([3, 4], [2]))), Raises(InputError, "one prompt length per request"))
    add("op-as-sampled-row-out-of-range", OPS, "as_sampled(rows=[1]) for a batch of one request",
        _op(_no_ref(_as_sampled([3], [2], rows=[1]))), Raises(InputError, "rows are indices of the 1 requests"))
    add("op-as-sampled-forward-rows", OPS, "split attention on 2 rows inside as_sampled of a 1-request engine batch",
        _op(_no_ref(_as_sampled([3], [1], batch=2), *_qkv(b=2))),
        Raises(InputError, "1 requests of the engine batch for a forward of 2 rows"))
    add("op-as-sampled-completion-too-long", OPS, "split attention on a 120-token row inside as_sampled([100], "
        "[10**7]) (the plan would grow with the claimed length)",
        _op(_no_ref(_as_sampled([100], [10 ** 7], batch=1), *_qkv(tq=120, tk=120))),
        Raises(InputError, "prompt + completion must equal the row's length"))
    add("op-as-sampled-rows-longer", OPS, "split attention on 160-token rows inside as_sampled([100, 100], [20, 20])",
        _op(_no_ref(_as_sampled([100, 100], [20, 20], batch=2), *_qkv(b=2, tq=160, tk=160))),
        Raises(InputError, "prompt + completion must equal the row's length"))
    add("op-attention-no-profile-attention", OPS, "attention with a profile without measured attention",
        _op(_no_ref(lambda q, k, v: F.attention(q, k, v, synthetic_profile()), *_qkv())),
        Raises(RegionUnavailable, "has no measured attention"))
    add("op-attention-empty-batch", OPS, "attention of an empty batch (0, 2, 3, 8)",
        _op(_no_ref(lambda q, k, v: F.attention(q, k, v, P_ATTENTION), *_qkv(b=0))), Succeeds("returns (0, 2, 3, 8) bfloat16"))
    return c


CASES: list[Case] = _cases()


# -- docs/bad-input.md ----------------------------------------------------------------------------


def _code(s: str) -> str:
    s = s.replace("|", "\\|")
    return f"`` {s} ``" if "`" in s else f"`{s}`"


def outcome(case: Case, r: Result) -> str:
    """The outcome, for the table (of a case that met its expectation)."""
    e = case.expect
    if isinstance(e, CliExit):
        line = said(r, e.prefix) if e.prefix else None
        return f"exit {r.exit_code}: {_code(line)}" if line else f"exit {r.exit_code}, no traceback ({r.detail})"
    if isinstance(e, Raises):
        first = r.message.splitlines()[0] if r.message else ""
        return f"{_code(r.error)}: {_code(first)}" if first else f"{_code(r.error)} ({r.detail})"
    if isinstance(e, Bitwise):
        return f"bitwise equal to the reference ({r.detail})"
    return r.detail.replace("|", "\\|")


def render_markdown(results: dict[str, Result]) -> str:
    """docs/bad-input.md for these results (one per case in CASES)."""
    docs = [c for c in CASES if c.in_docs]
    counts = {cat: sum(c.category == cat for c in docs) for cat in CATEGORIES}
    lines = [
        "# Bad input: what each one does",
        "",
        "Generated by `scripts/make_bad_input_docs.py` from the cases in `tests/bad_inputs.py`; do not edit by hand.",
        "`tests/test_bad_input.py` runs the same cases in CI, each against its expected outcome, and fails when this",
        "file differs from what the script writes now:",
        "",
        "```bash",
        ".venv/bin/python scripts/make_bad_input_docs.py",
        "```",
        "",
        "Each case runs in a fresh temporary folder (`<tmp>` below) with `$ENGINEPROFILES_DIR` pointing at an empty",
        "folder (`<shipped>`), so no outcome depends on the shipped profiles. An outcome is an exception's class and",
        "the first line of its message (every error class of this project derives from",
        "`engineprofiles.errors.EngineProfilesError`), a command's exit status and its `error:` line (never a",
        "traceback), a result bit for bit equal to the torch reference in `engineprofiles.regions` (on the default",
        "CPU backend), or what a success did. The damage check is what the case compared before and after the call;",
        "each found nothing changed. CLI cases run in-process (typer's CliRunner); the SIGINT cases run the command in",
        "a child process and interrupt it with a real signal where it is blocked.",
        "",
        f"{len(docs)} cases: " + ", ".join(f"{counts[cat]} {cat}" for cat in CATEGORIES) + ".",
        "",
        "| category | bad input | outcome | damage check |",
        "|---|---|---|---|",
    ]
    for c in docs:
        r = results[c.id]
        lines.append(f"| {c.category} | {c.bad_input.replace('|', chr(92) + '|')} | {outcome(c, r)} | {r.checked} |")
    left = [c for c in CASES if not c.in_docs]
    if left:
        lines += ["", "Run by the test but not in the table, because the outcome depends on the machine:", ""]
        lines += [f"- `{c.id}`: {c.bad_input}. {c.note}" for c in left]
    return "\n".join(lines) + "\n"
