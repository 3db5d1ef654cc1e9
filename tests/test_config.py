"""The configuration tree is the single source of truth: every setting is declared once, with help
text, and reaches --help, config.yaml, flat construction and validation from that declaration."""
import dataclasses
import pytest
import torch
from tensordict import TensorDict

from torchrl_oni.config_tree import leaves, parse_count
from torchrl_oni.train.cli import build_parser, parse_command
from torchrl_oni.train.config import PRESETS, TrainConfig

TINY = ["--frames", "256", "--workers", "1", "--envs-per-worker", "2", "--rollout", "32", "--no-progress",
        "--no-tensorboard"]


def test_every_setting_has_help_a_flag_and_survives_yaml(capsys):
    help_text = build_parser().format_help()
    names = set()
    for leaf in TrainConfig.settings():
        assert leaf.help and len(leaf.help) > 10, f"{leaf.flat} has no real help text"
        assert leaf.flag in help_text, f"{leaf.flag} missing from oni-train --help"
        assert leaf.flat not in names
        names.add(leaf.flat)
    # one non-default value per leaf, then a round trip through config.yaml
    cfg = TrainConfig()
    for leaf in TrainConfig.settings():
        if leaf.secret:
            continue
        allowed = leaf.allowed()
        value = leaf.default
        if allowed:
            value = next((a for a in allowed if a != leaf.default), leaf.default)
        elif isinstance(value, bool):
            value = not value
        elif isinstance(value, int):
            value = value + 3
        elif isinstance(value, float):
            value = value / 2 + 0.125
        elif isinstance(value, tuple):
            value = ("http://a:1/v1", "http://b:2/v1")
        else:
            value = f"/tmp/{leaf.flat}"
        leaf.set(cfg, value)
    again = TrainConfig.from_yaml(cfg.to_yaml())
    assert again == cfg
    for leaf in TrainConfig.settings():
        if not leaf.secret:
            assert leaf.get(again) == leaf.get(cfg), leaf.flat


def test_flags_map_to_the_tree_and_keep_old_names():
    cfg, _ = parse_command(["--task", "oracle", "--frames", "2M", "--lr", "1e-3", "--rm-lr", "5e-4",
                            "--reward-model", "m.pt", "--intrinsic-reward", "motif", "--no-tensorboard",
                            "--ranking-raw", "--llm-url", "http://a:1/v1", "http://b:2/v1", "--extrinsic-clip", "0"])
    assert cfg.env.task == "oracle" and cfg.frames == 2_000_000
    assert cfg.ppo.lr == 1e-3 and cfg.reward_model.lr == 5e-4
    assert cfg.reward.motif.reward_model == "m.pt" and cfg.reward.ranking.raw is True
    assert cfg.log.tensorboard is False and cfg.reward.extrinsic_clip == 0.0
    assert cfg.annotation.llm_url == ("http://a:1/v1", "http://b:2/v1")
    # flags only change what they name: the rest keeps the base's values
    assert cfg.env.workers == TrainConfig().env.workers


def test_flat_construction_equals_flags_and_sections():
    flat = TrainConfig(workers=1, lr=1e-3, ranking_threshold=-1.0, reward_model="x.pt")
    flags, _ = parse_command(["--workers", "1", "--lr", "1e-3", "--ranking-threshold", "-1", "--reward-model", "x.pt"])
    assert flat == flags
    with pytest.raises(TypeError, match="did you mean"):
        TrainConfig(worker=1)
    assert flat.replace(lr=2e-3).ppo.lr == 2e-3 and flat.ppo.lr == 1e-3


def test_derived_intrinsic_coefficient_lives_in_the_config():
    assert TrainConfig(intrinsic_reward="retrieval").resolved().reward.intrinsic_coeff == 0.4
    assert TrainConfig().resolved().reward.intrinsic_coeff == 0.0
    assert TrainConfig(intrinsic_reward="retrieval", intrinsic_coeff=0.1).resolved().reward.intrinsic_coeff == 0.1
    with pytest.raises(ValueError, match="intrinsic-coeff"):
        TrainConfig(intrinsic_coeff=0.5).resolved().validate()


