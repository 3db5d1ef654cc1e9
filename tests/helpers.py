"""Plain helpers shared by the test modules (fixtures live in ``conftest.py``).

Test modules import them as ``from helpers import ...``: ``tests/conftest.py`` puts this folder
on ``sys.path``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from torchrl_oni.annotators.scripted import ScriptedAnnotator
from torchrl_oni.captions import encode_messages, hash_messages

TIMEOUT = 20.0
"""Seconds a test waits for work in the background (a worker thread, a server) before failing."""

RULES = ScriptedAnnotator()
"""The scripted rules: what a well-behaved LLM (the fake server included) answers for a caption."""

TINY_RUN = {"frames": 1024, "workers": 1, "envs_per_worker": 4, "rollout": 32, "minibatch_size": 64}
"""The tests' one tiny training run: 1024 frames from one env worker of 4 games, PPO updates of 128
frames in minibatches of 64. :func:`tiny_config` (a TrainConfig) and ``TINY`` (oni-train's flags)
are this run; a test changes only the settings its check needs."""

TINY = [arg for key, value in TINY_RUN.items() for arg in (f"--{key.replace('_', '-')}", str(value))] + [
    "--no-progress", "--no-tensorboard", "--quiet"]
"""oni-train flags for the tiny run, quiet (add ``--logdir``)."""


def tiny_config(logdir, **settings):
    """The TrainConfig of the tiny run (``TINY_RUN``; no progress bar, no TensorBoard) into
    ``logdir``, ``settings`` changed: the run ``oni-train *TINY --logdir LOGDIR`` makes.

    >>> from torchrl_oni.train.cli import parse_command
    >>> tiny_config("run") == parse_command([*TINY, "--logdir", "run"])[0]
    True
    >>> cfg = tiny_config("run", frames=2048, workers=2)
    >>> cfg.frames, cfg.env.workers, cfg.env.envs_per_worker
    (2048, 2, 4)
    """
    from torchrl_oni.train import TrainConfig

    return TrainConfig(**{**TINY_RUN, "progress": False, "tensorboard": False, "logdir": str(logdir), **settings})


# ------------------------------------------------------------------------------------ waiting
def poll(predicate, timeout=TIMEOUT, every=0.02):
    """Call ``predicate`` until it is truthy (then True) or ``timeout`` seconds pass (then its last value).

    For ``assert poll(...)``: a time-out is the assertion's failure.

    >>> poll(lambda: 42, timeout=1.0)
    True
    >>> poll(lambda: 0, timeout=0.05, every=0.01)
    0
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(every)
    return predicate()


def wait_for(predicate, timeout=30.0, every=0.05, what="the condition"):
    """Call ``predicate`` until it is truthy and return that value; AssertionError after ``timeout`` s.

    >>> wait_for(lambda: "ready", timeout=1.0)
    'ready'
    """
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


# ------------------------------------------------------------------------------------ captions
def encoded(texts):
    """The encoded messages of ``texts`` and their caption hashes, as torch tensors.

    >>> msgs, hashes = encoded(["You kill the newt!", ""])
    >>> msgs.dtype, tuple(hashes.shape)
    (torch.uint8, (2,))
    """
    msgs = encode_messages(texts)
    return torch.from_numpy(msgs), torch.from_numpy(hash_messages(msgs))


# ------------------------------------------------------------------------------------ command lines
def run_cli(module, *args, env=None, timeout=60):
    """Run ``python -m module *args`` to the end; the CompletedProcess, with text output."""
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def one_error_line(proc, prog):
    """The one ``PROG: error: ...`` line of a command that exited with status 2; fails the test on
    another status, more error lines or a traceback."""
    assert proc.returncode == 2, proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if "error" in ln]
    assert len(errors) == 1 and errors[0].startswith(f"{prog}: error:"), proc.stderr
    assert "Traceback" not in proc.stderr
    return errors[0]


def main_in_process(main, args, capfd):
    """A command's ``main(args)`` run in this process, as its console script runs it, for the
    refusals it makes before any work (no Python process started to import torch for them): a
    ``CompletedProcess`` of its exit status and what reached stdout and stderr (``capfd``: the
    test's fixture), for :func:`one_error_line`. Its log lines reach stderr as the command writes
    them: its ``logging.basicConfig`` adds no handler where pytest's is in place, so this adds one
    of the command's format while it runs."""
    import logging

    capfd.readouterr()
    root = logging.getLogger()
    handler = None
    if root.handlers:
        handler = logging.StreamHandler(sys.stderr)  # sys.stderr: capfd's, while the test runs
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)
    try:
        code = main([str(a) for a in args])
    except SystemExit as stop:
        code = stop.code
    finally:
        if handler is not None:
            root.removeHandler(handler)
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(args, code, out, err)


# ------------------------------------------------------------------------------------ benchmarks
BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
"""The benchmark scripts' folder."""


def _reject_constant(name):
    raise ValueError(f"the JSON line holds {name}, which is not JSON")


def run_script(args, timeout=240, env=None):
    """Run ``python *args`` (a script and its flags) to the end; the CompletedProcess, with text
    output. ``env`` adds variables to this process's environment."""
    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          env=None if env is None else {**os.environ, **env})


def script_exit(script, args, capfd):
    """``main`` of a benchmark script (its file loaded as a module) run in this process on ``args``,
    as ``python SCRIPT ARGS`` runs it: its exit status and what reached this process's stderr
    (``capfd``: the test's fixture). For the refusals a script makes before any work, without a
    Python process started to import torch for them; ``sys.path`` and ``sys.argv`` are left as
    they were."""
    import importlib.util
    import inspect

    args = [str(a) for a in args]
    saved = sys.path[:], sys.argv
    try:
        spec = importlib.util.spec_from_file_location(f"_bench_{Path(script).stem}", script)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.argv = [str(script), *args]
        # a main() without parameters reads sys.argv
        main = module.main if inspect.signature(module.main).parameters else (lambda _: module.main())
        done = main_in_process(main, args, capfd)
    finally:
        sys.path[:], sys.argv = saved
    return done.returncode, done.stderr


def bench_json(args, timeout=240, env=None):
    """Run a benchmark script (``args``: its path and flags) to exit 0; its last line as strict
    JSON (NaN and Infinity refused: BENCHMARKS.md quotes these lines) and the whole stdout."""
    out = run_script(args, timeout, env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1], parse_constant=_reject_constant), out.stdout


# ------------------------------------------------------------------------------------ the browser
def press(driver, key):
    """Send ``key`` to the page the way a person types it (to the focused element)."""
    from selenium.webdriver.common.action_chains import ActionChains

    ActionChains(driver).send_keys(key).perform()


def page_ready(driver):
    """Whether the labelling page has loaded and is not waiting on the server."""
    return driver.execute_script("return document.body.dataset.ready === '1' && document.body.dataset.busy !== '1'")
