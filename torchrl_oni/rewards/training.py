"""Reward-model training shared by the classification, ranking and ensemble trainers.

:class:`RewardModelSchedule` decides when reward models train (ONI's rule within a wall-time
budget), :class:`ScheduledTraining` gives a trainer its ``after_iteration()``,
:func:`holdout_mask` picks the captions never trained on, and :func:`labelled_arrays` reads the
labelled captions from either caption-store interface. They live here, apart from any one
reward model, so that the model modules depend on this one and not on each other.

Example:
    >>> import torch
    >>> from torchrl_oni.rewards.training import RewardModelSchedule, holdout_mask
    >>> RewardModelSchedule(steps_per_new_labels=8).steps(dataset_size=10, new_labels=True, iteration_done=True)
    8
    >>> holdout_mask(torch.arange(1000), 0.1).float().mean().item() < 0.2
    True
"""
from __future__ import annotations

import time
from typing import Optional, Tuple

import torch

__all__ = ["RewardModelSchedule", "ScheduledTraining", "holdout_mask", "labelled_arrays"]


class RewardModelSchedule:
    """How many reward-model gradient steps to run after a PPO iteration: ONI's rule, within a
    wall-time budget. The one place that decides when reward models train.

    The rule (ONI's, made configurable): while the dataset holds fewer than ``switch_at`` items,
    every batch of new labels triggers ``steps_per_new_labels`` steps; from ``switch_at`` on, each
    PPO iteration triggers ``steps_per_iteration_after`` steps and new labels trigger none.

    The budget: with ``time_fraction`` f > 0, training may take at most a share f of the wall
    time. Credit accrues as f × the wall time between calls (less the training itself); owed steps
    run while the credit covers their measured cost, the rest wait for later iterations. Debt is
    capped at ``max_owed`` (default 4 × ``steps_per_new_labels``): on a slow CPU the rule's demand
    can exceed any budget, and old debt is worth less than fresh labels. f = 0 runs every step at
    once (ONI's behaviour).

    Example:
        >>> s = RewardModelSchedule(steps_per_new_labels=32, switch_at=25_000)
        >>> s.steps(dataset_size=100, new_labels=True, iteration_done=True)
        32
        >>> s.steps(dataset_size=30_000, new_labels=True, iteration_done=True)
        1
        >>> s.due(dataset_size=100), s.due(dataset_size=100), s.due(dataset_size=120)
        (32, 0, 32)
    """

    def __init__(
        self,
        steps_per_new_labels: int = 32,
        switch_at: int = 25_000,
        steps_per_iteration_after: int = 1,
        time_fraction: float = 0.0,
        max_owed: Optional[int] = None,
        clock=time.perf_counter,
    ):
        if min(steps_per_new_labels, steps_per_iteration_after, switch_at, time_fraction) < 0:
            raise ValueError("RewardModelSchedule arguments must be non-negative")
        self.steps_per_new_labels = int(steps_per_new_labels)
        self.switch_at = int(switch_at)
        self.steps_per_iteration_after = int(steps_per_iteration_after)
        self.time_fraction = float(time_fraction)
        self.max_owed = int(max_owed) if max_owed is not None else 4 * max(self.steps_per_new_labels, 1)
        self.clock = clock
        self.owed = 0
        self.credit = 0.0
        self.step_cost: Optional[float] = None
        self._seen_size = -1
        self._last = clock()
        self._spent_since = 0.0

    def steps(self, dataset_size: int, new_labels: bool, iteration_done: bool) -> int:
        """The rule alone: gradient steps given the dataset size and what just happened."""
        if dataset_size <= 0:
            return 0
        if dataset_size < self.switch_at:
            return self.steps_per_new_labels if new_labels else 0
        return self.steps_per_iteration_after if iteration_done else 0

    def due(self, dataset_size: int) -> int:
        """Call once per PPO iteration: the steps to run now (the rule, then the budget)."""
        new_labels = dataset_size > self._seen_size
        self._seen_size = max(self._seen_size, int(dataset_size))
        # below switch_at the rule pays on new labels, above it on the finished iteration
        new = self.steps(dataset_size, new_labels=new_labels, iteration_done=True)
        if self.time_fraction <= 0:
            self.owed = 0
            return new
        now = self.clock()
        self.owed = min(self.owed + new, self.max_owed)
        self.credit += self.time_fraction * max(now - self._last - self._spent_since, 0.0)
        self._last, self._spent_since = now, 0.0
        if not self.owed:
            return 0
        if self.step_cost is None:
            return 1  # measure what one step costs first
        return min(self.owed, int(self.credit // self.step_cost))

    def spent(self, steps: int, seconds: float) -> None:
        """Records that ``steps`` steps took ``seconds``."""
        self._spent_since += seconds
        if steps:
            cost = seconds / steps
            self.step_cost = cost if self.step_cost is None else 0.8 * self.step_cost + 0.2 * cost
        if self.time_fraction > 0:
            self.owed = max(self.owed - steps, 0)
            self.credit = max(self.credit - seconds, -10 * (self.step_cost or 0.0))

    def state_dict(self) -> dict:
        return {"seen_size": self._seen_size, "owed": self.owed}

    def load_state_dict(self, state: dict) -> None:
        self._seen_size = int(state.get("seen_size", -1))
        self.owed = int(state.get("owed", 0))


class ScheduledTraining:
    """``after_iteration()`` for reward-model trainers: runs what their schedule says is due.

    A trainer provides ``schedule``, ``dataset_size_now()`` and ``train_steps(n)``.
    """

    def after_iteration(self) -> dict:
        """Call after each PPO iteration: runs the steps the schedule says are due now."""
        n = self.schedule.due(self.dataset_size_now())
        if n <= 0:
            return {"steps": 0}
        start = self.schedule.clock()
        result = self.train_steps(n)
        self.schedule.spent(result.get("steps", 0), self.schedule.clock() - start)
        return result


def holdout_mask(hashes: torch.Tensor, fraction: float) -> torch.Tensor:
    """``bool[N]``: which captions belong to the held-out slice.

    Decided by the caption hash alone (a multiplicative remix of the 64-bit hash, bucketed into
    10 000), so a caption is held out in every run and every process, whatever order labels
    arrive in.
    """
    hashes = torch.as_tensor(hashes, dtype=torch.int64).reshape(-1)
    if fraction <= 0:
        return torch.zeros(hashes.shape, dtype=torch.bool)
    # Remix so that hashes that are not uniform in their low bits still spread evenly.
    mixed = (hashes * -7046029254386353131) >> 17  # wraps mod 2**64; arithmetic shift
    bucket = torch.remainder(mixed, 10_000)
    return bucket < int(round(fraction * 10_000))


def labelled_arrays(store) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(messages, hashes, labels)`` of every labelled caption, from either store interface."""
    if hasattr(store, "labelled"):
        return store.labelled()
    if hasattr(store, "labelled_data"):
        data = store.labelled_data()
        return data["message"], data["caption_hash"], data["label"]
    raise TypeError(f"{type(store).__name__} has neither labelled() nor labelled_data()")
