"""The fault-handling rules of every labelling queue of the package.

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
from typing import Dict

import numpy as np

from torchrl_oni.annotators.teacher import SKIP_ERROR

__all__ = ["is_parse_failure", "is_skip", "retry_delay", "waiting_slots", "MAX_RETRY_S", "MAX_SERVER_RETRY_S"]

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

