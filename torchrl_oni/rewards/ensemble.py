"""Ensembles of reward models, SURF pseudo-labels and RUNE exploration bonuses.

An ensemble is N independent reward models of the same kind — :class:`ClassifierEnsemble` of
:class:`~torchrl_oni.rewards.classification.ClassificationReward`, :class:`RankingEnsemble` of
:class:`~torchrl_oni.rewards.ranking.RankingReward` — each with its own initial weights (seeded)
and its own **bootstrap resample** of the labelled set. Their mean is the reward; the spread of
their predictions says where labels are most needed (:mod:`torchrl_oni.queries`) and, with RUNE,
where the agent should explore.

Each member is trained by the existing trainer classes
(:class:`~torchrl_oni.rewards.classification.ClassifierTrainer`,
:class:`~torchrl_oni.rewards.ranking.RankingTrainer`) reading the store through a bootstrap view;
with SURF, :class:`EnsembleClassifierTrainer` runs the same steps with pseudo-labelled captions
added to each batch. The bootstrap, SURF and the two ensemble trainers are written in
:mod:`torchrl_oni.rewards._ensemble_training`; import them from here.

Contracts (N messages, M members, K pairs):

===================================  ==================  ========================================
call                                 returns             meaning
===================================  ==================  ========================================
``ens(messages, hashes)``            float32[N]          the reward, before count scaling
``ens.member_predictions(messages)`` float32[N, M]       P(helpful) (classifier) or raw score g(m)
                                                         (ranking) of each member
``ens.member_probabilities(msgs)``   float32[N, M]       classifier only: P(helpful) per member
``ens.pair_probabilities(a, b)``     float32[K, M]       ranking: P_m(b better) (Bradley–Terry)
``bootstrap_counts(hashes, m)``      int64[N]            Poisson(1) copies of each item for member m
``surf_augment(...)``                TensorDict[B + U]   ``message``, ``target``, ``weight``, ``pseudo``
``RUNEBonus(ens)(messages, hashes)`` float32[N]          β_t · std over members of the predictions
===================================  ==================  ========================================

**Bootstrap.** Member m sees each labelled caption ``c ~ Poisson(1)`` times, with ``c`` a
deterministic function of the caption hash and m (the online bootstrap of Oza & Russell): the
resample stays the same as labels arrive, needs no memory, and is the same in every process.
Captions of the held-out slice (:func:`~torchrl_oni.rewards.training.holdout_mask`) keep
one copy each, so every member's held-out evaluation is unchanged.

**SURF** (Park et al., 2022): an unlabelled caption whose ensemble-mean P(helpful) is ≥ τ or
≤ 1 − τ joins the batch with that pseudo-label; the loss is
``CE_labelled + λ · mean CE_pseudo``.

**RUNE** (Liang et al., 2022): an exploration bonus ``β_t · std_m(prediction_m(caption))`` with
``β_t = β₀ (1 − ρ)^t``, ``t`` counting :meth:`RUNEBonus.step` calls (one per PPO iteration).
:func:`torchrl_oni.transforms.rune_transform` writes it to ``("next", "rune_bonus")``, apart from the intrinsic reward,
so it is logged on its own; the trainer adds it to the reward it optimises.

Example:
    >>> import torch
    >>> from torchrl_oni.rewards.ensemble import ClassifierEnsemble, RUNEBonus
    >>> ens = ClassifierEnsemble(size=3, seed=0)
    >>> msgs = torch.zeros(4, 256, dtype=torch.uint8)
    >>> ens.member_probabilities(msgs).shape, ens(msgs, torch.zeros(4, dtype=torch.int64)).shape
    (torch.Size([4, 3]), torch.Size([4]))
    >>> rune = RUNEBonus(ens, beta0=0.05, decay=0.5)
    >>> rune.step(2); rune.beta
    0.0125
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import torch
from torch import nn

from torchrl_oni.queries import pair_member_probs
from torchrl_oni.rewards._ensemble_training import (
    SURF,
    EnsembleClassifierTrainer,
    EnsembleRankingTrainer,
    bootstrap_counts,
    surf_augment,
    surf_loss,
)
from torchrl_oni.rewards.classification import ClassificationReward
from torchrl_oni.rewards.models import MessageClassifier, MessageRewardModel
from torchrl_oni.rewards.ranking import RankingReward
from torchrl_oni.rewards.scaling import RunningMeanStd

__all__ = [
    "bootstrap_counts",
    "ClassifierEnsemble",
    "RankingEnsemble",
    "EnsembleClassifierTrainer",
    "EnsembleRankingTrainer",
    "SURF",
    "surf_augment",
    "surf_loss",
    "RUNEBonus",
    "RUNE_BONUS_KEY",
]

RUNE_BONUS_KEY = "rune_bonus"


def _seeded(factory: Callable[[], nn.Module], seed: int) -> nn.Module:
    """Builds a module under ``seed`` without touching the global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return factory()


