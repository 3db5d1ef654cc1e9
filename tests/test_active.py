"""Label budgets and active query selection (torchrl_oni.queries) on crafted inputs."""
import math

import numpy as np
import pytest
import torch

from torchrl_oni.queries import (
    RULES,
    LabelBudget,
    SelectiveClaim,
    binary_entropy,
    disagreement,
    pair_member_probs,
    select,
    utility,
)
from torchrl_oni.annotators.base import Provenance
from torchrl_oni.captions import encode_messages, hash_messages
from torchrl_oni.rewards.ranking import bradley_terry_loss
from torchrl_oni.store import CaptionStore


# ------------------------------------------------------------------------------------ budgets
def _integrated(rate, total_frames, per_million, frames, n=200_001):
    """Reference allowance: numerically integrate a rate shape normalised to spend B overall."""
    xs = np.linspace(0.0, 1.0, n)
    r = rate(xs)
    total = per_million * total_frames / 1e6
    cum = np.concatenate([[0.0], np.cumsum((r[1:] + r[:-1]) / 2 * np.diff(xs))])
    cum = cum / cum[-1] * total
    return float(np.interp(min(frames / total_frames, 1.0), xs, cum))


@pytest.mark.parametrize("schedule,rate", [
    ("linear", lambda x: 1.0 - x),
    ("exponential", lambda x: np.exp(-3.0 * x)),
    ("constant", lambda x: np.ones_like(x)),
])
def test_budget_curves_match_integrated_rates(schedule, rate):
    budget = LabelBudget(per_million=500, schedule=schedule, total_frames=4_000_000)
    for frames in (0, 1, 123_456, 1_000_000, 2_500_000, 4_000_000):
        assert budget.cumulative(frames) == pytest.approx(_integrated(rate, 4e6, 500, frames), abs=1e-3)
    assert budget.cumulative(4_000_000) == pytest.approx(2000.0)
    if schedule != "constant":  # the run's budget is spent by the horizon, not beyond
        assert budget.cumulative(9_000_000) == pytest.approx(2000.0)
    curve = [budget.cumulative(f) for f in np.linspace(0, 5e6, 60)]
    assert all(b >= a for a, b in zip(curve, curve[1:]))


def test_front_loaded_schedules_give_more_early():
    kw = dict(per_million=1000, total_frames=1_000_000)
    at = 250_000
    constant, linear, exp = (LabelBudget(schedule=s, **kw).allowed(at) for s in ("constant", "linear", "exponential"))
    assert constant == 250 and linear == 437 and exp > linear  # 1000·(1 − e^−0.75)/(1 − e^−3) = 552
    assert exp == math.floor(1000 * (1 - math.exp(-0.75)) / (1 - math.exp(-3)))


def test_budget_spend_take_and_overdraw():
    budget = LabelBudget(per_million=100, initial=5)
    assert budget.allowed(0) == 5
    assert budget.take(3, frames=0) == 3 and budget.allowed(0) == 2
    assert budget.take(10, frames=0) == 2 and budget.allowed(0) == 0
    assert budget.allowed(100_000) == 10  # 5 + 10 earned − 5 spent
    budget.spend(30)  # a batch already in flight may overdraw
    assert budget.allowed(100_000) == 0 and budget.allowed(300_000) == 0 and budget.allowed(500_000) == 20
    state = budget.state_dict()
    again = LabelBudget(per_million=100, initial=5)
    again.load_state_dict(state)
    assert again.allowed(500_000) == 20


def test_token_budget_takes_items_in_order_while_they_fit():
    budget = LabelBudget(per_million=1000, unit="tokens")  # 1000 tokens per 1M frames
    assert budget.take([300, 300, 300, 300], frames=1_000_000) == 3
    assert budget.spent == 900
    assert budget.take([150], frames=1_000_000) == 0 and budget.take([100], frames=1_000_000) == 1


@pytest.mark.parametrize("kwargs,message", [
    (dict(per_million=10, schedule="weekly"), "schedule must be one of"),
    (dict(per_million=10, schedule="linear"), "needs total_frames"),
    (dict(per_million=-1), "per_million"),
    (dict(per_million=10, unit="dollars"), "unit must be"),
])
def test_budget_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LabelBudget(**kwargs)


