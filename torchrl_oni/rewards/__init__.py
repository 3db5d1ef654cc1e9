"""Intrinsic reward sources of ONI and its baselines, their networks, trainers and scaling.

Every reward source is called as ``reward(messages uint8[N, 256], hashes int64[N]) ->
float32[N]`` and returns the reward *before* the per-episode count decay
(:func:`~torchrl_oni.rewards.scaling.count_scale`) and the mixing coefficients
(:func:`~torchrl_oni.rewards.scaling.combine_rewards`).

* ``online_cls`` (ONI-Retrieval): :class:`RetrievalReward`; store needs ``lookup(hashes)``.
* ``online_cls_reward_model`` (ONI-Classification): :class:`ClassificationReward` trained by
  :class:`ClassifierTrainer`; store needs ``labelled()``.
* ``online_motif`` (ONI-Ranking): :class:`RankingReward` trained by :class:`RankingTrainer`;
  store needs ``sample_labelled_pairs(n)``; pairs to annotate come from
  :class:`UniqueCaptionPairSampler`.
* ``motif`` (offline Motif): :class:`MotifReward` from a :func:`train_reward_model` checkpoint.
* ``cosine-bow`` (ELLM-BoW): :class:`BoWReward`.
* ensembles of the online reward models (:mod:`~torchrl_oni.rewards.ensemble`):
  :class:`ClassifierEnsemble` / :class:`EnsembleClassifierTrainer` (with :class:`SURF`
  pseudo-labels), :class:`RankingEnsemble` / :class:`EnsembleRankingTrainer`, and RUNE's
  exploration bonus :class:`RUNEBonus` / :func:`torchrl_oni.transforms.rune_transform`.

Shared pieces: the reward-model schedule, holdout and labelled arrays
(:mod:`~torchrl_oni.rewards.training`), word vectors and sentence encoders
(:mod:`~torchrl_oni.rewards.text`). This package is the library only: how ``oni-train``
configures and builds each reward type is in :mod:`torchrl_oni.train.reward_types`.

Example:
    >>> import torch
    >>> from torchrl_oni.rewards import count_scale
    >>> count_scale(torch.ones(3), torch.tensor([1, 2, 3]), beta=3.0)
    tensor([1.0000, 0.1250, 0.0370])
"""
from torchrl_oni.rewards.bow import BoWReward
from torchrl_oni.rewards.classification import ClassificationReward, ClassifierTrainer, LabelledCaptions
from torchrl_oni.rewards.ensemble import (
    SURF,
    ClassifierEnsemble,
    EnsembleClassifierTrainer,
    EnsembleRankingTrainer,
    RankingEnsemble,
    RUNEBonus,
    bootstrap_counts,
)
from torchrl_oni.rewards.models import MessageClassifier, MessageEncoder, MessageRewardModel
from torchrl_oni.rewards.motif import (
    MotifReward,
    annotate_pairs,
    annotate_pairs_async,
    collect_frequency_pairs,
    collect_pairs,
    store_captions,
    train_reward_model,
)
from torchrl_oni.rewards.ranking import (
    LabelledPairs,
    PairQueue,
    RankingReward,
    RankingTrainer,
    UniqueCaptionPairSampler,
    bradley_terry_loss,
)
from torchrl_oni.rewards.retrieval import LabelLookup, RetrievalReward
from torchrl_oni.rewards.scaling import RunningMeanStd, combine_rewards, count_scale, threshold
from torchrl_oni.rewards.text import HashedWordVectors, MiniLMTokenVectors
from torchrl_oni.rewards.training import RewardModelSchedule, holdout_mask

__all__ = [
    "BoWReward",
    "HashedWordVectors",
    "MiniLMTokenVectors",
    "ClassificationReward",
    "ClassifierTrainer",
    "LabelledCaptions",
    "RewardModelSchedule",
    "holdout_mask",
    "ClassifierEnsemble",
    "EnsembleClassifierTrainer",
    "EnsembleRankingTrainer",
    "RankingEnsemble",
    "RUNEBonus",
    "SURF",
    "bootstrap_counts",
    "MessageClassifier",
    "MessageEncoder",
    "MessageRewardModel",
    "MotifReward",
    "annotate_pairs",
    "annotate_pairs_async",
    "collect_pairs",
    "collect_frequency_pairs",
    "store_captions",
    "train_reward_model",
    "LabelledPairs",
    "PairQueue",
    "RankingReward",
    "RankingTrainer",
    "UniqueCaptionPairSampler",
    "bradley_terry_loss",
    "LabelLookup",
    "RetrievalReward",
    "RunningMeanStd",
    "combine_rewards",
    "count_scale",
    "threshold",
]
