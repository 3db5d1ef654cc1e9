"""Reward-model ensembles, bootstrap, SURF and RUNE (torchrl_oni.rewards.ensemble)."""
import copy
import math

import numpy as np
import pytest
import torch
from tensordict import TensorDict
from torch import nn

from torchrl_oni.captions import encode_messages, hash_messages
from torchrl_oni.rewards.training import RewardModelSchedule, holdout_mask
from torchrl_oni.rewards.ensemble import (
    SURF,
    ClassifierEnsemble,
    EnsembleClassifierTrainer,
    EnsembleRankingTrainer,
    RankingEnsemble,
    RUNEBonus,
    bootstrap_counts,
    surf_augment,
    surf_loss,
)
from torchrl_oni.rewards.scaling import RunningMeanStd, threshold
from torchrl_oni.transforms import rune_transform

torch.set_num_threads(1)

POSITIVE = ["You kill the {m}!", "Welcome to experience level {k}.", "{k} gold pieces."]
NEGATIVE = ["The {m} bites!", "You see here {k} arrows.", "The {m} misses!", "It's a wall.", "You hear {m}s."]
MONSTERS = ["newt", "jackal", "kobold", "gnome", "lichen", "fox", "goblin", "gecko", "coyote", "rat"]


def _captions(n_per_template=30, seed=0):
    rng = np.random.default_rng(seed)
    out = {}
    for templates, label in ((POSITIVE, 1.0), (NEGATIVE, 0.0)):
        for t in templates:
            for _ in range(n_per_template):
                out[t.format(m=rng.choice(MONSTERS), k=int(rng.integers(2, 400)))] = label
    return list(out), list(out.values())


class Labelled:
    """labelled() over fixed texts (the ClassifierTrainer store protocol)."""

    def __init__(self, texts, labels):
        self.m = torch.as_tensor(encode_messages(texts))
        self.h = torch.as_tensor(hash_messages(self.m))
        self.y = torch.tensor(labels, dtype=torch.float32)

    def labelled(self):
        return self.m, self.h, self.y


# ------------------------------------------------------------------------------------ bootstrap
def test_bootstrap_counts_are_poisson_one_deterministic_and_independent():
    hashes = torch.as_tensor(hash_messages(encode_messages([f"caption {i}" for i in range(40_000)])))
    c0, c1 = bootstrap_counts(hashes, 0), bootstrap_counts(hashes, 1)
    assert torch.equal(c0, bootstrap_counts(hashes, 0))
    # the count of a caption does not depend on which other captions are in the batch
    assert torch.equal(bootstrap_counts(hashes[123:456], 0), c0[123:456])
    for c in (c0, c1):
        freq = np.bincount(c.numpy(), minlength=5)[:5] / len(c)
        ref = [math.exp(-1) / math.factorial(k) for k in range(5)]
        np.testing.assert_allclose(freq, ref, atol=0.01)
    assert abs(np.corrcoef(c0.numpy(), c1.numpy())[0, 1]) < 0.03
    assert not torch.equal(bootstrap_counts(hashes, 0, seed=1), c0)


def test_members_train_on_their_bootstrap_and_keep_the_heldout_slice():
    texts, labels = _captions()
    store = Labelled(texts, labels)
    ens = ClassifierEnsemble(size=3, seed=0)
    trainer = EnsembleClassifierTrainer(ens, store, batch_size=16, holdout_fraction=0.2, seed=7)
    trainer.refresh()
    held = holdout_mask(store.h, 0.2)
    for m, member in enumerate(trainer.trainers):
        counts = bootstrap_counts(store.h, m, seed=7)
        counts[held] = 1
        assert member._train[1].numel() == int(counts[~held].sum())
        assert member._heldout[1].numel() == int(held.sum())
    sizes = {t._train[1].numel() for t in trainer.trainers}
    assert len(sizes) > 1  # members see different resamples
    plain = EnsembleClassifierTrainer(ens, store, bootstrap=False, holdout_fraction=0.2)
    plain.refresh()
    assert {t._train[1].numel() for t in plain.trainers} == {int((~held).sum())}


