"""PPO training end to end: a short run, checkpoint → resume, the CLI's error handling."""
import json
import os

import pytest
import torch

from helpers import run_cli, tiny_config
from torchrl_oni.train import TrainConfig, Trainer, TrainHook
from torchrl_oni.train.build import build_run
from torchrl_oni.train.checkpoint import load_checkpoint, save_checkpoint
from torchrl_oni.train.run_log import read_metrics
from torchrl_oni.train.shaping import RewardShaping


def _cfg(tmp_path, **kw):
    return tiny_config(tmp_path / "run", **{"checkpoint_every": 512, **kw})


def test_short_run_then_resume_continues_where_it_stopped(tmp_path):
    cfg = _cfg(tmp_path)
    trainer = Trainer.from_config(cfg)
    before = {k: v.clone() for k, v in trainer.actor.state_dict().items()}
    summary = trainer.train()
    assert summary["frames"] >= 1024
    changed = any(not torch.equal(before[k], v) for k, v in trainer.actor.state_dict().items())
    assert changed, "PPO did not update the policy"
    rows = read_metrics(cfg.log.logdir)
    assert len(rows) >= 8 and rows[-1]["frames"] >= 1024
    assert all(k in rows[-1] for k in ("fps", "train/loss_objective", "collect_fraction"))
    state = load_checkpoint(cfg.log.logdir)
    assert state["frames"] == trainer.frames and state["iterations"] == trainer.iterations

    cfg2 = _cfg(tmp_path, frames=2048, resume="auto")
    resumed = Trainer.from_config(cfg2)
    assert resumed.frames == trainer.frames
    for k, v in trainer.actor.state_dict().items():
        assert torch.equal(resumed.actor.state_dict()[k], v)
    summary2 = resumed.train()
    assert summary2["frames"] >= 2048
    assert resumed.iterations > trainer.iterations
    rows2 = read_metrics(cfg.log.logdir)
    assert len(rows2) > len(rows)
    assert [r["frames"] for r in rows2] == sorted(r["frames"] for r in rows2)


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    path = str(tmp_path / "checkpoint.pt")
    save_checkpoint({"frames": 1}, path)

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError):
        save_checkpoint({"frames": 2}, path)
    monkeypatch.undo()
    assert load_checkpoint(path)["frames"] == 1
    assert os.listdir(tmp_path) == ["checkpoint.pt"]  # no temp file left behind


@pytest.mark.slow
def test_the_trainer_reads_its_sections_not_the_tree(tmp_path):
    """build_run hands each part its own sections; the trainer gets the run, ``ppo`` and ``log``,
    and the whole tree reaches it only as the run's record (config.yaml, the checkpoint)."""
    cfg = _cfg(tmp_path, frames=512).resolved()
    run = build_run(cfg)

    class Record:  # the tree with every setting hidden: what is left is writing it down
        def to_dict(self):
            return cfg.to_dict()

        def to_yaml(self):
            return cfg.to_yaml()

    run.cfg = Record()
    trainer = Trainer(run, cfg.ppo, cfg.log)
    assert trainer.train()["frames"] >= 512
    assert load_checkpoint(trainer.checkpoint_path)["config"] == cfg.to_dict()
    with open(os.path.join(cfg.log.logdir, "config.yaml")) as f:
        assert TrainConfig.from_yaml(f.read()).to_dict() == cfg.to_dict()


def test_shaped_reward_uses_coefficients_and_clip(tmp_path):
    from tensordict import TensorDict

    cfg = _cfg(tmp_path, extrinsic_coeff=0.1, intrinsic_coeff=0.5, intrinsic_reward="retrieval", extrinsic_clip=10.0)
    shaping = RewardShaping(cfg.reward)
    batch = TensorDict({("next", "reward"): torch.tensor([[50.0], [-1.0]]),
                        ("next", "intrinsic_reward"): torch.tensor([[1.0], [0.0]])}, batch_size=[2])
    shaping(batch)
    assert torch.allclose(batch["next", "reward"], torch.tensor([[0.1 * 10 + 0.5], [-0.1]]))
    assert torch.equal(batch["next", "extrinsic_reward"], torch.tensor([[50.0], [-1.0]]))


