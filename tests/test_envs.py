"""The ONI tasks on NLE 1.3 and the batched TorchRL env: rewards, ends, seeding, keys, specs."""
import subprocess
import sys

import numpy as np
import pytest
import torch
from nle import nethack
from torchrl.envs import SerialEnv, TransformedEnv, ParallelEnv
from torchrl.envs.transforms import RewardSum
from torchrl.envs.utils import check_env_specs

from torchrl_oni.captions import caption_hash, encode_message, message_bytes
from torchrl_oni.envs import NLEBatchEnv, TASKS, make_task, resolve_task
from torchrl_oni.envs.tasks import SUCCESS_REWARD, score_reward

SEARCH = 22  # index of 's' in both action sets: never ends a game by itself


# ---------------------------------------------------------------------------- task table
def test_every_task_builds_with_the_right_action_count():
    for name, spec in TASKS.items():
        env = make_task(name)
        assert env.action_space.n == (28 if spec["extended_actions"] else 23), name
        env.close()


def test_aliases_and_unknown_task():
    assert resolve_task("score") == "NetHackScoreExtendedActions-v1"
    assert resolve_task("Staircase_Lvl4") == "NetHackStaircaseLvl4ExtendedActions-v1"
    assert resolve_task("nethackoracle-v1") == "NetHackOracle-v1"
    with pytest.raises(ValueError, match="unknown task"):
        resolve_task("minecraft")


# ---------------------------------------------------------------------------- rewards
def _blstats(**values):
    bl = np.zeros(27, dtype=np.int64)
    for k, v in values.items():
        bl[getattr(nethack, "NLE_BL_" + k.upper())] = v
    return bl


def test_score_reward_is_score_delta_with_frozen_clock_penalty():
    before = _blstats(score=10, time=5)
    assert score_reward(before, _blstats(score=30, time=6), True) == 20.0
    assert score_reward(before, _blstats(score=30, time=5), True) == pytest.approx(19.99)
    assert score_reward(before, _blstats(score=10, time=5), True) == pytest.approx(-0.01)
    assert score_reward(before, _blstats(score=0, time=7), False) == 0.0  # game over: no delta


def _fake_obs(env, blstats, glyphs=None):
    obs = [None] * len(env._observation_keys)
    obs[env._blstats_index] = blstats
    obs[env._glyph_index] = glyphs if glyphs is not None else np.zeros((21, 79), np.int16)
    return obs


@pytest.mark.parametrize("name,level", [("staircase-lvl3", 3), ("staircase-lvl4", 4), ("NetHackStaircase-v1", 2)])
def test_staircase_success_needs_descend_message_and_level(name, level):
    env = make_task(name)
    on_level = _fake_obs(env, _blstats(dlevel=level))
    below = _fake_obs(env, _blstats(dlevel=level - 1))
    assert env._success(on_level, b"You descend the stairs.")
    assert not env._success(below, b"You descend the stairs.")
    assert not env._success(on_level, b"You fall through a trap door!")  # trapdoors do not count
    assert env._reward(on_level[env._blstats_index], True, True) == SUCCESS_REWARD
    assert env._reward(on_level[env._blstats_index], True, False) == 0.0
    env.close()


def test_oracle_success_window_and_sober_variant():
    env = make_task("oracle")
    sober = make_task("oracle-sober")
    glyphs = np.zeros((21, 79), np.int16)
    glyphs[10, 41] = env._oracle  # diagonal neighbour of (x=40, y=9)
    near = _blstats(x=40, y=9)
    far = _blstats(x=10, y=3)
    assert env._success(_fake_obs(env, near, glyphs), b"")
    assert not env._success(_fake_obs(env, far, glyphs), b"")
    hallucinating = _blstats(x=40, y=9, condition=512)
    assert env._success(_fake_obs(env, hallucinating, glyphs), b"")
    assert not sober._success(_fake_obs(sober, hallucinating, glyphs), b"")
    assert sober._success(_fake_obs(sober, near, glyphs), b"")
    env.close()
    sober.close()


