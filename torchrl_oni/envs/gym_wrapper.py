"""The same keys as :class:`NLEBatchEnv`, built from plain TorchRL pieces (one game per env).

For users who want TorchRL's ``GymEnv`` / ``SerialEnv`` / ``ParallelEnv`` machinery rather than
the batched fast path: a gymnasium wrapper that **copies** NLE's reused buffers (without it, a
``GymEnv`` rollout stores the last observation at every step) and adds ``caption_hash`` and the
``crop``; a TorchRL transform, :class:`MessageCounter`, that adds the per-episode ``msg_count``;
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
from torchrl.envs.transforms import Transform

from ..captions import CAPTION_HASH_KEY, MESSAGE_KEY, MSG_COUNT_KEY, caption_hash
from .batched import OFF_MAP_GLYPH, GlyphWindows
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


class MessageCounter(Transform):
    """Adds ``msg_count``: how often this exact caption was seen in the current episode.

    Keyed on ``caption_hash``; the reset observation counts (it gives 1), as in ONI. Works on
    unbatched envs and on batched envs (one counter table per batch element).

    It needs the env: the count is a running total along each episode, kept between steps. On a
    collected batch or a replay-buffer sample (``transform(td)``, a replay buffer's transform,
    a collector's ``postproc``) there is no such history, so calling it raises, as TorchRL's
    ``StepCounter`` does; such data already holds the ``msg_count`` the env wrote.
    """

    def __init__(self, in_key=CAPTION_HASH_KEY, out_key=MSG_COUNT_KEY):
        super().__init__(in_keys=[in_key], out_keys=[out_key])
        self._tables: Optional[list] = None

    def _count(self, hashes: torch.Tensor) -> torch.Tensor:
        flat = hashes.reshape(-1).tolist()
        if self._tables is None or len(self._tables) != len(flat):
            self._tables = [dict() for _ in flat]
        out = []
        for table, h in zip(self._tables, flat):
            n = table.get(h, 0) + 1
            table[h] = n
            out.append(n)
        return torch.tensor(out, dtype=torch.int64).reshape(hashes.shape)

    def _call(self, next_tensordict: TensorDictBase) -> TensorDictBase:
        next_tensordict.set(self.out_keys[0], self._count(next_tensordict.get(self.in_keys[0])))
        return next_tensordict

    def _reset(self, tensordict: TensorDictBase, tensordict_reset: TensorDictBase) -> TensorDictBase:
        hashes = tensordict_reset.get(self.in_keys[0])
        flat_n = hashes.numel()
        if self._tables is None or len(self._tables) != flat_n:
            self._tables = [dict() for _ in range(flat_n)]
        reset = tensordict.get("_reset", None) if tensordict is not None else None
        mask = [True] * flat_n if reset is None else reset.reshape(-1).tolist()
        if len(mask) != flat_n:
            mask = [bool(any(mask))] * flat_n
        for i, m in enumerate(mask):
            if m:
                self._tables[i].clear()
        counts = []
        previous = tensordict.get(self.out_keys[0], None) if tensordict is not None else None
        prev_flat = previous.reshape(-1).tolist() if previous is not None and previous.numel() == flat_n else None
        for i, h in enumerate(hashes.reshape(-1).tolist()):
            if mask[i] or prev_flat is None:
                n = self._tables[i].get(h, 0) + 1
                self._tables[i][h] = n
                counts.append(n)
            else:
                counts.append(prev_flat[i])
        tensordict_reset.set(self.out_keys[0], torch.tensor(counts, dtype=torch.int64).reshape(hashes.shape))
        return tensordict_reset

    def transform_observation_spec(self, observation_spec):
        ref = observation_spec[self.in_keys[0]]
        observation_spec[self.out_keys[0]] = Unbounded(ref.shape, dtype=torch.int64, device=ref.device)
        return observation_spec

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        # Transform.forward would copy caption_hash into msg_count through _apply_transform:
        # a count of ~1e18 that IntrinsicRewardTransform then turns into a reward of ~0
        raise NotImplementedError(
            f"{type(self).__name__} counts captions along episodes as an env steps and cannot be "
            "applied to a batch or a replay-buffer sample; the data already holds the env's "
            f"'{self.out_keys[0]}'. Append it to the env (TransformedEnv) or drop it from this transform."
        )

    def _apply_transform(self, obs):  # not used: _call is overridden and forward refuses
        raise NotImplementedError


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
