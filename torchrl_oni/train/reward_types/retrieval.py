"""oni-train's ``retrieval`` reward type: ONI-Retrieval, the LLM's label of the caption itself
(:class:`~torchrl_oni.rewards.retrieval.RetrievalReward` on the run's caption store)."""
from torchrl_oni.rewards.retrieval import RetrievalReward
from torchrl_oni.train.reward_types._registry import RewardParts, register_reward


@register_reward("retrieval", labels=True, help="ONI-Retrieval: the LLM's label of the caption itself")
def _build(ctx) -> RewardParts:
    return RewardParts(RetrievalReward(ctx.store))
