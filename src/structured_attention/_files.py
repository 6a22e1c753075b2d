"""File helpers shared by the package: atomic writes (checkpoints, data caches, downloads), file
checksums, and claims on a folder (a run's out_dir, a sweep's run)."""

from __future__ import annotations

import getpass
import hashlib
import os
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = ["atomic_write", "claim", "file_sha256", "release", "with_umask"]


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