# ---------------------------------------------------------------------------------------- ensembles
class _Ensemble:
    members: list

    def __len__(self) -> int:
        return len(self.members)

    def member_predictions(self, messages) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def disagreement(self, messages) -> torch.Tensor:
        """``float32[N]``: std over members of :meth:`member_predictions` (population std)."""
        return self.member_predictions(messages).std(dim=-1, unbiased=False)

    def state_dict(self) -> dict:
        return {"members": [m.state_dict() for m in self.members]}

    def load_state_dict(self, state: dict) -> None:
        if len(state["members"]) != len(self.members):
            raise ValueError(f"state has {len(state['members'])} members, this ensemble {len(self.members)}")
        for member, member_state in zip(self.members, state["members"]):
            member.load_state_dict(member_state)


class ClassifierEnsemble(_Ensemble):
    """N :class:`ClassificationReward` members; the reward is ``1[mean P(helpful) > threshold]``.

    Args:
        members: the members (built from ``size`` and ``seed`` when omitted).
        size (int): number of members to build. Default 5.
        threshold (float): decision threshold on the members' mean P(helpful) (0.5 as in ONI).
        seed (int): member ``i`` is initialised under seed ``seed * 7919 + i``.
        device: where inference runs.
        dropout (float): the classifiers' dropout.

    Example:
        >>> import torch
        >>> ens = ClassifierEnsemble(size=2, seed=1)
        >>> p = ens.member_probabilities(torch.zeros(1, 256, dtype=torch.uint8))
        >>> bool(p[0, 0] != p[0, 1])        # different initial weights
        True
    """

    def __init__(
        self,
        members: Optional[Sequence[ClassificationReward]] = None,
        *,
        size: int = 5,
        threshold: float = 0.5,
        seed: int = 0,
        device: Optional[torch.device] = None,
        dropout: float = 0.1,
    ):
        if members is None:
            if size < 1:
                raise ValueError(f"size must be >= 1, got {size}")
            members = [
                ClassificationReward(_seeded(lambda: MessageClassifier(dropout), seed * 7919 + i),
                                     threshold=threshold, device=device)
                for i in range(size)
            ]
        self.members: List[ClassificationReward] = list(members)
        if not self.members:
            raise ValueError("an ensemble needs at least one member")
        self.threshold = float(threshold)

    def member_probabilities(self, messages) -> torch.Tensor:
        """``float32[N, M]``: each member's P(helpful)."""
        return torch.stack([m.helpful_probability(messages) for m in self.members], dim=-1)

    member_predictions = member_probabilities

    def helpful_probability(self, messages) -> torch.Tensor:
        """``float32[N]``: the members' mean P(helpful)."""
        return self.member_probabilities(messages).mean(dim=-1)

    def __call__(self, messages: torch.Tensor, hashes: torch.Tensor) -> torch.Tensor:
        """``(uint8[N,256], int64[N]) -> float32[N]`` in {0, 1}, before count scaling."""
        return (self.helpful_probability(messages) > self.threshold).float()

    def state_dict(self) -> dict:
        return {**super().state_dict(), "threshold": self.threshold}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.threshold = float(state.get("threshold", self.threshold))


