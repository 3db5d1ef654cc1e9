"""Sparse tasks and the reward-free setting: a grid of oni-train runs, evaluated, aggregated over seeds.

The grid is tasks × intrinsic rewards × annotators × seeds. Every cell is one ``oni-train``
process (the real command, run with this script's Python as ``python -m torchrl_oni.train``)
with its own run folder ``ROOT/<task>/<setting>/seed<k>``, where the setting is
``<reward>-<annotator>`` (``retrieval-llm``), ``none`` (no intrinsic reward: the annotator plays
no part, so it is trained once) or ``random`` (``--random``: an untrained policy). Each finished
run is then evaluated with ``oni-eval`` (``python -m torchrl_oni.evaluate``), which writes
``eval.json`` into the run folder. The script then prints

1. the evaluation table: per task × setting, the mean over seeds and the half-width of its
   95 % confidence interval (Student's t over seeds) of the success rate, extrinsic return, deepest
   dungeon level, experience level, BALROG's progression (in %: :mod:`torchrl_oni.progression`, so
   the numbers read beside BALROG's NetHack leaderboard), in-game score and distinct approved
   captions per episode;
2. the training-curve table: ``--curve-metrics`` (default the success rate over the last
   ``--stats-window`` episodes that ``metrics.csv`` logs) at ``--budgets`` fractions of ``--frames``
   (the logged row nearest to it, within one logging interval), with frames and wall time;
3. how the evaluation episodes ended, pooled over the seeds (oni-eval's death causes), and how
   many runs' evaluations printed an ``!!`` line (reward hacking, a self-inflicted death cause);
4. one row per run (status, frames, training and evaluation wall time),
5. the paired table: every setting against ``--baseline`` (default ``none``) on the seeds both
   have done — per seed the difference in success (the two runs share the training seed), its
   mean with a Student-t 95 % CI and whether that excludes 0, the exact sign-flip p and the
   seeds won; then the evaluation episodes paired by game (``oni-eval`` plays episode k of every
   run from the same game seed when their evaluation flags agree) with McNemar's exact p,
6. once ``--frames`` was raised on a finished grid (below, frame ladders): success, deepest
   level and progression by frames trained, every budget's evaluations side by side,

and, as its last line, one JSON object with all of it. ``ROOT/<task>/curves.png`` shows the
learning curves of each setting as the mean over seeds with a shaded 95 % band (``oni-plot
--group``).

Resumable. Run the same command again and it continues: a run whose ``eval.json`` is newer than
its checkpoint and matches ``--episodes``/``--eval-extra`` is not touched; a trained run without
one is only evaluated; a run with a checkpoint short of ``--frames`` (interrupted, or ``--frames``
raised) is continued with ``oni-train --resume``. A run folder whose ``config.yaml`` differs from
the flags (other than ``--frames`` and settings that do not change results: device, logging,
server address) is refused with one line naming the differences: use another ``--root``. Ctrl-C,
SIGTERM or SIGUSR1 are passed to the running ``oni-train`` processes, which save a checkpoint;
``--dry-run`` lists every run, its state and the command it needs, and runs nothing. A folder
brought back from another machine without its checkpoint (``benchmarks/gpu_sparse_call.sh``: one
run per GPU session) counts as done when its ``eval.json`` matches the flags, and is refused, never
trained again, when it does not; a grid moved to another ``--root`` keeps its evaluations.

Frame ladders. Raising ``--frames`` on a finished grid (10M, then 20M, then 50M) continues every
run and evaluates it again; the evaluation of the smaller budget is kept beside the new one as
``RUN/eval_<frames>.json``. Once a run has such an earlier evaluation the script also prints
success, depth and progression by frames trained (per setting and budget: the mean over seeds with
its 95 % CI, and the difference with ``--baseline`` paired by seed) and draws them as
``ROOT/<task>/by_frames.png``:
the scaling question (does a setting pull away from extrinsic-only with more frames?) answered
from policies evaluated alike, without waiting for the last budget.

Runs that survive the machine. ``--archive DIR`` (a folder in the repository) keeps, as each run
finishes a rung, its evaluations, its training log thinned to what the curves read, its config and
the rung's checkpoint and caption store, gzipped (``benchmarks/grid_archive.py``); commit it. A run
folder that is missing is rebuilt from it before anything else (``--dry-run`` too), so a lost
``--root`` costs at most the rung under way.

Configuration. There is no sweep syntax: the grid is a list of flag sets. ``--extra "FLAGS"``
goes to every ``oni-train`` command; ``--extra-for KEY "FLAGS"`` only to runs of one reward type
(``retrieval``), of every intrinsic reward (``intrinsic``), of ``none`` or of ``random``.
``--variant NAME "FLAGS"`` runs every intrinsic setting again with FLAGS added, as the setting
``<setting>+NAME`` (an option measured against the default: ``--variant dp1 "--death-penalty 1"
--baseline retrieval-scripted``). ``--control-variant NAME`` runs ``none`` with that variant's flags
too, as ``none+NAME``: an option that is not about the intrinsic reward (a death penalty) is then
measured on extrinsic-only as well, which separates what it does alone from what ONI adds to it
(the same command with ``--baseline none+NAME`` prints that pairing; nothing is run again). The flags
the grid sets (``--task``, ``--intrinsic-reward``, ``--annotator``, ``--seed``, ``--frames``,
``--logdir``, ``--resume``, ``--overwrite``) may not appear in them. ``--eval-extra`` goes to ``oni-eval``.

Approved captions. Intrinsic runs are judged by their own caption store. ``none`` and ``random``
runs have none, so they are evaluated with the store of the same task and seed of the first
intrinsic reward and the first annotator of the grid (``oni-eval --caption-store``): the same
labels, so the counts compare (captions that run never saw are not labelled, hence not approved).
Those evaluations wait until that run's training is finished.

The staircase experiment (ONI: extrinsic coefficient 10 on the sparse tasks)::

    python benchmarks/sparse_tasks.py --root runs/sparse --tasks staircase staircase-lvl3 \\
        --rewards none retrieval --annotators scripted llm --seeds 0 1 2 --frames 4M \\
        --extra "--extrinsic-coeff 10 --workers 2" --episodes 100

The reward-free setting (intrinsic only vs extrinsic only vs a random policy, on Score)::

    python benchmarks/sparse_tasks.py --root runs/reward_free --tasks score --rewards retrieval none \\
        --annotators llm --random --seeds 0 1 2 --frames 4M --extra "--workers 2" \\
        --extra-for intrinsic "--extrinsic-coeff 0 --intrinsic-coeff 1" \\
        --curve-metrics episode/dlvl episode/xlvl --episodes 100

``--parallel N`` runs N commands at once (each ``oni-train`` uses ``--workers`` + 1 cores);
``--seconds S`` starts no new command after S seconds (run again to go on). Exit status: 0 when
every run is done or was left for later by ``--seconds``, 1 when a command failed (its log:
``RUN/train.log``, ``RUN/eval.log``), 128 + the signal when interrupted, 2 for bad input.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from torchrl_oni.cli_errors import OneLineArgumentParser, report  # noqa: E402
from torchrl_oni.config_tree import parse_count  # noqa: E402
from torchrl_oni.run_folder import holds_run  # noqa: E402
from torchrl_oni.train.annotator_types import annotator_names  # noqa: E402  (no torch: --help stays fast)

sys.path.insert(0, str(Path(__file__).resolve().parent))
import grid_archive  # noqa: E402

PROG = "sparse_tasks.py"
TRAIN_MODULE, EVAL_MODULE = "torchrl_oni.train", "torchrl_oni.evaluate"
TRAIN_LOG, EVAL_LOG = "train.log", "eval.log"
NONE, RANDOM, INTRINSIC = "none", "random", "intrinsic"
# flags the grid sets on every oni-train command (flat setting names)
GRID_SETTINGS = ("task", "intrinsic_reward", "annotator", "seed", "frames", "logdir", "resume", "overwrite")
# oni-eval flags the script sets
EVAL_OWNED = ("--episodes", "-o", "--output", "--caption-store")
# settings that may differ between a run folder's config.yaml and the flags without making it
# another experiment: where things run, what is logged, the server's address, --frames (a run
# with fewer frames is continued, one with more is kept as it is)
NOT_COMPARED = {"frames", "device", "logdir", "resume", "progress", "tensorboard", "wandb", "wandb_mode",
                "checkpoint_every", "llm_url", "llm_api_key", "llm_timeout", "llm_concurrency",
                "embedded_server", "embedded_threads", "backend", "ray_address"}
# eval.json statistics in the evaluation table: (key in the JSON rows, eval.json path, header)
EVAL_METRICS = (
    ("success", ("success_rate", "mean"), "success"),
    ("return", ("return", "mean"), "return"),
    ("max_dlvl", ("max_dlvl", "mean"), "max dlvl"),
    ("xlvl", ("xlvl", "mean"), "xp level"),
    ("progression", ("progression", "mean"), "progress %"),
    ("score", ("score", "mean"), "score"),
    ("approved_per_episode", ("messages", "approved_per_episode", "mean"), "approved/ep"),
)


# the eval.json fields that fix which games oni-eval plays (its module docstring): runs equal in all
# of them played episode k from the same game seed, so their episodes pair one to one
EVAL_GAMES = ("task", "seed", "episodes", "workers", "envs_per_worker", "max_episode_steps")
# an eval.json replaced by the evaluation of more frames (--frames raised) is kept under this name
EARLIER_EVAL = "eval_{frames}.json"
EARLIER_EVAL_PATTERN = re.compile(r"eval_(\d+)\.json")


class GridError(ValueError):
    """Bad input: a flag, an oni-train/oni-eval flag set, a run folder of another configuration."""


# ---------------------------------------------------------------------- the grid
@dataclass
class Run:
    """One cell of the grid: its oni-train flags, its folder and, for none/random, whose labels judge it."""

    task: str
    reward: str  # an intrinsic reward type, "none" or "random"
    annotator: Optional[str]
    seed: int
    logdir: Path
    train_args: List[str]  # oni-train flags (random: the flags its untrained checkpoint is built from)
    target_frames: int  # 0 for random
    store_from: Optional["Run"] = None  # none/random: the run whose caption store labels its messages
    config: object = None  # the resolved TrainConfig these flags give
    status: str = ""
    detail: str = ""
    frames: Optional[int] = None
    outcome: Optional[str] = None  # this invocation: done, failed, interrupted, waiting, not started
    variant: Optional[str] = None  # --variant NAME: the setting run again with NAME's flags (none: --control-variant)

    @property
    def setting(self) -> str:
        base = self.reward if self.annotator is None else f"{self.reward}-{self.annotator}"
        return base if self.variant is None else f"{base}+{self.variant}"

    @property
    def name(self) -> str:
        return f"{self.task}/{self.setting}/seed{self.seed}"

    @property
    def store(self) -> Optional[Path]:
        """The caption store oni-eval is given (None: the run's own, found by oni-eval)."""
        from torchrl_oni.run_folder import CAPTION_STORE_NAME

        return None if self.store_from is None else self.store_from.logdir / CAPTION_STORE_NAME


def _split(flags: str, what: str) -> List[str]:
    try:
        return shlex.split(flags)
    except ValueError as err:
        raise GridError(f"{what} {flags!r}: {err}") from None


def _grid_flags() -> Dict[str, str]:
    """``{flag or alias: flat name}`` of the settings the grid sets."""
    from torchrl_oni.train.config import TrainConfig

    out = {}
    for leaf in TrainConfig.settings():
        if leaf.flat in GRID_SETTINGS:
            for flag in (leaf.flag, *leaf.aliases):
                out[flag] = leaf.flat
    return out


def _check_not_owned(tokens: Sequence[str], owned, what: str) -> None:
    for token in tokens:
        flag = token.split("=", 1)[0]
        if flag in owned:
            raise GridError(f"{what} may not set {flag}: the grid sets it for every run")


def build_grid(args) -> List[Run]:
    """Every run of the grid, intrinsic runs first (none/random evaluations use their stores)."""
    from torchrl_oni.train.config import intrinsic_rewards

    known = intrinsic_rewards()
    for reward in args.rewards:
        if reward not in known:
            raise GridError(f"--rewards: unknown reward {reward!r} (choose from {', '.join(known)})")
    owned = _grid_flags()
    extra = _split(args.extra, "--extra")
    _check_not_owned(extra, owned, "--extra")
    annotators = annotator_names()
    extra_for: Dict[str, List[str]] = {}
    for key, flags in args.extra_for:
        if key not in known + annotators + (INTRINSIC, RANDOM):
            raise GridError(f"--extra-for: unknown key {key!r} (a reward type, an annotator, {INTRINSIC!r} or "
                            f"{RANDOM!r})")
        tokens = _split(flags, f"--extra-for {key}")
        _check_not_owned(tokens, owned, f"--extra-for {key}")
        extra_for.setdefault(key, []).extend(tokens)

    def flags_for(reward: str, annotator: Optional[str]) -> List[str]:
        out = ["--no-progress", *extra]
        for key, tokens in extra_for.items():
            if key in (reward, annotator) or (key == INTRINSIC and reward not in (NONE, RANDOM)):
                out += tokens
        return out

    variants: List[tuple] = []
    for name, flags in args.variant:
        if not re.fullmatch(r"[a-z0-9][a-z0-9_.]*", name) or name in [v for v, _ in variants]:
            raise GridError(f"--variant: {name!r} must be a new name of lower-case letters, digits, '_' and '.'")
        tokens = _split(flags, f"--variant {name}")
        _check_not_owned(tokens, owned, f"--variant {name}")
        variants.append((name, tokens))
    controls = list(dict.fromkeys(args.control_variant))
    for name in controls:
        if name not in [v for v, _ in variants]:
            raise GridError(f"--control-variant: {name!r} is not a --variant of this grid")
        if NONE not in args.rewards:
            raise GridError(f"--control-variant {name} runs the '{NONE}' setting again: add it to --rewards")
    intrinsic = [r for r in dict.fromkeys(args.rewards) if r != NONE]
    # (reward, annotator, variant name, its flags): every intrinsic setting, then each with every variant
    settings = [(r, a, None, []) for r in intrinsic for a in dict.fromkeys(args.annotators)]
    settings += [(r, a, name, tokens) for r, a, _, _ in list(settings) for name, tokens in variants]
    if NONE in args.rewards:
        settings.append((NONE, None, None, []))
        settings += [(NONE, None, name, tokens) for name, tokens in variants if name in controls]
    if args.random:
        settings.append((RANDOM, None, None, []))
    root = Path(args.root)
    runs: List[Run] = []
    for task in dict.fromkeys(args.tasks):
        for seed in dict.fromkeys(args.seeds):
            source = None
            for reward, annotator, variant, variant_flags in settings:
                run = Run(task, reward, annotator, seed, Path(), [], 0 if reward == RANDOM else args.frames,
                          variant=variant)
                run.logdir = logdir = root / task / run.setting / f"seed{seed}"
                argv = flags_for(reward, annotator) + variant_flags
                argv += ["--task", task, "--intrinsic-reward", NONE if reward == RANDOM else reward]
                if annotator is not None:
                    argv += ["--annotator", annotator]
                run.train_args = argv + ["--seed", str(seed), "--frames", str(args.frames), "--logdir", str(logdir)]
                if annotator is not None and source is None:
                    source = run  # the first intrinsic reward with the first annotator
                elif annotator is None:
                    run.store_from = source
                runs.append(run)
    return runs


def parse_train_flags(run: Run):
    """The resolved, validated TrainConfig that ``oni-train`` would run with ``run``'s flags."""
    from torchrl_oni.train.cli import parse_command

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            cfg, _ = parse_command(list(run.train_args))
        cfg = cfg.resolved()
        cfg.validate()
    except SystemExit:
        message = err.getvalue().strip().replace("oni-train: error: ", "")
        raise GridError(f"{run.name}: oni-train refuses its flags: {message}") from None
    except (ValueError, TypeError) as error:
        raise GridError(f"{run.name}: oni-train refuses its flags: {error}") from None
    return cfg


def parse_eval_flags(args) -> argparse.Namespace:
    """``oni-eval``'s parsed flags for ``--episodes`` and ``--eval-extra`` (checked once for all runs)."""
    from torchrl_oni.evaluate import build_parser

    tokens = _split(args.eval_extra, "--eval-extra")
    _check_not_owned(tokens, EVAL_OWNED, "--eval-extra")
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return build_parser().parse_args(["RUN", "--episodes", str(args.episodes), *tokens])
    except SystemExit:
        message = err.getvalue().strip().replace("oni-eval: error: ", "")
        raise GridError(f"--eval-extra: oni-eval refuses it: {message}") from None


def eval_command(run: Run, args) -> List[str]:
    """``oni-eval`` flags for ``run`` (its folder first)."""
    argv = [str(run.logdir), "--episodes", str(args.episodes), "--no-progress", *_split(args.eval_extra, "--eval-extra")]
    if run.store is not None:
        argv += ["--caption-store", str(run.store)]
    return argv


# ---------------------------------------------------------------------- state of a run folder
def config_differences(wanted, saved) -> List[str]:
    """``--flag run-value -> wanted`` for every compared setting where two TrainConfigs differ."""
    from torchrl_oni.train.config import TrainConfig

    out = []
    for leaf in TrainConfig.settings():
        if leaf.flat in NOT_COMPARED or leaf.secret:
            continue
        have, want = leaf.get(saved), leaf.get(wanted)
        if have != want:
            out.append(f"{leaf.flag} {have!r} -> {want!r}")
    return out


def _read_json(path: Path) -> Optional[dict]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return math.inf


def eval_is_current(run: Run, eval_args: argparse.Namespace) -> bool:
    """Whether ``RUN/eval.json`` evaluates the run's current checkpoint as the flags ask."""
    from torchrl_oni.evaluate import EVAL_NAME
    from torchrl_oni.train.checkpoint import CHECKPOINT_NAME

    path = run.logdir / EVAL_NAME
    result = _read_json(path)
    if result is None:
        return False
    wanted = {"episodes": eval_args.episodes, "seed": eval_args.seed,
              "policy": "greedy" if eval_args.greedy else "sampling"}
    if eval_args.max_episode_steps is not None:
        wanted["max_episode_steps"] = eval_args.max_episode_steps
    if any(result.get(k) != v for k, v in wanted.items()):
        return False
    if (result.get("frames_trained") or 0) < run.target_frames:
        return False
    # the store it was judged by, by its place in the grid (task/setting/seed/file): a grid moved or
    # copied to another --root (the GPU node's results) keeps its evaluations
    if run.store is not None and Path(str(result.get("caption_store"))).parts[-4:] != run.store.parts[-4:]:
        return False
    if not (run.logdir / CHECKPOINT_NAME).exists():
        # a folder brought back without its checkpoint (the GPU node's results): the evaluation
        # judged the only policy there is, whatever the copy did to the files' times
        return True
    written = _mtime(path)
    newer = [run.logdir / CHECKPOINT_NAME] + ([run.store] if run.store is not None else [])
    # a checkpoint (or labels) rewritten after the evaluation: it judged another policy
    return all(_mtime(p) <= written for p in newer if p.exists())


def inspect_run(run: Run, eval_args: argparse.Namespace) -> tuple:
    """``(state, detail, frames)`` of a run folder; state is done, eval, resume, train (create
    for random) or conflict. Reads the folder only."""
    from torchrl_oni.evaluate import EVAL_NAME
    from torchrl_oni.train.checkpoint import CHECKPOINT_NAME, CheckpointError, load_checkpoint
    from torchrl_oni.train.config import CONFIG_NAME, TrainConfig

    config_file = run.logdir / CONFIG_NAME
    checkpoint = run.logdir / CHECKPOINT_NAME
    if config_file.exists():
        import yaml

        try:
            saved = TrainConfig.from_dict(yaml.safe_load(config_file.read_text()) or {}, strict=False)
        except Exception as err:  # unreadable YAML or a setting of an unknown type: not ours to overwrite
            return "conflict", f"unreadable {CONFIG_NAME} ({type(err).__name__})", None
        diffs = config_differences(run.config, saved)
        if diffs:
            return "conflict", "; ".join(diffs), None
    elif checkpoint.exists():
        return "conflict", f"a checkpoint without {CONFIG_NAME}: not written by this grid", None
    if eval_is_current(run, eval_args):
        return "done", "", int(_read_json(run.logdir / EVAL_NAME)["frames_trained"])
    if not checkpoint.exists():
        if (run.logdir / EVAL_NAME).exists() and run.reward != RANDOM:
            # training again would overwrite a run that was trained and evaluated elsewhere
            return "conflict", (f"an {EVAL_NAME} of other flags or fewer frames and no checkpoint to continue or "
                                f"evaluate again (a folder copied without it)"), None
        return ("create" if run.reward == RANDOM else "train"), "", None
    try:
        frames = int(load_checkpoint(str(checkpoint))["frames"])
    except (CheckpointError, KeyError, TypeError, ValueError) as err:
        return "conflict", f"unreadable checkpoint ({err})", None
    if frames < run.target_frames:
        return "resume", f"from {frames:,} frames", frames
    return "eval", "", frames


def update_status(run: Run, eval_args: argparse.Namespace) -> str:
    """Sets ``run.status``, ``run.detail`` and ``run.frames`` from its folder (:func:`inspect_run`)."""
    run.status, run.detail, run.frames = inspect_run(run, eval_args)
    return run.status


# ---------------------------------------------------------------------- running
class Launcher:
    """Runs oni-train/oni-eval commands, one per pool thread; passes stop signals on to them."""

    def __init__(self, parallel: int, seconds: Optional[float]):
        self.parallel = parallel
        self.deadline = None if seconds is None else time.monotonic() + seconds
        self.lock = threading.RLock()  # RLock: the signal handler may run while this thread holds it
        self.procs: set = set()
        self.stopped_by: Optional[int] = None
        self.launched = {"train": 0, "resume": 0, "eval": 0, "create": 0}
        self.training: Dict[str, Run] = {}  # the runs whose oni-train runs now, by name (progress lines)

    def may_start(self) -> bool:
        return self.stopped_by is None and (self.deadline is None or time.monotonic() < self.deadline)

    def stop(self, signum: int) -> None:
        with self.lock:
            first = self.stopped_by is None
            self.stopped_by = self.stopped_by or signum
            procs = list(self.procs)
        for proc in procs:  # they run in sessions of their own: the terminal's Ctrl-C reaches only us
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signum)
        if first:
            say(f"{signal.Signals(signum).name}: stopping; {len(procs)} running command(s) save and exit "
                "(run the same command again to continue)")

    def run(self, kind: str, module: str, argv: List[str], log_path: Path) -> int:
        cmd = [sys.executable, "-m", module, *argv]
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "a", encoding="utf-8") as log:
            log.write(f"\n$ {display_command(module, argv)}    # {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
            log.flush()
            with self.lock:
                if self.stopped_by is not None:
                    return 128 + self.stopped_by
                proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        start_new_session=True, env=_child_env())
                self.procs.add(proc)
                self.launched[kind] += 1
            try:
                return proc.wait()
            finally:
                with self.lock:
                    self.procs.discard(proc)