def test_continual_pays_once_and_does_not_end():
    env = make_task("NetHackStaircaseLvl3Continual-v1")
    bl = _blstats(dlevel=3)
    assert env._reward(bl, True, True) == SUCCESS_REWARD
    assert env._reward(bl, True, True) == 0.0
    env.close()


# ---------------------------------------------------------------------------- step logic
def test_food_prompt_nw_key_takes_first_item_other_keys_cancel():
    env = make_task("score")
    nw = env.actions.index(ord("y"))
    prompt = b"What do you want to eat? [fg or ?*]"
    assert env._key_for(nw, prompt) == ord("f")
    assert env._key_for(SEARCH, prompt) == ord(" ")
    assert env._key_for(SEARCH, b"You see here a newt corpse.") == ord("s")
    drink = b"What do you want to drink? [h or ?*]"
    assert env._key_for(nw, drink) == ord("h")
    motif = make_task("NetHackScore-v1")
    assert motif._key_for(nw, drink) == ord("y")  # Motif's step knows only the eat prompt
    env.close()
    motif.close()


class _ScriptedNetHack:
    """Plays back canned observations to drive ``_known_steps`` without a real game."""

    def __init__(self, env, frames):
        self.env, self.frames, self.keys = env, list(frames), []

    def step(self, key):
        self.keys.append(key)
        return self.frames.pop(0), False


def _frame(env, message, more=False, yn=False, getlin=False):
    obs = [np.zeros(1)] * len(env._observation_keys)
    obs = list(obs)
    obs[env._message_index] = encode_message(message)
    internal = np.zeros(9, np.int32)
    internal[1], internal[2], internal[3] = yn, getlin, more
    obs[env._internal_index] = internal
    return obs


def test_more_prompts_are_dismissed_and_descend_message_is_kept():
    env = make_task("staircase-lvl3")
    real = env.nethack
    try:
        first = _frame(env, "You descend the stairs.--More--", more=True)
        after = _frame(env, "You see here a scroll.")
        env.nethack = _ScriptedNetHack(env, [after])
        obs, done = env._known_steps(first, False, ord(">"))
        assert env.nethack.keys == [ord(" ")]
        assert b"You descend the stairs." in message_bytes(obs[env._message_index])
        # an ordinary --More-- is dismissed and its text is not kept
        other = _frame(env, "The newt bites!--More--", more=True)
        env.nethack = _ScriptedNetHack(env, [_frame(env, "You hit the newt.")])
        obs, _ = env._known_steps(other, False, ord("h"))
        assert message_bytes(obs[env._message_index]) == b"You hit the newt."
    finally:
        env.nethack = real
        env.close()


