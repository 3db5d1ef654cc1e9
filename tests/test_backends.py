"""``--backend`` by name (torchrl_oni/train/backends.py): a new backend is one registration, and
the trainer asks the entry what the backend supports."""
import tempfile

import pytest
from torchrl.collectors import Collector

from torchrl_oni.train import backends
from torchrl_oni.train.backends import Backend, backend_names, get_backend
from torchrl_oni.train.cli import build_parser
from torchrl_oni.train.config import TrainConfig


def _in_process(env_factories, policy, *, frames_per_batch, total_frames, dist=None, worker_policies=None,
                exploration_type=None):
    # the simplest collector there is: the one worker's env stepped in the trainer's process
    return Collector(env_factories[0], policy, frames_per_batch=frames_per_batch, total_frames=total_frames,
                     auto_register_policy_transforms=False)


@pytest.fixture
def in_process(monkeypatch):
    backend = Backend("in-process", "one worker in the trainer's process", _in_process)
    monkeypatch.setitem(backends._BACKENDS, backend.name, backend)  # the one place a backend is added
    return backend


def test_a_registered_backend_is_a_choice_of_the_cli_and_trains(in_process):
    assert "in-process" in backend_names()
    args = build_parser().parse_args(["--backend", "in-process"])
    assert args.backend == "in-process"
    cfg = TrainConfig(backend="in-process", frames=256, workers=1, envs_per_worker=2, rollout=16,
                      logdir=tempfile.mkdtemp(), progress=False, tensorboard=False)
    assert TrainConfig.from_dict(cfg.to_dict()).distributed.backend == "in-process"
    from torchrl_oni.train import Trainer

    summary = Trainer.from_config(cfg).train()
    assert summary["frames"] >= 256


def test_what_a_backend_supports_comes_from_its_entry(in_process):
    with pytest.raises(ValueError, match="--acting server needs a backend whose workers can reach a policy server"):
        TrainConfig(backend="in-process", acting="server").validate()
    TrainConfig(backend="local", acting="server").validate()
    assert get_backend("local").restart_workers and not get_backend("ray").restart_workers


def test_unknown_backends_and_duplicates_are_refused():
    with pytest.raises(ValueError, match="unknown --backend 'slurm' \\(local or ray\\)"):
        get_backend("slurm")
    with pytest.raises(ValueError, match="already registered"):
        backends.register_backend(get_backend("local"))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--backend", "slurm"])