REPO = Path(__file__).resolve().parent.parent


def _child_env() -> Dict[str, str]:
    """This environment, with this checkout importable (as the script itself imports it)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def display_command(module: str, argv: Sequence[str]) -> str:
    return shlex.join(["oni-train" if module == TRAIN_MODULE else "oni-eval", *argv])


_print_lock = threading.RLock()  # reentrant: a signal handler may print while the main thread does


def say(line: str) -> None:
    """Progress goes to stderr: stdout holds the tables and the JSON line."""
    with _print_lock:
        print(f"[{time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


def keep_earlier_eval(run: Run) -> Optional[Path]:
    """Renames ``RUN/eval.json`` to ``RUN/eval_<frames>.json`` when it evaluated fewer frames than
    the run is now trained to (``--frames`` raised): the evaluation about to run replaces it, and
    it is the grid's figure for that budget. Returns the new path, or None when nothing was kept
    (no eval.json, or one of as many frames, e.g. evaluated with other flags: that one is redone).
    """
    from torchrl_oni.evaluate import EVAL_NAME

    path = run.logdir / EVAL_NAME
    result = _read_json(path)
    frames = None if result is None else result.get("frames_trained")
    if not isinstance(frames, int) or frames >= run.target_frames:
        return None
    kept = run.logdir / EARLIER_EVAL.format(frames=frames)
    os.replace(path, kept)
    say(f"{run.name}: the evaluation at {frames:,} frames is kept as {kept.name}")
    return kept


def create_untrained(run: Run) -> None:
    """The random policy: a freshly initialised checkpoint (the networks of ``Trainer``, no hook), no
    training."""
    from torchrl_oni.train import Trainer
    from torchrl_oni.train.build import build_run
    from torchrl_oni.train.ppo import write_config

    # the networks exactly as the run would start, from its seed (run.config: resolved by parse_train_flags)
    trainer = Trainer(build_run(run.config, intrinsic=False))
    write_config(trainer.cfg, str(run.logdir))
    trainer.save()


def execute(run: Run, launcher: Launcher, args, eval_args, final: bool) -> None:
    """Trains (or resumes) ``run`` if needed, then evaluates it once its caption store's run is trained.

    Sets ``run.outcome``; with ``final=False`` an evaluation that must wait is left for later.
    """
    if not launcher.may_start():
        run.outcome = "not started"
        return
    if run.status in ("train", "resume"):
        argv = run.train_args + (["--resume"] if run.status == "resume" else [])
        if run.status == "train" and holds_run(str(run.logdir)):
            # metrics of a run that died before its first checkpoint: nothing to continue, and
            # oni-train keeps a folder holding a run unless told to start it over
            argv.append("--overwrite")
        say(f"{run.name}: {'continuing' if run.status == 'resume' else 'training'} ({run.target_frames:,} frames)")
        with launcher.lock:
            launcher.training[run.name] = run
        try:
            rc = launcher.run(run.status, TRAIN_MODULE, argv, run.logdir / TRAIN_LOG)
        finally:
            with launcher.lock:
                launcher.training.pop(run.name, None)
        if rc != 0:
            run.outcome = "interrupted" if rc >= 128 or rc < 0 else "failed"
            say(f"{run.name}: oni-train {run.outcome} (exit {rc}); see {run.logdir / TRAIN_LOG}")
            return
        run.status = "eval"
    if run.status != "eval":
        return
    if run.store_from is not None and inspect_run(run.store_from, eval_args)[0] not in ("done", "eval"):
        run.outcome = "waiting"  # its labels are not final yet
        if not final:
            return
        if not run.store.exists():
            run.outcome = "failed"
            say(f"{run.name}: not evaluated: {run.store_from.name} has no caption store to judge it by")
            return
        say(f"{run.name}: evaluated with the labels of {run.store_from.name}, whose training is not finished")
    if not launcher.may_start():
        run.outcome = "not started"
        return
    keep_earlier_eval(run)
    rc = launcher.run("eval", EVAL_MODULE, eval_command(run, args), run.logdir / EVAL_LOG)
    if rc != 0:
        run.outcome = "interrupted" if rc >= 128 or rc < 0 else "failed"
        say(f"{run.name}: oni-eval {run.outcome} (exit {rc}); see {run.logdir / EVAL_LOG}")
        return
    run.outcome = "done"
    if args.archive is not None:
        kept = grid_archive.save(run.logdir, args.archive)
        say(f"{run.name}: kept in {grid_archive.archive_folder(args.archive, run.logdir)} ({', '.join(kept)}): "
            f"commit it")
    say(f"{run.name}: evaluated")


def last_metrics_row(path: Path) -> Optional[Dict[str, float]]:
    """The last complete row of a ``metrics.csv``, from its header and its last 64 KiB only (a
    50M-frame run's file holds tens of thousands of rows); None without one."""
    try:
        with open(path, "rb") as f:
            header = f.readline().decode("utf-8", "replace").rstrip("\r\n").split(",")
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 65536))
            tail = f.read().decode("utf-8", "replace")
    except OSError:
        return None
    for line in reversed(tail.split("\n")[1:-1]):  # [0] may be cut by the seek, [-1] by a write in progress
        values = line.rstrip("\r").split(",")
        if len(values) != len(header) or values == header:
            continue
        try:
            return {k: float(v) for k, v in zip(header, values) if v != ""}
        except ValueError:
            continue
    return None


