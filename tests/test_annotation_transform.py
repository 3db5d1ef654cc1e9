"""Tests for torchrl_oni.annotation: LLMAnnotationTransform and AnnotationWorker."""
import asyncio
import copy
import logging
import threading
import time

import numpy as np
import pytest
import torch
from tensordict import TensorDict
from torchrl.data import Bounded, Categorical, Composite, LazyTensorStorage, TensorDictReplayBuffer, Unbounded
from torchrl.envs import EnvBase, TransformedEnv
from torchrl.envs.utils import check_env_specs

from helpers import TIMEOUT, poll
from torchrl_oni.annotation import AnnotationWorker, LLMAnnotationTransform
from torchrl_oni.annotators.base import FIRST, SECOND, Annotator, Label, Preference, Provenance
from torchrl_oni.captions import MESSAGE_LEN, encode_messages, hash_messages
from torchrl_oni.store import CaptionStore

torch.set_num_threads(1)
pytestmark = pytest.mark.timeout(60)

TEXTS = ["You kill the newt!", "It's a wall.", "You see here 5 gold pieces.", "", "You kill the jackal!"]


class KillAnnotator:
    """Labels captions containing "kill" as progress; can wait on a gate, be slow, or fail."""

    provenance = Provenance("test", "kill-rules", "v0")

    def __init__(self, *, gate=None, delay=0.0, fail_calls=0, error="http 500", raise_calls=0):
        self.gate = gate
        self.delay = delay
        self.fail_calls = fail_calls
        self.raise_calls = raise_calls
        self.error = error
        self.started = threading.Event()
        self.calls = 0
        self.finished = 0
        self.batches = []
        self.active = 0
        self.max_active = 0
        self.closed = False

    async def annotate(self, captions):
        self.calls += 1
        self.batches.append(list(captions))
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        self.started.set()
        try:
            while self.gate is not None and not self.gate.is_set():
                await asyncio.sleep(0.005)
            if self.delay:
                await asyncio.sleep(self.delay)
            if self.raise_calls > 0:
                self.raise_calls -= 1
                raise ConnectionError("server went away")
            if self.fail_calls > 0:
                self.fail_calls -= 1
                return [Label(None, self.provenance, error=self.error) for _ in captions]
            return [Label(float("kill" in c), self.provenance, score=0.9 if "kill" in c else 0.1) for c in captions]
        finally:
            self.active -= 1
            self.finished += 1

    async def compare(self, pairs):
        return [Preference(SECOND if "kill" in b and "kill" not in a else FIRST, self.provenance) for a, b in pairs]

    async def aclose(self):
        self.closed = True


def _batch(texts, shape):
    msgs = torch.from_numpy(encode_messages(texts)).reshape(*shape, MESSAGE_LEN)
    return msgs, torch.from_numpy(hash_messages(msgs))


