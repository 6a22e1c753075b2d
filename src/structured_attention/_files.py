"""File helpers shared by the package: atomic writes (checkpoints, data caches, downloads), file
checksums, and claims on a folder (a run's out_dir, a sweep's run)."""

from __future__ import annotations

import contextlib
import getpass
import hashlib
import os
import socket
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

__all__ = ["atomic_write", "check_folder", "claim", "file_sha256", "made_folder", "make_folder", "release",
           "with_umask"]


def check_folder(path: str | os.PathLike, name: str) -> Path:
    """``path`` as a folder that can be made or written, checked without making it, or a one-line
    ``ValueError`` naming the option ``name``: a command checks its output folder before its work
    (a benchmark's timings, a sweep's training), which would otherwise be done and then lost."""
    p = Path(path)
    for at in (p, *p.parents):
        if not at.exists():
            continue
        if not at.is_dir():
            raise ValueError(f"{name}: expected a folder, got {str(p)!r} ({str(at)!r} is a file)")
        if not os.access(at, os.W_OK | os.X_OK):
            raise ValueError(f"{name}: expected a folder this user can write, got {str(p)!r} ({str(at)!r} is not "
                             f"writable)")
        break
    return p


def make_folder(path: str | os.PathLike, name: str) -> Path:
    """``path`` made with its parents (kept if it is a folder already), or a one-line ``ValueError``
    naming the option ``name`` with the system's reason."""
    p = check_folder(path, name)
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"{name}: expected a folder that can be made, got {str(p)!r} "
                         f"({err.strerror or type(err).__name__})") from None
    return p


@contextlib.contextmanager
def made_folder(path: str | os.PathLike, name: str) -> Iterator[Path]:
    """:func:`make_folder` for the duration of a piece of work: if the work raises, the folders
    this call made (``path`` and any missing parents) are removed again where the work left them
    empty, so a run that fails before writing anything (a bad data source) leaves no empty folder
    behind. A folder that existed before, or holds anything, is kept."""
    p = check_folder(path, name)
    new = [at for at in (p, *p.parents) if not at.exists()]  # the deepest first
    make_folder(p, name)
    try:
        yield p
    except BaseException:
        for at in new:
            try:
                at.rmdir()  # only ever removes an empty folder
            except OSError:
                break
        raise


def with_umask(path: str | os.PathLike, mode: int) -> None:
    """Give ``path`` the permissions ``mode`` less the process's umask, what ``open`` or ``mkdir``
    would have given it: ``tempfile`` creates files 0600 and folders 0700 whatever the umask, which
    would leave checkpoints unreadable to the user's group on a shared machine."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, mode & ~umask)


def atomic_write(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """``write(tmp)`` to a temporary file beside ``path``, fsync it, then ``os.replace`` it onto
    ``path``: readers see the old file or the complete new one, never a partial one. The temporary
    file is removed if ``write`` raises. The file gets the permissions the umask gives new files."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".tmp-{path.name}-")
    os.close(fd)
    try:
        write(tmp)
        with_umask(tmp, 0o666)  # after write: a writer may replace the file (safetensors makes it 0600)
        with open(tmp, "rb+") as f:
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def file_sha256(path: str | os.PathLike) -> str:
    """The SHA-256 of a file's bytes, read in 1 MiB pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists but belongs to someone else
        return True
    return True


def _me() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no user name for this uid (a container)
        user = str(os.getuid()) if hasattr(os, "getuid") else "?"
    return f"{socket.gethostname()} {os.getpid()} {user}"


def claim(path: str | os.PathLike) -> str | None:
    """Create ``path`` as this process's claim (``host pid user``), atomically. Returns None once
    claimed, else the holder's ``host pid user``. A claim whose process is gone from this host is
    taken over, so a killed run never blocks its own resume; a claim from another host is always
    respected (its process cannot be checked from here)."""
    path = Path(path)
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                holder = path.read_text().strip()
            except FileNotFoundError:  # released in between
                continue
            host, _, rest = holder.partition(" ")
            pid = rest.split(" ")[0]
            if host == socket.gethostname() and pid.isdigit() and not _alive(int(pid)):
                path.unlink(missing_ok=True)
                continue
            return holder or "a process that is writing its claim"
        with os.fdopen(fd, "w") as f:
            f.write(_me())
        return None
    return "a process that took it over first"


def release(path: str | os.PathLike) -> None:
    """Remove ``path`` if it is this process's claim (never another's)."""
    path = Path(path)
    try:
        if path.read_text().strip() == _me():
            path.unlink()
    except FileNotFoundError:
        pass