def test_a_step_answers_the_prompt_it_meets_and_only_then():
    """step_core hands a frame to _known_steps only when it shows a prompt (or the env has the
    extended actions): the --More-- is dismissed within the agent's step, a plain frame is not
    touched, and a game that ended leaves its last prompt alone."""

    class Scripted(_ScriptedNetHack):
        """Both faces of NLE's ``Nethack``: its ``step`` (what ``_known_steps`` calls) and the
        compiled game behind it, ``_pynethack``, with the buffers ``_obs`` (what ``step_core``
        calls)."""

        def __init__(self, env, frames):
            super().__init__(env, frames)
            self._pynethack, self._obs, self._done = self, None, False

        def step(self, key):
            self.keys.append(key)
            self._obs, self._done = self.frames.pop(0)
            return self._obs, self._done

        def done(self):
            return self._done

        def in_normal_game(self):
            return True

    env = make_task("score")
    env.reset(seed=0)
    real = env.nethack

    def frame(message, **prompt):
        obs = [np.array(a, copy=True) for a in env.last_observation]
        obs[env._message_index][:] = encode_message(message)
        internal = obs[env._internal_index]
        internal[1], internal[2], internal[3] = prompt.get("yn", 0), prompt.get("getlin", 0), prompt.get("more", 0)
        return obs

    west = env._action_keys.index(ord("h"))
    try:
        env.nethack = Scripted(env, [(frame("The newt bites!--More--", more=1), False),
                                     (frame("You hit the newt."), False)])
        env.step_core(west)
        assert env.nethack.keys == [ord("h"), ord(" ")] and env._prev_message == b"You hit the newt."
        env.nethack = Scripted(env, [(frame("You see here a scroll."), False)])
        env.step_core(west)
        assert env.nethack.keys == [ord("h")] and env._prev_message == b"You see here a scroll."
        env.nethack = Scripted(env, [(frame("You feel more confident in your weapon skills."), False),
                                     (frame(""), False), (frame(""), False)])
        env.step_core(west)
        assert env.nethack.keys == [ord("h"), nethack.Command.ENHANCE, ord("a")]
        env.nethack = Scripted(env, [(frame("You cast."), False), (frame("In what direction?"), False)])
        env.step_core(env._action_keys.index(nethack.Command.CAST))
        assert env.nethack.keys == [nethack.Command.CAST, ord("a")]
        env.nethack = Scripted(env, [(frame("You die...--More--", more=1), True)])
        assert env.step_core(west)[1], "the game ended: terminated"
        assert env.nethack.keys == [ord("h")]
    finally:
        env.nethack = real
        env.close()


def test_yes_no_questions_escaped_unless_the_agent_must_answer():
    env = make_task("score")
    real = env.nethack
    try:
        question = _frame(env, "Really attack the shopkeeper? [yn] (n)", yn=True)
        env.nethack = _ScriptedNetHack(env, [])
        env._known_steps(question, False, ord("h"))
        assert env.nethack.keys == []  # left for the agent
        other = _frame(env, "Do you want your possessions identified? [ynq]", yn=True)
        env.nethack = _ScriptedNetHack(env, [_frame(env, "")])
        env._known_steps(other, False, ord("h"))
        assert env.nethack.keys == [27]  # ESC
        text = _frame(env, "Call it:", getlin=True)
        env.nethack = _ScriptedNetHack(env, [_frame(env, "")])
        env._known_steps(text, False, ord("h"))
        assert env.nethack.keys == [27]
        enhance = _frame(env, "You feel more confident in your weapon skills.")
        env.nethack = _ScriptedNetHack(env, [_frame(env, ""), _frame(env, "")])
        env._known_steps(enhance, False, ord("h"))
        assert env.nethack.keys == [nethack.Command.ENHANCE, ord("a")]
        cast = _frame(env, "")
        env.nethack = _ScriptedNetHack(env, [_frame(env, "In what direction?", yn=True)])
        env._known_steps(cast, False, nethack.Command.CAST)
        assert env.nethack.keys == [ord("a")]  # first spell, then the agent picks a direction
    finally:
        env.nethack = real
        env.close()


# ---------------------------------------------------------------------------- time limits
@pytest.mark.parametrize("as_termination", [False, True])
def test_time_limit_is_truncation_unless_asked(as_termination):
    env = make_task("score", max_episode_steps=6, timeout_as_termination=as_termination)
    env.reset(seed=1)
    for t in range(6):
        _, _, terminated, truncated, info = env.step(SEARCH)
        if terminated or truncated:
            break
    assert t == 5, "the game ended before the limit"
    assert (terminated, truncated) == ((True, False) if as_termination else (False, True))
    assert info["end_status"] == env.StepStatus.ABORTED
    env.close()


# ---------------------------------------------------------------------------- seeding
def _trajectory(env, actions):
    obs, _ = env.reset(seed=123)
    out = [(obs["message"].tobytes(), obs["blstats"].tobytes())]
    for a in actions:
        obs, r, term, trunc, _ = env.step(a)
        out.append((obs["message"].tobytes(), obs["blstats"].tobytes(), r, term, trunc))
        if term or trunc:
            obs, _ = env.reset()
            out.append((obs["message"].tobytes(), obs["blstats"].tobytes()))
    return out