class RankingEnsemble(_Ensemble):
    """N :class:`RankingReward` members; the reward is the normalised, thresholded mean score.

    ``z = (mean_m g_m(m) − running_mean) / running_std``, ``R = z · 1[z > threshold]`` — the
    recipe of :class:`RankingReward` applied to the members' mean score (with its own running
    statistics; each member's raw score is used, not its own normalisation).

    Args:
        members: the members (built from ``size`` and ``seed`` when omitted).
        size (int): number of members to build. Default 5.
        threshold, normalize, update_stats: as in :class:`RankingReward`.
        seed (int): member ``i`` is initialised under seed ``seed * 7919 + i``.
        device: where inference runs.

    Example:
        >>> import torch
        >>> ens = RankingEnsemble(size=3)
        >>> a, b = torch.zeros(2, 256, dtype=torch.uint8), torch.ones(2, 256, dtype=torch.uint8)
        >>> ens.pair_probabilities(a, b).shape
        torch.Size([2, 3])
    """

    def __init__(
        self,
        members: Optional[Sequence[RankingReward]] = None,
        *,
        size: int = 5,
        threshold: float = -0.5,
        normalize: bool = True,
        update_stats: bool = True,
        seed: int = 0,
        device: Optional[torch.device] = None,
    ):
        if members is None:
            if size < 1:
                raise ValueError(f"size must be >= 1, got {size}")
            members = [
                RankingReward(_seeded(MessageRewardModel, seed * 7919 + i), threshold=threshold,
                              normalize=False, device=device)
                for i in range(size)
            ]
        self.members: List[RankingReward] = list(members)
        if not self.members:
            raise ValueError("an ensemble needs at least one member")
        self.threshold = float(threshold)
        self.normalize = bool(normalize)
        self.update_stats = bool(update_stats)
        self.stats = RunningMeanStd()

    def member_scores(self, messages) -> torch.Tensor:
        """``float32[N, M]``: each member's raw score ``g_m(m)``."""
        return torch.stack([m.scores(messages) for m in self.members], dim=-1)

    member_predictions = member_scores

    def scores(self, messages) -> torch.Tensor:
        """``float32[N]``: the members' mean raw score."""
        return self.member_scores(messages).mean(dim=-1)

    def pair_probabilities(self, first, second) -> torch.Tensor:
        """``float32[K, M]``: each member's P(second is better) (Bradley–Terry)."""
        return pair_member_probs(self.member_scores(first), self.member_scores(second)).float()

    # RankingReward's recipe on the members' mean score: it reads only scores(), normalize,
    # update_stats, stats and threshold, which this class has with the same meaning
    __call__ = RankingReward.__call__

    def state_dict(self) -> dict:
        return {**super().state_dict(), "stats": self.stats.state_dict(), "threshold": self.threshold}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.stats.load_state_dict(state["stats"])
        self.threshold = float(state.get("threshold", self.threshold))


# ---------------------------------------------------------------------------------------- RUNE
class RUNEBonus:
    """RUNE's exploration bonus as a reward source: ``β_t · std_m(prediction_m(caption))``.

    ``β_t = β₀ (1 − ρ)^t``; ``t`` counts :meth:`step` calls (the trainer calls it once per PPO
    iteration). Predictions are :meth:`member_predictions` of the ensemble: P(helpful) for a
    :class:`ClassifierEnsemble`, raw scores for a :class:`RankingEnsemble`.

    Args:
        ensemble: a :class:`ClassifierEnsemble` or :class:`RankingEnsemble`.
        beta0 (float): initial scale β₀ (0.05 in CleanRLHF).
        decay (float): ρ in [0, 1) per step (1e-4 in CleanRLHF).

    Example:
        >>> import torch
        >>> class TwoMembers:
        ...     def member_predictions(self, messages):
        ...         return torch.tensor([[0.0, 1.0], [0.5, 0.5]])
        >>> RUNEBonus(TwoMembers(), beta0=0.2)(torch.zeros(2, 256, dtype=torch.uint8), None).tolist()
        [0.10000000149011612, 0.0]
    """

    def __init__(self, ensemble, beta0: float = 0.05, decay: float = 1e-4):
        if beta0 < 0:
            raise ValueError(f"beta0 must be >= 0, got {beta0}")
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay}")
        self.ensemble = ensemble
        self.beta0 = float(beta0)
        self.decay = float(decay)
        self.t = 0

    @property
    def beta(self) -> float:
        """The current scale ``β₀ (1 − ρ)^t``."""
        return self.beta0 * (1.0 - self.decay) ** self.t

    def step(self, n: int = 1) -> None:
        """Advances the decay by ``n`` steps."""
        self.t += int(n)

    def __call__(self, messages: torch.Tensor, hashes: Optional[torch.Tensor]) -> torch.Tensor:
        """``(uint8[N,256], int64[N]) -> float32[N]``."""
        preds = torch.as_tensor(self.ensemble.member_predictions(messages), dtype=torch.float32)
        return (self.beta * preds.std(dim=-1, unbiased=False)).float()

    def state_dict(self) -> dict:
        return {"t": self.t, "beta0": self.beta0, "decay": self.decay}

    def load_state_dict(self, state: dict) -> None:
        self.t = int(state["t"])
