"""ONI-Classification: a char-CNN classifier distils the LLM's labels; it pays 1 when sure.

``R(m) = 1[P(helpful | m) > threshold]`` for every message, labelled or not (oni_spec §2.2).
The classifier is trained online on the labels in the caption store, between PPO iterations,
following :class:`RewardModelSchedule`.

Differences from ONI, on purpose (oni_spec §7):

* class imbalance is handled (balanced batches by default, or a class-weighted loss), since
  helpful messages are rare;
* a deterministic slice of captions (chosen by hash, 10 % by default) is never trained on, so
  the reported accuracy is held-out accuracy rather than training accuracy.

With balanced batches the classifier's probabilities are calibrated for a 50/50 prior, so the
default threshold 0.5 means "more likely helpful than not, ignoring how rare helpful is".

Store interface (duck-typed, :class:`LabelledCaptions`): ``labelled()`` returning
``(messages uint8[M,256], hashes int64[M], labels float32[M])`` for every labelled caption, or
``CaptionStore.labelled_data()`` returning a TensorDict with ``message``, ``caption_hash`` and
``label``.

Thread safety: the trainer optimises its own copy of the network and *publishes* a fresh
eval-mode copy to the reward with :meth:`ClassificationReward.swap_model` (a single reference
assignment under a lock). Reward computation in another thread always runs a complete,
consistent set of weights and never waits for a gradient step.

Example:
    >>> import torch
    >>> from torchrl_oni.rewards.classification import ClassificationReward
    >>> from torchrl_oni.rewards.models import MessageClassifier
    >>> _ = torch.manual_seed(0)
    >>> reward = ClassificationReward(MessageClassifier(), threshold=0.5)
    >>> out = reward(torch.zeros(3, 256, dtype=torch.uint8), torch.zeros(3, dtype=torch.int64))
    >>> out.shape, out.dtype, bool(((out == 0) | (out == 1)).all())
    (torch.Size([3]), torch.float32, True)
"""
from __future__ import annotations

import copy
from typing import Optional, Protocol, Tuple, runtime_checkable

import torch
from torch import nn

from torchrl_oni.rewards.models import MessageClassifier, ServedModel, as_message_tensor
from torchrl_oni.rewards.training import RewardModelSchedule, ScheduledTraining, holdout_mask, labelled_arrays

__all__ = ["LabelledCaptions", "ClassificationReward", "ClassifierTrainer"]


