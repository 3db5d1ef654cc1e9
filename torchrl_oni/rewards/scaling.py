"""Turning raw intrinsic rewards into the reward PPO sees: count decay, normalisation, mixing.

ONI (oni_spec §1.4) feeds V-trace

    r_t = extrinsic_coeff * r_ext_t + intrinsic_coeff * R(m_t) * msg_count_t ** (-beta)

where ``msg_count`` is how often the message has been seen in the episode so far (1 for the
first sighting) and ``beta = 3``. This module holds those pieces, plus the running mean/std
normaliser and the "keep only above a threshold" cut used by the ranking and Motif rewards.

Example:
    >>> import torch
    >>> from torchrl_oni.rewards.scaling import count_scale, threshold, combine_rewards
    >>> count_scale(torch.tensor([1.0, 1.0]), torch.tensor([1, 2]))
    tensor([1.0000, 0.1250])
    >>> threshold(torch.tensor([-1.0, 0.2, 0.7]), 0.5)
    tensor([0.0000, 0.0000, 0.7000])
    >>> combine_rewards(torch.tensor([2.0]), torch.tensor([1.0]), 0.1, 0.4)
    tensor([0.6000])
"""
from __future__ import annotations

import threading
from typing import Optional, Tuple

import torch

from torchrl_oni.locks import OwnLockOnCopy

__all__ = ["count_scale", "threshold", "combine_rewards", "reward_streams", "survival_terms", "RunningMeanStd",
           "RunMessageCounts"]


def count_scale(rewards: torch.Tensor, msg_count: torch.Tensor, beta: float = 3.0) -> torch.Tensor:
    """Motif's count decay: ``rewards * msg_count ** -beta``.

    Counts below 1 (which a correct counter never emits) are treated as 1 so that the factor
    never exceeds 1.

    Args:
        rewards: ``float[N]`` raw rewards.
        msg_count: ``int[N]`` per-episode sightings of each message, this step included.
        beta: the exponent (3 in ONI/Motif; 0 disables the decay).
    """
    counts = msg_count.to(rewards.dtype if rewards.is_floating_point() else torch.float32)
    counts = counts.reshape(rewards.shape).clamp_min(1.0)
    return rewards * counts.pow(-float(beta))


def threshold(values: torch.Tensor, cut: float) -> torch.Tensor:
    """Keeps values strictly above ``cut``, zeroes the rest: ``values * 1[values > cut]``."""
    return torch.where(values > cut, values, torch.zeros_like(values))


