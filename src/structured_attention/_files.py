"""File helpers shared by the package: atomic writes (checkpoints, data caches, downloads)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = ["atomic_write"]


def atomic_write(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """``write(tmp)`` to a temporary file beside ``path``, fsync it, then ``os.replace`` it onto
    ``path``: readers see the old file or the complete new one, never a partial one. The temporary
    file is removed if ``write`` raises."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".tmp-{path.name}-")
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
