"""Label budgets and active query selection: which captions (or pairs) to pay a labeller for, and when.

Two pure pieces (torch/numpy, no I/O, no threads) and one small adapter:

* :class:`LabelBudget` — how many labels (or LLM tokens) may be spent by a given point of
  training: a rate per million frames, spread by a ``constant``, ``linear`` or ``exponential``
  schedule over the run (the last two front-load it: early labels shape the reward the agent
  learns from for longest).
* :func:`select` / :func:`utility` — which of a set of candidates to query first, by one of
  :data:`RULES`: ``fifo``, ``frequency``, ``uniform``, ``disagree`` (spread of an ensemble's
  predictions) or ``entropy`` (binary entropy of the ensemble mean).
* :class:`SelectiveClaim` — a drop-in replacement for ``CaptionStore.claim`` that applies a
  budget and a rule (what ``AnnotationWorker`` calls instead of ``store.claim``).

Candidates (contract shared by every rule; a ``TensorDict`` or a mapping of tensors, batch ``[N]``):

==================  ============  =====================================================================
key                 shape/dtype   meaning
==================  ============  =====================================================================
``order``           int64[N]      arrival order, smaller = older (``fifo``; default ``arange(N)``)
``times_seen``      int64[N]      how often the caption was seen (``frequency``)
``member_probs``    float[N, M]   each of M ensemble members' probability: P(progress) for a caption,
                                  P(second is better) for a pair (``disagree``, ``entropy``)
==================  ============  =====================================================================

For pairs, :func:`pair_member_probs` turns two captions' member scores into ``member_probs`` with
Bradley–Terry: ``P_m(second better) = sigmoid(s_m(second) - s_m(first))``, the probability
:func:`~torchrl_oni.rewards.ranking.bradley_terry_loss` trains.

Example:
    >>> import torch
    >>> from torchrl_oni.queries import LabelBudget, select
    >>> budget = LabelBudget(per_million=1000)          # 1,000 labels per 1M frames, constant
    >>> budget.allowed(250_000)
    250
    >>> budget.spend(200); budget.allowed(250_000)
    50
    >>> cands = {"times_seen": torch.tensor([5, 50, 1]),
    ...          "member_probs": torch.tensor([[0.3, 0.9], [0.5, 0.5], [0.0, 0.1]])}
    >>> select(cands, 2, "frequency").tolist()
    [1, 0]
    >>> select(cands, 1, "disagree").tolist(), select(cands, 1, "entropy").tolist()
    ([0], [1])
"""
from __future__ import annotations

import math
import threading
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch

__all__ = [
    "RULES",
    "SCHEDULES",
    "LabelBudget",
    "binary_entropy",
    "disagreement",
    "pair_member_probs",
    "utility",
    "select",
    "SelectiveClaim",
]

RULES = ("fifo", "frequency", "uniform", "disagree", "entropy")
SCHEDULES = ("constant", "linear", "exponential")
UNITS = ("labels", "tokens")

Candidates = Mapping[str, torch.Tensor]


