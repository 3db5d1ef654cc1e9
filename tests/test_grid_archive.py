"""benchmarks/grid_archive.py: a grid's runs kept rung by rung in the repository, and rebuilt from it."""
import doctest
import gzip
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
TINY = ["--tasks", "staircase", "--annotators", "scripted", "--rewards", "none", "--seeds", "0",
        "--extra", "--workers 1 --envs-per-worker 4 --max-episode-steps 40 --no-tensorboard",
        "--episodes", "4", "--eval-extra", "--workers 1"]


@pytest.fixture(scope="module")
def archive():
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("grid_archive", BENCH / "grid_archive.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    sys.path.remove(str(BENCH))


def test_its_examples_run(archive):
    assert doctest.testmod(archive).failed == 0


def _run_folder(root, frames=2048, metrics_rows=300):
    run = root / "staircase-lvl3" / "retrieval-store" / "seed1"
    run.mkdir(parents=True)
    (run / "checkpoint.pt").write_bytes(b"\x00weights" * 1000)
    (run / "captions.pt").write_bytes(b"\x01labels" * 1000)
    (run / "config.yaml").write_text("seed: 1\n")
    header = "frames,time_s,fps,train/loss_objective,episode/success,labels/seen_coverage"
    rows = [f"{1024 * i},{i},900,0.1,0.0,0.9" for i in range(1, metrics_rows + 1)]
    (run / "metrics.csv").write_text("\n".join([header, *rows]) + "\n")
    (run / "eval_1024.json").write_text(json.dumps({"frames_trained": 1024, "success_rate": {"mean": 0.0}}))
    (run / "eval.json").write_text(json.dumps({"frames_trained": frames, "success_rate": {"mean": 0.25}}))
    return run


def test_save_keeps_every_rung_the_thinned_log_and_the_last_checkpoint_gzipped(archive, tmp_path):
    run = _run_folder(tmp_path / "runs")
    kept = archive.save(run, tmp_path / "archive")
    dest = tmp_path / "archive" / "staircase-lvl3" / "retrieval-store" / "seed1"
    assert sorted(kept) == ["captions.pt.gz", "checkpoint.pt.gz", "config.yaml", "eval_1024.json", "eval_2048.json",
                            "metrics.csv"]
    assert gzip.decompress((dest / "checkpoint.pt.gz").read_bytes()) == (run / "checkpoint.pt").read_bytes()
    assert json.loads((dest / "eval_2048.json").read_text())["success_rate"]["mean"] == 0.25
    lines = (dest / "metrics.csv").read_text().splitlines()
    assert lines[0] == "frames,time_s,fps,episode/success,labels/seen_coverage"  # the loss is not a curve
    frames = [int(line.split(",")[0]) for line in lines[1:]]
    assert frames == [1024, 100352, 200704, 300032, 307200]  # one row per 100k frames, and the last
    assert archive.save(tmp_path / "nothing", tmp_path / "archive") == []  # not evaluated: nothing to keep


def test_restore_rebuilds_a_lost_folder_as_the_grid_counts_it_and_never_touches_a_live_one(archive, tmp_path):
    run = _run_folder(tmp_path / "runs")
    archive.save(run, tmp_path / "archive")
    lost = tmp_path / "elsewhere" / "staircase-lvl3" / "retrieval-store" / "seed1"
    written = archive.restore(tmp_path / "archive", lost)
    assert sorted(written) == ["captions.pt", "checkpoint.pt", "config.yaml", "eval.json", "eval_1024.json",
                               "metrics.csv"]
    assert (lost / "checkpoint.pt").read_bytes() == (run / "checkpoint.pt").read_bytes()
    assert json.loads((lost / "eval.json").read_text())["frames_trained"] == 2048  # the last rung judged it
    # the grid's test of a current evaluation: written after the checkpoint and the store it judged
    assert (lost / "eval.json").stat().st_mtime > (lost / "checkpoint.pt").stat().st_mtime
    assert (lost / "eval.json").stat().st_mtime > (lost / "captions.pt").stat().st_mtime
    (lost / "checkpoint.pt").write_bytes(b"trained further")
    assert archive.restore(tmp_path / "archive", lost) == []  # a folder holding a run is never written to
    assert (lost / "checkpoint.pt").read_bytes() == b"trained further"
    assert archive.restore(tmp_path / "archive", tmp_path / "x" / "task" / "none" / "seed0") == []  # not kept


@pytest.mark.slow
def test_a_grid_whose_runs_vanished_goes_on_from_the_archive(tmp_path):
    script = BENCH / "sparse_tasks.py"
    root, kept = tmp_path / "runs", tmp_path / "archive"
    base = [sys.executable, str(script), "--root", str(root), "--archive", str(kept), *TINY]
    first = subprocess.run(base + ["--frames", "1024"], capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    dest = kept / "staircase" / "none" / "seed0"
    assert {p.name for p in dest.iterdir()} >= {"checkpoint.pt.gz", "config.yaml", "metrics.csv"}
    [rung] = dest.glob("eval_*.json")
    assert "commit it" in first.stderr
    shutil.rmtree(root)  # the machine's runs/ is gone
    second = subprocess.run(base + ["--frames", "2048"], capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "rebuilt from" in second.stderr
    summary = json.loads(second.stdout.strip().splitlines()[-1])
    assert summary["launched"] == {"train": 0, "resume": 1, "eval": 1, "create": 0}  # continued, not retrained
    assert json.loads((root / "staircase" / "none" / "seed0" / "eval.json").read_text())["frames_trained"] == 2048
    assert len(list(dest.glob("eval_*.json"))) == 2 and rung.exists()
    assert [r["frames"] for r in summary["by_frames"]] == sorted(r["frames"] for r in summary["by_frames"])
    assert len(summary["by_frames"]) == 2  # the rung before the loss is in the curve