# ------------------------------------------------------------------------------------ ensembles
def test_classifier_ensemble_mean_reward_and_member_predictions():
    ens = ClassifierEnsemble(size=3, seed=2, threshold=0.5)
    msgs = torch.as_tensor(encode_messages(["You kill the newt!", "It's a wall.", ""]))
    per_member = torch.stack([m.helpful_probability(msgs) for m in ens.members], dim=-1)
    assert torch.equal(ens.member_probabilities(msgs), per_member)
    assert torch.equal(ens.helpful_probability(msgs), per_member.mean(-1))
    assert torch.equal(ens(msgs, torch.zeros(3, dtype=torch.int64)), (per_member.mean(-1) > 0.5).float())
    np.testing.assert_allclose(ens.disagreement(msgs).numpy(), np.std(per_member.numpy(), axis=1), rtol=1e-5)
    assert len({tuple(m.model.head[-1].bias.tolist()) for m in ens.members}) == 3  # distinct inits
    # same seed, same ensemble; the global RNG is left alone
    state = torch.random.get_rng_state()
    again = ClassifierEnsemble(size=3, seed=2)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert torch.equal(again.member_probabilities(msgs), per_member)
    clone = ClassifierEnsemble(size=3, seed=99)
    clone.load_state_dict(ens.state_dict())
    assert torch.equal(clone.member_probabilities(msgs), per_member)
    with pytest.raises(ValueError, match="members"):
        ClassifierEnsemble(size=2).load_state_dict(ens.state_dict())


def test_classifier_ensemble_learns_the_labels():
    torch.manual_seed(0)
    texts, labels = _captions(n_per_template=40)
    ens = ClassifierEnsemble(size=2, seed=0)
    trainer = EnsembleClassifierTrainer(ens, Labelled(texts, labels), lr=1e-3, batch_size=32,
                                        holdout_fraction=0.15, seed=0)
    before = trainer.evaluate()
    metrics = trainer.train_steps(40)
    assert metrics["steps"] == 40 and trainer.total_steps == 40
    after = trainer.evaluate()
    assert after["heldout_size"] == before["heldout_size"] > 10
    assert after["heldout_balanced_accuracy"] > 0.9 > before["heldout_balanced_accuracy"], (before, after)


def test_ranking_ensemble_pairs_reward_and_training():
    ens = RankingEnsemble(size=2, seed=0, threshold=-10.0)
    a = torch.as_tensor(encode_messages(["You kill the newt!", "It's a wall."]))
    b = torch.as_tensor(encode_messages(["It's a wall.", "12 gold pieces."]))
    sa, sb = ens.member_scores(a), ens.member_scores(b)
    assert torch.allclose(ens.pair_probabilities(a, b), torch.sigmoid(sb - sa))
    raw = ens.scores(a)
    assert torch.allclose(raw, sa.mean(-1))
    z = ens(a, torch.zeros(2, dtype=torch.int64))
    ref = RunningMeanStd()  # RankingReward's recipe, on the members' mean score
    ref.update(raw)
    assert torch.allclose(z, threshold(ref.normalize(raw).float(), -10.0))
    assert not torch.allclose(z, raw)

    class Pairs:  # "kill" always beats "wall"
        def __init__(self):
            self.rng = np.random.default_rng(0)

        def sample_labelled_pairs(self, n, generator=None):
            first_kill = (generator or self.rng).random(n) < 0.5
            kill, wall = (torch.as_tensor(encode_messages([t] * n)) for t in ("You kill the newt!", "It's a wall."))
            first = torch.where(torch.from_numpy(first_kill)[:, None], kill, wall)
            second = torch.where(torch.from_numpy(first_kill)[:, None], wall, kill)
            return TensorDict(message_a=first, message_b=second,
                              preference=torch.from_numpy((~first_kill).astype(np.float32)), batch_size=[n])

        def num_labelled_pairs(self):
            return 10

    torch.manual_seed(0)
    schedule = RewardModelSchedule(steps_per_new_labels=2)
    trainer = EnsembleRankingTrainer(ens, Pairs(), lr=1e-3, batch_size=16, schedule=schedule)
    assert trainer.train_steps(20)["steps"] == 20
    kill, wall = (torch.as_tensor(encode_messages([t])) for t in ("You kill the newt!", "It's a wall."))
    assert (ens.pair_probabilities(wall, kill) > 0.9).all()  # every member learned the order
    # the shared schedule: 10 new pairs (< switch_at) owe 2 steps to every member, then nothing
    before = [t.total_steps for t in trainer.trainers]
    assert trainer.after_iteration()["steps"] == 2 and trainer.after_iteration()["steps"] == 0
    assert [t.total_steps for t in trainer.trainers] == [n + 2 for n in before]


