"""Atomic file writes: a crash while writing never costs the last good file.

Every file this package writes for later use (checkpoints, the caption store, Motif annotations
and reward models) goes through :func:`atomic_write`: the bytes go to a temporary file in the
same folder, are flushed to disk, and the file is then renamed over the target (``os.replace``
is atomic on POSIX and Windows); the folder is fsynced so the rename itself survives a crash.

Example:
    >>> import os, tempfile
    >>> from torchrl_oni.atomic import atomic_write
    >>> path = os.path.join(tempfile.mkdtemp(), "note.txt")
    >>> _ = atomic_write(path, lambda f: f.write(b"kept"))
    >>> open(path, "rb").read()
    b'kept'
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable, Union

__all__ = ["atomic_write"]


def atomic_write(path: Union[str, os.PathLike], write: Callable[[BinaryIO], object]) -> Path:
    """Calls ``write(f)`` on a temporary binary file, then moves it over ``path``."""
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:  # make the rename durable; harmless where directories cannot be opened
        dir_fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:
        pass
    return path
