"""oni-train's ``ranking`` reward type: ONI-Ranking, a Bradley–Terry model of pairwise
preferences (or, with ``--rm-ensemble``, an ensemble of them), with the caption pairs to label
queued on every collected batch (:mod:`torchrl_oni.rewards.ranking`,
:mod:`torchrl_oni.rewards.ensemble`)."""
from dataclasses import dataclass

from torchrl_oni.queries import LabelBudget, pair_member_probs
from torchrl_oni.config_tree import setting
from torchrl_oni.rewards.ensemble import EnsembleRankingTrainer, RankingEnsemble
from torchrl_oni.rewards.ranking import PairQueue, RankingReward, RankingTrainer
from torchrl_oni.train.reward_types._registry import RewardParts, register_reward
from torchrl_oni.train.reward_types._rune import rune_step


@dataclass
class RankingSettings:
    PREFIX = "ranking"
    threshold: float = setting(-0.5, "cut on the normalised ranking score")
    raw: bool = setting(False, "pay the raw ranking score, as ONI's code did by accident")
    pairs: int = setting(10, "caption pairs queued per collected batch (ONI: 10)")


def _check(cfg) -> None:
    if cfg.reward.ranking.pairs < 1:
        raise ValueError("--ranking-pairs must be at least 1")


@register_reward("ranking", pairs=True, reward_model=True, settings=RankingSettings, check=_check,
                 help="ONI-Ranking: a Bradley-Terry model of pairwise preferences")
def _build(ctx) -> RewardParts:
    """One Bradley–Terry model, or with ``--rm-ensemble N`` a
    :class:`~torchrl_oni.rewards.ensemble.RankingEnsemble` (the members' mean raw score);
    pairs queued by :class:`~torchrl_oni.rewards.ranking.PairQueue` under ``--query-selection``
    and ``--label-budget``; RUNE's bonus (``--rm-rune-beta``) as its batch step."""
    settings, store, cfg = ctx.settings, ctx.store, ctx.cfg
    rm, ann = cfg.reward_model, cfg.annotation
    # raw scores here; the transform normalises (frequency-weighted running statistics over every
    # step, as ONI) and thresholds them after de-duplicating the batch
    if rm.ensemble > 1:
        reward = RankingEnsemble(size=rm.ensemble, normalize=False, seed=cfg.seed, device=ctx.device)
        trainer = EnsembleRankingTrainer(reward, store, seed=cfg.seed, lr=rm.lr, batch_size=rm.batch_size,
                                         schedule=ctx.schedule)
        pair_probabilities = reward.pair_probabilities
    else:
        reward = RankingReward(normalize=False, device=ctx.device)
        trainer = RankingTrainer(reward, store, lr=rm.lr, batch_size=rm.batch_size, schedule=ctx.schedule)

        def pair_probabilities(first, second):
            return pair_member_probs(reward.scores(first)[:, None], reward.scores(second)[:, None])

    budget = None
    if ann.label_budget is not None:
        budget = LabelBudget(ann.label_budget, ann.label_schedule, total_frames=cfg.frames)
    queue = PairQueue(store, pairs=settings.pairs, backlog_limit=2 * ann.llm_batch_size, rule=ann.query_selection,
                      pair_probabilities=pair_probabilities, budget=budget, wake=ctx.wake_annotator, seed=cfg.seed)
    normalize = not settings.raw
    return RewardParts(reward, trainer=trainer, on_batch=queue, normalize=normalize,
                       threshold=settings.threshold if normalize else None,
                       stateful={"sampler": queue.sampler, "pair_queue": queue}, metrics=queue.metrics,
                       after_reward=rune_step(ctx, reward))
