"""PPO training of NetHack agents with ONI intrinsic rewards."""
from .config import TrainConfig, PRESETS, INTRINSIC_REWARDS
from .ppo import Trainer, TrainHook

__all__ = ["TrainConfig", "PRESETS", "INTRINSIC_REWARDS", "Trainer", "TrainHook"]