def reward_streams(
    extrinsic: torch.Tensor,
    intrinsic: torch.Tensor,
    extrinsic_coeff: float,
    intrinsic_coeff: float,
    extrinsic_clip: Optional[float] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(extrinsic_coeff * clip(extrinsic), intrinsic_coeff * intrinsic)``, shaped like ``extrinsic``.

    Args:
        extrinsic: env rewards (already multiplied by any reward scale).
        intrinsic: intrinsic rewards, count decay already applied.
        extrinsic_coeff, intrinsic_coeff: the mixing coefficients.
        extrinsic_clip: if given, the extrinsic reward is clipped to ``[-clip, clip]`` *before*
            the coefficient, as ONI does with ``reward_clip=10``; the intrinsic term is never
            clipped.
    """
    if extrinsic_clip is not None:
        extrinsic = extrinsic.clamp(-float(extrinsic_clip), float(extrinsic_clip))
    intrinsic = intrinsic.reshape(extrinsic.shape).to(extrinsic.dtype)
    return extrinsic_coeff * extrinsic, intrinsic_coeff * intrinsic


def survival_terms(died: torch.Tensor, death_penalty: float = 0.0, survival_bonus: float = 0.0) -> torch.Tensor:
    """The reward for staying alive: ``-death_penalty`` on the steps where ``died`` (the agent
    died on that step), ``+survival_bonus`` on every other step, as ``float32`` shaped like
    ``died``. Neither is in ONI; both are options against intrinsic rewards that pay for habits
    that kill (a meal that chokes), added after the coefficients.

    Example:
        >>> import torch
        >>> survival_terms(torch.tensor([False, True, False]), death_penalty=5.0, survival_bonus=0.01)
        tensor([ 0.0100, -5.0000,  0.0100])
    """
    return torch.where(died, torch.full((), -float(death_penalty)), torch.full((), float(survival_bonus)))


def combine_rewards(
    extrinsic: torch.Tensor,
    intrinsic: torch.Tensor,
    extrinsic_coeff: float,
    intrinsic_coeff: float,
    extrinsic_clip: Optional[float] = None,
) -> torch.Tensor:
    """``extrinsic_coeff * clip(extrinsic) + intrinsic_coeff * intrinsic`` (see :func:`reward_streams`)."""
    ext, intr = reward_streams(extrinsic, intrinsic, extrinsic_coeff, intrinsic_coeff, extrinsic_clip)
    return ext + intr


class RunningMeanStd(OwnLockOnCopy):
    """Running mean and variance over every value seen (parallel-merge update, float64).

    Thread-safe: updates and reads take an internal lock. Copies (``copy.deepcopy``, pickle,
    hence ``torch.save``, ``ParallelEnv`` factories and a collector's ``postproc``) carry the
    statistics and get a lock of their own.

    Args:
        epsilon: the initial pseudo-count, which keeps the first normalisations finite.
        min_std: floor on the standard deviation used by :meth:`normalize`.

    Example:
        >>> import torch
        >>> rms = RunningMeanStd(epsilon=0.0)
        >>> rms.update(torch.tensor([1.0, 2.0, 3.0]))
        >>> round(rms.mean, 4), round(rms.var, 4)
        (2.0, 0.6667)
        >>> rms.normalize(torch.tensor([2.0]))
        tensor([0.])
    """

    def __init__(self, epsilon: float = 1e-4, min_std: float = 1e-6):
        self.mean = 0.0
        self.var = 1.0
        self.count = float(epsilon)
        self.min_std = float(min_std)
        self._lock = threading.Lock()

    @property
    def std(self) -> float:
        return max(self.var, 0.0) ** 0.5

    def update(self, values: torch.Tensor) -> None:
        """Folds a batch of values into the statistics."""
        values = values.detach().reshape(-1).double()
        n = values.numel()
        if n == 0:
            return
        batch_mean = values.mean().item()
        batch_var = values.var(unbiased=False).item()
        with self._lock:
            total = self.count + n
            delta = batch_mean - self.mean
            new_mean = self.mean + delta * n / total
            m2 = self.var * self.count + batch_var * n + delta * delta * self.count * n / total
            self.mean, self.var, self.count = new_mean, m2 / total, total

    def normalize(self, values: torch.Tensor) -> torch.Tensor:
        """``(values - mean) / max(std, min_std)`` with the current statistics."""
        with self._lock:
            mean, std = self.mean, max(self.std, self.min_std)
        return (values - mean) / std

    def state_dict(self) -> dict:
        with self._lock:
            return {"mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        with self._lock:
            self.mean = float(state["mean"])
            self.var = float(state["var"])
            self.count = float(state["count"])


class RunMessageCounts:
    """Sightings of each caption over the whole run, for a count decay that never restarts.

    ONI decays a caption's reward by its count *in the episode*, so a caption is paid again in
    full after every reset (the meal that is eaten in every episode). With these counts in
    place of ``msg_count`` (``--count-scope run``, not in ONI) a caption pays ``R · n ** -beta``
    at its n-th sighting in the run. :meth:`count` takes the hashes in the order they were seen
    and returns each sighting's count, this one included; the table lives in the trainer
    process and travels in checkpoints (:meth:`state_dict`).

    Example:
        >>> import torch
        >>> counts = RunMessageCounts()
        >>> counts.count(torch.tensor([7, 7, 9]))
        tensor([1, 2, 1])
        >>> counts.count(torch.tensor([9, 7]))  # a later batch goes on from the table
        tensor([2, 3])
    """

    def __init__(self):
        self.seen: dict = {}  # caption hash -> sightings so far

    def count(self, hashes: torch.Tensor) -> torch.Tensor:
        flat = hashes.reshape(-1).to(torch.int64).cpu()
        if flat.numel() == 0:
            return torch.zeros(hashes.shape, dtype=torch.int64)
        unique, inverse, sizes = torch.unique(flat, return_inverse=True, return_counts=True)
        # each sighting's rank among the sightings of its caption in this batch, in order
        order = torch.argsort(inverse, stable=True)
        starts = torch.cumsum(sizes, 0) - sizes
        rank = torch.empty_like(flat)
        rank[order] = torch.arange(flat.numel()) - starts.repeat_interleave(sizes)
        keys = unique.tolist()
        before = torch.tensor([self.seen.get(h, 0) for h in keys], dtype=torch.int64)
        for h, n in zip(keys, (before + sizes).tolist()):
            self.seen[h] = n
        return (before[inverse] + rank + 1).reshape(hashes.shape)

    def __len__(self) -> int:
        return len(self.seen)

    def state_dict(self) -> dict:
        return {"hashes": torch.tensor(list(self.seen), dtype=torch.int64),
                "counts": torch.tensor(list(self.seen.values()), dtype=torch.int64)}

    def load_state_dict(self, state: dict) -> None:
        self.seen = dict(zip(state["hashes"].tolist(), state["counts"].tolist()))
