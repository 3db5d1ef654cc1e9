"""Training the members of an ensemble (the face: :mod:`torchrl_oni.rewards.ensemble`).

* :func:`bootstrap_counts`: member m sees each labelled caption ``c ~ Poisson(1)`` times, ``c`` a
  deterministic function of the caption hash and m (the online bootstrap);
* :class:`SURF`, :func:`surf_augment`, :func:`surf_loss`: confidently pseudo-labelled unlabelled
  captions added to each batch;
* :class:`EnsembleClassifierTrainer` and :class:`EnsembleRankingTrainer`: one
  :class:`~torchrl_oni.rewards.classification.ClassifierTrainer` or
  :class:`~torchrl_oni.rewards.ranking.RankingTrainer` per member of a
  :class:`~torchrl_oni.rewards.ensemble.ClassifierEnsemble` or
  :class:`~torchrl_oni.rewards.ensemble.RankingEnsemble`, reading the store through the member's
  bootstrap view.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch
from tensordict import TensorDict
from torch import nn

from torchrl_oni.captions import MESSAGE_LEN, hash_messages
from torchrl_oni.rewards.classification import ClassifierTrainer
from torchrl_oni.rewards.models import as_message_tensor
from torchrl_oni.rewards.ranking import RankingTrainer
from torchrl_oni.rewards.training import ScheduledTraining, holdout_mask, labelled_arrays

__all__ = ["bootstrap_counts", "EnsembleClassifierTrainer", "EnsembleRankingTrainer", "SURF", "surf_augment",
           "surf_loss"]

# Poisson(1) cumulative distribution up to k = 12 (P(k > 12) < 1e-10): inverse-CDF sampling.
_POISSON1_CDF = np.cumsum([math.exp(-1.0) / math.factorial(k) for k in range(13)])
_MASK64 = (1 << 64) - 1


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser: a bijective 64-bit mixer (uint64 in, uint64 out)."""
    x = x.astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        x += np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def bootstrap_counts(hashes, member: int, seed: int = 0) -> torch.Tensor:
    """``int64[N]``: how many copies of each item member ``member`` trains on, ~ Poisson(1).

    A deterministic function of ``(hash, member, seed)``, so the resample of a growing labelled
    set only grows (an item keeps its count) and is the same in every process.

    Example:
        >>> import torch
        >>> c = bootstrap_counts(torch.arange(100_000), member=0)
        >>> round(c.float().mean().item(), 2), round(c.float().var().item(), 2), round((c == 0).float().mean().item(), 2)
        (1.0, 1.0, 0.37)
    """
    h = np.asarray(torch.as_tensor(hashes, dtype=torch.int64).reshape(-1).numpy()).view(np.uint64)
    key = np.uint64(((int(seed) * 1_000_003 + int(member) + 1) * 0xD1B54A32D192ED03) & _MASK64)
    mixed = _splitmix64(h ^ key)
    u = (mixed >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))  # uniform in [0, 1)
    return torch.from_numpy(np.searchsorted(_POISSON1_CDF, u, side="right").astype(np.int64))


# ---------------------------------------------------------------------------------------- SURF
@dataclass(frozen=True)
class SURF:
    """SURF settings: pseudo-label unlabelled captions the ensemble is sure about.

    Attributes:
        tau: confidence threshold on the ensemble-mean P(helpful), in (0.5, 1]: pseudo-label 1
            at ``p >= tau``, 0 at ``p <= 1 - tau`` (0.999 in CleanRLHF).
        lam: weight of the pseudo-labelled loss (0.1 in CleanRLHF).
        batch_size: unlabelled captions drawn per step (default: the trainer's batch size).
    """

    tau: float = 0.999
    lam: float = 0.1
    batch_size: Optional[int] = None

    def __post_init__(self):
        if not 0.5 < self.tau <= 1.0:
            raise ValueError(f"SURF tau must be in (0.5, 1], got {self.tau}")
        if self.lam < 0:
            raise ValueError(f"SURF lam must be >= 0, got {self.lam}")


