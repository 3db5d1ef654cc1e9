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

Usage::

    oni-plot runs/retrieval runs/none -o curves.png --smooth 5
    oni-plot runs/oni --x time_s

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
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from torchrl_oni.cli_errors import OneLineArgumentParser, report

__all__ = ["PANELS", "Panel", "PlotError", "load_run", "make_figure", "plot_runs", "main"]

PROG = "oni-plot"
X_AXES = {"frames": "env frames", "time_s": "wall time (s)"}
METRICS_FILE = "metrics.csv"


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
    # Read here rather than with train.logging.read_metrics: that import pulls in torch and
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


def make_figure(
    run_dirs: Sequence[Union[str, os.PathLike]],
    *,
    x: str = "frames",
    smooth: int = 1,
    labels: Optional[Sequence[str]] = None,
    title: Optional[str] = None,
    columns_per_row: int = 3,
):
    """Builds the learning-curve figure (a :class:`matplotlib.figure.Figure`, Agg canvas).

    Args:
        run_dirs: run folders (or ``metrics.csv`` paths).
        x: ``"frames"`` or ``"time_s"``.
        smooth: trailing moving-average window in logged rows (1 = raw).
        labels: legend names (default: the folder names).
        title: figure title (default: none).
        columns_per_row: panels per row.

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
    if labels is None:
        labels = _labels([p.parent if p.is_file() else p for p in paths])
    elif len(labels) != len(paths):
        raise PlotError(f"{len(labels)} labels for {len(paths)} runs")

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
    colours = [f"C{i % 10}" for i in range(len(runs))]
    for ax, panel in zip(axes, panels):
        for data, colour in zip(runs, colours):
            for name, style in zip(panel.columns, panel.styles * len(panel.columns)):
                col = _column(data, name)
                if col is None:
                    continue
                xs, ys = _series(data, col, x, smooth)
                if xs.size == 0:
                    continue
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
    fig.legend(handles, list(labels), loc="outside lower center", ncols=min(len(runs), 4),
               frameon=False, fontsize="medium")
    suffix = f" (moving average over {smooth} logs)" if smooth > 1 else ""
    if title or suffix:
        fig.suptitle((title or "") + suffix, fontsize="medium")
    return fig


def plot_runs(
    run_dirs: Sequence[Union[str, os.PathLike]],
    out_path: Union[str, os.PathLike] = "learning_curves.png",
    *,
    x: str = "frames",
    smooth: int = 1,
    labels: Optional[Sequence[str]] = None,
    title: Optional[str] = None,
    dpi: int = 110,
) -> Path:
    """Draws the learning curves of ``run_dirs`` side by side and saves them as a PNG.

    Args:
        run_dirs: run folders holding ``metrics.csv`` (or the csv paths themselves).
        out_path: the PNG to write (its folder is created).
        x: ``"frames"`` or ``"time_s"``.
        smooth: trailing moving-average window in logged rows (1 = raw).
        labels: legend names (default: the folder names).
        title: figure title.
        dpi: resolution.

    Returns:
        The path of the written PNG.

    Raises:
        PlotError: for a missing folder, a folder without ``metrics.csv``, or nothing to plot.
    """
    fig = make_figure(run_dirs, x=x, smooth=smooth, labels=labels, title=title)
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
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs ``oni-plot``; returns the exit status (0 ok, 2 bad input)."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as stop:  # argparse already printed its one line (or --help)
        return int(stop.code or 0)
    try:
        out = plot_runs(args.runs, args.output, x=args.x, smooth=args.smooth, title=args.title)
    except PlotError as err:
        return report(PROG, str(err))
    except OSError as err:  # -o is a folder, unwritable, disk full
        return report(PROG, f"cannot write {args.output}: {err.strerror or err}")
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
