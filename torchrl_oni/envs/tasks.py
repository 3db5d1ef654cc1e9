"""ONI's and Motif's NetHack tasks, re-created on NLE 1.3 + gymnasium, seedable.

NLE 1.3 registers only ``NetHack*-v0``; ONI (the paper) used the 28-action ``*ExtendedActions``
tasks and Motif the 23-action ones. This module re-creates them as gymnasium envs with:

* the rewards and terminations of the originals (score delta with a -0.01 penalty on steps where
  the in-game clock stands still; +50 for reaching dungeon level N by the stairs; +50 for
  standing next to the Oracle; ``Continual`` variants that pay +50 once and go on);
* the ExtendedActions step logic: eat/drink prompts answered by the NW key, auto-dismissed
  ``--More--`` (keeping "You descend the stairs." in the observation, which the staircase
  tasks need), text prompts escaped, yes/no prompts escaped unless the agent must answer,
  the CAST macro (first spell) and auto-``#enhance``;
* **seeding**: ``reset(seed=s)`` makes the game reproducible, and later episodes derive their own
  seeds from ``s``, so the same seed and the same actions give the same trajectory (the
  original could not be seeded);
* **time limits reported as truncation** (``terminated=False, truncated=True``), so value
  bootstrapping stays correct. ``timeout_as_termination=True`` restores the original behaviour,
  where a time-out was a terminal state like death.

The env is lean on purpose: it copies only the blstats it needs between steps (NLE's own
``step`` copies every observation array), because the batched TorchRL env steps many of these
per process and NetHack itself takes only ~50 µs a step.

Rendering: ``render_mode`` is one of NLE's (``"human"``, ``"ansi"``, ``"full"``, ``"pixel"``)
and ``render()`` gives what NLE's own ids give. The screens those modes draw from (the terminal,
the map's characters) are kept by NetHack beside the observation, never in it, and only for an
env made with a ``render_mode``: the default (``None``, gymnasium's "no rendering") keeps none.

Example:
    >>> from torchrl_oni.envs.tasks import make_task
    >>> env = make_task("score")
    >>> obs, info = env.reset(seed=3)
    >>> sorted(obs)[:3], int(env.action_space.n)
    (['blstats', 'glyphs', 'message'], 28)
    >>> obs, reward, terminated, truncated, info = env.step(0)
    >>> sorted(k for k in info if k in ("dlvl", "gold", "xlvl"))
    ['dlvl', 'gold', 'xlvl']
    >>> env.close()
    >>> env = make_task("score", render_mode="ansi")  # the observation stays the same three keys
    >>> obs, info = env.reset(seed=3)
    >>> sorted(obs), "@" in env.render()
    (['blstats', 'glyphs', 'message'], True)
    >>> env.close()
"""
from __future__ import annotations

import re
from typing import Dict, NamedTuple, Optional, Tuple

import gymnasium as gym
import numpy as np
from nle import nethack
from nle.env import base as nle_base
from nle.env import tasks as nle_tasks

from ..task_ids import TASKS, resolve_task

__all__ = [
    "ONITask",
    "make_task",
    "MOTIF_ACTIONS",
    "EXTENDED_ACTIONS",
]

# 23 actions of NLE's TASK_ACTIONS, and the 5 ONI adds (cast, quaff, pray, pick up, pay).
MOTIF_ACTIONS = tuple(nle_tasks.TASK_ACTIONS)
EXTENDED_ACTIONS = MOTIF_ACTIONS + (
    nethack.Command.CAST,
    nethack.Command.QUAFF,
    nethack.Command.PRAY,
    nethack.Command.PICKUP,
    nethack.Command.PAY,
)

# glyphs, not chars/colours: NetHack fills every requested buffer on every step, and with many
# games per process each extra buffer costs cache (32 games: 1.23x faster without chars/colours)
OBSERVATION_KEYS = ("glyphs", "blstats", "message")

# what NLE's render() reads, per mode: NetHack fills these beside the observation (never in it),
# and only for an env made to render, so training envs pay nothing for them
RENDER_KEYS = {
    "human": ("tty_chars", "tty_colors", "tty_cursor"),
    "ansi": ("chars",),
    "full": ("chars", "colors", "inv_strs", "inv_letters"),
    "pixel": (),  # drawn from NetHack's own glyph state
}

