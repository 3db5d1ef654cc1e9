"""README's Python scripts run as written: each block marked ``<!-- readme-script: NAME -->``."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
MARKED = re.compile(r"<!-- readme-script: ([\w-]+) -->\s*```python\n(.*?)```", re.S)


def readme_scripts() -> dict:
    return dict(MARKED.findall(README.read_text()))


def test_the_torchrl_script_is_at_most_15_lines():
    script = readme_scripts()["torchrl-ppo"]
    lines = [line for line in script.splitlines() if line.strip()]
    assert len(lines) <= 15, f"{len(lines)} lines"
    # what the issue asks of it: TorchRL's own collector, loss and GAE on GymEnv("NetHackScore-v0")
    for piece in ("Collector(", "ClipPPOLoss(", "value_estimator", 'GymEnv("NetHackScore-v0"', "oni_transforms("):
        assert piece in script


@pytest.mark.slow
def test_the_torchrl_script_trains_ppo_with_oni(tmp_path):
    script = tmp_path / "readme_ppo.py"
    script.write_text(readme_scripts()["torchrl-ppo"])
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    labelled, helpful = map(int, re.search(r"(\d+) captions labelled, (\d+) of them helpful", out.stdout).groups())
    assert labelled >= 10  # a policy that acts sees tens of distinct captions in 2,048 frames
    assert helpful <= labelled
