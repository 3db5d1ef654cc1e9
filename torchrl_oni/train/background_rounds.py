"""Work the trainer hands to a thread beside it: it asks for a round, and never waits for it.

:class:`BackgroundRounds` runs a function (one *round*: a reward model's due steps and its
held-out evaluation) in a daemon thread each time the trainer calls :meth:`BackgroundRounds.poke`
after a PPO update. The update that follows runs at once; the round overlaps it and the time the
trainer spends waiting for env workers' batches.

Contract:

==================  ===========================================================================
``poke()``          asks for a round; returns at once. Pokes that arrive while a round runs are
                    coalesced into one next round (counted in ``coalesced``): a round that takes
                    longer than an update never builds a queue.
``paused()``        context manager: holds the thread between rounds (checkpoints read and write
                    the state a round changes).
``close()``         waits for the running round, then stops the thread. Idempotent.
errors              an exception in a round stops the thread; the next ``poke()`` (or
                    ``close()``) raises it in the trainer's thread, so a crash is never silent.
==================  ===========================================================================

Not :class:`~torchrl_oni.background.BackgroundLoop`, the asyncio loop that keeps an annotator's
HTTP calls in flight: a round here is blocking compute, one at a time.

Why a thread and not a process: the reward model is trained where it scores (the learner's
device), its published copy is swapped under a lock (:class:`~torchrl_oni.rewards.models.
ServedModel`), and torch releases the GIL inside its kernels.

Example:
    >>> from torchrl_oni.train.background_rounds import BackgroundRounds
    >>> done = []
    >>> rounds = BackgroundRounds(lambda: done.append(len(done)), name="demo")
    >>> rounds.poke()
    >>> rounds.wait_idle(timeout=10)
    True
    >>> rounds.close()
    >>> done, rounds.rounds
    ([0], 1)
"""
from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator, Optional

__all__ = ["BackgroundRounds"]


class BackgroundRounds:
    """Runs ``round_fn()`` in a daemon thread, once per :meth:`poke` (coalesced while busy).

    Args:
        round_fn: the work of one round; its return value is ignored (it records its own results).
        name: the thread's name (shown by py-spy and in error messages).

    Attributes:
        rounds: rounds finished.
        pokes: rounds asked for.
        coalesced: pokes folded into a round already asked for (the thread was behind).
    """

    def __init__(self, round_fn: Callable[[], object], name: str = "background-rounds"):
        self.round_fn = round_fn
        self.name = name
        self.rounds = self.pokes = self.coalesced = 0
        self._state = threading.Condition()
        self._asked = False  # a round is asked for and not started yet
        self._running = False
        self._held = 0  # paused() sections open
        self._stop = False
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def poke(self) -> None:
        """Asks for one round after the current one; raises the error of a round that failed."""
        with self._state:
            self._raise_error()
            if self._stop:
                raise RuntimeError(f"{self.name}: poked after close()")
            self.pokes += 1
            if self._asked:
                self.coalesced += 1
            self._asked = True
            self._state.notify_all()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Waits for the running round to end and starts no other until the block exits."""
        with self._state:
            self._held += 1
            self._state.wait_for(lambda: not self._running)
        try:
            yield
        finally:
            with self._state:
                self._held -= 1
                self._state.notify_all()

    def wait_idle(self, timeout: Optional[float] = None) -> bool:
        """Blocks until no round is running or asked for (tests, the end of a run); True if so."""
        with self._state:
            idle = self._state.wait_for(
                lambda: (not self._asked and not self._running) or self._error is not None or self._stop,
                timeout)
            self._raise_error()
            return idle

    def close(self) -> None:
        """Lets the running round finish, drops a round only asked for, stops the thread, and
        raises the error of a failed round if nobody has seen it yet."""
        with self._state:
            self._stop = True
            self._state.notify_all()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
        with self._state:
            self._raise_error()

    def _raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"{self.name} failed: {type(error).__name__}: {error}") from error

    def _loop(self) -> None:
        while True:
            with self._state:
                self._state.wait_for(lambda: self._stop or (self._asked and not self._held))
                if self._stop:
                    return
                self._asked, self._running = False, True
            try:
                self.round_fn()
            except BaseException as err:  # reported to the trainer's thread at its next poke
                with self._state:
                    self._error, self._running, self._stop = err, False, True
                    self._state.notify_all()
                return
            with self._state:
                self.rounds += 1
                self._running = False
                self._state.notify_all()
