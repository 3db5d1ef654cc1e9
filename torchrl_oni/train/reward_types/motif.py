"""oni-train's ``motif`` reward type: offline Motif, a frozen reward model trained beforehand on
LLM preferences (:class:`~torchrl_oni.rewards.motif.MotifReward` from an ``oni-train-reward``
checkpoint)."""
from dataclasses import dataclass
from typing import Optional

from torchrl_oni.config_tree import setting
from torchrl_oni.rewards.motif import MotifReward
from torchrl_oni.train.reward_types._registry import RewardParts, register_reward


@dataclass
class MotifSettings:
    PREFIX = "motif"
    reward_model: Optional[str] = setting(None, "reward-model checkpoint written by oni-train-reward",
                                          aliases=("--reward-model",), metavar="PATH")
    quantile: float = setting(0.5, "threshold quantile of the reward model's scores, 0.05..0.95")


def _check(cfg) -> None:
    if not cfg.reward.motif.reward_model:
        raise ValueError("--intrinsic-reward motif needs --reward-model PATH (a checkpoint from oni-train-reward)")


@register_reward("motif", settings=MotifSettings, check=_check,
                 help="offline Motif: a frozen reward model trained on LLM preferences collected beforehand")
def _build(ctx) -> RewardParts:
    return RewardParts(MotifReward(ctx.settings.reward_model, quantile=ctx.settings.quantile, device=ctx.device))