def surf_augment(
    messages: torch.Tensor,
    targets: torch.Tensor,
    unlabelled: Optional[torch.Tensor],
    probabilities: Optional[torch.Tensor],
    *,
    tau: float,
    lam: float,
    class_weights: Optional[torch.Tensor] = None,
) -> TensorDict:
    """A labelled batch plus the confidently pseudo-labelled unlabelled captions, with weights.

    The weights make ``surf_loss = Σ weight · CE`` equal to the trainer's loss on the labelled
    rows (``CrossEntropyLoss(weight=class_weights)``, a class-weighted mean) plus ``lam`` times
    the mean cross-entropy on the pseudo-labelled rows.

    Args:
        messages: ``uint8[B, 256]`` labelled captions; ``targets``: ``int64[B]`` classes 0/1.
        unlabelled: ``uint8[U, 256]`` unlabelled captions (or ``None``).
        probabilities: ``float[U]`` the ensemble-mean P(helpful) of ``unlabelled``.
        tau, lam: see :class:`SURF`.
        class_weights: ``float[2]`` per-class loss weights of the labelled rows (or ``None``).

    Returns:
        a TensorDict ``[B + P]`` (P = confident unlabelled captions): ``message`` uint8[256],
        ``target`` int64, ``weight`` float32, ``pseudo`` bool.

    Example:
        >>> import torch
        >>> m = torch.zeros(2, 256, dtype=torch.uint8)
        >>> out = surf_augment(m, torch.tensor([1, 0]), m.repeat(2, 1), torch.tensor([0.999, 0.9, 0.0005, 0.5]),
        ...                    tau=0.99, lam=0.1)
        >>> out["target"].tolist(), out["weight"].tolist(), out["pseudo"].tolist()
        ([1, 0, 1, 0], [0.5, 0.5, 0.05000000074505806, 0.05000000074505806], [False, False, True, True])
    """
    messages = as_message_tensor(messages).reshape(-1, MESSAGE_LEN)
    targets = torch.as_tensor(targets, dtype=torch.int64).reshape(-1).to(messages.device)
    if len(targets) != len(messages):
        raise ValueError(f"{len(messages)} messages but {len(targets)} targets")
    if class_weights is None:
        w = torch.ones(len(targets), dtype=torch.float32, device=messages.device)
    else:
        w = torch.as_tensor(class_weights, dtype=torch.float32, device=messages.device)[targets]
    weight = w / w.sum() if len(w) else w
    parts_m, parts_t, parts_w = [messages], [targets], [weight]
    pseudo_n = 0
    if unlabelled is not None and probabilities is not None and len(unlabelled) and lam > 0:
        unlabelled = as_message_tensor(unlabelled, messages.device).reshape(-1, MESSAGE_LEN)
        p = torch.as_tensor(probabilities, dtype=torch.float32).reshape(-1).to(messages.device)
        if len(p) != len(unlabelled):
            raise ValueError(f"{len(unlabelled)} unlabelled captions but {len(p)} probabilities")
        positive, negative = p >= tau, p <= 1.0 - tau
        confident = positive | negative
        pseudo_n = int(confident.sum())
        if pseudo_n:
            parts_m.append(unlabelled[confident])
            parts_t.append(positive[confident].long())
            parts_w.append(torch.full((pseudo_n,), lam / pseudo_n, dtype=torch.float32, device=messages.device))
    pseudo = torch.zeros(len(targets) + pseudo_n, dtype=torch.bool, device=messages.device)
    pseudo[len(targets):] = True
    return TensorDict(
        {"message": torch.cat(parts_m), "target": torch.cat(parts_t), "weight": torch.cat(parts_w), "pseudo": pseudo},
        batch_size=[len(pseudo)],
    )


