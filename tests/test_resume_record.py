"""A run killed after its last checkpoint and resumed keeps one increasing metrics record.

RunLogger(resume_at=N) drops the rows logged after the checkpoint, time_s goes on, a repeated
final row updates the last one, the episode window comes back, and the temporary files of
writes cut short by the kill are cleaned.
"""
import csv
import os
import subprocess
import sys
import textwrap

import pytest

from torchrl_oni.atomic import atomic_write, remove_stale_temps
from torchrl_oni.train.checkpoint import load_checkpoint, save_checkpoint
from torchrl_oni.train.run_log import EpisodeWindow, MetricsFileError, RunLogger, read_metrics

KILLED_RUN = textwrap.dedent("""
    import os, signal, sys
    from torchrl_oni.train.checkpoint import save_checkpoint
    from torchrl_oni.train.run_log import RunLogger
    run = sys.argv[1]
    logger = RunLogger(run, tensorboard=False)
    for i in range(1, 9):
        frames = 128 * i
        row = {"frames": frames, "time_s": 2.0 * i, "fps": 64.0, "iteration": i}
        if i >= 3:
            row["episode/return"] = float(i)  # a column that appears later: the file is rewritten
        logger.log(row)
        if frames == 640:
            save_checkpoint({"frames": frames}, os.path.join(run, "checkpoint.pt"))
    # killed mid-append: half a row, no newline
    with open(os.path.join(run, "metrics.csv"), "a") as f:
        f.write("1152,18.0,6")
        f.flush()
    os.kill(os.getpid(), signal.SIGKILL)
""")


