"""The env workers of a run: their collector, what acts for them, and their faults.

:class:`EnvWorkers` is the trainer's source of batches. It is built by
:func:`~torchrl_oni.train.build.build_run` from the ``env`` and ``distributed`` sections (and
``acting``), never from the whole configuration, and it owns everything about the worker
processes (or Ray actors) a run starts:

* the collector of the run's backend (``--backend``), made again from the current weights when
  workers die, up to ``--worker-restarts`` times, each restart said once;
* the stall watchdog (:mod:`torchrl_oni.train.watchdog`) that turns a silent worker into a dead
  one;
* with ``--acting server``, the :class:`~torchrl_oni.train.acting.PolicyServer` that answers every
  worker's games from the learner's device;
* the weights after each update: to the server in place, or to the workers' CPU copies.

Workers that fail before their first batch are not restarted (the same error would come back):
:class:`EnvWorkerError` carries the worker's own error.

Example:
    >>> import torch
    >>> from torchrl_oni.train.build import build_run
    >>> from torchrl_oni.train.config import TrainConfig
    >>> from torchrl_oni.train.policy import make_actor_critic
    >>> run = build_run(TrainConfig(workers=1, envs_per_worker=2, rollout=4, frames=16).resolved())
    >>> probe = run.workers.probe()
    >>> actor, _ = make_actor_critic(probe)
    >>> probe.close()
    >>> frames = 0
    >>> for batch in run.workers.batches(actor, torch.device("cpu"), total_frames=16, done=lambda: (frames, 0)):
    ...     frames += batch.numel()
    >>> frames, tuple(batch.shape)
    (16, (2, 4))
    >>> run.workers.shutdown()
"""
from __future__ import annotations

import contextlib
import logging
import re
import signal
from typing import Callable, Dict, Iterator, Optional, Sequence, Tuple

from tensordict import TensorDictBase

from .backends import get_backend
from .config import DistributedConfig
from .env_factory import EnvFactory
from .policy import acting_copy

__all__ = ["EnvWorkers", "EnvWorkerError"]

log = logging.getLogger("torchrl_oni.train")


class EnvWorkerError(RuntimeError):
    """The env workers could not start, or kept dying (the checkpoint is saved)."""


