"""torchrl_oni: ONI (online intrinsic rewards from LLM feedback) for TorchRL on NetHack.

The public names load lazily, so ``import torchrl_oni`` stays cheap (no NLE, no torchrl import
until a name is used). It tells gymnasium the task ids, so ``gymnasium.make("NetHackScore-v1")``
(or any id of :data:`torchrl_oni.task_ids.TASKS`) works after it.

Example:
    >>> import torchrl_oni
    >>> torchrl_oni.IntrinsicRewardTransform.__name__
    'IntrinsicRewardTransform'
"""
from __future__ import annotations

import importlib

__all__ = [
    "CaptionStore",
    "CombineRewards",
    "ONITransforms",
    "OpenAIAnnotator",
    "RetrievalReward",
    "ScriptedAnnotator",
    "oni_transforms",
    "IntrinsicRewardTransform",
    "LLMAnnotationTransform",
    "NLEBatchEnv",
    "TrainConfig",
    "Trainer",
]

_WHERE = {
    "CaptionStore": "torchrl_oni.store",
    "CombineRewards": "torchrl_oni.transforms",
    "ONITransforms": "torchrl_oni.stack",
    "OpenAIAnnotator": "torchrl_oni.annotators",
    "RetrievalReward": "torchrl_oni.rewards",
    "ScriptedAnnotator": "torchrl_oni.annotators",
    "oni_transforms": "torchrl_oni.stack",
    "IntrinsicRewardTransform": "torchrl_oni.transforms",
    "LLMAnnotationTransform": "torchrl_oni.transforms",
    "NLEBatchEnv": "torchrl_oni.envs.batched",
    "TrainConfig": "torchrl_oni.train.config",
    "Trainer": "torchrl_oni.train.ppo",
}


def __getattr__(name):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'torchrl_oni' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + __all__)


def _register_task_ids() -> None:
    from .task_ids import register_with_gymnasium

    register_with_gymnasium()


_register_task_ids()