# ------------------------------------------------------------------------------------ SURF
def test_surf_augment_numerics_match_the_two_term_loss():
    torch.manual_seed(0)
    msgs = torch.randint(1, 255, (6, 256), dtype=torch.uint8)
    targets = torch.tensor([1, 0, 0, 1, 0, 0])
    unl = torch.randint(1, 255, (5, 256), dtype=torch.uint8)
    probs = torch.tensor([0.95, 0.5, 0.05, 0.949, 0.0])  # tau 0.95: rows 0 (1), 2 (0), 4 (0)
    cw = torch.tensor([1.0, 3.0])
    batch = surf_augment(msgs, targets, unl, probs, tau=0.95, lam=0.3, class_weights=cw)
    assert batch["target"].tolist() == [1, 0, 0, 1, 0, 0, 1, 0, 0]
    assert torch.equal(batch["message"][6:], unl[[0, 2, 4]])
    assert batch["pseudo"].tolist() == [False] * 6 + [True] * 3
    logits = torch.randn(9, 2, dtype=torch.float64)
    expected = (nn.CrossEntropyLoss(weight=cw.double())(logits[:6], targets)
                + 0.3 * nn.functional.cross_entropy(logits[6:], batch["target"][6:]))
    assert surf_loss(logits, batch).item() == pytest.approx(expected.item(), rel=1e-6)
    # nothing confident, or lam = 0: exactly the labelled loss
    for p, kwargs in ((probs.clamp(0.01, 0.99), dict(tau=0.999, lam=0.3)), (probs, dict(tau=0.95, lam=0.0))):
        plain = surf_augment(msgs, targets, unl, p, class_weights=cw, **kwargs)
        assert len(plain) == 6
        assert surf_loss(logits[:6], plain).item() == pytest.approx(
            nn.CrossEntropyLoss(weight=cw.double())(logits[:6], targets).item(), rel=1e-6)
    with pytest.raises(ValueError):
        SURF(tau=0.5)


def test_surf_training_without_pseudo_labels_is_the_plain_trainer_step():
    texts, labels = _captions(n_per_template=8)
    store = Labelled(texts, labels)

    def run(surf):
        ens = ClassifierEnsemble(size=2, seed=3, dropout=0.0)  # no dropout: no RNG-order dependence
        trainer = EnsembleClassifierTrainer(ens, store, surf=surf, unlabelled=lambda n, rng: store.m[:n],
                                            batch_size=8, holdout_fraction=0.0, lr=1e-3, seed=1)
        trainer.train_steps(4)
        return [copy.deepcopy(t.model.state_dict()) for t in trainer.trainers], trainer

    plain, _ = run(None)
    surf_off, trainer = run(SURF(tau=1.0, lam=0.5))  # tau 1: a fresh net is never that sure
    assert trainer.pseudo_labelled_total == 0
    for a, b in zip(plain, surf_off):
        for key in a:
            torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6)


