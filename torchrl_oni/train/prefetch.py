"""Batches taken from the env workers while the learner learns: a bounded prefetch thread.

Why: TorchRL's ``MultiAsyncCollector`` asks a worker for its next batch ("continue") only when
the trainer takes that worker's last batch from the collector's queue. While the learner
updates, hooks run and logs are written, nobody takes, and every worker that finishes a batch
waits. On the GPU node (15 workers × 128 games, the trainer waiting ~70 % of the time) each
worker made 5.6–6.5k frames/s against 7.3k for a core alone: the workers were the limit, and
part of their time was this wait.

:class:`Prefetcher` drives an iterator (the collector's own) in a daemon thread and keeps what
it yields until the consumer asks, so the collector's queue is drained, and the workers are
re-armed, while the trainer is busy elsewhere.

Contract:

* **bounded**: at most ``depth`` items are taken from the source and not yet handed over; the
  thread asks the source for the next one only when there is room, so a worker is never more
  than ``depth`` batches ahead of the learner because of the prefetch (a batch taken early was
  played with the weights its worker had, as any batch of the asynchronous collector);
* **in order**: items come out in the order the source yielded them; an exception raised by the
  source is raised by the consumer's ``next()`` after the items yielded before it; the source's
  end ends the iteration;
* **stoppable**: :meth:`close` sets :attr:`stopping`, waits for the thread and drops the items
  held. A source that can block for long must poll :attr:`stopping` and raise
  :class:`PrefetchStopped` when it is set (the local collector's queue polls every 50 ms), so
  that nothing else (shutting the workers down) runs beside the thread.

Example:
    >>> def slow_squares():
    ...     for i in range(5):
    ...         yield i * i
    >>> with Prefetcher(slow_squares(), depth=2) as ready:
    ...     list(ready)
    [0, 1, 4, 9, 16]
    >>> def breaks():
    ...     yield "batch"
    ...     raise RuntimeError("worker 1 died")
    >>> ready = Prefetcher(breaks(), depth=4)
    >>> next(ready)
    'batch'
    >>> next(ready)
    Traceback (most recent call last):
    RuntimeError: worker 1 died
    >>> ready.close()
"""
from __future__ import annotations

import queue
import threading
from typing import Iterator, Optional

__all__ = ["PrefetchStopped", "Prefetcher"]

_END = object()  # the source is exhausted
_POLL_S = 0.05  # how often a waiting thread looks at ``stopping``


class PrefetchStopped(Exception):
    """Raised inside the source when the prefetcher is closing: the thread ends quietly."""


class Prefetcher:
    """Iterates ``source`` in a daemon thread, holding up to ``depth`` items ready.

    Args:
        source: the iterator to drain (a generator, a collector's ``iterator()``).
        depth: items taken and not yet handed over, at most (≥ 1).
        name: the thread's name (for ``py-spy`` and logs).
    """

    def __init__(self, source: Iterator, depth: int, name: str = "prefetch"):
        if depth < 1:
            raise ValueError(f"prefetch depth must be at least 1, got {depth}")
        self.depth = depth
        self.stopping = threading.Event()
        self._source = source
        self._room = threading.Semaphore(depth)
        self._ready: "queue.Queue" = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        try:
            while not self.stopping.is_set():
                if not self._room.acquire(timeout=_POLL_S) or self.stopping.is_set():
                    continue
                try:
                    item = next(self._source)
                except StopIteration:
                    self._ready.put((_END, None))
                    return
                self._ready.put((item, None))
        except PrefetchStopped:
            return
        except BaseException as err:  # noqa: BLE001 — handed to the consumer, raised there
            self._ready.put((None, err))

    # ------------------------------------------------------------------ the consumer
    def __iter__(self) -> "Prefetcher":
        return self

    def __next__(self):
        while True:
            try:
                item, err = self._ready.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._ready.empty():
                    raise RuntimeError("the prefetch thread ended without a word") from None
        if err is not None:
            self._ready.put((None, err))  # raised again if asked again, as a broken source would
            raise err
        if item is _END:
            self._ready.put((_END, None))
            raise StopIteration
        self._room.release()
        return item

    @property
    def held(self) -> int:
        """Items ready and not yet handed over (for tests and debugging)."""
        return self._ready.qsize()

    def close(self, timeout: Optional[float] = 30.0) -> None:
        """Stops the thread and drops what it holds. Safe to call twice."""
        self.stopping.set()
        self._room.release()  # a thread waiting for room wakes and sees ``stopping``
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
        while not self._ready.empty():
            self._ready.get_nowait()

    def __enter__(self) -> "Prefetcher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
