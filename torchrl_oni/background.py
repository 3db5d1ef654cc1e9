"""BackgroundLoop: a daemon thread with its own asyncio loop that keeps a client's calls in flight.

The package's two background workers are this loop with different work:
:class:`~torchrl_oni.annotation.AnnotationWorker` (captions of a
:class:`~torchrl_oni.store.CaptionStore` → labels) and :class:`~torchrl_oni.rewards.ellm.GoalWorker`
(states of a :class:`~torchrl_oni.rewards.ellm.GoalTable` → goals). The caller never waits: it
:meth:`~BackgroundLoop.wake`\\ s the loop after adding work, which costs one lock and one
``call_soon_threadsafe``.

One round of the loop:

1. ask the client whether a request could be sent now (``available()``); when a server that was
   out answers again (the client's ``recoveries`` counter moved) or may (``available()`` turned
   True: a health check or the breaker's cool-down lets a request through), put the items that
   failed for server reasons back in the queue (:meth:`BackgroundLoop._requeue_failed`);
2. while fewer than ``concurrency_hint()`` (else ``max_concurrency``) calls are in flight and the
   client is available, start a call on up to ``min(batch_size, batch_hint())`` claimed items
   (:meth:`BackgroundLoop._next_call`); while no request could be sent nothing is claimed, so no
   item is held or refused;
3. with nothing in flight and nothing claimable, declare itself idle (:meth:`~BackgroundLoop.wait_idle`
   returns), unless a :meth:`~BackgroundLoop.wake` came in since the round began;
4. sleep until a call finishes, a wake-up, or ``poll_interval_s`` (retry backoffs end, a server
   that was out is checked).

:meth:`~BackgroundLoop.stop` gives calls in flight a moment, then cancels them (a subclass's call
releases its items when cancelled: :meth:`BackgroundLoop._results`), and awaits the client's
``aclose()`` when asked to. An exception escaping the loop is kept in ``crashed`` and logged; the
caller's thread never sees it.

The client's steering methods are all optional (:class:`~torchrl_oni.annotators.openai.OpenAIAnnotator`
has them, and so has :class:`~torchrl_oni.annotators.goals.OpenAIGoalSuggester` through it):
``available()``, ``recoveries`` (an int attribute), ``batch_hint()``, ``concurrency_hint()``.

Failures are counted by kind with the store's classification
(:func:`~torchrl_oni.store.is_parse_failure`, :func:`~torchrl_oni.store.is_skip`) and summed up in
the log at most every ``log_interval_s`` seconds.

Example:
    >>> import asyncio
    >>> from torchrl_oni.background import BackgroundLoop
    >>> class Squares(BackgroundLoop):
    ...     def __init__(self, todo):
    ...         super().__init__(None, batch_size=2, name="squares")
    ...         self.todo, self.done = list(todo), []
    ...     def _claimable(self):
    ...         return len(self.todo)
    ...     def _next_call(self, batch):
    ...         if not self.todo:
    ...             return None
    ...         items, self.todo = self.todo[:batch], self.todo[batch:]
    ...         return self._square(items)
    ...     async def _square(self, items):
    ...         await asyncio.sleep(0)
    ...         self.done += [x * x for x in items]
    >>> worker = Squares(range(5)).start()
    >>> worker.wait_idle(timeout=10)
    True
    >>> worker.stop()
    >>> sorted(worker.done), worker.running
    ([0, 1, 4, 9, 16], False)
"""
from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from typing import Any, Awaitable, Callable, Deque, Dict, List, Optional, Sequence, Tuple

import numpy as np

from torchrl_oni.store import is_parse_failure, is_skip

__all__ = ["BackgroundLoop", "NotCopyableError"]


class NotCopyableError(RuntimeError):
    """Raised by ``copy.deepcopy`` and pickling of an object that owns a background thread.

    A ``RuntimeError`` on purpose: TorchRL's multiprocess collectors turn a ``TypeError`` raised
    while pickling a worker's arguments into a generic "non-serializable object" error (or drop
    it), and let a ``RuntimeError`` through with its message.
    """

_log = logging.getLogger(__name__)


