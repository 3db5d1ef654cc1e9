"""The simulated B-Pref teacher (torchrl_oni.annotators.teacher)."""
import asyncio
import math
import time

import numpy as np
import pytest

from torchrl_oni.annotators.base import SKIP_ERROR, TIE, Annotator
from torchrl_oni.annotators.scripted import NOT_PROGRESS_EXAMPLES, ScriptedAnnotator
from torchrl_oni.annotators.teacher import SimulatedTeacher

CAPTIONS = [
    "You kill the newt!", "Welcome to experience level 2.", "12 gold pieces.", "You find a hidden door.",
    "There is a staircase down here.", "You die...", "The jackal bites!", *NOT_PROGRESS_EXAMPLES,
]


def _sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


def test_rational_teacher_is_the_rules_annotator():
    rules, teacher = ScriptedAnnotator(), SimulatedTeacher()
    labels = asyncio.run(teacher.annotate(CAPTIONS))
    assert [l.value for l in labels] == [rules.label(c) for c in CAPTIONS]
    pairs = [(a, b) for a in CAPTIONS[:7] for b in CAPTIONS[:9]]
    prefs = asyncio.run(teacher.compare(pairs))
    assert [p.value for p in prefs] == [rules.preference(a, b) for a, b in pairs]
    assert all(l.provenance.annotator == "teacher" for l in labels)
    assert isinstance(teacher, Annotator)


def test_mistakes_flip_decided_answers_but_not_ties():
    rules, teacher = ScriptedAnnotator(), SimulatedTeacher(epsilon=1.0)
    assert [teacher.label(c) for c in CAPTIONS] == [1.0 - rules.label(c) for c in CAPTIONS]
    assert teacher.preference("It's a wall.", "Never mind.") == TIE
    assert teacher.preference("It's a wall.", "You kill the newt!") == 0.0


def test_mistake_rate_matches_epsilon():
    teacher = SimulatedTeacher(epsilon=0.2, seed=3)
    n = 5000
    flips = sum(teacher.label("You kill the newt!") == 0.0 for _ in range(n))
    assert abs(flips / n - 0.2) < 3 * math.sqrt(0.2 * 0.8 / n)


@pytest.mark.parametrize("beta", [0.5, 2.0])
def test_rationality_is_a_logistic_choice_on_the_rule_scores(beta):
    teacher = SimulatedTeacher(beta=beta, seed=1)
    n = 4000
    for caption, score in (("You kill the newt!", 2.0), ("It's a wall.", 0.0), ("You die...", -5.0)):
        p = _sigmoid(beta * (score - 0.5))
        assert teacher.progress_probability(caption) == pytest.approx(p)
        freq = np.mean([teacher.label(caption) for _ in range(n)])
        assert abs(freq - p) < 4 * math.sqrt(p * (1 - p) / n) + 1e-9
    # a pair: level up (3) vs kill (2): P(second) = sigmoid(beta * (2 - 3))
    p = _sigmoid(beta * -1.0)
    freq = np.mean([teacher.preference("Welcome to experience level 2.", "You kill the newt!") for _ in range(n)])
    assert abs(freq - p) < 4 * math.sqrt(p * (1 - p) / n)


def test_skip_and_equal_thresholds():
    teacher = SimulatedTeacher(skip_threshold=1.5, equal_threshold=1.0)
    prefs = asyncio.run(teacher.compare([("It's a wall.", "Never mind."),          # both irrelevant
                                         ("You kill the newt!", "Welcome to experience level 2."),  # |2-3| <= 1
                                         ("It's a wall.", "You kill the newt!")]))
    assert prefs[0].error == SKIP_ERROR and prefs[0].value is None and not prefs[0].ok
    assert prefs[1].value == TIE and prefs[2].value == 1.0
    labels = asyncio.run(teacher.annotate(["It's a wall.", "You find a hidden door.", "You kill the newt!"]))
    assert [l.error for l in labels] == [SKIP_ERROR, SKIP_ERROR, None]  # |score| 0 and 1 < 1.5
    assert teacher.stats.errors_by_kind[SKIP_ERROR] == 3


def test_same_seed_same_answers():
    def answers(seed):
        t = SimulatedTeacher(beta=0.7, epsilon=0.1, seed=seed)
        return [t.label(c) for c in CAPTIONS * 5]

    assert answers(4) == answers(4) and answers(4) != answers(5)


def test_bad_arguments():
    for kwargs in (dict(beta=0), dict(epsilon=1.5), dict(skip_threshold=-1), dict(equal_threshold=-0.1)):
        with pytest.raises(ValueError):
            SimulatedTeacher(**kwargs)


def test_teacher_labels_a_caption_store_through_the_annotation_worker():
    from torchrl_oni.annotation import AnnotationWorker
    from torchrl_oni.captions import encode_messages, hash_messages
    from torchrl_oni.store import CaptionStore

    store = CaptionStore(capacity=32, server_retry_s=0.0, retry_backoff_s=0.0)
    msgs = encode_messages(["You kill the newt!", "It's a wall.", "You find a hidden door."])
    store.add(msgs, hash_messages(msgs))
    teacher = SimulatedTeacher(skip_threshold=0.5)
    worker = AnnotationWorker(store, teacher, pairs=False, poll_interval_s=0.02).start()
    try:
        assert worker.wait_idle(timeout=20)
        time.sleep(0.1)  # a few more polls: a skipped caption would be handed out again by now
        assert worker.wait_idle(timeout=20)
        metrics, health = worker.metrics(), worker.health()
    finally:
        worker.stop()
    labels, found = store.lookup(hash_messages(msgs))
    assert found.tolist() == [True, False, True] and labels.tolist() == [1.0, 0.0, 1.0]
    # a skip is the teacher's final answer: asked once, never again, counted apart from failures
    stats = store.stats()
    assert stats["skipped"] == 1 and stats[f"errors/{SKIP_ERROR}"] == 1 and stats["unseen"] == 0
    assert teacher.stats.captions == 3
    assert metrics["skipped"] == 1 and metrics["parse_failures"] == 0 and metrics["caption_server_failures"] == 0
    assert health.startswith(("ok", "idle")), health
    assert {p.annotator for p in store.provenances} == {"teacher"}
