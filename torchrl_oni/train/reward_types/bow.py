"""oni-train's ``bow`` reward type: ELLM-BoW, the bag-of-words cosine between a caption and the
goal sentence of ``--goal`` (:class:`~torchrl_oni.rewards.bow.BoWReward`), no LLM."""
from dataclasses import dataclass
from typing import Literal

from torchrl_oni.config_tree import setting
from torchrl_oni.rewards.bow import GOAL_SENTENCES, BoWReward
from torchrl_oni.rewards.text import make_vectors
from torchrl_oni.train.reward_types._registry import RewardParts, register_reward


@dataclass
class BowSettings:
    PREFIX = "bow"
    threshold: float = setting(-0.5, "cosines at or below this pay 0")
    vectors: Literal["auto", "minilm", "sentence", "hashed"] = setting(
        "auto", "word vectors: minilm (all-MiniLM-L6-v2's token table), sentence (the full MiniLM sentence "
        "encoder; slower, not better on our labelled messages), hashed (no weights), auto (minilm if installed)")


def _check(cfg) -> None:
    if cfg.annotation.goal not in GOAL_SENTENCES:
        raise ValueError(f"--intrinsic-reward bow needs a goal sentence; --goal {cfg.annotation.goal} has none")


@register_reward("bow", settings=BowSettings, check=_check,
                 help="ELLM-BoW: bag-of-words cosine between the caption and a goal sentence, no LLM")
def _build(ctx) -> RewardParts:
    settings = ctx.settings
    vectors = make_vectors(settings.vectors)
    return RewardParts(BoWReward(GOAL_SENTENCES[ctx.cfg.annotation.goal], vectors=vectors,
                                 threshold=settings.threshold))