# ------------------------------------------------------------------------------------ selection
def test_scores_match_reference_formulas():
    probs = torch.tensor([[0.1, 0.9, 0.5], [0.5, 0.5, 0.5], [0.0, 0.0, 1.0], [0.2, 0.3, 0.25]])
    np.testing.assert_allclose(disagreement(probs).numpy(), np.std(probs.numpy().astype(np.float64), axis=1),
                               rtol=1e-6)
    mean = probs.double().mean(1).numpy()
    with np.errstate(divide="ignore", invalid="ignore"):
        ref = -(np.nan_to_num(mean * np.log(mean)) + np.nan_to_num((1 - mean) * np.log(1 - mean)))
    np.testing.assert_allclose(binary_entropy(torch.from_numpy(mean)).numpy(), ref, rtol=1e-9)
    assert binary_entropy(torch.tensor([0.0, 1.0])).tolist() == [0.0, 0.0]


def test_pair_probabilities_are_the_bradley_terry_of_the_loss():
    a = torch.tensor([[0.0, 2.0], [1.5, -1.0]], dtype=torch.float64)
    b = torch.tensor([[1.0, 0.0], [1.5, 3.0]], dtype=torch.float64)
    p = pair_member_probs(a, b)
    np.testing.assert_allclose(p.numpy(), 1 / (1 + np.exp(a.numpy() - b.numpy())), rtol=1e-9)
    # the loss on "second is better" is exactly -log of that probability
    loss = bradley_terry_loss(a[:, 0], b[:, 0], torch.ones(2))
    assert loss.item() == pytest.approx(-np.log(p[:, 0].numpy()).mean(), rel=1e-6)


def test_each_rule_orders_crafted_candidates():
    cands = {
        "order": torch.tensor([3, 0, 1, 2, 4]),
        "times_seen": torch.tensor([10, 10, 500, 1, 7]),
        # member P(progress): unanimous 0; split 0/1 (max std); 0.5 unanimous (max entropy, no std); ...
        "member_probs": torch.tensor([[0.0, 0.0], [0.0, 1.0], [0.5, 0.5], [0.2, 0.4], [0.9, 0.95]]),
    }
    assert select(cands, 5, "fifo").tolist() == [1, 2, 3, 0, 4]
    assert select(cands, 3, "frequency").tolist() == [2, 1, 0]  # 10 vs 10: the older (order 0) first
    assert select(cands, 2, "disagree").tolist() == [1, 3]
    # entropy: mean 0.5 for rows 1 and 2 (tie -> older row 1), then 0.3, then 0.925, then 0
    assert select(cands, 5, "entropy").tolist() == [1, 2, 3, 4, 0]
    assert select(cands, 99, "fifo").shape == (5,) and select(cands, 0, "fifo").shape == (0,)


def test_uniform_is_a_seeded_permutation():
    cands = {"times_seen": torch.zeros(50)}
    a = select(cands, 50, "uniform", generator=torch.Generator().manual_seed(1))
    b = select(cands, 50, "uniform", generator=torch.Generator().manual_seed(1))
    c = select(cands, 50, "uniform", generator=torch.Generator().manual_seed(2))
    assert a.tolist() == b.tolist() and a.tolist() != c.tolist()
    assert sorted(a.tolist()) == list(range(50))


def test_selection_for_pairs_from_member_scores():
    # two members score 4 captions; pairs (0,1) both agree, (2,3) members disagree on the order
    scores = torch.tensor([[0.0, 0.0], [3.0, 3.0], [0.0, 2.0], [2.0, 0.0]])
    first, second = torch.tensor([0, 2]), torch.tensor([1, 3])
    probs = pair_member_probs(scores[first], scores[second])
    assert select({"member_probs": probs}, 1, "disagree").tolist() == [1]
    assert select({"member_probs": probs}, 1, "entropy").tolist() == [1]  # mean exactly 0.5


def test_rule_errors_are_clear():
    with pytest.raises(ValueError, match="rule must be one of"):
        utility({"times_seen": torch.ones(2)}, "loudest")
    with pytest.raises(KeyError, match="member_probs"):
        select({"times_seen": torch.ones(2)}, 1, "disagree")
    with pytest.raises(ValueError, match=r"\[N=2, M\]"):
        select({"times_seen": torch.ones(2), "member_probs": torch.ones(3, 2)}, 1, "entropy")
    assert set(RULES) == {"fifo", "frequency", "uniform", "disagree", "entropy"}


