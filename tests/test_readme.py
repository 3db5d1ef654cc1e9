"""README's Python runs as written: every ```python block as a file (unless the line before it is
``<!-- not run: REASON -->``), and the scripts marked ``<!-- readme-script: NAME -->`` at full size."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
MARKED = re.compile(r"<!-- readme-script: ([\w-]+) -->\s*```python\n(.*?)```", re.S)


# The scripts run with one torch (OpenMP) thread, as the suite's own tests do (tests/conftest.py):
# with two pytest-xdist workers on 2 cores, a script's default of one thread per core spins against
# the other worker's, and the README's tiny policy then trains several times slower.
ONE_THREAD = dict(os.environ, OMP_NUM_THREADS="1")


def readme_scripts() -> dict:
    return dict(MARKED.findall(README.read_text()))


def test_the_torchrl_script_is_at_most_15_lines():
    script = readme_scripts()["torchrl-ppo"]
    lines = [line for line in script.splitlines() if line.strip()]
    assert len(lines) <= 15, f"{len(lines)} lines"
    # what the issue asks of it: TorchRL's own collector, loss and GAE on GymEnv("NetHackScore-v0")
    for piece in ("Collector(", "ClipPPOLoss(", "value_estimator", 'GymEnv("NetHackScore-v0"', "oni_transforms("):
        assert piece in script


@pytest.fixture(scope="module")
def readme_script_runs(tmp_path_factory):
    """``run(name)``: the README's script marked ``<!-- readme-script: NAME -->`` run as a file at
    full size (its CompletedProcess), once for the module: the script's own test reads its output
    and the test of its ```python block its exit (one run of a script that takes minutes, not two)."""
    done = {}

    def run(name):
        if name not in done:
            folder = tmp_path_factory.mktemp(f"readme-{name}")
            script = folder / f"readme_{name.replace('-', '_')}.py"
            script.write_text(readme_scripts()[name])
            done[name] = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600,
                                        cwd=folder, env=ONE_THREAD)
        return done[name]

    return run


@pytest.mark.slow
def test_the_torchrl_script_trains_ppo_with_oni(readme_script_runs):
    out = readme_script_runs("torchrl-ppo")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    labelled, helpful = map(int, re.search(r"(\d+) captions labelled, (\d+) of them helpful", out.stdout).groups())
    assert labelled >= 10  # a policy that acts sees tens of distinct captions in 2,048 frames
    assert helpful <= labelled


# ----------------------------------------------------------------------------- every python block
# Every ```python block of README.md runs as a file, the way a reader runs it (`python snippet.py`),
# unless the line before it says why not: `<!-- not run: REASON -->`. A snippet that starts worker
# processes must show its `if __name__ == "__main__":` guard, or it fails here as it fails for them.
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
NOT_RUN = re.compile(r"<!-- not run: (.*?) -->")
# The README's sizes take minutes; the test runs each snippet as written but for these replacements.
# Each `old` must be in its snippet, so a changed README fails here rather than running at full size.
# A script marked ``<!-- readme-script: NAME -->`` runs at full size, once (``readme_script_runs``).
SMALLER = {
    "Trainer.from_config(cfg": [("frames=200_000", "frames=256, workers=1, envs_per_worker=2, rollout=16")],
    "NLEBatchEnv(\"score\", num_envs=16": [("num_envs=16", "num_envs=2"), ("rollout(200,", "rollout(20,")],
}


def python_blocks() -> list:
    """``(line, the line before the fence, source)`` of every ```python block of README.md."""
    text = README.read_text()
    blocks = []
    for match in FENCE.finditer(text):
        before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        blocks.append((text.count("\n", 0, match.start()) + 1, before, match.group(1)))
    return blocks


def _smaller(source: str) -> str:
    for key, replacements in SMALLER.items():
        if key in source:
            for old, new in replacements:
                assert old in source, f"README changed: {old!r} is no longer in the snippet with {key!r}"
                source = source.replace(old, new)
    return source


def test_every_python_block_is_run_or_says_why_not():
    blocks = python_blocks()
    assert len(blocks) >= 3
    for line, before, _ in blocks:
        reason = NOT_RUN.search(before)
        assert reason is None or reason.group(1).strip(), f"README.md:{line}: `<!-- not run: -->` without a reason"
    assert all(any(key in source for _, _, source in blocks) for key in SMALLER), "a SMALLER entry matches no snippet"


# what starts worker processes (multiprocessing's spawn imports the running script again in each)
STARTS_PROCESSES = ("Trainer.from_config(", "Trainer(", "ParallelEnv(", "MultiSyncCollector(", "MultiAsyncCollector(", "MultiaSyncCollector(",
                    "MultiSyncDataCollector(", "MultiaSyncDataCollector(")


def test_snippets_that_start_worker_processes_show_the_main_guard():
    # the fast half of the check below: saved as a file, such a snippet stops with MainGuardError
    from torchrl_oni.spawn_check import has_main_guard

    for line, before, source in python_blocks():
        if not NOT_RUN.search(before) and any(call in source for call in STARTS_PROCESSES):
            assert has_main_guard(source), f"README.md:{line}: starts worker processes without `if __name__ == \"__main__\":`"


# Each snippet is a subprocess that imports torch, torchrl and NLE (some also start a worker
# process): 10 to 40 s apiece on a 2-core machine, hence slow.
@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(python_blocks())), ids=[f"line{line}" for line, _, _ in python_blocks()])
def test_each_python_block_runs_as_a_file(index, tmp_path, readme_script_runs):
    line, before, source = python_blocks()[index]
    if NOT_RUN.search(before):
        pytest.skip(f"README.md:{line}: {before.strip()}")
    marked = MARKED.match(before + "\n```python\n" + source + "```")
    if marked:  # a marked script: its full-size run as a file, shared with its own test above
        assert readme_scripts()[marked.group(1)] == source
        out = readme_script_runs(marked.group(1))
    else:
        script = tmp_path / f"readme_block_{line}.py"
        script.write_text(_smaller(source))
        out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                             cwd=tmp_path, env=ONE_THREAD)
    assert out.returncode == 0, f"README.md:{line} exited {out.returncode}:\n{out.stderr[-3000:]}"
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
