"""benchmarks/sparse_tasks.py: a grid of real oni-train/oni-eval commands, resumed, skipped, aggregated over seeds."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "sparse_tasks.py"
sys.path.insert(0, str(SCRIPT.parent))  # benchmarks/: the sparse_grid package, and grid_archive it imports
from sparse_grid import analysis, cli, launcher, report  # noqa: E402
from sparse_grid import grid as runs  # noqa: E402

sys.path.remove(str(SCRIPT.parent))
T975 = {1: 12.706, 2: 4.303}  # Student's t, 97.5 % quantile, from printed tables
EVAL_KEYS = {"success", "return", "max_dlvl", "xlvl", "progression", "score", "approved_per_episode"}
TINY = ["--tasks", "staircase", "--annotators", "scripted", "--frames", "2048",
        "--extra", "--workers 1 --envs-per-worker 4 --max-episode-steps 40 --no-tensorboard",
        "--episodes", "4", "--eval-extra", "--workers 1"]


@pytest.fixture(scope="module")
def grid():
    """The grid's bottom module (runs and their folders); the tests reach the others by name."""
    return runs


def _json_line(text):
    lines = text.strip().splitlines()
    return json.loads(lines[-1]), lines[:-1]


def _snapshot(root):
    """mtime of every file of every run folder."""
    return {str(p): p.stat().st_mtime_ns for p in Path(root).rglob("*") if p.is_file() and "seed" in str(p)}