def surf_loss(logits: torch.Tensor, batch: TensorDict) -> torch.Tensor:
    """``Σ weight · CE(logits, target)`` over a :func:`surf_augment` batch."""
    ce = nn.functional.cross_entropy(logits, batch["target"].to(logits.device), reduction="none")
    return (batch["weight"].to(logits.device) * ce).sum()


# ---------------------------------------------------------------------------------------- trainers
class _BootstrapCaptions:
    """The labelled set member ``m`` sees: the parent's snapshot with Poisson(1) copies."""

    def __init__(self, parent: "EnsembleClassifierTrainer", member: int):
        self.parent = parent
        self.member = member

    def labelled(self):
        messages, hashes, labels = self.parent._snapshot
        if not self.parent.bootstrap or len(hashes) == 0:
            return messages, hashes, labels
        counts = bootstrap_counts(hashes, self.member, self.parent.seed)
        counts[holdout_mask(hashes, self.parent.holdout_fraction)] = 1
        idx = torch.repeat_interleave(torch.arange(len(hashes)), counts)
        return messages[idx], hashes[idx], labels[idx]


UnlabelledSource = Callable[[int, np.random.Generator], torch.Tensor]


class EnsembleClassifierTrainer(ScheduledTraining):
    """Trains every member of a :class:`ClassifierEnsemble` on its bootstrap of the store's labels.

    Each member has its own :class:`ClassifierTrainer` (own copy of the network, Adam state,
    balanced sampler, seed ``seed + m``). One snapshot of the store's labels per refresh is
    shared by all members. Without SURF a step is exactly ``ClassifierTrainer.train_steps``;
    with SURF, each step draws unlabelled captions, pseudo-labels the confident ones with the
    ensemble's mean, and trains every member on :func:`surf_augment` of its own labelled batch.
    :meth:`after_iteration` runs what the (shared) schedule says is due, for every member.

    Args:
        ensemble (ClassifierEnsemble): the ensemble to keep up to date.
        store: a labelled-captions store (``labelled()`` or ``labelled_data()``).
        bootstrap (bool): resample the labelled set per member (:func:`bootstrap_counts`).
        surf (SURF, optional): pseudo-labelling settings; needs ``unlabelled``.
        unlabelled (callable, optional): ``(n, numpy Generator) -> uint8[k <= n, 256]`` unlabelled
            captions; defaults to ``store.sample_unlabelled`` when the store has one.
        seed (int): member trainers use ``seed + m``; bootstrap resamples use ``seed``.
        **trainer_kwargs: passed to each :class:`ClassifierTrainer` (``lr``, ``batch_size``,
            ``holdout_fraction``, ``balance``, ``schedule``, ``device``).

    Example:
        >>> import torch
        >>> from torchrl_oni.captions import encode_messages, hash_messages
        >>> class Store:
        ...     m = torch.as_tensor(encode_messages(["You kill it!", "A wall."] * 4))
        ...     def labelled(self):
        ...         return self.m, torch.as_tensor(hash_messages(self.m)), torch.tensor([1.0, 0.0] * 4)
        >>> from torchrl_oni.rewards.ensemble import ClassifierEnsemble
        >>> ens = ClassifierEnsemble(size=2)
        >>> trainer = EnsembleClassifierTrainer(ens, Store(), batch_size=4, holdout_fraction=0.0)
        >>> trainer.train_steps(2)["steps"]
        2
    """

    def __init__(
        self,
        ensemble: ClassifierEnsemble,
        store,
        *,
        bootstrap: bool = True,
        surf: Optional[SURF] = None,
        unlabelled: Optional[UnlabelledSource] = None,
        seed: int = 0,
        **trainer_kwargs,
    ):
        if surf is not None and unlabelled is None:
            unlabelled = getattr(store, "sample_unlabelled", None)
            if unlabelled is None:
                raise ValueError("SURF needs unlabelled captions: pass unlabelled=(n, rng) -> uint8[k, 256] "
                                 "or a store with sample_unlabelled(n, generator)")
        self.ensemble = ensemble
        self.store = store
        self.bootstrap = bool(bootstrap)
        self.surf = surf
        self.unlabelled = unlabelled
        self.seed = int(seed)
        self.rng = np.random.default_rng(seed)
        self.trainers = [
            ClassifierTrainer(member, _BootstrapCaptions(self, m), seed=self.seed + m, **trainer_kwargs)
            for m, member in enumerate(ensemble.members)
        ]
        first = self.trainers[0]
        self.holdout_fraction = first.holdout_fraction
        self.schedule = first.schedule
        self.batch_size = first.batch_size
        self.dataset_size = 0
        self.pseudo_labelled_total = 0
        self._snapshot = (torch.zeros(0, MESSAGE_LEN, dtype=torch.uint8), torch.zeros(0, dtype=torch.int64),
                          torch.zeros(0))

    @property
    def total_steps(self) -> int:
        return self.trainers[0].total_steps

    def refresh(self) -> int:
        """One snapshot of the store's labels for every member; returns how many are labelled."""
        messages, hashes, labels = labelled_arrays(self.store)
        self._snapshot = (
            as_message_tensor(messages).reshape(-1, MESSAGE_LEN).cpu(),
            torch.as_tensor(hashes, dtype=torch.int64).reshape(-1).cpu(),
            torch.as_tensor(labels, dtype=torch.float32).reshape(-1).cpu(),
        )
        for trainer in self.trainers:
            trainer.refresh()
        self.dataset_size = int((~torch.isnan(self._snapshot[2])).sum())
        return self.dataset_size

    def train_steps(self, n: int, publish: bool = True, refresh: bool = True) -> dict:
        """``n`` gradient steps for every member.

        Returns:
            ``{"steps", "loss", "train_accuracy", "dataset_size", "pseudo_labelled"}``: loss and
            accuracy averaged over members (NaN when nothing was trained), ``pseudo_labelled``
            the pseudo-labelled captions used per step on average.
        """
        if refresh:
            self.refresh()
        if self.surf is None:
            results = [t.train_steps(n, publish=publish, refresh=False) for t in self.trainers]
            pseudo = 0.0
        else:
            results, pseudo = self._surf_steps(n, publish)
        steps = results[0]["steps"]
        if steps == 0:
            return {"steps": 0, "loss": float("nan"), "train_accuracy": float("nan"),
                    "dataset_size": self.dataset_size, "pseudo_labelled": 0.0}
        return {
            "steps": steps,
            "loss": float(np.mean([r["loss"] for r in results])),
            "train_accuracy": float(np.mean([r["train_accuracy"] for r in results])),
            "dataset_size": self.dataset_size,
            "pseudo_labelled": pseudo,
        }

    def _surf_steps(self, n: int, publish: bool):
        empty = {"steps": 0, "loss": float("nan"), "train_accuracy": float("nan")}
        if n <= 0 or any(t._train[1].numel() == 0 for t in self.trainers):
            return [empty] * len(self.trainers), 0.0
        surf = self.surf
        u_size = surf.batch_size or self.batch_size
        sums = [[0.0, 0, 0] for _ in self.trainers]  # loss, correct, seen (labelled rows)
        pseudo_total = 0
        for t in self.trainers:
            t.model.train()
        for _ in range(n):
            unlabelled = self.unlabelled(u_size, self.rng)
            probs = None
            if unlabelled is not None and len(unlabelled):
                unlabelled = as_message_tensor(unlabelled).reshape(-1, MESSAGE_LEN)
                probs = self.ensemble.helpful_probability(unlabelled)
            for k, trainer in enumerate(self.trainers):
                messages, classes = trainer._sample_batch()
                batch = surf_augment(messages, classes, unlabelled, probs, tau=surf.tau, lam=surf.lam,
                                     class_weights=trainer._class_weights())
                batch = batch.to(trainer.device)
                logits = trainer.model(batch["message"])
                loss = surf_loss(logits, batch)
                trainer.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                trainer.optimizer.step()
                labelled = ~batch["pseudo"]
                sums[k][0] += loss.item()
                sums[k][1] += int((logits[labelled].argmax(-1) == batch["target"][labelled]).sum())
                sums[k][2] += int(labelled.sum())
                if k == 0:
                    pseudo_total += int(batch["pseudo"].sum())
        for trainer in self.trainers:
            trainer.total_steps += n
            if publish:
                trainer.publish()
        self.pseudo_labelled_total += pseudo_total
        results = [{"steps": n, "loss": s[0] / n, "train_accuracy": s[1] / max(s[2], 1)} for s in sums]
        return results, pseudo_total / n

    def publish(self) -> None:
        for trainer in self.trainers:
            trainer.publish()

    def dataset_size_now(self) -> int:
        """Labelled captions in the store now (for the schedule)."""
        if hasattr(self.store, "stats"):
            return int(self.store.stats()["labelled"])
        return self.refresh()  # the members read the parent's snapshot: refresh it, not theirs

    @torch.no_grad()
    def evaluate(self, refresh: bool = True) -> dict:
        """Held-out accuracy of the *ensemble* (published members, mean P > threshold).

        Returns:
            ``{"heldout_accuracy", "heldout_balanced_accuracy", "heldout_size", "train_size"}``.
        """
        if refresh:
            self.refresh()
        messages, hashes, labels = self._snapshot
        valid = ~torch.isnan(labels)
        messages, hashes, labels = messages[valid], hashes[valid], labels[valid]
        held = holdout_mask(hashes, self.holdout_fraction)
        classes = (labels[held] > 0.5).long()
        result = {"heldout_size": int(held.sum()), "train_size": int((~held).sum())}
        if classes.numel() == 0:
            result.update(heldout_accuracy=float("nan"), heldout_balanced_accuracy=float("nan"))
            return result
        predicted = self.ensemble(messages[held], hashes[held]).long()
        result["heldout_accuracy"] = float((predicted == classes).float().mean())
        recalls = [float((predicted[classes == c] == c).float().mean()) for c in (0, 1) if bool((classes == c).any())]
        result["heldout_balanced_accuracy"] = sum(recalls) / len(recalls)
        return result

    def state_dict(self) -> dict:
        return {"trainers": [t.state_dict() for t in self.trainers], "rng": self.rng.bit_generator.state,
                "pseudo_labelled_total": self.pseudo_labelled_total}

    def load_state_dict(self, state: dict) -> None:
        for trainer, trainer_state in zip(self.trainers, state["trainers"], strict=True):
            trainer.load_state_dict(trainer_state)
        self.rng.bit_generator.state = state["rng"]
        self.pseudo_labelled_total = int(state.get("pseudo_labelled_total", 0))


