"""Silent env workers of the local backend: found, named once, and killed so that they restart.

A worker process that *dies* is noticed by TorchRL's collector (``MultiAsyncCollector`` checks
its processes every second while it waits) and the trainer restarts the workers. One that is
alive but *silent* (stopped by ``SIGSTOP``, stuck inside NetHack, blocked forever on a lock) is
not: with one worker the trainer waited forever in the collector's ``next()``, with several the
run went on without that worker's games, and a weight update that waits for every worker's
acknowledgement (``SharedMemWeightSyncScheme(sync=True)``) waited forever too.

:class:`StallWatchdog` is a background thread over one collector's worker processes. The
trainer tells it when it waits (``with watchdog.waiting("batch")`` around ``next()``, ``"weights"``
around the weight update) and which worker delivered each batch (``delivered(idx)``). A worker is
*silent* when one of these is proven, measured against ``timeout`` (``--worker-stall-timeout``;
``FIRST_BATCH_FACTOR`` times longer before a worker's first batch, which includes start-up):

* **no batch**: the worker was asked for a batch (the collector asks again as soon as it hands
  one over) and has not delivered it for longer than the allowance. A worker's batch may sit in
  the collector's queue while the learner learns, so silence is counted only up to what is
  known: the queue is first in, first out, so a batch another worker was asked for later and
  delivered first proves the silent worker had not delivered by then; and while the trainer has
  been waiting in ``next()`` for more than a short grace, the queue is empty, so no worker has an
  undelivered batch there;
* **stopped**: the process has been seen in state ``T`` (``/proc/PID/stat``: ``SIGSTOP``,
  ``SIGTSTP``) at every check for longer than ``timeout`` (a stopped process delivers nothing,
  whatever the queue holds). A traced process (``t``: a debugger, ``py-spy``) is left alone;
* **weights**: the weight update has waited longer than ``timeout``. The silent worker is the
  stopped one when a worker is stopped; otherwise it cannot be told (the update waits for the
  workers' acknowledgements one after another) and all the collector's workers are killed.

The silent workers are then killed with ``SIGKILL``, once per collector, in one log line that
names them and says how long they were silent; a dead worker is what the trainer already
restarts (``--worker-restarts``), and the batch lost with it is never counted. The watchdog
waits (up to 5 s) until the killed processes have exited, so that the collector's next look finds
them dead. A weight update waiting for a killed worker's acknowledgement is released (one
``"updated"`` put in that worker's acknowledgement queue: the worker is dead, nothing else will
answer there), at the kill and again for any later update that waits (the collector may hand over
one more batch of the other workers before it looks).

Time the trainer process itself spent stopped (``Ctrl-Z``, a debugger on the trainer) is not
counted: a check that comes much later than its period shifts every clock by the gap.

Example:
    >>> import subprocess, types
    >>> proc = subprocess.Popen(["sleep", "60"])
    >>> dog = StallWatchdog([types.SimpleNamespace(pid=proc.pid)], timeout=10, first_timeout=10)
    >>> with dog.waiting("batch", now=0.0):  # the collector's next() waits, and waits...
    ...     [dog.check(now=t) for t in (9.0, 11.0, 13.0)]
    [None, None, 'worker 0 stalled: no batch for 11 s']
    >>> proc.wait(), dog.fired
    (-9, 'worker 0 stalled: no batch for 11 s')
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from typing import Callable, Dict, Iterable, List, Optional, Sequence

__all__ = ["StallWatchdog", "FIRST_BATCH_FACTOR", "process_state", "release_weight_acks"]

log = logging.getLogger("torchrl_oni.train")

FIRST_BATCH_FACTOR = 5
"""A worker's first batch may take this many times ``--worker-stall-timeout`` (start-up: NetHack,
the games' first reset)."""

MAX_GRACE_S = 2.0
"""How long the trainer waits in ``next()`` before the collector's queue is taken to be empty (a
batch put in it reaches the trainer within milliseconds)."""


