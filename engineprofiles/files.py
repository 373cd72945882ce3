"""Writing output files safely, without torch (the CLI checks its outputs before it hands over).

A profile (or a report) is written only to a regular file or to a path where nothing exists yet:
never over a folder, a device (``/dev/null``, ``/dev/full``), a FIFO or a socket, which an atomic
rename would replace with a regular file. A symlink is written through (the link stays). The
written file keeps the mode (and, where allowed, the owner) of the file it replaces; a new file
gets ``0o666`` minus the umask, as ``open`` would give it. SIGTERM and SIGHUP during the write
remove the temporary file before the process ends by the signal.
"""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import tempfile
import threading
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

from .errors import OutputNotWritable


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder")):
        if test(mode):
            return name
    return "a special file"


def file_target(path: str | os.PathLike[str]) -> Path:
    """The file a write to ``path`` replaces: ``path``, or the file its symlink points to.

    Raises :class:`OutputNotWritable` when that is anything but a regular file or nothing (a
    folder, a device, a FIFO, a socket, or a path below a regular file)."""
    p = Path(path)
    target = Path(os.path.realpath(p)) if p.is_symlink() else p
    try:
        st = os.stat(target)
    except FileNotFoundError:
        return target
    except NotADirectoryError:
        raise OutputNotWritable(f"cannot write {p}: a folder on its path is a file") from None
    except OSError as e:
        raise OutputNotWritable(f"cannot write {p}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise OutputNotWritable(
            f"cannot write {p}: it is {_kind(st.st_mode)}, not a regular file; write to a regular file or a new path"
        )
    return target


def check_writable_folder(folder: Path, what: str) -> None:
    """Check that files can be created in ``folder`` (or, where it does not exist yet, that it can
    be made): by trying, since permission bits do not tell (root, read-only mounts, /proc)."""
    probe_dir = folder
    while not probe_dir.exists():
        probe_dir = probe_dir.parent
    if not probe_dir.is_dir():
        raise OutputNotWritable(f"cannot write {what}: {probe_dir} is a file, not a folder")
    try:
        if probe_dir == folder:
            fd, tmp = tempfile.mkstemp(prefix=".engineprofiles-check.", dir=folder)
            os.close(fd)
            os.unlink(tmp)
        else:
            os.rmdir(tempfile.mkdtemp(prefix=".engineprofiles-check.", dir=probe_dir))
    except OSError as e:
        raise OutputNotWritable(f"cannot write {what}: {probe_dir} is not writable ({e.strerror or e})") from None


def _umask() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # no /proc: read it the only other way (set and restore)
    os.umask(mask)
    return mask


class _Signalled(BaseException):
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _raise_signalled(signum: int, frame: object) -> None:
    raise _Signalled(signum)


@contextlib.contextmanager
def _signals_raise() -> Iterator[None]:
    """While the block runs, SIGTERM and SIGHUP (where they would end the process) raise instead,
    so that the block's cleanup runs; then the signal is delivered again with its default action."""
    installed: dict[int, object] = {}
    if threading.current_thread() is threading.main_thread():
        for name in ("SIGTERM", "SIGHUP"):
            sig = getattr(signal, name, None)
            if sig is not None and signal.getsignal(sig) is signal.SIG_DFL:
                installed[sig] = signal.signal(sig, _raise_signalled)

    def restore() -> None:
        for sig, old in installed.items():
            signal.signal(sig, old)  # type: ignore[arg-type]
        installed.clear()

    try:
        yield
    except _Signalled as e:
        restore()
        signal.raise_signal(e.signum)  # the default action: the process ends by the signal
        raise  # pragma: no cover - only if the default action did not end the process
    finally:
        restore()


def write_atomic(path: str | os.PathLike[str], text: str | bytes) -> Path:
    """Write ``text`` (UTF-8; or bytes as they are) to ``path`` atomically: a failure or a signal leaves the old file
    (or nothing) and no temporary file. Refuses a target that is not a regular file or absent."""
    data = text.encode("utf-8") if isinstance(text, str) else text
    return write_atomic_with(path, lambda f: f.write(data))


def write_atomic_with(path: str | os.PathLike[str], write: Callable[[BinaryIO], object]) -> Path:
    """:func:`write_atomic` for a writer: ``write(f)`` fills the temporary file ``f`` (opened binary), e.g.
    ``lambda f: torch.save(obj, f)``; then it replaces ``path`` as :func:`write_atomic` does (a temporary
    file of a unique name in the target's folder, the old file's mode kept, a symlink written through,
    nothing left behind by a failure, an interrupt or SIGTERM/SIGHUP). An exception of ``write`` that is
    not an OSError propagates as it is."""
    path = Path(path)
    target = file_target(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputNotWritable(f"cannot write {path}: cannot make the folder {target.parent} ({e.strerror or e})") from None
    try:
        old = os.stat(target)
    except FileNotFoundError:
        old = None
    mode = (old.st_mode & 0o7777) if old is not None else (0o666 & ~_umask())
    with _signals_raise():
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
            with os.fdopen(fd, "wb") as f:
                if old is not None and (old.st_uid, old.st_gid) != (os.geteuid(), os.getegid()):
                    with contextlib.suppress(OSError):  # keep the owner where we may (root)
                        os.fchown(f.fileno(), old.st_uid, old.st_gid)
                os.fchmod(f.fileno(), mode)
                write(f)
                f.flush()
                os.fsync(f.fileno())
            file_target(path)  # still a regular file or nothing, right before the rename
            os.replace(tmp, target)
            tmp = None
        except OSError as e:
            if tmp is not None and os.path.lexists(tmp):
                os.unlink(tmp)
            if isinstance(e, OutputNotWritable):
                raise
            raise OutputNotWritable(f"cannot write {path}: {e.strerror or e}") from e
        except BaseException:
            if tmp is not None and os.path.lexists(tmp):
                os.unlink(tmp)
            raise
    return path
