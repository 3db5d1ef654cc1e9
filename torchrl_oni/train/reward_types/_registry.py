"""The registry of oni-train's intrinsic reward types: what each needs, and how it is built.

A module of :mod:`torchrl_oni.train.reward_types` registers its type with
:func:`register_reward` on the function that builds it. The declaration says what the trainer
must provide:

================  =========================================================================
declaration       meaning
================  =========================================================================
``labels``        single captions go to the annotator (a :class:`~torchrl_oni.store.CaptionStore` is opened)
``pairs``         caption pairs go to the annotator (ranking)
``reward_model``  the type trains a reward model online: the ``--rm-*`` settings (ensembles,
                  SURF, RUNE, ``--query-selection disagree/entropy``) apply to it
``llm``           the type sends requests of its own to the LLM server (ELLM's goals): the hook
                  provides an endpoint (``ctx.llm``), starting the embedded server if needed
``settings``      a dataclass of the type's own settings; it becomes the config section
                  ``reward.<name>`` and flags ``--<name>-<field>`` (:mod:`torchrl_oni.train.config`)
``check``         ``check(cfg)`` raises ``ValueError`` (one sentence) for impossible settings
``build``         ``build(ctx: RewardContext) -> RewardParts``: the reward and its helpers
================  =========================================================================

Every module of the :mod:`torchrl_oni.train.reward_types` package is imported once, the first
time the registry is read through the package (:func:`~torchrl_oni.train.reward_types.reward_types`,
by :mod:`torchrl_oni.train.config` before it derives the config tree and the command line), so a
new reward type is one new module there; or, from any code that runs before the config is
imported, one :func:`register_reward` call. The package does that discovery, not this module:
the modules import the registry, and the registry imports none of them. The reward classes
themselves live in :mod:`torchrl_oni.rewards`, which knows nothing of this registry. ``none``
(no intrinsic reward) is not a type: it needs no hook at all.

Example:
    >>> from torchrl_oni.train.reward_types import model_rewards, reward_types
    >>> spec = reward_types()["retrieval"]
    >>> spec.labels, spec.pairs, spec.needs_annotator, spec.reward_model
    (True, False, True, False)
    >>> model_rewards()
    ('classification', 'ranking')
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

__all__ = ["RewardType", "RewardParts", "RewardContext", "LLMEndpoint", "register_reward"]


@dataclass
class RewardContext:
    """What a reward type's ``build`` gets from :func:`~torchrl_oni.train.build.build_intrinsic_hook`.

    Attributes:
        cfg: the run's :class:`~torchrl_oni.train.config.TrainConfig` (resolved): a type reads the
            sections it needs (``reward_model``, ``annotation``, the seed).
        settings: the type's own settings section (``cfg.reward.<name>``), or None.
        store: the run's caption store when the type declared ``labels`` or ``pairs``, else None.
        device: where reward models live (the learner's device, never the env workers).
        schedule: the reward-model training schedule (:class:`~torchrl_oni.rewards.training.RewardModelSchedule`)
            built from ``cfg.reward_model``, for types that train a model.
        annotator: the annotator when the type needs one (labels or pairs).
        llm: an :class:`LLMEndpoint` when the type declared ``llm`` and the run uses an LLM
            (``--annotator llm``); None with the rules annotator.
        wake_annotator: call after queueing work (pairs) so the annotation worker picks it up.
    """

    cfg: Any
    settings: Any = None
    store: Any = None
    device: Any = "cpu"
    schedule: Any = None
    annotator: Any = None
    llm: Any = None
    wake_annotator: Callable[[], None] = lambda: None


@dataclass(frozen=True)
class LLMEndpoint:
    """Where a reward type's own LLM requests go: OpenAI-compatible base URLs and the model."""

    urls: Tuple[str, ...]
    model: str
    api_key: Optional[str] = None


@dataclass
class RewardParts:
    """What ``build`` returns.

    Attributes:
        reward: ``reward(messages uint8[N,256], hashes int64[N]) -> float32[N]``, before count decay;
            or None when ``on_batch`` writes ``("next", "intrinsic_reward")`` itself.
        trainer: a reward-model trainer with ``after_iteration() -> dict`` (steps run now, by its
            own schedule), ``evaluate()`` optionally, and ``state_dict``/``load_state_dict``.
        on_batch: ``on_batch(batch)`` called on every collected batch before the reward (e.g. pairs
            to queue); may return a new batch.
        normalize, threshold: passed to :class:`~torchrl_oni.transforms.IntrinsicRewardTransform`.
        stateful: further objects with ``state_dict``/``load_state_dict`` kept in checkpoints, by name.
        metrics: ``metrics() -> dict`` of type-specific numbers for the logs.
        close: called once at the end of the run.
        env_transforms: TorchRL transforms appended to every env worker's env (and the env the
            networks are built from): observations the policy must see at acting time, e.g.
            ELLM's goal embedding. They must be picklable.
        after_reward: the type's own step after the reward on every batch (RUNE's bonus,
            :mod:`~torchrl_oni.train.reward_types._rune`): ``after_reward(batch) -> batch``,
            ``after_update()`` after each PPO iteration, ``metrics() -> dict``, and
            ``state_dict``/``load_state_dict`` kept in checkpoints under its ``name``.
    """

    reward: Optional[Callable] = None
    trainer: Any = None
    on_batch: Optional[Callable] = None
    normalize: bool = False
    threshold: Optional[float] = None
    stateful: Optional[Dict[str, Any]] = None
    metrics: Optional[Callable[[], Dict[str, float]]] = None
    close: Optional[Callable[[], None]] = None
    env_transforms: Sequence[Any] = ()
    after_reward: Any = None


@dataclass(frozen=True)
class RewardType:
    """One registered reward type: its name, ``build`` and declaration (see the module docstring)."""

    name: str
    build: Callable[[RewardContext], RewardParts]
    help: str = ""
    labels: bool = False
    pairs: bool = False
    settings: Optional[type] = None
    check: Optional[Callable[[Any], None]] = None
    llm: bool = False
    reward_model: bool = False

    @property
    def needs_annotator(self) -> bool:
        return self.labels or self.pairs


_REGISTRY: Dict[str, RewardType] = {}  # read through the package, which fills it first
_LOCK = threading.RLock()


def register_reward(name: str, *, help: str = "", labels: bool = False, pairs: bool = False, llm: bool = False,
                    reward_model: bool = False, settings: Optional[type] = None,
                    check: Optional[Callable[[Any], None]] = None):
    """Decorator registering ``build`` as the reward type ``name`` (see the module docstring)."""
    if name == "none" or not name.replace("-", "").isalnum():
        raise ValueError(f"invalid reward type name {name!r}")

    def decorate(build: Callable[[RewardContext], RewardParts]):
        existing = _REGISTRY.get(name)
        if existing is not None and existing.build.__qualname__ != build.__qualname__:
            raise ValueError(f"reward type {name!r} is registered twice")
        if settings is not None and getattr(settings, "PREFIX", None) != name.replace("-", "_"):
            raise ValueError(f"settings of reward type {name!r} need PREFIX = {name.replace('-', '_')!r}")
        _REGISTRY[name] = RewardType(name, build, help, labels, pairs, settings, check, llm, reward_model)
        return build

    return decorate

