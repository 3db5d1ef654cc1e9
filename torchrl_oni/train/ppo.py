"""PPO on batched NetHack envs: ``MultiAsyncCollector`` → reward shaping → ``GAE`` → ``ClipPPOLoss``.

The loop, one update at a time:

1. a worker process steps K games for ``rollout`` steps with the current actor and hands back
   one TensorDict ``[K, rollout]`` (``MultiAsyncCollector``: the other workers keep playing
   meanwhile); with ``--frames-per-update`` several workers' batches are gathered into one;
2. batch transforms run **in the trainer**, once per update (``LLMAnnotationTransform``,
   ``IntrinsicRewardTransform``...): the collector deep-copies a ``postproc``, so stateful work
   (the annotation queue, the caption store) must live here;
3. the reward PPO optimises is ``extrinsic_coeff · clip(r_env) + intrinsic_coeff · r_int``
   (written to ``("next", "reward")``; the env's own reward stays in
   ``("next", "extrinsic_reward")``);
4. ``GAE`` then ``ClipPPOLoss`` for ``ppo_epochs`` passes of minibatches; fresh weights go to
   the workers; hooks run (reward-model training between PPO iterations).

The trainer runs a :class:`~torchrl_oni.train.build.Run` (:func:`~torchrl_oni.train.build.build_run`);
its hooks declare the stages they run at (:mod:`torchrl_oni.train.hooks`), and the trainer keeps
one list per stage, made once when it is built. From a configuration, in one line:
:meth:`Trainer.from_config`.

Example:
    >>> from torchrl_oni.train import TrainConfig, Trainer
    >>> import tempfile
    >>> cfg = TrainConfig(frames=1024, workers=1, envs_per_worker=4, rollout=32,
    ...                   logdir=tempfile.mkdtemp(), progress=False, tensorboard=False)
    >>> summary = Trainer.from_config(cfg).train()
    >>> summary["frames"] >= 1024
    True
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import signal
import threading
import time
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch
from tensordict import TensorDictBase

from ..envs.batched import EPISODE_STATS
from ..envs.tasks import STATUS_ABORTED, STATUS_DEATH
from ..atomic import remove_stale_temps
from .archs import RECURRENT_ARCHS
from .backends import get_backend
from .build import Run, check_resolved
from .checkpoint import CHECKPOINT_NAME, TRAINER_KEYS, CheckpointError, load_checkpoint, save_checkpoint
from .config import CONFIG_NAME, TrainConfig
from .env_factory import make_env_factory
from .hooks import STAGES, TrainHook
from .run_log import EpisodeWindow, RunLogger
from .policy import acting_copy, make_actor_critic, recurrent_primer

__all__ = ["Trainer", "TrainingStopped", "EnvWorkerError", "write_config"]

log = logging.getLogger("torchrl_oni.train")


class TrainingStopped(KeyboardInterrupt):
    """Training was stopped by a signal (SIGINT, SIGTERM, SIGUSR1) after saving its checkpoint."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum
        self.summary: Optional[Dict[str, float]] = None  # what the run did until then (train()'s summary)


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


class EnvWorkerError(RuntimeError):
    """The env workers could not start, or kept dying (the checkpoint is saved)."""


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


class _StopState:
    saving = False


@contextlib.contextmanager
def _stop_on_signals():
    """Turns SIGINT/SIGTERM/SIGUSR1 into :class:`TrainingStopped` in the training loop, so the
    loop's ``finally`` saves the checkpoint and the caption store. SLURM sends SIGUSR1 (with
    ``--signal=USR1@120``) or SIGTERM before preemption, ``timeout`` and ``docker stop`` SIGTERM.
    Signals that arrive while the final save runs are ignored: the save must complete."""
    state = _StopState()
    if threading.current_thread() is not threading.main_thread():
        yield state  # signal handlers can only be installed from the main thread
        return

    def handler(signum, frame):
        if not state.saving:
            state.saving = True
            raise TrainingStopped(signum)

    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    try:
        yield state
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