def test_same_seed_same_actions_same_trajectory_across_episodes():
    actions = np.random.default_rng(0).integers(0, 28, size=400).tolist()
    a = make_task("score", max_episode_steps=150)
    b = make_task("score", max_episode_steps=150)
    ta, tb = _trajectory(a, actions), _trajectory(b, actions)
    assert ta == tb
    assert len(ta) > 400  # at least one reset happened inside
    c = make_task("score", max_episode_steps=150)
    c.reset(seed=124)
    first_c = c.last_observation[c._blstats_index].tobytes()
    assert (ta[0][1] != first_c) or (ta[1] != _trajectory(c, actions)[1])
    for e in (a, b, c):
        e.close()


def test_batched_env_is_reproducible_with_a_seed():
    def roll():
        env = NLEBatchEnv("score", num_envs=3, seed=7, task_kwargs={"max_episode_steps": 40})
        torch.manual_seed(0)
        td = env.rollout(90, break_when_any_done=False)
        env.close()
        return td

    a, b = roll(), roll()
    assert torch.equal(a["blstats"], b["blstats"])
    assert torch.equal(a["message"], b["message"])
    assert torch.equal(a["next", "reward"], b["next", "reward"])
    assert not torch.equal(a["blstats"][0], a["blstats"][1])  # games differ from each other


# ---------------------------------------------------------------------------- keys
def test_stored_observations_do_not_alias():
    env = NLEBatchEnv("score", num_envs=2, seed=0)
    # actions from a generator of the test's own, not the global RNG: the observations must change
    # over the 30 steps (asserted below), and from whatever global state the tests run before this
    # one left, some action streams get stuck at a prompt for most of them
    actions = torch.Generator().manual_seed(0)
    td = env.reset()
    stored, snapshots = [], []
    for _ in range(30):
        td["action"] = torch.randint(env.action_spec.space.n, env.action_spec.shape, generator=actions)
        step_td, td = env.step_and_maybe_reset(td)
        stored.append(step_td)
        snapshots.append(step_td.clone())
    for kept, copy in zip(stored, snapshots):
        for key in ("message", "blstats", "crop", ("next", "message"), ("next", "blstats")):
            assert torch.equal(kept[key], copy[key]), key
    # and the observations really changed over time (otherwise aliasing would go unseen)
    assert len({bytes(s["blstats"][0].numpy()) for s in stored}) > 5
    env.close()


def test_msg_count_counts_exact_messages_per_episode_including_reset():
    env = NLEBatchEnv("score", num_envs=2, seed=3, task_kwargs={"max_episode_steps": 25})
    td = env.rollout(80, break_when_any_done=False)
    env.close()
    for i in range(2):
        counts = {}
        hashes = td["caption_hash"][i].tolist()
        got = td["msg_count"][i].tolist()
        done = td["next", "done"][i].flatten().tolist()
        for t, h in enumerate(hashes):
            counts[h] = counts.get(h, 0) + 1
            assert got[t] == counts[h], (i, t)
            if done[t]:
                counts = {}
        assert max(got) > 1


def test_caption_hash_matches_message_and_is_stable_across_processes():
    env = NLEBatchEnv("score", num_envs=2, seed=0)
    td = env.rollout(20, break_when_any_done=False)
    env.close()
    msgs = td["message"].reshape(-1, 256)
    hashes = td["caption_hash"].reshape(-1)
    for m, h in zip(msgs, hashes):
        assert caption_hash(m.numpy()) == int(h)
    texts = [b"You kill the newt!", b"", "Ça va".encode("latin-1"), bytes(range(1, 256))]
    local = [caption_hash(t) for t in texts]
    code = (
        "import sys; from torchrl_oni.captions import caption_hash;"
        "texts=[b'You kill the newt!', b'', 'Ça va'.encode('latin-1'), bytes(range(1,256))];"
        "print(','.join(str(caption_hash(t)) for t in texts))"
    )
    for salt in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={"PYTHONHASHSEED": salt, "PATH": ""})
        assert [int(x) for x in out.stdout.strip().split(",")] == local