def test_python_config_with_an_intrinsic_reward_trains_with_its_coefficient(tmp_path):
    from torchrl_oni.train import Trainer

    cfg = TrainConfig(intrinsic_reward="retrieval", annotator="scripted", frames=64, workers=1, envs_per_worker=2,
                      logdir=str(tmp_path), progress=False, tensorboard=False)
    trainer = Trainer.from_config(cfg, intrinsic=False)  # the coefficient, not the hook
    assert trainer.run.cfg.reward.intrinsic_coeff == 0.4
    batch = TensorDict({("next", "reward"): torch.zeros(4, 1),
                        ("next", "intrinsic_reward"): torch.tensor([[1.0], [0.0], [0.5], [0.0]])}, [4])
    shaped = trainer.shaping(batch).get(("next", "reward")).squeeze(-1)
    assert shaped.tolist() == pytest.approx([0.4, 0.0, 0.2, 0.0])


def test_validation_speaks_in_flags():
    for settings, words in [
        (dict(frames=0), "--frames"),
        (dict(intrinsic_reward="motif"), "--reward-model"),
        (dict(value_heads=3), "--value-heads"),
        (dict(lr=float("nan")), "--lr"),
        (dict(intrinsic_reward="bogus"), "--intrinsic-reward"),
        (dict(workers=1.5), "--workers"),
    ]:
        with pytest.raises(ValueError, match=words.replace("-", r"\-")):
            TrainConfig(**settings).resolved().validate()


def test_numbers_have_ranges_declared_once_and_shown_in_help():
    """Upper bounds a run never needs to exceed (a typo caught before hours are spent), declared on
    the leaves, checked for every source (flags, files, Python) and shown in --help."""
    by_flag = {leaf.flag: leaf for leaf in TrainConfig.settings()}
    for flag in ("--frames", "--lr", "--rm-lr", "--minibatch-size", "--llm-batch-size", "--checkpoint-every",
                 "--workers", "--envs-per-worker", "--seed"):
        assert by_flag[flag].at_most is not None, flag
    help_text = " ".join(build_parser().format_help().split())
    assert "range: [1, 1e10]" in help_text and "range: (0, 1]" in help_text
    for settings, message in [
        (dict(frames=2 * 10**10), "--frames must be at most 1e10, not 2e10"),
        (dict(lr=3.0), "--lr must be at most 1, not 3"),
        (dict(rm_lr=0.0), "--rm-lr must be positive, not 0"),
        (dict(seed=-1), "--seed must be at least 0, not -1"),
        (dict(workers=5000), "--workers must be at most 4096"),
        (dict(workers=4096, envs_per_worker=2), "--workers × --envs-per-worker must be at most 4096"),
        (dict(llm_batch_size=10**6), "--llm-batch-size must be at most 10000"),
    ]:
        with pytest.raises(ValueError) as err:
            TrainConfig(**settings).validate()
        assert str(err.value).startswith(message), str(err.value)
    assert TrainConfig.from_yaml("frames: 1.0e+11\n").frames == 10**11  # read as a whole number...
    with pytest.raises(ValueError, match="--frames must be at most"):
        TrainConfig.from_yaml("frames: 1.0e+11\n").validate()  # ...and refused by its range


def test_settings_of_another_reward_type_are_refused_not_ignored():
    with pytest.raises(ValueError, match="--ellm-goal-table needs --intrinsic-reward ellm, not 'none'"):
        TrainConfig(ellm_goal_table="goals.pt").validate()
    with pytest.raises(ValueError, match="--ranking-pairs needs --intrinsic-reward ranking, not 'classification'"):
        TrainConfig(intrinsic_reward="classification", annotator="scripted", ranking_pairs=3).validate()
    # a configuration file written by a run holds every section at its defaults: accepted
    TrainConfig.from_yaml(TrainConfig(intrinsic_reward="bow").to_yaml()).validate()


def test_presets_are_configurations():
    oni = PRESETS["oni"]
    assert isinstance(oni, TrainConfig) and oni.ppo.arch == "oni" and oni.ppo.lr == 1e-4
    cfg, _ = parse_command(["--preset", "oni", "--lr", "3e-4"])
    assert cfg.ppo.arch == "oni" and cfg.ppo.lr == 3e-4