def progress_line(run: Run) -> Optional[str]:
    """``run``'s training progress from its metrics.csv: frames, share of the budget, frames/s,
    time left at that rate.

    Example:
        >>> import tempfile
        >>> d = Path(tempfile.mkdtemp())
        >>> _ = (d / "metrics.csv").write_text("frames,time_s,fps\\n1024,1.0,900\\n7215104,1091.8,6608.2\\n")
        >>> run = Run("staircase", "none", None, 0, d, [], target_frames=10_000_000)
        >>> progress_line(run)
        'staircase/none/seed0: 7,215,104 of 10,000,000 frames (72 %), 6,608 frames/s, about 7 min left'
    """
    from torchrl_oni.run_folder import METRICS_NAME

    row = last_metrics_row(run.logdir / METRICS_NAME)
    if row is None or "frames" not in row:
        return None
    frames, fps = row["frames"], row.get("fps", 0.0)
    line = f"{run.name}: {frames:,.0f} of {run.target_frames:,} frames ({100 * frames / max(run.target_frames, 1):.0f} %)"
    if fps > 0:
        left = max(run.target_frames - frames, 0) / fps
        when = f"{left / 3600:.1f} h" if left >= 5400 else f"{max(1, round(left / 60))} min"
        line += f", {fps:,.0f} frames/s, about {when} left"
    return line


