"""ONI-Ranking: a reward model fitted to LLM pairwise preferences (Bradley–Terry).

The LLM compares pairs of captions; a :class:`~torchrl_oni.rewards.models.MessageRewardModel`
``g`` is trained so that ``softmax([g(m1), g(m2)])`` matches the preference, with ties as 0.5
(oni_spec §2.3). The reward is

    z = (g(m) - running_mean) / running_std,     R(m) = z * 1[z > threshold]

i.e. the score **normalised with running statistics and thresholded**. That is what ONI's code
clearly intends; because of a variable-name typo (``llm_reward_cpu`` vs ``llm_rewards_cpu``,
``learner.py`` l.1096) the original actually paid the *raw* score ``g(m)``. Pass
``normalize=False`` to reproduce that behaviour.

Pairs to send to the annotator come from :class:`UniqueCaptionPairSampler`: a bounded set of
distinct captions (never an identical pair, no empty message unless asked), which fixes ONI's
unbounded, frequency-weighted, unfiltered buffer (oni_spec §7.2–7.3).

Store interface (duck-typed, :class:`LabelledPairs`): ``sample_labelled_pairs(n)`` returning
``(first uint8[k,256], second uint8[k,256], preference float32[k])`` with ``k <= n`` and
preference = P(second is better) (0, 1, or 0.5 for a tie), or, as ``CaptionStore`` does, a
TensorDict with ``message_a``, ``message_b`` and ``preference``. For the training schedule the
number of labelled pairs comes from ``num_labelled_pairs()`` or ``stats()["pairs_labelled"]``.

Thread safety: as for classification, the trainer optimises a private copy and publishes an
eval-mode copy with :meth:`RankingReward.swap_model`; the running statistics have their own
lock.

Example:
    >>> import torch
    >>> from torchrl_oni.rewards.ranking import RankingReward, bradley_terry_loss
    >>> _ = torch.manual_seed(0)
    >>> reward = RankingReward(threshold=0.0)
    >>> reward(torch.zeros(4, 256, dtype=torch.uint8), torch.zeros(4, dtype=torch.int64)).shape
    torch.Size([4])
    >>> round(bradley_terry_loss(torch.tensor([0.0]), torch.tensor([0.0]), torch.tensor([0.5])).item(), 4)
    0.6931
"""
from __future__ import annotations

import copy
from typing import Optional, Protocol, Tuple, runtime_checkable

import numpy as np
import torch
from torch import nn

from torchrl_oni.captions import CAPTION_HASH_KEY, MESSAGE_KEY, MESSAGE_LEN
from torchrl_oni.rewards.models import MessageRewardModel, ServedModel, as_message_tensor
from torchrl_oni.rewards.scaling import RunningMeanStd, threshold as threshold_values
from torchrl_oni.rewards.training import RewardModelSchedule, ScheduledTraining
from torchrl_oni.store import CaptionStore

__all__ = [
    "PairQueue",
    "LabelledPairs",
    "bradley_terry_loss",
    "pairwise_accuracy",
    "RankingReward",
    "RankingTrainer",
    "UniqueCaptionPairSampler",
]