def _collector_batch(T=4, K=3, seed=0):
    """A [T, K] batch like a collector's, root and ("next", ...) captions shifted by one step."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(TEXTS), (T + 1, K))
    texts = [TEXTS[i] for i in idx.flatten()]
    msgs, hashes = _batch(texts, (T + 1, K))
    return TensorDict(
        {
            "message": msgs[:-1],
            "caption_hash": hashes[:-1],
            "observation": torch.randn(T, K, 3),
            "next": {"message": msgs[1:], "caption_hash": hashes[1:], "reward": torch.zeros(T, K, 1)},
        },
        batch_size=[T, K],
    )


class FakeCaptionEnv(EnvBase):
    """A tiny env whose observation is a NetHack-like caption and its hash."""

    def __init__(self, texts=TEXTS, seed=0):
        super().__init__(batch_size=torch.Size([]))
        self._messages = torch.from_numpy(encode_messages(texts))
        self._hashes = torch.from_numpy(hash_messages(self._messages.numpy()))
        self.observation_spec = Composite(
            message=Bounded(0, 255, shape=(MESSAGE_LEN,), dtype=torch.uint8),
            caption_hash=Unbounded(shape=(), dtype=torch.int64),
        )
        self.action_spec = Categorical(4, shape=())
        self.reward_spec = Unbounded(shape=(1,))
        self._t = 0

    def _obs(self):
        i = self._t % len(self._messages)
        return {"message": self._messages[i].clone(), "caption_hash": self._hashes[i].clone()}

    def _reset(self, tensordict):
        self._t = 0
        return TensorDict({**self._obs(), "done": torch.zeros(1, dtype=torch.bool),
                           "terminated": torch.zeros(1, dtype=torch.bool)}, batch_size=[])

    def _step(self, tensordict):
        self._t += 1  # every caption appears within len(texts) steps
        return TensorDict(
            {**self._obs(), "reward": torch.zeros(1), "done": torch.zeros(1, dtype=torch.bool),
             "terminated": torch.zeros(1, dtype=torch.bool)},
            batch_size=[],
        )

    def _set_seed(self, seed):
        return seed


def test_protocol_is_satisfied_by_the_test_annotator():
    assert isinstance(KillAnnotator(), Annotator)


def test_call_returns_before_the_annotator_finishes_and_data_pass_through():
    gate = threading.Event()
    annotator = KillAnnotator(gate=gate)
    store = CaptionStore(capacity=16)
    batch = _collector_batch()
    reference = batch.clone()
    with LLMAnnotationTransform(store, annotator) as transform:
        out = transform(batch)
        # the call is back although the annotator is still blocked on the gate
        assert annotator.started.wait(TIMEOUT)
        assert annotator.finished == 0
        assert out is batch and (out == reference).all()
        assert set(out.keys(True)) == set(reference.keys(True))
        assert not store.lookup(batch["caption_hash"])[1].any()
        assert transform.metrics()["pending"] > 0
        gate.set()
        assert transform.wait_idle(TIMEOUT)
        labels, found = store.lookup(batch.get(("next", "caption_hash")))
        assert found.all()
        expected = torch.tensor([[1.0 if "kill" in t else 0.0 for t in row] for row in _texts_of(batch["next"])])
        assert torch.equal(labels, expected)
        assert store.scores(batch["caption_hash"]).max() == pytest.approx(0.9)
        # captions of both the root and "next" were sent, each once
        sent = [t for b in annotator.batches for t in b]
        assert len(sent) == len(set(sent)) == len(store)


def _texts_of(td):
    by_hash = {int(h): t for t, h in zip(TEXTS, hash_messages(encode_messages(TEXTS)).tolist())}
    return [[by_hash[int(h)] for h in row] for row in td["caption_hash"]]


def test_batches_and_concurrency_are_bounded():
    annotator = KillAnnotator(delay=0.02)
    store = CaptionStore(capacity=512)
    msgs = torch.from_numpy(encode_messages([f"You kill monster number {i}!" for i in range(230)]))
    batch = TensorDict(message=msgs, caption_hash=torch.from_numpy(hash_messages(msgs)), batch_size=[230])
    with LLMAnnotationTransform(store, annotator, batch_size=20, max_concurrency=3) as transform:
        transform(batch)
        assert transform.wait_idle(TIMEOUT)
        assert max(len(b) for b in annotator.batches) <= 20
        assert annotator.max_active <= 3
        assert annotator.max_active >= 2  # concurrency actually used
        metrics = transform.metrics()
    assert metrics["labels_total"] == 230 and metrics["labelled"] == 230
    assert metrics["requests_total"] == annotator.calls
    assert metrics["latency_s"] >= 0.02 and metrics["labels_per_s"] > 0


def test_failures_are_retried_and_counted(caplog):
    annotator = KillAnnotator(fail_calls=2, error="http 500", raise_calls=1)
    store = CaptionStore(capacity=16, server_retry_s=0.0, max_attempts=2)  # faults never give up
    msgs, hashes = _batch(TEXTS, (len(TEXTS),))
    batch = TensorDict(message=msgs, caption_hash=hashes, batch_size=[len(TEXTS)])
    with caplog.at_level(logging.WARNING, logger="torchrl_oni.annotation"):
        with LLMAnnotationTransform(store, annotator, poll_interval_s=0.02) as transform:
            transform(batch)
            deadline = time.monotonic() + TIMEOUT
            while not store.lookup(hashes)[1].all() and time.monotonic() < deadline:
                time.sleep(0.01)
            metrics = transform.metrics()
    assert store.lookup(hashes)[1].all()
    assert annotator.calls == 4  # raised once, failed twice, then labelled
    assert metrics["caption_server_failures"] == 3 * len(TEXTS)
    assert metrics["parse_failures"] == 0
    assert store.stats()["errors/ConnectionError"] == len(TEXTS)
    assert store.stats()["errors/http 500"] == 2 * len(TEXTS)
    summaries = [r for r in caplog.records if "annotation failures" in r.getMessage()]
    assert 1 <= len(summaries) <= 2  # rate-limited: one at the first failure, one at shutdown


def test_parse_failures_give_up_after_max_attempts():
    annotator = KillAnnotator(fail_calls=100, error="unparsable")
    store = CaptionStore(capacity=16, retry_backoff_s=0.0, max_attempts=2)
    msgs, hashes = _batch(TEXTS[:2], (2,))
    with LLMAnnotationTransform(store, annotator, poll_interval_s=0.02) as transform:
        transform(TensorDict(message=msgs, caption_hash=hashes, batch_size=[2]))
        deadline = time.monotonic() + TIMEOUT
        while store.stats()["failed"] < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert transform.wait_idle(TIMEOUT)
        metrics = transform.metrics()
    assert store.stats()["failed"] == 2 and metrics["failed"] == 2
    assert metrics["parse_failures"] == 4 and metrics["caption_server_failures"] == 0
    assert metrics["given_up"] == 2 and sorted(store.given_up()) == sorted(TEXTS[:2])
    assert annotator.calls == 2


def test_close_releases_pending_captions():
    gate = threading.Event()
    annotator = KillAnnotator(gate=gate)
    store = CaptionStore(capacity=16)
    msgs, hashes = _batch(TEXTS, (len(TEXTS),))
    transform = LLMAnnotationTransform(store, annotator, close_annotator=True)
    transform(TensorDict(message=msgs, caption_hash=hashes, batch_size=[len(TEXTS)]))
    assert annotator.started.wait(TIMEOUT)
    assert store.pending().numel() == len(TEXTS)
    transform.close(timeout=0.1)
    assert not transform.worker.running
    assert store.pending().numel() == 0 and store.stats()["unseen"] == len(TEXTS)
    assert annotator.closed
    transform.close()  # idempotent
    transform(TensorDict(message=msgs, caption_hash=hashes, batch_size=[len(TEXTS)]))  # still passes data
    assert not transform.worker.running


def test_labelled_key_and_coverage_metric():
    annotator = KillAnnotator()
    store = CaptionStore(capacity=16)
    with LLMAnnotationTransform(store, annotator, labelled_key="caption_labelled") as transform:
        batch = transform(_collector_batch(seed=1))
        assert batch["caption_labelled"].shape == (4, 3) and batch["caption_labelled"].dtype == torch.bool
        assert not batch["caption_labelled"].any()
        assert transform.metrics()["coverage"] == 0.0
        assert transform.wait_idle(TIMEOUT)
        batch = transform(_collector_batch(seed=1))
        assert batch["caption_labelled"].all() and batch.get(("next", "caption_labelled")).all()
        metrics = transform.metrics()
    assert metrics["coverage"] == pytest.approx(0.5)  # two calls: none labelled, then all
    assert metrics["steps_seen"] == 24


def test_pairs_are_answered_by_compare():
    store = CaptionStore(capacity=16)
    msgs, hashes = _batch(["It's a wall.", "You kill the newt!"], (2,))
    store.add(msgs, hashes)
    store.add_pairs(hashes[:1], hashes[1:])
    annotator = KillAnnotator()
    worker = AnnotationWorker(store, annotator).start()
    try:
        assert worker.wait_idle(TIMEOUT)
    finally:
        worker.stop()
    sample = store.sample_labelled_pairs(4)
    assert sample["preference"].tolist() == [SECOND] * 4
    assert worker.metrics()["preferences_total"] == 1


def test_works_on_replay_buffer_samples():
    store = CaptionStore(capacity=16)
    transform = LLMAnnotationTransform(store, KillAnnotator(), include_next=False)
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(64), batch_size=8, transform=transform)
    rb.extend(_collector_batch(T=4, K=3).reshape(-1).exclude("next"))
    sample = rb.sample()
    assert sample["message"].shape == (8, MESSAGE_LEN)
    assert transform.wait_idle(TIMEOUT)
    assert store.lookup(sample["caption_hash"])[1].all()
    transform.close()


def test_hash_is_computed_when_absent_and_missing_message_is_an_error():
    store = CaptionStore(capacity=16)
    msgs, hashes = _batch(TEXTS[:2], (2,))
    with LLMAnnotationTransform(store, KillAnnotator(), autostart=False) as transform:
        transform(TensorDict(message=msgs, batch_size=[2]))
        assert torch.equal(store.slots(hashes) >= 0, torch.tensor([True, True]))
        assert not transform.worker.running
        with pytest.raises(KeyError, match="no 'message'"):
            transform(TensorDict(observation=torch.zeros(2, 3), batch_size=[2]))


def test_copying_is_refused_with_a_clear_message():
    transform = LLMAnnotationTransform(CaptionStore(capacity=4), KillAnnotator())
    with pytest.raises(RuntimeError, match="in the trainer"):
        copy.deepcopy(transform)
    shallow = transform.clone()
    assert shallow.worker is transform.worker and shallow.store is transform.store


def test_transformed_env_check_specs_and_labels():
    store = CaptionStore(capacity=16)
    annotator = KillAnnotator()
    env = TransformedEnv(FakeCaptionEnv(), LLMAnnotationTransform(store, annotator, labelled_key="caption_labelled"))
    try:
        assert env.observation_spec["caption_labelled"].dtype == torch.bool
        check_env_specs(env)
        rollout = env.rollout(12)
        assert rollout.get(("next", "caption_labelled")).shape == (12,)
        assert env.transform.wait_idle(TIMEOUT)
        assert len(store) == len(TEXTS)
        labels, found = store.lookup(rollout["caption_hash"])
        assert found.all()
        texts = _texts_of(TensorDict(caption_hash=rollout["caption_hash"][None], batch_size=[1]))[0]
        assert labels.tolist() == [float("kill" in t) for t in texts]
        later = env.rollout(5)
        assert later.get(("next", "caption_labelled")).all()
    finally:
        env.close()
    assert not env.transform.worker.running


def test_transformed_env_without_labelled_key_keeps_specs():
    base = FakeCaptionEnv()
    env = TransformedEnv(FakeCaptionEnv(), LLMAnnotationTransform(CaptionStore(capacity=16), KillAnnotator()))
    try:
        assert env.observation_spec == base.observation_spec
        check_env_specs(env)
    finally:
        env.close()


# ------------------------------------------------------------------------------------ budgets, query rules, people
def _store_with(texts_seen, **kwargs):
    """A store holding ``texts_seen`` (text -> times seen), added in that order."""
    store = CaptionStore(capacity=64, **kwargs)
    for text, n in texts_seen.items():
        msgs, hashes = _batch([text] * n, (n,))
        store.add(msgs, hashes)
    return store


@pytest.mark.parametrize("failure,labelled,refunded", [("server fault", 3, 3), ("unparsable", 0, 0)])
def test_label_budget_through_the_worker(failure, labelled, refunded):
    from torchrl_oni.queries import LabelBudget, SelectiveClaim

    texts = {f"You kill monster number {i}!": i + 1 for i in range(10)}
    store = _store_with(texts, server_retry_s=0.0, retry_backoff_s=0.0)
    if failure == "server fault":
        annotator = KillAnnotator(raise_calls=1)  # the first request fails for a server reason
    else:
        annotator = KillAnnotator(fail_calls=1, error="unparsable")  # the first answer cannot be parsed
    budget = LabelBudget(per_million=1000)  # one label per 1,000 frames
    claim = SelectiveClaim(store, "frequency", budget=budget)
    with LLMAnnotationTransform(store, annotator, claim=claim, poll_interval_s=0.02) as transform:
        transform.start()
        assert transform.wait_idle(TIMEOUT)
        assert store.stats()["labelled"] == 0 and annotator.calls == 0  # frame 0: nothing may be bought
        claim.set_frames(3000)
        transform.worker.wake()
        assert poll(lambda: budget.spent == 3 and not store.pending().numel() and annotator.calls >= 1)
        assert transform.wait_idle(TIMEOUT)
        metrics = transform.metrics()
        # a server fault costs nothing (the captions are asked again within the budget); an
        # unparsable answer was paid for: nothing is labelled until more frames earn budget
        assert store.stats()["labelled"] == labelled and budget.spent == 3
        assert claim.refunded_total == refunded and claim.metrics()["outstanding"] == 0
        assert metrics["labels_total"] == labelled
        claim.set_frames(5000)
        transform.worker.wake()
        assert poll(lambda: store.stats()["labelled"] == labelled + 2 and not store.pending().numel())
        assert budget.spent == 5 and claim.claimed_total == 5 + refunded
    # the most seen were bought first; after an unparsable answer the same (most seen) are asked again
    top = sorted(texts, key=texts.get, reverse=True)
    asked = {t for b in annotator.batches for t in b}
    assert asked == set(top[:5] if failure == "server fault" else top[:3])


RULE_TEXTS = {"A": 1, "B": 5, "C": 3, "D": 4, "E": 2}  # arrival order A..E, with these sightings
RULE_PROBS = {"A": [0.5, 0.5], "B": [0.1, 0.1], "C": [0.0, 1.0], "D": [0.2, 0.6], "E": [0.9, 0.7]}
RULE_ORDERS = {
    "fifo": ["A", "B", "C", "D", "E"],
    "frequency": ["B", "D", "C", "E", "A"],
    "disagree": ["C", "D", "E", "A", "B"],  # std .5, .2, .1, then the ties (0) oldest first
    "entropy": ["A", "C", "D", "E", "B"],  # mean .5 (A, C: oldest first), .4, .8, .1
}


def _asked_in_order(rule, seed=0):
    from torchrl_oni.queries import SelectiveClaim
    from torchrl_oni.captions import decode_messages

    store = _store_with(RULE_TEXTS)
    annotator = KillAnnotator()

    def member_probs(messages):
        return torch.tensor([RULE_PROBS[t] for t in decode_messages(messages.numpy())])

    claim = SelectiveClaim(store, rule, member_probs=member_probs, seed=seed)
    with LLMAnnotationTransform(store, annotator, claim=claim, batch_size=1, max_concurrency=1) as transform:
        transform.start()
        assert transform.wait_idle(TIMEOUT)
    assert all(len(b) == 1 for b in annotator.batches)
    return [b[0] for b in annotator.batches]


@pytest.mark.parametrize("rule", sorted(RULE_ORDERS))
def test_each_query_rule_orders_the_workers_requests(rule):
    assert _asked_in_order(rule) == RULE_ORDERS[rule]


def test_uniform_query_rule_through_the_worker_is_a_seeded_shuffle():
    first, again, other = _asked_in_order("uniform", 0), _asked_in_order("uniform", 0), _asked_in_order("uniform", 1)
    assert sorted(first) == sorted(RULE_TEXTS) and first == again and other != first


def test_a_late_llm_answer_never_replaces_a_persons_label():
    gate = threading.Event()
    annotator = KillAnnotator(gate=gate)
    store = CaptionStore(capacity=16)
    msgs, hashes = _batch(TEXTS[:2], (2,))
    person = Provenance("human", "ada", "feedback-v1")
    with LLMAnnotationTransform(store, annotator) as transform:
        transform(TensorDict(message=msgs, caption_hash=hashes, batch_size=[2]))
        assert annotator.started.wait(TIMEOUT)  # both captions are with the LLM now
        store.set_labels(hashes[:1], [0.0], person)  # a person answers meanwhile ("kill" is progress for the LLM)
        gate.set()
        assert transform.wait_idle(TIMEOUT)
        metrics = transform.metrics()
    assert store.lookup(hashes)[0].tolist() == [0.0, 0.0]
    assert metrics["labels_total"] == 1  # only the LLM label that was written counts


def test_a_failing_selection_rule_loses_nothing_and_keeps_the_worker_alive():
    from torchrl_oni.queries import SelectiveClaim

    store = _store_with(RULE_TEXTS)
    calls = {"n": 0}

    def flaky_member_probs(messages):
        calls["n"] += 1
        if calls["n"] <= 2:
            raise RuntimeError("the reward model is being swapped")
        return torch.rand(len(messages), 2)

    annotator = KillAnnotator()
    claim = SelectiveClaim(store, "disagree", member_probs=flaky_member_probs)
    with LLMAnnotationTransform(store, annotator, claim=claim, poll_interval_s=0.02) as transform:
        transform.start()
        assert poll(lambda: store.stats()["labelled"] == len(RULE_TEXTS))
        metrics = transform.metrics()
    assert metrics["claim_errors"] == 2 and metrics["worker_running"] == 1.0
    assert store.stats()["pending"] == 0


def test_a_crashed_worker_is_reported_and_the_caller_goes_on(caplog):
    """An error outside the calls (here the store's pair queue) ends the worker's thread, never
    the caller's: it is kept in ``crashed``, logged once, and named by ``health()``."""
    store = _store_with({text: 1 for text in TEXTS})

    def broken_claim_pairs(max_items):
        raise OSError("the pair table is gone")

    store.claim_pairs = broken_claim_pairs
    worker = AnnotationWorker(store, KillAnnotator(), captions=False, poll_interval_s=0.02)
    with caplog.at_level(logging.ERROR, logger="torchrl_oni.annotation"):
        worker.start()
        assert poll(lambda: not worker.running)
    assert isinstance(worker.crashed, OSError)
    assert worker.health() == "annotation worker crashed: OSError: the pair table is gone"
    assert worker.metrics()["worker_running"] == 0.0 and not worker.wait_idle(1)
    # only our logger's records: TorchRL logs INFO lines of its own (storage initialised) that
    # reach caplog unless RL_WARNINGS=False, which a user's environment does not set
    ours = [r.getMessage() for r in caplog.records if r.name == "torchrl_oni.annotation"]
    assert ours == ["annotation worker crashed"]
    worker.stop()  # still fine