class EnvWorkers:
    """``count`` env worker processes (or Ray actors), each playing the games of ``games``.

    Args:
        games: one worker's games (:func:`~torchrl_oni.train.env_factory.make_env_factory`, with
            the hooks' acting-time transforms); worker ``w`` plays them with the seed moved by
            ``w`` (and by 1000 per update done when the workers restart).
        count: ``--workers``.
        dist: the ``distributed`` section (backend, restarts, stall timeout, prefetch).
        acting: ``workers`` (a CPU copy of the actor in each worker) or ``server`` (one
            :class:`~torchrl_oni.train.acting.PolicyServer` on the learner's device).
        acting_splits: with ``acting="server"``, groups of each worker's games that take turns
            (``PolicyServer(splits=)``).
        frames_per_batch: frames of one worker's batch (games × rollout).

    Attributes:
        collector: the collector of the running :meth:`batches` (hooks reach the worker
            processes through it), None before.
        server: the policy server (``acting="server"``), once the workers started.
    """

    def __init__(self, games: EnvFactory, count: int, dist: DistributedConfig, *, acting: str = "workers",
                 acting_splits: int = 1, frames_per_batch: int):
        self.games, self.count, self.dist = games, count, dist
        self.acting, self.acting_splits, self.frames_per_batch = acting, acting_splits, frames_per_batch
        self.backend = get_backend(dist.backend)
        self.collector = None
        self.server = None
        self.watchdog = None  # the collector's StallWatchdog (silent local workers), while it runs

    def probe(self):
        """A throw-away env of one worker's games: the specs the networks are built from."""
        return self.games.offset(0, transforms=[t.clone() for t in self.games.transforms])()

    def _make_collector(self, actor, device, primer_spec, total_frames: int, seed_offset: int):
        factories = [self.games.offset(w + seed_offset, primer_spec) for w in range(self.count)]
        # workers act on CPU (weights synced after each update) and store no trunk outputs
        policy = acting_copy(actor, "cpu")
        worker_policies = None
        if self.acting == "server":
            from .acting import PolicyServer

            if self.server is None:  # one per run: restarted workers reach the same server
                # one copy of the policy on the learner's device answers every worker's games
                self.server = PolicyServer(actor, device=device, num_workers=self.count, example=factories[0],
                                           splits=self.acting_splits)
            worker_policies = self.server.worker_policies()
        self.collector = self.backend.make(
            factories, policy, frames_per_batch=self.frames_per_batch, total_frames=total_frames, dist=self.dist,
            worker_policies=worker_policies, exploration_type=None,
        )
        return self.collector

    def _watch(self, collector):
        """A :class:`~torchrl_oni.train.watchdog.StallWatchdog` over the collector's worker
        processes (``--worker-stall-timeout``), for backends whose workers the trainer restarts."""
        from .watchdog import StallWatchdog, release_weight_acks

        timeout = self.dist.worker_stall_timeout
        procs = getattr(collector, "procs", None)
        if not timeout or not procs or not self.backend.restart_workers:
            return None
        return StallWatchdog(procs, timeout, release=lambda workers: release_weight_acks(collector, workers)).start()

    def stop_watchdog(self) -> Optional[str]:
        """Stops the watchdog; what it did, in words (None if it did not kill)."""
        watchdog, self.watchdog = self.watchdog, None
        if watchdog is None:
            return None
        watchdog.stop()
        return watchdog.fired

    def _waiting(self, phase: str):
        return self.watchdog.waiting(phase) if self.watchdog is not None else contextlib.nullcontext()

    def batches(self, actor, device, primer_spec=None, *, total_frames: int,
                done: Callable[[], Tuple[int, int]]) -> Iterator[TensorDictBase]:
        """Batches from the env workers until ``total_frames`` are collected.

        Args:
            actor: the policy (its CPU copy acts in the workers, or the policy server serves it).
            device: the learner's device (the policy server's).
            primer_spec: the recurrent policy's state specs (None: a feed-forward policy).
            total_frames: the run's frames (``--frames``); read again when the workers restart.
            done: ``(frames trained, updates done)`` now, read when the workers (re)start.

        A worker process that dies (the OOM killer, a crash in NetHack) stops TorchRL's
        collector; the workers are then started again from the current weights, up to
        ``--worker-restarts`` times, and the run says so once each time. A worker alive but
        silent for ``--worker-stall-timeout`` is killed by the stall watchdog, which turns it
        into a dead one.
        """
        per_batch = self.frames_per_batch
        restarts = 0
        while True:
            frames, updates = done()
            remaining = max(total_frames - frames, per_batch)
            started = False
            collector = None
            try:
                collector = self._make_collector(actor, device, primer_spec, -(-remaining // per_batch) * per_batch,
                                                 seed_offset=1000 * updates)
                self.watchdog = self._watch(collector)
                it = iter(collector)
                while True:
                    with self._waiting("batch"):
                        batch = next(it, None)
                    if batch is None:
                        return
                    if self.watchdog is not None:
                        self.watchdog.delivered(getattr(collector, "last_worker", None))
                    started = True
                    yield batch
            except Exception as err:  # noqa: BLE001 — the collector's errors only: the trainer's run outside
                stalled = self.stop_watchdog()
                procs = getattr(collector, "procs", None) or () if started else ()
                death = _worker_death(err, procs)
                if stalled is not None and death is not None:
                    death = f"{stalled}, killed after --worker-stall-timeout {self.dist.worker_stall_timeout:g} s"
                if not started or death is None:
                    first = (str(err).strip().splitlines() or [""])[0]
                    what = "env worker failed to start" if not started else "env workers stopped"
                    detail = death if stalled is not None and death is not None else f"{type(err).__name__}: {first}"
                    raise EnvWorkerError(f"{what}: {detail}") from err
                frames = done()[0]
                if not self.backend.restart_workers or restarts >= self.dist.worker_restarts:
                    raise EnvWorkerError(f"env {death} at {frames:,} frames, after {restarts} restart(s) of the "
                                         f"env workers (--worker-restarts {self.dist.worker_restarts})") from err
                restarts += 1
                log.warning("env %s at %s frames; starting the env workers again from the current weights "
                            "(restart %d of %d)", death, f"{frames:,}", restarts, self.dist.worker_restarts)
                with contextlib.suppress(Exception):
                    self.collector.shutdown()
                _end_processes(procs)
            finally:
                self.stop_watchdog()

    def send_weights(self, actor, device) -> None:
        """Fresh weights to whatever acts: the policy server (on the learner's device, in place)
        or the env workers' CPU copies (through the collector)."""
        from tensordict import TensorDict

        weights = TensorDict.from_module(actor)
        if self.server is not None:
            self.server.update_weights(weights)
            return
        with self._waiting("weights"):  # a weight sync waiting for a silent worker's acknowledgement
            self.collector.update_policy_weights_(weights if device.type == "cpu" else weights.to("cpu"))

    def metrics(self) -> Dict[str, float]:
        """The policy server's figures (none without one)."""
        return self.server.metrics() if self.server is not None else {}

    def shutdown(self) -> None:
        """Stops the watchdog (first: nothing is killed while the run saves), the workers and the
        policy server."""
        self.stop_watchdog()
        if self.collector is not None:
            self.collector.shutdown()
        if self.server is not None:
            self.server.shutdown()


def _worker_death(err: BaseException, procs: Sequence = ()) -> Optional[str]:
    """What TorchRL's collector says when a worker process is gone ("At least one process failed:
    worker 1 (exit code -9)"), in words; None for any other error.

    ``procs`` (the collector's worker processes) name the dead worker when TorchRL's own clean-up
    failed first: having found a dead worker, it terminates the others and closes each after 0.1 s,
    and on a loaded CPU a worker still exiting then makes ``close()`` raise "Cannot close a process
    while it is still running" in place of the death."""
    text = str(err)
    if isinstance(err, ValueError) and "Cannot close a process while it is still running" in text:
        dead = [(i, code) for i, code in enumerate(map(_exit_code, procs)) if code is not None]
        if not dead:
            return None
        # the worker that died first is the one TorchRL did not terminate itself
        i, code = next(((i, c) for i, c in dead if c != -signal.SIGTERM), dead[0])
        return _in_words(f"worker {i} (exit code {code})")
    if not isinstance(err, RuntimeError) or "process failed" not in text:
        return None
    return _in_words(text.split(":", 1)[-1].split(". Check")[0].strip().rstrip("."))


def _in_words(detail: str) -> str:
    """``worker I (exit code C)`` with the signal named when the code is one."""
    code = re.search(r"exit code (-?\d+)", detail)
    if code and int(code.group(1)) < 0:
        sig = -int(code.group(1))
        name = signal.Signals(sig).name if sig in signal.valid_signals() else f"signal {sig}"
        detail += f": killed by {name}" + (", e.g. by the out-of-memory killer" if sig == signal.SIGKILL else "")
    return detail


def _exit_code(proc) -> Optional[int]:
    """A worker process's exit code; None while it runs or once it is closed."""
    try:
        return proc.exitcode
    except ValueError:  # closed by TorchRL's clean-up
        return None


def _end_processes(procs: Sequence, timeout: float = 10.0) -> None:
    """Kills the worker processes still running after a failed clean-up and waits for them, so
    that the restarted workers do not start beside the old ones."""
    for proc in procs:
        with contextlib.suppress(ValueError, AttributeError, OSError):
            if proc.is_alive():
                proc.kill()
            proc.join(timeout)
