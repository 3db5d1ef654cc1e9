"""A dead or silent env worker of the default (local) backend: the run neither hangs nor loses its work.

Killed while playing (the OOM killer's SIGKILL), the env workers are started again from the
current weights and the run goes on, saying so; past ``--worker-restarts`` the run stops with its
checkpoint saved and one sentence. A worker that cannot even start stops the run at once. A
worker alive but silent (SIGSTOP, stuck in NetHack) for ``--worker-stall-timeout`` is named in
one log line and killed by the stall watchdog (train/watchdog.py), and then restarted as a dead
one; its logic is checked first on a clock of its own, then on real runs."""
import csv
import logging
import os
import signal
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from helpers import tiny_config
from torchrl_oni.train import TrainConfig, Trainer, TrainHook
from torchrl_oni.train import workers
from torchrl_oni.train.checkpoint import load_checkpoint
from torchrl_oni.train.env_factory import EnvFactory
from torchrl_oni.train.build import build_run
from torchrl_oni.train.workers import EnvWorkerError, _worker_death
from torchrl_oni.train.watchdog import FIRST_BATCH_FACTOR, StallWatchdog, process_state

PARENT_ENV = "ONI_TEST_TRAINER_PID"


class _KillWorker(TrainHook):
    """Kills env worker 1 with SIGKILL after the given PPO iterations."""

    stages = ("post_update",)

    def __init__(self, at_iterations):
        self.at = set(at_iterations)
        self.killed = 0

    def after_update(self, trainer):
        if trainer.iterations in self.at:
            pid = trainer.workers.collector.procs[1].pid
            os.kill(pid, signal.SIGKILL)
            # Waits on /proc, not proc.join(): with --prefetch-batches the collector's thread polls
            # the same forkserver process, and two threads polling it race (the loser reads exit
            # code 255 in place of -9).
            deadline = time.monotonic() + 10
            while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
                time.sleep(0.01)
            self.killed += 1


class FailsInWorker(EnvFactory):
    """An env factory that works in the trainer (the probe env) and fails in a worker process."""

    def __call__(self):
        if str(os.getpid()) != os.environ.get(PARENT_ENV):
            raise OSError("NetHack could not start (simulated)")
        return super().__call__()


def _cfg(tmp_path, **kw):
    """The tiny run with two workers of 8 games (worker 1 is the one killed or stopped)."""
    return tiny_config(tmp_path, **{"frames": 16 * 256, "workers": 2, "envs_per_worker": 8, "minibatch_size": 256,
                                    **kw})


def test_torchrl_worker_death_in_words():
    err = RuntimeError("At least one process failed: worker 1 (exit code -9). Check for more infos in the log.")
    assert _worker_death(err) == "worker 1 (exit code -9): killed by SIGKILL, e.g. by the out-of-memory killer"
    assert _worker_death(RuntimeError("At least one process failed: worker 0 (exit code 1).")) == \
        "worker 0 (exit code 1)"
    assert _worker_death(ValueError("process failed")) is None
    assert _worker_death(RuntimeError("shapes do not match")) is None


def _slow_to_exit():
    signal.signal(signal.SIGTERM, lambda *_: (time.sleep(1.0), os._exit(0)))
    time.sleep(60)


def test_worker_death_named_when_torchrl_cannot_close_a_slow_worker():
    """On a loaded CPU, TorchRL's clean-up after a death (terminate the others, 0.1 s, close) fails
    on a worker still exiting; the run must still see the death and restart, not stop."""
    import multiprocessing

    from torchrl._utils import _check_for_faulty_process

    ctx = multiprocessing.get_context("fork")  # the children only sleep
    procs = [ctx.Process(target=time.sleep, args=(60,)), ctx.Process(target=_slow_to_exit)]
    for proc in procs:
        proc.start()
    try:
        time.sleep(0.5)  # the second one has installed its SIGTERM handler
        os.kill(procs[0].pid, signal.SIGKILL)
        procs[0].join(10)
        with pytest.raises(ValueError, match="Cannot close a process while it is still running") as caught:
            _check_for_faulty_process(procs)
        assert _worker_death(caught.value, procs) == \
            "worker 0 (exit code -9): killed by SIGKILL, e.g. by the out-of-memory killer"
        assert _worker_death(caught.value) is None, "without the processes there is no death to name"
        workers._end_processes(procs)
        assert not procs[1].is_alive()
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()


