"""Tests for torchrl_oni.store._queue.WorkQueue: the one labelling queue under captions, pairs and ELLM goals."""
import numpy as np
import pytest

from torchrl_oni.store import _queue
from torchrl_oni.store._queue import MAX_RETRY_S, MAX_SERVER_RETRY_S, RetryRules, WorkQueue
from torchrl_oni.store.status import FAILED, GIVEN_UP, LABELLED, PENDING, SKIPPED, UNSEEN, Status

pytestmark = pytest.mark.timeout(60)


class Clock:
    """Stands in for the time module of _queue: time moves only when a test says so."""

    def __init__(self):
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


class Rows:
    """An owner of the queue's columns that grows by replacing its arrays, as the tables do."""

    def __init__(self, n: int):
        self.status = np.zeros(n, np.int8)
        self.attempts = np.zeros(n, np.int16)

    def grow(self, n_new: int) -> None:
        self.status = np.concatenate([self.status, np.zeros(n_new, np.int8)])
        self.attempts = np.concatenate([self.attempts, np.zeros(n_new, np.int16)])

    def columns(self):
        return self.status, self.attempts


@pytest.fixture
def clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(_queue, "time", clock)
    return clock


def _queue_of(n, **rules):
    rows = Rows(n)
    return rows, WorkQueue(rows.columns, RetryRules(**rules))


def test_status_numbers_are_the_saved_ones():
    assert [int(s) for s in Status] == [0, 1, 2, 3, 4, 5]
    assert (UNSEEN, PENDING, LABELLED, FAILED, GIVEN_UP, SKIPPED) == tuple(Status)


def test_claim_marks_pending_in_slot_order_or_the_given_order():
    rows, queue = _queue_of(5)
    assert queue.claim(2).tolist() == [0, 1]
    assert rows.status.tolist() == [PENDING, PENDING, UNSEEN, UNSEEN, UNSEEN]
    newest_first = queue.claim(2, order=lambda cand, k: cand[::-1][:k])
    assert newest_first.tolist() == [4, 3] and queue.claimable().tolist() == [2]
    assert queue.pending().tolist() == [0, 1, 3, 4]
    assert queue.claim(-1).tolist() == [] and queue.claim(10).tolist() == [2]
    assert queue.claim(10).tolist() == []


def test_queue_follows_its_owner_when_the_arrays_are_replaced():
    rows, queue = _queue_of(2)
    queue.claim(2)
    rows.grow(3)
    assert queue.claimable().tolist() == [2, 3, 4]
    queue.finish(np.array([0]))
    assert rows.status[0] == LABELLED


def test_server_fault_spends_no_attempt_and_waits_a_doubling_backoff(clock):
    rows, queue = _queue_of(1, max_attempts=1, server_retry_s=5.0)
    for k in range(1, 10):  # never given up, however many
        assert queue.claim(1).tolist() == [0]
        failed, gave_up = queue.fail(np.array([0]), "timeout")
        assert failed.tolist() == [0] and gave_up.tolist() == [False]
        assert rows.status[0] == UNSEEN and rows.attempts[0] == 0
        wait = min(5.0 * 2 ** (k - 1), MAX_SERVER_RETRY_S)
        clock.now += wait - 0.01
        assert queue.claimable().tolist() == []  # still waiting
        clock.now += 0.02


def test_unparsable_answers_spend_attempts_then_give_up(clock):
    rows, queue = _queue_of(2, max_attempts=3, retry_backoff_s=30.0)
    for attempt in (1, 2):
        queue.claim(2)
        failed, gave_up = queue.fail(np.array([0]), "unparsable")
        assert gave_up.tolist() == [False] and rows.attempts[0] == attempt and rows.status[0] == UNSEEN
        assert queue.claimable().tolist() == []  # slot 1 is pending, slot 0 waits
        clock.now += min(30.0 * 2 ** (attempt - 1), MAX_RETRY_S)
        assert queue.claimable().tolist() == [0]
        queue.release()
    queue.claim(2)
    assert queue.fail(np.array([0]), "unparsable")[1].tolist() == [True]
    assert rows.status[0] == GIVEN_UP and queue.retrying() == 0
    # a late failure leaves given-up and labelled items alone
    queue.finish(np.array([1]))
    failed, _ = queue.fail(np.array([0, 1]), "unparsable")
    assert failed.tolist() == [] and rows.status.tolist() == [GIVEN_UP, LABELLED]