def run_pool(runs: List[Run], launcher: Launcher, args, eval_args, final: bool) -> None:
    """Executes ``runs`` ``launcher.parallel`` at a time; returns when all are over. Every
    ``args.status_every`` seconds it says how far each training run has come (:func:`progress_line`)."""
    every = getattr(args, "status_every", 0) or 0
    next_status = time.monotonic() + every
    with ThreadPoolExecutor(max_workers=launcher.parallel, thread_name_prefix="grid") as pool:
        futures = [pool.submit(execute, run, launcher, args, eval_args, final) for run in runs]
        pending = set(futures)
        while pending:  # short waits: signal handlers run in this thread between them
            _, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
            if every and time.monotonic() >= next_status:
                next_status = time.monotonic() + every
                with launcher.lock:
                    training = list(launcher.training.values())
                for line in filter(None, map(progress_line, training)):
                    say(line)
    for future in futures:
        future.result()  # what went wrong in a thread (a full disk, a bug) is raised here


@contextlib.contextmanager
def forward_signals(launcher: Launcher):
    """SIGINT/SIGTERM/SIGUSR1 stop new launches and reach the running commands."""
    def handler(signum, frame):
        launcher.stop(signum)

    sigs = [signal.SIGINT, signal.SIGTERM] + ([signal.SIGUSR1] if hasattr(signal, "SIGUSR1") else [])
    previous = {s: signal.signal(s, handler) for s in sigs}
    try:
        yield
    finally:
        for s, old in previous.items():
            signal.signal(s, old)


# ---------------------------------------------------------------------- results
def _dig(data, path):
    for key in path:
        if not isinstance(data, dict) or data.get(key) is None:
            return None
        data = data[key]
    return data


def curve_value(rows: List[Dict[str, float]], metric: str, target: float) -> Optional[float]:
    """``metric`` in the logged row nearest to ``target`` frames, if one lies within one logging interval.

    Example:
        >>> rows = [{"frames": 512.0 * i, "episode/success": i / 10} for i in range(1, 9)]
        >>> curve_value(rows, "episode/success", 2048), curve_value(rows, "episode/success", 2100)
        (0.4, 0.4)
        >>> curve_value(rows, "episode/success", 8192) is None  # the run stopped at 4,096 frames
        True
    """
    have = [(r["frames"], r[metric]) for r in rows
            if "frames" in r and metric in r and math.isfinite(r[metric])]
    if not have:
        return None
    frames = sorted(r["frames"] for r in rows if "frames" in r)
    gaps = [b - a for a, b in zip(frames, frames[1:])]
    tolerance = max(gaps) if gaps else frames[0]
    x, value = min(have, key=lambda p: (abs(p[0] - target), p[0]))
    return float(value) if abs(x - target) <= tolerance else None


def collect_run(run: Run, args) -> dict:
    """One run's numbers: eval.json statistics, curve values at the budgets, frames, wall times."""
    from torchrl_oni.evaluate import EVAL_NAME
    from torchrl_oni.train.run_log import METRICS_NAME, MetricsFileError, read_metrics

    out = {"task": run.task, "setting": run.setting, "reward": run.reward, "annotator": run.annotator,
           "seed": run.seed, "logdir": str(run.logdir), "status": run.status, "frames": run.frames,
           "train_time_s": None, "eval_time_s": None, "eval": {}, "curve": {}}
    result = _read_json(run.logdir / EVAL_NAME) if run.status == "done" else None
    if result is not None:
        out.update(eval_summary(result))
    out["earlier_evals"] = earlier_evals(run.logdir)
    metrics = run.logdir / METRICS_NAME
    if metrics.exists():
        try:
            rows = read_metrics(str(metrics))
        except (MetricsFileError, OSError) as err:
            say(f"{run.name}: cannot read metrics.csv ({err})")
            rows = []
        times = [r["time_s"] for r in rows if "time_s" in r]
        out["train_time_s"] = times[-1] if times else None
        out["curve"] = {metric: {budget_key(b): curve_value(rows, metric, b * args.frames) for b in args.budgets}
                        for metric in args.curve_metrics}
    return out