@pytest.mark.slow
@pytest.mark.parametrize("prefetch", [0, 2], ids=["no-prefetch", "prefetch"])
def test_killed_worker_is_restarted_and_the_run_finishes(tmp_path, caplog, prefetch):
    killer = _KillWorker(at_iterations=[3])
    trainer = Trainer.from_config(_cfg(tmp_path, worker_restarts=2, prefetch_batches=prefetch), hooks=[killer])
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
    trainer = Trainer.from_config(_cfg(tmp_path, worker_restarts=0), hooks=[_KillWorker(at_iterations=[2])])
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
    cfg = _cfg(tmp_path, frames=1024).resolved()
    run = build_run(cfg)
    games = run.workers.games
    run.workers.games = FailsInWorker(games.task, games.num_envs, games.seed, games.task_kwargs)
    trainer = Trainer(run, cfg.ppo, cfg.log)
    t0 = time.monotonic()
    with pytest.raises(EnvWorkerError, match="env worker failed to start: OSError: NetHack could not start"):
        trainer.train()
    assert time.monotonic() - t0 < 90, "a worker failing at start-up must not leave the trainer waiting"
    assert trainer.frames == 0


# ------------------------------------------------------------------ silent workers: the watchdog's logic
class _Fake:
    """Worker processes on a clock of the test's own: their /proc states and the kills."""

    def __init__(self, n):
        self.procs = [SimpleNamespace(pid=1000 + i) for i in range(n)]
        self.states = {p.pid: "S" for p in self.procs}
        self.killed = []
        self.released = []

    def dog(self, timeout=10.0, **kw):
        return StallWatchdog(self.procs, timeout, state_of=self.states.get, release=self.released.extend,
                             kill=self.kill, **kw)

    def kill(self, pid, sig):
        self.killed.append((pid, sig))
        self.states[pid] = "Z"


def _run_checks(dog, start, stop, each=None):
    """Checks once a second from ``start`` to ``stop``; the first time it fires, or None."""
    for t in range(start, stop):
        if each is not None:
            each(t)
        if dog.check(now=float(t)) is not None:
            return t
    return None


def test_the_silent_worker_is_named_while_the_others_deliver(caplog):
    fake = _Fake(3)
    dog = fake.dog(timeout=10.0)
    with dog.waiting("batch", now=0.0):  # the first next() asks every worker
        dog.delivered(1, now=0.0)

    def workers_0_and_2_deliver(t):  # a fast trainer: never waits, gets a batch each second
        if t:
            dog.delivered(0 if t % 2 == 0 else 2, now=float(t))

    with caplog.at_level(logging.WARNING, logger="torchrl_oni.train"):
        fired_at = _run_checks(dog, 0, 60, workers_0_and_2_deliver)
    # worker 1 is proven silent up to when the last deliverer was asked (t - 2), less the grace (2 s)
    assert fired_at == 15
    assert fake.killed == [(1001, signal.SIGKILL)], "only the silent worker is killed"
    assert fake.released == [1]
    assert dog.fired == "worker 1 stalled: no batch for 11 s"
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["env worker 1 (pid 1001) stalled: no batch for 11 s; killed with SIGKILL after "
                     "--worker-stall-timeout 10 s so that the env workers restart"]
    assert _run_checks(dog, 16, 30, workers_0_and_2_deliver) is None and len(fake.killed) == 1, "once per collector"


def test_batches_waiting_for_a_busy_learner_are_no_silence():
    fake = _Fake(2)
    dog = fake.dog(timeout=10.0)
    with dog.waiting("batch", now=0.0):
        pass
    dog.delivered(0, now=1.0)
    # the learner learns for 100 s (its batches queue up), then gets them at once
    assert _run_checks(dog, 1, 100) is None
    for t, worker in ((100.0, 1), (100.01, 0), (100.02, 1)):
        with dog.waiting("batch", now=t):
            dog.delivered(worker, now=t)
    assert _run_checks(dog, 100, 108) is None and not fake.killed