@runtime_checkable
class LabelledCaptions(Protocol):
    """What :class:`ClassifierTrainer` needs from a caption store."""

    def labelled(self) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every labelled caption: ``(messages uint8[M,256], hashes int64[M], labels float32[M])``."""
        ...


class ClassificationReward(ServedModel):
    """``R(m) = 1[P(helpful | m) > threshold]`` from a :class:`MessageClassifier`.

    Args:
        model: the classifier (a fresh one if ``None``). It is put in eval mode.
        threshold: decision threshold on P(helpful) (0.5 in ONI).
        device: where inference runs (default: the model's device).
        chunk_size: messages per forward pass, to bound memory.
    """

    def __init__(
        self,
        model: Optional[nn.Module] = None,
        threshold: float = 0.5,
        device: Optional[torch.device] = None,
        chunk_size: int = 8192,
    ):
        super().__init__(MessageClassifier() if model is None else model, device, chunk_size)
        self.threshold = float(threshold)

    def helpful_probability(self, messages: torch.Tensor) -> torch.Tensor:
        """``float32[N]`` P(helpful) for each message."""
        return self._apply(messages, lambda model, chunk: model.helpful_probability(chunk))

    def __call__(self, messages: torch.Tensor, hashes: torch.Tensor) -> torch.Tensor:
        """``(uint8[N,256], int64[N]) -> float32[N]`` in {0, 1}, before count scaling."""
        return (self.helpful_probability(messages) > self.threshold).float()

    def state_dict(self) -> dict:
        return {"model": self._model_state(), "threshold": self.threshold}

    def load_state_dict(self, state: dict) -> None:
        self.threshold = float(state.get("threshold", self.threshold))
        self._load_model_state(state["model"])


class ClassifierTrainer(ScheduledTraining):
    """Trains a :class:`ClassificationReward`'s network online on the store's labels.

    Each :meth:`train_steps` call takes a snapshot of the labelled captions, splits off the
    held-out slice (:func:`~torchrl_oni.rewards.training.holdout_mask`), runs Adam steps on balanced (or class-weighted)
    minibatches, and publishes the updated weights to the reward.

    Args:
        reward: the reward to keep up to date.
        store: a :class:`LabelledCaptions`.
        lr: Adam learning rate (1e-4 in ONI).
        batch_size: minibatch size (256 in ONI).
        holdout_fraction: share of captions kept for evaluation (0 to train on all).
        balance: ``"sampler"`` (half helpful, half not per batch), ``"weighted"`` (inverse
            class frequency weights in the loss) or ``"none"`` (ONI's plain CE).
        schedule: the :class:`~torchrl_oni.rewards.training.RewardModelSchedule` that :meth:`after_iteration` follows.
        device: where training runs (default: the reward's device).
        seed: seed of the minibatch sampler.

    Example:
        >>> import torch
        >>> from torchrl_oni.captions import encode_messages, hash_messages
        >>> class Store:
        ...     def __init__(self, texts, labels):
        ...         self.m = torch.as_tensor(encode_messages(texts))
        ...         self.h = torch.as_tensor(hash_messages(self.m))
        ...         self.y = torch.tensor(labels, dtype=torch.float32)
        ...     def labelled(self): return self.m, self.h, self.y
        >>> _ = torch.manual_seed(0)
        >>> reward = ClassificationReward()
        >>> trainer = ClassifierTrainer(reward, Store(["You kill it!", "A wall."], [1, 0]),
        ...                             batch_size=8, holdout_fraction=0.0)
        >>> trainer.train_steps(2)["steps"]
        2
    """

    def __init__(
        self,
        reward: ClassificationReward,
        store: LabelledCaptions,
        lr: float = 1e-4,
        batch_size: int = 256,
        holdout_fraction: float = 0.1,
        balance: str = "sampler",
        schedule: Optional[RewardModelSchedule] = None,
        device: Optional[torch.device] = None,
        seed: int = 0,
    ):
        if balance not in ("sampler", "weighted", "none"):
            raise ValueError(f"balance must be 'sampler', 'weighted' or 'none', got {balance!r}")
        if not 0.0 <= holdout_fraction < 1.0:
            raise ValueError(f"holdout_fraction must be in [0, 1), got {holdout_fraction}")
        self.reward = reward
        self.store = store
        self.batch_size = int(batch_size)
        self.holdout_fraction = float(holdout_fraction)
        self.balance = balance
        self.schedule = schedule if schedule is not None else RewardModelSchedule()
        self.device = torch.device(device) if device is not None else reward.device
        self.model = copy.deepcopy(reward.model).to(self.device)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=lr)
        self.generator = torch.Generator().manual_seed(seed)
        self.total_steps = 0
        self.dataset_size = 0
        self._train = self._heldout = None

    # -- data ------------------------------------------------------------------------------
    def refresh(self) -> int:
        """Takes a fresh snapshot of the store's labels; returns the number of labelled captions."""
        messages, hashes, labels = labelled_arrays(self.store)
        messages = as_message_tensor(messages).reshape(-1, 256).cpu()
        hashes = torch.as_tensor(hashes, dtype=torch.int64).reshape(-1).cpu()
        labels = torch.as_tensor(labels, dtype=torch.float32).reshape(-1).cpu()
        valid = ~torch.isnan(labels)
        messages, hashes, labels = messages[valid], hashes[valid], labels[valid]
        classes = (labels > 0.5).long()
        held = holdout_mask(hashes, self.holdout_fraction)
        self._train = (messages[~held], classes[~held])
        self._heldout = (messages[held], classes[held])
        self.dataset_size = int(labels.numel())
        return self.dataset_size

    def _sample_batch(self) -> Tuple[torch.Tensor, torch.Tensor]:
        messages, classes = self._train
        n = classes.numel()
        if self.balance == "sampler":
            pos = torch.nonzero(classes == 1).squeeze(1)
            neg = torch.nonzero(classes == 0).squeeze(1)
            if pos.numel() and neg.numel():
                n_pos = self.batch_size // 2
                idx = torch.cat(
                    [
                        pos[torch.randint(pos.numel(), (n_pos,), generator=self.generator)],
                        neg[torch.randint(neg.numel(), (self.batch_size - n_pos,), generator=self.generator)],
                    ]
                )
                return messages[idx], classes[idx]
        if n <= self.batch_size:
            idx = torch.randperm(n, generator=self.generator)
        else:
            idx = torch.randint(n, (self.batch_size,), generator=self.generator)
        return messages[idx], classes[idx]

    def _class_weights(self) -> Optional[torch.Tensor]:
        if self.balance != "weighted":
            return None
        counts = torch.bincount(self._train[1], minlength=2).float().clamp_min(1.0)
        return (counts.sum() / (2.0 * counts)).to(self.device)

    # -- training --------------------------------------------------------------------------
    def train_steps(self, n: int, publish: bool = True, refresh: bool = True) -> dict:
        """Runs ``n`` gradient steps on a fresh snapshot of the labels (or the last one).

        Returns:
            ``{"steps", "loss", "train_accuracy", "dataset_size"}`` (loss/accuracy are
            averages over the steps; ``steps`` is 0 when there is nothing to train on).
        """
        if refresh or self._train is None:
            self.refresh()
        if n <= 0 or self._train[1].numel() == 0:
            return {"steps": 0, "loss": float("nan"), "train_accuracy": float("nan"),
                    "dataset_size": self.dataset_size}
        loss_fn = nn.CrossEntropyLoss(weight=self._class_weights())
        self.model.train()
        total_loss, correct, seen = 0.0, 0, 0
        for _ in range(n):
            messages, classes = self._sample_batch()
            messages, classes = messages.to(self.device), classes.to(self.device)
            logits = self.model(messages)
            loss = loss_fn(logits, classes)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            total_loss += loss.item()
            correct += int((logits.argmax(-1) == classes).sum())
            seen += classes.numel()
        self.total_steps += n
        if publish:
            self.publish()
        return {"steps": n, "loss": total_loss / n, "train_accuracy": correct / seen,
                "dataset_size": self.dataset_size}

    def publish(self) -> None:
        """Hands an eval-mode copy of the trained network to the reward."""
        self.reward.swap_model(copy.deepcopy(self.model))

    def dataset_size_now(self) -> int:
        """Labelled captions in the store now (cheap when the store keeps counts)."""
        if hasattr(self.store, "stats"):
            return int(self.store.stats()["labelled"])
        return self.refresh()

    @torch.no_grad()
    def evaluate(self, refresh: bool = True) -> dict:
        """Held-out accuracy of the *published* network at the reward's threshold.

        Returns:
            ``{"heldout_accuracy", "heldout_balanced_accuracy", "heldout_size", "train_size"}``;
            accuracies are NaN when the held-out slice is empty.
        """
        if refresh or self._heldout is None:
            self.refresh()
        messages, classes = self._heldout
        result = {"heldout_size": int(classes.numel()), "train_size": int(self._train[1].numel())}
        if classes.numel() == 0:
            result.update(heldout_accuracy=float("nan"), heldout_balanced_accuracy=float("nan"))
            return result
        predicted = self.reward(messages, torch.zeros(len(messages), dtype=torch.int64)).long()
        result["heldout_accuracy"] = float((predicted == classes).float().mean())
        recalls = [
            float((predicted[classes == c] == c).float().mean())
            for c in (0, 1)
            if bool((classes == c).any())
        ]
        result["heldout_balanced_accuracy"] = sum(recalls) / len(recalls)
        return result

    # -- checkpointing ---------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "model": copy.deepcopy(self.model.state_dict()),
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "generator": self.generator.get_state(),
            "total_steps": self.total_steps,
        }

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.generator.set_state(state["generator"])
        self.total_steps = int(state["total_steps"])
        self.publish()
