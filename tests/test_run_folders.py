"""Nothing a user runs is lost: a second ``oni-train`` keeps the first run, a folder that holds a
run is only reused on ``--resume`` or ``--overwrite``, and ``oni-eval -o`` / ``oni-replay -o``
never replace a file without ``--overwrite``."""
import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import TINY, main_in_process
from torchrl_oni.run_folder import CHECKPOINT_NAME, CONFIG_NAME, METRICS_NAME
from torchrl_oni.train.run_log import read_metrics


def _md5(path) -> str:
    return hashlib.md5(Path(path).read_bytes()).hexdigest()


def _train(*args, cwd, quiet=True, timeout=300):
    """``oni-train TINY *args`` in ``cwd`` (where the default ``runs/`` goes)."""
    tiny = TINY if quiet else [a for a in TINY if a != "--quiet"]
    return subprocess.run([sys.executable, "-m", "torchrl_oni.train", *tiny, *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


def _lines(text):
    return [line for line in text.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def two_default_runs(tmp_path_factory):
    """Two ``oni-train`` runs without ``--logdir`` in one folder: the first run's files as they
    were after it, then what the second run left."""
    cwd = tmp_path_factory.mktemp("cwd")
    first = _train(cwd=cwd)
    assert first.returncode == 0, first.stderr[-2000:]
    [folder] = sorted((cwd / "runs").iterdir())
    before = {name: _md5(folder / name) for name in (CHECKPOINT_NAME, METRICS_NAME)}
    second = _train("--seed", "1", cwd=cwd, quiet=False)
    assert second.returncode == 0, second.stderr[-2000:]
    return {"cwd": cwd, "first": first, "second": second, "folder": folder, "before": before}


def test_a_second_run_with_the_default_folder_keeps_the_first(two_default_runs):
    cwd, folder = two_default_runs["cwd"], two_default_runs["folder"]
    folders = sorted((cwd / "runs").iterdir())
    assert len(folders) == 2 and all(f.name.startswith("oni-") for f in folders), folders
    for name, md5 in two_default_runs["before"].items():
        assert _md5(folder / name) == md5, f"the second run changed the first run's {name}"
    for run, path in zip(("first", "second"), folders):
        assert (path / CHECKPOINT_NAME).exists()
        # named once, at the start: the user knows where the run is
        named = [line for line in _lines(two_default_runs[run].stderr) if "run folder" in line]
        assert named == [f"oni-train: run folder runs/{path.name} (new for this run; --logdir chooses one)"], \
            two_default_runs[run].stderr


def test_the_summary_names_the_new_folder(two_default_runs):
    second = sorted((two_default_runs["cwd"] / "runs").iterdir())[-1]
    assert second.name.startswith("oni-"), second
    assert f"run folder                   runs/{second.name}" in two_default_runs["second"].stdout


def _fake_run(folder: Path, what: str) -> Path:
    """A folder that holds a run by ``what`` (never read: the refusal comes first)."""
    folder.mkdir(parents=True, exist_ok=True)
    if what == "checkpoint":
        (folder / CHECKPOINT_NAME).write_bytes(b"a run's weights")
    else:
        (folder / METRICS_NAME).write_text("frames,time_s\n512,1.0\n")
    return folder


@pytest.mark.parametrize("what", ["checkpoint", "metrics"])
@pytest.mark.parametrize("how", ["--logdir", "--config"])
def test_an_explicit_folder_holding_a_run_is_refused_in_one_line(tmp_path, capsys, what, how):
    from torchrl_oni.train.cli import main
    from torchrl_oni.train.config import TrainConfig

    run = _fake_run(tmp_path / "run", what)
    kept = {p.name: p.read_bytes() for p in run.iterdir()}
    if how == "--logdir":
        argv = [*TINY, "--logdir", str(run)]
    else:  # a config file that names the folder (another run's config.yaml) is a --logdir too
        config = tmp_path / "other.yaml"
        config.write_text(TrainConfig(logdir=str(run)).to_yaml())
        argv = [*TINY, "--config", str(config)]
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    lines = _lines(capsys.readouterr().err)
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"oni-train: error: {run} already holds a run") and "--resume" in lines[0] \
        and "--overwrite" in lines[0], lines
    assert {p.name: p.read_bytes() for p in run.iterdir()} == kept


def test_folders_without_a_run_are_used_and_the_default_one_is_new(tmp_path, monkeypatch):
    from torchrl_oni.train.cli import settle_run_folder
    from torchrl_oni.train.config import TrainConfig

    # what benchmarks/sparse_tasks.py leaves before oni-train starts, an empty folder, a config.yaml alone
    for name, files in (("grid", {"train.log": "$ oni-train ...\n"}), ("empty", {}),
                        ("config", {CONFIG_NAME: TrainConfig().to_yaml(), METRICS_NAME: ""})):
        folder = tmp_path / name
        folder.mkdir()
        for file, text in files.items():
            (folder / file).write_text(text)
        cfg = TrainConfig(logdir=str(folder))
        assert settle_run_folder(cfg, given=True) is None and cfg.log.logdir == str(folder)
        assert sorted(p.name for p in folder.iterdir()) == sorted(files)
    monkeypatch.chdir(tmp_path)
    cfg = TrainConfig()
    made = settle_run_folder(cfg, given=False)
    assert made == cfg.log.logdir and Path(made).is_dir() and Path(made).name.startswith("oni-")
    assert Path(settle_run_folder(TrainConfig(), given=False)) != Path(made)  # never the same one twice


def test_resume_and_overwrite_together_are_refused(tmp_path, capsys):
    from torchrl_oni.train.cli import main

    run = _fake_run(tmp_path / "run", "checkpoint")
    with pytest.raises(SystemExit) as stop:
        main([*TINY, "--logdir", str(run), "--resume", "--overwrite"])
    lines = _lines(capsys.readouterr().err)
    assert stop.value.code == 2 and len(lines) == 1 and "not both" in lines[0], lines


def test_overwrite_starts_the_run_over(two_default_runs, tmp_path):
    run = Path(shutil.copytree(two_default_runs["folder"], tmp_path / "run"))
    (run / "notes.txt").write_text("mine")  # not the run's: stays
    (run / "tensorboard").mkdir()
    old_rows = read_metrics(str(run))
    out = _train("--logdir", str(run), "--overwrite", "--frames", "512", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"oni-train: --overwrite: deleted the run in {run} (" in out.stderr
    rows = read_metrics(str(run))
    assert rows[-1]["frames"] < old_rows[-1]["frames"] and len(rows) < len(old_rows), "not started over"
    assert (run / "notes.txt").read_text() == "mine" and not (run / "tensorboard").exists()


def test_resume_without_logdir_continues_the_newest_run(two_default_runs, tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    older = Path(shutil.copytree(two_default_runs["folder"], runs / "oni-20000101-000000"))
    newer = Path(shutil.copytree(two_default_runs["folder"], runs / "oni-20000101-000001"))
    (older / CHECKPOINT_NAME).touch()  # its checkpoint written last: the run a Ctrl-C stopped last
    before = read_metrics(str(older))
    out = _train("--resume", "--frames", "2048", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"oni-train: --resume: continuing runs/{older.name} (the newest run folder; --logdir RUN continues " \
           f"another)" in _lines(out.stderr), out.stderr
    rows = read_metrics(str(older))
    assert rows[: len(before)] == before and rows[-1]["frames"] >= 2048
    assert read_metrics(str(newer)) == before  # the other run is untouched
    assert sorted(p.name for p in runs.iterdir()) == [older.name, newer.name]  # and no new folder
    # the continued run's config.yaml re-runs it elsewhere as a new run: --resume was for that start only
    from torchrl_oni.train.config import TrainConfig

    saved = TrainConfig.from_yaml((older / CONFIG_NAME).read_text())
    assert saved.log.resume is None and saved.log.logdir == f"runs/{older.name}"


def test_resume_without_any_run_is_one_line(tmp_path, capfd, monkeypatch):
    from torchrl_oni.train.cli import main

    monkeypatch.chdir(tmp_path)  # where the default runs/ would be
    out = main_in_process(main, [*TINY, "--resume"], capfd)
    lines = _lines(out.stderr)
    assert out.returncode == 2 and len(lines) == 1 and "no run to continue" in lines[0], lines


# ------------------------------------------------------------------ oni-eval -o, oni-replay -o
def test_eval_never_replaces_a_file_named_by_o(two_default_runs, tmp_path, capsys, monkeypatch):
    from torchrl_oni import evaluate

    out = tmp_path / "mine.json"
    out.write_text('{"kept": true}')
    code = evaluate.main([str(two_default_runs["folder"]), "-o", str(out), "--episodes", "1", "--no-progress"])
    lines = _lines(capsys.readouterr().err)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0] == f"oni-eval: error: -o {out} already exists: --overwrite replaces it, or choose another file"
    assert out.read_text() == '{"kept": true}'

    # with --overwrite the evaluation goes ahead (stopped here: playing is tested in test_eval.py)
    def reached(*args, **kwargs):
        raise evaluate.EvalError("evaluation reached")

    monkeypatch.setattr(evaluate, "evaluate", reached)
    assert evaluate.main([str(two_default_runs["folder"]), "-o", str(out), "--overwrite", "--no-progress"]) == 2
    assert "evaluation reached" in capsys.readouterr().err


@pytest.mark.parametrize("flag, name", [("-o", "mine.html"), ("--gif", "mine.gif")])
def test_replay_never_replaces_a_file_it_is_told_to_write(tmp_path, capsys, flag, name):
    from torchrl_oni.replay import Episode, main, save_episode

    episode = save_episode(tmp_path / "episode_000.npz", Episode.blank(6, meta={
        "task": "score", "episode": 0, "action_names": ["a", "b"], "stats": {"end": "timeout", "return": 0.0}}))
    out = tmp_path / name
    out.write_bytes(b"mine")
    assert main([str(episode), flag, str(out)]) == 2
    lines = _lines(capsys.readouterr().err)
    assert lines == [f"oni-replay: error: {flag} {out} already exists: --overwrite replaces it, or choose another "
                     f"file"], lines
    assert out.read_bytes() == b"mine"
    assert main([str(episode), flag, str(out), "--overwrite"]) == 0
    assert out.read_bytes() != b"mine"
    # the default player beside the episode is made from it again, as before
    assert main([str(episode)]) == 0 and main([str(episode)]) == 0


# ------------------------------------------------------------------ benchmarks/sparse_tasks.py
def test_the_sparse_grid_starts_over_only_a_run_that_left_metrics_and_no_checkpoint(tmp_path):
    """The grid trains a folder holding only its train.log as before; a folder whose run died before
    its first checkpoint (metrics rows, nothing to resume) gets --overwrite, as oni-train now asks."""
    bench = str(Path(__file__).resolve().parent.parent / "benchmarks")
    sys.path.insert(0, bench)  # benchmarks/: the sparse_grid package, and grid_archive it imports
    try:
        from sparse_grid import launcher as grid

        class Recorder(grid.Launcher):
            def run(self, kind, module, argv, log_path):
                self.argv = argv
                return 1  # "failed": execute() stops there

        seen = {}
        for name, files in (("fresh", {"train.log": "$ oni-train ...\n"}),
                            ("died", {"train.log": "", METRICS_NAME: "frames,time_s\n128,1.0\n"})):
            folder = tmp_path / name
            folder.mkdir()
            for file, text in files.items():
                (folder / file).write_text(text)
            run = grid.Run(task="staircase", reward="none", annotator=None, seed=0, logdir=folder,
                           train_args=["--logdir", str(folder)], target_frames=2048, status="train")
            launcher = Recorder(parallel=1, seconds=None)
            grid.execute(run, launcher, None, None, final=True)
            seen[name] = launcher.argv
        assert seen == {"fresh": ["--logdir", str(tmp_path / "fresh")],
                        "died": ["--logdir", str(tmp_path / "died"), "--overwrite"]}
    finally:
        sys.path.remove(bench)