def eval_summary(result: dict) -> dict:
    """What the grid reads from one eval.json (:func:`collect_run`'s evaluation fields)."""
    episodes = sorted(result.get("per_episode") or [], key=lambda e: e.get("episode", 0))
    stats = {key: _dig(result, path) for key, path, _ in EVAL_METRICS}
    if stats["progression"] is None:
        stats["progression"] = _progression_of_episodes(episodes)
    return {
        "eval": stats,
        "eval_time_s": result.get("time_s"),
        "caption_store": result.get("caption_store"),
        # "0110…": episode k's success, k in oni-eval's order; two runs with equal eval_games played the same games
        "episode_success": "".join("1" if e.get("success") else "0" for e in episodes),
        "eval_games": {key: result.get(key) for key in EVAL_GAMES},
        # the diagnostics of oni-eval: how episodes ended, and its `!!` lines (reward hacking, death causes)
        "death_causes": dict(result.get("death_causes") or {}),
        "episodes": _dig(result, ("success_rate", "n")),
        "flags": [*(_dig(result, ("reward_hacking", "warnings")) or []),
                  *(_dig(result, ("death_causes_check", "warnings")) or [])],
    }


def _progression_of_episodes(episodes: List[dict]) -> Optional[float]:
    """BALROG's mean progression from the episodes' ``max_dlvl`` and ``xlvl``, for an eval.json
    written before oni-eval scored it (a frame ladder's earlier rungs); None without them.

    Those episodes know only their last experience level, not their highest: the two differ only
    after a level drain, so the mean may come out a little lower than oni-eval's own.

    Example:
        >>> round(100 * _progression_of_episodes([{"max_dlvl": 5, "xlvl": 1}, {"max_dlvl": 1, "xlvl": 1}]), 3)
        1.324
        >>> _progression_of_episodes([]) is None
        True
    """
    from torchrl_oni.progression import progression

    values = [progression(e["max_dlvl"], e["xlvl"]) for e in episodes
              if e.get("max_dlvl") is not None and e.get("xlvl") is not None]
    return sum(values) / len(values) if values and len(values) == len(episodes) else None


def earlier_evals(logdir: Path) -> List[dict]:
    """The run's kept evaluations of smaller budgets (``eval_<frames>.json``), fewest frames first:
    ``{"frames", "eval"}`` each, ``eval`` as :func:`collect_run` reads it."""
    kept = []
    for path in logdir.glob("eval_*.json"):
        match = EARLIER_EVAL_PATTERN.fullmatch(path.name)
        result = _read_json(path) if match else None
        if result is None:
            continue
        kept.append({"frames": int(result.get("frames_trained", match.group(1))),
                     "eval": eval_summary(result)["eval"]})
    return sorted(kept, key=lambda e: e["frames"])


def budget_key(fraction: float) -> str:
    return f"{fraction:g}"


def _pooled(counts) -> Dict[str, int]:
    """The sum of ``{cause: count}`` dicts, largest first."""
    total: Dict[str, int] = {}
    for c in counts:
        for cause, n in c.items():
            total[cause] = total.get(cause, 0) + int(n)
    return dict(sorted(total.items(), key=lambda kv: (-kv[1], kv[0])))


def aggregate(per_run: List[dict], args) -> List[dict]:
    """Per task × setting: mean and 95 % CI over the seeds whose run is done (:func:`mean_ci`)."""
    from torchrl_oni.stats import mean_ci

    groups: Dict[tuple, List[dict]] = {}
    for r in per_run:
        groups.setdefault((r["task"], r["setting"]), []).append(r)
    rows = []
    for (task, setting), members in groups.items():
        done = [r for r in members if r["status"] == "done"]

        def stat(values):
            return mean_ci([v for v in values if v is not None])

        row = {"task": task, "setting": setting, "reward": members[0]["reward"], "annotator": members[0]["annotator"],
               "seeds": [r["seed"] for r in done], "runs": len(members),
               "eval": {key: stat(r["eval"].get(key) for r in done) for key, _, _ in EVAL_METRICS},
               "curve": {m: {budget_key(b): stat(r["curve"].get(m, {}).get(budget_key(b)) for r in done)
                             for b in args.budgets} for m in args.curve_metrics},
               "frames": stat(r["frames"] for r in done),
               "train_time_s": stat(r["train_time_s"] for r in done),
               "eval_time_s": stat(r["eval_time_s"] for r in done),
               # pooled over the seeds: episodes, deaths by cause, runs with an `!!` line of oni-eval
               "episodes": sum(r.get("episodes") or 0 for r in done),
               "death_causes": _pooled(r.get("death_causes") or {} for r in done),
               "flagged_runs": sum(bool(r.get("flags")) for r in done)}
        rows.append(row)
    return rows


def paired(per_run: List[dict], baseline: str = NONE) -> List[dict]:
    """Per task, every setting against ``baseline`` on the seeds both have done: each seed is a pair
    (the two runs share the training seed and, when their ``eval_games`` agree, the evaluation games).

    ``success``: :func:`torchrl_oni.stats.paired_difference` of the seeds' success rates (the mean
    difference, its Student-t 95 % CI, whether that excludes 0, the exact sign-flip p, seeds won).
    ``episodes``: the episodes paired by game over those seeds — counts of both/only one/neither
    succeeding and the exact McNemar p — or None, with ``episodes_unpaired`` saying why, when some
    pair did not play the same games.
    """
    from torchrl_oni.stats import mcnemar_exact, paired_difference

    done = {(r["task"], r["setting"], r["seed"]): r for r in per_run
            if r["status"] == "done" and r["eval"].get("success") is not None}
    rows = []
    for task in dict.fromkeys(r["task"] for r in per_run):
        settings = [s for s in dict.fromkeys(r["setting"] for r in per_run if r["task"] == task) if s != baseline]
        for setting in settings:
            seeds = sorted(seed for (t, s_, seed) in done if t == task and s_ == setting
                           and (task, baseline, seed) in done)
            if not seeds:
                continue
            pairs = [(done[(task, setting, k)], done[(task, baseline, k)]) for k in seeds]
            row = {"task": task, "setting": setting, "baseline": baseline, "seeds": seeds,
                   "success": paired_difference([a["eval"]["success"] for a, _ in pairs],
                                                [b["eval"]["success"] for _, b in pairs]),
                   "episodes": None}
            mismatched = [k for k, (a, b) in zip(seeds, pairs)
                          if a.get("eval_games") != b.get("eval_games") or not a.get("episode_success")
                          or len(a["episode_success"]) != len(b.get("episode_success") or "")]
            if mismatched:
                row["episodes_unpaired"] = (f"seed(s) {', '.join(map(str, mismatched))}: the two runs were not "
                                            "evaluated on the same games (eval.json differs in "
                                            f"{'/'.join(EVAL_GAMES)} or has no per_episode)")
            else:
                counts = {"both": 0, "only_setting": 0, "only_baseline": 0, "neither": 0}
                for a, b in pairs:
                    for x, y in zip(a["episode_success"], b["episode_success"]):
                        counts[{("1", "1"): "both", ("1", "0"): "only_setting", ("0", "1"): "only_baseline",
                                ("0", "0"): "neither"}[(x, y)]] += 1
                counts["pairs"] = sum(counts.values())
                counts["p"] = mcnemar_exact(counts["only_setting"], counts["only_baseline"])
                row["episodes"] = counts
            rows.append(row)
    return rows


def budget_of(frames: int) -> int:
    """``frames`` to 3 significant digits: the runs of one ``--frames`` stop a batch or so past it.

    Example:
        >>> budget_of(10_000_384), budget_of(3_000_320), budget_of(2048)
        (10000000, 3000000, 2050)
    """
    return int(float(f"{int(frames):.3g}"))


def short_count(n: int) -> str:
    """``n`` as the grid's flags write it.

    Example:
        >>> short_count(10_000_000), short_count(2_050), short_count(512)
        ('10M', '2.05k', '512')
    """
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)


