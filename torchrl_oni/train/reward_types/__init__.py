"""oni-train's intrinsic reward types: one module each, registered by name.

Each module of this package registers one type (:func:`register_reward`): its settings (the
config section ``reward.<name>`` and flags ``--<name>-<field>``), its checks, and how it is
built from the run's configuration out of the reward classes of :mod:`torchrl_oni.rewards`.
The registry itself is :mod:`~torchrl_oni.train.reward_types._registry`; this package imports
each module the first time the registry is read (:func:`reward_types`). The configuration
(:mod:`torchrl_oni.train.config`) reads it for the ``--intrinsic-reward`` choices, the reward
sections and the types that train a reward model, and the run's builder
(:func:`~torchrl_oni.train.build.build_intrinsic_hook`) for what to provide and what to build.

==================  ====================================================================
module              reward type
==================  ====================================================================
``retrieval``       ONI-Retrieval: the LLM's label of the caption itself
``classification``  ONI-Classification: a classifier (or an ensemble, SURF) distils labels
``ranking``         ONI-Ranking: a Bradley–Terry model (or an ensemble) of preferences
``motif``           offline Motif: a frozen reward model trained beforehand
``bow``             ELLM-BoW: bag-of-words cosine with a goal sentence
``ellm``            ELLM: goals suggested per state, paid when a message matches one
==================  ====================================================================

Adding a reward type is one new module here (see docs/design.md).

Example:
    >>> from torchrl_oni.train.reward_types import reward_names
    >>> reward_names()
    ('none', 'bow', 'classification', 'ellm', 'motif', 'ranking', 'retrieval')
"""
import importlib
import pkgutil
from typing import Dict, Tuple

from torchrl_oni.train.reward_types._registry import (
    _LOCK,
    _REGISTRY,
    LLMEndpoint,
    RewardContext,
    RewardParts,
    RewardType,
    register_reward,
)

__all__ = ["RewardType", "RewardParts", "RewardContext", "LLMEndpoint", "register_reward", "reward_types",
           "reward_names", "model_rewards"]

_DISCOVERED = False


def _discover() -> None:
    # Done here, by the package, not by the registry: each module imports the registry to
    # register its type, so the imports run one way (package -> its modules -> registry).
    global _DISCOVERED
    with _LOCK:
        if _DISCOVERED:
            return
        # the package's __path__ at call time, so that a directory appended to it counts too
        for module in pkgutil.iter_modules(__path__):
            if not module.name.startswith("_"):
                importlib.import_module(f"{__name__}.{module.name}")
        _DISCOVERED = True


def reward_types() -> Dict[str, RewardType]:
    """Every registered reward type by name (each module of this package imported first)."""
    _discover()
    return dict(_REGISTRY)


def reward_names() -> Tuple[str, ...]:
    """``("none", ...)`` followed by the registered types, sorted."""
    return ("none",) + tuple(sorted(reward_types()))


def model_rewards() -> Tuple[str, ...]:
    """The registered types that train a reward model (declared ``reward_model``), sorted."""
    return tuple(sorted(name for name, spec in reward_types().items() if spec.reward_model))