def test_episode_statistics_are_final_at_done():
    env = NLEBatchEnv("score", num_envs=2, seed=1, task_kwargs={"max_episode_steps": 12})
    from tensordict.nn import TensorDictModule

    search = TensorDictModule(lambda h: torch.full_like(h, SEARCH), in_keys=["caption_hash"], out_keys=["action"])
    td = env.rollout(30, search, break_when_any_done=False)
    env.close()
    done = td["next", "done"].squeeze(-1)
    assert done.any()
    ep = td["next", "episode"][done]
    reward_sums = []
    for i in range(2):
        r = td["next", "reward"][i].squeeze(-1)
        d = done[i]
        ends = d.nonzero().flatten().tolist()
        start = 0
        for e in ends:
            reward_sums.append(float(r[start : e + 1].sum()))
            start = e + 1
    assert torch.allclose(ep["return"], torch.tensor(reward_sums), atol=1e-4)
    assert (ep["length"] == 12).all()
    assert (ep["end_status"] == -1).all()  # time-out
    assert (td["next", "truncated"][done]).all() and not td["next", "terminated"][done].any()
    assert (ep["dlvl"] >= 1).all() and (ep["xlvl"] >= 1).all()


# ---------------------------------------------------------------------------- specs
def test_check_env_specs_batched_and_transformed():
    env = NLEBatchEnv("oracle", num_envs=3, seed=0)
    check_env_specs(env)
    tenv = TransformedEnv(NLEBatchEnv("score", num_envs=2, seed=0), RewardSum())
    check_env_specs(tenv)
    env.close()
    tenv.close()


def _make_gym():
    from torchrl_oni.envs.gym_wrapper import make_gym_env

    return make_gym_env("score", max_episode_steps=20)


def test_check_env_specs_gym_wrapper_serial_and_parallel():
    serial = SerialEnv(2, _make_gym)
    check_env_specs(serial)
    serial.close()
    parallel = ParallelEnv(2, _make_gym, mp_start_method="spawn")
    check_env_specs(parallel)
    td = parallel.rollout(30, break_when_any_done=False)
    assert td["msg_count"].min() >= 1
    # copies, not views: consecutive stored messages of a game differ somewhere
    assert len({bytes(m.numpy()) for m in td["blstats"][0]}) > 1
    parallel.close()


def test_parallel_env_of_batched_envs():
    env = ParallelEnv(2, lambda: NLEBatchEnv("score", num_envs=2), mp_start_method="spawn")
    check_env_specs(env)
    td = env.rollout(5)
    assert td.batch_size == torch.Size([2, 2, 5])
    env.close()


def test_crop_is_centred_on_the_agent_and_blank_off_map():
    from torchrl_oni.envs.batched import OFF_MAP_GLYPH

    env = NLEBatchEnv("score", num_envs=2, seed=5, crop_size=9)
    td = env.rollout(40, break_when_any_done=False)
    env.close()
    crops, bl = td["crop"].reshape(-1, 9, 9), td["blstats"].reshape(-1, 27)
    centre = crops[:, 4, 4].long()
    is_monster = (centre >= nethack.GLYPH_MON_OFF) & (centre < nethack.GLYPH_PET_OFF)
    assert is_monster.float().mean() > 0.9  # the agent is drawn as its own monster glyph
    for crop, b in zip(crops, bl):
        x, y = int(b[0]), int(b[1])
        for r in range(9):
            for c in range(9):
                on_map = 0 <= y - 4 + r < 21 and 0 <= x - 4 + c < 79
                assert (int(crop[r, c]) < OFF_MAP_GLYPH) == on_map, (r, c, x, y)


