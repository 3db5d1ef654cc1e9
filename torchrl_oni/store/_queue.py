"""The labelling work queue of the package, and its fault-handling rules.

:class:`WorkQueue` is the one queue under :class:`~torchrl_oni.store.CaptionStore`'s captions,
its pairs, and :class:`~torchrl_oni.rewards.ellm.GoalTable`'s states: statuses
(:mod:`torchrl_oni.store.status`) and attempts in its owner's columns, retry times and server
fault counts beside them. Life of an item: unseen → :meth:`~WorkQueue.claim` → pending →
:meth:`~WorkQueue.finish` → labelled, or :meth:`~WorkQueue.fail` → back to unseen after a
backoff, given up, or skipped.

A failed request is one of three things:

* a **server fault** (timeouts, HTTP 5xx, connection errors, a request held back by the circuit
  breaker, anything that is not an unparsable answer) says nothing about the item: it goes back
  to the queue after a short backoff (``server_retry_s``, doubling, at most
  :data:`MAX_SERVER_RETRY_S`) and is **never given up**; ``requeue_server_failures`` cancels
  those backoffs (when the server is back);
* an **unparsable answer** (:func:`is_parse_failure`) counts as an attempt: the item waits
  ``retry_backoff_s``, doubling, at most :data:`MAX_RETRY_S`, and is *given up* after
  ``max_attempts`` of them;
* a **skip** (:func:`is_skip`): the labeller declined the item; a final answer, never retried.

Example:
    >>> is_parse_failure("unparsable"), is_skip("skip"), retry_delay(5.0, 3, MAX_SERVER_RETRY_S)
    (True, True, 20.0)
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, Optional, Protocol, Tuple

import numpy as np

from torchrl_oni.annotators.base import SKIP_ERROR
from torchrl_oni.store.status import GIVEN_UP, LABELLED, PENDING, SKIPPED, UNSEEN

__all__ = ["WorkQueue", "RetryRules", "is_parse_failure", "is_skip", "retry_delay", "waiting_slots", "MAX_RETRY_S", "MAX_SERVER_RETRY_S"]

# Longest wait before an item that failed for a server reason is handed out again, and before
# one whose answer could not be parsed is.
MAX_SERVER_RETRY_S = 300.0
MAX_RETRY_S = 3600.0


def is_parse_failure(error_kind: str) -> bool:
    """True for failures that are the model's fault (an answer that could not be parsed).

    Everything else (timeouts, HTTP errors, connection errors, ``"circuit open"``, exceptions)
    is a server fault: it says nothing about the caption.

    Example:
        >>> is_parse_failure("unparsable"), is_parse_failure("timeout")
        (True, False)
    """
    return "pars" in error_kind.lower()


def retry_delay(first_s: float, failures, cap_s: float):
    """Seconds before an item that failed ``failures`` times in a row is asked again:
    ``first_s · 2^(failures-1)``, at most ``cap_s``. Vectorised over a numpy array of counts.

    The rule of every request queue of the package (:class:`CaptionStore`'s captions and pairs,
    :class:`~torchrl_oni.rewards.ellm.GoalTable`'s states): server faults wait
    ``server_retry_s``-based delays capped at :data:`MAX_SERVER_RETRY_S` and are never given up;
    unparsable answers wait ``retry_backoff_s``-based delays capped at :data:`MAX_RETRY_S`.

    Example:
        >>> retry_delay(5.0, 1, 300.0), retry_delay(5.0, 4, 300.0), retry_delay(5.0, 99, 300.0)
        (5.0, 40.0, 300.0)
        >>> retry_delay(30.0, np.array([1, 2]), 3600.0).tolist()
        [30.0, 60.0]
    """
    # the exponent is capped so a long outage cannot overflow the float
    exponent = np.minimum(np.asarray(failures, dtype=np.float64), 30.0) - 1.0
    delay = np.minimum(float(first_s) * 2.0 ** exponent, float(cap_s))
    return float(delay) if delay.ndim == 0 else delay


def waiting_slots(*retry_ats: Dict[int, float]) -> np.ndarray:
    """Slots still waiting for a retry backoff in ``retry_ats`` (slot → monotonic time it may be
    asked again); entries whose time has come are dropped on the way.

    Example:
        >>> import time
        >>> retry_at = {3: time.monotonic() + 60.0, 7: time.monotonic() - 1.0}
        >>> waiting_slots(retry_at).tolist(), sorted(retry_at)
        ([3], [3])
    """
    if not any(retry_ats):
        return np.empty(0, dtype=np.int64)
    now = time.monotonic()
    for retry_at in retry_ats:
        for slot in [k for k, t in retry_at.items() if t <= now]:
            del retry_at[slot]
    keys = [k for retry_at in retry_ats for k in retry_at]
    return np.fromiter(keys, dtype=np.int64, count=len(keys))


def is_skip(error_kind: str) -> bool:
    """True for a labeller's refusal to answer (:data:`SKIP_ERROR`): final, never retried.

    Example:
        >>> is_skip("skip"), is_skip("timeout")
        (True, False)
    """
    return error_kind == SKIP_ERROR


class QueueRules(Protocol):
    """What a :class:`WorkQueue` reads from its owner at each failure (so later changes count)."""

    max_attempts: int
    retry_backoff_s: float
    server_retry_s: float


@dataclass
class RetryRules:
    """A stand-alone :class:`QueueRules` (owners such as the caption store are their own)."""

    max_attempts: int = 3
    retry_backoff_s: float = 30.0
    server_retry_s: float = 5.0


class WorkQueue:
    """A labelling queue over its owner's ``status`` and ``attempts`` columns. Not thread-safe:
    the owner's lock is held around every call.

    Args:
        columns: returns ``(status int8[n], attempts int16[n])``, writable views of the owner's
            live rows (called at each operation, so the owner may grow or replace its arrays).
        rules: ``max_attempts``, ``retry_backoff_s``, ``server_retry_s`` (see the module
            docstring), read at each failure.
        given_up: the status of an item given up after ``max_attempts`` unparsable answers:
            :data:`~torchrl_oni.store.status.GIVEN_UP`, or ``FAILED`` for ELLM's goal table,
            whose saved files use 3 for it.

    Example:
        >>> import numpy as np
        >>> status, attempts = np.zeros(3, np.int8), np.zeros(3, np.int16)
        >>> queue = WorkQueue(lambda: (status, attempts), RetryRules(max_attempts=1))
        >>> queue.claim(2).tolist(), status.tolist()
        ([0, 1], [1, 1, 0])
        >>> queue.finish(np.array([0]))
        >>> queue.fail(np.array([1]), "unparsable")[1].tolist(), status.tolist()   # given up
        ([True], [2, 4, 0])
    """

    def __init__(self, columns: Callable[[], Tuple[np.ndarray, np.ndarray]], rules: QueueRules, *,
                 given_up: int = GIVEN_UP):
        self._columns = columns
        self.rules = rules
        self.given_up = given_up
        # slot -> monotonic time before which a failed item is not handed out again: after
        # unparsable answers (kept until the item is answered) and after server faults (dropped
        # by requeue_server_failures), with the count of server faults in a row per slot.
        self._retry_at: Dict[int, float] = {}
        self._server_retry_at: Dict[int, float] = {}
        self._server_faults: Dict[int, int] = {}

    @property
    def status(self) -> np.ndarray:
        """The status column (a view of the owner's live rows)."""
        return self._columns()[0]

    def claimable(self) -> np.ndarray:
        """Unseen slots whose retry backoff (if any) has passed, in slot order."""
        cand = np.flatnonzero(self.status == UNSEEN)
        if len(cand):
            blocked = waiting_slots(self._retry_at, self._server_retry_at)
            if len(blocked):
                cand = cand[~np.isin(cand, blocked)]
        return cand

    def claim(self, max_items: int, order: Optional[Callable[[np.ndarray, int], np.ndarray]] = None) -> np.ndarray:
        """Marks up to ``max_items`` claimable slots pending and returns them: the first in slot
        order, or those ``order(candidates, max_items)`` picks."""
        k = max(int(max_items), 0)
        cand = self.claimable()
        cand = cand[:k] if order is None else order(cand, k)
        self.status[cand] = PENDING
        return cand

    def pending(self) -> np.ndarray:
        """Slots handed out and not answered yet."""
        return np.flatnonzero(self.status == PENDING)

    def finish(self, slots: np.ndarray) -> None:
        """Marks ``slots`` labelled: their answers arrived (whoever claimed them)."""
        self.status[slots] = LABELLED
        if self._retry_at:
            for slot in np.asarray(slots).tolist():
                self._retry_at.pop(slot, None)

    def forget(self, slots: Iterable[int]) -> None:
        """Drops the retry times and server fault counts of ``slots``."""
        for slot in np.asarray(slots).tolist():
            self._retry_at.pop(slot, None)
            self._server_retry_at.pop(slot, None)
            self._server_faults.pop(slot, None)

    def fail(self, slots: np.ndarray, error_kind: str, *, parse_failure: Optional[bool] = None,
             final: Optional[bool] = None) -> Tuple[np.ndarray, np.ndarray]:
        """Records failed requests of kind ``error_kind`` for ``slots``.

        A skip (``final``, by default :func:`is_skip`) is final: the items become skipped. A
        server fault (``not parse_failure``, by default ``not`` :func:`is_parse_failure`) sends
        them back to unseen after a server backoff and spends no attempt. An unparsable answer
        spends one: back to unseen after a backoff, or given up after ``max_attempts``. Labelled,
        given-up and skipped items are left alone (a late failure never erases an answer).

        Returns:
            ``(slots that took the failure, mask of those given up or skipped)``: the owner
            counts the failures it keeps statistics of.
        """
        status = self.status
        current = status[slots]
        slots = slots[(current != LABELLED) & (current != self.given_up) & (current != SKIPPED)]
        now = time.monotonic()
        if is_skip(error_kind) if final is None else final:
            # the labeller declined: a final answer, neither retried nor paid for again
            status[slots] = SKIPPED
            self.forget(slots)
            return slots, np.ones(len(slots), dtype=bool)
        if not (is_parse_failure(error_kind) if parse_failure is None else parse_failure):
            # A server fault says nothing about the item: back to the queue, no attempt spent.
            status[slots] = UNSEEN
            for slot in slots.tolist():
                k = self._server_faults.get(slot, 0) + 1
                self._server_faults[slot] = k
                self._server_retry_at[slot] = now + retry_delay(self.rules.server_retry_s, k, MAX_SERVER_RETRY_S)
            return slots, np.zeros(len(slots), dtype=bool)
        attempts_col = self._columns()[1]
        attempts_col[slots] += 1
        attempts = attempts_col[slots]
        give_up = attempts >= self.rules.max_attempts
        status[slots[give_up]] = self.given_up
        status[slots[~give_up]] = UNSEEN
        delays = retry_delay(self.rules.retry_backoff_s, attempts[~give_up], MAX_RETRY_S)
        for slot, delay in zip(slots[~give_up].tolist(), delays.tolist()):
            self._retry_at[slot] = now + delay
        for slot in slots[give_up].tolist():
            self._retry_at.pop(slot, None)
        return slots, give_up

    def release(self, slots: Optional[np.ndarray] = None) -> int:
        """Sends the pending ones of ``slots`` (default: all pending) back to unseen, at once;
        returns how many."""
        status = self.status
        slots = self.pending() if slots is None else slots[status[slots] == PENDING]
        status[slots] = UNSEEN
        return len(slots)

    def reopen(self, statuses: Iterable[int]) -> np.ndarray:
        """Items with one of ``statuses`` (e.g. given up) become unseen with a fresh attempt
        count; returns their slots."""
        status, attempts = self._columns()
        slots = np.flatnonzero(np.isin(status, tuple(statuses)))
        status[slots] = UNSEEN
        attempts[slots] = 0
        return slots

    def requeue_server_failures(self) -> int:
        """Cancels every server fault backoff and count; returns how many unseen items were
        waiting on one."""
        status = self.status
        now = time.monotonic()
        waiting = sum(1 for slot, t in self._server_retry_at.items() if t > now and status[slot] == UNSEEN)
        self._server_retry_at.clear()
        self._server_faults.clear()
        return waiting

    def retrying(self) -> int:
        """Unseen items that failed before: after unparsable answers, or after server faults."""
        status, attempts = self._columns()
        unseen = status == UNSEEN
        return int((unseen & (attempts > 0)).sum()) + sum(
            1 for slot in self._server_faults if status[slot] == UNSEEN and attempts[slot] == 0)
