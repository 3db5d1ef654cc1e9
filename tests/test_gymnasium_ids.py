"""Every task id is a gymnasium id after ``import torchrl_oni``, passes gymnasium's checker (render
check included) and renders in every mode NLE declares, as NLE's own ids do."""
import re
import subprocess
import sys
import warnings

import gymnasium
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import torchrl_oni  # noqa: F401  (registers the ids)
from torchrl_oni.task_ids import TASKS

RENDER_MODES = ("human", "ansi", "full", "pixel")  # NLE's metadata["render_modes"]
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


def test_import_torchrl_oni_registers_every_id_without_loading_nethack():
    out = subprocess.run([sys.executable, "-c", "import sys, gymnasium, torchrl_oni; "
                          "print(all(t in gymnasium.registry for t in torchrl_oni.task_ids.TASKS), "
                          "'nle' in sys.modules, 'torchrl' in sys.modules)"],
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["True", "False", "False"], out.stderr[-1000:]


@pytest.mark.parametrize("task_id", sorted(TASKS))
def test_gymnasium_make_and_check_env(task_id):
    env = gymnasium.make(task_id)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            check_env(env.unwrapped)  # renders a new env in every declared mode too
        assert [str(w.message) for w in caught] == []  # seeding and rendering included
        obs, _ = env.reset(seed=3)
        assert env.unwrapped.extended_actions == TASKS[task_id]["extended_actions"]
        assert env.action_space.n == (28 if TASKS[task_id]["extended_actions"] else 23)
        assert "message" in obs
    finally:
        env.close()


def _render(env, capsys):
    """``(what render() returned, what it printed with the colour codes taken out)``."""
    capsys.readouterr()
    returned = env.render()
    return returned, ANSI_ESCAPE.sub("", capsys.readouterr().out)


def _hero(env):
    from nle import nethack

    blstats = env.unwrapped.last_observation[env.unwrapped._blstats_index]
    return int(blstats[nethack.NLE_BL_X]), int(blstats[nethack.NLE_BL_Y])


def test_nle_declares_the_modes_tested_here():
    from nle.env.base import NLE

    assert tuple(NLE.metadata["render_modes"]) == RENDER_MODES
    assert gymnasium.make("NetHackScore-v1").unwrapped.metadata["render_modes"] == list(RENDER_MODES)


@pytest.mark.parametrize("mode", RENDER_MODES)
@pytest.mark.parametrize("task_id", sorted(TASKS))
def test_every_id_renders_the_game_in_every_mode(task_id, mode, capsys):
    plain = gymnasium.make(task_id)
    env = gymnasium.make(task_id, render_mode=mode)
    try:
        assert env.unwrapped.render_mode == mode
        # rendering keeps its screens beside the observation, never in it
        assert env.observation_space == plain.observation_space
        obs, _ = env.reset(seed=3)
        assert sorted(obs) == sorted(plain.observation_space.spaces)
        for action in (1, 2, 3):  # the screen of a fresh game, then after N and after E
            x, y = _hero(env)
            returned, printed = _render(env, capsys)
            if mode == "ansi":
                rows = returned.split("\n")
                assert len(rows) == 21 and {len(r) for r in rows} == {79}
                assert rows[y][x] == "@"
                assert printed == ""
            elif mode == "pixel":
                assert returned.dtype == np.uint8 and returned.shape == (21 * 16, 79 * 16, 3)
                assert returned.any()
            elif mode == "human":
                assert returned is None
                rows = printed.split("\n")[1:25]  # the terminal, 24 x 80
                assert {len(r) for r in rows} == {80}
                assert rows[1 + y][x] == "@"
                assert re.search(r"Dlvl:\d+ \$:\d+ HP:\d+\(\d+\) Pw:\d+\(\d+\) AC:-?\d+ Xp:\d+/\d+ T:\d+", rows[23])
                assert "Agent the " in rows[22] and "St:" in rows[22]
            else:  # full: message, inventory, map
                assert returned is None
                assert "a an uncursed +2 pair of leather gloves (being worn)" in printed
                map_rows = printed.split("\n")[-22:-1]
                assert map_rows[y][x] == "@"
            env.step(action)
    finally:
        env.close()
        plain.close()


@pytest.mark.parametrize("mode", RENDER_MODES)
def test_render_is_nle_own_render_of_the_same_game(mode, capsys):
    from nle.env.tasks import NetHackScore

    from torchrl_oni.envs.tasks import _derive_seeds

    ours = gymnasium.make("NetHackScoreExtendedActions-v1", render_mode=mode)
    # NLE's own task on the game our reset(seed=5) starts (same seeds, moon phase and character)
    theirs = NetHackScore(render_mode="ansi" if mode == "full" else mode, fix_moon_phase=True)
    try:
        ours.reset(seed=5)
        theirs.nethack.set_initial_seeds(*_derive_seeds(5, 0), False, None)
        theirs.reset()
        ours_returned, ours_printed = _render(ours, capsys)
        theirs_returned, theirs_printed = _render(theirs, capsys)
        if mode == "pixel":
            assert np.array_equal(ours_returned, theirs_returned)
        elif mode == "full":
            # NLE's own "full" fails under numpy 2 (OverflowError in tty_render): its map is "ansi"
            assert ours_printed.split("\n")[-22:-1] == theirs_returned.split("\n")
        else:
            assert (ours_returned, ours_printed) == (theirs_returned, theirs_printed)
            assert "@" in (ours_returned or ours_printed)
    finally:
        ours.close()
        theirs.close()


def test_rendering_does_not_change_the_game_or_the_observations(capsys):
    envs = [gymnasium.make("NetHackScoreExtendedActions-v1", render_mode=m) for m in (None, "human", "full")]
    try:
        actions = np.random.default_rng(0).integers(0, 28, size=300)
        firsts = [env.reset(seed=11) for env in envs]
        assert all(sorted(obs) == sorted(firsts[0][0]) for obs, _ in firsts)
        for t, action in enumerate(actions):
            results = [env.step(int(action)) for env in envs]
            obs0, reward0, term0, trunc0, _ = results[0]
            for obs, reward, term, trunc, _ in results[1:]:
                assert obs.keys() == obs0.keys()
                assert all(np.array_equal(obs[k], obs0[k]) for k in obs0), t
                assert (reward, term, trunc) == (reward0, term0, trunc0), t
            if t % 50 == 0:
                for env in envs[1:]:
                    env.render()
            if term0 or trunc0:
                for env in envs:
                    env.reset()
        capsys.readouterr()
    finally:
        for env in envs:
            env.close()


def test_render_without_a_render_mode_warns_and_names_the_modes():
    env = gymnasium.make("NetHackScore-v1")
    try:
        env.reset(seed=0)
        with pytest.warns(UserWarning, match="render_mode.*'ansi'"):
            assert env.render() is None
        with pytest.raises(ValueError, match="unknown render_mode 'rgb_array'"):
            gymnasium.make("NetHackScore-v1", render_mode="rgb_array")
    finally:
        env.close()