# Yes/no questions the agent answers itself (NLE's list plus "drink").
ANSWERED_BY_AGENT = (b"eat", b"attack", b"direction?", b"pray", b"drink")
DESCEND_MESSAGE = b"You descend the stairs."
ENHANCE_MESSAGE = b"You feel more confident in"
FOOD_PROMPTS = (b"What do you want to eat", b"What do you want to drink")
OPTIONS_RE = re.compile(rb"\[([a-zA-Z]+)")

ASCII_SPACE = ord(" ")
ASCII_ESC = 27
KEY_Y = ord("y")
KEY_A = ord("a")

BL = nethack  # blstats indices, e.g. BL.NLE_BL_SCORE
CAST_KEY = int(nethack.Command.CAST)
ENHANCE_KEY = int(nethack.Command.ENHANCE)
SCOUT_EVERY = 8  # steps between two counts of explored squares (and on every level change)
GOAL_SCORE, GOAL_STAIRCASE, GOAL_ORACLE = 0, 1, 2
# end statuses as plain ints (NLE's StepStatus values)
STATUS_ABORTED, STATUS_RUNNING, STATUS_DEATH, STATUS_SUCCESS = -1, 0, 1, 2
CONDITION_HALLUCINATING = 512
SUCCESS_REWARD = 50.0
TIME_PENALTY = -0.01


def _oracle_glyph() -> int:
    for glyph in range(nethack.GLYPH_MON_OFF, nethack.GLYPH_PET_OFF):
        if nethack.permonst(nethack.glyph_to_mon(glyph)).mname == "Oracle":
            return glyph
    raise RuntimeError("NLE has no Oracle monster glyph")


def _derive_seeds(seed: int, episode: int) -> Tuple[int, int]:
    """Two NetHack seeds (core, disp) for one episode of a seeded env."""
    ss = np.random.SeedSequence([int(seed) & 0xFFFFFFFFFFFFFFFF, int(episode)])
    core, disp = ss.generate_state(2, dtype=np.uint64)
    # NetHack takes signed longs; keep them positive and below 2**62.
    return int(core >> np.uint64(2)), int(disp >> np.uint64(2))