def test_surf_adds_confident_pseudo_labels_to_training():
    texts, labels = _captions(n_per_template=8)
    store = Labelled(texts, labels)

    class Sure(ClassifierEnsemble):  # an ensemble that is certain every caption is progress
        def helpful_probability(self, messages):
            return torch.ones(len(messages))

    # Captions of the negative templates that are not in the labelled set: the labels alone teach
    # "not progress", so only the pseudo-label 1 can pull them above 0.5 (a caption unlike every
    # template may land anywhere without SURF, and the test could pass with SURF doing nothing).
    unl = torch.as_tensor(encode_messages(["The kitten bites!", "You hear kittens."]))

    def train(surf):
        # No dropout: its masks would come from the global RNG, whose state is whatever the tests
        # run before this one in the process left (oni-train's Trainer seeds it in-process), so the
        # outcome would depend on the test order. The gentle lr keeps a member's prediction on the
        # two captions from hinging on the noise of 40 steps on a few dozen labels.
        ens = Sure(size=2, seed=0, dropout=0.0)  # a fresh ensemble each time: training publishes into it
        trainer = EnsembleClassifierTrainer(ens, store, surf=surf, unlabelled=lambda n, rng: unl[:n], batch_size=8,
                                            holdout_fraction=0.0, lr=1e-3, seed=0)
        out = trainer.train_steps(40)
        with torch.no_grad():
            logits = torch.stack([t.reward.model(unl) for t in trainer.trainers])
        return ens, trainer, out, logits[..., 1] - logits[..., 0]  # [member, caption] log-odds of "helpful"

    rng_state = torch.random.get_rng_state()
    ens, trainer, out, with_surf = train(SURF(tau=0.99, lam=1.0, batch_size=2))
    assert out["pseudo_labelled"] == 2.0 and trainer.pseudo_labelled_total == 80
    _, _, _, without = train(None)
    assert torch.equal(torch.random.get_rng_state(), rng_state)  # nothing read the global RNG
    # Every member is pulled past 0.5 on both captions, and the pull is SURF's: the same seeds
    # without it must come out well below, so a SURF that adds nothing cannot pass.
    assert (with_surf > 0).all(), with_surf
    assert with_surf.mean() > without.mean() + 4.0, (with_surf, without)
    with pytest.raises(ValueError, match="unlabelled"):
        EnsembleClassifierTrainer(ens, store, surf=SURF())


# ------------------------------------------------------------------------------------ RUNE
def test_rune_bonus_value_decay_and_transform():
    ens = ClassifierEnsemble(size=3, seed=5)
    msgs = torch.as_tensor(encode_messages(["You kill the newt!", "It's a wall."]))
    rune = RUNEBonus(ens, beta0=0.5, decay=0.1)
    std = ens.member_probabilities(msgs).std(-1, unbiased=False)
    assert torch.allclose(rune(msgs, None), 0.5 * std)
    rune.step(3)
    assert rune.beta == pytest.approx(0.5 * 0.9 ** 3)
    assert torch.allclose(rune(msgs, None), 0.5 * 0.9 ** 3 * std)
    again = RUNEBonus(ens, beta0=0.5, decay=0.1)
    again.load_state_dict(rune.state_dict())
    assert again.beta == rune.beta

    transform = rune_transform(ens, beta0=0.5, decay=0.0, count_beta=3.0)
    hashes = torch.as_tensor(hash_messages(msgs))
    td = TensorDict({"message": msgs, "caption_hash": hashes, "msg_count": torch.tensor([1, 2]),
                     ("next", "reward"): torch.zeros(2, 1)}, batch_size=[2])
    out = transform(td)["next", "rune_bonus"].squeeze(-1)
    assert torch.allclose(out, 0.5 * std * torch.tensor([1.0, 1 / 8]), atol=1e-7)
    assert "intrinsic_reward" not in td["next"].keys()  # logged apart from the intrinsic reward
    with pytest.raises(ValueError):
        RUNEBonus(ens, decay=1.0)


def test_ensemble_trainer_on_a_caption_store_follows_the_schedule_and_surf_reads_unlabelled_captions():
    from torchrl_oni.annotators.base import Provenance
    from torchrl_oni.store import CaptionStore

    texts, labels = _captions(n_per_template=6)
    store = CaptionStore(capacity=512)
    store.add(encode_messages(texts + ["You see here a dagger.", "A boulder fills the corridor."]))
    store.set_labels(hash_messages(encode_messages(texts)), labels, Provenance("test"))
    ens = ClassifierEnsemble(size=2, seed=0)
    seen = []

    def unlabelled(n, rng):
        out = store.sample_unlabelled(n, rng)
        seen.append(out)
        return out

    trainer = EnsembleClassifierTrainer(ens, store, surf=SURF(tau=0.6, lam=0.5), batch_size=8, holdout_fraction=0.0,
                                        schedule=RewardModelSchedule(steps_per_new_labels=3, time_fraction=0.0))
    assert trainer.unlabelled == store.sample_unlabelled  # the store's sampler by default
    trainer.unlabelled = unlabelled
    assert trainer.dataset_size_now() == len(texts)
    assert trainer.after_iteration()["steps"] == 3 and trainer.total_steps == 3  # new labels: steps owed
    assert trainer.after_iteration()["steps"] == 0  # no new labels since
    assert len(seen) == 3 and all(len(u) == 2 for u in seen)  # the two unlabelled captions, every step
