"""How much to send to one LLM server, and when: the pacing parts of
:class:`~torchrl_oni.annotators.client.LLMClient`, one set per server of its pool.

* :class:`CircuitBreaker` — takes a server out after consecutive failures and lets a request
  through again after a cool-down or a health check that answers;
* :class:`RequestSizer` — prompts per request, requests in flight and the time limit of a
  request, adapted to the latency the server shows;
* ``_RateMeter`` — events per second over a sliding window (each server's ``labels_per_s``).

**A slow answer is not a failure.** A :class:`RequestSizer` adapts to the latency the server
actually shows:

* prompts per request start at ``initial_batch`` (4) and double after a full request
  answered within ``target_latency_s / 2`` (up to ``max_batch``); they halve after a request
  slower than ``2 × target_latency_s`` or a timeout;
* requests in flight (at most ``max_concurrency``) halve after a timeout and grow back by one
  after each answer within ``target_latency_s``;
* the time limit of a request of ``n`` prompts is
  ``clip(timeout_factor × p × n, min_timeout_s, max_timeout_s)`` where ``p`` is the larger of
  the 90th percentile and the latest of the seconds per prompt of recent requests (latency / n;
  a request that timed out contributes limit / n, a lower bound, so the next limit per prompt is
  at least twice as long). Before any answer the limit is ``first_timeout_s``. ``timeout_s``
  fixes the limit instead.

Example:
    >>> from torchrl_oni.annotators.pacing import CircuitBreaker, RequestSizer
    >>> sizer = RequestSizer(max_batch=8, max_concurrency=2, initial_batch=8, timeout_s=5.0)
    >>> sizer.batch, sizer.concurrency, sizer.timeout(8)
    (8, 2, 5.0)
    >>> CircuitBreaker(failures=1).state
    'closed'
"""
from __future__ import annotations

import collections
import math
import time
from typing import Deque, List, Optional

__all__ = ["CircuitBreaker", "RequestSizer"]

class CircuitBreaker:
    """Opens after ``failures`` consecutive failures; stays open for ``cooldown_s``.

    After the cool-down (or :meth:`half_open`, when a health check says the server answers) the
    breaker is *half-open*: a request is let through; its failure re-opens the breaker at once,
    its success closes it.

    Example:
        >>> cb = CircuitBreaker(failures=2, cooldown_s=60.0)
        >>> cb.record_failure(); cb.allow()
        True
        >>> cb.record_failure(); cb.allow(), cb.state
        (False, 'open')
        >>> cb.half_open(); cb.allow(), cb.state
        (True, 'half-open')
    """

    def __init__(self, failures: int = 5, cooldown_s: float = 30.0, clock=time.monotonic) -> None:
        self.failures = max(1, int(failures))
        self.cooldown_s = float(cooldown_s)
        self._clock = clock
        self.consecutive = 0
        self._open_until = 0.0

    def allow(self) -> bool:
        return self._clock() >= self._open_until

    @property
    def is_open(self) -> bool:
        return not self.allow()

    @property
    def state(self) -> str:
        """``"closed"``, ``"open"`` or ``"half-open"``."""
        if not self.allow():
            return "open"
        return "half-open" if self.consecutive >= self.failures else "closed"

    def open_for(self) -> float:
        """Seconds until the breaker lets a request through again (0 when it does now)."""
        return max(0.0, self._open_until - self._clock())

    def record_success(self) -> None:
        self.consecutive = 0
        self._open_until = 0.0

    def record_failure(self) -> None:
        self.consecutive += 1
        if self.consecutive >= self.failures:
            self._open_until = self._clock() + self.cooldown_s

    def trip(self) -> None:
        """Opens the breaker now (a server found dead by a health check)."""
        self.consecutive = max(self.consecutive, self.failures)
        self._open_until = self._clock() + self.cooldown_s

    def half_open(self) -> None:
        """Lets the next request through (a health check found the server answering)."""
        if self.consecutive >= self.failures:
            self._open_until = min(self._open_until, self._clock())


