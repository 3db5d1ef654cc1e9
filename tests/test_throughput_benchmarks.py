"""Seconds-long runs of the throughput benchmarks, so that a refactor cannot leave them crashing:
each must end with its JSON line and the fields BENCHMARKS.md quotes."""
import pytest
from helpers import BENCH, bench_json, script_exit


def test_learner_throughput_smoke():
    result, table = bench_json([BENCH / "learner_throughput.py", "--seconds", "0.5", "--threads", "1",
                                "--frames-per-update", "256", "512", "--minibatch-size", "128"])
    assert "frames/s" in table and "GAE path" in table
    rows = result["results"]
    assert [(r["frames_per_update"], r["fast_values"]) for r in rows] == [(256, True), (256, False), (512, True)]
    for r in rows:
        assert r["fps"] > 0 and 0 < r["outside_loss_share"] < 1
        assert {"gae", "forward", "backward", "optimizer"} <= set(r["shares"])
    assert result["ratio"] > 0


def test_learner_throughput_refuses_missing_cuda(capfd):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    code, err = script_exit(BENCH / "learner_throughput.py", ["--device", "cuda"], capfd)
    assert code == 2 and "CUDA is not available" in err and "Traceback" not in err


@pytest.mark.slow
def test_train_throughput_smoke():
    result, table = bench_json([BENCH / "train_throughput.py", "--seconds", "3", "--workers", "1", "--envs", "4",
                                "--frames-per-update", "256", "--no-baseline"])
    assert result["fps"] > 0 and result["frames_per_update"] == 256
    assert {"gae", "forward", "backward", "weights"} <= set(result["stages"])
    assert 0 < result["outside_loss_share"] < 1
    assert result["gpu_util"] is None  # no GPU here: unknown, never a made-up figure
    assert "learner's time per stage" in table


def test_train_throughput_against_baseline_settings_smoke():
    """The A/B of a setting in one run: this code with --prefetch-batches 2 against the same code
    (--baseline-code) with 0; both sides get the same --frames-per-update. The baseline plays its
    own number of games per worker (--baseline-envs: a default that changed)."""
    root = str(BENCH.parent)
    result, table = bench_json([BENCH / "train_throughput.py", "--seconds", "4", "--workers", "1", "--envs", "4",
                                "--frames-per-update", "256", "--prefetch-batches", "2", "--baseline-code", root,
                                "--baseline-prefetch-batches", "0", "--baseline-envs", "8"])
    assert result["prefetch_batches"] == 2 and result["frames_per_update"] == 256
    assert (result["envs_per_worker"], result["baseline_envs_per_worker"]) == (4, 8)
    assert result["baseline_fps"] > 0 and result["ratio"] == pytest.approx(result["fps"] / result["baseline_fps"],
                                                                          rel=0.01)
    assert len(result["rounds_fps"]) == len(result["rounds_baseline_fps"]) == 1
    assert "--baseline-code" in table


def test_train_throughput_compares_games_in_groups_with_one_group_smoke():
    """--acting-splits against the same code with --baseline-acting-splits: both sides served."""
    root = str(BENCH.parent)
    result, table = bench_json([BENCH / "train_throughput.py", "--seconds", "4", "--workers", "1", "--envs", "4",
                                "--acting", "server", "--acting-splits", "2", "--baseline-code", root,
                                "--baseline-acting-splits", "1"])
    assert result["acting"] == "server" and result["acting_splits"] == 2
    assert result["baseline_fps"] > 0 and "acting on server" in table


def test_train_throughput_prices_a_reward_type_on_a_task_smoke():
    """What ONI-Retrieval costs, in one run: this code with it against the same code without it
    (--baseline-intrinsic-reward none), on the task asked for; the hooks run on one side only."""
    root = str(BENCH.parent)
    result, table = bench_json([BENCH / "train_throughput.py", "--seconds", "4", "--workers", "1", "--envs", "4",
                                "--frames-per-update", "256", "--task", "staircase-lvl3", "--intrinsic-reward",
                                "retrieval", "--baseline-code", root, "--baseline-intrinsic-reward", "none"])
    assert result["task"] == "staircase-lvl3" and result["baseline_intrinsic_reward"] == "none"
    assert result["stages"]["hooks"] > 10 * result["baseline_stages"]["hooks"]
    assert result["ratio"] == pytest.approx(result["fps"] / result["baseline_fps"], rel=0.01)
    assert "(baseline: none), task staircase-lvl3" in table


