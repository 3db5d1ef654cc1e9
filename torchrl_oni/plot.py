"""``oni-plot``: learning curves of one or several runs, side by side, in one PNG.

Each run folder written by ``oni-train`` (or :class:`~torchrl_oni.train.Trainer`) holds a
``metrics.csv`` with one row per PPO iteration. This module draws, for every run given, the
panels that have data in at least one of them:

===========================  ==========================================================
panel                        columns
===========================  ==========================================================
episode return               ``episode/return``
success rate                 ``episode/success``
dungeon / experience level   ``episode/dlvl`` (solid) and ``episode/xlvl`` (dashed)
intrinsic reward             ``reward/intrinsic_mean``
label coverage               ``annotation/coverage``, ``coverage`` or any ``*/coverage``
===========================  ==========================================================

against ``frames`` or wall time (``time_s``), optionally smoothed with a trailing moving
average. Each run is one colour, named after its folder in a legend shared by all panels.
Figures are built with matplotlib's object API on the Agg canvas, so nothing needs a display
and the pyplot state of a notebook is left alone.

Seed bands. ``--group`` puts runs that share a parent folder (``exp/retrieval/seed0``,
``exp/retrieval/seed1``: group ``retrieval``) into one curve; ``--group-by REGEX`` names a run's
group by the regular expression's first capture group (or whole match) in its path instead. A
group is drawn as the mean of its runs' curves with a shaded 95 % confidence band of that
mean (Student's t over runs, :func:`seed_band`). Runs log at different frames, so each run's
(smoothed) curve is interpolated linearly onto a common grid: every x at which any run of the
group logged, within the range that **all** of them cover (no extrapolation: the band stops where
the shortest run stops). A group of one run is its curve, without a band.

Usage::

    oni-plot runs/retrieval runs/none -o curves.png --smooth 5
    oni-plot runs/oni-20250612-101500 --x time_s
    oni-plot runs/staircase/*/seed* --group -o staircase.png     # one band per reward type
    oni-plot runs/*/seed* --group-by '(\\w+)/seed\\d+$'

A missing folder, a folder without ``metrics.csv`` or a run with nothing to plot ends with one
``oni-plot: error: ...`` line and exit status 2.

Example:
    >>> import os, tempfile
    >>> from torchrl_oni.plot import plot_runs
    >>> run = os.path.join(tempfile.mkdtemp(), "demo")
    >>> os.makedirs(run)
    >>> with open(os.path.join(run, "metrics.csv"), "w") as f:
    ...     _ = f.write("frames,time_s,episode/return\\n512,1.0,0.5\\n1024,2.0,1.5\\n")
    >>> out = plot_runs([run], os.path.join(run, "curves.png"))
    >>> open(out, "rb").read(8) == b"\\x89PNG\\r\\n\\x1a\\n"
    True
"""
from __future__ import annotations

import argparse
import csv
import math
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from torchrl_oni.cli_errors import OneLineArgumentParser, one_line, overwritten_input, report
from torchrl_oni.run_folder import METRICS_NAME as METRICS_FILE
from torchrl_oni.stats import t_quantile_975

__all__ = ["PANELS", "Panel", "PlotError", "Band", "load_run", "group_runs", "seed_band", "make_figure",
           "plot_runs", "main"]

PROG = "oni-plot"
X_AXES = {"frames": "env frames", "time_s": "wall time (s)"}


class PlotError(ValueError):
    """Bad input for a plot (missing folder, no ``metrics.csv``, nothing to draw).

    Example:
        >>> from torchrl_oni.plot import PlotError, plot_runs
        >>> try:
        ...     plot_runs(["/no/such/run"], "x.png")
        ... except PlotError as err:
        ...     print(err)
        no such run folder: /no/such/run
    """


@dataclass(frozen=True)
class Panel:
    """One subplot: a title, a y label and the columns drawn in it (one line style each).

    Example:
        >>> from torchrl_oni.plot import PANELS
        >>> [p.title for p in PANELS if "episode/dlvl" in p.columns]
        ['Depth and experience']
    """

    title: str
    ylabel: str
    columns: Tuple[str, ...]
    styles: Tuple[str, ...] = ("-",)
    ylim: Optional[Tuple[float, float]] = None