def process_state(pid: int) -> Optional[str]:
    """The state letter of ``/proc/PID/stat`` (``R``, ``S``, ``D``, ``T`` stopped, ``t`` traced,
    ``Z``...), None where there is no such file (gone, or not Linux)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode("latin-1")
    except OSError:
        return None
    fields = text.rsplit(")", 1)[-1].split()  # the command name may hold spaces and parentheses
    return fields[0] if fields else None


def release_weight_acks(collector, workers: Iterable[int]) -> None:
    """Releases a weight update waiting for the acknowledgement of dead ``workers``: TorchRL's
    synchronous weight-sync schemes (``SharedMemWeightSyncScheme``, ``MultiProcessWeightSyncScheme``
    with ``sync=True``) wait on one queue per worker without a time limit."""
    for scheme in (getattr(collector, "_weight_sync_schemes", None) or {}).values():
        queues = getattr(scheme, "_ack_queues", None) or {}
        for idx in workers:
            if idx in queues:
                with contextlib.suppress(Exception):
                    queues[idx].put("updated")  # TorchRL warns about any other word


def _pid(proc) -> Optional[int]:
    """The process id of a worker still to be killed; None once it is known to have exited (its
    id may then belong to another process)."""
    if getattr(proc, "_closed", False):
        return None
    popen = getattr(proc, "_popen", None)
    if popen is not None and getattr(popen, "returncode", None) is not None:
        return None
    return getattr(proc, "pid", None)


def _plural(items: Sequence, one: str, many: str) -> str:
    return f"{one if len(items) == 1 else many} {', '.join(map(str, items))}"


class StallWatchdog:
    """Kills the silent env worker processes of one collector (see the module's docstring).

    Args:
        procs: the worker processes, by worker index (``collector.procs``): objects with a
            ``pid`` (``multiprocessing.Process``).
        timeout: seconds a worker may be silent (``--worker-stall-timeout``); must be positive.
        first_timeout: the allowance before a worker's first batch (default
            ``FIRST_BATCH_FACTOR × timeout``).
        release: called with the killed workers' indices after the kill, e.g.
            ``lambda idx: release_weight_acks(collector, idx)``.
        flag: the setting's name in the log line.
        state_of, clock, kill: ``/proc`` state, monotonic clock and ``os.kill`` (tests replace them).

    Attributes:
        fired: what happened, in words (``"worker 1 stalled: ..."``), once the watchdog has
            killed; None before.
    """

    def __init__(self, procs: Sequence, timeout: float, *, first_timeout: Optional[float] = None,
                 release: Optional[Callable[[List[int]], None]] = None, flag: str = "--worker-stall-timeout",
                 state_of: Callable[[int], Optional[str]] = process_state, clock: Callable[[], float] = time.monotonic,
                 kill: Callable[[int, int], None] = os.kill):
        if not timeout > 0:
            raise ValueError(f"{flag} must be positive to watch the workers, not {timeout!r}")
        self.procs = list(procs)
        self.timeout = float(timeout)
        self.first_timeout = float(first_timeout if first_timeout is not None else FIRST_BATCH_FACTOR * timeout)
        self.grace = min(MAX_GRACE_S, self.timeout / 2)
        self.period = min(1.0, max(0.05, self.timeout / 10))
        self.release = release
        self.flag = flag
        self._state_of, self._clock, self._kill = state_of, clock, kill
        # without /proc (not Linux) no state is known, and a missing one does not mean "gone"
        self._procfs = state_of is not process_state or os.path.exists("/proc/self/stat")
        n = len(self.procs)
        self._lock = threading.Lock()
        self._asked: List[Optional[float]] = [None] * n  # when each worker was last asked for a batch
        self._known: List[float] = [0.0] * n  # up to when it is known not to have delivered since
        self._delivered_once = [False] * n
        self._stopped_since: List[Optional[float]] = [None] * n
        self._phase: Optional[str] = None  # "batch" or "weights" while the trainer waits
        self._wait_since = 0.0
        self._last_check: Optional[float] = None
        self._done = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._killed: List[int] = []
        self._killed_pids: List[int] = []
        self._released_wait: Optional[float] = None  # the weight-update wait last released
        self.fired: Optional[str] = None

    # ------------------------------------------------------------------ the trainer's side
    def start(self) -> "StallWatchdog":
        """Starts the background thread (a daemon: it never keeps the process alive)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="oni-stall-watchdog", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stops the thread: nothing is killed after this returns. Safe to call twice."""
        with self._lock:
            self._done.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(5.0)

    @contextlib.contextmanager
    def waiting(self, phase: str, now: Optional[float] = None):
        """The trainer waits for a batch (``"batch"``: the collector's ``next()``; the first one
        starts the workers' clocks, as it asks every worker for a batch) or for the weight update
        (``"weights"``)."""
        with self._lock:
            now = self._clock() if now is None else now
            self._phase, self._wait_since = phase, now
            if phase == "batch" and self._asked[0:1] == [None]:
                self._asked = [now] * len(self.procs)
                self._known = [now] * len(self.procs)
        try:
            yield self
        finally:
            with self._lock:
                self._phase = None

    def delivered(self, worker: Optional[int], now: Optional[float] = None) -> None:
        """The collector handed over a batch of ``worker`` (None: unknown) and asked it for the next."""
        with self._lock:
            now = self._clock() if now is None else now
            n = len(self.procs)
            if worker is None or not 0 <= worker < n:
                self._asked, self._known, self._delivered_once = [now] * n, [now] * n, [True] * n
                return
            asked = self._asked[worker]
            if asked is not None:
                # first in, first out: the others had not delivered when this one was asked
                for i in range(n):
                    if i != worker and self._asked[i] is not None:
                        self._known[i] = max(self._known[i], asked - self.grace)
            self._asked[worker] = self._known[worker] = now
            self._delivered_once[worker] = True
            self._stopped_since[worker] = None

    # ------------------------------------------------------------------ the watchdog's side
    def _run(self) -> None:
        while not self._done.wait(self.period):
            try:
                self.check()
            except Exception as err:  # noqa: BLE001 — a fault here must not stop the training
                log.warning("the env worker stall watchdog stopped: %s: %s", type(err).__name__, err)
                return

    def check(self, now: Optional[float] = None) -> Optional[str]:
        """One look at the workers; kills the silent ones. Returns :attr:`fired` when it did."""
        with self._lock:
            now = self._clock() if now is None else now
            if self._done.is_set():
                return None
            if self.fired is not None:
                self._release_again(now)
                return None
            self._skip_gap(now)
            if self._asked[0:1] == [None]:
                return None  # the collector has not asked for a batch yet
            pids = [_pid(proc) for proc in self.procs]
            states = [self._state_of(pid) if pid is not None else None for pid in pids]
            for i, state in enumerate(states):
                if state == "T":
                    self._stopped_since[i] = self._stopped_since[i] if self._stopped_since[i] is not None else now
                else:
                    self._stopped_since[i] = None
            if self._phase == "batch" and now - self._wait_since > self.grace:
                self._known = [max(k, now - self.grace) for k in self._known]  # the queue is empty
            silent: Dict[int, str] = {}
            gone = [pid is None or (self._procfs and states[i] in (None, "Z")) for i, pid in enumerate(pids)]
            for i, pid in enumerate(pids):
                if gone[i]:
                    continue  # exited: the collector's own check reports it
                quiet = self._known[i] - self._asked[i]
                stopped = now - self._stopped_since[i] if self._stopped_since[i] is not None else None
                allowance = self.timeout if self._delivered_once[i] else self.first_timeout
                parts = []
                if quiet > allowance:
                    parts.append(f"no batch for {quiet:.0f} s")
                if stopped is not None and stopped > self.timeout:
                    parts.append(f"stopped (process state T) for {stopped:.0f} s")
                if parts:
                    silent[i] = ", ".join(parts)
            if not silent and self._phase == "weights" and now - self._wait_since > self.timeout:
                waited = f"the weight update waited {now - self._wait_since:.0f} s for an acknowledgement"
                stopped_now = [i for i, state in enumerate(states) if state == "T" and not gone[i]]
                alive = [i for i in range(len(pids)) if not gone[i]]
                if stopped_now:
                    silent = {i: f"{waited}, stopped (process state T)" for i in stopped_now}
                else:
                    silent = {i: f"{waited} (which worker is silent cannot be told: all are killed)" for i in alive}
            if not silent:
                return None
            self._fire(silent, pids)
            if self._phase == "weights":
                self._released_wait = self._wait_since
        self._await_deaths()
        if self.release is not None:
            with contextlib.suppress(Exception):
                self.release(list(self._killed))
        return self.fired

    def _release_again(self, now: float) -> None:
        """A weight update that waits for a killed worker after its release was used up (the
        collector, which had not yet seen the worker dead, handed over one more batch)."""
        if (self._phase == "weights" and now - self._wait_since > self.grace and self.release is not None
                and self._released_wait != self._wait_since):
            self._released_wait = self._wait_since
            with contextlib.suppress(Exception):
                self.release(list(self._killed))

    def _await_deaths(self, limit_s: float = 5.0) -> None:
        """Until the killed processes have exited (SIGKILL takes a moment, more for a large
        process), so that the collector's next look finds them dead."""
        deadline = time.monotonic() + limit_s
        for pid in self._killed_pids:
            while self._state_of(pid) not in (None, "Z") and time.monotonic() < deadline:
                time.sleep(0.01)

    def _skip_gap(self, now: float) -> None:
        """Time the trainer itself did not run (stopped, suspended) is nobody's silence."""
        last, self._last_check = self._last_check, now
        if last is None:
            return
        gap = now - last - self.period
        if gap > max(2 * self.period, 2.0):
            shift = lambda t: None if t is None else t + gap  # noqa: E731
            self._asked = [shift(t) for t in self._asked]
            self._known = [k + gap for k in self._known]
            self._stopped_since = [shift(t) for t in self._stopped_since]
            self._wait_since += gap

    def _fire(self, silent: Dict[int, str], pids: List[Optional[int]]) -> None:
        workers = sorted(silent)
        self._killed, self._killed_pids = workers, [pids[i] for i in workers]
        reasons = sorted(set(silent.values()))
        what = "; ".join(f"{i}: {silent[i]}" for i in workers) if len(reasons) > 1 else reasons[0]
        self.fired = f"{_plural(workers, 'worker', 'workers')} stalled: {what}"
        for i in workers:
            with contextlib.suppress(ProcessLookupError):
                self._kill(pids[i], signal.SIGKILL)
        log.warning("env %s (%s) %s; killed with SIGKILL after %s %g s so that the env workers restart",
                    _plural(workers, "worker", "workers"), _plural([pids[i] for i in workers], "pid", "pids"),
                    self.fired[self.fired.index("stalled"):], self.flag, self.timeout)
