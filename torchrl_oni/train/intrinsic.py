"""Builds the trainer hooks that produce ``("next", "intrinsic_reward")`` for ``--intrinsic-reward``."""
from __future__ import annotations

from typing import List

from .config import TrainConfig


def build_intrinsic_hooks(cfg: TrainConfig) -> List:
    """Hooks for ``cfg.intrinsic_reward``; ``none`` needs none."""
    if cfg.intrinsic_reward == "none":
        return []
    raise ValueError(f"--intrinsic-reward {cfg.intrinsic_reward} is not wired into oni-train yet; use 'none'")