def test_config_file_reruns_a_run(tmp_path):
    cfg = TrainConfig(task="oracle", seed=7, lr=1e-3, intrinsic_reward="bow", logdir=str(tmp_path / "a"))
    path = tmp_path / "config.yaml"
    path.write_text(cfg.to_yaml())
    again, _ = parse_command(["--config", str(path)])
    assert again == cfg
    other, _ = parse_command(["--config", str(path), "--seed", "8"])
    assert other.seed == 8 and other.ppo.lr == 1e-3
    path.write_text("ppo:\n  lrr: 1\n")
    with pytest.raises(SystemExit) as stop:
        parse_command(["--config", str(path)])
    assert stop.value.code == 2


def test_api_keys_never_reach_files():
    cfg = TrainConfig(llm_api_key="sk-secret")
    assert "sk-secret" not in cfg.to_yaml()
    assert cfg.annotation.llm_api_key == "sk-secret"


@pytest.mark.parametrize("flags, words", [
    (["--frames", "inf"], "finite"),
    (["--frames", "1.5"], "whole"),
    (["--lr", "nan"], "finite"),
    (["--intrinsic-reward", "nope"], "invalid choice"),
    (["--config", "/nonexistent.yaml"], "No such file"),
    (["--config", "x.yaml", "--preset", "oni"], "not both"),
    (["--workers", "0"], "--workers"),
    (["--acting-splits", "2"], "--acting-splits 2 needs --acting server"),
    (["--acting", "server", "--acting-splits", "3"], "--acting-splits (3) must divide --envs-per-worker"),
    (["--acting", "server", "--acting-splits", "0"], "--acting-splits"),
])
def test_cli_errors_are_one_line_exit_2(flags, words, capsys):
    from torchrl_oni.train.cli import main

    with pytest.raises(SystemExit) as stop:
        main([*TINY, *flags])
    assert stop.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("oni-train: error:") and words in lines[0], lines


def test_parse_count():
    assert parse_count("300k") == 300_000 and parse_count("2M") == 2_000_000 and parse_count("1e3") == 1000
    for bad in ("inf", "nan", "x", "1.5"):
        with pytest.raises(Exception):
            parse_count(bad)


def test_reward_types_bring_their_own_sections():
    from torchrl_oni.train.reward_types import reward_types

    reward_fields = {f.name for f in dataclasses.fields(TrainConfig().reward)}
    for name, spec in reward_types().items():
        if spec.settings is not None:
            assert name.replace("-", "_") in reward_fields
            for leaf in leaves(spec.settings):
                assert any(x.flat == f"{name.replace('-', '_')}_{leaf.flat}" for x in TrainConfig.settings())


def test_adding_a_reward_type_is_one_module(tmp_path):
    """The example in docs/design.md, dropped into the reward-types package as a module of its own."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    design = (Path(__file__).resolve().parent.parent / "docs" / "design.md").read_text()
    module = re.search(r"```python\n(.*?register_reward\(\"novelty\".*?)```", design, re.S).group(1)
    (tmp_path / "novelty.py").write_text(module)
    script = f"""
import torch, torchrl_oni.train.reward_types as package
package.__path__.append({str(tmp_path)!r})   # as if the file were in torchrl_oni/train/reward_types/
from torchrl_oni.train.cli import parse_command
from torchrl_oni.train.reward_types import RewardContext, reward_types
from torchrl_oni.store import CaptionStore
from torchrl_oni.captions import encode_messages, hash_messages
cfg, _ = parse_command(["--intrinsic-reward", "novelty", "--novelty-bonus", "0.5"])
cfg.resolved().validate()
spec = reward_types()["novelty"]
store = CaptionStore(capacity=8)
msgs = encode_messages(["You kill the newt!"])
parts = spec.build(RewardContext(cfg=cfg, settings=cfg.reward.novelty, store=store))
print(spec.labels, cfg.reward.novelty.bonus, parts.reward(torch.as_tensor(msgs), torch.as_tensor(hash_messages(msgs))).tolist())
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1].split() == ["True", "0.5", "[0.5]"]