# ---------------------------------------------------------------------------------------- budget
class LabelBudget:
    """How many labels (or tokens) may have been spent after ``frames`` frames of training.

    The allowance is a cumulative curve ``A(f)`` over frames, and ``allowed(f) = A(f) - spent``:

    * ``constant``: ``A(f) = initial + rate · f / 1e6`` (needs no horizon; the budget keeps
      growing as long as training runs).
    * ``linear``: the rate falls linearly from ``2·rate`` to 0 over ``total_frames``:
      ``A(f) = initial + B · (2x − x²)``, ``x = min(f / total_frames, 1)``,
      ``B = rate · total_frames / 1e6``.
    * ``exponential``: the rate decays as ``exp(−λx)``: ``A(f) = initial + B · (1 − e^{−λx}) /
      (1 − e^{−λ})``. ``λ = 3`` spends 63 % of ``B`` in the first third of the run.

    All three spend the same total ``B`` over ``total_frames``; after the horizon the linear and
    exponential curves stop growing. Unused allowance carries over (nothing is lost by a slow
    labeller), and ``spend`` may overdraw (a batch already in flight is never cut): ``allowed``
    is then 0 until the curve catches up.

    Args:
        per_million (float): labels (``unit="labels"``) or annotator tokens (``unit="tokens"``)
            per million frames, averaged over the run.
        schedule (str): one of :data:`SCHEDULES`. Default ``"constant"``.
        total_frames (int, optional): the run's length; required by ``linear``/``exponential``.
        initial (float): allowance available at frame 0 (a warm-start set of labels). Default 0.
        decay (float): ``λ`` of the exponential schedule. Default 3.
        unit (str): ``"labels"`` (each caption or pair costs 1) or ``"tokens"`` (callers pass the
            per-item token costs to :meth:`take`).

    Example:
        >>> b = LabelBudget(per_million=100, schedule="linear", total_frames=2_000_000)
        >>> [b.allowed(f) for f in (0, 500_000, 1_000_000, 2_000_000, 3_000_000)]
        [0, 87, 150, 200, 200]
        >>> b.take(10, frames=1_000_000), b.take(1000, frames=1_000_000), b.spent
        (10, 140, 150.0)
    """

    def __init__(
        self,
        per_million: float,
        schedule: str = "constant",
        *,
        total_frames: Optional[int] = None,
        initial: float = 0.0,
        decay: float = 3.0,
        unit: str = "labels",
    ):
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
        if unit not in UNITS:
            raise ValueError(f"unit must be one of {', '.join(UNITS)}, got {unit!r}")
        if not per_million >= 0 or not math.isfinite(per_million):
            raise ValueError(f"per_million must be a finite number >= 0, got {per_million}")
        if initial < 0:
            raise ValueError(f"initial must be >= 0, got {initial}")
        if schedule != "constant" and (total_frames is None or total_frames <= 0):
            raise ValueError(f"the {schedule!r} schedule needs total_frames > 0")
        if schedule == "exponential" and not decay > 0:
            raise ValueError(f"decay must be > 0, got {decay}")
        self.per_million = float(per_million)
        self.schedule = schedule
        self.total_frames = None if total_frames is None else int(total_frames)
        self.initial = float(initial)
        self.decay = float(decay)
        self.unit = unit
        self.spent = 0.0
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(per_million={self.per_million:g}, schedule={self.schedule!r}, "
                f"total_frames={self.total_frames}, unit={self.unit!r}, spent={self.spent:g})")

    def cumulative(self, frames: float) -> float:
        """``A(frames)``: the allowance earned since frame 0 (before anything was spent)."""
        frames = max(float(frames), 0.0)
        if self.schedule == "constant":
            return self.initial + self.per_million * frames / 1e6
        total = self.per_million * self.total_frames / 1e6
        x = min(frames / self.total_frames, 1.0)
        if self.schedule == "linear":
            shape = 2.0 * x - x * x
        else:
            shape = -math.expm1(-self.decay * x) / -math.expm1(-self.decay)
        return self.initial + total * shape

    def allowed(self, frames: float) -> int:
        """Whole labels (or tokens) that may be spent now; never negative."""
        with self._lock:
            # a tiny epsilon so that 0.1 + 0.2-style rounding never withholds a label
            return max(int(math.floor(self.cumulative(frames) - self.spent + 1e-9)), 0)

    def spend(self, amount: float) -> None:
        """Records ``amount`` labels (or tokens) as spent."""
        if amount < 0:
            raise ValueError(f"cannot spend a negative amount ({amount})")
        with self._lock:
            self.spent += float(amount)

    def refund(self, amount: float) -> None:
        """Gives back ``amount`` spent on items that cost nothing after all (a request that never
        reached a labeller); ``spent`` never goes below 0."""
        if amount < 0:
            raise ValueError(f"cannot refund a negative amount ({amount})")
        with self._lock:
            self.spent = max(self.spent - float(amount), 0.0)

    def take(self, costs: Union[int, Sequence[float]], frames: float) -> int:
        """Spends as many items as fit now, in order, and returns how many.

        Args:
            costs: the number of items (each costs 1), or one cost per item (e.g. tokens).
            frames: training frames so far.
        """
        if isinstance(costs, (int, np.integer)):
            costs = np.ones(max(int(costs), 0))
        costs = np.asarray(costs, dtype=np.float64).reshape(-1)
        if (costs < 0).any():
            raise ValueError("costs must be >= 0")
        with self._lock:
            left = self.cumulative(frames) - self.spent + 1e-9
            n = int(np.searchsorted(np.cumsum(costs), left, side="right"))
            self.spent += float(costs[:n].sum())
        return n

    def state_dict(self) -> dict:
        return {"spent": self.spent}

    def load_state_dict(self, state: dict) -> None:
        self.spent = float(state["spent"])

    def metrics(self, frames: float) -> dict:
        """``{"spent", "earned", "allowed"}`` at ``frames`` (for the logs)."""
        return {"spent": self.spent, "earned": self.cumulative(frames), "allowed": float(self.allowed(frames))}