# ---------------------------------------------------------------------------- the fast path
def _roll_pairs(env, steps, step_fn, seed=0):
    """(step output, next root) pairs, cloned at once, with a policy-like key in the root."""
    gen = torch.Generator().manual_seed(seed)
    td = env.reset()
    out = []
    for _ in range(steps):
        td["action"] = torch.randint(0, env.num_actions, (env.num_envs,), generator=gen)
        td["policy_output"] = torch.randn(env.num_envs, 3, generator=gen)
        stepped, td = step_fn(env, td)
        out.append((stepped.clone(), td.clone()))
    return out


def test_fast_step_matches_torchrl():
    """NLEBatchEnv's own step_and_maybe_reset gives what TorchRL's generic one gives, resets included."""
    from torchrl.envs import EnvBase

    def make():
        env = NLEBatchEnv("score", num_envs=3, seed=11, task_kwargs={"max_episode_steps": 40})
        for i, game in enumerate(env.games):  # games end at different steps: partial resets
            game._max_episode_steps = 13 + 7 * i
        return env

    fast_env, generic_env = make(), make()
    fast = _roll_pairs(fast_env, 60, lambda e, td: e.step_and_maybe_reset(td))
    generic = _roll_pairs(generic_env, 60, lambda e, td: EnvBase._step_and_maybe_reset(e, td))
    resets = 0
    for (a, a_next), (b, b_next) in zip(fast, generic):
        for x, y in ((a, b), (a_next, b_next)):
            assert set(x.keys(True, True)) == set(y.keys(True, True))
            for key in x.keys(True, True):
                assert x[key].dtype == y[key].dtype and torch.equal(x[key], y[key]), key
        resets += int(a["next", "done"].any())
    partial = sum(0 < int(a["next", "done"].sum()) < 3 for a, _ in fast)
    assert resets >= 5 and partial >= 3
    fast_env.close()
    generic_env.close()


def test_batched_env_shows_what_each_game_shows():
    """Messages, blstats and crops of the batched env equal those of single games, step by step."""
    K, steps, crop = 3, 70, 7
    env = NLEBatchEnv("score", num_envs=K, seed=4, crop_size=crop, task_kwargs={"max_episode_steps": 30})
    games = [make_task("score", max_episode_steps=30) for _ in range(K)]
    for i, g in enumerate(games):
        g.reset(seed=4 * 1_000_003 + i)
    actions = torch.from_numpy(np.random.default_rng(1).integers(0, 28, size=(steps, K)))
    td = env.reset()
    h = crop // 2
    for t in range(steps):
        td["action"] = actions[t]
        stepped, td = env.step_and_maybe_reset(td)
        for i, g in enumerate(games):
            _, reward, terminated, truncated, _ = g.step(int(actions[t, i]))
            obs = g.last_observation
            assert stepped["next", "message"][i].numpy().tobytes() == obs[g._message_index].tobytes()
            bl = obs[g._blstats_index]
            assert torch.equal(stepped["next", "blstats"][i], torch.from_numpy(bl))
            assert float(stepped["next", "reward"][i]) == pytest.approx(reward)
            x, y = int(bl[0]), int(bl[1])
            padded = np.pad(obs[g._glyph_index], h, constant_values=-1)
            expected = padded[y : y + crop, x : x + crop]
            got = stepped["next", "crop"][i].numpy()
            assert (got[expected >= 0] == expected[expected >= 0]).all()
            if terminated or truncated:
                g.reset()
    env.close()
    for g in games:
        g.close()