PANELS: Tuple[Panel, ...] = (
    Panel("Episode return", "return (extrinsic)", ("episode/return",)),
    Panel("Success rate", "fraction of episodes", ("episode/success",), ylim=(-0.02, 1.02)),
    Panel("Depth and experience", "dlvl (solid), xlvl (dashed)",
          ("episode/dlvl", "episode/xlvl"), ("-", "--")),
    Panel("Intrinsic reward", "mean per step", ("reward/intrinsic_mean",)),
    Panel("Label coverage", "steps with a labelled caption", ("coverage",), ylim=(-0.02, 1.02)),
)

RunData = Dict[str, np.ndarray]


def _metrics_path(run: Union[str, os.PathLike]) -> Path:
    path = Path(run)
    if path.is_file() and path.name.endswith(".csv"):
        return path
    if not path.exists():
        raise PlotError(f"no such run folder: {path}")
    if not path.is_dir():
        raise PlotError(f"{path} is neither a run folder nor a metrics .csv file")
    csv_path = path / METRICS_FILE
    if not csv_path.is_file():
        raise PlotError(f"{path} has no {METRICS_FILE} (is it an oni-train run folder?)")
    return csv_path


def load_run(run: Union[str, os.PathLike]) -> RunData:
    """Reads a run folder's ``metrics.csv`` into ``{column: float64 array}`` (NaN where empty).

    Raises:
        PlotError: the folder or its ``metrics.csv`` is missing, or the file has no rows.
    """
    csv_path = _metrics_path(run)
    try:
        with open(csv_path, newline="") as f:
            reader = csv.reader(f)
            header = next(reader, None)
            rows = [row for row in reader if row]
    except (OSError, UnicodeDecodeError, csv.Error) as err:
        raise PlotError(f"cannot read {csv_path}: {err}") from None
    if not header or not rows:
        raise PlotError(f"{csv_path} has no rows yet")
    # Read here rather than with train.run_log.read_metrics: that import pulls in torch and
    # TorchRL (seconds), and a cell that is not a number is better drawn as a gap than fatal.
    return {
        name: np.array([_number(row[i]) if i < len(row) else math.nan for row in rows])
        for i, name in enumerate(header)
    }


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return {"true": 1.0, "false": 0.0}.get(text.strip().lower(), math.nan)


def _coverage_column(data: RunData) -> Optional[str]:
    for name in ("annotation/coverage", "coverage"):
        if name in data:
            return name
    matches = sorted(c for c in data if c.endswith("/coverage") and "seen" not in c)
    return matches[0] if matches else None


def _column(data: RunData, name: str) -> Optional[str]:
    if name == "coverage":
        return _coverage_column(data)
    return name if name in data else None


def _smooth(y: np.ndarray, window: int) -> np.ndarray:
    """Trailing moving average over the finite values (NaNs stay NaN)."""
    if window <= 1:
        return y
    out = np.full_like(y, np.nan)
    finite = np.isfinite(y)
    values = y[finite]
    if values.size == 0:
        return out
    csum = np.cumsum(np.insert(values, 0, 0.0))
    idx = np.arange(1, values.size + 1)
    lo = np.maximum(0, idx - window)
    out[finite] = (csum[idx] - csum[lo]) / (idx - lo)
    return out


def _series(data: RunData, column: str, x: str, smooth: int) -> Tuple[np.ndarray, np.ndarray]:
    xs, ys = data[x], data[column]
    keep = np.isfinite(xs) & np.isfinite(ys)
    return xs[keep], _smooth(ys[keep], smooth)


def _labels(paths: Sequence[Path]) -> List[str]:
    """The folder names; parent folders are added where two runs would share a name."""
    parts = [p.resolve().parts for p in paths]
    depth = 1
    while True:
        labels = ["/".join(p[-depth:]) for p in parts]
        if len(set(labels)) == len(labels) or depth >= max(len(p) for p in parts):
            return labels
        depth += 1


def _run_folder(path: Path) -> Path:
    return path.parent if path.is_file() else path


