"""The env workers' constructor: what each collector worker process builds (K NetHack games in one
``NLEBatchEnv``, plus the recurrent policy's primers and the hooks' acting-time transforms).

Training, evaluation and the learner's benchmark batch all build their envs here, so an episode
is played the same way wherever it runs.

Example:
    >>> from torchrl_oni.train.config import TrainConfig
    >>> from torchrl_oni.train.env_factory import make_env_factory
    >>> env = make_env_factory(TrainConfig(envs_per_worker=2), worker=0)()
    >>> env.batch_size
    torch.Size([2])
    >>> env.close()
"""
from __future__ import annotations

import copy
from typing import Callable

import torch
from torchrl.envs import Compose, InitTracker, TransformedEnv

from ..envs.batched import NLEBatchEnv
from .config import TrainConfig

__all__ = ["EnvFactory", "make_env_factory"]


class EnvFactory:
    """Picklable env constructor for collector workers (one torch thread per env process)."""

    def __init__(self, task, num_envs, seed, task_kwargs, primer_spec=None, screens=False, transforms=()):
        self.task, self.num_envs, self.seed = task, num_envs, seed
        self.task_kwargs = task_kwargs
        self.screens = screens  # the terminal too, for the labelling page (--human-feedback)
        self.recurrent = primer_spec is not None
        self.primer_spec = primer_spec
        self.transforms = list(transforms)  # the hooks' acting-time observations (e.g. ELLM's goal)

    def offset(self, seed_offset: int, primer_spec=None, transforms=None) -> "EnvFactory":
        """The same games' constructor with the seed moved by ``seed_offset`` (one per env
        worker, and per restart of the workers), the recurrent policy's primers and, when given,
        other transforms."""
        out = copy.copy(self)
        out.seed = self.seed + seed_offset
        out.recurrent, out.primer_spec = primer_spec is not None, primer_spec
        if transforms is not None:
            out.transforms = list(transforms)
        return out

    def __call__(self):
        torch.set_num_threads(1)
        env = NLEBatchEnv(self.task, self.num_envs, seed=self.seed, task_kwargs=self.task_kwargs, screens=self.screens)
        transforms = list(self.transforms)
        if self.recurrent:
            from torchrl.envs import TensorDictPrimer

            transforms += [InitTracker(), TensorDictPrimer(self.primer_spec, expand_specs=True)]
        return TransformedEnv(env, Compose(*transforms)) if transforms else env


def make_env_factory(cfg: TrainConfig, worker: int, primer_spec=None, transforms=()) -> Callable:
    task_kwargs = dict(
        timeout_as_termination=cfg.env.timeout_as_termination, max_episode_steps=cfg.env.max_episode_steps
    )
    seed = cfg.seed * 10_007 + worker
    return EnvFactory(cfg.env.task, cfg.env.envs_per_worker, seed, task_kwargs, primer_spec,
                      screens=cfg.feedback.human_feedback, transforms=transforms)
