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


# ---------------------------------------------------------------------- seed bands (--group)
T975 = {1: 12.706, 2: 4.303, 3: 3.182}  # Student's t, 97.5 % quantile, from printed tables


def _write_linear_run(folder, slope, intercept, frames, column="episode/return"):
    """A run whose ``column`` is exactly ``slope · frames + intercept`` at the logged ``frames``."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "metrics.csv"), "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["frames", "time_s", column])
        for x in frames:
            writer.writerow([x, x / 1000.0, slope * x + intercept])
    return folder


def _band_collections(ax):
    from matplotlib.collections import PolyCollection

    return [c for c in ax.collections if isinstance(c, PolyCollection)]


def test_group_draws_the_mean_and_a_95ci_band_that_match_a_reference(tmp_path):
    # three seeds logging at different frames and over different ranges; linear curves make
    # linear interpolation exact, so the reference is analytic, not another np.interp
    lines = [(0.002, 1.0), (0.001, 3.0), (0.004, -2.0)]
    logged = [np.arange(512, 8193, 512), np.arange(300, 9001, 700), np.arange(1000, 7001, 250)]
    runs = [_write_linear_run(tmp_path / "exp" / "retrieval" / f"seed{i}", a, b, f)
            for i, ((a, b), f) in enumerate(zip(lines, logged))]
    other = _write_linear_run(tmp_path / "exp" / "none" / "seed0", 0.0, 5.0, np.arange(512, 8193, 512))
    fig = make_figure(runs + [other], group=True)
    ax = fig.axes[0]
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["retrieval (3 runs)", "none (1 run)"]
    assert len(ax.lines) == 2
    bands = _band_collections(ax)
    assert len(bands) == 1  # the one-run group has no band

    start, stop = max(f[0] for f in logged), min(f[-1] for f in logged)
    grid = np.unique(np.concatenate([f[(f >= start) & (f <= stop)] for f in logged])).astype(float)
    values = np.array([[a * x + b for x in grid] for a, b in lines])
    mean = values.mean(axis=0)
    half = T975[2] * values.std(axis=0, ddof=1) / np.sqrt(3)

    line = ax.lines[0]
    np.testing.assert_allclose(line.get_xdata(), grid)
    np.testing.assert_allclose(line.get_ydata(), mean, rtol=1e-9)
    assert line.get_xdata()[0] == 1000 and line.get_xdata()[-1] == 7000  # the range all three cover
    vertices = bands[0].get_paths()[0].vertices
    for xk, lo, hi in zip(grid, mean - half, mean + half):
        ys = vertices[np.isclose(vertices[:, 0], xk), 1]
        assert np.isclose(ys, lo, rtol=1e-3).any() and np.isclose(ys, hi, rtol=1e-3).any(), xk
    # the lone run is drawn as it is
    np.testing.assert_allclose(ax.lines[1].get_ydata(), np.full(16, 5.0))


def test_seed_band_matches_a_reference_and_one_run_has_no_band(tmp_path, capsys):
    frames = np.arange(1, 11) * 100.0
    ys = [np.sin(frames / 100.0 + k) for k in range(4)]
    band = plot.seed_band([(frames, y) for y in ys])
    stacked = np.stack(ys)
    np.testing.assert_allclose(band.mean, stacked.mean(axis=0))
    np.testing.assert_allclose(band.hi - band.mean, T975[3] * stacked.std(axis=0, ddof=1) / 2.0, rtol=1e-4)
    one = plot.seed_band([(frames, ys[0])])
    assert one.n == 1 and np.array_equal(one.lo, one.hi)
    with pytest.raises(PlotError, match="do not overlap"):
        plot.seed_band([(np.array([0.0, 1.0]), np.zeros(2)), (np.array([2.0, 3.0]), np.zeros(2))])
    early = _write_linear_run(tmp_path / "exp" / "a" / "seed0", 1.0, 0.0, [512, 1024])
    late = _write_linear_run(tmp_path / "exp" / "a" / "seed1", 1.0, 0.0, [2048, 4096])
    assert plot.main([str(early), str(late), "--group", "-o", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "oni-plot: error: a (2 runs): the runs of a group do not overlap on the x axis"


def test_without_group_runs_are_drawn_one_by_one(tmp_path):
    runs = [_write_linear_run(tmp_path / "exp" / "retrieval" / f"seed{i}", 0.001 * i, 0.0, np.arange(512, 4097, 512))
            for i in range(3)]
    ax = make_figure(runs).axes[0]
    assert len(ax.lines) == 3 and not _band_collections(ax)


def test_group_by_regex_from_the_command_line(tmp_path, capsys):
    for setting in ("ret", "none"):
        for seed in range(2):
            _write_linear_run(tmp_path / f"{setting}_s{seed}", 0.001 * (seed + 1), 0.0, np.arange(512, 4097, 512))
    runs = sorted(str(p) for p in tmp_path.glob("*_s*"))
    assert plot.group_runs(runs, by=r"(\w+)_s\d+$") == [("none", [0, 1]), ("ret", [2, 3])]
    out = tmp_path / "bands.png"
    assert plot.main(runs + ["--group-by", r"(\w+)_s\d+$", "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG_MAGIC
    fig = make_figure(runs, group=r"(\w+)_s\d+$")
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["none (2 runs)", "ret (2 runs)"]
    assert len(_band_collections(fig.axes[0])) == 2


@pytest.mark.parametrize(
    "extra, expected",
    [
        (["--group-by", r"seed(\d+)"], "does not match"),
        (["--group-by", "(unclosed"], "is not a regular expression"),
        (["--group", "--group-by", "x"], "not allowed with argument"),
    ],
)
def test_group_errors_are_one_line(tmp_path, capsys, extra, expected):
    run = _write_linear_run(tmp_path / "a" / "run", 0.001, 0.0, np.arange(512, 2049, 512))
    assert plot.main([str(run)] + extra + ["-o", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("oni-plot: error:") and expected in err and len(err.splitlines()) == 1
    with pytest.raises(PlotError, match="1 labels for 2 groups"):
        other = _write_linear_run(tmp_path / "b" / "run", 0.001, 0.0, np.arange(512, 2049, 512))
        make_figure([run, other], group=True, labels=["only one"])
