"""The trainer's prefetch (train/prefetch.py): batches taken from the env workers while the learner
learns, bounded, in order, errors where they happened, and nothing left running at shutdown."""
import threading
import time

import pytest
import torch

from torchrl_oni.train import TrainConfig, Trainer
from torchrl_oni.train.prefetch import Prefetcher, PrefetchStopped


def _wait_until(condition, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


class _Counted:
    """A source that counts what it has yielded."""

    def __init__(self, n):
        self.n = n
        self.yielded = 0

    def __iter__(self):
        for i in range(self.n):
            self.yielded += 1
            yield i


# ------------------------------------------------------------------------------------ Prefetcher
def test_items_come_in_order_and_the_source_is_never_more_than_depth_ahead():
    source = _Counted(50)
    ready = Prefetcher(iter(source), depth=3)
    got = []
    for item in ready:
        assert _wait_until(lambda: source.yielded == min(len(got) + 1 + 3, 50))  # it fills up to depth...
        time.sleep(0.02)
        assert source.yielded <= len(got) + 1 + 3, "...and no further"
        got.append(item)
    assert got == list(range(50))
    with pytest.raises(StopIteration):
        next(ready)
    ready.close()


def test_an_error_is_raised_after_the_items_before_it():
    def source():
        yield 1
        yield 2
        raise RuntimeError("At least one process failed: worker 1 (exit code -9).")

    ready = Prefetcher(source(), depth=8)
    assert _wait_until(lambda: ready.held == 3)  # two items and the error, all taken ahead
    assert [next(ready), next(ready)] == [1, 2]
    for _ in range(2):  # asked again, it fails again (as a broken collector would)
        with pytest.raises(RuntimeError, match="worker 1"):
            next(ready)
    ready.close()


def test_close_stops_a_source_that_waits_and_a_thread_that_waits_for_room():
    def waiting_source(prefetcher_box):
        yield "first"
        while True:  # a collector whose workers have nothing yet: polls, as LocalEnvCollector does
            if prefetcher_box[0].stopping.is_set():
                raise PrefetchStopped
            time.sleep(0.01)

    box = [None]
    box[0] = ready = Prefetcher(waiting_source(box), depth=2)
    assert next(ready) == "first"
    t0 = time.monotonic()
    ready.close()
    assert time.monotonic() - t0 < 2 and not ready._thread.is_alive()

    full = Prefetcher(iter(range(100)), depth=2)
    assert _wait_until(lambda: full.held == 2)
    t0 = time.monotonic()
    full.close()
    assert time.monotonic() - t0 < 2 and not full._thread.is_alive() and full.held == 0
    full.close()  # twice is harmless


def test_depth_must_be_positive():
    with pytest.raises(ValueError, match="at least 1"):
        Prefetcher(iter(()), depth=0)


# ------------------------------------------------------------------------------------ the collector
def _collector(prefetch, workers=1, envs=2, rollout=8, batches=6):
    from torchrl_oni.envs import NLEBatchEnv
    from torchrl_oni.train.env_factory import make_env_factory
    from torchrl_oni.train.policy import make_actor_critic

    cfg = TrainConfig(workers=workers, envs_per_worker=envs, rollout=rollout, prefetch_batches=prefetch)
    actor, _ = make_actor_critic(NLEBatchEnv("score", num_envs=1, seed=0))
    factories = [make_env_factory(cfg, w) for w in range(workers)]
    dist = cfg.resolved().distributed
    from torchrl_oni.train.backends import get_backend

    return get_backend("local").make(factories, actor, frames_per_batch=envs * rollout,
                                     total_frames=batches * envs * rollout, dist=dist)


@pytest.mark.slow
def test_workers_keep_playing_while_the_trainer_is_away():
    """With prefetch the collector takes (and re-arms) batches while nobody asks; without it,
    the worker's one batch waits in TorchRL's queue."""
    collector = _collector(prefetch=3, batches=20)
    try:
        batches = iter(collector)
        first = next(batches)
        assert first.shape == (2, 8) and collector.last_worker == 0
        # the trainer "learns" for a while: three more batches are taken meanwhile
        assert _wait_until(lambda: collector._prefetcher is not None and collector._prefetcher.held == 3)
        t0 = time.monotonic()
        rest = [next(batches) for _ in range(3)]
        assert time.monotonic() - t0 < 0.5, "taken while the trainer was away: handed over at once"
        assert all(b.shape == (2, 8) for b in rest) and collector.last_worker == 0
        # each batch is a copy of its own: the worker writing the next into its buffer did not change it
        lengths = [b["episode", "length"] for b in [first, *rest]]
        assert all(not torch.equal(a, b) for i, a in enumerate(lengths) for b in lengths[i + 1:])
    finally:
        collector.shutdown()
    assert collector._prefetcher is None
    assert not any(t.name == "collector-prefetch" for t in threading.enumerate())


@pytest.mark.slow
@pytest.mark.parametrize("prefetch", [0, 2])
def test_the_collector_delivers_every_batch_once_and_says_whose(prefetch):
    collector = _collector(prefetch=prefetch, workers=2, batches=8)
    try:
        whose = []
        frames = 0
        for batch in collector:
            whose.append(collector.last_worker)
            frames += batch.numel()
            if len(whose) == 1:
                # on a loaded machine the second worker may still be importing torch while the first
                # delivers every batch: give it time to queue one (the batches it is owed are what count)
                time.sleep(5)
        assert frames == 8 * 16 and len(whose) == 8 and set(whose) == {0, 1}
    finally:
        collector.shutdown()


@pytest.mark.slow
def test_shutdown_in_the_middle_leaves_no_thread_and_no_worker():
    import multiprocessing

    collector = _collector(prefetch=2, workers=2, batches=1000)
    next(iter(collector))
    t0 = time.monotonic()
    collector.shutdown()
    assert time.monotonic() - t0 < 30
    assert not any(t.name == "collector-prefetch" for t in threading.enumerate())
    assert _wait_until(lambda: not multiprocessing.active_children(), timeout=10)


# ------------------------------------------------------------------------------------ the setting
def test_the_default_takes_one_update_worth_on_a_gpu_learner_with_several_batches_an_update():
    def resolved(**kw):
        return TrainConfig(envs_per_worker=32, rollout=32, **kw).resolved().distributed.prefetch_batches

    assert resolved(device="cuda") == 0, "one batch an update: the worker is re-armed when it is taken"
    assert resolved(device="cuda", frames_per_update=4096) == 4
    assert resolved(device="cuda:1", frames_per_update=4096) == 4
    assert resolved(device="cpu", frames_per_update=4096) == 0, "a CPU learner keeps its cores"
    assert resolved(device="auto", frames_per_update=4096) == (4 if torch.cuda.is_available() else 0)
    assert resolved(device="cpu", frames_per_update=4096, prefetch_batches=3) == 3, "asked for: kept"
    assert resolved(device="cuda", frames_per_update=4096, prefetch_batches=0) == 0


@pytest.mark.slow
def test_a_run_with_prefetch_trains_every_frame_once(tmp_path):
    cfg = TrainConfig(frames=6 * 128, workers=2, envs_per_worker=4, rollout=32, frames_per_update=256,
                      prefetch_batches=2, minibatch_size=128, logdir=str(tmp_path), progress=False, tensorboard=False)
    trainer = Trainer.from_config(cfg)
    assert trainer.run.cfg.distributed.prefetch_batches == 2
    seen = []
    original = trainer._ppo_update
    trainer._ppo_update = lambda batch: (seen.append(batch.clone()), original(batch))[1]
    summary = trainer.train()
    assert summary["frames"] == 6 * 128 and len(seen) == 3
    # no batch handed over twice: every update's (game, step) rows are new
    keys = [tuple(b["episode", "length"].flatten().tolist()) + tuple(b["action"].flatten().tolist()) for b in seen]
    assert len(set(keys)) == 3


@pytest.mark.slow
def test_workers_acting_through_the_server_run_with_prefetch(tmp_path):
    cfg = TrainConfig(frames=4 * 256, workers=2, envs_per_worker=8, rollout=32, acting="server", frames_per_update=512,
                      prefetch_batches=2, minibatch_size=256, logdir=str(tmp_path), progress=False, tensorboard=False)
    trainer = Trainer.from_config(cfg)
    summary = trainer.train()
    assert summary["frames"] == 4 * 256 and summary["iteration"] == 2
    assert not any(t.name == "collector-prefetch" for t in threading.enumerate())
