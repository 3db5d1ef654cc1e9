"""The command line of ``benchmarks/sparse_tasks.py``: its flags, their checks, the plan (every run
and its state), ``--dry-run``, and :func:`main`, which runs the grid and prints its tables and JSON line.

For whoever adds or changes a flag; the top layer of :mod:`sparse_grid`.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import grid_archive
from sparse_grid.analysis import aggregate, by_frames, collect_run, paired, read_seed_summaries
from sparse_grid.grid import (EVAL_MODULE, NONE, TRAIN_MODULE, GridError, Run, build_grid, eval_command,
                              parse_eval_flags, parse_train_flags, say, update_status)
from sparse_grid.launcher import Launcher, create_untrained, display_command, forward_signals, run_pool
from sparse_grid.report import format_by_frames, format_paired, format_tables, make_figures, plot_by_frames
from torchrl_oni.cli_errors import OneLineArgumentParser, report
from torchrl_oni.config_tree import parse_count
from torchrl_oni.train.annotator_types import annotator_names  # (no torch: --help stays fast)

PROG = "sparse_tasks.py"
# --help's description: the first line of benchmarks/sparse_tasks.py's docstring
DESCRIPTION = "Sparse tasks and the reward-free setting: a grid of oni-train runs, evaluated, aggregated over seeds."


def build_parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(prog=PROG, description=DESCRIPTION,
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
    p.add_argument("--seed-summaries", type=Path, default=None, metavar="FILE",
                   help="a JSON list of seed pairs known only by their figures (their run folders gone), "
                        "joined to the paired analysis at their frames (sparse_grid/analysis.py)")
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
        args.summaries = read_seed_summaries(args.seed_summaries) if args.seed_summaries else []
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
    paired_rows = paired(per_run, args.baseline, args.summaries)
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
                 "eval_extra": args.eval_extra, "baseline": args.baseline,
                 "seed_summaries": str(args.seed_summaries) if args.seed_summaries else None},
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
