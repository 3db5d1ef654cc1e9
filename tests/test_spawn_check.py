"""A script without a ``__main__`` guard gets one clear error instead of a hung collector start."""
import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

from torchrl_oni.spawn_check import MainGuardError, check_main_guard, has_main_guard

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = """
import tempfile
from torchrl_oni.train import TrainConfig, Trainer

def run():
    cfg = TrainConfig(frames=256, workers=1, envs_per_worker=2, rollout=16, logdir=tempfile.mkdtemp(),
                      progress=False, tensorboard=False)
    print("frames", Trainer.from_config(cfg).train()["frames"])
"""


def _run(tmp_path, body):
    script = tmp_path / "train_me.py"
    script.write_text(textwrap.dedent(SCRIPT) + textwrap.dedent(body))
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240,
                          cwd=tmp_path, env=env)


def test_an_unguarded_script_fails_at_once_naming_the_fix(tmp_path):
    done = _run(tmp_path, "run()\n")  # before the check: hung in TorchRL's collector start
    assert done.returncode != 0
    assert "has no `if __name__ == \"__main__\":` guard" in done.stderr
    assert "frames" not in done.stdout


def test_a_guarded_script_trains(tmp_path):
    done = _run(tmp_path, 'if __name__ == "__main__":\n    run()\n')
    assert done.returncode == 0, done.stderr[-2000:]
    assert "frames 256" in done.stdout


def test_an_unguarded_script_that_forks_its_workers_trains(tmp_path):
    # "fork" re-imports nothing: the check follows the start method TorchRL will use, the one the
    # script set (tutorials run as plain scripts do so), and refuses only under spawn
    # (force: importing torchrl already set TorchRL's default, spawn)
    done = _run(tmp_path, 'import multiprocessing\nmultiprocessing.set_start_method("fork", force=True)\nrun()\n')
    assert done.returncode == 0, done.stderr[-2000:]
    assert "frames 256" in done.stdout


@pytest.mark.parametrize("source, guarded", [
    ('if "__main__" == __name__:\n    main()\n', True),
    ('if __name__ != "__main__":\n    main()\n', False),
    ('def f():\n    if __name__ == "__main__":\n        main()\n', False),  # not at top level
    ("main()\n", False),
])
def test_guard_detection(source, guarded):
    assert has_main_guard(source) is guarded


def test_the_check_reads_the_running_main_script(tmp_path, monkeypatch):
    script = tmp_path / "s.py"
    script.write_text("print(1)\n")
    # raising=False: under pytest-xdist the worker's __main__ has no __file__ (undo removes it again)
    monkeypatch.setattr(sys.modules["__main__"], "__file__", str(script), raising=False)
    monkeypatch.setattr(sys.modules["__main__"], "__spec__", None)  # run as `python s.py`
    with pytest.raises(MainGuardError, match="s.py has no"):
        check_main_guard("spawn")
    script.write_text("print(1)\n")  # `python -m package` runs package/__main__.py, never re-run by spawn
    monkeypatch.setattr(sys.modules["__main__"], "__spec__", importlib.util.spec_from_file_location("pkg.__main__", script))
    check_main_guard("spawn")
    check_main_guard("fork")  # fork re-imports nothing
    script.write_text('if __name__ == "__main__":\n    print(1)\n')
    check_main_guard("spawn")
