"""oni-train's ``classification`` reward type: ONI-Classification, a classifier distils the
labels and pays when sure; with ``--rm-ensemble`` (or SURF) an ensemble of classifiers
(:mod:`torchrl_oni.rewards.classification`, :mod:`torchrl_oni.rewards.ensemble`)."""
from dataclasses import dataclass

from torchrl_oni.config_tree import setting
from torchrl_oni.rewards.classification import ClassificationReward, ClassifierTrainer
from torchrl_oni.rewards.ensemble import SURF, ClassifierEnsemble, EnsembleClassifierTrainer
from torchrl_oni.train.reward_types._registry import RewardParts, register_reward
from torchrl_oni.train.reward_types._rune import rune_step


@dataclass
class ClassificationSettings:
    PREFIX = "classification"
    threshold: float = setting(0.5, "pay 1 when the classifier's P(helpful) exceeds this")


@register_reward("classification", labels=True, reward_model=True, settings=ClassificationSettings,
                 help="ONI-Classification: a classifier distils the labels and pays when sure")
def _build(ctx) -> RewardParts:
    """One classifier, or with ``--rm-ensemble N`` (or SURF, ``--rm-surf-tau``) a
    :class:`~torchrl_oni.rewards.ensemble.ClassifierEnsemble` of N trained on bootstrap resamples,
    paying ``1[mean P(helpful) > threshold]``; RUNE's bonus (``--rm-rune-beta``) as its batch step."""
    rm = ctx.cfg.reward_model
    kwargs = dict(lr=rm.lr, batch_size=rm.batch_size, schedule=ctx.schedule, seed=ctx.cfg.seed)
    if rm.ensemble > 1 or rm.surf_tau > 0:
        reward = ClassifierEnsemble(size=rm.ensemble, threshold=ctx.settings.threshold, seed=ctx.cfg.seed,
                                    device=ctx.device)
        surf = SURF(tau=rm.surf_tau, lam=rm.surf_lambda) if rm.surf_tau > 0 else None
        return RewardParts(reward, trainer=EnsembleClassifierTrainer(reward, ctx.store, surf=surf, **kwargs),
                           after_reward=rune_step(ctx, reward))
    reward = ClassificationReward(threshold=ctx.settings.threshold, device=ctx.device)
    return RewardParts(reward, trainer=ClassifierTrainer(reward, ctx.store, **kwargs),
                       after_reward=rune_step(ctx, reward))