def group_runs(run_dirs: Sequence[Union[str, os.PathLike]],
               by: Union[bool, str] = True) -> List[Tuple[str, List[int]]]:
    """Groups runs for seed bands: ``[(group name, [indices into run_dirs]), ...]`` in order of first appearance.

    Args:
        run_dirs: run folders (or their ``metrics.csv`` paths).
        by: ``True``: by parent folder (named by its folder name, with its own parents added where
            two parents would share a name); a string: a regular expression searched in each run's
            path (``/`` separators), whose first capture group, or else whole match, names the group.

    Raises:
        PlotError: the expression is invalid or does not match a run.

    Example:
        >>> from torchrl_oni.plot import group_runs
        >>> runs = ["exp/retrieval/seed0", "exp/none/seed0", "exp/retrieval/seed1"]
        >>> group_runs(runs)
        [('retrieval', [0, 2]), ('none', [1])]
        >>> group_runs(["a/s0", "b/s0", "a/s1"], by=r"^(\\w)/")
        [('a', [0, 2]), ('b', [1])]
    """
    paths = [_run_folder(Path(r)) for r in run_dirs]
    if by is True:
        parents = [p.resolve().parent for p in paths]
        distinct = list(dict.fromkeys(parents))
        names = dict(zip(distinct, _labels(distinct)))
        keys = [names[p] for p in parents]
    else:
        try:
            pattern = re.compile(str(by))
        except re.error as err:
            raise PlotError(f"--group-by {by!r} is not a regular expression ({err})") from None
        keys = []
        for path in paths:
            match = pattern.search(path.as_posix())
            if match is None:
                raise PlotError(f"--group-by {by!r} does not match {path.as_posix()}")
            keys.append(match.group(1) if pattern.groups else match.group(0))
    groups: Dict[str, List[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    return list(groups.items())


@dataclass(frozen=True)
class Band:
    """The mean curve of several runs and its 95 % confidence band, on a common x grid.

    ``lo``/``hi`` equal ``mean`` where there is one run (no spread to show).
    """

    x: np.ndarray
    mean: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    n: int


def seed_band(curves: Sequence[Tuple[np.ndarray, np.ndarray]]) -> Band:
    """Mean and Student-t 95 % interval over runs of ``curves`` (``(x, y)`` pairs, x increasing).

    The grid is every x of any curve inside the range all curves cover; each curve is
    interpolated linearly onto it (:func:`numpy.interp`).

    Raises:
        PlotError: no curve, or curves whose x ranges do not overlap.

    Example:
        >>> import numpy as np
        >>> from torchrl_oni.plot import seed_band
        >>> band = seed_band([(np.array([0., 2., 4.]), np.array([0., 2., 4.])),
        ...                   (np.array([0., 1., 3.]), np.array([2., 3., 5.]))])
        >>> band.x.tolist(), band.mean.tolist(), band.n
        ([0.0, 1.0, 2.0, 3.0], [1.0, 2.0, 3.0, 4.0], 2)
        >>> (band.hi - band.mean).round(3).tolist()  # t(1) · std / sqrt(2), std = sqrt(2)
        [12.706, 12.706, 12.706, 12.706]
    """
    curves = [(np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)) for x, y in curves if len(x)]
    if not curves:
        raise PlotError("no data to average")
    start = max(x[0] for x, _ in curves)
    stop = min(x[-1] for x, _ in curves)
    if start > stop:
        raise PlotError("the runs of a group do not overlap on the x axis")
    grid = np.unique(np.concatenate([x[(x >= start) & (x <= stop)] for x, _ in curves]))
    values = np.stack([np.interp(grid, x, y) for x, y in curves])
    mean = values.mean(axis=0)
    n = len(curves)
    if n < 2:
        return Band(grid, mean, mean.copy(), mean.copy(), n)
    half = t_quantile_975(n - 1) * values.std(axis=0, ddof=1) / math.sqrt(n)
    return Band(grid, mean, mean - half, mean + half, n)


def make_figure(
    run_dirs: Sequence[Union[str, os.PathLike]],
    *,
    x: str = "frames",
    smooth: int = 1,
    labels: Optional[Sequence[str]] = None,
    title: Optional[str] = None,
    columns_per_row: int = 3,
    group: Union[bool, str, None] = None,
):
    """Builds the learning-curve figure (a :class:`matplotlib.figure.Figure`, Agg canvas).

    Args:
        run_dirs: run folders (or ``metrics.csv`` paths).
        x: ``"frames"`` or ``"time_s"``.
        smooth: trailing moving-average window in logged rows (1 = raw), applied to each run.
        labels: legend names, one per run, or one per group when grouping (default: the folder
            names, or the group names).
        title: figure title (default: none).
        columns_per_row: panels per row.
        group: ``None``/``False``: one curve per run; ``True``: one mean curve with a 95 % band
            per parent folder; a regular expression: per group it names (:func:`group_runs`).

    Raises:
        PlotError: for bad input (one readable sentence).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not run_dirs:
        raise PlotError("give at least one run folder")
    if x not in X_AXES:
        raise PlotError(f"unknown x axis {x!r}; choose {' or '.join(X_AXES)}")
    if smooth < 1:
        raise PlotError(f"--smooth must be at least 1, got {smooth}")
    paths = [Path(r) for r in run_dirs]
    runs = [load_run(p) for p in paths]
    for path, data in zip(paths, runs):
        if x not in data:
            raise PlotError(f"{path} has no '{x}' column in {METRICS_FILE}")
    if group is None or group is False:
        groups = [(name, [i]) for i, name in enumerate(_labels([_run_folder(p) for p in paths]))]
    else:
        groups = [(f"{name} ({len(members)} run{'s' if len(members) > 1 else ''})", members)
                  for name, members in group_runs(paths, group)]
    if labels is None:
        labels = [name for name, _ in groups]
    elif len(labels) != len(groups):
        what = "groups" if group not in (None, False) else "runs"
        raise PlotError(f"{len(labels)} labels for {len(groups)} {what}")

    def has_data(panel: Panel) -> bool:
        for data in runs:
            for name in panel.columns:
                col = _column(data, name)
                if col is not None and np.isfinite(data[col]).any() and np.isfinite(data[x]).any():
                    return True
        return False

    panels = [p for p in PANELS if has_data(p)]
    if not panels:
        wanted = ", ".join(c for p in PANELS for c in p.columns)
        raise PlotError(f"nothing to plot: none of the runs has any of {wanted}")

    n_cols = max(1, min(columns_per_row, len(panels)))
    n_rows = math.ceil(len(panels) / n_cols)
    fig = Figure(figsize=(4.6 * n_cols, 3.4 * n_rows + 0.7), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(n_rows, n_cols, squeeze=False).ravel()
    colours = [f"C{i % 10}" for i in range(len(groups))]
    for ax, panel in zip(axes, panels):
        for (group_name, members), colour in zip(groups, colours):
            for name, style in zip(panel.columns, panel.styles * len(panel.columns)):
                curves = []
                for i in members:
                    col = _column(runs[i], name)
                    if col is not None:
                        xs, ys = _series(runs[i], col, x, smooth)
                        if xs.size:
                            curves.append((xs, ys))
                if not curves:
                    continue
                if len(members) == 1:
                    xs, ys = curves[0]
                else:
                    try:
                        band = seed_band(curves)
                    except PlotError as err:
                        raise PlotError(f"{group_name}: {err}") from None
                    xs, ys = band.x, band.mean
                    if band.n > 1:
                        ax.fill_between(xs, band.lo, band.hi, color=colour, alpha=0.2, linewidth=0)
                marker = "o" if xs.size == 1 else None
                ax.plot(xs, ys, linestyle=style, color=colour, marker=marker, linewidth=1.6)
        ax.set_title(panel.title)
        ax.set_xlabel(X_AXES[x])
        ax.set_ylabel(panel.ylabel)
        if panel.ylim is not None:
            ax.set_ylim(*panel.ylim)
        ax.grid(True, alpha=0.3)
        if x == "frames":
            ax.ticklabel_format(axis="x", style="sci", scilimits=(-3, 4), useMathText=True)
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=c, linewidth=2.5) for c in colours]
    fig.legend(handles, list(labels), loc="outside lower center", ncols=min(len(groups), 4),
               frameon=False, fontsize="medium")
    notes = [f"moving average over {smooth} logs"] if smooth > 1 else []
    if group not in (None, False):
        notes.append("mean over runs, shaded: 95 % CI")
    suffix = f" ({'; '.join(notes)})" if notes else ""
    if title or suffix:
        fig.suptitle((title or "") + suffix, fontsize="medium")
    return fig


def _check_title(title: Optional[str]) -> None:
    """Raises :class:`PlotError` if matplotlib cannot draw ``title`` (bad ``$...$`` mathtext),
    which it would only find when saving the whole figure."""
    if not title or "$" not in title:
        return
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    probe = Figure(figsize=(2, 1))
    probe.suptitle(title)
    try:
        FigureCanvasAgg(probe).draw()
    except ValueError as err:
        raise PlotError(f"--title {title!r} is not valid matplotlib mathtext (write \\$ for a dollar sign): "
                        f"{one_line(err)}") from None


def plot_runs(
    run_dirs: Sequence[Union[str, os.PathLike]],
    out_path: Union[str, os.PathLike] = "learning_curves.png",
    *,
    x: str = "frames",
    smooth: int = 1,
    labels: Optional[Sequence[str]] = None,
    title: Optional[str] = None,
    dpi: int = 110,
    group: Union[bool, str, None] = None,
) -> Path:
    """Draws the learning curves of ``run_dirs`` side by side and saves them as a PNG.

    Args:
        run_dirs: run folders holding ``metrics.csv`` (or the csv paths themselves).
        out_path: the PNG to write (its folder is created).
        x: ``"frames"`` or ``"time_s"``.
        smooth: trailing moving-average window in logged rows (1 = raw).
        labels: legend names (default: the folder names, or the group names).
        title: figure title.
        dpi: resolution.
        group: ``True``: one mean curve with a 95 % band per parent folder; a regular
            expression: per group it names (see :func:`group_runs`); ``None``: one curve per run.

    Returns:
        The path of the written PNG.

    Raises:
        PlotError: for a missing folder, a folder without ``metrics.csv``, a ``group``
            expression that is invalid or does not match, or nothing to plot.
    """
    _check_title(title)
    fig = make_figure(run_dirs, x=x, smooth=smooth, labels=labels, title=title, group=group)
    out = Path(out_path)
    if out.parent and not out.parent.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi, format="png")
    return out


def build_parser() -> argparse.ArgumentParser:
    """The ``oni-plot`` argument parser."""
    parser = OneLineArgumentParser(
        prog=PROG,
        description="Plot the learning curves (return, success, dlvl/xlvl, intrinsic reward, "
                    "label coverage) of one or several oni-train runs into one PNG.",
    )
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR",
                        help="run folders holding metrics.csv")
    parser.add_argument("-o", "--output", default="learning_curves.png",
                        help="the PNG to write (default: learning_curves.png)")
    parser.add_argument("--x", choices=tuple(X_AXES), default="frames",
                        help="x axis: env frames or wall time in seconds (default: frames)")
    parser.add_argument("--smooth", type=int, default=1,
                        help="moving-average window in logged rows (default: 1, no smoothing)")
    parser.add_argument("--title", default=None, help="figure title")
    grouping = parser.add_mutually_exclusive_group()
    grouping.add_argument("--group", action="store_true",
                          help="one curve per parent folder (e.g. the seeds of one setting): the mean "
                               "over its runs with a shaded 95 %% confidence band")
    grouping.add_argument("--group-by", metavar="REGEX", default=None,
                          help="like --group, but a run's group is the first capture group (or the "
                               "match) of REGEX in its path, e.g. '(\\w+)/seed\\d+$'")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs ``oni-plot``; returns the exit status (0 ok, 2 bad input)."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as stop:  # argparse already printed its one line (or --help)
        return int(stop.code or 0)
    try:
        inputs = [p for run in args.runs for p in (run, os.path.join(run, "metrics.csv"))]
        if overwritten_input(args.output, inputs):
            raise PlotError(f"-o {args.output} is one of the runs' files; choose another output")
        group = args.group_by if args.group_by is not None else (True if args.group else None)
        out = plot_runs(args.runs, args.output, x=args.x, smooth=args.smooth, title=args.title, group=group)
    except PlotError as err:
        return report(PROG, str(err))
    except OSError as err:  # -o is a folder, unwritable, disk full
        return report(PROG, f"cannot write {args.output}: {err.strerror or err}")
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