# what the by-frames table follows: the task's success, the deepest level reached, which moves
# long before success does on staircase-lvl3 (reach dungeon level 3), and BALROG's progression, the
# number other NetHack agents are compared by
FRAMES_METRICS = (("success", "success", 3), ("max_dlvl", "max dlvl", 2), ("progression", "progress %", 2))
# statistics kept as shares in the JSON and shown in %, as BALROG's leaderboard shows progression
PERCENT_METRICS = {"progression"}


def _in_percent(key: str, s: Optional[dict]) -> Optional[dict]:
    """A :func:`mean_ci` or :func:`paired_difference` dict of ``key`` with its mean, bounds and
    spread in % where ``key`` is one of :data:`PERCENT_METRICS` (as it is otherwise).

    Example:
        >>> _in_percent("progression", {"mean": 0.015, "ci95": [0.01, 0.02], "n": 3})
        {'mean': 1.5, 'ci95': [1.0, 2.0], 'n': 3}
    """
    if key not in PERCENT_METRICS or not s:
        return s
    out = dict(s)
    for k in ("mean", "std", "min", "max"):
        if out.get(k) is not None:
            out[k] = 100 * out[k]
    if out.get("ci95") is not None:
        out["ci95"] = [100 * x for x in out["ci95"]]
    return out


def by_frames(per_run: List[dict], baseline: str = NONE) -> List[dict]:
    """Success, depth and progression at every budget the grid was run to, from the current and the
    kept earlier evaluations (:func:`earlier_evals`); [] when no run has an earlier one.

    One row per task × budget × setting, with for each of :data:`FRAMES_METRICS` the
    :func:`mean_ci` over the seeds evaluated at that budget (``eval``) and the
    :func:`paired_difference` with ``baseline`` on the seeds both were evaluated at that budget
    (``vs_baseline``; None for the baseline itself or without a common seed).
    """
    from torchrl_oni.stats import mean_ci, paired_difference

    if not any(r.get("earlier_evals") for r in per_run):
        return []
    points: Dict[tuple, Dict[str, Dict[int, dict]]] = {}  # (task, budget) -> setting -> seed -> eval
    for r in per_run:
        evals = list(r.get("earlier_evals") or [])
        if r["status"] == "done" and r["frames"]:
            evals.append({"frames": r["frames"], "eval": r["eval"]})
        for e in evals:
            if e["eval"].get("success") is not None:
                budget = (r["task"], budget_of(e["frames"]))
                points.setdefault(budget, {}).setdefault(r["setting"], {})[r["seed"]] = e["eval"]
    tasks = list(dict.fromkeys(r["task"] for r in per_run))
    settings = list(dict.fromkeys(r["setting"] for r in per_run))
    rows = []
    for (task, budget) in sorted(points, key=lambda k: (tasks.index(k[0]), k[1])):
        group = points[(task, budget)]
        base = group.get(baseline, {})
        for setting in (s for s in settings if s in group):
            mine = group[setting]
            common = [k for k in sorted(mine) if k in base] if setting != baseline else []
            row = {"task": task, "frames": budget, "setting": setting, "seeds": sorted(mine), "baseline": baseline,
                   "eval": {}, "vs_baseline": {}}
            for key, _, _ in FRAMES_METRICS:
                row["eval"][key] = mean_ci([mine[k][key] for k in sorted(mine) if mine[k].get(key) is not None])
                pairs = [(mine[k][key], base[k][key]) for k in common
                         if mine[k].get(key) is not None and base[k].get(key) is not None]
                row["vs_baseline"][key] = paired_difference(*zip(*pairs)) if pairs else None
            rows.append(row)
    return rows


def _difference_cell(d: Optional[dict], digits: int, star: bool = True) -> str:
    """``+mean ±half-width*`` of a :func:`paired_difference` (``*`` with ``star``: its 95 % CI excludes 0)."""
    if d is None:
        return "-"
    text = f"{d['mean']:+.{digits}f}"
    if d["ci95"] is not None:
        text += f" ±{(d['ci95'][1] - d['ci95'][0]) / 2:.{digits}f}"
    return text + ("*" if star and d["excludes_zero"] else "")


def format_by_frames(rows: List[dict]) -> List[str]:
    """The by-frames table's lines (none when no run was evaluated at an earlier budget)."""
    if not rows:
        return []
    baseline = rows[0]["baseline"]
    width = max(len(f"{r['task']} / {r['setting']}") for r in rows) + 2
    heads = "".join(f"{head:>16}{'vs ' + baseline:>18}" for _, head, _ in FRAMES_METRICS)
    lines = ["", f"By frames trained (every budget the grid was run to: earlier evaluations are kept as "
                 f"eval_<frames>.json): mean over seeds ±half-width of its 95 % CI (Student's t); the difference "
                 f"with {baseline} paired by seed, * where its CI excludes 0",
             f"{'task / setting':<{width}}{'frames':>10}{'seeds':>7}{heads}"]
    for r in rows:
        cells = "".join(f"{_cell(_in_percent(key, r['eval'][key]), digits):>16}"
                        f"{_difference_cell(_in_percent(key, r['vs_baseline'][key]), digits):>18}"
                        for key, _, digits in FRAMES_METRICS)
        lines.append(f"{r['task'] + ' / ' + r['setting']:<{width}}{short_count(r['frames']):>10}{len(r['seeds']):>7}"
                     f"{cells}")
    return lines


def plot_by_frames(rows: List[dict], root: Path) -> List[str]:
    """``ROOT/<task>/by_frames.png``: each setting's mean success, depth and progression at each
    budget with 95 % CIs as error bars (progression in %), for the tasks evaluated at two budgets or
    more."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter

    written = []
    for task in dict.fromkeys(r["task"] for r in rows):
        mine = [r for r in rows if r["task"] == task]
        if len({r["frames"] for r in mine}) < 2:
            continue
        fig = Figure(figsize=(5.5 * len(FRAMES_METRICS), 4.2))
        FigureCanvasAgg(fig)
        for i, (key, head, _) in enumerate(FRAMES_METRICS):
            ax = fig.add_subplot(1, len(FRAMES_METRICS), i + 1)
            for setting in dict.fromkeys(r["setting"] for r in mine):
                pts = sorted(((r["frames"], _in_percent(key, r["eval"][key])) for r in mine
                              if r["setting"] == setting and r["eval"][key]["n"]), key=lambda p: p[0])
                if not pts:
                    continue
                lo = [0.0 if st["ci95"] is None else st["mean"] - st["ci95"][0] for _, st in pts]
                hi = [0.0 if st["ci95"] is None else st["ci95"][1] - st["mean"] for _, st in pts]
                ax.errorbar([f for f, _ in pts], [st["mean"] for _, st in pts], yerr=[lo, hi], marker="o",
                            capsize=3, label=f"{setting} ({max(st['n'] for _, st in pts)} seeds)")
            ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: short_count(int(x)) if x >= 0 else ""))
            ax.set_xlabel("frames trained")
            ax.set_ylabel(f"{head} (oni-eval)")
            ax.grid(alpha=0.3)
            ax.legend()
        fig.suptitle(f"{task}: by frames trained, mean and 95 % CI over seeds")
        out = Path(root) / task / "by_frames.png"
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=100, bbox_inches="tight")
        written.append(str(out))
    return written


def format_paired(rows: List[dict]) -> List[str]:
    """The paired table's lines (none without a baseline in the grid)."""
    if not rows:
        return []
    width = max(len(f"{r['task']} / {r['setting']} - {r['baseline']}") for r in rows) + 2
    lines = ["", "Paired against the baseline: per seed, success(setting) - success(baseline), the two runs "
                 "trained from the same seed; mean ±half-width of its 95 % CI (Student's t), the exact "
                 "sign-flip p over seeds, seeds won; then the evaluation episodes paired by game "
                 "(both / only the setting / only the baseline succeeded) and McNemar's exact p",
             f"{'task / setting - baseline':<{width}}{'seeds':>6}{'difference':>18}{'CI excl. 0':>12}{'p (seeds)':>11}"
             f"{'won/lost':>10}{'episodes':>10}{'both/only s/only b':>20}{'p (episodes)':>14}"]
    for r in rows:
        d = r["success"]
        diff = _difference_cell(d, 3, star=False)  # the table has its own "CI excl. 0" column
        won = f"{d['wins'][0]}/{d['wins'][1]}"
        e = r["episodes"]
        eps = ("-", "not paired", "-") if e is None else (
            f"{e['pairs']}", f"{e['both']}/{e['only_setting']}/{e['only_baseline']}", f"{e['p']:.3f}")
        lines.append(f"{r['task'] + ' / ' + r['setting'] + ' - ' + r['baseline']:<{width}}{len(r['seeds']):>6}"
                     f"{diff:>18}{'yes' if d['excludes_zero'] else 'no':>12}{d['p']:>11.3f}"
                     f"{won:>10}"
                     f"{eps[0]:>10}{eps[1]:>20}{eps[2]:>14}")
        if e is None and r.get("episodes_unpaired"):
            lines.append(f"  {r['episodes_unpaired']}")
    return lines


