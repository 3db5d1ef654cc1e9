"""Atomic checkpoints: a crash while saving never costs the last good checkpoint.

Example:
    >>> import tempfile, os
    >>> from torchrl_oni.train.checkpoint import save_checkpoint, load_checkpoint
    >>> path = os.path.join(tempfile.mkdtemp(), "checkpoint.pt")
    >>> save_checkpoint({"frames": 1024}, path)
    >>> load_checkpoint(path)["frames"]
    1024
"""
from __future__ import annotations

import os

import torch

from ..atomic import atomic_write

__all__ = ["save_checkpoint", "load_checkpoint", "CHECKPOINT_NAME"]

CHECKPOINT_NAME = "checkpoint.pt"


def save_checkpoint(state: dict, path: str) -> None:
    """Writes ``state`` to a temporary file beside ``path``, fsyncs it, then renames it over."""
    atomic_write(path, lambda f: torch.save(state, f))


def load_checkpoint(path: str) -> dict:
    """Loads a checkpoint written by :func:`save_checkpoint` (a folder means its checkpoint.pt)."""
    if os.path.isdir(path):
        path = os.path.join(path, CHECKPOINT_NAME)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no checkpoint at {path}")
    return torch.load(path, map_location="cpu", weights_only=False)