# ---------------------------------------------------------------------------------------- scores
def binary_entropy(p: torch.Tensor) -> torch.Tensor:
    """``H(p) = −p log p − (1 − p) log(1 − p)`` in nats, 0 at p ∈ {0, 1}.

    Example:
        >>> import torch
        >>> binary_entropy(torch.tensor([0.0, 0.5, 1.0])).tolist() == [0.0, math.log(2), 0.0]
        True
    """
    p = torch.as_tensor(p, dtype=torch.float64)
    return -(torch.special.xlogy(p, p) + torch.special.xlogy(1.0 - p, 1.0 - p))


def disagreement(member_probs: torch.Tensor) -> torch.Tensor:
    """Standard deviation over the members (last dim) of ``float[N, M]`` predictions, ``[N]``.

    The population std (divisor M), so that one member (M = 1) gives 0 rather than NaN.
    """
    member_probs = torch.as_tensor(member_probs, dtype=torch.float64)
    if member_probs.ndim != 2:
        raise ValueError(f"member_probs must be [N, M], got shape {tuple(member_probs.shape)}")
    return member_probs.std(dim=-1, unbiased=False)


def pair_member_probs(scores_first: torch.Tensor, scores_second: torch.Tensor) -> torch.Tensor:
    """Bradley–Terry ``P_m(second better) = sigmoid(s_m(second) − s_m(first))``, ``float[N, M]``.

    Args:
        scores_first, scores_second: ``float[N, M]`` each member's score of the pair's first
            and second caption (a ranking model's ``g(m)``, or a classifier's logit).

    Example:
        >>> import torch
        >>> pair_member_probs(torch.tensor([[0.0, 1.0]]), torch.tensor([[0.0, 0.0]])).tolist()[0][0]
        0.5
    """
    a = torch.as_tensor(scores_first, dtype=torch.float64)
    b = torch.as_tensor(scores_second, dtype=torch.float64)
    if a.shape != b.shape:
        raise ValueError(f"score shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    return torch.sigmoid(b - a)


def _length(candidates: Candidates) -> int:
    if hasattr(candidates, "batch_size") and len(candidates.batch_size):
        return int(candidates.batch_size[0])
    for value in candidates.values():
        return int(torch.as_tensor(value).shape[0])
    raise ValueError("candidates is empty: give at least one of order, times_seen, member_probs")


def _get(candidates: Candidates, key: str, rule: str) -> torch.Tensor:
    value = candidates.get(key, None)
    if value is None:
        raise KeyError(f"rule {rule!r} needs candidates[{key!r}]")
    return torch.as_tensor(value)


def utility(
    candidates: Candidates, rule: str, *, generator: Optional[torch.Generator] = None
) -> torch.Tensor:
    """``float64[N]``: how useful each candidate is to query under ``rule`` (higher = sooner).

    * ``fifo``: ``−order`` (oldest first);
    * ``frequency``: ``times_seen`` (a label for a frequent caption covers more steps);
    * ``uniform``: i.i.d. uniform noise (a random order, from ``generator``);
    * ``disagree``: :func:`disagreement` of ``member_probs``;
    * ``entropy``: :func:`binary_entropy` of the members' mean.
    """
    if rule not in RULES:
        raise ValueError(f"rule must be one of {', '.join(RULES)}, got {rule!r}")
    n = _length(candidates)
    if rule == "fifo":
        order = candidates.get("order", None)
        order = torch.arange(n) if order is None else torch.as_tensor(order)
        return -order.to(torch.float64).reshape(n)
    if rule == "frequency":
        return _get(candidates, "times_seen", rule).to(torch.float64).reshape(n)
    if rule == "uniform":
        return torch.rand(n, generator=generator, dtype=torch.float64)
    probs = _get(candidates, "member_probs", rule)
    if probs.ndim != 2 or probs.shape[0] != n:
        raise ValueError(f"member_probs must be [N={n}, M], got shape {tuple(probs.shape)}")
    if rule == "disagree":
        return disagreement(probs)
    return binary_entropy(probs.to(torch.float64).mean(dim=-1))


def select(
    candidates: Candidates, k: int, rule: str, *, generator: Optional[torch.Generator] = None
) -> torch.Tensor:
    """Indices of the ``min(k, N)`` most useful candidates under ``rule``, most useful first.

    Ties keep arrival order (``order`` when given, else position), so every rule is
    deterministic apart from ``uniform``'s generator.

    Returns:
        ``LongTensor[min(k, N)]``.
    """
    n = _length(candidates)
    k = max(min(int(k), n), 0)
    if k == 0:
        return torch.zeros(0, dtype=torch.int64)
    score = utility(candidates, rule, generator=generator).numpy()
    order = candidates.get("order", None)
    age = np.arange(n) if order is None else torch.as_tensor(order).reshape(n).numpy()
    # lexsort's last key is the primary one: highest score, then oldest
    ranked = np.lexsort((age, -score))[:k]
    return torch.from_numpy(ranked.astype(np.int64))


# ---------------------------------------------------------------------------------------- claim
MemberProbs = Callable[[torch.Tensor], torch.Tensor]


class SelectiveClaim:
    """``store.claim`` under a budget and a selection rule: hand it to ``AnnotationWorker``.

    Each call claims the first ``pool_size`` claimable captions in the store's order (its
    ``claim_order``, ``oni-train --claim-order``), marking them pending, keeps the ``max_items``
    best under ``rule`` that the budget allows, and releases the rest back to unseen — so a
    caption is never lost and the store's retry and backoff rules keep applying. With ``rule="frequency"`` and no budget it behaves like
    ``store.claim``. Every rule chooses within that pool (``fifo``: oldest of the pool by row
    slot; ``uniform``: a random member of it), which keeps a call cheap on a large backlog.

    Args:
        store: a :class:`~torchrl_oni.store.CaptionStore` (uses ``claim`` and ``release``).
        rule (str): one of :data:`RULES`.
        budget (LabelBudget, optional): spent per claimed caption (``unit="labels"``), or per
            token when ``unit="tokens"`` (costs from ``token_cost``); unlimited when ``None``.
        member_probs (callable, optional): ``uint8[N, 256] -> float[N, M]`` member predictions
            (e.g. :meth:`~torchrl_oni.rewards.ensemble.ClassifierEnsemble.member_probabilities`),
            required by ``disagree``/``entropy``.
        pool_size (int): captions considered per call. Default 1024.
        token_cost (callable, optional): ``list[str] -> costs`` for a token budget.
        seed (int): seed of the ``uniform`` rule.

    The trainer tells it how far training is with :meth:`set_frames` (read by the budget).
    ``AnnotationWorker`` settles the accounts: :meth:`refund` gives the budget back for captions
    whose request failed for a server reason or was cancelled (they cost nothing and are asked
    again later), :meth:`settle` closes those paid for (labelled, unparsable or skipped).

    Example (a stand-in for the store: ``claim`` hands out most-seen first, ``release`` returns):
        >>> import torch
        >>> class Store:
        ...     def __init__(self, texts): self.unseen = list(texts)
        ...     def claim(self, n):
        ...         out, self.unseen = self.unseen[:n], self.unseen[n:]
        ...         return torch.arange(len(out)), out
        ...     def release(self, hashes): self.released = hashes.tolist()
        >>> store = Store(["You kill the newt!", "It's a wall.", "You see here a scroll."])
        >>> claim = SelectiveClaim(store, "frequency", budget=LabelBudget(per_million=2, initial=1))
        >>> claim(10)[1]                   # 1 label allowed at frame 0; the other two go back
        ['You kill the newt!']
        >>> store.released
        [1, 2]
    """

    def __init__(
        self,
        store,
        rule: str = "frequency",
        *,
        budget: Optional[LabelBudget] = None,
        member_probs: Optional[MemberProbs] = None,
        pool_size: int = 1024,
        token_cost: Optional[Callable[[List[str]], Sequence[float]]] = None,
        seed: int = 0,
    ):
        if rule not in RULES:
            raise ValueError(f"rule must be one of {', '.join(RULES)}, got {rule!r}")
        if rule in ("disagree", "entropy") and member_probs is None:
            raise ValueError(f"rule {rule!r} needs member_probs (an ensemble's member predictions)")
        if budget is not None and budget.unit == "tokens" and token_cost is None:
            raise ValueError("a token budget needs token_cost (texts -> tokens per text)")
        if pool_size < 1:
            raise ValueError(f"pool_size must be >= 1, got {pool_size}")
        self.store = store
        self.rule = rule
        self.budget = budget
        self.member_probs = member_probs
        self.pool_size = int(pool_size)
        self.token_cost = token_cost
        self.generator = torch.Generator().manual_seed(seed)
        self.frames = 0
        self.claimed_total = 0
        self.refunded_total = 0
        # caption hash -> what its claim cost, until the worker settles or refunds it
        self._outstanding: Dict[int, float] = {}
        self._accounts = threading.Lock()

    def set_frames(self, frames: int) -> None:
        """Training progress, for the budget (thread-safe: one int assignment)."""
        self.frames = int(frames)

    def __call__(self, max_items: int) -> Tuple[torch.Tensor, List[str]]:
        """Like ``CaptionStore.claim``: ``(hashes LongTensor[n], texts)``, marked pending."""
        from torchrl_oni.captions import encode_messages

        max_items = max(int(max_items), 0)
        if self.budget is not None and self.budget.unit == "labels":
            max_items = min(max_items, self.budget.allowed(self.frames))
        if max_items == 0:
            return torch.zeros(0, dtype=torch.int64), []
        pool = max(self.pool_size, max_items)
        hashes, texts = self.store.claim(pool)
        if not texts:
            return hashes, texts
        # store.claim hands out in its claim order (most seen, or most seen per caption first seen
        # since): its position is the frequency rank; a caption's row slot is its arrival order (fifo)
        slots = getattr(self.store, "slots", None)
        order = torch.as_tensor(slots(hashes)).reshape(-1) if callable(slots) else torch.arange(len(texts))
        cands = {"order": order, "times_seen": -torch.arange(len(texts), dtype=torch.float64)}
        try:
            if self.rule in ("disagree", "entropy"):
                with torch.no_grad():
                    probs = self.member_probs(torch.from_numpy(encode_messages(texts)))
                cands["member_probs"] = torch.as_tensor(probs)
            ranked = select(cands, len(texts), self.rule, generator=self.generator).tolist()
        except BaseException:
            self.store.release(hashes)  # nothing stays pending because the scorer failed
            raise
        keep = ranked[:max_items]
        if self.budget is not None:
            if self.budget.unit == "labels":
                costs = np.ones(len(keep))
            else:
                costs = np.asarray(self.token_cost([texts[i] for i in keep]), dtype=np.float64).reshape(-1)
            keep = keep[: self.budget.take(costs, self.frames)]
            with self._accounts:
                for i, cost in zip(keep, costs.tolist()):
                    self._outstanding[int(hashes[i])] = cost
        dropped = sorted(set(range(len(texts))) - set(keep))
        if dropped:
            self.store.release(hashes[dropped])
        self.claimed_total += len(keep)
        return hashes[keep], [texts[i] for i in keep]

    def _close(self, hashes) -> float:
        with self._accounts:
            return sum(self._outstanding.pop(int(h), 0.0) for h in torch.as_tensor(hashes).reshape(-1).tolist())

    def settle(self, hashes) -> None:
        """These claimed captions were paid for (answered, even unparsably, or skipped)."""
        self._close(hashes)

    def refund(self, hashes) -> None:
        """These claimed captions cost nothing (server fault, cancelled): the budget gets them back."""
        amount = self._close(hashes)
        if amount and self.budget is not None:
            self.budget.refund(amount)
            self.refunded_total += len(torch.as_tensor(hashes).reshape(-1))

    def metrics(self) -> Dict[str, float]:
        """``claimed_total``, ``refunded_total``, ``outstanding`` and, with a budget,
        ``budget_spent``, ``budget_earned``, ``budget_allowed`` (labels or tokens)."""
        with self._accounts:
            outstanding = len(self._outstanding)
        out = {"claimed_total": float(self.claimed_total), "refunded_total": float(self.refunded_total),
               "outstanding": float(outstanding)}
        if self.budget is not None:
            out.update({f"budget_{k}": v for k, v in self.budget.metrics(self.frames).items()})
        return out

    def state_dict(self) -> dict:
        """The budget spent (outstanding claims are refunded: a restart asks them again) and the
        ``uniform`` rule's generator."""
        with self._accounts:  # the annotation thread settles accounts meanwhile
            outstanding = sum(self._outstanding.values())
        spent = self.budget.spent - outstanding if self.budget is not None else 0.0
        return {"spent": max(spent, 0.0), "claimed_total": self.claimed_total,
                "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        if self.budget is not None:
            self.budget.load_state_dict({"spent": state["spent"]})
        self.claimed_total = int(state.get("claimed_total", 0))
        if "generator" in state:
            self.generator.set_state(state["generator"])