class ONITask(nle_base.NLE):
    """Base of every ONI/Motif task: NLE with ONI's step logic, seeding and truncation.

    Args:
        extended_actions: 28 actions and ONI's ExtendedActions step logic (True), or Motif's
            23 actions with only the eat-prompt rule (False).
        goal: ``"score"``, ``"staircase"``, ``"oracle"``.
        target_level: dungeon level to reach for ``staircase`` (2, 3 or 4).
        sober: for ``oracle``, also require not hallucinating (OracleSober).
        continual: pay the success reward once and keep playing (Motif's intrinsic-only tasks).
        timeout_as_termination: report the step limit as termination, like the original.
        max_episode_steps: agent steps before the game is stopped (default 5000).
        character: NetHack character string (default ``"mon-hum-neu-mal"``, a Monk).
        observation_keys: NLE keys to return (``glyphs``, ``blstats``, ``message`` are
            always needed internally).
        render_mode: ``None`` (no rendering, the default) or one of ``metadata["render_modes"]``
            (NLE's): ``"human"`` prints the terminal, ``"ansi"`` returns the map as text,
            ``"full"`` prints message, inventory and map, ``"pixel"`` returns an RGB array.
    """

    StepStatus = nle_tasks.NetHackStaircase.StepStatus  # ABORTED, RUNNING, DEATH, TASK_SUCCESSFUL

    # gymnasium seeds through reset(seed=...) (below); NLE's legacy seed(core, disp, ...) is not
    # offered, so seeding has one way and gymnasium's checker has nothing to warn about
    seed = None

    def __init__(
        self,
        *,
        extended_actions: bool = True,
        goal: str = "score",
        target_level: int = 2,
        sober: bool = False,
        continual: bool = False,
        timeout_as_termination: bool = False,
        max_episode_steps: int = 5000,
        character: str = "mon-hum-neu-mal",
        observation_keys=OBSERVATION_KEYS,
        render_mode: Optional[str] = None,
        **kwargs,
    ):
        if goal not in ("score", "staircase", "oracle"):
            raise ValueError(f"unknown goal {goal!r}")
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(
                f"unknown render_mode {render_mode!r}; choose one of {self.metadata['render_modes']} or None"
            )
        actions = EXTENDED_ACTIONS if extended_actions else MOTIF_ACTIONS
        observation_keys = tuple(observation_keys)
        render_keys = tuple(k for k in RENDER_KEYS.get(render_mode, ()) if k not in observation_keys)
        super().__init__(
            actions=actions,
            max_episode_steps=max_episode_steps,
            character=character,
            observation_keys=observation_keys + render_keys,
            fix_moon_phase=True,  # phase of the moon from the seed, not the wall clock
            render_mode=render_mode,
            **kwargs,
        )
        if render_keys:
            # NetHack fills the render buffers (NLE's render() finds them in _observation_keys);
            # the observation and its space stay those asked for
            self._original_observation_keys = observation_keys
            self._original_indices = tuple(self._observation_keys.index(k) for k in observation_keys)
            self.observation_space = gym.spaces.Dict({k: self.observation_space[k] for k in observation_keys})
        self.extended_actions = extended_actions
        self.goal = goal
        self.target_level = int(target_level)
        self.sober = sober
        self.continual = continual
        self.timeout_as_termination = timeout_as_termination
        self._action_keys = [int(a) for a in actions]
        self._food_prompts = FOOD_PROMPTS if extended_actions else FOOD_PROMPTS[:1]
        self._goal_code = {"score": GOAL_SCORE, "staircase": GOAL_STAIRCASE, "oracle": GOAL_ORACLE}[goal]
        self._oracle = _oracle_glyph() if goal == "oracle" else None
        self._seed: Optional[int] = None
        self._seeded_episode = 0
        self._reset_stats()

    def render(self):
        """NLE's render in ``self.render_mode``; ``None`` with a warning for an env made without one."""
        if self.render_mode is None:
            gym.logger.warn(
                "render() called on an env made without render_mode; make it with render_mode= one of "
                f"{self.metadata['render_modes']} (gymnasium.make(id, render_mode=...) or "
                "make_task(..., render_mode=...))"
            )
            return None
        if self.render_mode == "full":
            return self._render_full()
        return super().render()

    def _render_full(self):
        # NLE's "full" mode, with the colours widened first: NLE's own hands uint8 colours to
        # tty_render, whose ``colour & ~8`` raises OverflowError under numpy 2
        obs, keys = self.last_observation, self._observation_keys
        print(obs[keys.index("message")].tobytes().split(b"\0", 1)[0].decode("ascii", "replace"))
        for letter, line in zip(obs[keys.index("inv_letters")], obs[keys.index("inv_strs")]):
            if not line.any():
                break
            print(chr(letter), line.tobytes().split(b"\0", 1)[0].decode("ascii", "replace"))
        print(nethack.tty_render(obs[keys.index("chars")], obs[keys.index("colors")].astype(np.int16)))
        return None

    # ------------------------------------------------------------------ seeding
    def reset(self, seed: Optional[int] = None, options=None):
        """Gymnasium reset: ``(obs, info)``.

        ``seed`` seeds NetHack (this episode and the ones after it) and gymnasium's
        ``np_random`` (which seeded wrappers such as ``StickyAction`` draw from).
        ``options`` is NLE's: ``{"wizkit_items": [...]}`` (wizard mode); ``{}`` means none.
        """
        if seed is not None:
            self._seed = int(seed)
            self._seeded_episode = 0
            # gymnasium's contract: reset(seed=s) seeds env.np_random. Done here rather than by
            # NLE.reset(seed=s), which calls self.reset(seed=s) again when a game fails to start
            # and would restart our seed sequence on the same failing seeds.
            gym.Env.reset(self, seed=seed)
        if self._seed is not None:
            core, disp = _derive_seeds(self._seed, self._seeded_episode)
            self.nethack.set_initial_seeds(core, disp, False, None)
            self._seeded_episode += 1
        if options is not None and "wizkit_items" not in options:
            # NLE 1.3 reads options["wizkit_items"] from any options dict, so the reset(options={})
            # that gymnasium allows (and check_env makes) raised KeyError: give it the default
            options = {**options, "wizkit_items": None}
        self._reset_stats()
        obs, info = super().reset(options=options)
        self._prev_message = self.last_observation[self._message_index].tobytes().split(b"\0", 1)[0]
        self._prev_blstats = self.last_observation[self._blstats_index].copy()
        self._last_game_blstats = self._prev_blstats.copy()
        self._update_scout(self.last_observation)
        info.update(self._episode_info())
        return obs, info

    def _reset_stats(self):
        self._kills = 0
        self._scout: Dict[Tuple[int, int], int] = {}
        self._scout_total = 0
        self._scout_tick = 0
        self._level = None
        self._in_game = True
        self._paid_success = False
        self._prev_message = b""

    # ------------------------------------------------------------------ stepping
    def step(self, action: int):
        """Gymnasium step: ``(obs, reward, terminated, truncated, info)``."""
        reward, terminated, truncated, end_status, success = self.step_core(action)
        info = {"end_status": end_status, "success": success}
        info.update(self._episode_info())
        return self._get_observation(self.last_observation), reward, terminated, truncated, info

    def step_core(self, action: int):
        """One agent step without building the observation dict or info (the batched env's path).

        Returns:
            ``(reward, terminated, truncated, end_status, success)``; the observation is left in
            ``self.last_observation`` (NLE's reused buffers: copy what you keep).
        """
        key = self._key_for(action, self._prev_message)
        # NetHack's own calls rather than NLE's wrappers around them (what Nethack.step returns is
        # its reused buffers, _obs): two Python calls fewer on every step of every game
        game = self.nethack._pynethack
        game.step(key)
        observation, done = self.nethack._obs, game.done()
        message = observation[self._message_index].tobytes()
        if not done:  # a prompt the agent is not meant to see, or a macro's second key: answered here
            internal = observation[self._internal_index]
            if internal[1] or internal[2] or internal[3] or (self.extended_actions and (
                    key == CAST_KEY or ENHANCE_MESSAGE in message)):
                observation, done = self._known_steps(observation, done, key)
                message = observation[self._message_index].tobytes()
        self._steps += 1
        self.last_observation = observation

        blstats = observation[self._blstats_index]
        nul = message.find(b"\0")
        message = message if nul < 0 else message[:nul]
        self._prev_message = message
        if b"kill" in message and b"you kill " in message.lower():  # counted when seen
            self._kills += 1
        in_game = game.in_normal_game()
        self._in_game = in_game
        current = blstats.copy()
        if in_game:
            self._last_game_blstats = current
            self._scout_tick += 1
            level = (int(current[BL.NLE_BL_DNUM]), int(current[BL.NLE_BL_DLEVEL]))
            # exploration is counted every few steps and on arrival (a logging statistic)
            if level != self._level or self._scout_tick >= SCOUT_EVERY:
                self._update_scout(observation)

        success = (not done) and self._goal_code != GOAL_SCORE and self._success(observation, message)
        timed_out = self._steps >= self._max_episode_steps
        reward = self._reward(current, in_game, success)
        self._prev_blstats = current

        if done:
            end_status = STATUS_DEATH
        elif success and not self.continual:
            end_status = STATUS_SUCCESS
        elif timed_out:
            end_status = STATUS_ABORTED
        else:
            return reward, False, False, STATUS_RUNNING, success

        terminated = end_status != STATUS_ABORTED
        truncated = not terminated
        if truncated and self.timeout_as_termination:
            terminated, truncated = True, False
        if in_game:
            self._update_scout(observation)
        if not done:
            # stop the game now; the agent sees the observation from before quitting, put back
            # into NLE's buffers (the game writes nothing more there until the next reset)
            kept = [a.copy() for a in observation]
            self._quit_game(observation, done)
            for buffer, value in zip(observation, kept):
                buffer[...] = value
        return reward, terminated, truncated, end_status, success

    def _key_for(self, action: int, prev_message: bytes) -> int:
        key = self._action_keys[action]
        if b"want to " in prev_message and any(p in prev_message for p in self._food_prompts):
            if key == KEY_Y:  # the NW key doubles as "take the first offered item"
                match = OPTIONS_RE.search(prev_message)
                return match.group(1)[0] if match else ASCII_SPACE
            return ASCII_SPACE  # anything else cancels the prompt
        return key

    def _known_steps(self, observation, done, key):
        """Answers the game's prompts the agent is not meant to see (ONI §4.3)."""
        internal_i, msg_i = self._internal_index, self._message_index
        step = self.nethack.step
        extended = self.extended_actions
        enhance = False
        if extended and key == CAST_KEY and not done:  # the CAST macro: always the first spell
            observation, done = step(KEY_A)
        for _ in range(64):  # a guard: NetHack never chains this many prompts
            if done:
                break
            internal = observation[internal_i]
            more, getlin, yes_no = internal[3], internal[2], internal[1]
            if not extended and not (more or getlin or yes_no):
                break
            message = observation[msg_i].tobytes()
            if extended and ENHANCE_MESSAGE in message:
                enhance = True
            if more:  # --More--
                observation, done = step(ASCII_SPACE)
                if DESCEND_MESSAGE in message and not done:
                    # keep the arrival message: the staircase tasks are judged on it
                    observation[msg_i][:] = np.frombuffer(message, dtype=np.uint8)
                continue
            if getlin:  # the game wants a line of text
                observation, done = step(ASCII_ESC)
                continue
            if yes_no:  # a yes/no question
                if self._allow_all_yn_questions or any(q in message for q in ANSWERED_BY_AGENT):
                    break  # the agent answers (e.g. NW = yes to a prayer)
                observation, done = step(ASCII_ESC)
            if enhance and not done:
                enhance = False
                observation, done = step(ENHANCE_KEY)
                if not done:
                    observation, done = step(KEY_A)
                    continue
            break
        return observation, done

    # ------------------------------------------------------------------ rewards
    def _success(self, observation, message: bytes) -> bool:
        if self.goal == "staircase":
            blstats = observation[self._blstats_index]
            return DESCEND_MESSAGE[:-1] in message and int(blstats[BL.NLE_BL_DLEVEL]) == self.target_level
        if self.goal == "oracle":
            blstats = observation[self._blstats_index]
            x, y = int(blstats[BL.NLE_BL_X]), int(blstats[BL.NLE_BL_Y])
            glyphs = observation[self._glyph_index]
            window = glyphs[max(y - 1, 0) : y + 2, max(x - 1, 0) : x + 2]
            found = bool((window == self._oracle).any())
            if found and self.sober:
                found = int(blstats[BL.NLE_BL_CONDITION]) != CONDITION_HALLUCINATING
            return found
        return False

    def _reward(self, blstats, in_game: bool, success: bool) -> float:
        if self._goal_code == GOAL_SCORE:
            return score_reward(self._prev_blstats, blstats, in_game)
        if success and not self._paid_success:
            if self.continual:
                self._paid_success = True
            return SUCCESS_REWARD
        return 0.0

    # ------------------------------------------------------------------ statistics
    def _update_scout(self, observation):
        blstats = observation[self._blstats_index]
        level = (int(blstats[BL.NLE_BL_DNUM]), int(blstats[BL.NLE_BL_DLEVEL]))
        glyphs = observation[self._glyph_index]
        seen = int(np.count_nonzero(glyphs != nethack.GLYPH_CMAP_OFF))
        self._scout_total += seen - self._scout.get(level, 0)
        self._scout[level] = seen
        self._level = level
        self._scout_tick = 0

    def step_notes(self) -> "StepNotes":
        """What a batched env reads from the game after each step (one call instead of reaching
        into this class's bookkeeping)."""
        return StepNotes(self._prev_message, self._scout_total, self._kills, self._in_game,
                         self._last_game_blstats)

    def _episode_info(self) -> dict:
        bl = self._last_game_blstats
        return {
            "dlvl": int(bl[BL.NLE_BL_DEPTH]),
            "gold": int(bl[BL.NLE_BL_GOLD]),
            "xlvl": int(bl[BL.NLE_BL_XP]),
            "scout": int(self._scout_total),
            "kills": int(self._kills),
        }


