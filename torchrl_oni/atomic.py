"""Files that survive crashes and hostile contents: atomic writes, safe reads, stale-temp cleanup.

Every file this package writes for later use (checkpoints, the caption store, Motif annotations
and reward models, ``metrics.csv``) goes through :func:`atomic_write`: the bytes go to a
temporary file ``.<name>.<random>.tmp`` in the same folder, are flushed to disk, and the file is
then renamed over the target (``os.replace`` is atomic on POSIX and Windows); the folder is
fsynced so the rename itself survives a crash. A process killed mid-write leaves only such a
temporary file behind, which :func:`remove_stale_temps` deletes at the next start.

Every torch file this package reads goes through :func:`safe_torch_load`: ``torch.load`` with
``weights_only=True``, so a crafted pickle cannot run code, and any failure (a truncated file,
garbage, a forbidden object) becomes one :class:`UnreadableFileError` with a one-line message.

Example:
    >>> import os, tempfile, torch
    >>> from torchrl_oni.atomic import atomic_write, remove_stale_temps, safe_torch_load
    >>> folder = tempfile.mkdtemp()
    >>> path = os.path.join(folder, "note.pt")
    >>> _ = atomic_write(path, lambda f: torch.save({"step": 3}, f))
    >>> safe_torch_load(path, what="note")
    {'step': 3}
    >>> _ = open(os.path.join(folder, ".note.pt.k3x9_q2a.tmp"), "wb")  # a write that was killed
    >>> [os.path.basename(p) for p in remove_stale_temps(folder)]
    ['.note.pt.k3x9_q2a.tmp']
"""
from __future__ import annotations

import os
import pickle
import re
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable, List, Union

__all__ = ["atomic_write", "remove_stale_temps", "safe_torch_load", "UnreadableFileError"]

# tempfile.mkstemp(prefix=".<name>.", suffix=".tmp") adds 8 characters from this alphabet
_TEMP_NAME = re.compile(r"^\.(?P<target>.+)\.[a-z0-9_]{8}\.tmp$")


class UnreadableFileError(ValueError):
    """A file cannot be read back: empty, truncated, not of the expected kind, or unsafe.

    A ``ValueError`` so that command-line tools report it as one ``prog: error: ...`` line.
    """


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


def remove_stale_temps(directory: Union[str, os.PathLike], *, min_age_s: float = 0.0) -> List[str]:
    """Deletes the temporary files that interrupted :func:`atomic_write` calls left in ``directory``.

    Only regular files named like :func:`atomic_write`'s temporaries (``.<name>.<8 chars>.tmp``)
    directly in ``directory`` are touched; the targets themselves never are. Call it when no
    other process is writing into ``directory`` (e.g. when a run starts or resumes), or give
    ``min_age_s`` so that files younger than that are left alone.

    Args:
        directory: the folder to clean (a missing folder is fine: nothing to do).
        min_age_s: only delete temporaries last modified at least this many seconds ago.

    Returns:
        The paths deleted.
    """
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return []
    now = time.time()
    removed = []
    for entry in entries:
        if not _TEMP_NAME.match(entry.name) or not entry.is_file(follow_symlinks=False):
            continue
        try:
            if min_age_s > 0 and now - entry.stat(follow_symlinks=False).st_mtime < min_age_s:
                continue
            os.unlink(entry.path)
        except FileNotFoundError:  # someone else cleaned it meanwhile
            continue
        removed.append(entry.path)
    return sorted(removed)


def safe_torch_load(path: Union[str, os.PathLike], *, what: str = "file", safe_globals: Iterable = ()) -> Any:
    """``torch.load(path, map_location="cpu", weights_only=True)`` with one clear error type.

    ``weights_only=True`` rebuilds only tensors and plain containers (dict, list, tuple, str,
    numbers, ``None``, ``OrderedDict``, ``torch.Size``...); a pickle that names any other
    callable is refused before anything runs.

    Args:
        path: the file.
        what: what the file should be, for the message ("checkpoint", "caption store"...).
        safe_globals: extra classes/functions to accept for this one load (see
            ``torch.serialization.safe_globals``); keep it to plain data types.

    Raises:
        FileNotFoundError: there is no such file.
        UnreadableFileError: the file is empty, truncated, not a torch file, or holds
            objects that ``weights_only`` refuses; the message is one line.
    """
    import torch

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no {what} at {path}")
    extra = list(safe_globals)
    try:
        if extra:
            with torch.serialization.safe_globals(extra):
                return torch.load(path, map_location="cpu", weights_only=True)
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise UnreadableFileError(f"{path} is not a readable {what} ({_reason(err)})") from None


def _reason(err: BaseException) -> str:
    """One line saying why ``torch.load`` failed (its own messages span many lines)."""
    text = str(err)
    if isinstance(err, pickle.UnpicklingError) and "WeightsUnpickler error:" in text:
        detail = text.split("WeightsUnpickler error:", 1)[1].strip().splitlines()[0]
        # torch goes on to suggest allowlisting the global: not advice to pass on for a file
        # that may be hostile
        detail = detail.split(" was not an allowed global")[0].split(". Please")[0]
        return f"refused: it holds more than tensors and plain data; {detail}"
    if isinstance(err, EOFError) or not text.strip():
        return "empty or truncated"
    if isinstance(err, (zipfile.BadZipFile, RuntimeError)) and "zip" in text.lower():
        return "truncated or damaged archive"
    if isinstance(err, (pickle.UnpicklingError, KeyError, ValueError, UnicodeDecodeError, AttributeError)):
        return "not a torch file"
    first = text.strip().splitlines()[0]
    return f"{type(err).__name__}: {first[:200]}"
