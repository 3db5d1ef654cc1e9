"""PPO training of NetHack agents with ONI intrinsic rewards.

The names below load on first use, so that importing a module of this package (for instance
:mod:`torchrl_oni.train.reward_types`, to register a reward type) does not build the
configuration tree before every reward type is registered.
"""
import importlib

__all__ = ["TrainConfig", "PRESETS", "INTRINSIC_REWARDS", "Trainer", "TrainHook"]

_HOMES = {"TrainConfig": ".config", "PRESETS": ".config", "INTRINSIC_REWARDS": ".config", "Trainer": ".ppo",
          "TrainHook": ".hooks"}


def __getattr__(name):
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