class StepNotes(NamedTuple):
    """A game's bookkeeping after a step (:meth:`ONITask.step_notes`)."""

    message: bytes  # the current message, NUL-stripped
    scout: int  # map tiles seen this episode, over all levels
    kills: int  # "You kill ..." messages this episode
    in_game: bool  # False once NetHack has ended the game (death, quit)
    game_blstats: np.ndarray  # the last blstats while in game (NetHack zeroes them at the end)


def score_reward(prev_blstats, blstats, in_game: bool) -> float:
    """Score task reward: in-game score delta, -0.01 on steps where the game clock stood still.

    Example:
        >>> import numpy as np
        >>> a = np.zeros(27, dtype=np.int64); b = a.copy(); b[9] = 20; b[20] = 1
        >>> score_reward(a, b, True), score_reward(a, a, True), score_reward(a, b, False)
        (20.0, -0.01, 0.0)
    """
    delta = float(blstats[BL.NLE_BL_SCORE] - prev_blstats[BL.NLE_BL_SCORE]) if in_game else 0.0
    if int(blstats[BL.NLE_BL_TIME]) == int(prev_blstats[BL.NLE_BL_TIME]):
        delta += TIME_PENALTY
    return delta


def make_task(name: str = "score", **kwargs) -> ONITask:
    """Builds a task env by alias or full id; keyword arguments go to :class:`ONITask`."""
    spec = dict(TASKS[resolve_task(name)])
    spec.update(kwargs)
    return ONITask(**spec)