def _cell(s: dict, digits: int = 2) -> str:
    """``mean ±half-width`` of a :func:`mean_ci` dict (``-`` without values, no ± for one seed)."""
    if not s or s["n"] == 0:
        return "-"
    text = f"{s['mean']:,.{digits}f}"
    if s["ci95"] is not None:
        text += f" ±{(s['ci95'][1] - s['ci95'][0]) / 2:,.{digits}f}"
    return text


# digits of the evaluation table's cells (progression: in %)
_DIGITS = {"success": 3, "score": 1}


def format_tables(rows: List[dict], per_run: List[dict], args) -> str:
    width = max([len("task / setting")] + [len(f"{r['task']} / {r['setting']}") for r in rows]) + 2
    lines = [f"Evaluation: {args.episodes} episodes per run (oni-eval); mean over seeds ±half-width of its 95 % CI "
             f"(Student's t); {args.frames:,} frames per run",
             f"{'task / setting':<{width}}{'seeds':>6}" + "".join(f"{h:>16}" for _, _, h in EVAL_METRICS)]
    for r in rows:
        cells = "".join(f"{_cell(_in_percent(k, r['eval'][k]), _DIGITS.get(k, 2)):>16}"
                        for k, _, _ in EVAL_METRICS)
        lines.append(f"{r['task'] + ' / ' + r['setting']:<{width}}{len(r['seeds']):>3}/{r['runs']:<2}{cells}")
    heads = [f"{m.split('/')[-1]}@{b:.0%}" for m in args.curve_metrics for b in args.budgets]
    lines += ["", f"Training curve (metrics.csv: mean of the last --stats-window episodes) at a fraction of "
                  f"{args.frames:,} frames; frames trained, wall time of training and evaluation",
              f"{'task / setting':<{width}}" + "".join(f"{h:>16}" for h in heads)
              + f"{'frames':>14}{'train s':>14}{'eval s':>10}"]
    for r in rows:
        cells = "".join(f"{_cell(r['curve'][m][budget_key(b)], 3):>16}" for m in args.curve_metrics for b in args.budgets)
        frames = "-" if r["frames"]["n"] == 0 else f"{r['frames']['mean']:,.0f}"
        train = "-" if r["train_time_s"]["n"] == 0 else f"{r['train_time_s']['mean']:,.0f}"
        ev = "-" if r["eval_time_s"]["n"] == 0 else f"{r['eval_time_s']['mean']:,.1f}"
        lines.append(f"{r['task'] + ' / ' + r['setting']:<{width}}{cells}{frames:>14}{train:>14}{ev:>10}")
    causes = list(_pooled(r["death_causes"] for r in rows))[:4]
    lines += ["", "How the evaluation episodes ended, pooled over the seeds (oni-eval's death causes), and the "
                  "runs whose evaluation printed an `!!` line (reward hacking, a self-inflicted death cause)",
              f"{'task / setting':<{width}}{'episodes':>10}{'deaths':>8}" + "".join(f"{c:>11}" for c in causes)
              + f"{'other':>8}{'flagged runs':>14}"]
    for r in rows:
        deaths = sum(r["death_causes"].values())
        shown = "".join(f"{r['death_causes'].get(c, 0):>11}" for c in causes)
        other = deaths - sum(r["death_causes"].get(c, 0) for c in causes)
        lines.append(f"{r['task'] + ' / ' + r['setting']:<{width}}{r['episodes']:>10}{deaths:>8}{shown}{other:>8}"
                     f"{str(r['flagged_runs']) + '/' + str(len(r['seeds'])):>14}")
    lines += ["", "Runs", f"{'run':<{width + 8}}{'status':<10}{'frames':>12}{'train s':>12}{'eval s':>10}{'success':>10}"]
    for r in per_run:
        name = f"{r['task']}/{r['setting']}/seed{r['seed']}"
        frames = "-" if r["frames"] is None else f"{r['frames']:,}"
        train = "-" if r["train_time_s"] is None else f"{r['train_time_s']:,.0f}"
        ev = "-" if r["eval_time_s"] is None else f"{r['eval_time_s']:,.1f}"
        success = r["eval"].get("success")
        lines.append(f"{name:<{width + 8}}{r['status']:<10}{frames:>12}{train:>12}{ev:>10}"
                     f"{'-' if success is None else f'{success:.3f}':>10}")
    return "\n".join(lines)


def make_figures(runs: List[Run], args) -> List[str]:
    """``ROOT/<task>/curves.png``: each setting's mean curve over seeds with a 95 % band (oni-plot --group)."""
    from torchrl_oni.plot import METRICS_FILE, PlotError, plot_runs

    written = []
    for task in dict.fromkeys(r.task for r in runs):
        dirs = [str(r.logdir) for r in runs if r.task == task and (r.logdir / METRICS_FILE).exists()]
        if not dirs:
            continue
        out = Path(args.root) / task / "curves.png"
        try:
            written.append(str(plot_runs(dirs, out, group=True, smooth=args.smooth,
                                         title=task)))
        except (PlotError, OSError) as err:
            say(f"no figure for {task}: {err}")
    return written


