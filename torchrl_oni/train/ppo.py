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
from .build import Run
from .checkpoint import CHECKPOINT_NAME, TRAINER_KEYS, CheckpointError, load_checkpoint, save_checkpoint
from .config import CONFIG_NAME, LogConfig, PPOConfig, TrainConfig
from .hooks import STAGES, TrainHook
from .run_log import EpisodeWindow, RunLogger
from .policy import make_actor_critic, recurrent_primer

__all__ = ["Trainer", "TrainingStopped", "write_config"]

log = logging.getLogger("torchrl_oni.train")


class TrainingStopped(KeyboardInterrupt):
    """Training was stopped by a signal (SIGINT, SIGTERM, SIGUSR1) after saving its checkpoint."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum
        self.summary: Optional[Dict[str, float]] = None  # what the run did until then (train()'s summary)


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


class _StopState:
    saving = False
    signum: Optional[int] = None  # the signal that stopped the run, once one has


@contextlib.contextmanager
def _stop_on_signals():
    """Turns SIGINT/SIGTERM/SIGUSR1 into :class:`TrainingStopped` in the training loop, so the
    loop's ``finally`` saves the checkpoint and the caption store. SLURM sends SIGUSR1 (with
    ``--signal=USR1@120``) or SIGTERM before preemption, ``timeout`` and ``docker stop`` SIGTERM.
    Signals that arrive while the final save runs are ignored: the save must complete. Until it
    starts, every signal raises again and the loop also stops at its next batch once one has
    arrived: code that swallows every exception (the stop among them) must not leave a run that
    no later SIGTERM can end."""
    state = _StopState()
    if threading.current_thread() is not threading.main_thread():
        yield state  # signal handlers can only be installed from the main thread
        return

    def handler(signum, frame):
        if not state.saving:
            state.signum = signum
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
    """PPO trainer over a run's env workers.

    Args:
        run: what to train (:func:`~torchrl_oni.train.build.build_run`): the env workers, the
            reward shaping, the hooks (:class:`~torchrl_oni.train.hooks.TrainHook`, each declaring
            its stages), the batch transforms, the budget, the seed and the learner's device.
        ppo: the ``ppo`` section (the networks, the loss, the optimiser).
        log: the ``log`` section (run folder, checkpoints, metrics, progress bar, ``--resume``).

    From a configuration in one line: :meth:`from_config`. When building the trainer fails (a
    checkpoint of another network, env workers that cannot start), its hooks are closed without
    saving: an embedded LLM server or an annotation thread must not outlive a run that never
    started.
    """

    def __init__(self, run: Run, ppo: PPOConfig, log: LogConfig):
        self.run = run
        self.ppo, self.log = ppo, log
        self.workers, self.shaping = run.workers, run.shaping
        self.total_frames = run.frames  # --frames; a benchmark may end a run early by lowering it
        self.hooks = list(run.hooks)
        self.batch_transforms = list(run.batch_transforms)
        # one list per stage, in the hooks' order, made once: the loop calls these, never asks a hook
        self._at: Dict[str, list] = {stage: [] for stage in STAGES}
        for hook in self.hooks:
            if not isinstance(hook, TrainHook):
                raise TypeError(f"{hook!r} is not a TrainHook: subclass torchrl_oni.train.TrainHook and declare "
                                f"the stages it runs at (its stages attribute)")
            hook.register(self)
        self._saves_state = [any(h is hook for h in self._at["state"]) for hook in self.hooks]
        try:
            self._build()
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
        return cls(build_run(cfg, hooks, batch_transforms, intrinsic=intrinsic), cfg.ppo, cfg.log)

    def register_op(self, stage: str, hook: TrainHook) -> None:
        """Runs ``hook`` at ``stage`` (one of :data:`~torchrl_oni.train.hooks.STAGES`), after the
        hooks registered there before it; called by :meth:`TrainHook.register` when the trainer
        is built."""
        if stage not in self._at:
            raise ValueError(f"unknown hook stage {stage!r} (of {getattr(hook, 'name', hook)!r}); the stages: "
                             f"{', '.join(STAGES)}")
        self._at[stage].append(hook)

    def _build(self) -> None:
        run, ppo = self.run, self.ppo
        self.device = run.device
        if run.learner_threads is not None:
            # the env workers own a core each; OpenMP threads spinning beside them cost 3×
            torch.set_num_threads(run.learner_threads)
        torch.manual_seed(run.seed)
        np.random.seed(run.seed % 2**32)
        self.run_dir = self.log.logdir
        os.makedirs(self.run_dir, exist_ok=True)
        remove_stale_temps(self.run_dir)  # what a killed save left behind
        self.checkpoint_path = os.path.join(self.run_dir, CHECKPOINT_NAME)

        # a throw-away env gives the specs the networks are built from
        probe = self.workers.probe()
        self.actor, self.critic = make_actor_critic(probe, arch=ppo.arch, value_heads=ppo.value_heads)
        self.recurrent = ppo.arch in RECURRENT_ARCHS
        self.primer_spec = recurrent_primer(self.actor).primers if self.recurrent else None
        probe.close()
        self.actor.to(self.device)
        self.critic.to(self.device)

        from .learner import PPOLearner
        from .timing import StageClock

        self.clock = StageClock()
        self.learner = PPOLearner(self.actor, self.critic, ppo, self.device, recurrent=self.recurrent,
                                  value_heads=ppo.value_heads, clock=self.clock)
        if ppo.compile != "off":
            log.info("--compile %s: the first updates compile the critic and the loss (a minute or two on a CPU; "
                     "once per batch shape)", ppo.compile)
        # the learner's parts, reachable as before (hooks train with the trainer's optimiser)
        self.advantages, self.loss = self.learner.advantages, self.learner.loss
        self.params, self.optimizer = self.learner.params, self.learner.optimizer
        self.frames = 0
        self.iterations = 0
        self.episodes = EpisodeWindow(self.log.stats_window)
        self.time_collect = 0.0
        self.time_learn = 0.0
        self._start_frames = 0
        self._elapsed_s = 0.0  # training wall time before this process (resumed runs), for time_s
        if self.log.resume:
            self._resume(self.log.resume)

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
            "config": self.run.cfg.to_dict(),
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
                f"task {saved.env.task}) than this run (--arch {self.ppo.arch}, --value-heads "
                f"{self.ppo.value_heads}, task {self.workers.games.task}): {str(err).splitlines()[0]}") from None
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
        settings = self.log
        remaining = self.total_frames - self.frames
        try:
            if remaining <= 0:
                log.info("nothing to do: %d frames already trained", self.frames)
                self._close_hooks()
                return {"frames": float(self.frames), "checkpoint": self.checkpoint_path}
            logger = RunLogger(
                self.run_dir,
                tensorboard=settings.tensorboard,
                wandb=settings.wandb,
                wandb_mode=settings.wandb_mode,
                config=self.run.cfg.to_dict(),
                resume=bool(settings.resume),
                resume_at=self._start_frames if settings.resume else None,
                time_offset=self._elapsed_s if settings.resume else None,
            )
            write_config(self.run.cfg, self.run_dir)
        except BaseException:
            self._close_hooks()  # an embedded LLM server or annotation thread must not outlive the run
            raise
        with _stop_on_signals() as stopping:
            try:
                return self._train_loop(logger, stopping)
            finally:
                stopping.saving = True  # a second signal must not interrupt the final save

    def _train_loop(self, logger: "RunLogger", stopping) -> Dict[str, float]:
        settings, per_update = self.log, self.run.frames_per_update
        bar = None
        next_checkpoint = (self.frames // settings.checkpoint_every + 1) * settings.checkpoint_every
        metrics: Dict[str, float] = {}
        stopped: Optional[TrainingStopped] = None
        at = self._at
        try:
            batches = self.workers.batches(self.actor, self.device, self.primer_spec, total_frames=self.total_frames,
                                           done=lambda: (self.frames, self.iterations))
            if settings.progress:
                from tqdm.auto import tqdm

                bar = tqdm(total=self.total_frames, initial=self.frames, unit="frames", dynamic_ncols=True, smoothing=0.1,
                           bar_format=BAR_FORMAT)
            t_start = time.perf_counter()
            t_wait = time.perf_counter()
            elapsed_before = self._elapsed_s
            clock = self.clock
            pending: List[TensorDictBase] = []  # batches gathered for the next update
            for batch in batches:
                if stopping.signum is not None:  # a stop that something on the way swallowed
                    raise TrainingStopped(stopping.signum)
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
                if sum(b.numel() for b in pending) < per_update and self.frames < self.total_frames:
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
                    self.shaping(batch)
                train_stats = self._ppo_update(batch)
                self.iterations += 1
                with clock("after_update"):
                    for hook in at["post_update"]:
                        hook.after_update(self)
                with clock("weights"):
                    self.workers.send_weights(self.actor, self.device)
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
                metrics.update(self.workers.metrics())
                if intrinsic is not None:
                    metrics["reward/intrinsic_mean"] = float(intrinsic.float().mean())
                    metrics["reward/intrinsic_nonzero"] = float((intrinsic != 0).float().mean())
                for hook in at["metrics"]:
                    metrics.update(hook.metrics())
                if self.iterations % settings.log_every == 0:
                    logger.log(metrics)
                for hook in at["alert"]:
                    text = hook.alert(metrics)
                    for line in (text.splitlines() if text else ()):
                        _warn(line, bar)
                if bar is not None:
                    bar.set_postfix_str(_progress_fields(fps, metrics, at["bar"]), refresh=False)
                if self.frames >= next_checkpoint:
                    self.save()
                    next_checkpoint += settings.checkpoint_every
                t_wait = time.perf_counter()
                clock.add("log", t_wait - t_log)
                self.time_learn += t_wait - t_got
                if self.frames >= self.total_frames:
                    break
        except TrainingStopped as stop:  # saved below like any end; the summary travels with it
            stopped = stop
        except Exception as err:
            # Code that wraps its own (TorchRL's PPO loss runs the actor inside a context manager
            # that fails on any exception) can turn the stop raised in the middle of it into
            # another error: once a signal has arrived, the run ends as stopped by it.
            if stopping.signum is None:
                raise
            stopped = TrainingStopped(stopping.signum)
            stopped.__cause__ = err
        finally:
            stopping.saving = True
            self.workers.shutdown()  # its watchdog first: nothing is killed during the final save
            if bar is not None:
                bar.close()
            # hooks first: labels that land while the annotation worker drains are counted
            self._close_hooks()
            if metrics:
                final = {k: v for k, v in metrics.items()}
                for hook in at["metrics"]:
                    final.update(hook.metrics())
                if final != metrics or self.iterations % settings.log_every:
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