# ---------------------------------------------------------------------------- gymnasium / TorchRL contracts
@pytest.mark.parametrize("render_mode", [None, "human", "ansi", "full", "pixel"])
@pytest.mark.parametrize("name", list(TASKS))
def test_gymnasium_check_env_passes_on_every_task(name, render_mode):
    import warnings

    from gymnasium.utils.env_checker import check_env

    env = make_task(name, render_mode=render_mode)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. a render that returns the wrong type for its mode
        # NLE keeps gym's old seed() method beside reset(seed=...): check_env only warns about it
        warnings.filterwarnings("ignore", message=".*`seed` function is dropped.*")
        # make_task gives no gymnasium spec, so check_env renders only this env's own mode
        warnings.filterwarnings("ignore", message=".*Not able to test alternative render modes.*")
        check_env(env)
    env.close()


def test_reset_seed_seeds_np_random_and_sticky_actions_replay():
    from gymnasium.wrappers import StickyAction

    env = make_task("score")
    env.reset(seed=5)
    first = env.np_random.integers(1 << 30, size=4).tolist()
    env.reset(seed=5)
    assert env.np_random.integers(1 << 30, size=4).tolist() == first
    env.reset(seed=6)
    assert env.np_random.integers(1 << 30, size=4).tolist() != first
    env.reset()  # an unseeded reset continues the generator, it does not reseed it
    assert env.np_random.integers(1 << 30, size=4).tolist() != first
    env.close()

    def sticky_trajectory():
        game = StickyAction(make_task("score", max_episode_steps=60), repeat_action_probability=0.5)
        obs, _ = game.reset(seed=11)
        out = [obs["blstats"].tobytes()]
        for a in np.random.default_rng(0).integers(0, 28, size=80).tolist():
            obs, _, term, trunc, _ = game.step(a)
            out.append(obs["blstats"].tobytes() + obs["message"].tobytes())
            if term or trunc:
                obs, _ = game.reset()
                out.append(obs["blstats"].tobytes())
        game.close()
        return out

    # the sticky draws come from env.np_random: seeded by reset(seed=11), the runs are identical
    assert sticky_trajectory() == sticky_trajectory()


def test_reset_accepts_empty_options():
    env = make_task("score")
    obs_a, _ = env.reset(seed=2, options={})
    obs_b, _ = env.reset(seed=2)
    assert np.array_equal(obs_a["blstats"], obs_b["blstats"]) and np.array_equal(obs_a["message"], obs_b["message"])
    env.close()


def test_message_counter_refuses_offline_data_and_counts_in_the_env():
    from tensordict import TensorDict
    from torchrl.data import LazyTensorStorage, ReplayBuffer
    from torchrl.envs import Compose

    from torchrl_oni.envs.gym_wrapper import MessageCounter, make_gym_env
    from torchrl_oni.transforms import IntrinsicRewardTransform

    env = make_gym_env("score", seed=4, max_episode_steps=30)
    td = env.rollout(70, break_when_any_done=False)
    env.close()
    # in the env: the running count of each exact caption within its episode, reset included
    counts, hashes, done = {}, td["caption_hash"].flatten().tolist(), td["next", "done"].flatten().tolist()
    expected = []
    for h, d in zip(hashes, done):
        counts[h] = counts.get(h, 0) + 1
        expected.append(counts[h])
        if d:
            counts = {}
    assert td["msg_count"].flatten().tolist() == expected and max(expected) > 1
    # offline: raising beats writing the caption hash where the count belongs
    reward = Compose(MessageCounter(), IntrinsicRewardTransform(lambda m, h: torch.ones(len(m))))
    with pytest.raises(NotImplementedError, match="MessageCounter .* cannot be applied to a batch"):
        reward(td.clone())
    buffer = ReplayBuffer(storage=LazyTensorStorage(100), transform=MessageCounter())
    buffer.extend(td)
    with pytest.raises(NotImplementedError, match="replay-buffer sample"):
        buffer.sample(8)
    with pytest.raises(NotImplementedError):
        MessageCounter()(TensorDict({"caption_hash": torch.tensor([5])}, batch_size=[1]))