def test_a_worker_stopped_longer_than_the_timeout_is_killed_whatever_the_queue_holds():
    fake = _Fake(3)
    dog = fake.dog(timeout=10.0)
    with dog.waiting("batch", now=0.0):
        pass

    def stop_1_trace_2(t):
        if t == 5:
            fake.states[1001] = "T"  # kill -STOP
            fake.states[1002] = "t"  # a debugger: left alone

    # the trainer learns all along (no waiting, no delivery): only the stop proves silence
    assert _run_checks(dog, 0, 60, stop_1_trace_2) == 16
    assert fake.killed == [(1001, signal.SIGKILL)]
    assert dog.fired == "worker 1 stalled: stopped (process state T) for 11 s"


def test_a_worker_continued_in_time_is_not_killed():
    fake = _Fake(1)
    dog = fake.dog(timeout=10.0)
    with dog.waiting("batch", now=0.0):
        pass
    dog.delivered(0, now=0.5)

    def stop_then_continue(t):
        fake.states[1000] = "T" if 2 <= t < 10 else "S"
        if t == 10:
            dog.delivered(0, now=10.0)

    assert _run_checks(dog, 1, 40, stop_then_continue) is None and not fake.killed


def test_the_first_batch_has_a_longer_allowance():
    fake = _Fake(2)
    dog = fake.dog(timeout=10.0)
    assert dog.first_timeout == FIRST_BATCH_FACTOR * 10.0
    flag_help = next(leaf.help for leaf in TrainConfig.settings() if leaf.flat == "worker_stall_timeout")
    assert f"{FIRST_BATCH_FACTOR}x as long before its first batch" in flag_help
    assert _run_checks(dog, 0, 100) is None, "no clock runs before the collector asks for a batch"
    with dog.waiting("batch", now=100.0):  # start-up: the trainer waits for the first batch
        fired_at = _run_checks(dog, 101, 200)
    assert fired_at == 100 + FIRST_BATCH_FACTOR * 10 + 2 + 1
    assert sorted(pid for pid, _ in fake.killed) == [1000, 1001]
    assert dog.fired == "workers 0, 1 stalled: no batch for 51 s"


def test_time_the_trainer_itself_was_stopped_is_nobodys_silence():
    fake = _Fake(1)
    dog = fake.dog(timeout=10.0)
    with dog.waiting("batch", now=0.0):
        pass
    dog.delivered(0, now=0.0)
    with dog.waiting("batch", now=1.0):  # Ctrl-Z between t=2 and t=600: no check ran meanwhile
        assert _run_checks(dog, 1, 3) is None
        assert _run_checks(dog, 600, 610) is None  # 600 - 2 - 1: the gap less one period is not counted
        assert _run_checks(dog, 610, 640) == 610
    assert fake.killed and dog.fired == "worker 0 stalled: no batch for 11 s"


def test_a_weight_update_waiting_too_long_kills_the_stopped_worker_or_all():
    fake = _Fake(3)
    dog = fake.dog(timeout=10.0)
    with dog.waiting("batch", now=0.0):
        pass
    for i in range(3):
        dog.delivered(i, now=1.0)
    with dog.waiting("weights", now=2.0):  # e.g. SharedMemWeightSyncScheme(sync=True)'s _wait_for_ack
        assert _run_checks(dog, 2, 30) == 13
    assert sorted(pid for pid, _ in fake.killed) == [1000, 1001, 1002] and fake.released == [0, 1, 2]
    assert "the weight update waited 11 s for an acknowledgement (which worker is silent cannot be told" in dog.fired
    # the collector handed over one more queued batch before it saw the workers dead: the next
    # update waits for them again, and is released again (once per update)
    with dog.waiting("weights", now=40.0):
        assert _run_checks(dog, 40, 50) is None
    assert fake.released == [0, 1, 2] * 2 and len(fake.killed) == 3

    fake = _Fake(3)
    dog = fake.dog(timeout=10.0)
    with dog.waiting("batch", now=0.0):
        pass
    for i in range(3):
        dog.delivered(i, now=1.0)
    fake.states[1002] = "T"
    with dog.waiting("weights", now=2.0):
        assert _run_checks(dog, 2, 30) is not None
    assert fake.killed == [(1002, signal.SIGKILL)] and fake.released == [2]


