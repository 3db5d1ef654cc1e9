"""Checkpoints: written atomically, read back safely.

A crash while saving never costs the last good checkpoint (:func:`~torchrl_oni.atomic.atomic_write`),
and loading one never runs code: :func:`load_checkpoint` reads with ``weights_only=True``, so a
checkpoint holds only tensors and plain containers (the trainer's state: network and optimizer
state dicts, ints, floats, strings, the config as a dict, the torch RNG state). A file that
cannot be read, or is not a checkpoint, raises :class:`CheckpointError` with a one-line message.

Example:
    >>> import tempfile, os
    >>> from torchrl_oni.train.checkpoint import save_checkpoint, load_checkpoint
    >>> path = os.path.join(tempfile.mkdtemp(), "checkpoint.pt")
    >>> save_checkpoint({"frames": 1024}, path)
    >>> load_checkpoint(path)["frames"]
    1024
    >>> load_checkpoint(path, required=("frames", "actor"))
    Traceback (most recent call last):
    ...
    torchrl_oni.train.checkpoint.CheckpointError: ... is not an oni-train checkpoint (no 'actor')
"""
from __future__ import annotations

import os
from typing import Sequence

import numpy as np
import torch

from ..atomic import UnreadableFileError, atomic_write, safe_torch_load
from ..run_folder import CHECKPOINT_NAME

__all__ = ["save_checkpoint", "load_checkpoint", "CheckpointError", "CHECKPOINT_NAME", "TRAINER_KEYS"]

# what Trainer.state_dict() always holds; pass as ``required`` to refuse other torch files early
TRAINER_KEYS = ("actor", "critic", "optimizer", "frames", "iterations", "torch_rng")

# Checkpoints of ranking runs written before the pair sampler stored tensors hold its numpy
# arrays (uint8 messages, int64 hashes). These globals rebuild a plain ndarray of those dtypes
# from (shape, dtype, raw bytes) and nothing else: the array class must itself be allowlisted
# (only np.ndarray is), and an object array needs ObjectDType, which is not.
_reconstruct = np.ndarray.__reduce__(np.zeros(0))[0]
_LEGACY_NUMPY = (
    _reconstruct,
    (_reconstruct, "numpy.core.multiarray._reconstruct"),  # the name numpy 1.x pickles
    np.ndarray,
    np.dtype,
    type(np.dtype(np.uint8)),
    type(np.dtype(np.int64)),
)


class CheckpointError(UnreadableFileError):
    """A checkpoint that cannot be loaded (truncated, garbage, unsafe, or not a checkpoint)."""


def save_checkpoint(state: dict, path: str) -> None:
    """Writes ``state`` to a temporary file beside ``path``, fsyncs it, then renames it over."""
    atomic_write(path, lambda f: torch.save(state, f))


def load_checkpoint(path: str, *, required: Sequence[str] = ()) -> dict:
    """Loads a checkpoint written by :func:`save_checkpoint` (a folder means its checkpoint.pt).

    Args:
        path: the checkpoint file, or the run folder holding ``checkpoint.pt``.
        required: keys the checkpoint must have (e.g. :data:`TRAINER_KEYS`).

    Raises:
        FileNotFoundError: there is no such file.
        CheckpointError: the file is truncated, not a torch file, holds objects other than
            tensors and plain data (a crafted pickle is refused before it runs), is not a dict,
            or lacks a ``required`` key. The message is one line.
    """
    if os.path.isdir(path):
        path = os.path.join(path, CHECKPOINT_NAME)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no checkpoint at {path}")
    try:
        state = safe_torch_load(path, what="checkpoint", safe_globals=_LEGACY_NUMPY)
    except UnreadableFileError as err:
        raise CheckpointError(str(err)) from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} is not an oni-train checkpoint (a {type(state).__name__}, not a dict)")
    missing = [k for k in required if k not in state]
    if missing:
        raise CheckpointError(f"{path} is not an oni-train checkpoint (no {', '.join(map(repr, missing))})")
    return state
