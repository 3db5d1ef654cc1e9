"""ELLM's goal worker: a :class:`~torchrl_oni.background.BackgroundLoop` that asks a goal suggester
for the goals of a :class:`~torchrl_oni.rewards.ellm.table.GoalTable`'s new states, off the
trainer's thread.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Dict, List

from torchrl_oni.background import BackgroundLoop
from torchrl_oni.rewards.ellm.table import GoalTable

__all__ = ["GoalWorker"]

log = logging.getLogger(__name__)


class GoalWorker(BackgroundLoop):
    """A thread with its own asyncio loop that asks for goals for the table's unseen states.

    Each round it claims up to ``batch_size`` states, keeps at most ``max_concurrency``
    ``suggester.suggest`` calls in flight, stores goals (and, with an ``encoder``, embeds the new
    goal texts in a helper thread so the trainer finds them cached) or marks failures (the table
    queues server faults again and gives a state up only after repeated unparsable answers). It
    sleeps until :meth:`wake` or ``poll_interval_s``. An exception from the suggester fails that
    call's states, never the worker. The thread, its loop and the start/stop/wake/idle machinery
    are :class:`~torchrl_oni.background.BackgroundLoop`'s, shared with the caption
    :class:`~torchrl_oni.annotation.AnnotationWorker`, and so is the steering by an HTTP suggester
    (:class:`~torchrl_oni.annotators.goals.OpenAIGoalSuggester`): nothing is claimed while no
    server can take a request, states that failed meanwhile are queued again when one answers,
    and calls are sized to one request each.

    Args:
        table: the :class:`GoalTable`.
        suggester: a :class:`~torchrl_oni.annotators.goals.GoalSuggester`.
        batch_size: most states per ``suggest`` call.
        max_concurrency: calls in flight (when the suggester gives no ``concurrency_hint``).
        poll_interval_s: longest sleep between rounds.
        encoder: optional sentence encoder to warm with new goal texts.
        close_suggester: await ``suggester.aclose()`` when stopping.
        log_interval_s: failures are summarised in the log at most this often.

    Example:
        >>> from torchrl_oni.annotators.goals import ScriptedGoalSuggester
        >>> table = GoalTable()
        >>> _ = table.add([5], ["Dungeon level 1. You are healthy and not hungry. Nearby: gold."])
        >>> worker = GoalWorker(table, ScriptedGoalSuggester()).start()
        >>> worker.wait_idle(timeout=10)
        True
        >>> worker.stop()
        >>> table.goals_of(5), worker.metrics()["states_done"]
        (('pick up the gold',), 1)
    """

    what = "ELLM goals"
    noun = "states"
    failure_log = ("ELLM goal requests failed since last report (states; server faults are retried, "
                   "unparsable answers given up after a few tries): %s")
    crash_log = "ELLM goal worker crashed"
    wrong_count = "wrong count"
    no_value = "no goals"

    def __init__(self, table: GoalTable, suggester, *, batch_size: int = 32, max_concurrency: int = 4,
                 poll_interval_s: float = 1.0, encoder=None, close_suggester: bool = True,
                 log_interval_s: float = 60.0):
        super().__init__(suggester, batch_size=batch_size, max_concurrency=max_concurrency,
                         poll_interval_s=poll_interval_s, log_interval_s=log_interval_s,
                         close_client=close_suggester, name="ellm-goals", logger=log)
        self.table = table
        self.suggester = suggester
        self.encoder = encoder
        self.states_done = 0

    @property
    def in_flight(self) -> int:
        """``suggest`` calls in flight."""
        return self._in_flight

    def metrics(self) -> Dict[str, float]:
        """``requests_total`` (calls answered), ``states_done``, ``in_flight``, ``parse_failures``,
        ``server_errors`` (states whose request failed for a server reason: queued again),
        ``requeued_total`` (queued again at once when a server answered again), ``latency_s``,
        ``worker_running``. Thread-safe."""
        with self._metrics_lock:
            out = self._loop_metrics()
            out.update(states_done=self.states_done, server_errors=self.server_failures,
                       requeued_total=self.requeued_total)
        return out

    def _claimable(self) -> int:
        return self.table.claimable()

    def _requeue_failed(self) -> int:
        return self.table.requeue_server_failures()

    def _next_call(self, batch: int):
        hashes, captions = self.table.claim(batch)
        return self._request(hashes, captions) if hashes else None

    async def _request(self, hashes: List[int], captions: List[str]) -> None:
        start = time.monotonic()
        results = await self._results(self.suggester.suggest(captions), len(hashes),
                                      release=lambda: self.table.release(hashes),
                                      fail=lambda kind: self.table.mark_failed(hashes, kind))
        if results is None:
            return
        ok = [i for i, r in enumerate(results) if r.ok]
        fresh = self.table.set_goals([hashes[i] for i in ok], [results[i].goals for i in ok],
                                     [results[i].provenance for i in ok]) if ok else []
        failed = self._failures(results)
        for kind, idx in failed.items():
            self.table.mark_failed([hashes[i] for i in idx], kind)
        with self._metrics_lock:
            self._count_call(time.monotonic() - start)
            self.states_done += len(ok)
        self._record_failures({kind: len(idx) for kind, idx in failed.items()})
        if fresh and self.encoder is not None:
            try:  # warm the encoder's cache off the trainer's thread
                await asyncio.to_thread(self.encoder.encode, fresh)
            except Exception:  # noqa: BLE001 - the trainer encodes them itself then
                log.exception("encoding new goals failed")