class _BootstrapPairs:
    """The labelled pairs member ``m`` sees: each sampled pair repeated Poisson(1) times."""

    def __init__(self, store, member: int, seed: int):
        self.store = store
        self.member = member
        self.seed = seed
        self.rng = np.random.default_rng([seed, member])

    def _sample(self, n: int):
        try:
            return self.store.sample_labelled_pairs(n, generator=self.rng)
        except TypeError:  # a store whose sampler takes no generator
            return self.store.sample_labelled_pairs(n)

    def sample_labelled_pairs(self, n: int):
        batch = self._sample(n)
        if isinstance(batch, (tuple, list)):
            first, second, pref = batch
            ha = torch.as_tensor(hash_messages(as_message_tensor(first)))
            hb = torch.as_tensor(hash_messages(as_message_tensor(second)))
        else:
            first, second, pref = batch["message_a"], batch["message_b"], batch["preference"]
            ha, hb = batch.get("caption_hash_a", None), batch.get("caption_hash_b", None)
            if ha is None or hb is None:
                ha = torch.as_tensor(hash_messages(as_message_tensor(first)))
                hb = torch.as_tensor(hash_messages(as_message_tensor(second)))
        first, second = torch.as_tensor(first), torch.as_tensor(second)
        pref = torch.as_tensor(pref, dtype=torch.float32).reshape(-1)
        if len(pref) == 0:
            return first, second, pref
        # an ordered pair's key: mix the first hash before combining, so (a, b) != (b, a)
        ha = torch.as_tensor(ha, dtype=torch.int64).reshape(-1).numpy().view(np.uint64)
        hb = torch.as_tensor(hb, dtype=torch.int64).reshape(-1).numpy().view(np.uint64)
        key = torch.from_numpy((_splitmix64(ha) ^ hb).view(np.int64))
        idx = torch.repeat_interleave(torch.arange(len(pref)), bootstrap_counts(key, self.member, self.seed))
        return first[idx], second[idx], pref[idx]

    def __getattr__(self, name):  # num_labelled_pairs(), stats() for the schedule
        return getattr(self.store, name)


