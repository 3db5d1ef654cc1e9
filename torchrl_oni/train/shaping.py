"""The reward PPO optimises, written on each update's batch from the ``reward`` section.

``("next", "reward") = extrinsic_coeff · clip(r_env) + intrinsic_coeff · r_int`` (TorchRL's
transform :class:`~torchrl_oni.transforms.CombineRewards`; the env's own reward stays in
``("next", "extrinsic_reward")``), then ``--death-penalty`` on the step an agent dies and
``--survival-bonus`` on every other step. With two value heads the weighted terms are kept as two
streams, and the survival terms go to the game's stream: staying alive is about the game, not the
captions.

Example:
    >>> import torch
    >>> from tensordict import TensorDict
    >>> from torchrl_oni.train.config import RewardConfig
    >>> shaping = RewardShaping(RewardConfig(extrinsic_coeff=0.1, intrinsic_coeff=0.5, death_penalty=1.0))
    >>> batch = TensorDict({"next": {"reward": torch.tensor([[20.0], [1.0]]),
    ...                              "intrinsic_reward": torch.tensor([[1.0], [0.0]]),
    ...                              "episode": {"end_status": torch.tensor([[0], [1]])}}}, [2])
    >>> shaping(batch).get(("next", "reward")).squeeze(-1)  # 0.1·clip(20, ±10) + 0.5·1; 0.1·1 − 1 (died)
    tensor([ 1.5000, -0.9000])
"""
from __future__ import annotations

from tensordict import TensorDictBase

from ..envs.tasks import STATUS_DEATH
from ..rewards.scaling import survival_terms
from ..transforms import CombineRewards

__all__ = ["RewardShaping"]


class RewardShaping:
    """Writes the reward PPO optimises on a collected batch (in place; returns it).

    Args:
        reward: the ``reward`` section (``extrinsic_coeff``, ``intrinsic_coeff``, ``extrinsic_clip``,
            ``death_penalty``, ``survival_bonus``), resolved: ``intrinsic_coeff`` is a number.
        value_heads: 2 keeps the extrinsic and intrinsic streams for a critic with a head per
            stream (``--value-heads``).
    """

    def __init__(self, reward, value_heads: int = 1):
        self.streams = value_heads == 2
        self.mix = CombineRewards(reward.extrinsic_coeff, reward.intrinsic_coeff, reward.extrinsic_clip or None,
                                  streams=self.streams)
        self.death_penalty, self.survival_bonus = reward.death_penalty, reward.survival_bonus

    def __call__(self, batch: TensorDictBase) -> TensorDictBase:
        batch = self.mix(batch)
        if self.death_penalty or self.survival_bonus:
            nxt = batch.get("next")
            reward = nxt.get("reward")
            died = nxt.get(("episode", "end_status")).reshape(reward.shape) == STATUS_DEATH
            terms = survival_terms(died, self.death_penalty, self.survival_bonus).to(reward.dtype)
            nxt.set("reward", reward + terms)
            if self.streams:
                nxt.set("reward_ext", nxt.get("reward_ext") + terms)
        return batch
