"""A dead env worker of the default (local) backend: the run neither hangs nor loses its work.

Killed while playing (the OOM killer's SIGKILL), the env workers are started again from the
current weights and the run goes on, saying so; past ``--worker-restarts`` the run stops with its
checkpoint saved and one sentence. A worker that cannot even start stops the run at once."""
import logging
import os
import time

import pytest
import torch

from torchrl_oni.train import TrainConfig, Trainer
from torchrl_oni.train import ppo
from torchrl_oni.train.checkpoint import load_checkpoint
from torchrl_oni.train.ppo import EnvWorkerError, _worker_death

PARENT_ENV = "ONI_TEST_TRAINER_PID"


class _KillWorker:
    """Kills env worker 1 with SIGKILL after the given PPO iterations."""

    def __init__(self, at_iterations):
        self.at = set(at_iterations)
        self.killed = 0

    def after_update(self, trainer):
        if trainer.iterations in self.at:
            proc = trainer.collector.procs[1]
            proc.kill()
            proc.join(10)
            self.killed += 1


class FailsInWorker(ppo.EnvFactory):
    """An env factory that works in the trainer (the probe env) and fails in a worker process."""

    def __call__(self):
        if str(os.getpid()) != os.environ.get(PARENT_ENV):
            raise OSError("NetHack could not start (simulated)")
        return super().__call__()


def _cfg(tmp_path, **kw):
    base = dict(frames=16 * 256, workers=2, envs_per_worker=8, rollout=32, minibatch_size=256,
                logdir=str(tmp_path), progress=False, tensorboard=False)
    base.update(kw)
    return TrainConfig(**base)


def test_torchrl_worker_death_in_words():
    err = RuntimeError("At least one process failed: worker 1 (exit code -9). Check for more infos in the log.")
    assert _worker_death(err) == "worker 1 (exit code -9): killed by SIGKILL, e.g. by the out-of-memory killer"
    assert _worker_death(RuntimeError("At least one process failed: worker 0 (exit code 1).")) == \
        "worker 0 (exit code 1)"
    assert _worker_death(ValueError("process failed")) is None
    assert _worker_death(RuntimeError("shapes do not match")) is None


@pytest.mark.slow
def test_killed_worker_is_restarted_and_the_run_finishes(tmp_path, caplog):
    killer = _KillWorker(at_iterations=[3])
    trainer = Trainer(_cfg(tmp_path, worker_restarts=2), hooks=[killer])
    with caplog.at_level(logging.WARNING, logger="torchrl_oni.train"):
        t0 = time.monotonic()
        summary = trainer.train()
    assert killer.killed == 1
    assert summary["frames"] >= 16 * 256, "the run must collect all its frames after the restart"
    assert time.monotonic() - t0 < 120
    lines = [r.getMessage() for r in caplog.records if "starting the env workers again" in r.getMessage()]
    assert len(lines) == 1 and "killed by SIGKILL" in lines[0] and "restart 1 of 2" in lines[0]


@pytest.mark.slow
def test_worker_dying_past_the_restarts_stops_with_checkpoint(tmp_path):
    trainer = Trainer(_cfg(tmp_path, worker_restarts=0), hooks=[_KillWorker(at_iterations=[2])])
    with pytest.raises(EnvWorkerError, match=r"killed by SIGKILL.*after 0 restart\(s\).*--worker-restarts 0"):
        trainer.train()
    state = load_checkpoint(trainer.checkpoint_path)
    assert state["frames"] == trainer.frames > 0, "the checkpoint holds the frames trained before the death"
    import multiprocessing

    deadline = time.monotonic() + 10
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not multiprocessing.active_children(), "the surviving worker must not outlive the run"


def test_worker_that_cannot_start_stops_the_run_at_once(tmp_path, monkeypatch):
    monkeypatch.setenv(PARENT_ENV, str(os.getpid()))
    original = ppo.make_env_factory

    def failing(*args, **kwargs):
        factory = original(*args, **kwargs)
        factory.__class__ = FailsInWorker
        return factory

    monkeypatch.setattr(ppo, "make_env_factory", failing)
    trainer = Trainer(_cfg(tmp_path, frames=1024))
    t0 = time.monotonic()
    with pytest.raises(EnvWorkerError, match="env worker failed to start: OSError: NetHack could not start"):
        trainer.train()
    assert time.monotonic() - t0 < 90, "a worker failing at start-up must not leave the trainer waiting"
    assert trainer.frames == 0