# one frames/s figure on the bar: the run's own (frames since start / wall time), not tqdm's
# smoothed rate beside it
BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} frames [{elapsed}<{remaining}{postfix}]"


def _progress_fields(fps: float, metrics: Dict[str, float], hooks: Sequence = ()) -> str:
    """What the progress bar shows after the frame count: speed, return, and the words of each
    hook of the ``bar`` stage (ONI: steps and distinct captions labelled, the queue, labels/s,
    the LLM server's state).

    Example:
        >>> _progress_fields(2713.4, {"episode/return": 0.25})
        'frames/s=2,713, return=0.25'
    """
    post = [f"frames/s={fps:,.0f}"]
    if "episode/return" in metrics:
        post.append(f"return={metrics['episode/return']:.2f}")
    for hook in hooks:
        post += hook.bar_fields(metrics)
    return ", ".join(post)


def _warn(line: str, bar) -> None:
    """A warning above the progress bar (not in the middle of it)."""
    if bar is not None:
        bar.write(f"WARNING {line}")
    else:
        log.warning(line)


def write_config(cfg: TrainConfig, run_dir: str) -> str:
    """Writes the run's resolved configuration to ``run_dir/config.yaml`` (``oni-train --config``
    re-runs it)."""
    from ..atomic import atomic_write

    path = os.path.join(run_dir, CONFIG_NAME)
    text = cfg.to_yaml()
    atomic_write(path, lambda f: f.write(text.encode("utf-8")))
    return path


