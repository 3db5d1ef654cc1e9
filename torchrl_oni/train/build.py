"""Builds a run from its configuration: the one place that reads the whole tree.

``oni-train`` (after parsing) and :meth:`Trainer.from_config
<torchrl_oni.train.ppo.Trainer.from_config>` (for Python) both come here with a configuration
resolved once (:meth:`~torchrl_oni.train.config.TrainConfig.resolved`: every derived value
computed) and validated, and get a :class:`Run`: what the :class:`~torchrl_oni.train.ppo.Trainer`
runs. Each part is handed its own sections, never the tree:

==================================================  ============================================
part                                                what it gets
==================================================  ============================================
:class:`~torchrl_oni.train.labelling.Labelling`     ``annotation``, ``feedback``; the caption
                                                    store's path, the seed, the run's frames
the reward type's ``build``                         a :class:`~torchrl_oni.train.reward_types.RewardContext`:
                                                    its settings section, the store, the annotator
                                                    or LLM endpoint, the learner's device, the
                                                    reward-model schedule (``reward_model``)
:class:`~torchrl_oni.train.intrinsic.IntrinsicRewardHook`  the labelling and the reward's parts; from
                                                    ``reward`` the paying message and the count decay
:class:`~torchrl_oni.train.workers.EnvWorkers`      ``env`` (one worker's games, the hooks'
                                                    acting-time transforms), ``distributed``,
                                                    ``acting``
:class:`~torchrl_oni.train.shaping.RewardShaping`   ``reward`` (coefficients, clip, survival terms)
:class:`~torchrl_oni.train.ppo.Trainer`             the :class:`Run` (its parts, the budget, the
                                                    seed and the learner's device), ``ppo``, ``log``
==================================================  ============================================

The whole tree travels in the :class:`Run` only as the run's record (``config.yaml``, the
checkpoints): no part reads a setting from it.

Example:
    >>> from torchrl_oni.train.build import build_run
    >>> from torchrl_oni.train.config import TrainConfig
    >>> run = build_run(TrainConfig(workers=1).resolved())
    >>> run.hooks, run.frames, run.workers.count, run.shaping.mix.intrinsic_coeff
    ([], 300000, 1, 0.0)
    >>> build_run(TrainConfig())
    Traceback (most recent call last):
    ...
    ValueError: build_run needs a resolved configuration: TrainConfig.resolved() computes what a run derives, once
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence

from ..run_folder import CAPTION_STORE_NAME
from .config import TrainConfig

__all__ = ["Run", "build_run", "build_intrinsic_hook", "check_resolved"]

log = logging.getLogger("torchrl_oni.train")


@dataclass
class Run:
    """What the trainer runs.

    Attributes:
        cfg: the resolved :class:`~torchrl_oni.train.config.TrainConfig`, the run's record
            (written to ``config.yaml`` and the checkpoints); the parts below were built from it.
        workers: the env workers (:class:`~torchrl_oni.train.workers.EnvWorkers`).
        shaping: the reward PPO optimises (:class:`~torchrl_oni.train.shaping.RewardShaping`).
        frames: frames to train in all (``--frames``).
        frames_per_update: frames gathered for each PPO update.
        seed: the networks' and sampling's seed (the games' seeds are the workers').
        device: the learner's device.
        learner_threads: torch threads of the learner on a CPU (None: leave torch's).
        hooks: :class:`~torchrl_oni.train.hooks.TrainHook` objects, in the order they run at each
            stage: the intrinsic reward's first, then the caller's.
        batch_transforms: TorchRL transforms on each update's batch, before the hooks' ``on_batch``.
    """

    cfg: TrainConfig
    workers: Any
    shaping: Any
    frames: int
    frames_per_update: int
    seed: int
    device: Any
    learner_threads: Optional[int] = None
    hooks: List[Any] = field(default_factory=list)
    batch_transforms: List[Any] = field(default_factory=list)


def check_resolved(cfg: TrainConfig, who: str) -> None:
    """ValueError unless ``cfg`` was resolved: a part built from raw settings would derive its own
    values, and the run would record others than it used."""
    if getattr(cfg, "derived", None) is None:
        raise ValueError(f"{who} needs a resolved configuration: TrainConfig.resolved() computes what a run "
                         f"derives, once")


def build_run(cfg: TrainConfig, hooks: Sequence = (), batch_transforms: Sequence = (), *,
              intrinsic: bool = True) -> Run:
    """The :class:`Run` of ``cfg``.

    Args:
        cfg: a resolved (:meth:`~torchrl_oni.train.config.TrainConfig.resolved`) and validated
            configuration.
        hooks: further :class:`~torchrl_oni.train.hooks.TrainHook` objects, run after the
            intrinsic reward's.
        batch_transforms: TorchRL transforms applied to each update's batch, in order, before the
            hooks' ``on_batch``.
        intrinsic: build the hook of ``cfg.reward.intrinsic_reward`` (its annotator, store, reward
            model...); False: the networks and the loop alone (an untrained checkpoint).

    Raises:
        ValueError / RuntimeError: one-line reasons (see :func:`build_intrinsic_hook`).
    """
    from .env_factory import make_env_factory
    from .shaping import RewardShaping
    from .workers import EnvWorkers

    check_resolved(cfg, "build_run")
    if cfg.reward.intrinsic_reward != "none" and not cfg.reward.intrinsic_coeff:
        log.warning("--intrinsic-reward %s with --intrinsic-coeff 0: the intrinsic reward is computed and "
                    "logged but does not reach the policy", cfg.reward.intrinsic_reward)
    built = [build_intrinsic_hook(cfg)] if intrinsic and cfg.reward.intrinsic_reward != "none" else []
    # the hooks' acting-time observations (e.g. ELLM's goal), in every worker's env
    env_transforms = [t for hook in built for t in hook.env_transforms()]
    workers = EnvWorkers(make_env_factory(cfg, 0, transforms=env_transforms), cfg.env.workers, cfg.distributed,
                         acting=cfg.acting, acting_splits=cfg.acting_splits, frames_per_batch=cfg.frames_per_batch)
    return Run(cfg, workers, RewardShaping(cfg.reward, cfg.ppo.value_heads), frames=cfg.frames,
               frames_per_update=cfg.frames_per_update, seed=cfg.seed, device=cfg.derived.device,
               learner_threads=cfg.derived.learner_threads, hooks=[*built, *hooks],
               batch_transforms=list(batch_transforms))


def build_intrinsic_hook(cfg: TrainConfig):
    """The :class:`~torchrl_oni.train.intrinsic.IntrinsicRewardHook` of ``cfg.reward.intrinsic_reward``
    (not ``none``), its parts built and started in this order: the labelling's annotator or LLM
    endpoint (first: a dead server fails fast), judge probe and caption store; the reward type's
    parts; the annotation worker and the labelling page (label budgets by disagreement and the
    page's order read the reward model). When a step fails, whatever started is stopped again and
    nothing is written.

    Raises:
        ValueError / RuntimeError: one-line reasons (dead LLM server, unknown model, missing
            reward-model checkpoint...), which ``oni-train`` prints and exits 2 on.
    """
    from ..rewards.training import RewardModelSchedule
    from .intrinsic import IntrinsicRewardHook
    from .labelling import Labelling
    from .reward_types import RewardContext, reward_types

    check_resolved(cfg, "build_intrinsic_hook")
    kind, derived, rm = cfg.reward.intrinsic_reward, cfg.derived, cfg.reward_model
    if kind == "none":
        raise ValueError("an intrinsic-reward hook needs an --intrinsic-reward other than 'none'")
    spec = reward_types()[kind]
    labelling = Labelling(cfg.annotation, cfg.feedback, spec, seed=cfg.seed, total_frames=cfg.frames,
                          store_path=cfg.annotation.caption_store or os.path.join(cfg.log.logdir, CAPTION_STORE_NAME))
    parts = None
    try:
        labelling.open()
        schedule = RewardModelSchedule(rm.steps_per_labels, rm.switch_at, rm.steps_per_iteration,
                                       time_fraction=derived.rm_time_fraction)
        settings = getattr(cfg.reward, kind.replace("-", "_"), None) if spec.settings else None
        parts = spec.build(RewardContext(cfg=cfg, settings=settings, store=labelling.store, device=derived.device,
                                         schedule=schedule, annotator=labelling.annotator, llm=labelling.llm,
                                         wake_annotator=labelling.wake))
        labelling.start(parts.reward)
        return IntrinsicRewardHook(spec, labelling, parts, run_dir=cfg.log.logdir,
                                   message=cfg.reward.reward_message, count_exponent=cfg.reward.count_exponent,
                                   count_scope=cfg.reward.count_scope, rm_background=derived.rm_background)
    except BaseException:
        try:
            if parts is not None and parts.close is not None:
                parts.close()
        finally:
            labelling.close(save=False)  # a run that never started must not write a store
        raise
