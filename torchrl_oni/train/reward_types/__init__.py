"""oni-train's intrinsic reward types: one module each, registered by name.

Each module of this package registers one type (:func:`register_reward`): its settings (the
config section ``reward.<name>`` and flags ``--<name>-<field>``), its checks, and how it is
built from the run's configuration out of the reward classes of :mod:`torchrl_oni.rewards`.
The registry itself is :mod:`~torchrl_oni.train.reward_types._registry`; the configuration
(:mod:`torchrl_oni.train.config`) reads it for the ``--intrinsic-reward`` choices, the reward
sections and the types that train a reward model, and the trainer's hook
(:mod:`torchrl_oni.train.intrinsic`) for what to provide and what to build.

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
from torchrl_oni.train.reward_types._registry import (
    LLMEndpoint,
    RewardContext,
    RewardParts,
    RewardType,
    model_rewards,
    register_reward,
    reward_names,
    reward_types,
)

__all__ = ["RewardType", "RewardParts", "RewardContext", "LLMEndpoint", "register_reward", "reward_types",
           "reward_names", "model_rewards"]
