"""K NetHack games in one process behind one TorchRL ``EnvBase`` of batch size ``[K]``.

TorchRL costs about 0.5 ms per env step (TensorDict creation, spec checks) while NetHack takes
about 0.05 ms, so one game per TensorDict spends 90 % of its time in bookkeeping. This env
steps K games in a plain Python loop, writes their observations straight into fresh numpy arrays
(fresh every step: NLE reuses its buffers, so a stored observation must never alias the next
one) and wraps them in ONE TensorDict, which amortises TorchRL's cost over K games.

Keys (batch size ``[K]``):

==========================  ==================  ==========================================
key                         shape / dtype       meaning
==========================  ==================  ==========================================
``message``                 uint8[K, 256]       NLE's message, NUL-padded (the caption)
``caption_hash``            int64[K]            blake2b-64 of the message bytes, stable
``msg_count``               int64[K]            times this exact message was seen this
                                                episode, this step and the reset included
``blstats``                 int64[K, 27]        NLE's bottom-line statistics
``crop``                    int16[K, C, C]      glyph ids around the agent (NLE glyphs;
                                                ``MAX_GLYPH`` off the map)
``episode``                 Composite           ``return``, ``length``, ``dlvl``, ``xlvl``,
                                                ``gold``, ``scout``, ``kills``,
                                                ``end_status``, ``success``: running
                                                values, final at ``done``
``action``                  int64[K]            index into the task's 23 or 28 actions
``reward``                  float32[K, 1]       the task's extrinsic reward
``done/terminated/truncated``  bool[K, 1]       truncated = time limit (see ``tasks``)
==========================  ==================  ==========================================

Example:
    >>> import torch
    >>> from torchrl.envs.utils import check_env_specs
    >>> from torchrl_oni.envs import NLEBatchEnv
    >>> env = NLEBatchEnv("score", num_envs=4, seed=0)
    >>> check_env_specs(env)
    >>> td = env.rollout(10, break_when_any_done=False)
    >>> td.batch_size
    torch.Size([4, 10])
    >>> td["message"].dtype, td["caption_hash"].dtype, td["next", "reward"].shape
    (torch.uint8, torch.int64, torch.Size([4, 10, 1]))
    >>> env.close()
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.data import Bounded, Categorical, Composite, Unbounded
from torchrl.envs import EnvBase

from nle import nethack

from ..captions import CAPTION_HASH_KEY, MESSAGE_KEY, MESSAGE_LEN, MSG_COUNT_KEY, hash_bytes
from .tasks import ONITask, make_task, resolve_task

__all__ = ["NLEBatchEnv", "EPISODE_STATS", "OFF_MAP_GLYPH"]

EPISODE_STATS = ("return", "length", "dlvl", "xlvl", "gold", "scout", "kills", "end_status", "success")
_BL_X, _BL_Y, _BL_DEPTH, _BL_GOLD, _BL_XLVL = 0, 1, 12, 13, 18
_MAP_H, _MAP_W = 21, 79
OFF_MAP_GLYPH = int(nethack.MAX_GLYPH)  # one past the last glyph: "outside the map"


class _HashCache:
    """bytes → caption hash, memoised: NetHack repeats a few thousand messages endlessly."""

    def __init__(self, max_size: int = 200_000):
        self.table = {}
        self.max_size = max_size

    def __call__(self, raw: bytes) -> int:
        h = self.table.get(raw)
        if h is None:
            if len(self.table) >= self.max_size:
                self.table.clear()
            h = self.table[raw] = hash_bytes(raw)
        return h


class NLEBatchEnv(EnvBase):
    """K ONI/Motif NetHack games stepped in one process, one TensorDict per step.

    Args:
        task: task alias (``"score"``, ``"oracle"``, ``"staircase-lvl3"``...) or full id.
        num_envs: games in this process (K).
        seed: base seed; game ``i`` plays a reproducible sequence of games derived from
            ``(seed, i)``. ``None``: NetHack seeds itself (not reproducible).
        crop_size: side of the glyph crop centred on the agent.
        device: where the output tensors go (keep ``"cpu"`` in env workers).
        task_kwargs: extra arguments for :class:`~torchrl_oni.envs.tasks.ONITask`
            (``max_episode_steps``, ``timeout_as_termination``, ``character``...).
    """

    def __init__(
        self,
        task: str = "score",
        num_envs: int = 16,
        *,
        seed: Optional[int] = None,
        crop_size: int = 9,
        device="cpu",
        task_kwargs: Optional[dict] = None,
    ):
        if num_envs < 1:
            raise ValueError(f"num_envs must be >= 1, got {num_envs}")
        if crop_size < 1:
            raise ValueError(f"crop_size must be >= 1, got {crop_size}")
        super().__init__(device=device, batch_size=torch.Size([num_envs]))
        self.task = resolve_task(task)
        self.num_envs = num_envs
        self.crop_size = crop_size
        self.task_kwargs = dict(task_kwargs or {})
        self.games: Sequence[ONITask] = [make_task(self.task, **self.task_kwargs) for _ in range(num_envs)]
        self.num_actions = len(self.games[0].actions)
        self._hash = _HashCache()
        self._seeds: list = [None] * num_envs
        self._counts = [dict() for _ in range(num_envs)]
        self._ep_return = np.zeros(num_envs, dtype=np.float32)
        self._ep_length = np.zeros(num_envs, dtype=np.int64)
        half = crop_size // 2
        self._half = half
        # what lies outside the map: blank characters in colour 0
        self._crop_template = np.full((num_envs, crop_size, crop_size), OFF_MAP_GLYPH, np.int16)
        self._state: Optional[dict] = None
        self._make_specs()
        if seed is not None:
            self.set_seed(seed)

    # ------------------------------------------------------------------ specs
    def _make_specs(self):
        K, C = self.num_envs, self.crop_size
        shape = torch.Size([K])
        i64 = torch.int64
        episode = Composite(
            {
                "return": Unbounded(shape, dtype=torch.float32),
                **{k: Unbounded(shape, dtype=i64) for k in EPISODE_STATS if k not in ("return", "success")},
                "success": Categorical(2, shape, dtype=torch.bool),
            },
            shape=shape,
        )
        self.observation_spec = Composite(
            {
                MESSAGE_KEY: Bounded(0, 255, shape + (MESSAGE_LEN,), dtype=torch.uint8),
                CAPTION_HASH_KEY: Unbounded(shape, dtype=i64),
                MSG_COUNT_KEY: Unbounded(shape, dtype=i64),
                "blstats": Unbounded(shape + (27,), dtype=i64),
                "crop": Bounded(0, OFF_MAP_GLYPH, shape + (C, C), dtype=torch.int16),
                "episode": episode,
            },
            shape=shape,
        )
        self.action_spec = Categorical(self.num_actions, shape, dtype=i64)
        self.reward_spec = Unbounded(shape + (1,), dtype=torch.float32)
        self.done_spec = Composite(
            {k: Categorical(2, shape + (1,), dtype=torch.bool) for k in ("done", "terminated", "truncated")},
            shape=shape,
        )

    # ------------------------------------------------------------------ seeding
    def _set_seed(self, seed: Optional[int]) -> None:
        for i in range(self.num_envs):
            self._seeds[i] = None if seed is None else int(seed) * 1_000_003 + i

    # ------------------------------------------------------------------ core loop
    def _empty_state(self) -> dict:
        K = self.num_envs
        return {
            "message": np.empty((K, MESSAGE_LEN), np.uint8),
            "blstats": np.empty((K, 27), np.int64),
            "hash": np.empty(K, np.int64),
            "count": np.empty(K, np.int64),
            "scout": np.empty(K, np.int64),
            "kills": np.empty(K, np.int64),
            "end_status": np.zeros(K, np.int64),
            "success": np.zeros(K, bool),
            "crop": self._crop_template.copy(),
        }

    def _observe(self, i: int, game: ONITask, st: dict) -> None:
        """Copies game i's current observation into row i of the new state arrays."""
        obs = game.last_observation
        st["message"][i] = obs[game._message_index]
        st["blstats"][i] = obs[game._blstats_index]
        raw = game._prev_message
        counts = self._counts[i]
        n = counts.get(raw, 0) + 1
        counts[raw] = n
        st["count"][i] = n
        st["hash"][i] = self._hash(raw)
        # the crop: the part of the C×C window around the agent that lies on the map
        x, y, C, h = int(obs[game._blstats_index][_BL_X]), int(obs[game._blstats_index][_BL_Y]), self.crop_size, self._half
        r0, c0 = y - h, x - h
        rs, cs = max(r0, 0), max(c0, 0)
        re, ce = min(r0 + C, _MAP_H), min(c0 + C, _MAP_W)
        crop = st["crop"][i]
        crop[rs - r0 : re - r0, cs - c0 : ce - c0] = obs[game._glyph_index][rs:re, cs:ce]
        st["scout"][i] = game._scout_total
        st["kills"][i] = game._kills

    def _to_tensordict(self, st: dict, extra: Optional[dict] = None) -> TensorDictBase:
        f = torch.from_numpy
        game_blstats = st["blstats"]
        # after death NetHack zeroes blstats: the episode statistics use the last in-game ones
        dead = [i for i, game in enumerate(self.games) if not game._in_game]
        if dead:
            game_blstats = game_blstats.copy()
            for i in dead:
                game_blstats[i] = self.games[i]._last_game_blstats
        shape = self.batch_size
        episode = {
            "return": f(self._ep_return.copy()),
            "length": f(self._ep_length.copy()),
            "dlvl": f(game_blstats[:, _BL_DEPTH].copy()),
            "xlvl": f(game_blstats[:, _BL_XLVL].copy()),
            "gold": f(game_blstats[:, _BL_GOLD].copy()),
            "scout": f(st["scout"]),
            "kills": f(st["kills"]),
            "end_status": f(st["end_status"]),
            "success": f(st["success"]),
        }
        source = {
            MESSAGE_KEY: f(st["message"]),
            CAPTION_HASH_KEY: f(st["hash"]),
            MSG_COUNT_KEY: f(st["count"]),
            "blstats": f(st["blstats"]),
            "crop": f(st["crop"]),
            "episode": TensorDict._new_unsafe(episode, batch_size=shape),
        }
        if extra:
            source.update(extra)
        td = TensorDict._new_unsafe(source, batch_size=shape)
        if self.device is not None and self.device != torch.device("cpu"):
            td = td.to(self.device, non_blocking=True)
        return td

    def _reset(self, tensordict: Optional[TensorDictBase] = None, **kwargs) -> TensorDictBase:
        reset_mask = None
        if tensordict is not None:
            reset_mask = tensordict.get("_reset", None)
        if reset_mask is None or self._state is None:
            indices = range(self.num_envs)
        else:
            indices = reset_mask.reshape(self.num_envs).nonzero().flatten().tolist()
        old = self._state
        st = self._empty_state()
        if old is not None:  # games that are not reset keep their observation
            for k in st:
                st[k][:] = old[k]
        for i in indices:
            game = self.games[i]
            game.reset(seed=self._seeds[i])
            self._seeds[i] = None  # seeded once; later episodes derive their seeds
            self._counts[i].clear()
            self._ep_return[i] = 0.0
            self._ep_length[i] = 0
            st["end_status"][i] = 0
            st["success"][i] = False
            st["crop"][i] = self._crop_template[i]
            self._observe(i, game, st)
        self._state = st
        zeros = torch.zeros(self.batch_size + (1,), dtype=torch.bool)
        return self._to_tensordict(st, {"done": zeros, "terminated": zeros.clone(), "truncated": zeros.clone()})

    def _step(self, tensordict: TensorDictBase) -> TensorDictBase:
        actions = tensordict.get("action").reshape(self.num_envs).tolist()
        K = self.num_envs
        st = self._empty_state()
        reward = np.empty(K, np.float32)
        terminated = np.zeros(K, bool)
        truncated = np.zeros(K, bool)
        for i, game in enumerate(self.games):
            r, term, trunc, status, success = game.step_core(actions[i])
            reward[i] = r
            terminated[i] = term
            truncated[i] = trunc
            st["end_status"][i] = status
            st["success"][i] = success
            self._observe(i, game, st)
        self._ep_return += reward
        self._ep_length += 1
        self._state = st
        f = torch.from_numpy
        done = terminated | truncated
        return self._to_tensordict(
            st,
            {
                "reward": f(reward).unsqueeze(-1),
                "done": f(done).unsqueeze(-1),
                "terminated": f(terminated).unsqueeze(-1),
                "truncated": f(truncated).unsqueeze(-1),
            },
        )

    def close(self, *, raise_if_closed: bool = True):
        for game in getattr(self, "games", ()):
            try:
                game.close()
            except Exception:  # a game that failed to start has nothing to close
                pass
        self.games = []
        try:
            super().close(raise_if_closed=raise_if_closed)
        except TypeError:  # older TorchRL signature
            super().close()