def test_a_stopped_watchdog_kills_nothing_and_its_thread_ends():
    fake = _Fake(1)
    dog = fake.dog(timeout=0.5).start()
    with dog.waiting("batch"):
        dog.stop()
        time.sleep(1.5)
    assert not dog._thread.is_alive() and not fake.killed and dog.fired is None
    with pytest.raises(ValueError, match="--worker-stall-timeout must be positive"):
        StallWatchdog([], 0)


def test_process_state_of_a_stopped_process():
    import subprocess

    proc = subprocess.Popen(["sleep", "30"])
    try:
        os.kill(proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while process_state(proc.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert process_state(proc.pid) == "T"
        assert process_state(os.getpid()) == "R"
    finally:
        proc.kill()
        proc.wait()
    assert process_state(proc.pid) is None


# ------------------------------------------------------------------ silent workers: real runs
STALL_S = 5.0  # --worker-stall-timeout of these runs


class _StopWorker(TrainHook):
    """SIGSTOPs env worker ``worker`` after a PPO iteration (kill -STOP). With ``busy_learner`` the
    learner then stays busy, as a slow one would, until the watchdog has killed the worker: a
    stalled worker is found without the trainer waiting for it."""

    stages = ("post_update",)

    def __init__(self, at_iteration, worker=1, busy_learner=True):
        self.at, self.worker, self.busy_learner = at_iteration, worker, busy_learner
        self.pid = None
        self.stopped_at = None
        self.killed_after = None

    def after_update(self, trainer):
        if trainer.iterations != self.at or self.pid is not None:
            return
        self.pid = trainer.workers.collector.procs[self.worker].pid
        os.kill(self.pid, signal.SIGSTOP)
        self.stopped_at = time.monotonic()
        if self.busy_learner:
            deadline = self.stopped_at + 60
            while process_state(self.pid) not in (None, "Z") and time.monotonic() < deadline:
                time.sleep(0.05)
            self.killed_after = time.monotonic() - self.stopped_at


def _metrics_frames(run_dir):
    with open(os.path.join(run_dir, "metrics.csv")) as f:
        return [int(float(row["frames"])) for row in csv.DictReader(f)]


def _assert_stall_restart(caplog, stopper, restarts):
    """One warning names the stopped worker (only it) and its pid, one more says the workers restart."""
    lines = [r.getMessage() for r in caplog.records]
    stall = [line for line in lines if "killed with SIGKILL after --worker-stall-timeout" in line]
    assert len(stall) == 1, stall
    assert stall[0].startswith(f"env worker 1 (pid {stopper.pid}) stalled: "), stall
    assert "stopped (process state T)" in stall[0]
    assert stall[0].endswith(f"; killed with SIGKILL after --worker-stall-timeout {STALL_S:g} s so that the env "
                             f"workers restart")
    again = [line for line in lines if "starting the env workers again" in line]
    assert len(again) == 1 and again[0].startswith("env worker 1 stalled: ") and "stopped (process state T)" in again[0]
    assert f"killed after --worker-stall-timeout {STALL_S:g} s at " in again[0]
    assert f"restart 1 of {restarts}" in again[0]


@pytest.mark.slow
@pytest.mark.parametrize("prefetch", [0, 2], ids=["no-prefetch", "prefetch"])
def test_stopped_worker_is_killed_restarted_and_the_run_finishes(tmp_path, caplog, prefetch):
    stopper = _StopWorker(at_iteration=3)
    cfg = _cfg(tmp_path, worker_restarts=2, worker_stall_timeout=STALL_S, prefetch_batches=prefetch)
    trainer = Trainer.from_config(cfg, hooks=[stopper])
    with caplog.at_level(logging.WARNING, logger="torchrl_oni.train"):
        t0 = time.monotonic()
        summary = trainer.train()
    assert time.monotonic() - t0 < 150
    assert STALL_S <= stopper.killed_after < STALL_S + 4, "killed within the timeout and a few seconds"
    assert trainer.workers.collector.last_worker in (0, 1), "the collector says whose batch came last"
    _assert_stall_restart(caplog, stopper, restarts=2)
    # the batch lost with the workers is not counted: every frame is one delivered and learned on
    assert summary["frames"] == cfg.frames == trainer.frames
    assert _metrics_frames(tmp_path)[-1] == cfg.frames
    assert load_checkpoint(trainer.checkpoint_path)["frames"] == cfg.frames


@pytest.mark.slow
def test_weight_update_waiting_for_a_stopped_worker_is_released(tmp_path, caplog, monkeypatch):
    """The weight sync that waits for every worker's acknowledgement (TorchRL's default
    ``SharedMemWeightSyncScheme(sync=True)``, where the original report hung) is timed too."""
    import torchrl.weight_update

    scheme = torchrl.weight_update.SharedMemWeightSyncScheme
    monkeypatch.setattr(torchrl.weight_update, "SharedMemWeightSyncScheme", lambda **kw: scheme(sync=True))
    stopper = _StopWorker(at_iteration=3, busy_learner=False)  # the next weight update waits for its ack
    cfg = _cfg(tmp_path, worker_restarts=1, worker_stall_timeout=STALL_S)
    trainer = Trainer.from_config(cfg, hooks=[stopper])
    with caplog.at_level(logging.WARNING, logger="torchrl_oni.train"):
        t0 = time.monotonic()
        summary = trainer.train()
    assert time.monotonic() - t0 < 150
    _assert_stall_restart(caplog, stopper, restarts=1)
    assert summary["frames"] == cfg.frames == _metrics_frames(tmp_path)[-1]


def _cli_run(tmp_path, monkeypatch, *flags):
    """``oni-train`` in this process, one env worker; returns its collectors as they are made."""
    collectors = []
    original = workers.EnvWorkers._make_collector

    def recording(self, *args, **kwargs):
        collectors.append(original(self, *args, **kwargs))
        return collectors[-1]

    monkeypatch.setattr(workers.EnvWorkers, "_make_collector", recording)
    argv = ["--frames", str(256 * 400), "--workers", "1", "--envs-per-worker", "8", "--rollout", "32",
            "--minibatch-size", "256", "--logdir", str(tmp_path), "--no-progress", "--no-tensorboard", "--quiet",
            *flags]
    return collectors, argv


def _stop_the_worker_when_running(tmp_path, collectors, then=None):
    """A thread: once the run has logged a row, SIGSTOPs its env worker, then calls ``then()``."""
    info = {}

    def body():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if collectors and os.path.exists(tmp_path / "metrics.csv") and _metrics_frames(tmp_path):
                info["pid"] = collectors[-1].procs[0].pid
                os.kill(info["pid"], signal.SIGSTOP)
                info["stopped_at"] = time.monotonic()
                if then is not None:
                    then()
                return
            time.sleep(0.1)

    threading.Thread(target=body, daemon=True).start()
    return info


def test_stall_past_the_restarts_ends_with_one_line(tmp_path, monkeypatch, capsys):
    from torchrl_oni.train import cli

    collectors, argv = _cli_run(tmp_path, monkeypatch, "--worker-restarts", "0", "--worker-stall-timeout", "3")
    info = _stop_the_worker_when_running(tmp_path, collectors)
    with pytest.raises(SystemExit) as stop:
        cli.main(argv)
    assert stop.value.code == 1, "the code the CLI uses for EnvWorkerError"
    assert time.monotonic() - info["stopped_at"] < 3 + 20
    err = capsys.readouterr().err
    assert "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert line.startswith("oni-train: error: env worker 0 stalled: ") and "stopped (process state T)" in line
    assert "killed after --worker-stall-timeout 3 s at " in line
    assert "after 0 restart(s) of the env workers (--worker-restarts 0); the checkpoint is saved" in line
    assert len(collectors) == 1, "no restart"
    assert process_state(info["pid"]) is None, "the stalled worker does not outlive the run"


def test_sigterm_ends_a_run_with_a_stopped_worker_in_bounded_time(tmp_path, monkeypatch, capsys):
    from torchrl_oni.train import cli

    collectors, argv = _cli_run(tmp_path, monkeypatch)  # the default --worker-stall-timeout: not reached
    sent = {}

    def sigterm():
        time.sleep(1.0)
        sent["at"] = time.monotonic()
        os.kill(os.getpid(), signal.SIGTERM)

    info = _stop_the_worker_when_running(tmp_path, collectors, then=sigterm)
    assert cli.main(argv) == 128 + signal.SIGTERM
    assert time.monotonic() - sent["at"] < 30, "SIGTERM ends the run in bounded time"
    assert "SIGTERM: checkpoint and caption store saved" in capsys.readouterr().err
    assert not [t for t in threading.enumerate() if t.name == "oni-stall-watchdog"], "the watchdog is cancelled"
    assert process_state(info["pid"]) is None, "the stopped worker does not outlive the run"
    assert load_checkpoint(os.path.join(tmp_path, "checkpoint.pt"))["frames"] > 0


def _in_the_ppo_loss() -> bool:
    """Whether the caller runs inside TorchRL's PPO loss (the actor's pass there)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_name != "_get_cur_log_prob":
        frame = frame.f_back
    return frame is not None


def test_a_stop_that_something_swallows_still_ends_the_run(tmp_path, monkeypatch, capsys):
    # Code on the trainer's thread that swallows every exception (here, around the actor's pass in
    # the loss) can take the stop the handler raises: the run must still end as stopped at its next
    # batch, and a later SIGTERM must still be heard, instead of training on to its last frame.
    from torchrl_oni.train import cli, policy

    _, argv = _cli_run(tmp_path, monkeypatch)
    forward = policy.LightNet.forward
    sent = []

    def forward_swallowing_a_stop(self, *args, **kwargs):
        if not sent and _in_the_ppo_loss():
            sent.append(time.monotonic())
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.2)  # the handler runs here at the latest
            except BaseException:  # noqa: BLE001 — the swallowing this test is about
                sent.append("swallowed")
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(policy.LightNet, "forward", forward_swallowing_a_stop)
    assert cli.main(argv) == 128 + signal.SIGTERM
    assert sent[1:] == ["swallowed"], "the handler raised inside the swallowing code"
    err = capsys.readouterr().err
    assert "SIGTERM: checkpoint and caption store saved" in err and "Traceback" not in err
    frames = load_checkpoint(os.path.join(tmp_path, "checkpoint.pt"))["frames"]
    assert 0 < frames < 256 * 400, "stopped, not trained to the end"


def test_a_stop_signal_inside_the_ppo_loss_ends_the_run_as_stopped(tmp_path, monkeypatch, capsys):
    # TorchRL's PPO loss runs the actor inside a context manager that answers any exception raised
    # in it with "Converting a tensordict to boolean value is not permitted": a SIGTERM that lands
    # there must still end the run as a stop (exit 128 + 15, the checkpoint saved), not a failure.
    from torchrl_oni.train import cli, policy

    _, argv = _cli_run(tmp_path, monkeypatch)
    forward = policy.LightNet.forward
    sent = []

    def forward_then_stop(self, *args, **kwargs):
        if not sent and _in_the_ppo_loss():  # the actor's pass in TorchRL's PPO loss
            sent.append(time.monotonic())
            os.kill(os.getpid(), signal.SIGTERM)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(policy.LightNet, "forward", forward_then_stop)
    assert cli.main(argv) == 128 + signal.SIGTERM
    assert sent, "the update ran the actor"
    err = capsys.readouterr().err
    assert "SIGTERM: checkpoint and caption store saved" in err and "Traceback" not in err
    assert load_checkpoint(os.path.join(tmp_path, "checkpoint.pt"))["frames"] > 0
