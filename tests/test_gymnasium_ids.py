"""Every task id is a gymnasium id after ``import torchrl_oni``, and passes gymnasium's checker."""
import subprocess
import sys
import warnings

import gymnasium
import pytest
from gymnasium.utils.env_checker import check_env

import torchrl_oni  # noqa: F401  (registers the ids)
from torchrl_oni.task_ids import TASKS


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
            check_env(env.unwrapped, skip_render_check=True)
        assert [str(w.message) for w in caught if "seed" in str(w.message)] == []
        obs, _ = env.reset(seed=3)
        assert env.unwrapped.extended_actions == TASKS[task_id]["extended_actions"]
        assert env.action_space.n == (28 if TASKS[task_id]["extended_actions"] else 23)
        assert "message" in obs
    finally:
        env.close()