def _killed_run(run_dir):
    proc = subprocess.run([sys.executable, "-c", KILLED_RUN, str(run_dir)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr  # SIGKILL: no cleanup ran


def _assert_monotonic(rows):
    frames = [r["frames"] for r in rows]
    times = [r["time_s"] for r in rows]
    assert frames == sorted(set(frames)), frames  # strictly increasing: no repeats, never backwards
    assert times == sorted(set(times)), times


def test_kill_after_checkpoint_then_resume_keeps_the_record_monotonic(tmp_path):
    run = tmp_path / "run"
    _killed_run(run)
    before = read_metrics(str(run))
    assert [r["frames"] for r in before][-2:] == [1024.0, 1152.0]  # rows after the checkpoint, and a torn one
    at = load_checkpoint(str(run))["frames"]
    assert at == 640

    logger = RunLogger(str(run), tensorboard=False, resume_at=at)
    # the new process measures time from its own start
    for k, frames in enumerate(range(768, 1281, 128), start=1):
        logger.log({"frames": frames, "time_s": 1.5 * k, "fps": 80.0, "iteration": 5 + k, "episode/return": 9.0})
    logger.log({"frames": 1280, "time_s": 7.6, "fps": 80.0, "labels": 3.0})  # the final row, repeated
    logger.close()

    rows = read_metrics(str(run))
    _assert_monotonic(rows)
    assert rows[:5] == before[:5]  # the record up to the checkpoint is untouched
    assert [r["frames"] for r in rows] == [128.0 * i for i in range(1, 11)]
    assert rows[5]["time_s"] == pytest.approx(10.0 + 1.5)  # continues from the checkpoint's row
    assert rows[-1]["time_s"] == pytest.approx(10.0 + 7.6) and rows[-1]["labels"] == 3.0
    assert rows[-1]["episode/return"] == 9.0  # the update keeps what only the earlier row had
    with open(run / "metrics.csv", newline="") as f:
        lines = list(csv.reader(f))
    assert all(len(line) == len(lines[0]) for line in lines)  # rewritten whole: one header, full rows

    # a second kill + resume, at the checkpoint of the resumed run, keeps it monotonic
    logger = RunLogger(str(run), tensorboard=False, resume_at=1024)
    logger.log({"frames": 1152, "time_s": 0.5})
    logger.close()
    again = read_metrics(str(run))
    _assert_monotonic(again)
    assert [r["frames"] for r in again][-3:] == [896.0, 1024.0, 1152.0]


def test_resume_without_metrics_and_explicit_time_offset(tmp_path):
    logger = RunLogger(str(tmp_path), tensorboard=False, resume_at=512, time_offset=40.0)
    logger.log({"frames": 640, "time_s": 1.0})
    logger.close()
    assert read_metrics(str(tmp_path)) == [{"frames": 640.0, "time_s": 41.0}]
    fresh = RunLogger(str(tmp_path), tensorboard=False)  # not resuming: a new record, time from 0
    fresh.log({"frames": 128, "time_s": 1.0})
    assert fresh.time_offset == 0.0 and read_metrics(str(tmp_path)) == [{"frames": 128.0, "time_s": 1.0}]


def test_same_frames_updates_the_last_row_only(tmp_path):
    logger = RunLogger(str(tmp_path), tensorboard=False)
    logger.log({"frames": 100, "a": 1.0})
    logger.log({"frames": 200, "a": 2.0, "b": 5.0})
    logger.log({"frames": 200, "a": 3.0})
    logger.log({"frames": 300, "a": 4.0})
    assert read_metrics(str(tmp_path)) == [
        {"frames": 100.0, "a": 1.0}, {"frames": 200.0, "a": 3.0, "b": 5.0}, {"frames": 300.0, "a": 4.0}]


@pytest.mark.parametrize("content, words", [
    (b"frames,time_s\n128,1.0\n256,abc\n", "line 3: 'abc' in column 'time_s' is not a number"),
    (b"frames,time_s\n128,1.0,7\n", "line 2: more values than columns"),
    (b"step,loss\n1,2\n", "no 'frames' column"),
    (b"\xff\xfe\x00garbage\x00\x81", "not UTF-8"),
    (b"frames,time_s\n1\x00,2\n", "line 2: '1\\x00' in column 'frames' is not a number"),
    (b'frames,time_s\n"1\n2",3\n', "line 3: '1\\n2' in column 'frames' is not a number"),
])
def test_a_corrupt_metrics_file_is_one_clear_error(tmp_path, content, words):
    (tmp_path / "metrics.csv").write_bytes(content)
    for attempt in (lambda: RunLogger(str(tmp_path), tensorboard=False, resume_at=128),
                    lambda: read_metrics(str(tmp_path))):
        with pytest.raises(MetricsFileError) as info:
            attempt()
        message = str(info.value)
        assert "\n" not in message and words in message and "metrics.csv" in message, message
    assert issubclass(MetricsFileError, ValueError)


def test_episode_window_comes_back_through_a_checkpoint(tmp_path):
    window = EpisodeWindow(3)
    window.add({"return": [1.0, 2.0], "death": [1.0, 0.0]})
    window.add({"return": [6.0, 10.0], "death": [0.0, 0.0]})
    path = str(tmp_path / "checkpoint.pt")
    save_checkpoint({"episode_window": window.state_dict()}, path)
    state = load_checkpoint(path)["episode_window"]
    same = EpisodeWindow(3)
    same.load_state_dict(state)
    assert same.means() == window.means() == {"episode/return": 6.0, "episode/death": 0.0}
    assert same.episodes == 4
    smaller = EpisodeWindow(2)  # a run resumed with a smaller --stats-window keeps the newest
    smaller.load_state_dict(state)
    assert smaller.means() == {"episode/return": 8.0, "episode/death": 0.0}
    same.add({"return": [0.0], "death": [1.0]})  # and the restored window keeps rolling
    assert same.means()["episode/return"] == pytest.approx(16.0 / 3) and same.episodes == 5


KILLED_WRITE = textwrap.dedent("""
    import os, sys
    from torchrl_oni.atomic import atomic_write
    def write(f):
        f.write(b"half a checkpoint")
        f.flush()
        os._exit(1)  # killed mid-write: atomic_write's cleanup never runs
    atomic_write(os.path.join(sys.argv[1], "checkpoint.pt"), write)
""")


def test_remove_stale_temps_cleans_only_interrupted_atomic_writes(tmp_path):
    atomic_write(tmp_path / "checkpoint.pt", lambda f: f.write(b"the good one"))
    proc = subprocess.run([sys.executable, "-c", KILLED_WRITE, str(tmp_path)], capture_output=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    leftovers = [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
    assert len(leftovers) == 1 and leftovers[0].startswith(".checkpoint.pt.")
    keep = ["notes.tmp", ".hidden", "checkpoint.pt", ".metrics.csv.tmp", "run.x1.tmp"]
    for name in keep[:2] + keep[3:]:
        (tmp_path / name).write_bytes(b"mine")
    (tmp_path / ".captions.pt.abc.tmp").mkdir()  # not a file: left alone
    assert remove_stale_temps(tmp_path, min_age_s=3600) == []  # too young to be stale
    removed = remove_stale_temps(tmp_path)
    assert [os.path.basename(p) for p in removed] == leftovers
    assert sorted(os.listdir(tmp_path)) == sorted(keep + [".captions.pt.abc.tmp"])
    assert (tmp_path / "checkpoint.pt").read_bytes() == b"the good one"
    assert remove_stale_temps(tmp_path / "missing") == []


def test_tensorboard_gets_every_value_of_a_row_at_its_frames(tmp_path):
    """A row goes to TensorBoard as one event holding every value (one write per row, not per
    metric); TensorBoard's own reader finds each metric at the row's frames, and a repeated final
    row adds only the values that changed."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = RunLogger(str(tmp_path), tensorboard=True)
    logger.log({"frames": 512, "time_s": 2.0, "fps": 900.0, "loss/policy": -0.25})
    logger.log({"frames": 1024, "time_s": 4.0, "fps": 950.0, "loss/policy": 0.5, "episode/return": 3.5})
    logger.log({"frames": 1024, "time_s": 4.0, "fps": 950.0, "labels/labelled": 7.0})  # the final row
    logger.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard" / "oni"))  # TorchRL's logger: <log_dir>/<exp_name>
    acc.Reload()
    scalars = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    assert scalars == {
        "time_s": [(512, 2.0), (1024, 4.0)],
        "fps": [(512, 900.0), (1024, 950.0)],
        "loss/policy": [(512, -0.25), (1024, 0.5)],
        "episode/return": [(1024, 3.5)],
        "labels/labelled": [(1024, 7.0)],
    }
