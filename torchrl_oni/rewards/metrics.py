"""Kept for one release: :func:`auc` now lives in :mod:`torchrl_oni.stats`."""
from torchrl_oni.stats import auc  # noqa: F401

__all__ = ["auc"]