# ---------------------------------------------------------------------- end to end (real commands)
@pytest.mark.slow
def test_grid_trains_evaluates_aggregates_skips_and_resumes(grid, tmp_path, capsys):
    root = tmp_path / "grid"
    tiny = [*TINY, "--frames", "1024"]  # eight updates of 128 frames (the last --frames counts)
    args = [sys.executable, str(SCRIPT), "--root", str(root), *tiny]
    first = subprocess.run(args + ["--rewards", "none", "retrieval", "--seeds", "0", "--random", "--parallel", "2"],
                           capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stderr[-3000:]
    summary, table = _json_line(first.stdout)
    assert any(line.startswith("task / setting") for line in table)
    assert summary["launched"] == {"train": 2, "resume": 0, "eval": 3, "create": 1}
    assert summary["failed"] == [] and summary["done"] == 3

    runs = {s: root / "staircase" / s / "seed0" for s in ("retrieval-scripted", "none", "random")}
    store = runs["retrieval-scripted"] / "captions.pt"
    evals = {}
    for setting, folder in runs.items():
        evals[setting] = json.loads((folder / "eval.json").read_text())
        assert evals[setting]["episodes"] == 4
        assert evals[setting]["messages"]["approved_per_episode"] is not None  # every row judged by labels
    assert evals["retrieval-scripted"]["frames_trained"] >= 1024 and evals["random"]["frames_trained"] == 0
    # none and random are judged by the intrinsic run's labels
    assert evals["none"]["caption_store"] == evals["random"]["caption_store"] == str(store)
    assert not (runs["none"] / "captions.pt").exists()
    train_log = (runs["none"] / "train.log").read_text()
    assert "$ oni-train " in train_log and "--intrinsic-reward none --seed 0 --frames 1024" in train_log
    assert "--annotator" not in train_log.splitlines()[1]

    rows = {r["setting"]: r for r in summary["rows"]}
    assert set(rows) == set(runs)
    for setting, row in rows.items():
        assert set(row["eval"]) == EVAL_KEYS and row["seeds"] == [0]
        assert row["eval"]["success"]["mean"] == evals[setting]["success_rate"]["mean"]
        assert row["eval"]["score"]["mean"] == evals[setting]["score"]["mean"]
        assert row["eval"]["progression"]["mean"] == evals[setting]["progression"]["mean"]
        assert set(row["curve"]["episode/success"]) == {"0.25", "0.5", "1"}
    assert rows["none"]["curve"]["episode/success"]["1"]["n"] == 1
    assert rows["random"]["curve"]["episode/success"]["1"]["n"] == 0  # never trained: no curve
    per_run = {r["setting"]: r for r in summary["runs"]}
    assert per_run["none"]["train_time_s"] > 0 and per_run["none"]["eval_time_s"] > 0
    assert per_run["none"]["frames"] == evals["none"]["frames_trained"]
    assert summary["figures"] == [str(root / "staircase" / "curves.png")]
    assert (root / "staircase" / "curves.png").read_bytes()[:4] == b"\x89PNG"
    # every setting against none, seed 0 a pair, the 4 evaluation episodes paired by game
    paired = {r["setting"]: r for r in summary["paired"]}
    assert set(paired) == {"retrieval-scripted", "random"}
    for setting, row in paired.items():
        assert row["baseline"] == "none" and row["seeds"] == [0]
        assert row["success"]["mean"] == pytest.approx(
            evals[setting]["success_rate"]["mean"] - evals["none"]["success_rate"]["mean"])
        assert row["episodes"]["pairs"] == 4
        mine = sum(e["success"] for e in evals[setting]["per_episode"])
        assert row["episodes"]["both"] + row["episodes"]["only_setting"] == mine
    assert any(line.startswith("Paired against the baseline") for line in table)
    for setting, row in rows.items():  # oni-eval's diagnostics, pooled
        assert row["episodes"] == 4 and sum(row["death_causes"].values()) == evals[setting]["end_status"].get("death", 0)
        assert 0 <= row["flagged_runs"] <= 1
    assert any(line.startswith("How the evaluation episodes ended") for line in table)

    # the same command again: everything is done, nothing is launched, nothing rewritten
    before = _snapshot(root)
    again = ["--root", str(root), *tiny, "--rewards", "none", "retrieval", "--seeds", "0", "--random"]
    assert cli.main(again) == 0
    summary, _ = _json_line(capsys.readouterr().out)
    assert summary["launched"] == {"train": 0, "resume": 0, "eval": 0, "create": 0} and summary["done"] == 3
    assert _snapshot(root) == before

    # the folders brought back from another machine without their checkpoints (the GPU node's
    # results), their files' times changed by the copy: done, and never trained again
    import shutil

    copied = tmp_path / "copied"
    for setting in ("retrieval-scripted", "none"):
        shutil.copytree(runs[setting], copied / "staircase" / setting / "seed0",
                        ignore=shutil.ignore_patterns("checkpoint.pt"), copy_function=shutil.copyfile)
    (copied / "staircase" / "retrieval-scripted" / "seed0" / "captions.pt").touch()  # newer than none's eval
    # (none's eval.json names the store under the first --root: the grid reads its place in the grid)
    copied_args = ["--root", str(copied), *tiny, "--rewards", "none", "retrieval", "--seeds", "0"]
    assert cli.main(copied_args + ["--dry-run"]) == 0
    listed, _ = _json_line(capsys.readouterr().out)
    assert listed["counts"] == {"done": 2}
    assert cli.main(copied_args + ["--dry-run", "--episodes", "8"]) == 0  # evaluated otherwise: nothing to redo it with
    listed, _ = _json_line(capsys.readouterr().out)
    assert listed["counts"] == {"conflict": 2}
    assert "copied without it" in listed["runs"][0]["detail"]

    # --dry-run lists the state: done now; with more frames the trained runs are to be resumed
    assert cli.main(again + ["--dry-run"]) == 0
    listed, _ = _json_line(capsys.readouterr().out)
    assert listed["counts"] == {"done": 3}
    assert cli.main(again + ["--dry-run", "--frames", "2048"]) == 0
    out = capsys.readouterr().out
    listed, lines = _json_line(out)
    states = {r["run"]: (r["status"], r["frames"]) for r in listed["runs"]}
    assert states == {"staircase/retrieval-scripted/seed0": ("resume", 1024), "staircase/none/seed0": ("resume", 1024),
                      "staircase/random/seed0": ("done", 0)}
    assert any("from 1,024 frames" in line and "--resume" in line for line in lines)
    assert _snapshot(root) == before

    # an interrupted or extended run is continued with oni-train --resume, its curve kept
    assert cli.main(["--root", str(root), *tiny, "--rewards", "none", "--seeds", "0", "--frames", "2048"]) == 0
    summary, _ = _json_line(capsys.readouterr().out)
    assert summary["launched"] == {"train": 0, "resume": 1, "eval": 1, "create": 0}
    commands = [line for line in (runs["none"] / "train.log").read_text().splitlines() if line.startswith("$ ")]
    assert len(commands) == 2 and commands[1].split("#")[0].rstrip().endswith("--resume")
    frames = [float(line.split(",")[0]) for line in (runs["none"] / "metrics.csv").read_text().splitlines()[1:]]
    assert frames[0] == 128 and frames[-1] == 2048 and frames == sorted(frames)
    assert json.loads((runs["none"] / "eval.json").read_text())["frames_trained"] == 2048
    # the evaluation of the 1,024-frame budget is kept beside the new one, and reported by frames
    [kept] = runs["none"].glob("eval_*.json")
    assert kept.name == f"eval_{evals['none']['frames_trained']}.json"
    assert json.loads(kept.read_text()) == evals["none"]
    assert [(r["setting"], r["frames"], r["seeds"]) for r in summary["by_frames"]] == [
        ("none", analysis.budget_of(evals["none"]["frames_trained"]), [0]), ("none", analysis.budget_of(2048), [0])]
    assert summary["by_frames"][0]["eval"]["success"]["mean"] == evals["none"]["success_rate"]["mean"]
    assert summary["by_frames"][0]["eval"]["max_dlvl"]["mean"] == evals["none"]["max_dlvl"]["mean"]


# ---------------------------------------------------------------------- fast: planning, errors, aggregation
def test_dry_run_lists_every_run_and_its_commands_and_creates_nothing(grid, tmp_path, capsys):
    root = tmp_path / "plan"
    argv = ["--root", str(root), "--tasks", "staircase", "score", "--rewards", "retrieval", "none", "classification",
            "--annotators", "scripted", "llm", "--seeds", "0", "1", "--random", "--frames", "4M",
            "--extra", "--workers 2", "--extra-for", "intrinsic", "--extrinsic-coeff 0", "--episodes", "8", "--dry-run"]
    assert cli.main(argv) == 0
    listed, lines = _json_line(capsys.readouterr().out)
    settings = ["retrieval-scripted", "retrieval-llm", "classification-scripted", "classification-llm", "none", "random"]
    expected = [f"{t}/{s}/seed{k}" for t in ("staircase", "score") for k in (0, 1) for s in settings]
    assert [r["run"] for r in listed["runs"]] == expected
    assert listed["counts"] == {"train": 20, "create": 4}
    by_run = {line.split()[0]: line for line in lines[1:]}
    ret = by_run["score/retrieval-llm/seed1"]
    assert "oni-train --no-progress --workers 2 --extrinsic-coeff 0 --task score --intrinsic-reward retrieval " \
           "--annotator llm --seed 1 --frames 4000000" in ret
    none = by_run["score/none/seed1"]
    assert "--extrinsic-coeff" not in none and "--annotator" not in none  # extra-for intrinsic only
    assert f"--caption-store {root}/score/retrieval-scripted/seed1/captions.pt" in none
    assert "--episodes 8" in none
    assert "untrained checkpoint" in by_run["staircase/random/seed0"]
    assert not root.exists()


def test_variants_run_every_intrinsic_setting_again_with_their_flags(grid, tmp_path, capsys):
    root = tmp_path / "plan"
    argv = ["--root", str(root), "--rewards", "retrieval", "none", "--annotators", "scripted", "--seeds", "0",
            "--frames", "3M", "--extra", "--workers 2", "--variant", "dp1", "--death-penalty 1",
            "--variant", "run", "--count-scope run --count-exponent 0.5", "--baseline", "retrieval-scripted",
            "--dry-run"]
    assert cli.main(argv) == 0
    listed, lines = _json_line(capsys.readouterr().out)
    assert [r["run"] for r in listed["runs"]] == [
        "staircase/retrieval-scripted/seed0", "staircase/retrieval-scripted+dp1/seed0",
        "staircase/retrieval-scripted+run/seed0", "staircase/none/seed0"]
    by_run = {line.split()[0]: line for line in lines[1:]}
    dp1 = by_run["staircase/retrieval-scripted+dp1/seed0"]
    assert "--workers 2 --death-penalty 1 --task staircase" in dp1
    assert f"--logdir {root}/staircase/retrieval-scripted+dp1/seed0" in dp1
    assert "--count-scope run --count-exponent 0.5" in by_run["staircase/retrieval-scripted+run/seed0"]
    base = by_run["staircase/retrieval-scripted/seed0"]
    assert "--death-penalty" not in base and "--count-scope" not in base
    # none is judged by the labels of the setting without a variant
    assert f"--caption-store {root}/staircase/retrieval-scripted/seed0/captions.pt" in by_run["staircase/none/seed0"]
    # the paired analysis compares the variants with the chosen baseline
    per_run = [_evaluated(s, 0, e) for s, e in (("retrieval-scripted", "1000"), ("retrieval-scripted+dp1", "1100"),
                                                ("none", "0000"))]
    rows = {r["setting"]: r for r in analysis.paired(per_run, "retrieval-scripted")}
    assert set(rows) == {"retrieval-scripted+dp1", "none"}
    assert rows["retrieval-scripted+dp1"]["success"]["mean"] == pytest.approx(0.25)
    assert rows["none"]["success"]["mean"] == pytest.approx(-0.25)


def test_a_control_variant_runs_extrinsic_only_with_the_variants_flags_too(grid, tmp_path, capsys):
    root = tmp_path / "plan"
    argv = ["--root", str(root), "--rewards", "retrieval", "none", "--annotators", "scripted", "--seeds", "0", "1",
            "--frames", "3M", "--extra", "--workers 2", "--variant", "dp2", "--death-penalty 2",
            "--variant", "run", "--count-scope run", "--control-variant", "dp2", "--baseline", "none+dp2", "--dry-run"]
    assert cli.main(argv) == 0
    listed, lines = _json_line(capsys.readouterr().out)
    assert [r["run"] for r in listed["runs"]] == [
        f"staircase/{s}/seed{k}" for k in (0, 1)
        for s in ("retrieval-scripted", "retrieval-scripted+dp2", "retrieval-scripted+run", "none", "none+dp2")]
    by_run = {line.split()[0]: line for line in lines[1:]}
    control = by_run["staircase/none+dp2/seed1"]
    assert "--workers 2 --death-penalty 2 --task staircase --intrinsic-reward none --seed 1" in control
    assert "--count-scope" not in control and "--annotator" not in control
    assert f"--logdir {root}/staircase/none+dp2/seed1" in control
    # judged by the labels of the intrinsic setting without a variant, as plain none is
    assert f"--caption-store {root}/staircase/retrieval-scripted/seed1/captions.pt" in control
    assert "--death-penalty" not in by_run["staircase/none/seed1"]
    per_run = [_evaluated(s, 0, e) for s, e in (("retrieval-scripted+dp2", "1110"), ("none+dp2", "1000"),
                                                ("none", "0000"))]
    rows = {r["setting"]: r for r in analysis.paired(per_run, "none+dp2")}
    assert rows["retrieval-scripted+dp2"]["success"]["mean"] == pytest.approx(0.5)
    assert rows["none"]["success"]["mean"] == pytest.approx(-0.25)
    # without none in the grid there is nothing to run it on
    argv = ["--root", str(root), "--rewards", "retrieval", "--seeds", "0", "--variant", "dp2", "--death-penalty 2",
            "--control-variant", "dp2", "--dry-run"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == "sparse_tasks.py: error: --control-variant dp2 runs the 'none' setting again: add it to --rewards"


def test_extra_for_an_annotator_reaches_only_the_runs_it_labels(grid, tmp_path, capsys):
    root = tmp_path / "plan"
    argv = ["--root", str(root), "--rewards", "retrieval", "none", "--annotators", "scripted", "store",
            "--extra-for", "store", "--labels-from llm_labels.pt", "--seeds", "0", "--frames", "3M", "--dry-run"]
    assert cli.main(argv) == 0
    listed, lines = _json_line(capsys.readouterr().out)
    assert [r["run"] for r in listed["runs"]] == [
        "staircase/retrieval-scripted/seed0", "staircase/retrieval-store/seed0", "staircase/none/seed0"]
    by_run = {line.split()[0]: line for line in lines[1:]}
    assert "--labels-from llm_labels.pt --task staircase --intrinsic-reward retrieval --annotator store" \
        in by_run["staircase/retrieval-store/seed0"]
    assert "--labels-from" not in by_run["staircase/retrieval-scripted/seed0"]
    assert "--labels-from" not in by_run["staircase/none/seed0"]


@pytest.mark.parametrize(
    "extra, expected",
    [
        (["--extra", "--seed 3"], "--extra may not set --seed"),
        (["--extra-for", "retrieval", "--logdir x"], "may not set --logdir"),
        (["--extra", "--no-such-flag"], "oni-train refuses its flags: unrecognized arguments: --no-such-flag"),
        (["--extra", "--lr abc"], "oni-train refuses its flags: argument --lr"),
        (["--extra", "--workers 0"], "--workers must be at least 1"),
        (["--extra", '"unclosed'], "--extra"),
        (["--extra-for", "bogus", "--lr 1"], "unknown key 'bogus'"),
        (["--eval-extra", "--episodes 3"], "--eval-extra may not set --episodes"),
        (["--eval-extra", "--greedy --sample"], "oni-eval refuses it"),
        (["--rewards", "nope"], "unknown reward 'nope'"),
        (["--budgets", "0"], "--budgets are fractions"),
        (["--parallel", "0"], "--parallel must be at least 1"),
        (["--status-every", "-1"], "--status-every must be non-negative"),
        (["--frames", "lots"], "--frames"),
        (["--variant", "Bad Name", "--lr 1"], "--variant: 'Bad Name' must be a new name"),
        (["--variant", "a", "--lr 1", "--variant", "a", "--lr 2"], "--variant: 'a' must be a new name"),
        (["--variant", "a", "--task score"], "--variant a may not set --task"),
        (["--variant", "dp", "--death-penalty -1"], "--death-penalty and --survival-bonus must be non-negative"),
        (["--baseline", "retrieval-scripted"], "--baseline 'retrieval-scripted' is not a setting of this grid"),
        (["--variant", "dp", "--death-penalty 1", "--control-variant", "dq"],
         "--control-variant: 'dq' is not a --variant of this grid"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(grid, tmp_path, capsys, extra, expected):
    argv = ["--root", str(tmp_path / "r"), "--rewards", "none", "retrieval", "--seeds", "0", *extra]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("sparse_tasks.py: error:") and len(err.splitlines()) == 1, err
    assert expected in err, err
    assert not (tmp_path / "r").exists()


def test_a_run_folder_of_another_configuration_is_refused(grid, tmp_path, capsys):
    from torchrl_oni.train.config import TrainConfig
    from torchrl_oni.train.ppo import write_config

    root = tmp_path / "r"
    folder = root / "staircase" / "none" / "seed0"
    folder.mkdir(parents=True)
    # the same flags but another learning rate and more frames (frames alone would be continued)
    write_config(TrainConfig(task="staircase", frames=8192, lr=1e-3, workers=1, envs_per_worker=4,
                             max_episode_steps=40, tensorboard=False, progress=False).resolved(), str(folder))
    argv = ["--root", str(root), *TINY, "--rewards", "none", "--seeds", "0"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("sparse_tasks.py: error:") and len(err.splitlines()) == 1
    assert str(folder) in err and "--lr 0.001 -> 0.0003" in err and "--frames" not in err
    assert cli.main(argv + ["--dry-run"]) == 0
    listed, _ = _json_line(capsys.readouterr().out)
    assert listed["runs"][0]["status"] == "conflict"
    assert sorted(p.name for p in folder.iterdir()) == ["config.yaml"]  # nothing launched


def test_a_run_trained_past_the_budget_is_not_evaluated_as_this_budgets(grid, tmp_path, capsys):
    """A ladder restarted at a lower rung after its next rung began: the run folder holds a later
    budget's checkpoint, and this budget's evaluation must stay what it was."""
    from torchrl_oni.train.checkpoint import save_checkpoint
    from torchrl_oni.train.config import TrainConfig
    from torchrl_oni.train.ppo import write_config

    root = tmp_path / "r"
    folder = root / "staircase" / "none" / "seed0"
    folder.mkdir(parents=True)
    cfg = TrainConfig(task="staircase", frames=2048, workers=1, envs_per_worker=4, max_episode_steps=40,
                      tensorboard=False, progress=False).resolved()
    write_config(cfg, str(folder))
    evaluation = json.dumps({"frames_trained": 2048, "episodes": 4, "seed": 0, "policy": "sampling"})
    (folder / "eval.json").write_text(evaluation)
    argv = ["--root", str(root), *TINY, "--rewards", "none", "--seeds", "0", "--dry-run"]
    for frames, status in ((2048 + cfg.frames_per_update - 1, "eval"), (2048 + cfg.frames_per_update, "conflict")):
        save_checkpoint({"frames": frames}, str(folder / "checkpoint.pt"))  # newer than eval.json
        assert cli.main(argv) == 0
        listed, _ = _json_line(capsys.readouterr().out)
        assert listed["runs"][0]["status"] == status, frames
    assert cli.main(argv[:-1]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("sparse_tasks.py: error:") and len(err.splitlines()) == 1
    assert f"trained to {2048 + cfg.frames_per_update:,} frames, past --frames 2,048" in err
    assert (folder / "eval.json").read_text() == evaluation, "this budget's evaluation is left as it was"


def _per_run(task, setting, seed, status, success, ret, curve):
    return {"task": task, "setting": setting, "reward": setting.split("-")[0], "annotator": None, "seed": seed,
            "status": status, "frames": 4096, "train_time_s": 10.0 + seed, "eval_time_s": 1.0,
            "eval": {"success": success, "return": ret, "max_dlvl": 1.0 + seed, "xlvl": 1.0, "score": 5.0,
                     "progression": 0.01 * seed, "approved_per_episode": None},
            "curve": {"episode/success": {"0.5": curve, "1": curve + 0.1}}}


def test_aggregate_is_mean_and_student_t_ci_over_the_seeds_that_are_done(grid):
    class Args:
        budgets = [0.5, 1.0]
        curve_metrics = ["episode/success"]
        episodes, frames = 16, 4096

    success, ret = [0.25, 0.5, 0.75], [1.0, 4.0, 10.0]
    per_run = [_per_run("staircase", "retrieval-llm", k, "done", success[k], ret[k], 0.1 * k) for k in range(3)]
    per_run.append(_per_run("staircase", "retrieval-llm", 3, "resume", 1.0, 100.0, 1.0))  # not done: left out
    per_run += [_per_run("staircase", "none", k, "done", 0.0, 2.0 * k, 0.0) for k in range(2)]
    rows = {r["setting"]: r for r in analysis.aggregate(per_run, Args)}
    row = rows["retrieval-llm"]
    assert row["seeds"] == [0, 1, 2] and row["runs"] == 4

    def reference(values):
        n = len(values)
        mean = sum(values) / n
        sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
        half = T975[n - 1] * sd / math.sqrt(n)
        return mean, [mean - half, mean + half]

    for key, values in (("success", success), ("return", ret), ("max_dlvl", [1.0, 2.0, 3.0])):
        mean, ci = reference(values)
        assert row["eval"][key]["mean"] == pytest.approx(mean)
        assert row["eval"][key]["ci95"] == pytest.approx(ci, rel=1e-4)
    mean, ci = reference([0.1 * k + 0.1 for k in range(3)])
    assert row["curve"]["episode/success"]["1"]["mean"] == pytest.approx(mean)
    assert row["curve"]["episode/success"]["1"]["ci95"] == pytest.approx(ci, rel=1e-4)
    assert row["eval"]["approved_per_episode"]["n"] == 0 and row["train_time_s"]["mean"] == pytest.approx(11.0)
    mean, ci = reference([0.0, 2.0])
    assert rows["none"]["eval"]["return"]["ci95"] == pytest.approx(ci, rel=1e-4)
    text = report.format_tables(list(rows.values()), per_run, Args)
    assert "success@50%" in text and "staircase / retrieval-llm" in text
    assert rows["retrieval-llm"]["episodes"] == 0 and rows["retrieval-llm"]["death_causes"] == {}  # no eval.json
    line = next(line for line in text.splitlines() if line.startswith("staircase / retrieval-llm") and "/4" in line)
    half = T975[2] * 0.25 / math.sqrt(3)  # success: mean 0.5, standard deviation 0.25 over 3 seeds
    assert f"0.500 ±{half:.3f}" in line, line
    # progression: shares 0, 0.01, 0.02 in the JSON, printed in %: mean 1, standard deviation 1
    assert row["eval"]["progression"]["mean"] == pytest.approx(0.01)
    assert "progress %" in text and f"1.00 ±{T975[2] / math.sqrt(3):.2f}" in line, line


def _evaluated(setting, seed, episodes, games=None):
    """A done run whose evaluation episodes succeeded as ``episodes`` says ("0110…")."""
    run = _per_run("staircase", setting, seed, "done", episodes.count("1") / len(episodes), 0.0, 0.0)
    run["episode_success"] = episodes
    run["eval_games"] = games or {"task": "staircase", "seed": 0, "episodes": len(episodes), "workers": 1,
                                  "envs_per_worker": 4, "max_episode_steps": 5000}
    return run


def test_paired_analysis_pairs_seeds_and_games_and_matches_a_reference(grid):
    from scipy import stats as scipy_stats  # the reference: SciPy's paired t interval and binomial test

    oni = ["1100", "1000", "1110", "0100", "1000"]
    none = ["1000", "0000", "0110", "0010", "0000"]  # seed 3: a tie, each side winning a game
    per_run = [_evaluated("retrieval-llm", k, e) for k, e in enumerate(oni)]
    per_run += [_evaluated("none", k, e) for k, e in enumerate(none)]
    per_run.append(_evaluated("retrieval-llm", 9, "1111"))  # no baseline run of seed 9: no pair
    per_run.append(_per_run("staircase", "none", 8, "train", None, None, 0.0))  # not done: no pair
    [row] = analysis.paired(per_run)
    assert row["setting"] == "retrieval-llm" and row["baseline"] == "none" and row["seeds"] == [0, 1, 2, 3, 4]
    a = [e.count("1") / 4 for e in oni]
    b = [e.count("1") / 4 for e in none]
    ci = scipy_stats.ttest_rel(a, b).confidence_interval()
    assert row["success"]["mean"] == pytest.approx(sum(a) / 5 - sum(b) / 5)
    assert row["success"]["ci95"] == pytest.approx([ci.low, ci.high], abs=1e-3)
    assert row["success"]["wins"] == [4, 0] and row["success"]["p"] == pytest.approx(2 / 16)  # 4 non-zero pairs
    # episodes: seed 0 "1100" vs "1000" -> both 1, only oni 1, neither 2; and so on
    assert row["episodes"] == {"both": 3, "only_setting": 5, "only_baseline": 1, "neither": 11, "pairs": 20,
                               "p": pytest.approx(scipy_stats.binomtest(5, 6).pvalue)}
    text = "\n".join(report.format_paired([row]))
    assert "staircase / retrieval-llm - none" in text and "3/5/1" in text


def test_seed_summaries_join_the_pairs_at_their_frames_and_match_a_reference(grid, tmp_path, capsys):
    """A seed known only by its figures (its run folders lost) joins the paired analysis at the
    runs' budget: its success rates join the seeds' t interval, its games the pooled McNemar."""
    from scipy import stats as scipy_stats

    per_run = [_evaluated("retrieval-llm", 1, "1000"), _evaluated("none", 1, "0000"),
               _evaluated("retrieval-llm", 2, "0100"), _evaluated("none", 2, "0100")]
    seed0 = {"task": "staircase", "setting": "retrieval-llm", "baseline": "none", "seed": 0, "frames": 4096,
             "success": [0.75, 0.0], "episodes": {"both": 0, "only_setting": 3, "only_baseline": 0, "neither": 1},
             "source": "BENCHMARKS.md"}
    elsewhere = dict(seed0, seed=5, frames=8192)  # another budget: not joined
    path = tmp_path / "summaries.json"
    path.write_text(json.dumps([seed0, elsewhere]))
    summaries = analysis.read_seed_summaries(path)
    [row] = analysis.paired(per_run, "none", summaries)
    a, b = [0.25, 0.25, 0.75], [0.0, 0.25, 0.0]  # seeds 1, 2, then the summary's seed 0
    ci = scipy_stats.ttest_rel(a, b).confidence_interval()
    assert row["seeds"] == [1, 2, 0] and row["summary_seeds"] == [0] and row["summary_sources"] == ["BENCHMARKS.md"]
    assert row["success"]["mean"] == pytest.approx((0.25 + 0 + 0.75) / 3)
    assert row["success"]["ci95"] == pytest.approx([ci.low, ci.high], abs=1e-3)
    # seed 1: only ONI 1, neither 3; seed 2: both 1, neither 3; seed 0: only ONI 3, neither 1
    assert row["episodes"] == {"both": 1, "only_setting": 4, "only_baseline": 0, "neither": 7, "pairs": 12,
                               "p": pytest.approx(scipy_stats.binomtest(4, 4).pvalue)}
    assert "seed 0: from its summary (BENCHMARKS.md)" in "\n".join(report.format_paired([row]))
    # a summary without games paired by game: the success interval still counts it, the games not
    [row] = analysis.paired(per_run, "none", [dict(seed0, episodes=None)])
    assert row["success"]["n"] == 3 and row["episodes"] is None and "seed(s) 0" in row["episodes_unpaired"]
    # ... and beside runs that played other games, both reasons are given
    other_games = dict(per_run[1]["eval_games"], seed=1)
    [row] = analysis.paired([per_run[0], _evaluated("none", 1, "0000", games=other_games)], "none",
                            [dict(seed0, episodes=None)])
    assert "seed(s) 1: the two runs were not" in row["episodes_unpaired"]
    assert "seed(s) 0: the summary has no games" in row["episodes_unpaired"]
    # a bad file is one GridError naming it
    path.write_text(json.dumps([{"task": "staircase"}]))
    with pytest.raises(analysis.GridError, match="entry 0 lacks setting"):
        analysis.read_seed_summaries(path)
    assert cli.main(["--root", str(tmp_path / "grid"), "--seed-summaries", str(path), "--dry-run"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "--seed-summaries" in line and "entry 0 lacks setting" in line


def test_death_causes_and_flags_are_pooled_over_the_seeds(grid):
    class Args:
        budgets = [1.0]
        curve_metrics = ["episode/success"]
        episodes, frames = 4, 4096

    per_run = []
    for k, (causes, flags) in enumerate([({"choking": 3, "died": 1}, ["choking ends 3 of 4 episodes"]),
                                         ({"died": 2, "starving": 1}, []),
                                         ({"choking": 1}, ["a paid caption precedes deaths"])]):
        run = _evaluated("retrieval-llm", k, "1000")
        run.update(death_causes=causes, flags=flags, episodes=4)
        per_run.append(run)
    skipped = _per_run("staircase", "retrieval-llm", 3, "train", None, None, 0.0)  # not done: not pooled
    skipped.update(death_causes={"choking": 50}, flags=["x"], episodes=64)
    per_run.append(skipped)
    [row] = analysis.aggregate(per_run, Args)
    assert row["episodes"] == 12 and row["flagged_runs"] == 2
    assert row["death_causes"] == {"choking": 4, "died": 3, "starving": 1}
    assert list(row["death_causes"]) == ["choking", "died", "starving"]  # largest first
    text = report.format_tables([row], per_run, Args)
    line = next(l for l in text.splitlines() if l.startswith("staircase / retrieval-llm") and l.rstrip().endswith("2/3"))
    assert line.split()[3:9] == ["12", "8", "4", "3", "1", "0"], line


def test_paired_analysis_does_not_pair_episodes_of_different_games(grid):
    other_games = {"task": "staircase", "seed": 1, "episodes": 4, "workers": 1, "envs_per_worker": 4,
                   "max_episode_steps": 5000}
    per_run = [_evaluated("retrieval-llm", 0, "1100"), _evaluated("none", 0, "1000", games=other_games)]
    [row] = analysis.paired(per_run)
    assert row["success"]["n"] == 1 and row["success"]["mean"] == pytest.approx(0.25)
    assert row["episodes"] is None and "seed(s) 0" in row["episodes_unpaired"]
    assert "not paired" in "\n".join(report.format_paired([row]))
    assert analysis.paired([_evaluated("retrieval-llm", 0, "1100")]) == []  # no baseline in the grid


def _run_folder(grid, tmp_path, target):
    return grid.Run(task="staircase", reward="none", annotator=None, seed=0, logdir=tmp_path,
                    train_args=[], target_frames=target)


def test_an_evaluation_of_fewer_frames_is_kept_before_the_next_one(grid, tmp_path):
    run = _run_folder(grid, tmp_path, target=4096)
    assert launcher.keep_earlier_eval(run) is None  # no eval.json yet
    first = {"frames_trained": 2048, "success_rate": {"mean": 0.25, "n": 4}}
    (tmp_path / "eval.json").write_text(json.dumps(first))
    kept = launcher.keep_earlier_eval(run)
    assert kept == tmp_path / "eval_2048.json" and not (tmp_path / "eval.json").exists()
    assert json.loads(kept.read_text()) == first
    # an evaluation of as many frames (other --episodes, say) is redone in place, not kept
    (tmp_path / "eval.json").write_text(json.dumps({"frames_trained": 4096}))
    assert launcher.keep_earlier_eval(run) is None and (tmp_path / "eval.json").exists()
    (tmp_path / "eval_junk.json").write_text("{}")  # not a budget: ignored
    (tmp_path / "eval_1024.json").write_text("not json")  # unreadable: ignored
    [earlier] = analysis.earlier_evals(tmp_path)
    assert earlier["frames"] == 2048 and earlier["eval"]["success"] == 0.25


def test_progression_is_read_or_recomputed_from_the_episodes_of_an_older_eval_json(grid):
    episodes = [{"episode": 0, "max_dlvl": 5, "xlvl": 1}, {"episode": 1, "max_dlvl": 1, "xlvl": 10}]
    older = {"success_rate": {"mean": 0.0, "n": 2}, "per_episode": episodes}  # before oni-eval scored progression
    # BALROG's table: dungeon level 5 -> 2.648 %, experience level 10 -> 17.910 %
    expected = (0.026482449457437766 + 0.17909953770432294) / 2
    assert analysis.eval_summary(older)["eval"]["progression"] == pytest.approx(expected)
    newer = dict(older, progression={"mean": 0.5, "n": 2})
    assert analysis.eval_summary(newer)["eval"]["progression"] == 0.5  # oni-eval's own is taken as it is
    assert analysis.eval_summary({"success_rate": {"mean": 0.0, "n": 2}})["eval"]["progression"] is None


def test_by_frames_pairs_each_budget_and_matches_a_reference(grid, tmp_path):
    from scipy import stats as scipy_stats

    def ladder(setting, seed, successes, depths):
        """A run evaluated at 1M and 2M frames (kept), then at 4M (current); its progression is
        a tenth of its depth."""
        run = _per_run("staircase", setting, seed, "done", successes[-1], 0.0, 0.0)
        run["eval"]["max_dlvl"] = depths[-1]
        run["eval"]["progression"] = depths[-1] / 10
        run["frames"] = 4_000_128
        run["earlier_evals"] = [{"frames": f, "eval": {"success": x, "max_dlvl": d, "progression": d / 10}}
                                for f, x, d in zip((1_000_064, 2_000_128), successes[:2], depths[:2])]
        return run

    oni = [[0.0, 0.25, 0.5], [0.0, 0.5, 0.75], [0.25, 0.5, 0.5]]
    none = [[0.0, 0.0, 0.25], [0.0, 0.25, 0.25], [0.0, 0.0, 0.0]]
    oni_depth = [[1.0, 1.5, 2.0], [1.1, 1.7, 2.5], [1.2, 1.6, 2.2]]
    none_depth = [[1.0, 1.1, 1.2], [1.0, 1.3, 1.1], [1.1, 1.0, 1.4]]
    per_run = [ladder("retrieval-llm", k, x, d) for k, (x, d) in enumerate(zip(oni, oni_depth))]
    per_run += [ladder("none", k, x, d) for k, (x, d) in enumerate(zip(none, none_depth))]
    per_run[0]["earlier_evals"].pop(0)  # seed 0 of ONI was not evaluated at 1M: that budget has 2 pairs
    per_run.append(_per_run("staircase", "none", 7, "resume", None, None, 0.0))  # nothing evaluated: left out
    rows = analysis.by_frames(per_run)
    assert [(r["frames"], r["setting"], r["seeds"]) for r in rows] == [
        (1_000_000, "retrieval-llm", [1, 2]), (1_000_000, "none", [0, 1, 2]),
        (2_000_000, "retrieval-llm", [0, 1, 2]), (2_000_000, "none", [0, 1, 2]),
        (4_000_000, "retrieval-llm", [0, 1, 2]), (4_000_000, "none", [0, 1, 2])]
    for row, budget in zip(rows[2::2], (1, 2)):
        for key, mine, base in (("success", oni, none), ("max_dlvl", oni_depth, none_depth)):
            a, b = [x[budget] for x in mine], [x[budget] for x in base]
            ci = scipy_stats.ttest_rel(a, b).confidence_interval()
            assert row["eval"][key]["mean"] == pytest.approx(sum(a) / 3)
            assert row["vs_baseline"][key]["mean"] == pytest.approx(sum(a) / 3 - sum(b) / 3)
            assert row["vs_baseline"][key]["ci95"] == pytest.approx([ci.low, ci.high], abs=1e-3)
    assert rows[0]["vs_baseline"]["success"]["n"] == 2  # 1M: ONI's seeds 1 and 2 against theirs
    assert rows[1]["vs_baseline"] == {"success": None, "max_dlvl": None, "progression": None}  # the baseline's own row
    assert rows[2]["eval"]["progression"]["mean"] == pytest.approx(rows[2]["eval"]["max_dlvl"]["mean"] / 10)
    text = "\n".join(report.format_by_frames(rows))
    assert "By frames trained" in text and "vs none" in text
    line = next(l for l in text.splitlines() if l.startswith("staircase / retrieval-llm") and " 2M " in l)
    half = T975[2] * math.sqrt(1 / 48) / math.sqrt(3)  # success and its difference: both sd 0.144 over 3 seeds
    depth = rows[2]["vs_baseline"]["max_dlvl"]
    assert line.split()[3:9] == ["2M", "3", "0.417", f"±{half:.3f}", "+0.333", f"±{half:.3f}"], line
    assert line.split()[12] == f"±{(depth['ci95'][1] - depth['ci95'][0]) / 2:.2f}*"  # depth: CI excludes 0
    # progression, a tenth of the depth: printed in %, ten times the depth's numbers
    mean, diff = rows[2]["eval"]["max_dlvl"]["mean"], depth["mean"]
    assert line.split()[13:17] == [f"{10 * mean:.2f}", f"±{10 * (rows[2]['eval']['max_dlvl']['ci95'][1] - mean):.2f}",
                                   f"{10 * diff:+.2f}", f"±{10 * (depth['ci95'][1] - depth['ci95'][0]) / 2:.2f}*"], line
    [figure] = report.plot_by_frames(rows, tmp_path)
    assert figure == str(tmp_path / "staircase" / "by_frames.png")
    assert Path(figure).read_bytes()[:4] == b"\x89PNG"
    assert report.plot_by_frames([r for r in rows if r["frames"] == 1_000_000], tmp_path / "one") == []
    # without an earlier evaluation the table would repeat the main one: nothing
    for run in per_run:
        run["earlier_evals"] = []
    assert analysis.by_frames(per_run) == [] and report.format_by_frames([]) == []


def test_the_last_complete_metrics_row_is_read_from_the_tail(grid, tmp_path):
    path = tmp_path / "metrics.csv"
    assert launcher.last_metrics_row(path) is None  # no file
    path.write_text("frames,time_s,fps\n")
    assert launcher.last_metrics_row(path) is None  # a header alone
    rows = "".join(f"{128 * i},{i}.0,{1000 + i}\n" for i in range(1, 20_000))  # far over the 64 KiB read
    path.write_text("frames,time_s,fps\n" + rows + "2560128,20000.0,99")  # the last line being written
    assert launcher.last_metrics_row(path) == {"frames": 128 * 19_999, "time_s": 19_999.0, "fps": 20_999.0}
    path.write_text("frames,time_s,fps,episode/success\n128,1.0,900,\n256,2.0,950,0.5\n")
    assert launcher.last_metrics_row(path) == {"frames": 256, "time_s": 2.0, "fps": 950.0, "episode/success": 0.5}
    path.write_text("frames,time_s,fps\n128,1.0,900\n256,2.0\n")  # a short row is skipped, not misread
    assert launcher.last_metrics_row(path) == {"frames": 128, "time_s": 1.0, "fps": 900.0}


def test_progress_lines_of_the_training_runs(grid, tmp_path, capsys):
    run = _run_folder(grid, tmp_path, target=100_000_000)
    assert launcher.progress_line(run) is None  # nothing logged yet
    (tmp_path / "metrics.csv").write_text("frames,time_s,fps\n10000000,1200.0,8000\n")
    assert launcher.progress_line(run) == ("staircase/none/seed0: 10,000,000 of 100,000,000 frames (10 %), "
                                       "8,000 frames/s, about 3.1 h left")

    class Args:  # one command that outlives a status interval
        status_every = 0.2

    class Slow:
        parallel = 1
        lock = launcher.threading.RLock()
        training = {run.name: run}

    import time as _time
    from unittest import mock
    with mock.patch.object(launcher, "execute", lambda *a: _time.sleep(0.8)):
        launcher.run_pool([run], Slow, Args, None, final=True)
    lines = [l for l in capsys.readouterr().err.splitlines() if "10,000,000 of 100,000,000" in l]
    assert 1 <= len(lines) <= 4, lines
    Args.status_every = 0
    with mock.patch.object(launcher, "execute", lambda *a: _time.sleep(0.8)):
        launcher.run_pool([run], Slow, Args, None, final=True)
    assert "frames/s" not in capsys.readouterr().err


def test_curve_values_are_read_at_the_budgets(grid, tmp_path):
    rows = [{"frames": 512.0 * i, "time_s": float(i), "episode/success": i / 10} for i in range(1, 9)]
    rows[0].pop("episode/success")  # no episode had ended yet
    assert analysis.curve_value(rows, "episode/success", 2048) == pytest.approx(0.4)
    assert analysis.curve_value(rows, "episode/success", 4096) == pytest.approx(0.8)
    assert analysis.curve_value(rows, "episode/success", 4300) == pytest.approx(0.8)  # within one logging interval
    assert analysis.curve_value(rows, "episode/success", 8192) is None  # the run is not there yet
    assert analysis.curve_value(rows, "episode/dlvl", 2048) is None


@pytest.mark.slow
def test_the_gpu_call_script_brings_back_runs_the_grid_counts_as_done(tmp_path, capsys):
    """benchmarks/gpu_sparse_call.sh on the CPU at toy sizes: one call per run; each finished run
    comes back as its archive folder packed in files the machine can return (no folders, under
    16 MiB), and the grid's own command, pointed at the unpacked archive, rebuilds them as done."""
    repo = SCRIPT.parent.parent
    out_dir = tmp_path / "out"
    # two updates, one evaluation game (oni-eval plays a single game in its own process: no
    # worker processes to start)
    env = dict(os.environ, DEVICE="cpu", WORKERS="1", ENVS="4", BATCH="256", FRAMES="512",
               EPISODES="1", GRID=str(tmp_path / "node"), OUT=str(out_dir), ARCHIVE=str(tmp_path / "node_archive"))
    call = ["bash", str(repo / "benchmarks" / "gpu_sparse_call.sh")]
    for setting in ("retrieval-store", "none"):  # none is judged by retrieval-store's labels
        out = subprocess.run(call + [setting, "0", "300"], cwd=repo, env=env, capture_output=True, text=True,
                             timeout=600)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        assert f"packed benchmarks/results/lvl3_gpu/staircase-lvl3/{setting}/seed0: finished" in out.stdout
    assert all(p.is_file() and p.stat().st_size <= 16 * 2**20 for p in out_dir.iterdir())
    here = tmp_path / "checkout"
    here.mkdir()
    for setting in ("retrieval-store", "none"):
        subprocess.run(["tar", "-xzf", str(out_dir / f"lvl3_gpu_{setting}_seed0.tgz")], cwd=here, check=True)
    archive = here / "benchmarks" / "results" / "lvl3_gpu" / "staircase-lvl3"
    assert sorted(p.name for p in archive.iterdir()) == ["none", "retrieval-store"]
    assert {"eval_512.json", "config.yaml", "metrics.csv", "checkpoint.pt.gz", "captions.pt.gz"} <= {
        p.name for p in (archive / "retrieval-store" / "seed0").iterdir()}
    # the grid's command on this side, an empty --root and the unpacked archive: done, nothing to run
    assert cli.main(["--root", str(tmp_path / "fresh"), "--archive", str(archive.parent),
                     "--tasks", "staircase-lvl3", "--rewards", "none", "retrieval",
                     "--annotators", "store", "--extra-for", "store",
                     "--labels-from benchmarks/labels/staircase-lvl3_qwen2.5-coder-0.5b.jsonl.gz",
                     "--seeds", "0", "--frames", "512", "--episodes", "1", "--extra",
                     "--device cpu --workers 1 --envs-per-worker 4 --prefetch-batches 0 --frames-per-update 256 "
                     "--minibatch-size 256 --extrinsic-coeff 10", "--dry-run"]) == 0, capsys.readouterr().err[-2000:]
    listed, _ = _json_line(capsys.readouterr().out)
    assert listed["counts"] == {"done": 2}
    bad = subprocess.run(call + ["retrieval-llm", "0"], cwd=repo, env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "unknown setting" in bad.stderr
