"""Old import path of oni-train's reward-type registry, kept for one release.

The registry is application configuration, so it moved to :mod:`torchrl_oni.train.reward_types`
(one module per reward type there); :mod:`torchrl_oni.rewards` is the library of reward classes
and imports nothing of :mod:`torchrl_oni.train`. This alias resolves its names only when one is
read, through :func:`importlib.import_module`, so importing :mod:`torchrl_oni.rewards` never
loads the trainer. New code imports from :mod:`torchrl_oni.train.reward_types`.

Example:
    >>> from torchrl_oni.rewards import registry
    >>> from torchrl_oni.train.reward_types import register_reward
    >>> registry.register_reward is register_reward
    True
"""
import importlib

__all__ = ["RewardType", "RewardParts", "RewardContext", "LLMEndpoint", "register_reward", "reward_types",
           "reward_names"]


def __getattr__(name):
    if name in __all__:
        return getattr(importlib.import_module("torchrl_oni.train.reward_types"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