class RequestSizer:
    """Prompts per request, requests in flight and the time limit for one server, adapted to
    the latency the server shows (the rules are in the module docstring).

    Args:
        max_batch: most prompts per request.
        max_concurrency: most requests in flight.
        adaptive: adapt the batch and concurrency; if False they stay at their maxima.
        initial_batch: prompts per request before any answer.
        target_latency_s: the request latency the batch is sized for.
        timeout_s: a fixed time limit per request (``None``: adaptive).
        min_timeout_s, max_timeout_s: bounds of the adaptive limit.
        first_timeout_s: the adaptive limit before any answer.
        timeout_factor: the limit is this many times the expected latency.
        window: how many recent requests the latency estimate uses.

    Example:
        >>> sizer = RequestSizer(max_batch=100, max_concurrency=4, initial_batch=4)
        >>> sizer.batch, sizer.timeout(4)
        (4, 120.0)
        >>> sizer.record_answer(4, latency_s=1.0)  # fast: the batch doubles
        >>> sizer.batch, sizer.timeout(8)  # 4 × 0.25 s × 8 prompts, raised to the floor
        (8, 30.0)
        >>> sizer.record_timeout(8, limit_s=200.0)  # 25 s per prompt at least: halve and wait longer
        >>> sizer.batch, sizer.concurrency, sizer.timeout(4)
        (4, 2, 400.0)
    """

    def __init__(
        self,
        max_batch: int = 100,
        max_concurrency: int = 4,
        *,
        adaptive: bool = True,
        initial_batch: int = 4,
        target_latency_s: float = 10.0,
        timeout_s: Optional[float] = None,
        min_timeout_s: float = 30.0,
        max_timeout_s: float = 600.0,
        first_timeout_s: float = 120.0,
        timeout_factor: float = 4.0,
        window: int = 32,
    ) -> None:
        if max_batch < 1 or max_concurrency < 1 or initial_batch < 1:
            raise ValueError("batch sizes and concurrency must be >= 1")
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if not 0 < min_timeout_s <= max_timeout_s or target_latency_s <= 0 or timeout_factor <= 0:
            raise ValueError("need 0 < min_timeout_s <= max_timeout_s, target_latency_s > 0 and "
                             "timeout_factor > 0")
        self.max_batch = int(max_batch)
        self.max_concurrency = int(max_concurrency)
        self.adaptive = bool(adaptive)
        self.target_latency_s = float(target_latency_s)
        self.timeout_s = None if timeout_s is None else float(timeout_s)
        self.min_timeout_s = float(min_timeout_s)
        self.max_timeout_s = float(max_timeout_s)
        self.first_timeout_s = min(max(float(first_timeout_s), self.min_timeout_s), self.max_timeout_s)
        self.timeout_factor = float(timeout_factor)
        self.batch = min(int(initial_batch), self.max_batch) if adaptive else self.max_batch
        self.concurrency = self.max_concurrency
        self._per_prompt: Deque[float] = collections.deque(maxlen=int(window))
        self._latency: Deque[float] = collections.deque(maxlen=int(window))

    def seconds_per_prompt(self) -> Optional[float]:
        """The larger of the p90 and the latest of recent latency / prompts; None before any."""
        if not self._per_prompt:
            return None
        ordered = sorted(self._per_prompt)
        p90 = ordered[min(len(ordered) - 1, int(math.ceil(0.9 * len(ordered))) - 1)]
        return max(p90, self._per_prompt[-1])

    def latency_s(self, q: float = 0.5) -> float:
        """A quantile of recent answered requests' latency (0 before any)."""
        if not self._latency:
            return 0.0
        ordered = sorted(self._latency)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    def timeout(self, n: int) -> float:
        """The time limit for a request of ``n`` prompts."""
        if self.timeout_s is not None:
            return self.timeout_s
        per_prompt = self.seconds_per_prompt()
        if per_prompt is None:
            return self.first_timeout_s
        limit = self.timeout_factor * per_prompt * max(int(n), 1)
        return min(max(limit, self.min_timeout_s), self.max_timeout_s)

    def record_answer(self, n: int, latency_s: float) -> None:
        """A request of ``n`` prompts was answered after ``latency_s`` seconds."""
        n = max(int(n), 1)
        self._per_prompt.append(latency_s / n)
        self._latency.append(latency_s)
        if not self.adaptive:
            return
        if latency_s > 2 * self.target_latency_s:
            self.batch = max(1, self.batch // 2)
        elif n >= self.batch and latency_s < self.target_latency_s / 2:
            self.batch = min(self.max_batch, 2 * self.batch)
        if latency_s <= self.target_latency_s and self.concurrency < self.max_concurrency:
            self.concurrency += 1

    def record_timeout(self, n: int, limit_s: float) -> None:
        """A request of ``n`` prompts got no answer within ``limit_s`` seconds."""
        self._per_prompt.append(limit_s / max(int(n), 1))  # a lower bound on the true value
        if self.adaptive:
            self.batch = max(1, self.batch // 2)
            self.concurrency = max(1, self.concurrency // 2)


class _RateMeter:
    """Events per second over a sliding window, in one-second buckets (cheap at any rate)."""

    def __init__(self, clock, keep_s: float = 60.0) -> None:
        self._clock = clock
        self._keep_s = keep_s
        self._buckets: Deque[List[float]] = collections.deque()

    def add(self, n: int) -> None:
        now = self._clock()
        second = math.floor(now)
        if self._buckets and self._buckets[-1][0] == second:
            self._buckets[-1][1] += n
        else:
            self._buckets.append([second, n])
        while self._buckets and now - self._buckets[0][0] > self._keep_s + 1:
            self._buckets.popleft()

    def count(self, window_s: float) -> float:
        now = self._clock()
        return sum(n for t, n in list(self._buckets) if now - t <= window_s)

    def rate(self, window_s: float, since: Optional[float] = None) -> float:
        span = window_s if since is None else min(window_s, max(self._clock() - since, 1e-9))
        return self.count(window_s) / span if span > 0 else 0.0