@pytest.mark.parametrize("flags", [["--baseline-intrinsic-reward", "none"], ["--rounds", "3"],
                                   ["--baseline-prefetch-batches", "0"], ["--baseline-acting-splits", "1"],
                                   ["--baseline-envs", "32"]])
def test_train_throughput_refuses_baseline_settings_without_a_baseline(flags, capfd):
    code, err = script_exit(BENCH / "train_throughput.py", ["--seconds", "1", *flags], capfd)
    assert code == 2 and "give --baseline-code" in err and flags[0] in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_train_throughput_refuses_a_baseline_without_games(capfd):
    code, err = script_exit(BENCH / "train_throughput.py", ["--baseline-code", str(BENCH.parent), "--baseline-envs", "0"],
                            capfd)
    assert code == 2 and "--baseline-envs must be >= 1, got 0" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_drop_in_overhead_smoke():
    result, table = bench_json([BENCH / "drop_in_overhead.py", "--seconds", "1.5", "--rounds", "1"])
    assert "+ oni_transforms" in table
    assert set(result["fps"]) == {"GymEnv", "+ copy, hash, count", "+ oni_transforms"}
    assert all(v > 0 for v in result["fps"].values()) and 0 < result["ratio"] < 2


def test_trainer_ceiling_smoke():
    result, table = bench_json([BENCH / "trainer_ceiling.py", "--seconds", "2", "--games", "4", "--rollout", "16",
                                "--frames-per-update", "64", "128"])
    assert "stand-in collector" in table
    rows = result["results"]
    assert [r["frames_per_update"] for r in rows] == [64, 128]
    for r in rows:
        assert r["fps"] > 0 and r["updates"] >= 2 and r["intrinsic_reward"] == "retrieval"
        assert {"hooks", "gather", "forward", "backward"} <= set(r["stages"])


@pytest.mark.slow
def test_reward_overhead_smoke():
    result, table = bench_json([BENCH / "reward_overhead.py", "--seconds", "4", "--rounds", "1", "--warmup", "1",
                                "--envs-per-worker", "4", "--rm-time-fraction", "0.1",
                                "--kinds", "classification/inline,classification/background"])
    assert "classification/background" in table
    assert result["rm_time_fraction"] == 0.1
    for name in ("none", "classification_inline", "classification_background"):
        assert result[f"fps_{name}"] > 0
    assert 0 < result["ratio_classification_background"] < 10
    assert result["rm_steps_classification_inline"] >= 1 and "model steps" in table


def test_reward_overhead_refuses_an_unknown_type(capfd):
    code, err = script_exit(BENCH / "reward_overhead.py", ["--kinds", "classification/sideways"], capfd)
    assert code == 2 and "classification/sideways" in err and "Traceback" not in err


@pytest.mark.slow
def test_learner_throughput_compile_smoke():
    """--compile: a compiled row beside the eager one, its warm-up (the compilation) apart, and the
    ratio of the two."""
    result, table = bench_json([BENCH / "learner_throughput.py", "--seconds", "0.5", "--threads", "1",
                                "--frames-per-update", "256", "--minibatch-size", "256", "--no-baseline",
                                "--compile", "default"], timeout=600)
    assert "warm-up s" in table
    eager, compiled = result["results"]
    assert (eager["compile"], compiled["compile"]) == ("off", "default")
    assert compiled["fps"] > 0 and compiled["warmup_s"] > eager["warmup_s"]
    assert result["compile_ratios"]["light 256 default"] == pytest.approx(compiled["fps"] / eager["fps"], rel=1e-2)