@pytest.mark.parametrize("value_heads", [1, 2])
def test_death_penalty_and_survival_bonus_are_paid_on_the_right_steps(tmp_path, value_heads):
    from tensordict import TensorDict

    cfg = _cfg(tmp_path, extrinsic_coeff=0.1, intrinsic_coeff=0.5, intrinsic_reward="retrieval",
               death_penalty=3.0, survival_bonus=0.25)
    shaping = RewardShaping(cfg.reward, value_heads)
    # step 0 lives on, step 1 dies (NLE's DEATH), step 2 succeeds (the task's status 2), step 3 times out (-1)
    batch = TensorDict({("next", "reward"): torch.tensor([[1.0], [0.0], [50.0], [0.0]]),
                        ("next", "intrinsic_reward"): torch.tensor([[1.0], [1.0], [0.0], [0.0]]),
                        ("next", "episode", "end_status"): torch.tensor([0, 1, 2, -1])}, batch_size=[4])
    shaping(batch)
    mixed = torch.tensor([0.1 + 0.5, 0.5, 1.0, 0.0])  # the coefficients and the clip at 10, as without the options
    expected = mixed + torch.tensor([0.25, -3.0, 0.25, 0.25])
    assert torch.allclose(batch["next", "reward"].squeeze(-1), expected)
    if value_heads == 2:  # the game's stream carries the terms; the two streams still sum to the reward
        assert torch.allclose(batch["next", "reward_ext"].squeeze(-1), torch.tensor([0.1, 0.0, 1.0, 0.0])
                              + torch.tensor([0.25, -3.0, 0.25, 0.25]))
        assert torch.allclose(batch["next", "reward_ext"] + batch["next", "reward_int"], batch["next", "reward"])


def test_death_penalty_and_survival_bonus_are_off_by_default_and_refused_when_negative(tmp_path):
    cfg = _cfg(tmp_path)
    assert cfg.reward.death_penalty == 0.0 and cfg.reward.survival_bonus == 0.0
    out = run_cli("torchrl_oni.train", "--death-penalty", "-1", "--logdir", str(tmp_path / "r"))
    assert out.returncode == 2 and "--death-penalty" in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_a_run_with_a_death_penalty_and_a_survival_bonus_trains_and_records_them(tmp_path, capfd):
    from helpers import TINY

    # oni-train's main in this process (the command's own process start is checked just above)
    code, _, err = _oni_train(capfd, *TINY, "--death-penalty", "2", "--survival-bonus", "0.01",
                              "--max-episode-steps", "64", "--logdir", str(tmp_path / "r"))
    assert code == 0, err[-2000:]
    saved = TrainConfig.from_yaml((tmp_path / "r" / "config.yaml").read_text())
    assert saved.reward.death_penalty == 2.0 and saved.reward.survival_bonus == 0.01


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["oni", "oni-lstm"])
def test_recurrent_policies_train(tmp_path, arch):
    cfg = _cfg(tmp_path, arch=arch, frames=512, rollout=16, minibatch_size=64, lr=1e-4)
    trainer = Trainer.from_config(cfg)
    before = {k: v.clone() for k, v in trainer.actor.state_dict().items()}
    summary = trainer.train()
    assert summary["frames"] >= 512
    assert "train/loss_objective" in summary
    assert any(not torch.equal(before[k], v) for k, v in trainer.actor.state_dict().items())


def _oni_train(capfd, *args):
    """oni-train's ``main(args)`` run in this process, as ``python -m torchrl_oni.train ARGS`` runs it:
    its exit status, stdout and stderr. The command's own process start is checked by ``run_cli``
    tests (above, and in test_train_intrinsic.py)."""
    from helpers import main_in_process

    from torchrl_oni.train.cli import main

    done = main_in_process(main, args, capfd)
    return done.returncode, done.stdout, done.stderr


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--task", "minecraft"], "unknown task"),
        (["--workers", "0"], "--workers"),
        (["--frames", "lots"], "frames"),
        (["--frames", "100"], "smaller than one batch"),
        (["--intrinsic-reward", "vibes"], "invalid choice"),
        (["--device", "cuda:7"] if not torch.cuda.is_available() else ["--device", "tpu"], "device"),
        (["--resume", "--logdir", "/nonexistent/run"], "no checkpoint"),
        (["--no-such-flag"], "unrecognized"),
    ],
)
def test_cli_bad_input_is_one_line_exit_2(args, needle, capfd):
    code, _, err = _oni_train(capfd, *args)
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert needle in lines[0]


