"""The grid's tables and figures: the evaluation, training-curve, death-cause, per-run, paired and
by-frames tables printed on stdout, and the PNG figures under ``ROOT/<task>/``.

For whoever changes what a reader of the results sees; it formats :mod:`sparse_grid.analysis`'s rows.
"""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

from sparse_grid.analysis import EVAL_METRICS, FRAMES_METRICS, _pooled, budget_key
from sparse_grid.grid import Run, say


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
        for seed, source in zip(r.get("summary_seeds", ()), r.get("summary_sources", ())):
            lines.append(f"  seed {seed}: from its summary ({source})")
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