def test_parse_failure_and_final_override_the_error_kind(clock):
    rows, queue = _queue_of(3, max_attempts=1)
    queue.claim(3)
    assert queue.fail(np.array([0]), "timeout", parse_failure=True)[1].tolist() == [True]
    assert queue.fail(np.array([1]), "unparsable", parse_failure=False)[1].tolist() == [False]
    assert queue.fail(np.array([2]), "timeout", final=True)[1].tolist() == [True]
    assert rows.status.tolist() == [GIVEN_UP, UNSEEN, SKIPPED] and rows.attempts.tolist() == [1, 0, 0]


def test_skip_is_final_and_forgets_the_backoffs(clock):
    rows, queue = _queue_of(1)
    queue.claim(1)
    queue.fail(np.array([0]), "timeout")
    clock.now += 60
    queue.claim(1)
    assert queue.fail(np.array([0]), "skip")[1].tolist() == [True]
    assert rows.status[0] == SKIPPED and queue.claimable().tolist() == []
    assert queue.fail(np.array([0]), "timeout")[0].tolist() == []  # never handed out again
    assert queue.requeue_server_failures() == 0


def test_requeue_server_failures_ends_the_waits(clock):
    rows, queue = _queue_of(3, server_retry_s=60.0)
    queue.claim(3)
    queue.fail(np.array([0, 1]), "http 500")
    queue.fail(np.array([2]), "unparsable")
    assert queue.claimable().tolist() == [] and queue.retrying() == 3
    assert queue.requeue_server_failures() == 2
    assert queue.claimable().tolist() == [0, 1]  # the unparsable one still waits
    assert queue.retrying() == 1 and queue.requeue_server_failures() == 0


def test_release_sends_pending_back_at_once(clock):
    rows, queue = _queue_of(4)
    queue.claim(3)
    assert queue.release(np.array([0, 3])) == 1  # slot 3 was not pending
    assert rows.status.tolist() == [UNSEEN, PENDING, PENDING, UNSEEN]
    assert queue.release() == 2 and queue.claimable().tolist() == [0, 1, 2, 3]


def test_finish_ends_the_unparsable_backoff(clock):
    rows, queue = _queue_of(1)
    queue.claim(1)
    queue.fail(np.array([0]), "unparsable")
    queue.finish(np.array([0]))
    rows.status[0] = UNSEEN  # e.g. a person undoes the label
    assert queue.claimable().tolist() == [0]


def test_reopen_gives_a_fresh_attempt_count(clock):
    rows, queue = _queue_of(3, max_attempts=1)
    queue.claim(3)
    queue.fail(np.array([0, 1]), "unparsable")
    rows.status[2] = FAILED  # as stores of older versions left it
    assert queue.reopen((FAILED,)).tolist() == [2]
    assert queue.reopen((GIVEN_UP,)).tolist() == [0, 1]
    assert rows.status.tolist() == [UNSEEN] * 3 and rows.attempts.tolist() == [0] * 3


def test_given_up_status_of_the_goal_table(clock):
    """ELLM's goal table saves 3 (FAILED) for a state given up: the queue writes what it is told."""
    rows = Rows(2)
    queue = WorkQueue(rows.columns, RetryRules(max_attempts=1), given_up=FAILED)
    queue.claim(2)
    queue.fail(np.array([0, 1]), "unparsable")
    assert rows.status.tolist() == [FAILED, FAILED]
    assert queue.fail(np.array([0]), "unparsable")[0].tolist() == []  # given up stays given up


def test_rules_are_read_at_each_failure(clock):
    rows = Rows(1)
    rules = RetryRules(max_attempts=5)
    queue = WorkQueue(rows.columns, rules)
    queue.claim(1)
    queue.fail(np.array([0]), "unparsable")
    rules.max_attempts = 2
    clock.now += MAX_RETRY_S
    queue.claim(1)
    assert queue.fail(np.array([0]), "unparsable")[1].tolist() == [True]