class BackgroundLoop:
    """The thread, the loop, and the bookkeeping both background workers share (see the module docstring).

    Subclasses implement :meth:`_next_call` (claim items and return the coroutine that asks the
    client about them), :meth:`_claimable` and, when their queue keeps server failures aside,
    :meth:`_requeue_failed`; their coroutines hand results back through :meth:`_results`,
    :meth:`_failures`, :meth:`_count_call` and :meth:`_record_failures`.

    Args:
        client: the object the calls go to (an annotator, a goal suggester); its optional
            steering methods are read each round.
        batch_size: most items per call.
        max_concurrency: calls in flight when the client gives no ``concurrency_hint``.
        poll_interval_s: longest sleep between rounds.
        log_interval_s: failures are summarised in the log at most this often.
        close_client: await ``client.aclose()`` when the loop stops.
        name: the thread's name.
        logger: where the loop's messages go (the subclass's module logger).
    """

    #: who speaks in log lines, and what its items are called
    what = "background"
    noun = "items"
    #: log line for failures since the last report (``%s``: ``kind: count, ...``)
    failure_log = "background calls failed since the last report: %s"
    #: log line when the loop dies
    crash_log = "background worker crashed"
    #: error kinds of a whole call with the wrong number of results, and of a result without one
    wrong_count = "wrong_count"
    no_value = "no_value"

    def __init__(
        self,
        client: Any,
        *,
        batch_size: int = 100,
        max_concurrency: int = 4,
        poll_interval_s: float = 1.0,
        log_interval_s: float = 60.0,
        close_client: bool = False,
        name: str = "oni-background",
        logger: Optional[logging.Logger] = None,
    ):
        if batch_size < 1 or max_concurrency < 1:
            raise ValueError("batch_size and max_concurrency must be >= 1")
        self.client = client
        self.batch_size = int(batch_size)
        self.max_concurrency = int(max_concurrency)
        self.poll_interval_s = float(poll_interval_s)
        self.log_interval_s = float(log_interval_s)
        self.close_client = bool(close_client)
        self._name = name
        self._logger = logger or _log
        self._thread: Optional[threading.Thread] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._wake_event: Optional[asyncio.Event] = None
        self._ready = threading.Event()
        self._stopping = False
        self._drain_timeout_s = 5.0
        self._idle = threading.Event()
        # wake() bumps this; the loop only declares itself idle if no wake came in since it last
        # looked for work (else an item added mid-round could be missed by wait_idle).
        self._wake_seq = 0
        self._idle_lock = threading.Lock()
        self._metrics_lock = threading.Lock()
        self._in_flight = 0
        self._call_started: Dict[asyncio.Future, float] = {}
        self._started_at: Optional[float] = None
        self._latencies: Deque[float] = collections.deque(maxlen=100)
        self._failure_times: Deque[Tuple[float, str, int]] = collections.deque(maxlen=4096)
        self._unlogged_failures: Dict[str, int] = {}
        self._last_failure_log = float("-inf")
        self._was_available = True
        self._recoveries_seen = getattr(client, "recoveries", None)
        self.requests_total = 0
        self.parse_failures = 0
        self.server_failures = 0
        self.skipped = 0
        self.requeued_total = 0
        self.failures_by_kind: Dict[str, int] = {}
        self.crashed: Optional[BaseException] = None

    # ------------------------------------------------------------------ for subclasses
    def _next_call(self, batch: int) -> Optional[Awaitable[None]]:
        """Claims up to ``batch`` items; returns the coroutine that handles them, or None."""
        raise NotImplementedError

    def _claimable(self) -> int:
        """How many items a round could claim now (retry backoffs excluded)."""
        return 0

    def _requeue_failed(self) -> int:
        """Puts items that failed for server reasons back in the queue now; returns how many."""
        return 0

    # ------------------------------------------------------------------ control
    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self):
        """Starts the thread (no-op when already running). Returns ``self``.

        A resumed or reused queue may hold items that failed for server reasons: they go back
        in the queue first.
        """
        if self.running:
            return self
        self._stopping = False
        self._ready.clear()
        self._idle.clear()
        self._started_at = time.monotonic()
        self._requeue("worker start")
        self._thread = threading.Thread(target=self._thread_main, name=self._name, daemon=True)
        self._thread.start()
        self._ready.wait(timeout=10)
        return self

    def wake(self) -> None:
        """Tells the loop there may be new work (thread-safe, never blocks)."""
        with self._idle_lock:
            self._wake_seq += 1
            self._idle.clear()
        loop, event = self._loop, self._wake_event
        if loop is not None and event is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # the loop closed between the check and the call
                pass

    def wait_idle(self, timeout: Optional[float] = None) -> bool:
        """Blocks until nothing is in flight and nothing is claimable (tests, end of a run).

        Returns False on timeout or when not running. Items waiting for a retry backoff do not
        count as work.
        """
        if not self.running:
            return False
        self.wake()
        return self._idle.wait(timeout)

    def stop(self, timeout: float = 5.0) -> None:
        """Stops the loop: calls in flight get ``timeout`` seconds to finish, then are cancelled
        and their items released back to the queue, so nothing is lost."""
        if self._thread is None:
            return
        self._drain_timeout_s = float(timeout)
        self._stopping = True
        self.wake()
        self._thread.join(timeout + 5.0)
        self._thread = None
        self._flush_failure_log(force=True)

    def __deepcopy__(self, memo):
        raise NotCopyableError(f"{type(self).__name__} owns a thread: it cannot be copied or pickled")

    def __getstate__(self):
        raise NotCopyableError(f"{type(self).__name__} owns a thread: it cannot be copied or pickled")

    def servers(self) -> list:
        """``(url, up, last_error)`` of each LLM server the client sends to; empty for clients
        without servers (rules, a simulated teacher)."""
        return list(self._client_call("servers", []))

    # ------------------------------------------------------------------ accounting
    def _client_call(self, name: str, default, *args):
        """``client.<name>(*args)``, or ``default`` when the client lacks it or it raises."""
        fn = getattr(self.client, name, None)
        if not callable(fn):
            return default
        try:
            return fn(*args)
        except Exception:  # noqa: BLE001 - steering and summaries must never break the loop
            self._logger.debug("%s.%s() failed", type(self.client).__name__, name, exc_info=True)
            return default

    def _count_call(self, latency_s: float) -> None:
        """Counts an answered call. Call with ``_metrics_lock`` held."""
        self.requests_total += 1
        self._latencies.append(latency_s)

    def _record_failures(self, counts: Dict[str, int]) -> None:
        """Counts failed items by error kind (skips are answers: counted apart, never logged)."""
        if not counts:
            return
        now = time.monotonic()
        with self._metrics_lock:
            for kind, n in counts.items():
                if is_skip(kind):
                    self.skipped += n
                    continue
                if is_parse_failure(kind):
                    self.parse_failures += n
                else:
                    self.server_failures += n
                self.failures_by_kind[kind] = self.failures_by_kind.get(kind, 0) + n
                self._unlogged_failures[kind] = self._unlogged_failures.get(kind, 0) + n
                self._failure_times.append((now, kind, n))
        self._flush_failure_log()

    def _flush_failure_log(self, force: bool = False) -> None:
        now = time.monotonic()
        with self._metrics_lock:
            if not self._unlogged_failures:
                return
            if not force and now - self._last_failure_log < self.log_interval_s:
                return
            summary = ", ".join(f"{k}: {v}" for k, v in sorted(self._unlogged_failures.items()))
            self._unlogged_failures = {}
            self._last_failure_log = now
        self._logger.warning(self.failure_log, summary)

    def _loop_metrics(self) -> Dict[str, float]:
        """``requests_total``, ``in_flight``, ``parse_failures``, ``latency_s`` (mean of the last
        100 calls), ``worker_running``. Call with ``_metrics_lock`` held."""
        return {
            "requests_total": self.requests_total,
            "in_flight": self._in_flight,
            "parse_failures": self.parse_failures,
            "latency_s": float(np.mean(self._latencies)) if self._latencies else 0.0,
            "worker_running": float(self.running),
        }

    def _requeue(self, why: str) -> int:
        n = int(self._requeue_failed())
        if n:
            with self._metrics_lock:
                self.requeued_total += n
            self._logger.info("%s: %d %s that failed for server reasons are queued again (%s)",
                              self.what, n, self.noun, why)
        return n

    # ------------------------------------------------------------------ results of one call
    async def _results(self, call: Awaitable[Sequence], n: int, *, release: Callable[[], Any],
                       fail: Callable[[str], Any]) -> Optional[Sequence]:
        """Awaits ``call`` (a client call about ``n`` items): its results, or None when the call
        failed as a whole (an exception: error kind = its class name; the wrong number of results:
        :attr:`wrong_count`), after ``fail(kind)`` and counting. Cancelled (at :meth:`stop`):
        ``release()``, then the cancellation goes on."""
        try:
            results = await call
        except asyncio.CancelledError:
            release()
            raise
        except Exception as err:  # noqa: BLE001 - a failing client fails its items, never the loop
            kind = type(err).__name__
        else:
            if len(results) == n:
                return results
            kind = self.wrong_count
        fail(kind)
        self._record_failures({kind: n})
        return None

    def _failures(self, results: Sequence) -> Dict[str, List[int]]:
        """Positions of the results that are not ``ok``, by error kind (:attr:`no_value` without one)."""
        failed: Dict[str, List[int]] = {}
        for i, result in enumerate(results):
            if not result.ok:
                failed.setdefault(result.error or self.no_value, []).append(i)
        return failed

    # ------------------------------------------------------------------ the loop
    def _thread_main(self) -> None:
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(self._main(loop))
        except BaseException as err:  # keep the caller alive; report through metrics and logs
            self.crashed = err
            self._logger.exception(self.crash_log)
        finally:
            self._loop = None
            self._wake_event = None
            self._ready.set()
            self._idle.set()
            loop.close()

    def _available(self) -> bool:
        """Steering at the start of a round: can a request be sent, and did a server come back?"""
        available = bool(self._client_call("available", True))
        recoveries = getattr(self.client, "recoveries", None)
        if recoveries is not None and recoveries != self._recoveries_seen:
            self._recoveries_seen = recoveries
            self._requeue("an LLM server answers again")
        elif available and not self._was_available:
            # a health check (or the breaker's cool-down) lets a request through: without items
            # to send, no request could succeed and bump ``recoveries``
            self._requeue(f"the {type(self.client).__name__} takes requests again")
        self._was_available = available
        return available

    async def _main(self, loop: asyncio.AbstractEventLoop) -> None:
        self._wake_event = asyncio.Event()
        self._loop = loop
        self._ready.set()
        in_flight: set = set()
        while not self._stopping:
            seq = self._wake_seq
            available = self._available()
            limit = max(1, int(self._client_call("concurrency_hint", self.max_concurrency)))
            while available and len(in_flight) < limit:
                batch = max(1, min(self.batch_size, int(self._client_call("batch_hint", self.batch_size))))
                call = self._next_call(batch)
                if call is None:
                    break
                task = asyncio.ensure_future(call)
                in_flight.add(task)
                self._call_started[task] = time.monotonic()
            with self._metrics_lock:
                self._in_flight = len(in_flight)
            if not in_flight and (available or not self._claimable()):
                with self._idle_lock:
                    if self._wake_seq == seq:
                        self._idle.set()
            wake = asyncio.ensure_future(self._wake_event.wait())
            done, _ = await asyncio.wait(in_flight | {wake}, timeout=self.poll_interval_s,
                                         return_when=asyncio.FIRST_COMPLETED)
            wake.cancel()
            self._wake_event.clear()
            in_flight -= done
            with self._metrics_lock:
                for task in done:
                    self._call_started.pop(task, None)
        # Shutdown: give calls in flight a moment, then cancel them (their items are released;
        # the client's aclose closes its connections so servers stop the work).
        if in_flight:
            _, still = await asyncio.wait(in_flight, timeout=self._drain_timeout_s)
            for task in still:
                task.cancel()
            if still:
                await asyncio.gather(*still, return_exceptions=True)
        with self._metrics_lock:
            self._in_flight = 0
            self._call_started.clear()
        if self.close_client and hasattr(self.client, "aclose"):
            try:
                await self.client.aclose()
            except Exception:  # noqa: BLE001
                self._logger.exception("%s.aclose() failed", type(self.client).__name__)
