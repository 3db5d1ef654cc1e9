"""``oni-train``: PPO on ONI's NetHack tasks, with or without LLM intrinsic rewards.

Every flag comes from :class:`~torchrl_oni.train.config.TrainConfig` (its declarations are the
help text); ``--help`` lists them by section. Flags apply on top of a base configuration: the
defaults, ``--preset oni``, ``--config FILE`` (e.g. another run's ``config.yaml``) or, with
``--resume``, the run's own ``config.yaml``.

Run folders are never overwritten: without ``--logdir`` each run gets a new folder,
``runs/oni-YYYYmmdd-HHMMSS`` (``-2``, ``-3``... when two start in the same second), named on
stderr at the start and in the summary; a ``--logdir`` (or a ``--config`` file's ``logdir``) that
already holds a run (a ``checkpoint.pt`` or a non-empty ``metrics.csv``) is refused with one line
and exit code 2 unless ``--resume`` (continue it) or ``--overwrite`` (delete it and start over)
is given. ``--resume`` without ``--logdir`` continues the newest ``runs/oni-*`` run (the one whose
checkpoint was written last) and names it.

Examples::

    oni-train                                   # a few CPU minutes on Score, extrinsic reward only
    oni-train --task oracle --frames 2e6 --workers 8 --envs-per-worker 32
    oni-train --config runs/oni-20250612-101500/config.yaml --seed 1 --logdir runs/seed1   # the same run, another seed
    oni-train --resume --logdir runs/oni-20250612-101500   # continue from its checkpoint.pt
    oni-train --resume                          # continue the newest runs/oni-* run
    oni-train --logdir runs/a --overwrite       # start runs/a over, deleting the run it holds

Bad flags, unknown task names, impossible sizes, unreadable checkpoints and dead servers end with
one ``oni-train: error: ...`` line and exit code 2. SIGINT, SIGTERM and SIGUSR1 (what SLURM sends
before preemption) save a checkpoint and the caption store, then exit with 128 + the signal
number; ``--resume`` continues.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from typing import List, Optional, Tuple

from ..cli_errors import OneLineArgumentParser, fail, one_line
from ..config_tree import add_arguments, apply_arguments
from ..worker_start import use_forkserver
from .config import CONFIG_NAME, PRESETS, TrainConfig

PROG = "oni-train"


def build_parser(defaults: Optional[TrainConfig] = None) -> OneLineArgumentParser:
    """The ``oni-train`` parser, generated from :class:`TrainConfig` (``defaults`` only changes
    what ``--help`` shows)."""
    p = OneLineArgumentParser(prog=PROG, usage="%(prog)s [--config FILE | --preset NAME] [--resume [CHECKPOINT]] [FLAG ...]",
                              description="Train a NetHack agent with PPO and ONI intrinsic rewards. "
                              "Flags apply on top of --preset / --config / the resumed run's config.yaml.")
    p.add_argument("--config", metavar="FILE", help="YAML configuration to start from, e.g. a run's config.yaml")
    p.add_argument("--preset", choices=sorted(PRESETS), help="configuration to start from; 'oni': the paper's "
                   "optimiser settings and GRU policy (default: default)")
    p.add_argument("--quiet", action="store_true", help="no summary on stdout")
    p.add_argument("--check-judge", action="store_true",
                   help="only ask the annotator (--annotator, --llm-url, --llm-prompt, --goal) a dozen captions with "
                   "known answers, say how it did and exit: 0 if its labels can make an ONI reward, 1 if not")
    add_arguments(p, TrainConfig, defaults=defaults)
    return p


def _read_config_file(path: str) -> TrainConfig:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as err:
        raise ValueError(f"--config {path}: {err.strerror or err}") from None
    try:
        return TrainConfig.from_yaml(text)
    except Exception as err:  # yaml errors, unknown settings: one line either way
        raise ValueError(f"--config {path}: {one_line(str(err))}") from None


def _file_names_logdir(path: str) -> bool:
    """Whether the configuration file ``path`` (already read by :func:`_read_config_file`, so
    valid and alias-bounded YAML) sets ``logdir``, nested under ``log`` or flat."""
    import yaml

    with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f) or {}
    return isinstance(data, dict) and ("logdir" in data or "logdir" in (data.get("log") or {}))


def _folder_to_resume(resume: str, stem: str) -> str:
    """The run a ``--resume`` without ``--logdir`` continues: the given checkpoint's folder, or
    the newest ``STEM``/``STEM-*`` run; ValueError when there is none."""
    from ..run_folder import CHECKPOINT_NAME, newest_run

    if resume != "auto":
        return os.path.dirname(resume) or "."
    found = newest_run(stem)
    if found is None:
        raise ValueError(f"--resume: no run to continue: neither {stem} nor any {stem}-* holds a {CHECKPOINT_NAME} "
                         f"(give --logdir RUN)")
    return found


def parse_command(argv: Optional[List[str]] = None) -> Tuple[TrainConfig, argparse.Namespace]:
    """The configuration ``oni-train argv`` runs (flags on top of their base; :func:`main`
    resolves it) and the parsed flags; exits 2 on bad input. ``args.logdir_given`` says whether
    the run folder was named (``--logdir`` or a ``--config`` file's ``logdir``): if not,
    :func:`main` makes a new one."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.config and args.preset:
            raise ValueError("give --config or --preset, not both")
        args.logdir_given = hasattr(args, "logdir")
        resuming = getattr(args, "resume", None)
        if args.config:
            base = _read_config_file(args.config)
            args.logdir_given = args.logdir_given or _file_names_logdir(args.config)
        elif args.preset:
            base = PRESETS[args.preset]
        else:
            base = TrainConfig()
        if resuming and not args.logdir_given:
            # the default folder is only a stem now (every run has its own folder): continue the
            # run the user most likely means, and say which
            args.logdir = _folder_to_resume(resuming, base.log.logdir)
            args.logdir_given = True
            which = "the newest run folder" if resuming == "auto" else "the folder of that checkpoint"
            # printed by main() once the run starts: a start that fails says one line only
            args.folder_note = f"--resume: continuing {args.logdir} ({which}; --logdir RUN continues another)"
        if not args.config and not args.preset:
            logdir = getattr(args, "logdir", base.log.logdir)
            run_config = os.path.join(logdir, CONFIG_NAME)
            if resuming and os.path.exists(run_config):
                base = _read_config_file(run_config)  # continue with the run's own settings
                base.log.logdir = logdir
        cfg = apply_arguments(base, args)
    except ValueError as err:
        fail(PROG, str(err))
    for line in guard_api_key(cfg.annotation, from_command_line=hasattr(args, "llm_url")):
        sys.stderr.write(f"{PROG}: warning: {line}\n")
    return cfg, args


def guard_api_key(ann, from_command_line: bool) -> List[str]:
    """Keeps the user's API key with the servers the user named: ``OPENAI_API_KEY`` is not sent
    to ``--llm-url`` servers read from a file (``--config``, a resumed run's config.yaml) unless
    ``--llm-url`` is given again on the command line; a key that would cross a network in plain
    http is warned about. Returns the warnings; may set ``llm_api_key`` to ``""`` (no key).

    ``ann`` is the ``annotation`` section of the configuration (all ``oni-annotate-pairs`` has)."""
    from urllib.parse import urlsplit

    from ..annotators.endpoints import API_KEY_ENV
    from ..net import is_loopback

    if not ann.llm_url:
        return []
    lines = []
    if ann.llm_api_key is None and os.environ.get(API_KEY_ENV) and not from_command_line:
        ann.llm_api_key = ""  # no Authorization header
        lines.append(f"{API_KEY_ENV} is not sent to {', '.join(ann.llm_url)}: that URL comes from a file, not from "
                     f"this command line; give --llm-url again (or --llm-api-key) to send a key there")
    key = ann.llm_api_key if ann.llm_api_key is not None else os.environ.get(API_KEY_ENV)
    if key:
        for url in ann.llm_url:
            parts = urlsplit(url)
            if parts.scheme == "http" and not is_loopback(parts.hostname or ""):
                lines.append(f"the API key goes to {url} over plain http: anyone on the path can read it (use https, "
                             f"or an SSH tunnel to a loopback port)")
    return lines



def _check_startable(cfg: TrainConfig) -> None:
    """Everything that can be checked before any process starts; raises ValueError."""
    from ..run_folder import CHECKPOINT_NAME
    from .backends import check_backend_settings

    cfg.validate()
    check_backend_settings(cfg.distributed)
    resume = cfg.log.resume
    if resume and cfg.log.overwrite:
        raise ValueError("give --resume (continue the run) or --overwrite (start it over), not both")
    if resume == "auto" and not os.path.exists(os.path.join(cfg.log.logdir, CHECKPOINT_NAME)):
        raise ValueError(f"--resume: no checkpoint in {cfg.log.logdir} (pass --logdir of the run to continue)")
    if resume not in (None, "auto") and not os.path.exists(resume):
        raise ValueError(f"--resume: no such checkpoint {resume}")


def _paths_read(cfg: TrainConfig) -> List[str]:
    """Every setting's value that names an existing file or folder: what ``--overwrite`` must not
    delete from the run folder (a ``--labels-from`` or ``--caption-store`` kept there)."""
    from ..config_tree import leaves

    out = []
    for leaf in leaves(TrainConfig):
        value = leaf.get(cfg)
        for item in value if isinstance(value, tuple) else (value,):
            if isinstance(item, str) and item and os.path.exists(item):
                out.append(item)
    return out


def settle_run_folder(cfg: TrainConfig, given: bool) -> Optional[str]:
    """Makes sure this start destroys no run: sets ``cfg.log.logdir`` to a new folder when none was
    ``given`` (returns it), clears a given folder's run on ``--overwrite`` (saying so on stderr at
    once: files are gone), and raises ValueError (one sentence) for a given folder that holds a
    run without ``--resume`` or ``--overwrite``."""
    from ..run_folder import clear_run, holds_run, new_run_folder

    log = cfg.log
    if log.resume:
        return None  # continuing that run is what was asked
    if not given:
        log.logdir = new_run_folder(log.logdir)
        return log.logdir
    found = holds_run(log.logdir)
    if found is None:
        return None  # empty, new, or only a config.yaml / a job's log in it: nothing to lose
    if not log.overwrite:
        raise ValueError(f"{log.logdir} already holds a run ({found}): --resume continues it, --overwrite deletes "
                         f"it and starts over, another --logdir keeps it")
    removed = clear_run(log.logdir, keep=_paths_read(cfg))
    sys.stderr.write(f"{PROG}: --overwrite: deleted the run in {log.logdir} ({', '.join(removed)})\n")
    return None


def main(argv: Optional[List[str]] = None) -> int:
    made: List[str] = []  # the new run folder this start made, if any
    try:
        return _main(argv, made)
    finally:
        # a start that failed before writing anything leaves no empty folder behind
        for folder in made:
            try:
                os.rmdir(folder)  # only succeeds when it is empty
            except OSError:
                pass


def _main(argv: Optional[List[str]], made: List[str]) -> int:
    cfg, args = parse_command(argv)
    try:
        # every derived value, computed here once (device, coefficients, prefetch, the reward
        # model's schedule): what every part of the run reads and config.yaml records
        cfg = cfg.resolved()
        _check_startable(cfg)
    except (ValueError, RuntimeError) as err:  # RuntimeError: a --device torch does not know
        fail(PROG, str(err))
    use_forkserver()  # env workers start as forks of one process that imported torch, TorchRL and NLE once
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("torchrl").setLevel(logging.WARNING)  # its INFO lines (storage sizes) would go to stdout
    logging.getLogger("torchrl_oni").setLevel(logging.INFO)  # what the run is doing: LLM start-up, resume
    from .build import build_run
    from .checkpoint import CheckpointError
    from .run_log import MetricsFileError
    from .ppo import Trainer, TrainingStopped
    from .workers import EnvWorkerError

    if args.check_judge:
        return _check_judge(cfg)
    try:
        made.extend(filter(None, [settle_run_folder(cfg, given=getattr(args, "logdir_given", True))]))
    except (ValueError, OSError) as err:  # OSError: a run folder that cannot be made or cleared
        fail(PROG, str(err) if isinstance(err, ValueError) else f"run folder {cfg.log.logdir}: {err.strerror or err}")
    folder_note = getattr(args, "folder_note", None)
    if made:
        folder_note = f"run folder {made[0]} (new for this run; --logdir chooses one)"
    try:
        # each closes what it started when it fails: nothing outlives a run that never started
        trainer = Trainer(build_run(cfg), cfg.ppo, cfg.log)
    except (ValueError, RuntimeError, OSError, CheckpointError) as err:  # OSError: dead server, unwritable logdir
        fail(PROG, str(err))
    if folder_note:
        sys.stderr.write(f"{PROG}: {folder_note}\n")
    try:
        summary = trainer.train()
    except TrainingStopped as stop:
        name = signal.Signals(stop.signum).name
        if stop.summary is not None and not args.quiet:  # what the run did until now: the moment a user wants it
            _print_summary(cfg, stop.summary, stopped_by=name)
        sys.stderr.write(f"\n{name}: checkpoint and caption store saved to {trainer.run_dir}; "
                         f"continue with: {PROG} --resume --logdir {trainer.run_dir}\n")
        return 128 + stop.signum
    except MetricsFileError as err:  # found before any training step (the hooks are closed by then)
        fail(PROG, str(err))
    except EnvWorkerError as err:  # workers that cannot start, or kept dying (checkpoint saved)
        fail(PROG, f"{err}; the checkpoint is saved, continue with: {PROG} --resume --logdir {trainer.run_dir}"
             if trainer.frames else str(err), code=1)
    except (ConnectionError, TimeoutError) as err:  # a Ray cluster gone, every env worker dead
        fail(PROG, f"training stopped: {err}; the checkpoint is saved, continue with --resume", code=1)
    except OSError as err:  # disk full while checkpointing, logdir gone: the last good checkpoint stays
        fail(PROG, f"{err.strerror or err} ({getattr(err, 'filename', '') or trainer.run_dir}); "
                   f"the last complete checkpoint is kept", code=1)
    if not args.quiet:
        _print_summary(cfg, summary)
    return 0


def _check_judge(cfg: TrainConfig) -> int:
    """``oni-train --check-judge``: the calibration probe alone (see torchrl_oni/annotators/probe.py)."""
    from .annotator_types import get_annotator
    from .labelling import check_judge, make_annotator

    if not get_annotator(cfg.annotation.annotator).answers:
        fail(PROG, f"--check-judge asks the annotator, and --annotator {cfg.annotation.annotator} answers nothing: "
                   f"probe the LLM that made the --labels-from labels (--check-judge --llm-url URL)")
    try:
        annotator, server = make_annotator(cfg.annotation, seed=cfg.seed)
    except (ValueError, RuntimeError, OSError) as err:
        fail(PROG, str(err))
    try:
        report = check_judge(annotator, cfg.annotation.goal)
    finally:
        if server is not None:
            server.stop()
    if report is None:
        fail(PROG, "the judge probe could not be asked (see the warning above)", code=1)
    print(report.summary())
    problem = report.problem()
    print(f"!! {problem}" if problem else "the judge separates progress from its absence: its labels can make an "
                                          "ONI reward")
    return 1 if problem else 0


def _print_summary(cfg: TrainConfig, summary: dict, stopped_by: Optional[str] = None) -> None:
    keys = [("frames", "frames", "{:,.0f}"), ("fps", "frames/s", "{:,.0f}"), ("episodes", "episodes", "{:,.0f}"),
            ("episode/return", "return (last 100 episodes)", "{:.2f}"), ("episode/length", "episode length", "{:.0f}"),
            ("episode/dlvl", "dungeon level", "{:.2f}"), ("episode/xlvl", "experience level", "{:.2f}"),
            ("episode/success", "success rate", "{:.3f}"), ("reward/intrinsic_mean", "intrinsic reward / step", "{:.3g}"),
            ("intrinsic/rewarded_fraction_run", "steps paid (whole run)", "{:.2%}"),
            ("labels/seen_coverage", "labelled (share of steps)", "{:.1%}"),
            ("labels/caption_coverage", "labelled (distinct captions)", "{:.1%}"),
            ("ellm/goal_coverage", "steps whose state has goals", "{:.1%}"),
            ("ellm/states_with_goals", "states with goals", "{:,.0f}"), ("ellm/states", "states seen", "{:,.0f}"),
            ("labels/seen_captions", "captions seen", "{:,.0f}"),
            ("labels/seen_labelled", "… of them labelled", "{:,.0f}"),
            ("annotation/queue_depth", "captions waiting for a label", "{:,.0f}"),
            ("collect_fraction", "time waiting for envs", "{:.0%}")]
    if summary.get("labels/seen_captions"):
        summary = {**summary, "labels/caption_coverage": summary.get("labels/seen_labelled", 0) / summary["labels/seen_captions"]}
    stopped = f", stopped by {stopped_by}" if stopped_by else ""
    print(f"\n== {PROG}: {cfg.env.task}, {cfg.reward.intrinsic_reward} intrinsic reward{stopped} ==")
    for key, label, fmt in keys:
        if key in summary:
            print(f"  {label:<28} {fmt.format(summary[key])}")
    print(f"  {'run folder':<28} {cfg.log.logdir}")
    print(f"  {'checkpoint':<28} {summary.get('checkpoint')}")
    for line in summary.get("notes", ()):
        print(f"  {line}")
    for line in summary.get("warnings", ()):
        print(f"  !! {line}")
    print(json.dumps({k: v for k, v in summary.items() if isinstance(v, (int, float))}))


if __name__ == "__main__":
    sys.exit(main())