class Trainer:
    """PPO trainer over ``cfg.env.workers`` processes of ``cfg.env.envs_per_worker`` NetHack games.

    Args:
        run: what to train (:func:`~torchrl_oni.train.build.build_run`): the resolved
            configuration, the hooks (:class:`~torchrl_oni.train.hooks.TrainHook`, each declaring
            its stages), the batch transforms and the env workers' transforms. From a
            configuration in one line: :meth:`from_config`.

    When building the trainer fails (a checkpoint of another network, env workers that cannot
    start), its hooks are closed without saving: an embedded LLM server or an annotation thread
    must not outlive a run that never started.
    """

    def __init__(self, run: Run):
        cfg = run.cfg
        check_resolved(cfg, "Trainer")
        self.cfg = cfg
        self.hooks = list(run.hooks)
        self.batch_transforms = list(run.batch_transforms)
        self.env_transforms = list(run.env_transforms)
        # one list per stage, in the hooks' order, made once: the loop calls these, never asks a hook
        self._at: Dict[str, list] = {stage: [] for stage in STAGES}
        for hook in self.hooks:
            if not isinstance(hook, TrainHook):
                raise TypeError(f"{hook!r} is not a TrainHook: subclass torchrl_oni.train.TrainHook and declare "
                                f"the stages it runs at (its stages attribute)")
            hook.register(self)
        self._saves_state = [any(h is hook for h in self._at["state"]) for hook in self.hooks]
        try:
            self._build(cfg)
        except BaseException:
            self._close_hooks(save=False)
            raise

    @classmethod
    def from_config(cls, cfg: TrainConfig, hooks: Sequence = (), batch_transforms: Sequence = (), *,
                    intrinsic: bool = True) -> "Trainer":
        """The trainer of ``cfg``: resolves it (the one time a Python run does), validates it,
        builds the run (the intrinsic reward's hook of ``cfg.reward.intrinsic_reward`` first, then
        ``hooks``; ``intrinsic=False``: none, e.g. for an untrained checkpoint) and the trainer.
        ``batch_transforms``: TorchRL transforms on each update's batch, before the hooks."""
        from .build import build_run

        cfg = cfg.resolved()
        cfg.validate()
        return cls(build_run(cfg, hooks, batch_transforms, intrinsic=intrinsic))

    def register_op(self, stage: str, hook: TrainHook) -> None:
        """Runs ``hook`` at ``stage`` (one of :data:`~torchrl_oni.train.hooks.STAGES`), after the
        hooks registered there before it; called by :meth:`TrainHook.register` when the trainer
        is built."""
        if stage not in self._at:
            raise ValueError(f"unknown hook stage {stage!r} (of {getattr(hook, 'name', hook)!r}); the stages: "
                             f"{', '.join(STAGES)}")
        self._at[stage].append(hook)

    def _build(self, cfg: TrainConfig) -> None:
        self.device = cfg.derived.device
        if cfg.derived.learner_threads is not None:
            # the env workers own a core each; OpenMP threads spinning beside them cost 3×
            torch.set_num_threads(cfg.derived.learner_threads)
        torch.manual_seed(cfg.seed)
        np.random.seed(cfg.seed % 2**32)
        self.run_dir = cfg.log.logdir
        os.makedirs(self.run_dir, exist_ok=True)
        remove_stale_temps(self.run_dir)  # what a killed save left behind
        if cfg.reward.intrinsic_reward != "none" and not cfg.reward.intrinsic_coeff:
            log.warning("--intrinsic-reward %s with --intrinsic-coeff 0: the intrinsic reward is computed and "
                        "logged but does not reach the policy", cfg.reward.intrinsic_reward)
        self.checkpoint_path = os.path.join(self.run_dir, CHECKPOINT_NAME)

        # a throw-away env gives the specs the networks are built from
        probe = make_env_factory(cfg, 0, transforms=[t.clone() for t in self.env_transforms])()
        self.value_heads = cfg.ppo.value_heads
        self.actor, self.critic = make_actor_critic(probe, arch=cfg.ppo.arch, value_heads=cfg.ppo.value_heads)
        self.recurrent = cfg.ppo.arch in RECURRENT_ARCHS
        self.primer_spec = None
        if self.recurrent:
            primer = recurrent_primer(self.actor)
            self.primer_spec = primer.primers
        probe.close()
        self.actor.to(self.device)
        self.critic.to(self.device)

        from .learner import PPOLearner
        from .timing import StageClock

        self.clock = StageClock()
        self.learner = PPOLearner(self.actor, self.critic, cfg.ppo, self.device, recurrent=self.recurrent,
                                  value_heads=self.value_heads, clock=self.clock)
        if cfg.ppo.compile != "off":
            log.info("--compile %s: the first updates compile the critic and the loss (a minute or two on a CPU; "
                     "once per batch shape)", cfg.ppo.compile)
        # the learner's parts, reachable as before (hooks train with the trainer's optimiser)
        self.advantages, self.loss = self.learner.advantages, self.learner.loss
        self.params, self.optimizer = self.learner.params, self.learner.optimizer
        self.server = None  # the inference server when the policy acts on the learner's device
        self.collector = None  # the env workers' collector of the running train()
        self.watchdog = None  # the collector's StallWatchdog (silent local workers), while it runs
        self.frames = 0
        self.iterations = 0
        self.episodes = EpisodeWindow(cfg.log.stats_window)
        self.time_collect = 0.0
        self.time_learn = 0.0
        self._start_frames = 0
        self._elapsed_s = 0.0  # training wall time before this process (resumed runs), for time_s
        if cfg.log.resume:
            self._resume(cfg.log.resume)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        return {
            "actor": self.actor.state_dict(),
            "critic": self.critic.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "frames": self.frames,
            "iterations": self.iterations,
            "episodes": self.episodes.episodes,
            "episode_window": self.episodes.state_dict(),
            "elapsed_s": self._elapsed_s,
            "config": self.cfg.to_dict(),
            "hooks": [h.state_dict() if saves else {} for h, saves in zip(self.hooks, self._saves_state)],
            "torch_rng": torch.get_rng_state(),
        }

    def save(self, path: Optional[str] = None) -> str:
        path = path or self.checkpoint_path
        save_checkpoint(self.state_dict(), path)
        return path

    def _resume(self, where: str) -> None:
        path = self.checkpoint_path if where in ("auto", "") else where
        state = load_checkpoint(path, required=TRAINER_KEYS)
        saved = TrainConfig.from_dict(state.get("config") or {}, strict=False)
        try:
            self.actor.load_state_dict(state["actor"])
            self.critic.load_state_dict(state["critic"])
            self.optimizer.load_state_dict(state["optimizer"])
        except (RuntimeError, KeyError, ValueError) as err:
            raise CheckpointError(
                f"{path} holds another network (--arch {saved.ppo.arch}, --value-heads {saved.ppo.value_heads}, "
                f"task {saved.env.task}) than this run (--arch {self.cfg.ppo.arch}, --value-heads "
                f"{self.cfg.ppo.value_heads}, task {self.cfg.env.task}): {str(err).splitlines()[0]}") from None
        self.frames = int(state["frames"])
        self.iterations = int(state["iterations"])
        if "episode_window" in state:
            self.episodes.load_state_dict(state["episode_window"])
        else:
            self.episodes.episodes = int(state.get("episodes", 0))
        self._elapsed_s = float(state.get("elapsed_s", 0.0))
        torch.set_rng_state(state["torch_rng"])
        for hook, saves, hook_state in zip(self.hooks, self._saves_state, state.get("hooks", [])):
            if hook_state and saves:
                hook.load_state_dict(hook_state)
        self._start_frames = self.frames
        log.info("resumed from %s at %d frames", path, self.frames)

    # ------------------------------------------------------------------ collection
    def _make_collector(self, total_frames: int):

        cfg = self.cfg
        factories = [make_env_factory(cfg, w + 1000 * self.iterations, self.primer_spec, self.env_transforms)
                     for w in range(cfg.env.workers)]
        # workers act on CPU (weights synced after each update) and store no trunk outputs
        policy = acting_copy(self.actor, "cpu")
        worker_policies = None
        if cfg.acting == "server":
            from .acting import PolicyServer

            if self.server is None:  # one per run: restarted workers reach the same server
                # one copy of the policy on the learner's device answers every worker's games
                self.server = PolicyServer(self.actor, device=self.device, num_workers=cfg.env.workers,
                                           example=factories[0])
            worker_policies = self.server.worker_policies()
        dist = cfg.distributed
        # kept on the trainer so that hooks can reach it (worker placement, fault tests)
        self.collector = get_backend(dist.backend).make(
            factories, policy, frames_per_batch=cfg.frames_per_batch, total_frames=total_frames, dist=dist,
            worker_policies=worker_policies, exploration_type=None,
        )
        return self.collector

    def _watch(self, collector):
        """A :class:`~torchrl_oni.train.watchdog.StallWatchdog` over the collector's worker
        processes (``--worker-stall-timeout``), for backends whose workers the trainer restarts."""
        from .watchdog import StallWatchdog, release_weight_acks

        timeout = self.cfg.distributed.worker_stall_timeout
        procs = getattr(collector, "procs", None)
        if not timeout or not procs or not get_backend(self.cfg.distributed.backend).restart_workers:
            return None
        return StallWatchdog(procs, timeout, release=lambda workers: release_weight_acks(collector, workers)).start()

    def _stop_watchdog(self) -> Optional[str]:
        """Stops the watchdog; what it did, in words (None if it did not kill)."""
        watchdog, self.watchdog = self.watchdog, None
        if watchdog is None:
            return None
        watchdog.stop()
        return watchdog.fired

    def _waiting(self, phase: str):
        watchdog = getattr(self, "watchdog", None)
        return watchdog.waiting(phase) if watchdog is not None else contextlib.nullcontext()

    def _collected_batches(self, per_batch: int):
        """Batches from the env workers until the run's frames are collected. A worker process
        that dies (the OOM killer, a crash in NetHack) stops TorchRL's collector; the workers are
        then started again from the current weights, up to ``--worker-restarts`` times, and the
        run says so once each time. A worker alive but silent for ``--worker-stall-timeout`` is
        killed by the stall watchdog (train/watchdog.py), which turns it into a dead one. Workers
        that fail before their first batch are not restarted (the same error would come back):
        :class:`EnvWorkerError` with the worker's own error."""
        cfg = self.cfg
        restarts = 0
        while True:
            remaining = max(cfg.frames - self.frames, per_batch)
            started = False
            try:
                collector = self._make_collector(total_frames=-(-remaining // per_batch) * per_batch)
                self.watchdog = self._watch(collector)
                batches = iter(collector)
                while True:
                    with self._waiting("batch"):
                        batch = next(batches, None)
                    if batch is None:
                        return
                    if self.watchdog is not None:
                        self.watchdog.delivered(getattr(collector, "last_worker", None))
                    started = True
                    yield batch
            except Exception as err:  # noqa: BLE001 — the collector's errors only: hooks run outside
                stalled = self._stop_watchdog()
                procs = getattr(collector, "procs", None) or () if started else ()
                death = _worker_death(err, procs)
                if stalled is not None and death is not None:
                    death = f"{stalled}, killed after --worker-stall-timeout {cfg.distributed.worker_stall_timeout:g} s"
                if not started or death is None:
                    first = (str(err).strip().splitlines() or [""])[0]
                    what = "env worker failed to start" if not started else "env workers stopped"
                    detail = death if stalled is not None and death is not None else f"{type(err).__name__}: {first}"
                    raise EnvWorkerError(f"{what}: {detail}") from err
                restartable = get_backend(cfg.distributed.backend).restart_workers
                if not restartable or restarts >= cfg.distributed.worker_restarts:
                    raise EnvWorkerError(f"env {death} at {self.frames:,} frames, after {restarts} restart(s) of the "
                                         f"env workers (--worker-restarts {cfg.distributed.worker_restarts})") from err
                restarts += 1
                log.warning("env %s at %s frames; starting the env workers again from the current weights "
                            "(restart %d of %d)", death, f"{self.frames:,}", restarts, cfg.distributed.worker_restarts)
                with contextlib.suppress(Exception):
                    self.collector.shutdown()
                _end_processes(procs)
            finally:
                self._stop_watchdog()

    # ------------------------------------------------------------------ rewards
    def shape_reward(self, batch: TensorDictBase) -> TensorDictBase:
        """Writes the reward PPO optimises; keeps the env's own in ``extrinsic_reward``."""
        from ..rewards.scaling import survival_terms
        from ..transforms import CombineRewards

        cfg = self.cfg
        mix = CombineRewards(cfg.reward.extrinsic_coeff, cfg.reward.intrinsic_coeff, cfg.reward.extrinsic_clip or None,
                             streams=self.value_heads == 2)
        batch = mix(batch)
        if cfg.reward.death_penalty or cfg.reward.survival_bonus:
            nxt = batch.get("next")
            reward = nxt.get("reward")
            died = nxt.get(("episode", "end_status")).reshape(reward.shape) == STATUS_DEATH
            terms = survival_terms(died, cfg.reward.death_penalty, cfg.reward.survival_bonus).to(reward.dtype)
            nxt.set("reward", reward + terms)
            if self.value_heads == 2:  # the game's stream: staying alive is about the game, not the captions
                nxt.set("reward_ext", nxt.get("reward_ext") + terms)
        return batch

    # ------------------------------------------------------------------ learning
    def _ppo_update(self, batch: TensorDictBase) -> Dict[str, float]:
        return self.learner.update(batch)

    def _episode_stats(self, batch: TensorDictBase) -> int:
        done = batch.get(("next", "done")).reshape(batch.shape)
        if not done.any():
            return 0
        episode = batch.get(("next", "episode"))[done]
        stats = {k: episode.get(k).float().numpy() for k in EPISODE_STATS if k != "end_status"}
        stats["death"] = (episode.get("end_status") == STATUS_DEATH).float().numpy()
        stats["timeout"] = (episode.get("end_status") == STATUS_ABORTED).float().numpy()
        return self.episodes.add(stats)

    # ------------------------------------------------------------------ the loop
    def train(self) -> Dict[str, float]:
        cfg = self.cfg
        remaining = cfg.frames - self.frames
        try:
            if remaining <= 0:
                log.info("nothing to do: %d frames already trained", self.frames)
                self._close_hooks()
                return {"frames": float(self.frames), "checkpoint": self.checkpoint_path}
            logger = RunLogger(
                self.run_dir,
                tensorboard=cfg.log.tensorboard,
                wandb=cfg.log.wandb,
                wandb_mode=cfg.log.wandb_mode,
                config=cfg.to_dict(),
                resume=bool(cfg.log.resume),
                resume_at=self._start_frames if cfg.log.resume else None,
                time_offset=self._elapsed_s if cfg.log.resume else None,
            )
            write_config(cfg, self.run_dir)
        except BaseException:
            self._close_hooks()  # an embedded LLM server or annotation thread must not outlive the run
            raise
        per_batch = cfg.frames_per_batch
        with _stop_on_signals() as stopping:
            try:
                return self._train_loop(cfg, logger, per_batch, stopping)
            finally:
                stopping.saving = True  # a second signal must not interrupt the final save

    def _train_loop(self, cfg: TrainConfig, logger: "RunLogger", per_batch: int, stopping) -> Dict[str, float]:
        bar = None
        next_checkpoint = (self.frames // cfg.log.checkpoint_every + 1) * cfg.log.checkpoint_every
        metrics: Dict[str, float] = {}
        stopped: Optional[TrainingStopped] = None
        at = self._at
        try:
            batches = self._collected_batches(per_batch)
            if cfg.log.progress:
                from tqdm.auto import tqdm

                bar = tqdm(total=cfg.frames, initial=self.frames, unit="frames", dynamic_ncols=True, smoothing=0.1,
                           bar_format=BAR_FORMAT)
            t_start = time.perf_counter()
            t_wait = time.perf_counter()
            elapsed_before = self._elapsed_s
            clock = self.clock
            pending: List[TensorDictBase] = []  # batches gathered for the next update
            for batch in batches:
                t_got = time.perf_counter()
                clock.add("wait", t_got - t_wait)
                self.time_collect += t_got - t_wait
                n = batch.numel()
                self.frames += n
                with clock("log"):
                    self._episode_stats(batch)
                if bar is not None:
                    # the last batch overshoots --frames by up to a batch: keep a total the bar can show
                    bar.total = max(bar.total, bar.n + n)
                    bar.update(n)
                pending.append(batch)
                if sum(b.numel() for b in pending) < cfg.frames_per_update and self.frames < cfg.frames:
                    t_wait = time.perf_counter()
                    self.time_learn += t_wait - t_got
                    continue
                with clock("gather"):
                    batch = pending[0] if len(pending) == 1 else torch.cat(pending, 0)
                    pending = []
                # once per update, on the gathered batch: each hook's fixed cost per call (store
                # lookups, the reward's transform, the hacking tally) is paid once, not per worker
                # batch (retrieval on 16 batches of 1,024 frames: 43 ms one by one, 19 ms gathered)
                with clock("hooks"):
                    for transform in self.batch_transforms:
                        batch = transform(batch)
                    for hook in at["batch"]:
                        batch = hook.on_batch(batch, self)
                intrinsic = batch.get(("next", "intrinsic_reward"), None)
                with clock("reward"):
                    self.shape_reward(batch)
                train_stats = self._ppo_update(batch)
                self.iterations += 1
                with clock("after_update"):
                    for hook in at["post_update"]:
                        hook.after_update(self)
                with clock("weights"):
                    self._send_weights()
                t_log = time.perf_counter()
                elapsed = t_log - t_start
                self._elapsed_s = elapsed_before + elapsed
                fps = (self.frames - self._start_frames) / max(elapsed, 1e-9)
                metrics = {
                    "frames": self.frames,
                    "iteration": self.iterations,
                    "time_s": elapsed,
                    "fps": fps,
                    "collect_fraction": self.time_collect / max(self.time_collect + self.time_learn, 1e-9),
                    "episodes": self.episodes.episodes,
                    "reward/extrinsic_mean": float(batch.get(("next", "extrinsic_reward")).mean()),
                    "reward/shaped_mean": float(batch.get(("next", "reward")).mean()),
                    **train_stats,
                    **self.episodes.means(),
                    **clock.metrics(),
                }
                if self.server is not None:
                    metrics.update(self.server.metrics())
                if intrinsic is not None:
                    metrics["reward/intrinsic_mean"] = float(intrinsic.float().mean())
                    metrics["reward/intrinsic_nonzero"] = float((intrinsic != 0).float().mean())
                for hook in at["metrics"]:
                    metrics.update(hook.metrics())
                if self.iterations % cfg.log.log_every == 0:
                    logger.log(metrics)
                for hook in at["alert"]:
                    text = hook.alert(metrics)
                    for line in (text.splitlines() if text else ()):
                        _warn(line, bar)
                if bar is not None:
                    bar.set_postfix_str(_progress_fields(fps, metrics, at["bar"]), refresh=False)
                if self.frames >= next_checkpoint:
                    self.save()
                    next_checkpoint += cfg.log.checkpoint_every
                t_wait = time.perf_counter()
                clock.add("log", t_wait - t_log)
                self.time_learn += t_wait - t_got
                if self.frames >= cfg.frames:
                    break
        except TrainingStopped as stop:  # saved below like any end; the summary travels with it
            stopped = stop
        finally:
            stopping.saving = True
            self._stop_watchdog()  # before the workers go: nothing is killed during the final save
            if self.collector is not None:
                self.collector.shutdown()
            if self.server is not None:
                self.server.shutdown()
            if bar is not None:
                bar.close()
            # hooks first: labels that land while the annotation worker drains are counted
            self._close_hooks()
            if metrics:
                final = {k: v for k, v in metrics.items()}
                for hook in at["metrics"]:
                    final.update(hook.metrics())
                if final != metrics or self.iterations % cfg.log.log_every:
                    logger.log(final)
                    metrics = final
            self.save()
            logger.close()
        summary = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        summary["frames"] = float(self.frames)
        summary["checkpoint"] = self.checkpoint_path
        warnings = [line for hook in at["final_warnings"] for line in hook.final_warnings(metrics)]
        for line in warnings:
            log.warning(line)
        if warnings:
            summary["warnings"] = warnings
        notes = [line for hook in at["summary"] for line in hook.summary_lines(metrics)]
        if notes:
            summary["notes"] = notes
        if stopped is not None:
            stopped.summary = summary
            raise stopped
        return summary

    def _close_hooks(self, save: bool = True) -> None:
        """Closes the hooks of the ``close`` stage; ``save=False``: a run that never started."""
        for hook in self._at["close"]:
            if save:
                hook.close()
            else:
                hook.close(save=False)

    def _send_weights(self) -> None:
        """Fresh weights to whatever acts: the inference server (on the learner's device, in
        place) or the env workers' CPU copies (through the collector)."""
        from tensordict import TensorDict

        weights = TensorDict.from_module(self.actor)
        if self.server is not None:
            self.server.update_weights(weights)
            return
        with self._waiting("weights"):  # a weight sync waiting for a silent worker's acknowledgement
            self.collector.update_policy_weights_(weights if self.device.type == "cpu" else weights.to("cpu"))