def test_cli_short_run_prints_summary_and_json(tmp_path, capfd):
    code, out, err = _oni_train(capfd, "--frames", "512", "--workers", "1", "--envs-per-worker", "4", "--rollout",
                                "32", "--logdir", str(tmp_path / "cli"), "--no-progress", "--minibatch-size", "64")
    assert code == 0, err[-2000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["frames"] >= 512
    assert os.path.exists(tmp_path / "cli" / "metrics.csv")
    assert os.path.isdir(tmp_path / "cli" / "tensorboard")


def test_wandb_offline_logging_needs_no_network(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = _cfg(tmp_path, frames=256, envs_per_worker=2, rollout=32, wandb=True)
    Trainer.from_config(cfg).train()
    runs = [d for d in os.listdir(os.path.join(cfg.log.logdir, "wandb")) if d.startswith("offline-run")]
    assert runs, os.listdir(os.path.join(cfg.log.logdir, "wandb"))
    files = os.listdir(os.path.join(cfg.log.logdir, "wandb", runs[0]))
    assert any(f.endswith(".wandb") for f in files), files


class _ParityReward(TrainHook):
    """A stand-in intrinsic reward: 1 for captions with an odd hash."""

    stages = ("batch",)

    def on_batch(self, batch, trainer):
        h = batch.get(("next", "caption_hash"))
        batch.set(("next", "intrinsic_reward"), (h % 2).float().reshape(*batch.shape, 1))
        return batch


def test_two_value_heads_each_learn_their_own_return(tmp_path):
    cfg = _cfg(tmp_path, frames=1024, value_heads=2, intrinsic_reward="retrieval", intrinsic_coeff=0.5)
    trainer = Trainer.from_config(cfg, hooks=[_ParityReward()], intrinsic=False)  # the stand-in, not retrieval
    head = [m for m in trainer.critic.modules() if isinstance(m, torch.nn.Linear)][-1]
    before = head.weight.detach().clone()
    batches = []
    original = trainer._ppo_update

    def spy(batch):
        out = original(batch)
        batches.append(batch)
        return out

    trainer._ppo_update = spy
    summary = trainer.train()
    assert summary["frames"] >= 1024 and "train/loss_critic" in summary
    last = batches[-1]
    assert torch.allclose(last["advantage"], last["advantage_ext"] + last["advantage_int"])
    assert torch.allclose(last["next", "reward_int"], 0.5 * last["next", "intrinsic_reward"])
    assert not torch.equal(last["value_target_ext"], last["value_target_int"])
    changed = (head.weight.detach() - before).abs().sum(-1)
    assert (changed > 0).all(), "both value heads should be trained"


def test_oni_train_resolves_its_configuration_once(tmp_path, monkeypatch):
    """Every derived value comes from one TrainConfig.resolved() call per run: the CLI's, right
    after parsing; the intrinsic reward's hook and the trainer read what it derived."""
    from torchrl_oni.train import cli

    calls = []
    resolved = TrainConfig.resolved

    def counted(self):
        calls.append(self)
        return resolved(self)

    monkeypatch.setattr(TrainConfig, "resolved", counted)
    argv = ["--frames", "256", "--workers", "1", "--envs-per-worker", "4", "--rollout", "32", "--minibatch-size", "64",
            "--intrinsic-reward", "retrieval", "--annotator", "scripted", "--logdir", str(tmp_path / "run"),
            "--no-progress", "--no-tensorboard", "--quiet"]
    assert cli.main(argv) == 0
    assert len(calls) == 1
    assert os.path.exists(tmp_path / "run" / "captions.pt")  # the hook ran, from the one resolved configuration


class _Counts(TrainHook):
    name = "counts"
    stages = ("batch", "metrics")

    def __init__(self):
        self.batches = 0

    def on_batch(self, batch, trainer):
        self.batches += 1
        return batch

    def metrics(self):
        return {"counts/batches": float(self.batches)}

    def after_update(self, trainer):  # not a declared stage: never called
        raise AssertionError("after_update runs only for hooks that declare post_update")


def test_hooks_run_at_the_stages_they_declare_and_nowhere_else(tmp_path):
    hook = _Counts()
    summary = Trainer.from_config(_cfg(tmp_path, frames=256, envs_per_worker=4, rollout=32),
                                  hooks=[hook]).train()
    assert hook.batches == 2 and summary["counts/batches"] == 2.0


def test_a_hook_that_declares_no_known_stage_or_is_no_train_hook_is_refused(tmp_path):
    class Typo(TrainHook):
        stages = ("batches",)

    class Duck:
        def on_batch(self, batch, trainer):
            return batch

    with pytest.raises(ValueError, match="unknown hook stage 'batches'"):
        Trainer.from_config(_cfg(tmp_path), hooks=[Typo()])
    with pytest.raises(TypeError, match="is not a TrainHook"):
        Trainer.from_config(_cfg(tmp_path), hooks=[Duck()])
