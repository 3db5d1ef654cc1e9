"""oni-train's reward-type registry (torchrl_oni/train/reward_types/): what it derives, and that a
new reward type is one registration, with the reward library (torchrl_oni/rewards/) kept apart."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _python(script: str) -> str:
    """Runs ``script`` in a fresh interpreter on this checkout's package; its stdout."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                         timeout=300, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_the_registry_derives_the_choices_and_the_model_rewards():
    from torchrl_oni.train.config import INTRINSIC_REWARDS, MODEL_REWARDS, TrainConfig
    from torchrl_oni.train.reward_types import model_rewards, reward_names, reward_types

    assert INTRINSIC_REWARDS == reward_names() == ("none", *sorted(reward_types()))
    assert {"retrieval", "classification", "ranking", "motif", "bow", "ellm"} <= set(reward_types())
    assert MODEL_REWARDS == model_rewards() == ("classification", "ranking")
    [leaf] = [x for x in TrainConfig.settings() if x.flat == "intrinsic_reward"]
    assert tuple(leaf.allowed()) == reward_names()
    with pytest.raises(ValueError, match="--rm-ensemble needs --intrinsic-reward classification or ranking"):
        TrainConfig(intrinsic_reward="retrieval", rm_ensemble=2).validate()


def test_the_reward_library_imports_nothing_of_the_trainer():
    out = _python("""
        import importlib, pkgutil, sys
        import torchrl_oni.rewards as package
        for module in pkgutil.iter_modules(package.__path__):
            importlib.import_module(f"torchrl_oni.rewards.{module.name}")
        print(sorted(m for m in sys.modules if m.startswith("torchrl_oni.train")))
    """)
    assert out.strip().splitlines()[-1] == "[]"


# The toy type: everything a new reward type needs, registered in one place, before oni-train's
# configuration is imported (as a module of torchrl_oni/train/reward_types/ would be).
TOY_TYPE = """
from dataclasses import dataclass

import torch

from torchrl_oni.config_tree import setting
from torchrl_oni.train.reward_types import RewardParts, register_reward


@dataclass
class ToySettings:
    PREFIX = "toy"
    scale: float = setting(1.0, "what every caption pays")


def _check(cfg):
    if cfg.reward.toy.scale < 0:
        raise ValueError("--toy-scale must be non-negative")


@register_reward("toy", reward_model=True, settings=ToySettings, check=_check, help="pays --toy-scale for every caption")
def _build(ctx):
    return RewardParts(lambda messages, hashes: torch.full((len(hashes),), ctx.settings.scale))
"""


def test_a_new_reward_type_is_one_registration(tmp_path):
    out = _python(TOY_TYPE + f"""
import contextlib, io

from torchrl_oni.captions import encode_messages, hash_messages
from torchrl_oni.train.cli import parse_command
from torchrl_oni.train.config import MODEL_REWARDS, TrainConfig
from torchrl_oni.train.build import build_intrinsic_hook

help_text = io.StringIO()
with contextlib.redirect_stdout(help_text), contextlib.suppress(SystemExit):
    parse_command(["--help"])
assert "toy" in help_text.getvalue() and "--toy-scale" in help_text.getvalue()
cfg, _ = parse_command(["--intrinsic-reward", "toy", "--toy-scale", "0.5", "--rm-ensemble", "2",
                        "--logdir", {str(tmp_path)!r}])
cfg = cfg.resolved()
cfg.validate()
assert "toy" in MODEL_REWARDS and "toy" in TrainConfig.from_yaml(cfg.to_yaml()).to_yaml()
try:
    TrainConfig(intrinsic_reward="toy", toy_scale=-1.0).validate()
except ValueError as err:
    assert str(err) == "--toy-scale must be non-negative"
else:
    raise AssertionError("the toy type's check did not run")
hook = build_intrinsic_hook(cfg)
try:
    msgs = encode_messages(["You kill the newt!", "It's a wall."])
    print(hook.reward(torch.as_tensor(msgs), torch.as_tensor(hash_messages(msgs))).tolist())
finally:
    hook.close(save=False)
""")
    assert out.strip().splitlines()[-1] == "[0.5, 0.5]"