class EnsembleRankingTrainer(ScheduledTraining):
    """Trains every member of a :class:`RankingEnsemble` with its own :class:`RankingTrainer`.

    Each member's batches are the store's labelled pairs, each repeated Poisson(1) times
    (a bootstrap of the pair set, deterministic per ordered pair and member).

    Args:
        ensemble (RankingEnsemble): the ensemble.
        store: a labelled-pairs store (``sample_labelled_pairs``).
        bootstrap (bool): resample per member; ``False`` gives every member the plain batches.
        seed (int): seed of the members' samplers and resamples.
        **trainer_kwargs: passed to each :class:`RankingTrainer`.

    Example:
        >>> import torch
        >>> from torchrl_oni.captions import encode_messages
        >>> from torchrl_oni.rewards.ensemble import RankingEnsemble
        >>> class Pairs:
        ...     def sample_labelled_pairs(self, n):
        ...         a = torch.as_tensor(encode_messages(["You kill it!"] * n))
        ...         b = torch.as_tensor(encode_messages(["A wall."] * n))
        ...         return a, b, torch.zeros(n)
        >>> trainer = EnsembleRankingTrainer(RankingEnsemble(size=2), Pairs(), bootstrap=False, batch_size=4)
        >>> trainer.train_steps(2)["steps"]
        2
    """

    def __init__(self, ensemble: RankingEnsemble, store, *, bootstrap: bool = True, seed: int = 0, **trainer_kwargs):
        self.ensemble = ensemble
        self.store = store
        self.trainers = [
            RankingTrainer(member, _BootstrapPairs(store, m, seed) if bootstrap else store, **trainer_kwargs)
            for m, member in enumerate(ensemble.members)
        ]
        self.schedule = self.trainers[0].schedule

    @property
    def total_steps(self) -> int:
        """Gradient steps taken by every member (the fewest, if a member ran out of pairs)."""
        return min(t.total_steps for t in self.trainers)

    def train_steps(self, n: int, publish: bool = True) -> dict:
        """``n`` steps per member; ``{"steps", "loss", "accuracy"}`` averaged over members."""
        results = [t.train_steps(n, publish=publish) for t in self.trainers]
        steps = min(r["steps"] for r in results)
        return {
            "steps": steps,
            "loss": float(np.nanmean([r["loss"] for r in results])) if steps else float("nan"),
            "accuracy": float(np.nanmean([r["accuracy"] for r in results]))
            if steps and not all(math.isnan(r["accuracy"]) for r in results) else float("nan"),
        }

    def dataset_size_now(self) -> int:
        """Labelled pairs in the store now (for the schedule)."""
        return self.trainers[0].dataset_size_now()

    def state_dict(self) -> dict:
        return {"trainers": [t.state_dict() for t in self.trainers]}

    def load_state_dict(self, state: dict) -> None:
        for trainer, trainer_state in zip(self.trainers, state["trainers"], strict=True):
            trainer.load_state_dict(trainer_state)