# ------------------------------------------------------------------------------------ SelectiveClaim
def _store(texts):
    store = CaptionStore(capacity=16)
    msgs = encode_messages(texts)
    store.add(msgs, hash_messages(msgs))
    return store


def test_selective_claim_budget_and_release_with_a_real_store():
    store = _store(["a", "b", "b", "b", "c", "c", "d"])
    claim = SelectiveClaim(store, "frequency", budget=LabelBudget(per_million=1000))
    h, t = claim(10)  # no frames yet: nothing allowed, nothing left pending
    assert t == [] and len(h) == 0
    assert store.stats()["pending"] == 0
    claim.set_frames(2000)  # 2 labels earned
    hashes, texts = claim(10)
    assert texts == ["b", "c"] and store.stats()["pending"] == 2 and store.stats()["unseen"] == 2
    store.set_labels(hashes, [1.0, 0.0], Provenance("test"))
    claim.set_frames(10_000)
    assert claim(1)[1] == ["a"]  # max_items still applies
    assert claim(10)[1] == ["d"]
    assert claim.claimed_total == 4 and claim.budget.spent == 4


def test_selective_claim_disagree_picks_the_most_disputed_caption():
    store = _store(["calm", "disputed", "calm", "mild"])
    spread = {"calm": [0.1, 0.1, 0.1], "disputed": [0.0, 1.0, 0.5], "mild": [0.2, 0.4, 0.3]}

    def member_probs(messages):
        from torchrl_oni.captions import decode_messages

        return torch.tensor([spread[t] for t in decode_messages(messages)])

    claim = SelectiveClaim(store, "disagree", member_probs=member_probs)
    assert claim(1)[1] == ["disputed"]
    assert claim(5)[1] == ["mild", "calm"]
    assert store.stats()["unseen"] == 0


def test_selective_claim_token_budget():
    store = _store(["short", "a much longer caption here", "mid caption"])
    budget = LabelBudget(per_million=30, unit="tokens", initial=0)
    claim = SelectiveClaim(store, "fifo", budget=budget, token_cost=lambda texts: [len(t) for t in texts])
    claim.set_frames(1_000_000)  # 30 "tokens": "short" (5) + the 26-char caption would be 31
    assert claim(10)[1] == ["short"]
    assert budget.spent == 5 and store.stats()["unseen"] == 2


def test_selective_claim_rejects_incomplete_setups():
    store = _store(["a"])
    with pytest.raises(ValueError, match="member_probs"):
        SelectiveClaim(store, "entropy")
    with pytest.raises(ValueError, match="token_cost"):
        SelectiveClaim(store, "fifo", budget=LabelBudget(per_million=1, unit="tokens"))


def test_selective_claim_accounts_refunds_and_checkpoints():
    store = _store(["a", "b", "b", "c", "c", "c", "d"])
    budget = LabelBudget(per_million=1000)
    claim = SelectiveClaim(store, "frequency", budget=budget)
    claim.set_frames(3000)
    hashes, texts = claim(10)
    assert texts == ["c", "b", "a"] and budget.spent == 3 and claim.metrics()["outstanding"] == 3
    claim.refund(hashes[:1])  # "c" failed for a server reason: the budget gets it back
    claim.settle(hashes[1:2])  # "b" was answered: paid
    assert budget.spent == 2 and claim.refunded_total == 1 and claim.metrics()["outstanding"] == 1
    claim.refund(hashes[1:2])  # settled already: nothing to give back
    assert budget.spent == 2
    # a checkpoint taken now counts "a" (still with the labeller) as not spent: a restart asks it again
    state = claim.state_dict()
    assert state["spent"] == 1
    again = SelectiveClaim(store, "frequency", budget=LabelBudget(per_million=1000))
    again.load_state_dict(state)
    assert again.budget.spent == 1 and again.claimed_total == 3
    metrics = claim.metrics()
    assert metrics["budget_spent"] == 2 and metrics["budget_earned"] == 3 and metrics["budget_allowed"] == 1
    with pytest.raises(ValueError, match="negative"):
        budget.refund(-1)
