"""What a run folder holds: one name per file, for the trainer that writes them and for every
tool that reads them (``oni-eval``, ``oni-plot``, ``oni-replay``, ``--resume``, the benchmarks).

=======================  =======================  ==========================================================
name                     file                     written by, read by
=======================  =======================  ==========================================================
``CONFIG_NAME``          ``config.yaml``          the trainer (the resolved configuration); ``--resume``, oni-eval
``CHECKPOINT_NAME``      ``checkpoint.pt``        the trainer; ``--resume``, oni-eval
``METRICS_NAME``         ``metrics.csv``          the trainer's run log; oni-plot, the tutorials, benchmarks
``CAPTION_STORE_NAME``   ``captions.pt``          the intrinsic-reward hook (captions and labels); oni-eval
``TOP_MESSAGES_NAME``    ``top_messages.txt``     the intrinsic-reward hook (most seen captions, their labels)
``EVAL_NAME``            ``eval.json``            oni-eval; oni-plot, benchmarks, oni-label (flagged captions first)
``REWARD_HACKING_NAME``  ``reward_hacking.json``  the intrinsic-reward hook at the end of a run; oni-label
``REPLAY_DIR``           ``replays/``             ``oni-eval --record``; oni-replay
=======================  =======================  ==========================================================

A folder **holds a run** (:func:`holds_run`) when it has a ``checkpoint.pt`` or a non-empty
``metrics.csv``: what a second start would destroy. ``oni-train`` never writes into such a
folder unless told (``--resume`` continues it, ``--overwrite`` clears it with :func:`clear_run`);
without ``--logdir`` it claims a new folder per run (:func:`new_run_folder`), and ``--resume``
alone continues the newest one (:func:`newest_run`).

Example:
    >>> import os, tempfile
    >>> from torchrl_oni.run_folder import CHECKPOINT_NAME
    >>> os.path.join("runs/oni", CHECKPOINT_NAME)
    'runs/oni/checkpoint.pt'
    >>> root = tempfile.mkdtemp()
    >>> first = new_run_folder(os.path.join(root, "oni"), now=0)
    >>> second = new_run_folder(os.path.join(root, "oni"), now=0)   # the same second: -2
    >>> second == first + "-2", holds_run(first)
    (True, None)
    >>> open(os.path.join(first, CHECKPOINT_NAME), "wb").close()
    >>> holds_run(first), newest_run(os.path.join(root, "oni")) == first
    ('checkpoint.pt', True)
    >>> clear_run(first), holds_run(first)
    (['checkpoint.pt'], None)
"""
import glob
import itertools
import os
import shutil
import time
from typing import Iterable, List, Optional

CONFIG_NAME = "config.yaml"
CHECKPOINT_NAME = "checkpoint.pt"
METRICS_NAME = "metrics.csv"
CAPTION_STORE_NAME = "captions.pt"
TOP_MESSAGES_NAME = "top_messages.txt"
EVAL_NAME = "eval.json"
REWARD_HACKING_NAME = "reward_hacking.json"
REPLAY_DIR = "replays"


RUN_OUTPUTS = (CONFIG_NAME, CHECKPOINT_NAME, METRICS_NAME, CAPTION_STORE_NAME, "captions.screens.pt",
               TOP_MESSAGES_NAME, EVAL_NAME, REWARD_HACKING_NAME, "goals.pt", REPLAY_DIR, "tensorboard", "wandb")
"""What a training run and its evaluation write into their folder (the screens beside the caption
store, ELLM's default goal table, the loggers' folders included): what ``--overwrite`` removes.
Anything else in the folder (a job's own log, a user's notes) is not the run's and stays."""

__all__ = ["CONFIG_NAME", "CHECKPOINT_NAME", "METRICS_NAME", "CAPTION_STORE_NAME", "TOP_MESSAGES_NAME",
           "EVAL_NAME", "REWARD_HACKING_NAME", "REPLAY_DIR", "RUN_OUTPUTS", "holds_run", "new_run_folder",
           "newest_run", "clear_run"]


def holds_run(folder: str) -> Optional[str]:
    """The file that makes ``folder`` a run a new start would destroy (``checkpoint.pt``, else a
    non-empty ``metrics.csv``), or None: a missing or empty folder, or one holding only a
    ``config.yaml`` or a job's log, is free to start in."""
    if os.path.exists(os.path.join(folder, CHECKPOINT_NAME)):
        return CHECKPOINT_NAME
    try:
        if os.path.getsize(os.path.join(folder, METRICS_NAME)) > 0:
            return METRICS_NAME
    except OSError:  # no metrics.csv (or no folder)
        pass
    return None


def new_run_folder(stem: str, now: Optional[float] = None) -> str:
    """Creates and returns ``STEM-YYYYmmdd-HHMMSS`` (local time ``now``, default: now), or
    ``…-2``, ``…-3`` when that name is taken. ``os.mkdir`` claims the name, so two runs started in
    the same second never share a folder."""
    parent = os.path.dirname(stem)
    if parent:
        os.makedirs(parent, exist_ok=True)
    base = f"{stem}-{time.strftime('%Y%m%d-%H%M%S', time.localtime(now))}"
    for n in itertools.count(1):
        path = base if n == 1 else f"{base}-{n}"
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            continue
    raise AssertionError("unreachable")  # itertools.count never ends


def newest_run(stem: str) -> Optional[str]:
    """The folder ``STEM`` or ``STEM-*`` whose ``checkpoint.pt`` was written last, or None: the run
    a bare ``--resume`` continues (the one a Ctrl-C or a time limit stopped last)."""
    found = []
    for path in [stem, *glob.glob(glob.escape(stem) + "-*")]:
        try:
            found.append((os.path.getmtime(os.path.join(path, CHECKPOINT_NAME)), path))
        except OSError:  # no checkpoint: not a run to continue
            continue
    return max(found)[1] if found else None


def clear_run(folder: str, keep: Iterable[str] = ()) -> List[str]:
    """Removes the run in ``folder`` (the :data:`RUN_OUTPUTS` present) and returns their names
    (folders with a trailing ``/``). Paths in ``keep`` (files the new run reads, e.g. a
    ``--labels-from`` store in that folder) stay, and so does the folder holding them."""
    kept = [os.path.realpath(p) for p in keep]
    removed = []
    for name in RUN_OUTPUTS:
        path = os.path.join(folder, name)
        real = os.path.realpath(path)
        if not os.path.lexists(path) or any(k == real or k.startswith(real + os.sep) for k in kept):
            continue
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
            removed.append(name + "/")
        else:
            os.remove(path)
            removed.append(name)
    return removed
