"""K NetHack games in one process behind one TorchRL ``EnvBase`` of batch size ``[K]``.

TorchRL costs about 0.5 ms per env step (TensorDict creation, spec checks) while NetHack takes
about 0.05 ms, so one game per TensorDict spends 90 % of its time in bookkeeping. This env
steps K games in a plain Python loop, with NetHack writing each game's observation into row i
of shared ``[K, ...]`` arrays; one copy per key (fresh every step: a stored observation must
never alias the next one) goes into ONE TensorDict, which amortises TorchRL's cost over K games.
``step_and_maybe_reset`` skips TorchRL's generic bookkeeping on ordinary steps (same data, tested).
The env workers' collector (:class:`~torchrl_oni.train._rollout.NLERolloutCollector`) skips the
per-step TensorDict altogether: ``_step_into`` writes the games' step into a rollout's buffers.

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
``tty_chars``               uint8[K, 24, 80]    only with ``screens=True``: the terminal the
``tty_colors``              int8[K, 24, 80]     player sees (NLE's), for the labelling page
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
from ..task_ids import resolve_task
from .tasks import OBSERVATION_KEYS, ONITask, make_task

__all__ = ["NLEBatchEnv", "GlyphWindows", "EPISODE_STATS", "OFF_MAP_GLYPH", "SCREEN_KEYS"]

EPISODE_STATS = ("return", "length", "dlvl", "xlvl", "gold", "scout", "kills", "end_status", "success")
_EPISODE_BLSTATS = [nethack.NLE_BL_DEPTH, nethack.NLE_BL_XP, nethack.NLE_BL_GOLD]
_MAP_H, _MAP_W = 21, 79
_TTY_H, _TTY_W = 24, 80
SCREEN_KEYS = ("tty_chars", "tty_colors")  # what screens=True adds
# root entries that ``step_mdp`` does not carry from one step to the next
_NOT_CARRIED = frozenset(("next", "reward", "done", "terminated", "truncated", "_reset", "_step"))
OFF_MAP_GLYPH = int(nethack.MAX_GLYPH)  # one past the last glyph: "outside the map"


class GlyphWindows:
    """C x C glyph windows centred on the agent, for ``games`` games at once.

    Glyphs are copied into ``interior``, a view of arrays padded with ``OFF_MAP_GLYPH``; a window
    that leaves the map then needs no special case. Used by :class:`NLEBatchEnv` and by the
    gym pieces' copying wrapper, so both paths cut the same crop.

    Example:
        >>> import numpy as np
        >>> w = GlyphWindows(games=1, crop_size=3)
        >>> w.interior[0] = np.arange(21 * 79, dtype=np.int16).reshape(21, 79)
        >>> w.crop(np.array([0]), x=np.array([0]), y=np.array([0]))[0].tolist()
        [[5976, 5976, 5976], [5976, 0, 1], [5976, 79, 80]]
    """

    def __init__(self, games: int, crop_size: int):
        top = crop_size // 2
        padded = np.full((games, _MAP_H + crop_size - 1, _MAP_W + crop_size - 1), OFF_MAP_GLYPH, np.int16)
        self.interior = padded[:, top : top + _MAP_H, top : top + _MAP_W]
        self._windows = np.lib.stride_tricks.sliding_window_view(padded, (crop_size, crop_size), axis=(1, 2))

    def crop(self, games, x, y) -> np.ndarray:
        """Fresh ``[len(games), C, C]`` windows of ``games`` around map positions ``(x, y)``."""
        # minimum/maximum, not clip: ndarray.clip's Python wrapper costs more than the indexing
        return self._windows[games, np.minimum(np.maximum(y, 0), _MAP_H - 1), np.minimum(np.maximum(x, 0), _MAP_W - 1)]


class _HashCache(dict):
    """bytes → caption hash, memoised (``cache[raw]``): NetHack repeats a few thousand messages
    endlessly. A dict whose misses hash, so a message seen before costs a dict lookup, not a call."""

    def __init__(self, max_size: int = 200_000):
        super().__init__()
        self.max_size = max_size

    def __missing__(self, raw: bytes) -> int:
        if len(self) >= self.max_size:
            self.clear()
        h = self[raw] = hash_bytes(raw)
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
        screens (bool): also return the terminal (``tty_chars``, ``tty_colors``), e.g. to show
            people the screen a caption appeared on (``oni-train --human-feedback``). Off by
            default: NetHack fills every requested buffer on every step, and the batch grows by
            3.8 kB per game and step.
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
        screens: bool = False,
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
        self.screens = bool(screens)
        # an empty tuple when off: the step loops over it, so the default path pays nothing
        self._screen_keys = SCREEN_KEYS if self.screens else ()
        game_kwargs = dict(self.task_kwargs)
        if self.screens:
            keys = tuple(game_kwargs.get("observation_keys", OBSERVATION_KEYS))
            game_kwargs["observation_keys"] = keys + tuple(k for k in SCREEN_KEYS if k not in keys)
        self.games: Sequence[ONITask] = [make_task(self.task, **game_kwargs) for _ in range(num_envs)]
        self.num_actions = len(self.games[0].actions)
        self._install_buffers()
        self._hash = _HashCache()
        self._seeds: list = [None] * num_envs
        self._counts = [dict() for _ in range(num_envs)]
        self._ep_return = np.zeros(num_envs, dtype=np.float32)
        self._ep_length = np.zeros(num_envs, dtype=np.int64)
        self._all_rows = np.arange(num_envs, dtype=np.int64)
        self._windows = GlyphWindows(num_envs, crop_size)
        # the latest observation arrays and whether a game just ended; a plain dict because
        # EnvBase (an nn.Module) makes every attribute assignment cost microseconds
        self._live = {"state": None, "any_done": False}
        self._cpu = self.device is None or self.device.type == "cpu"
        self._make_specs()
        # one step's arrays, by rollout_fields' names: [K, ...] shapes and numpy dtypes from the specs
        specs = {**dict(self.observation_spec.items(True, True)), **dict(self.done_spec.items(True, True))}
        self._step_layout = {name: (tuple(specs[key].shape), torch.empty(0, dtype=specs[key].dtype).numpy().dtype)
                             for name, key in self.rollout_fields().items()}
        self._step_layout["reward"] = (tuple(self.reward_spec.shape), np.dtype(np.float32))
        self._root_fields = [(name, key) for name, key in self.rollout_fields().items() if isinstance(key, str)]
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
        if self.screens:
            self.observation_spec["tty_chars"] = Bounded(0, 255, shape + (_TTY_H, _TTY_W), dtype=torch.uint8)
            self.observation_spec["tty_colors"] = Bounded(-128, 127, shape + (_TTY_H, _TTY_W), dtype=torch.int8)
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
    def _install_buffers(self) -> None:
        """Makes every game's NetHack write its observation into row i of shared [K, ...] arrays.

        NLE gives each game its own observation buffers; pointing them at rows of one array per
        key lets one ``copy()`` per key take the whole batch's observation, and the crops be cut
        for all games at once, instead of K small copies a step.
        """
        K = self.num_envs
        self._obs_rows = {
            "glyphs": np.zeros((K, _MAP_H, _MAP_W), np.int16),
            "blstats": np.zeros((K, 27), np.int64),
            "message": np.zeros((K, MESSAGE_LEN), np.uint8),
        }
        if self.screens:
            self._obs_rows["tty_chars"] = np.zeros((K, _TTY_H, _TTY_W), np.uint8)
            self._obs_rows["tty_colors"] = np.zeros((K, _TTY_H, _TTY_W), np.int8)
        for i, game in enumerate(self.games):
            nh = game.nethack
            try:
                for key, batch in self._obs_rows.items():
                    own = nh._obs_buffers[key]
                    if own.shape != batch.shape[1:] or own.dtype != batch.dtype:
                        raise TypeError(f"{key}: {own.dtype}{own.shape}")
                    nh._obs_buffers[key] = batch[i]
                nh._pynethack.set_buffers(**nh._obs_buffers)
                nh._obs = tuple(nh._obs_buffers.values())  # the order of its observation keys
            except (AttributeError, KeyError, TypeError) as e:  # pragma: no cover - other NLE
                raise RuntimeError(f"NLEBatchEnv needs nle==1.3's Nethack internals ({e})") from e
            game.last_observation = nh._obs

    def _observe(self, st: dict, rows=None) -> None:
        """Copies of the games' observations into ``st`` (``rows``: only those games' rows)."""
        buf = self._obs_rows
        if rows is None:  # every game: whole-array copies, no fancy indexing
            ks = self._all_rows
            np.copyto(st["message"], buf["message"])
            np.copyto(st["blstats"], buf["blstats"])
            blstats = buf["blstats"]
            np.copyto(self._windows.interior, buf["glyphs"])
            for key in self._screen_keys:
                np.copyto(st[key], buf[key])
        else:
            ks = np.asarray(rows, np.int64)
            st["message"][ks] = buf["message"][ks]
            st["blstats"][ks] = blstats = buf["blstats"][ks]
            self._windows.interior[ks] = buf["glyphs"][ks]
            for key in self._screen_keys:
                st[key][ks] = buf[key][ks]
        st["crop"][ks] = self._windows.crop(ks, x=blstats[:, nethack.NLE_BL_X], y=blstats[:, nethack.NLE_BL_Y])

    def _note_messages(self, st: dict, rows) -> None:
        """Per-episode message counts, caption hashes and game statistics of ``rows``."""
        games, counts_of, hash_of = self.games, self._counts, self._hash
        counts, hashes, scout, kills, dead = [], [], [], [], []
        for i in rows.tolist() if isinstance(rows, np.ndarray) else rows:
            raw, tiles, killed, in_game, last_in_game = games[i].step_notes()
            seen = counts_of[i]
            n = seen[raw] = seen.get(raw, 0) + 1
            counts.append(n)
            hashes.append(hash_of[raw])
            scout.append(tiles)
            kills.append(killed)
            if not in_game:
                dead.append((i, last_in_game))
        if len(counts) == self.num_envs:  # every game (rows never repeat): whole columns, no index arrays
            rows = slice(None)
        st["count"][rows] = counts
        st["hash"][rows] = hashes
        st["scout"][rows] = scout
        st["kills"][rows] = kills
        # after death NetHack zeroes blstats: the episode statistics use the last in-game ones
        game_blstats = st["game_blstats"]
        game_blstats[rows] = st["blstats"][rows]
        for i, last in dead:
            game_blstats[i] = last

    def _fresh_step(self) -> dict:
        """Fresh ``[K, ...]`` arrays for one step's entries (:meth:`rollout_fields` and ``reward``):
        the TensorDict made of them owns them (a stored observation never aliases the next one)."""
        return {name: np.empty(shape, dtype) for name, (shape, dtype) in self._step_layout.items()}

    def _to_tensordict(self, out: dict, with_reward: bool) -> TensorDictBase:
        """The TensorDict of one step's arrays (views: no copy)."""
        f = torch.from_numpy
        shape = self.batch_size
        device = self.device if self._cpu else None
        source = {key: f(out[name]) for name, key in self._root_fields}
        source["episode"] = TensorDict._new_unsafe({name: f(out[name]) for name in EPISODE_STATS},
                                                   batch_size=shape, device=device)
        if with_reward:
            source["reward"] = f(out["reward"])
        if self._cpu:
            return TensorDict._new_unsafe(source, batch_size=shape, device=self.device)
        return TensorDict._new_unsafe(source, batch_size=shape).to(self.device, non_blocking=True)

    def _reset(self, tensordict: Optional[TensorDictBase] = None, **kwargs) -> TensorDictBase:
        reset_mask = None
        if tensordict is not None:
            reset_mask = tensordict.get("_reset", None)
        K = self.num_envs
        old = self._live["state"]
        if reset_mask is None or old is None:
            rows = list(range(K))
            out = self._fresh_step()
            game_blstats = np.empty((K, 27), np.int64)
        else:
            rows = reset_mask.reshape(K).nonzero().flatten().tolist()
            # games not reset keep their observation (copies: the last step's TensorDict owns its own)
            out = {name: old[name].copy() for name in self._step_layout if name != "reward"}
            game_blstats = old["game_blstats"]
        self._reset_into(rows, out, game_blstats)
        for key in ("done", "terminated", "truncated"):  # TorchRL's reset: no game has ended
            out[key][...] = False
        self._live["state"] = {**out, "game_blstats": game_blstats}
        return self._to_tensordict(out, with_reward=False)

    def _step(self, tensordict: TensorDictBase) -> TensorDictBase:
        K = self.num_envs
        out = self._fresh_step()
        game_blstats = self._live["state"]["game_blstats"]
        ended = self._step_into(tensordict.get("action").reshape(K).tolist(), out, game_blstats)
        self._live["any_done"] = bool(ended)
        self._live["state"] = {**out, "game_blstats": game_blstats}
        return self._to_tensordict(out, with_reward=True)

    def _step_and_maybe_reset(self, tensordict: TensorDictBase):
        """``step`` + ``step_mdp`` + ``maybe_reset`` with TorchRL's semantics, minus its generic cost.

        TorchRL's generic version spends ~0.2 ms a call on validation and key bookkeeping that this
        env does not need (its ``_step`` already returns every key with the spec's shapes and
        dtypes): at K = 16 games that is a third of the time NetHack itself takes. Anything
        unusual (a partial ``_step`` mask, a preset ``"next"``, type checks, post-step hooks,
        another device, a lazy stack) takes TorchRL's own path, and so do resets, which are rare.
        ``test_fast_step_matches_torchrl`` checks both paths give the same data.
        """
        if (
            type(tensordict) is not TensorDict
            or self._post_step_mdp_hooks is not None
            or self.run_type_checks
            or tensordict.device != self.device
            or "_step" in tensordict.keys()
            or "next" in tensordict.keys()
        ):
            return super()._step_and_maybe_reset(tensordict)
        next_td = self._step(tensordict)
        tensordict._set_str("next", next_td, validated=True, inplace=False, non_blocking=False)
        # step_mdp: the root's other entries (action, policy outputs...) + the new observations
        carried = {
            k: (v.copy() if isinstance(v, TensorDictBase) else v)
            for k, v in tensordict._tensordict.items()
            if k not in _NOT_CARRIED
        }
        for k, v in next_td._tensordict.items():
            if k != "reward":
                carried[k] = v.copy() if isinstance(v, TensorDictBase) else v
        root = TensorDict._new_unsafe(carried, batch_size=self.batch_size, device=tensordict.device)
        if self._live["any_done"]:
            root = self.maybe_reset(root)
        return tensordict, root

    # ------------------------------------------------------------------ in-place stepping
    # The rollout collector's path (torchrl_oni/train/_rollout.py): the games write straight into
    # numpy views of a rollout's preallocated [K, T, ...] buffers, no TensorDict per step. ``out``
    # maps the names of :meth:`rollout_fields` (and ``"reward"`` for a step) to [K, ...] views
    # of one time step; ``game_blstats`` [K, 27] is the caller's running copy of the last in-game
    # blstats (taken from, and given back to, ``_live["state"]`` around a rollout).
    def rollout_fields(self) -> dict:
        """``{name: key}`` of every root entry one step of this env fills (observations, episode
        statistics, done flags); ``("next", key)`` adds ``"reward"``."""
        fields = {"message": MESSAGE_KEY, "hash": CAPTION_HASH_KEY, "count": MSG_COUNT_KEY,
                  "blstats": "blstats", "crop": "crop"}
        fields.update({key: key for key in self._screen_keys})
        fields.update({name: ("episode", name) for name in EPISODE_STATS})
        fields.update({key: key for key in ("done", "terminated", "truncated")})
        return fields

    def _episode_into(self, out: dict, game_blstats: np.ndarray, rows=slice(None)) -> None:
        out["return"][rows] = self._ep_return[rows]
        out["length"][rows] = self._ep_length[rows]
        out["dlvl"][rows] = game_blstats[rows, nethack.NLE_BL_DEPTH]
        out["xlvl"][rows] = game_blstats[rows, nethack.NLE_BL_XP]
        out["gold"][rows] = game_blstats[rows, nethack.NLE_BL_GOLD]

    def _step_into(self, actions: Sequence[int], out: dict, game_blstats: np.ndarray,
                   rows: Optional[range] = None) -> list:
        """One step of every game, or of the games ``rows`` (a ``range``: the other rows of ``out``
        are left alone), written into ``out``; returns the games that ended (ascending)."""
        at = slice(None) if rows is None else slice(rows.start, rows.stop)
        ks = self._all_rows[at]
        games = self.games if rows is None else self.games[at]
        outcome = np.array([game.step_core(a) for game, a in zip(games, actions)], np.float64)
        st = dict(out, game_blstats=game_blstats)
        self._observe(st, None if rows is None else ks)  # every game: whole-array copies
        self._note_messages(st, ks)
        reward = outcome[:, 0].astype(np.float32)
        np.add(self._ep_return[at], reward, out=self._ep_return[at])
        np.add(self._ep_length[at], 1, out=self._ep_length[at])
        out["reward"][at, 0] = reward
        flags = outcome[:, 1:3] != 0
        done = flags.any(1)
        out["done"][at, 0] = done
        out["terminated"][at, 0] = flags[:, 0]
        out["truncated"][at, 0] = flags[:, 1]
        out["end_status"][at] = outcome[:, 3].astype(np.int64)
        out["success"][at] = outcome[:, 4] != 0
        self._episode_into(out, game_blstats, at)
        return ks[done].tolist() if done.any() else []

    def _reset_into(self, rows: list, out: dict, game_blstats: np.ndarray) -> None:
        """:meth:`_reset` of the games ``rows`` (a partial reset) written into those rows of ``out``."""
        for i in rows:
            self.games[i].reset(seed=self._seeds[i])
            self._seeds[i] = None  # seeded once; later episodes derive their seeds
            self._counts[i].clear()
        self._ep_return[rows] = 0.0
        self._ep_length[rows] = 0
        out["end_status"][rows] = 0
        out["success"][rows] = False
        st = dict(out, game_blstats=game_blstats)
        self._observe(st, rows)  # by rows, even when every game ended
        self._note_messages(st, rows)
        self._episode_into(out, game_blstats, rows)
        for key in ("done", "terminated", "truncated"):
            out[key][rows] = False

    def _adopt_state(self, out: dict, game_blstats: np.ndarray) -> None:
        """Makes ``out`` (the games' current observation, as written by the in-place path) this
        env's state, so that a later :meth:`_step` or :meth:`_reset` continues from it (copies)."""
        self._live["state"] = {**{name: out[name].copy() for name in self.rollout_fields()},
                               "game_blstats": game_blstats.copy()}

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