@runtime_checkable
class LabelledPairs(Protocol):
    """What :class:`RankingTrainer` needs from a caption store."""

    def sample_labelled_pairs(self, n: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Up to ``n`` labelled pairs: ``(first, second, P(second better))``."""
        ...


def bradley_terry_loss(
    score_first: torch.Tensor, score_second: torch.Tensor, preference: torch.Tensor
) -> torch.Tensor:
    """Soft-label cross-entropy of ``softmax([s1, s2])`` against ``[1 - y, y]``, averaged.

    ``y`` is P(second is better): 0, 1, or 0.5 for a tie.
    """
    logp = torch.stack([score_first, score_second], dim=-1).log_softmax(-1)
    y = preference.to(logp.dtype)
    return -((1.0 - y) * logp[..., 0] + y * logp[..., 1]).mean()


def pairwise_accuracy(
    score_first: torch.Tensor, score_second: torch.Tensor, preference: torch.Tensor
) -> float:
    """Share of non-tie pairs whose higher-scored element is the preferred one (NaN if none)."""
    decided = preference != 0.5
    if not bool(decided.any()):
        return float("nan")
    second_wins = score_second > score_first
    return float((second_wins[decided] == (preference[decided] > 0.5)).float().mean())


def _pair_arrays(batch):
    """``(first, second, preference)`` from a tuple or a mapping/TensorDict of labelled pairs."""
    if isinstance(batch, (tuple, list)):
        return batch
    return batch["message_a"], batch["message_b"], batch["preference"]


class RankingReward(ServedModel):
    """Normalised, thresholded score of a :class:`MessageRewardModel`.

    Args:
        model: the scoring network (a fresh one if ``None``); put in eval mode.
        threshold: values of ``z`` at or below it become 0 (ONI's ``eps_threshold_quantile``,
            default -0.5, compared directly with the normalised value).
        normalize: ``False`` pays the raw score, as the original code did by accident.
        update_stats: fold each batch of scores into the running statistics when called
            (ONI updates them on every training minibatch).
        device: where inference runs (default: the model's device).
        chunk_size: messages per forward pass.
    """

    def __init__(
        self,
        model: Optional[nn.Module] = None,
        threshold: float = -0.5,
        normalize: bool = True,
        update_stats: bool = True,
        device: Optional[torch.device] = None,
        chunk_size: int = 8192,
    ):
        super().__init__(MessageRewardModel() if model is None else model, device, chunk_size)
        self.threshold = float(threshold)
        self.normalize = bool(normalize)
        self.update_stats = bool(update_stats)
        self.stats = RunningMeanStd()

    def scores(self, messages: torch.Tensor) -> torch.Tensor:
        """Raw scores ``g(m)``, ``float32[N]``."""
        return self._apply(messages, lambda model, chunk: model(chunk))

    def __call__(self, messages: torch.Tensor, hashes: torch.Tensor) -> torch.Tensor:
        """``(uint8[N,256], int64[N]) -> float32[N]``, before count scaling."""
        raw = self.scores(messages)
        if not self.normalize:
            return raw
        if self.update_stats:
            self.stats.update(raw)
        return threshold_values(self.stats.normalize(raw).float(), self.threshold)

    def state_dict(self) -> dict:
        return {"model": self._model_state(), "stats": self.stats.state_dict(), "threshold": self.threshold}

    def load_state_dict(self, state: dict) -> None:
        self.stats.load_state_dict(state["stats"])
        self.threshold = float(state.get("threshold", self.threshold))
        self._load_model_state(state["model"])


class RankingTrainer(ScheduledTraining):
    """Trains a :class:`RankingReward`'s network on labelled pairs (Bradley–Terry, ties = 0.5).

    Args:
        reward: the reward to keep up to date.
        store: a :class:`LabelledPairs`.
        lr: Adam learning rate (1e-4 in ONI).
        batch_size: pairs per step (256 in ONI).
        max_grad_norm: gradient-norm clip (10 in ONI).
        schedule: the :class:`RewardModelSchedule` that :meth:`after_iteration` follows.
        device: where training runs (default: the reward's device).

    Example:
        >>> import torch
        >>> from torchrl_oni.captions import encode_messages
        >>> class Pairs:
        ...     def sample_labelled_pairs(self, n):
        ...         a = torch.as_tensor(encode_messages(["You kill it!"] * n))
        ...         b = torch.as_tensor(encode_messages(["A wall."] * n))
        ...         return a, b, torch.zeros(n)
        >>> _ = torch.manual_seed(0)
        >>> trainer = RankingTrainer(RankingReward(), Pairs(), batch_size=4)
        >>> trainer.train_steps(3)["steps"]
        3
    """

    def __init__(
        self,
        reward: RankingReward,
        store: LabelledPairs,
        lr: float = 1e-4,
        batch_size: int = 256,
        max_grad_norm: Optional[float] = 10.0,
        schedule: Optional[RewardModelSchedule] = None,
        device: Optional[torch.device] = None,
    ):
        self.reward = reward
        self.store = store
        self.batch_size = int(batch_size)
        self.max_grad_norm = max_grad_norm
        self.schedule = schedule if schedule is not None else RewardModelSchedule()
        self.device = torch.device(device) if device is not None else reward.device
        self.model = copy.deepcopy(reward.model).to(self.device)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=lr)
        self.total_steps = 0

    def train_steps(self, n: int, publish: bool = True) -> dict:
        """Runs ``n`` steps, each on a fresh batch from the store.

        Returns:
            ``{"steps", "loss", "accuracy"}``; accuracy is on non-tie pairs, NaN if none.
        """
        losses, hits, decided, steps = [], 0.0, 0, 0
        self.model.train()
        for _ in range(max(int(n), 0)):
            first, second, pref = _pair_arrays(self.store.sample_labelled_pairs(self.batch_size))
            pref = torch.as_tensor(pref, dtype=torch.float32).reshape(-1)
            if pref.numel() == 0:
                break
            first = as_message_tensor(first, self.device).reshape(-1, MESSAGE_LEN)
            second = as_message_tensor(second, self.device).reshape(-1, MESSAGE_LEN)
            pref = pref.to(self.device)
            keep = ~torch.isnan(pref)
            first, second, pref = first[keep], second[keep], pref[keep]
            if pref.numel() == 0:
                break
            scores = self.model(torch.cat([first, second]))
            s1, s2 = scores[: len(pref)], scores[len(pref):]
            loss = bradley_terry_loss(s1, s2, pref)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if self.max_grad_norm is not None:
                nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
            self.optimizer.step()
            losses.append(loss.item())
            n_decided = int((pref != 0.5).sum())
            if n_decided:
                hits += pairwise_accuracy(s1.detach(), s2.detach(), pref) * n_decided
                decided += n_decided
            steps += 1
        self.total_steps += steps
        if steps and publish:
            self.publish()
        return {
            "steps": steps,
            "loss": sum(losses) / len(losses) if losses else float("nan"),
            "accuracy": hits / decided if decided else float("nan"),
        }

    def publish(self) -> None:
        """Hands an eval-mode copy of the trained network to the reward."""
        self.reward.swap_model(copy.deepcopy(self.model))

    def dataset_size_now(self) -> int:
        """Labelled pairs in the store now."""
        counter = getattr(self.store, "num_labelled_pairs", None)
        if counter is not None:
            return int(counter())
        if hasattr(self.store, "stats"):
            return int(self.store.stats()["pairs_labelled"])
        raise TypeError("the store has neither num_labelled_pairs() nor stats()")

    def state_dict(self) -> dict:
        return {
            "model": copy.deepcopy(self.model.state_dict()),
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "total_steps": self.total_steps,
        }

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.total_steps = int(state["total_steps"])
        self.publish()


class UniqueCaptionPairSampler:
    """A bounded pool of distinct captions, and random pairs of two different ones.

    Each caption hash is kept once, whatever its frequency, so pairs are uniform over distinct
    captions (ONI with ``remove_duplicated_obs=1``) instead of frequency-weighted. Memory is at
    most ``capacity × 256`` bytes: once full, a newly seen caption replaces a random one with
    probability ``capacity / distinct_seen`` (reservoir sampling), so the pool stays a uniform
    sample of every distinct caption seen. (A caption evicted and seen again counts again; the
    approximation only matters after the pool has filled.)

    Args:
        capacity: the most captions kept.
        include_empty: also pair the empty message (excluded by default, as Motif does).
        seed: seed of the sampler's random generator.

    Example:
        >>> from torchrl_oni.captions import encode_messages, hash_messages
        >>> msgs = encode_messages(["a", "b", "a", "", "c"])
        >>> sampler = UniqueCaptionPairSampler(capacity=10)
        >>> sampler.observe(msgs, hash_messages(msgs))
        3
        >>> first, second, h1, h2 = sampler.sample_pairs(5)
        >>> bool((h1 != h2).all()), first.shape
        (True, (5, 256))
    """

    def __init__(self, capacity: int = 100_000, include_empty: bool = False, seed: int = 0):
        if capacity < 2:
            raise ValueError(f"capacity must be at least 2, got {capacity}")
        self.capacity = int(capacity)
        self.include_empty = bool(include_empty)
        self.rng = np.random.default_rng(seed)
        self._messages = np.zeros((min(self.capacity, 1024), MESSAGE_LEN), dtype=np.uint8)
        self._hashes = np.zeros(len(self._messages), dtype=np.int64)
        self._slot = {}  # hash -> row
        self.size = 0
        self.distinct_seen = 0

    def __len__(self) -> int:
        return self.size

    def _grow(self) -> None:
        new_len = min(self.capacity, 2 * len(self._messages))
        messages = np.zeros((new_len, MESSAGE_LEN), dtype=np.uint8)
        hashes = np.zeros(new_len, dtype=np.int64)
        messages[: self.size] = self._messages[: self.size]
        hashes[: self.size] = self._hashes[: self.size]
        self._messages, self._hashes = messages, hashes

    def observe(self, messages, hashes) -> int:
        """Adds the batch's unseen captions to the pool; returns how many were added."""
        messages = np.asarray(
            messages.detach().cpu().numpy() if hasattr(messages, "detach") else messages,
            dtype=np.uint8,
        ).reshape(-1, MESSAGE_LEN)
        hashes = np.asarray(
            hashes.detach().cpu().numpy() if hasattr(hashes, "detach") else hashes, dtype=np.int64
        ).reshape(-1)
        _, first_rows = np.unique(hashes, return_index=True)
        added = 0
        for row in first_rows:
            h = int(hashes[row])
            if h in self._slot or (not self.include_empty and messages[row, 0] == 0):
                continue
            self.distinct_seen += 1
            if self.size < self.capacity:
                if self.size == len(self._messages):
                    self._grow()
                slot = self.size
                self.size += 1
            else:
                j = int(self.rng.integers(self.distinct_seen))
                if j >= self.capacity:
                    continue
                slot = j
                del self._slot[int(self._hashes[slot])]
            self._messages[slot] = messages[row]
            self._hashes[slot] = h
            self._slot[h] = slot
            added += 1
        return added

    def sample_pairs(self, n: int):
        """``n`` pairs of two different captions, uniform over the pool.

        Returns:
            ``(first uint8[n,256], second uint8[n,256], first_hash int64[n],
            second_hash int64[n])`` as numpy arrays; empty when the pool has fewer than 2.
        """
        if self.size < 2 or n <= 0:
            empty = np.zeros((0, MESSAGE_LEN), dtype=np.uint8)
            return empty, empty.copy(), np.zeros(0, np.int64), np.zeros(0, np.int64)
        i = self.rng.integers(self.size, size=n)
        j = (i + self.rng.integers(1, self.size, size=n)) % self.size  # never equal to i
        return (self._messages[i].copy(), self._messages[j].copy(),
                self._hashes[i].copy(), self._hashes[j].copy())

    def state_dict(self) -> dict:
        # tensors, not numpy arrays: checkpoints are read with torch.load(weights_only=True)
        return {
            "messages": torch.from_numpy(self._messages[: self.size].copy()),
            "hashes": torch.from_numpy(self._hashes[: self.size].copy()),
            "distinct_seen": self.distinct_seen,
            "rng": self.rng.bit_generator.state,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restores :meth:`state_dict` (tensors, or the numpy arrays older checkpoints hold)."""
        messages = np.asarray(state["messages"], dtype=np.uint8)[: self.capacity]
        hashes = np.asarray(state["hashes"], dtype=np.int64)[: self.capacity]
        self.size = len(hashes)
        alloc = max(self.size, min(self.capacity, 1024))
        self._messages = np.zeros((alloc, MESSAGE_LEN), dtype=np.uint8)
        self._hashes = np.zeros(alloc, dtype=np.int64)
        self._messages[: self.size] = messages
        self._hashes[: self.size] = hashes
        self._slot = {int(h): k for k, h in enumerate(hashes)}
        self.distinct_seen = int(state["distinct_seen"])
        self.rng.bit_generator.state = state["rng"]


class PairQueue:
    """Queues caption pairs for the annotator on every collected batch (``RewardParts.on_batch``).

    ONI's rule: ``pairs`` pairs of distinct captions, uniform over a bounded pool
    (:class:`UniqueCaptionPairSampler`), while fewer than ``backlog_limit`` pairs wait for a
    preference. With ``rule`` ``disagree`` or ``entropy`` and ``pair_probabilities``, it draws
    ``candidates`` × as many pairs and queues those the reward model's members disagree on most
    (or whose mean preference is closest to a coin flip: :func:`torchrl_oni.queries.select`). With
    a ``budget`` (:class:`~torchrl_oni.queries.LabelBudget`, one unit per new pair) it queues no
    more than the budget allows at the frames seen so far; a pair already in the store costs
    nothing.

    Args:
        store: the :class:`~torchrl_oni.store.CaptionStore`.
        pairs (int): pairs per batch (ONI: 10).
        backlog_limit (int): queue nothing while this many pairs wait for a preference.
        rule (str): a rule of :data:`torchrl_oni.queries.RULES` (only ``disagree``/``entropy``
            rank pairs; the others sample uniformly).
        pair_probabilities (callable, optional): ``(uint8[K,256], uint8[K,256]) -> float[K, M]``
            members' P(second better) (:meth:`~torchrl_oni.rewards.ensemble.RankingEnsemble.pair_probabilities`).
        budget (LabelBudget, optional): the label budget for pairs.
        candidates (int): candidate pairs drawn per pair queued by a ranking rule.
        wake (callable): called after queueing (wakes the annotation worker).
        seed (int): the sampler's seed.

    Example:
        >>> import torch
        >>> from torchrl_oni.queries import LabelBudget
        >>> from torchrl_oni.captions import encode_messages, hash_messages
        >>> from torchrl_oni.store import CaptionStore
        >>> from tensordict import TensorDict
        >>> store = CaptionStore(capacity=16)
        >>> msgs = torch.from_numpy(encode_messages(["a", "b", "c", "d"]))
        >>> batch = TensorDict(message=msgs, caption_hash=torch.from_numpy(hash_messages(msgs)), batch_size=[4])
        >>> _ = store.add(msgs)
        >>> queue = PairQueue(store, pairs=10, budget=LabelBudget(per_million=1e6))   # 1 pair per frame
        >>> queue(batch)                # 4 frames: at most 4 new pairs; a pair drawn twice costs nothing
        >>> 0 < store.num_pairs == queue.budget.spent <= 4
        True
    """

    def __init__(self, store: CaptionStore, *, pairs: int = 10, backlog_limit: int = 200, rule: str = "uniform",
                 pair_probabilities=None, budget=None, candidates: int = 10, wake=lambda: None, seed: int = 0):
        from torchrl_oni.queries import RULES

        if rule not in RULES:
            raise ValueError(f"rule must be one of {', '.join(RULES)}, got {rule!r}")
        if rule in ("disagree", "entropy") and pair_probabilities is None:
            raise ValueError(f"rule {rule!r} needs pair_probabilities (the reward model's members)")
        self.store = store
        self.pairs = int(pairs)
        self.backlog_limit = int(backlog_limit)
        self.rule = rule
        self.pair_probabilities = pair_probabilities
        self.budget = budget
        self.candidates = max(int(candidates), 1)
        self.wake = wake
        self.sampler = UniqueCaptionPairSampler(seed=seed)
        self.generator = torch.Generator().manual_seed(seed)
        self.frames = 0
        self.queued_total = 0

    def __call__(self, batch) -> None:
        from torchrl_oni.queries import select

        self.sampler.observe(batch.get(MESSAGE_KEY).reshape(-1, MESSAGE_LEN), batch.get(CAPTION_HASH_KEY).reshape(-1))
        self.frames += batch.numel()
        stats = self.store.stats()
        # ONI queued 10 pairs per minibatch while fewer than 2 × batch size were waiting
        if stats["pairs"] - stats["pairs_labelled"] - stats.get("pairs_skipped", 0) >= self.backlog_limit:
            return
        n = self.pairs if self.budget is None else min(self.pairs, self.budget.allowed(self.frames))
        if n <= 0:
            return
        if self.rule in ("disagree", "entropy"):
            first, second, h1, h2 = self.sampler.sample_pairs(self.candidates * n)
            if len(h1):
                with torch.no_grad():
                    probs = torch.as_tensor(self.pair_probabilities(torch.from_numpy(first), torch.from_numpy(second)))
                best = select({"member_probs": probs}, n, self.rule, generator=self.generator).numpy()
                h1, h2 = h1[best], h2[best]
        else:
            _, _, h1, h2 = self.sampler.sample_pairs(n)
        if not len(h1):
            return
        before = self.store.num_pairs
        self.store.add_pairs(h1, h2)
        new = self.store.num_pairs - before
        if self.budget is not None and new:
            self.budget.spend(new)
        self.queued_total += new
        self.wake()

    def metrics(self) -> dict:
        """For the logs: ``annotation/pairs_queued_total`` and, with a budget,
        ``annotation/budget_spent``, ``_earned``, ``_allowed`` (pairs)."""
        out = {"annotation/pairs_queued_total": float(self.queued_total)}
        if self.budget is not None:
            out.update({f"annotation/budget_{k}": v for k, v in self.budget.metrics(self.frames).items()})
        return out

    def state_dict(self) -> dict:
        # the sampler is checkpointed on its own (as "sampler", where older checkpoints keep it)
        return {"frames": self.frames, "queued_total": self.queued_total, "generator": self.generator.get_state(),
                "budget": self.budget.state_dict() if self.budget is not None else None}

    def load_state_dict(self, state: dict) -> None:
        self.frames = int(state["frames"])
        self.queued_total = int(state.get("queued_total", 0))
        self.generator.set_state(state["generator"])
        if self.budget is not None and state.get("budget") is not None:
            self.budget.load_state_dict(state["budget"])
