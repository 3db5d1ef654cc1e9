"""The same keys as :class:`NLEBatchEnv`, built from plain TorchRL pieces (one game per env).

For users who want TorchRL's ``GymEnv`` / ``SerialEnv`` / ``ParallelEnv`` machinery rather than
the batched fast path: a gymnasium wrapper that **copies** NLE's reused buffers (without it, a
``GymEnv`` rollout stores the last observation at every step) and adds ``caption_hash`` and the
``crop``; the TorchRL transform :class:`~torchrl_oni.envs.caption_keys.MessageCounter` (re-exported
here), that adds the per-episode ``msg_count``;
and an info reader that turns NLE's info dict into the ``episode`` statistics.

``GymWrapper`` gives scalar observations a trailing dimension of 1, so ``caption_hash`` and
``msg_count`` are ``[*B, 1]`` here and ``[*B]`` in the batched env; the transforms of this
package accept both.

This path is about 10× slower per frame than :class:`NLEBatchEnv` (TorchRL's per-step cost is
paid per game); use it for compatibility, the batched env for speed.

Example:
    >>> from torchrl.envs import ParallelEnv
    >>> from torchrl.envs.utils import check_env_specs
    >>> from torchrl_oni.envs.gym_wrapper import make_gym_env
    >>> env = make_gym_env("score", seed=0)
    >>> check_env_specs(env)
    >>> td = env.rollout(5)
    >>> td["msg_count"].shape, td["caption_hash"].dtype
    (torch.Size([5, 1]), torch.int64)
    >>> env.close()
"""
from __future__ import annotations

from typing import Optional

import gymnasium as gym
import numpy as np
import torch
from nle import nethack
from tensordict import TensorDictBase
from torchrl.data import Unbounded
from torchrl.envs import GymWrapper, TransformedEnv
from torchrl.envs.gym_like import BaseInfoDictReader

from ..captions import CAPTION_HASH_KEY, MESSAGE_KEY, caption_hash
from .batched import OFF_MAP_GLYPH, GlyphWindows
from .caption_keys import MessageCounter
from .tasks import make_task

__all__ = ["CopyingObservationWrapper", "MessageCounter", "EpisodeInfoReader", "make_gym_env"]



class CopyingObservationWrapper(gym.ObservationWrapper):
    """Copies NLE's observation buffers and adds ``caption_hash`` (int64) and the glyph ``crop``."""

    def __init__(self, env: gym.Env, crop_size: int = 9):
        super().__init__(env)
        self.crop_size = crop_size
        spaces = dict(env.observation_space.spaces)
        spaces[CAPTION_HASH_KEY] = gym.spaces.Box(np.iinfo(np.int64).min, np.iinfo(np.int64).max, (), np.int64)
        spaces["crop"] = gym.spaces.Box(0, OFF_MAP_GLYPH, (crop_size, crop_size), np.int16)
        for key in ("chars", "colors", "glyphs"):
            spaces.pop(key, None)
        self.observation_space = gym.spaces.Dict(spaces)
        self._windows = GlyphWindows(1, crop_size)
        self._game = np.zeros(1, np.int64)

    def observation(self, obs):
        self._windows.interior[0] = obs["glyphs"]
        blstats = obs["blstats"]
        crop = self._windows.crop(self._game, x=blstats[nethack.NLE_BL_X:nethack.NLE_BL_X + 1], y=blstats[nethack.NLE_BL_Y:nethack.NLE_BL_Y + 1])[0]
        return {
            MESSAGE_KEY: obs["message"].copy(),
            "blstats": obs["blstats"].astype(np.int64),
            CAPTION_HASH_KEY: np.int64(caption_hash(obs["message"])),
            "crop": crop,
        }


class EpisodeInfoReader(BaseInfoDictReader):
    """Reads the task's info dict (plain ints: NLE's IntEnum ``end_status`` is converted)."""

    KEYS = ("dlvl", "xlvl", "gold", "scout", "kills", "end_status")

    def __init__(self):
        self._info_spec = None

    def __call__(self, info_dict, tensordict: TensorDictBase) -> TensorDictBase:
        for key in self.KEYS:
            tensordict.set(("episode", key), torch.tensor(int(info_dict.get(key, 0)), dtype=torch.int64))
        return tensordict

    def reset(self):
        pass

    @property
    def info_spec(self):
        return {("episode", k): Unbounded((), dtype=torch.int64) for k in self.KEYS}


def make_gym_env(task: str = "score", *, seed: Optional[int] = None, crop_size: int = 9, **task_kwargs):
    """One task game as ``TransformedEnv(GymWrapper(copying wrapper), MessageCounter())``."""
    torch.set_num_threads(1)
    game = CopyingObservationWrapper(make_task(task, **task_kwargs), crop_size=crop_size)
    base = GymWrapper(game)
    base.set_info_dict_reader(EpisodeInfoReader())
    env = TransformedEnv(base, MessageCounter())
    if seed is not None:
        env.set_seed(seed)
    return env
