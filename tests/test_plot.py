"""oni-plot: learning curves from synthetic metrics.csv files."""
import csv
import math
import os

import numpy as np
import pytest

from torchrl_oni import plot
from torchrl_oni.plot import PlotError, make_figure, plot_runs

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write_run(folder, columns, n=20, missing_first=()):
    """A run folder whose metrics.csv has ``columns`` filled with smooth synthetic values."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "metrics.csv"), "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(columns)
        for i in range(1, n + 1):
            row = []
            for c in columns:
                if c == "frames":
                    row.append(i * 512)
                elif c == "time_s":
                    row.append(0.5 * i)
                elif c in missing_first and i <= 3:
                    row.append("")  # a metric that only appears later, as RunLogger writes it
                else:
                    row.append(math.sin(i / 3.0) + i / 10.0)
            writer.writerow(row)
    return folder


def _png_size(path):
    from PIL import Image

    with Image.open(path) as img:
        img.verify()
    with Image.open(path) as img:
        return img.size


FULL = ["frames", "time_s", "fps", "episode/return", "episode/success", "episode/dlvl",
        "episode/xlvl", "reward/intrinsic_mean", "annotation/coverage"]


def test_plot_runs_writes_a_valid_png(tmp_path):
    a = _write_run(tmp_path / "oni", FULL, missing_first=("episode/return",))
    b = _write_run(tmp_path / "baseline", ["frames", "time_s", "episode/return"])
    out = plot_runs([a, b], tmp_path / "figs" / "curves.png", smooth=3)
    assert out.exists() and out.read_bytes()[:8] == PNG_MAGIC
    width, height = _png_size(out)
    assert width > 400 and height > 300


def test_panels_follow_the_data(tmp_path):
    only_return = _write_run(tmp_path / "r", ["frames", "time_s", "episode/return"])
    fig = make_figure([only_return])
    titles = [ax.get_title() for ax in fig.axes if ax.get_visible()]
    assert titles == ["Episode return"]
    full = _write_run(tmp_path / "full", FULL)
    titles = [ax.get_title() for ax in make_figure([full, only_return]).axes if ax.get_visible()]
    assert titles == [p.title for p in plot.PANELS]


def test_one_line_per_run_and_legend_names(tmp_path):
    a = _write_run(tmp_path / "alpha", ["frames", "time_s", "episode/return"])
    b = _write_run(tmp_path / "beta", ["frames", "time_s", "episode/return"])
    fig = make_figure([a, b])
    ax = fig.axes[0]
    assert len(ax.lines) == 2
    legend_texts = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend_texts == ["alpha", "beta"]


def test_same_folder_names_get_their_parent(tmp_path):
    a = _write_run(tmp_path / "exp1" / "seed0", ["frames", "time_s", "episode/return"])
    b = _write_run(tmp_path / "exp2" / "seed0", ["frames", "time_s", "episode/return"])
    legend = [t.get_text() for t in make_figure([a, b]).legends[0].get_texts()]
    assert legend == ["exp1/seed0", "exp2/seed0"]


def test_time_axis_and_smoothing(tmp_path):
    run = _write_run(tmp_path / "r", ["frames", "time_s", "episode/return"])
    raw = make_figure([run], x="time_s").axes[0].lines[0]
    smooth = make_figure([run], x="time_s", smooth=5).axes[0].lines[0]
    np.testing.assert_allclose(raw.get_xdata(), 0.5 * np.arange(1, 21))
    y_raw, y_smooth = np.asarray(raw.get_ydata()), np.asarray(smooth.get_ydata())
    np.testing.assert_allclose(y_smooth[4], y_raw[:5].mean())
    assert np.abs(np.diff(y_smooth)).max() < np.abs(np.diff(y_raw)).max()


def test_main_writes_png_and_prints_path(tmp_path, capsys):
    run = _write_run(tmp_path / "r", FULL)
    out = tmp_path / "c.png"
    assert plot.main([str(run), "-o", str(out), "--x", "time_s", "--smooth", "2"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert out.read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize(
    "make_args, expected",
    [
        (lambda t: [str(t / "missing")], "no such run folder"),
        (lambda t: [str(t / "empty")], "has no metrics.csv"),
        (lambda t: [str(t / "headeronly")], "has no rows"),
        (lambda t: [str(t / "fpsonly")], "nothing to plot"),
        (lambda t: [str(t / "fpsonly"), "--smooth", "0"], "--smooth must be at least 1"),
        (lambda t: [str(t / "notime"), "--x", "time_s"], "no 'time_s' column"),
        (lambda t: [str(t / "fpsonly"), "--x", "steps"], "invalid choice"),
    ],
)
def test_errors_are_one_line_exit_2(tmp_path, capsys, make_args, expected):
    (tmp_path / "empty").mkdir()
    (tmp_path / "headeronly").mkdir()
    (tmp_path / "headeronly" / "metrics.csv").write_text("frames,episode/return\n")
    _write_run(tmp_path / "fpsonly", ["frames", "time_s", "fps"])
    _write_run(tmp_path / "notime", ["frames", "episode/return"])
    out = tmp_path / "never.png"
    assert plot.main(make_args(tmp_path) + ["-o", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("oni-plot: error:") and expected in err
    assert len(err.splitlines()) == 1
    assert not out.exists()


def test_plot_runs_raises_plot_error(tmp_path):
    with pytest.raises(PlotError, match="no such run folder"):
        plot_runs([tmp_path / "nope"], tmp_path / "x.png")
    with pytest.raises(PlotError, match="at least one"):
        plot_runs([], tmp_path / "x.png")