# ---------------------------------------------------------------------- command line
def build_parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(prog=PROG, description=__doc__.split("\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default="runs/sparse_tasks", help="where the run folders go (default: %(default)s)")
    p.add_argument("--archive", type=Path, default=None, metavar="DIR",
                   help="keep each run's evaluations, thinned metrics and last rung's checkpoint in DIR as each rung "
                   "ends (a folder in the repository, to commit), and rebuild missing run folders from it first")
    p.add_argument("--tasks", nargs="+", default=["staircase"], help="oni-train --task values (default: staircase)")
    p.add_argument("--rewards", nargs="+", default=[NONE, "retrieval"],
                   help="intrinsic reward types, 'none' included (default: none retrieval)")
    p.add_argument("--annotators", nargs="+", choices=annotator_names(), default=["llm"],
                   help="annotators of the intrinsic runs (default: llm)")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="seeds (default: 0 1 2)")
    p.add_argument("--frames", type=parse_count, default=parse_count("4M"), help="frames per run, e.g. 4M (default: 4M)")
    p.add_argument("--random", action="store_true",
                   help="add a random-policy row per task and seed: oni-eval of an untrained checkpoint")
    p.add_argument("--extra", default="", metavar="FLAGS", help="oni-train flags for every run, e.g. "
                   "\"--extrinsic-coeff 10 --workers 2\"")
    p.add_argument("--extra-for", nargs=2, action="append", default=[], metavar=("KEY", "FLAGS"),
                   help="oni-train flags for the runs of one reward type, of one annotator (e.g. store "
                        "\"--labels-from L.pt\"), of every intrinsic reward ('intrinsic') or of 'random'; "
                        "repeatable")
    p.add_argument("--variant", nargs=2, action="append", default=[], metavar=("NAME", "FLAGS"),
                   help="every intrinsic setting again with these oni-train flags, as setting '<setting>+NAME' "
                        "(e.g. --variant dp1 \"--death-penalty 1\"); repeatable")
    p.add_argument("--control-variant", action="append", default=[], metavar="NAME",
                   help="run 'none' with the flags of --variant NAME too, as setting 'none+NAME' (what the "
                        "option does without an intrinsic reward); repeatable")
    p.add_argument("--baseline", default=NONE, metavar="SETTING",
                   help="the setting the paired analysis compares every other one with (default: %(default)s; "
                        "e.g. retrieval-scripted to compare its variants with it)")
    p.add_argument("--episodes", type=int, default=64, help="oni-eval episodes per run (default: %(default)s)")
    p.add_argument("--eval-extra", default="", metavar="FLAGS", help="oni-eval flags, e.g. \"--workers 2 --greedy\"")
    p.add_argument("--budgets", nargs="+", type=float, default=[0.25, 0.5, 1.0],
                   help="fractions of --frames at which the training curve is read (default: 0.25 0.5 1)")
    p.add_argument("--curve-metrics", nargs="+", default=["episode/success"], metavar="COLUMN",
                   help="metrics.csv columns read at the budgets (default: episode/success)")
    p.add_argument("--parallel", type=int, default=1, help="commands run at once (default: 1)")
    p.add_argument("--seconds", type=float, default=None, help="start no new command after this many seconds")
    p.add_argument("--status-every", type=float, default=600, metavar="SECONDS",
                   help="say how far each training run has come (frames, frames/s, time left) this often; "
                        "0: never (default: %(default)g)")
    p.add_argument("--smooth", type=int, default=1, help="moving average of the figures' curves, in logged rows")
    p.add_argument("--no-plot", dest="plot", action="store_false", help="no figures")
    p.add_argument("--dry-run", action="store_true", help="list the runs, their state and commands; run nothing")
    return p


# options whose values are oni-train/oni-eval flags: (option, index of the flags among its values)
FLAG_VALUED = {"--extra": 0, "--eval-extra": 0, "--extra-for": 1, "--variant": 1}


def protect_flag_values(argv: Sequence[str]) -> List[str]:
    """``argv`` with a space before each value of :data:`FLAG_VALUED` options: argparse takes a
    lone ``--no-tensorboard`` after ``--extra`` for an option of its own (a value with a space in
    it is left alone, so the space makes it a value; shlex drops it again).

    Example:
        >>> protect_flag_values(["--extra", "--no-tensorboard", "--extra-for", "none", "--lr 1"])
        ['--extra', ' --no-tensorboard', '--extra-for', 'none', ' --lr 1']
    """
    out = list(argv)
    i = 0
    while i < len(out):
        position = FLAG_VALUED.get(out[i])
        if position is not None and i + 1 + position < len(out):
            out[i + 1 + position] = " " + out[i + 1 + position]
            i += 1 + position
        i += 1
    return out


def check_args(args) -> None:
    if args.frames <= 0:
        raise GridError("--frames must be positive")
    if args.parallel < 1:
        raise GridError("--parallel must be at least 1")
    if args.episodes < 1:
        raise GridError("--episodes must be at least 1")
    if args.smooth < 1:
        raise GridError("--smooth must be at least 1")
    if any(not 0 < b <= 1 for b in args.budgets):
        raise GridError("--budgets are fractions of --frames in (0, 1]")
    if args.seconds is not None and args.seconds < 0:
        raise GridError("--seconds must be non-negative")
    if args.status_every < 0:
        raise GridError("--status-every must be non-negative")


def plan(args):
    """The grid with every run's configuration and state; raises GridError on bad flags."""
    check_args(args)
    eval_args = parse_eval_flags(args)
    runs = build_grid(args)
    settings = list(dict.fromkeys(r.setting for r in runs))
    if args.baseline != NONE and args.baseline not in settings:
        raise GridError(f"--baseline {args.baseline!r} is not a setting of this grid ({', '.join(settings)})")
    for run in runs:
        run.config = parse_train_flags(run)
        if args.archive is not None:
            restored = grid_archive.restore(args.archive, run.logdir)
            if restored:
                say(f"{run.name}: rebuilt from {args.archive} ({', '.join(restored)})")
        update_status(run, eval_args)
        if args.archive is not None and run.status == "done" and not args.dry_run:
            grid_archive.save(run.logdir, args.archive)  # a rung finished before --archive was given
    return runs, eval_args


def dry_run(runs: List[Run], args) -> int:
    counts: Dict[str, int] = {}
    width = max(len(r.name) for r in runs) + 2
    print(f"{'run':<{width}}{'state':<10}what it needs")
    listed = []
    for run in runs:
        counts[run.status] = counts.get(run.status, 0) + 1
        if run.status in ("train", "resume"):
            what = display_command(TRAIN_MODULE, run.train_args + (["--resume"] if run.status == "resume" else []))
            what += " && " + display_command(EVAL_MODULE, eval_command(run, args))
        elif run.status == "create":
            what = "an untrained checkpoint (Trainer.from_config(cfg, intrinsic=False).save()) && "
            what += display_command(EVAL_MODULE, eval_command(run, args))
        elif run.status == "eval":
            what = display_command(EVAL_MODULE, eval_command(run, args))
        elif run.status == "conflict":
            what = f"refused: {run.detail}"
        else:
            what = "nothing"
        if run.detail and run.status != "conflict":
            what = f"({run.detail}) {what}"
        print(f"{run.name:<{width}}{run.status:<10}{what}")
        listed.append({"run": run.name, "logdir": str(run.logdir), "status": run.status, "detail": run.detail,
                       "frames": run.frames})
    print(json.dumps({"benchmark": "sparse_tasks", "dry_run": True, "counts": counts, "runs": listed}))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    import logging

    logging.getLogger("torchrl").setLevel(logging.WARNING)  # its INFO lines would go to stdout
    t0 = time.perf_counter()
    try:
        args = build_parser().parse_args(protect_flag_values(sys.argv[1:] if argv is None else argv))
    except SystemExit as stop:
        return int(stop.code or 0)
    args.extra, args.eval_extra = args.extra.strip(), args.eval_extra.strip()
    args.extra_for = [(key, flags.strip()) for key, flags in args.extra_for]
    try:
        runs, eval_args = plan(args)
    except GridError as err:
        return report(PROG, str(err))
    if args.dry_run:
        return dry_run(runs, args)
    conflicts = [r for r in runs if r.status == "conflict"]
    if conflicts:
        r = conflicts[0]
        more = f" (and {len(conflicts) - 1} more; see --dry-run)" if len(conflicts) > 1 else ""
        return report(PROG, f"{r.logdir} holds another run: {r.detail}; use another --root{more}")

    launcher = Launcher(args.parallel, args.seconds)
    todo = [r for r in runs if r.status != "done"]
    kinds = [f"{s} {sum(r.status == s for r in todo)}" for s in ("train", "resume", "eval", "create")
             if any(r.status == s for r in todo)]
    say(f"{len(runs)} runs, {len(runs) - len(todo)} done, {len(todo)} to go" + (f" ({', '.join(kinds)})" if kinds else ""))
    with forward_signals(launcher):
        for run in (r for r in todo if r.status == "create"):
            if not launcher.may_start():
                run.outcome = "not started"
                continue
            say(f"{run.name}: writing an untrained checkpoint")
            create_untrained(run)
            launcher.launched["create"] += 1
            run.status = "eval"
        first = [r for r in todo if r.status in ("train", "resume", "eval")]
        run_pool(first, launcher, args, eval_args, final=False)
        waiting = [r for r in first if r.outcome == "waiting"]
        if waiting:
            run_pool(waiting, launcher, args, eval_args, final=True)
    for run in runs:
        update_status(run, eval_args)
    failed = [r for r in runs if r.outcome == "failed"]
    per_run = [collect_run(r, args) for r in runs]
    rows = aggregate(per_run, args)
    paired_rows = paired(per_run, args.baseline)
    frames_rows = by_frames(per_run, args.baseline)
    figures = make_figures(runs, args) if args.plot else []
    if args.plot and frames_rows:
        figures += plot_by_frames(frames_rows, args.root)
    print("\n".join([format_tables(rows, per_run, args)] + format_paired(paired_rows) + format_by_frames(frames_rows)))
    summary = {
        "benchmark": "sparse_tasks",
        "root": str(args.root),
        "grid": {"tasks": args.tasks, "rewards": args.rewards, "annotators": args.annotators, "seeds": args.seeds,
                 "random": args.random, "frames": args.frames, "episodes": args.episodes, "extra": args.extra,
                 "extra_for": [list(x) for x in args.extra_for], "variants": [list(x) for x in args.variant],
                 "control_variants": args.control_variant,
                 "eval_extra": args.eval_extra, "baseline": args.baseline},
        "budgets": args.budgets,
        "rows": rows,
        "paired": paired_rows,
        "by_frames": frames_rows,
        "runs": per_run,
        "launched": launcher.launched,
        "done": sum(r.status == "done" for r in runs),
        "failed": [r.name for r in failed],
        "not_started": [r.name for r in runs if r.outcome == "not started"],
        "figures": figures,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    print(json.dumps(summary))
    if launcher.stopped_by is not None:
        return 128 + launcher.stopped_by
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
