"""The grid: its runs (tasks x settings x seeds, each an ``oni-train`` flag set and a run folder) and
the state of each run's folder (done, to evaluate, to continue, to train, or another run's).

For whoever changes what a grid is or when a run counts as done; the bottom layer of
:mod:`sparse_grid`, which the other modules import. Also :func:`say`, the progress lines on stderr.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import re
import shlex
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from torchrl_oni.train.annotator_types import annotator_names  # (no torch: --help stays fast)

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
    # a run stops at the first update past its budget; one trained a whole update or more past it
    # was trained for a later budget (a ladder's next rung, stopped): evaluating it now would judge
    # another policy as this budget's, and replace this budget's evaluation
    update = getattr(run.config, "frames_per_update", 0) or 0
    if run.target_frames and frames >= run.target_frames + max(update, 1):
        return "conflict", (f"trained to {frames:,} frames, past --frames {run.target_frames:,} (a later budget's "
                            f"run): continue it with --frames {frames:,} or more"), frames
    return "eval", "", frames


def update_status(run: Run, eval_args: argparse.Namespace) -> str:
    """Sets ``run.status``, ``run.detail`` and ``run.frames`` from its folder (:func:`inspect_run`)."""
    run.status, run.detail, run.frames = inspect_run(run, eval_args)
    return run.status


# ---------------------------------------------------------------------- progress lines
_print_lock = threading.RLock()  # reentrant: a signal handler may print while the main thread does


def say(line: str) -> None:
    """Progress goes to stderr: stdout holds the tables and the JSON line."""
    with _print_lock:
        print(f"[{time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)
