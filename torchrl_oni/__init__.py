"""torchrl_oni: ONI (online intrinsic rewards from LLM feedback) for TorchRL on NetHack.

The public names load lazily, so ``import torchrl_oni`` stays cheap (no NLE, no torchrl import
until a name is used). It tells gymnasium the task ids, so ``gymnasium.make("NetHackScore-v1")``
(or any id of :data:`torchrl_oni.task_ids.TASKS`) works after it.

API reference: everything a TorchRL user's own script needs is importable from here
(``from torchrl_oni import ...``); the module each name lives in is its documentation
(``help(torchrl_oni.MessageCounter)``).

* The whole stack in one call: ``oni_transforms`` (returns an ``ONITransforms``, a TorchRL
  ``Compose`` of the transforms below, in this order).
* Env-side transforms, the ones to put in each worker's env (``ParallelEnv`` factories,
  ``MultiSyncCollector``/``MultiAsyncCollector`` env factories): ``CopyAliasedObservations``
  (copies of observations NLE hands out in reused arrays), ``CaptionHash`` (``caption_hash``),
  ``MessageCounter`` (``msg_count``, the per-episode sightings the reward decays with).
* Trainer-side transforms, in the process that owns the store (an outer ``TransformedEnv`` or
  each collected batch): ``LLMAnnotationTransform`` (labels captions in the background),
  ``IntrinsicRewardTransform`` (``("next", "intrinsic_reward")``), ``CombineRewards`` (the
  extrinsic/intrinsic mix).
* The labels and who writes them: ``CaptionStore``, ``ScriptedAnnotator`` (NetHack rules, no
  LLM), ``OpenAIAnnotator`` (vLLM or any OpenAI-compatible server).
* Reward sources: ``RetrievalReward`` (ONI-Retrieval; more in :mod:`torchrl_oni.rewards`).
* Envs: ``NLEBatchEnv`` (K games stepped in one process); the gymnasium ids of
  :mod:`torchrl_oni.task_ids`.
* Training as ``oni-train`` does: ``TrainConfig``, ``Trainer``.

Example:
    >>> import torchrl_oni
    >>> torchrl_oni.IntrinsicRewardTransform.__name__
    'IntrinsicRewardTransform'
"""
from __future__ import annotations

import importlib

__all__ = [
    "CaptionHash",
    "CaptionStore",
    "CombineRewards",
    "CopyAliasedObservations",
    "MessageCounter",
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
    "CaptionHash": "torchrl_oni.envs.caption_keys",
    "CaptionStore": "torchrl_oni.store",
    "CombineRewards": "torchrl_oni.transforms",
    "CopyAliasedObservations": "torchrl_oni.envs.caption_keys",
    "MessageCounter": "torchrl_oni.envs.caption_keys",
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

