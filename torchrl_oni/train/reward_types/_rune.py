"""RUNE's exploration bonus as a reward type's own batch step (``RewardParts.after_reward``).

The reward types that train a reward model (classification, ranking) attach it with
:func:`rune_step` when ``--rm-rune-beta`` is above 0 (the configuration allows that only with an
ensemble): after the intrinsic reward is written, the bonus ``B_t · std_m(prediction_m(caption))``,
count-decayed like the reward (:func:`~torchrl_oni.transforms.rune_transform`), is **added to**
``("next", "intrinsic_reward")``, logged apart (``intrinsic/rune_bonus``, ``intrinsic/rune_beta``),
and ``B_t`` shrinks after every PPO iteration. Its checkpoint state (the decay's step) is kept
under ``"rune"``.
"""
from torchrl_oni.captions import INTRINSIC_REWARD_KEY

__all__ = ["RuneStep", "rune_step"]


class RuneStep:
    """The batch step of RUNE (see the module docstring).

    Attributes:
        reward: the :class:`~torchrl_oni.rewards.ensemble.RUNEBonus` (``beta``, ``step()``).
        out_key: where the bonus alone is written, under ``"next"``.
    """

    name = "rune"  # its key in the hook's checkpoint state

    def __init__(self, ensemble, beta0: float, decay: float, *, message: str, count_beta: float):
        from torchrl_oni.transforms import rune_transform

        self.transform = rune_transform(ensemble, beta0, decay, message=message, count_beta=count_beta)
        self.reward = self.transform.reward
        self.out_key = self.transform.out_key
        self._sum, self._steps = 0.0, 0

    def __call__(self, batch):
        """Adds the bonus to ``("next", "intrinsic_reward")`` (before the trainer mixes rewards)."""
        batch = self.transform(batch)
        bonus = batch.get(("next", self.out_key))
        key = ("next", INTRINSIC_REWARD_KEY)
        batch.set(key, batch.get(key) + bonus)
        self._sum += float(bonus.sum())
        self._steps += bonus.numel()
        return batch

    def after_update(self) -> None:
        """The bonus's scale decays once per PPO iteration."""
        self.reward.step()

    def metrics(self) -> dict:
        """``intrinsic/rune_beta`` and, when steps were paid since the last call, ``intrinsic/rune_bonus``."""
        out = {"intrinsic/rune_beta": self.reward.beta}
        if self._steps:
            out["intrinsic/rune_bonus"] = self._sum / self._steps
        self._sum, self._steps = 0.0, 0
        return out

    def state_dict(self) -> dict:
        return self.reward.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.reward.load_state_dict(state)


def rune_step(ctx, reward):
    """A :class:`RuneStep` on ``reward`` (an ensemble) when ``--rm-rune-beta`` is above 0, else None."""
    rm = ctx.cfg.reward_model
    if rm.rune_beta <= 0:
        return None
    return RuneStep(reward, rm.rune_beta, rm.rune_decay, message=ctx.cfg.reward.reward_message,
                    count_beta=ctx.cfg.reward.count_exponent)
