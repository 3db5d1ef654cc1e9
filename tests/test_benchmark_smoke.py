"""Seconds-long runs of the benchmarks that tests/test_throughput_benchmarks.py and
tests/test_sparse_tasks.py do not run, so that a refactor cannot leave them crashing: each must
exit 0 and end with its JSON line (strict JSON: no NaN) holding the fields BENCHMARKS.md quotes.

Each runs with the scripted annotator or a fake/scripted server: no network, no GPU. What needs
an optional package (Ray, the SmolLM2 weights) is skipped, saying why, where it is missing.
"""
import math
import os
import tempfile

import pytest
from helpers import BENCH, bench_json, script_exit


def _number(value, low=-math.inf, high=math.inf):
    return isinstance(value, (int, float)) and not isinstance(value, bool) and low <= value <= high


def _in_tmp(tmp_path):
    """Sends the run folders the scripts make with ``tempfile.mkdtemp`` into the test's tmp_path."""
    return {"TMPDIR": str(tmp_path)}


# ------------------------------------------------------------------------------------------- store
def test_store_smoke():
    result, table = bench_json([BENCH / "store.py", "--seconds", "10", "--n", "16384"])
    assert "CaptionStore benchmark" in table
    assert result["n"] == 16384 and result["extrapolated"] is False
    for key in ("mb_per_million", "index_mb_per_million", "dict_mb_per_million", "lookup_ms", "lookup_collector_ms",
                "dict_lookup_ms", "lookup_speedup_vs_dict", "add_ms", "add_collector_ms", "save_s", "load_s"):
        assert _number(result[key], low=0) and result[key] > 0, key
    assert 50 < result["mb_per_million"] < 2000  # bytes per caption row, not a scaling slip


def _store_of(path, captions, labels, seen):
    """A caption store at ``path``: each caption seen ``seen[i]`` times, labelled ``labels[i]`` (None: not)."""
    import numpy as np

    from torchrl_oni.annotators.base import Provenance
    from torchrl_oni.captions import encode_messages, hash_messages
    from torchrl_oni.store import CaptionStore

    store = CaptionStore()
    messages = encode_messages(captions)
    hashes = hash_messages(messages)
    store.add(np.repeat(messages, seen, axis=0), np.repeat(hashes, seen))
    done = [i for i, v in enumerate(labels) if v is not None]
    store.set_labels(hashes[done], [labels[i] for i in done], Provenance("scripted", "rules", "v1"))
    store.save(path)
    return path


def test_label_transfer_smoke_against_a_hand_count(tmp_path, capfd):
    """Three stores; each held out against the others, every figure counted by hand."""
    a = _store_of(tmp_path / "a.pt", ["kill", "wall", "gold"], [1.0, 0.0, None], [5, 3, 2])
    b = _store_of(tmp_path / "b.pt", ["kill", "wall", "door"], [1.0, 1.0, 0.0], [1, 1, 8])
    c = _store_of(tmp_path / "c.pt", ["gold", "newt"], [1.0, None], [4, 6])
    result, table = bench_json([BENCH / "label_transfer.py", a, b, c, "--write", tmp_path / "all.pt"])
    assert "Held out in turn" in table
    rows = {os.path.basename(r["store"]): r for r in result["rows"]}
    # a: kill (5) and wall (3) labelled by b, gold (2) by c: every step; its own labels cover 8 of 10
    assert rows["a.pt"]["steps_covered"] == 1.0 and rows["a.pt"]["own_steps_covered"] == 0.8
    assert rows["a.pt"]["agree"] == 0.5 and rows["a.pt"]["shared"] == 2  # b calls the wall progress
    # b: kill and wall from a (first store first), door nowhere: 2 of 10 steps, 2 of 3 captions
    assert rows["b.pt"]["steps_covered"] == 0.2 and rows["b.pt"]["captions_covered"] == pytest.approx(2 / 3)
    # c: gold is labelled by nobody else (a left it unlabelled), newt unknown
    assert rows["c.pt"]["steps_covered"] == 0.0 and rows["c.pt"]["agree"] is None
    assert result["written_labelled"] == 4  # kill and wall (a), door (b), gold (c); newt has no label
    from torchrl_oni.captions import encode_messages, hash_messages
    from torchrl_oni.store import CaptionStore

    union = CaptionStore.load(tmp_path / "all.pt")
    labels, found = union.lookup(hash_messages(encode_messages(["kill", "wall", "gold", "door", "newt"])))
    assert found.tolist() == [True, True, True, True, False]
    assert labels.tolist()[:4] == [1.0, 0.0, 1.0, 0.0]  # a's wall label wins over b's
    # the same merge as a labels file: the same labels, and it stands in for a store as an input
    from torchrl_oni.store.labels_file import load_labels

    result_gz, table_gz = bench_json([BENCH / "label_transfer.py", a, b, c, "--write", tmp_path / "all.jsonl.gz"])
    assert "labelled captions (2 approved), 0 KiB" in table_gz  # a few bytes, said in KiB
    assert result_gz["written_labelled"] == 4 and 0 < result_gz["written_bytes"] < os.path.getsize(tmp_path / "all.pt")
    again = load_labels(tmp_path / "all.jsonl.gz")
    counts = again.caption_rows(again.caption_slots(), fields=("caption_hash", "times_seen"))
    seen_by_hash = dict(zip(counts["caption_hash"].tolist(), counts["times_seen"].tolist()))
    kill, wall, gold, door = hash_messages(encode_messages(["kill", "wall", "gold", "door"])).tolist()
    # sightings summed over the runs: kill 5 + 1, wall 3 + 1, gold 2 + 4 (c labels it), door 8
    assert seen_by_hash == {kill: 6, wall: 4, gold: 6, door: 8}
    assert again.lookup(hash_messages(encode_messages(["kill", "wall", "gold", "door", "newt"])))[0].tolist()[:4] \
        == [1.0, 0.0, 1.0, 0.0]
    from torchrl_oni.store.labels_file import write_labels

    write_labels(CaptionStore.load(a), tmp_path / "a.jsonl.gz")
    result_mixed, _ = bench_json([BENCH / "label_transfer.py", tmp_path / "a.jsonl.gz", b, c])
    by_name = {os.path.basename(r["store"]): r for r in result_mixed["rows"]}
    for name in ("b.pt", "c.pt"):  # against a's labels file, as against a's store
        assert by_name[name]["steps_covered"] == rows[name]["steps_covered"]
        assert by_name[name]["captions_covered"] == rows[name]["captions_covered"]
    code, err = script_exit(BENCH / "label_transfer.py", [a], capfd)
    assert code == 2 and "two or more" in err and "Traceback" not in err
    code, err = script_exit(BENCH / "label_transfer.py", [a, tmp_path / "missing.pt"], capfd)
    assert code == 2 and "missing.pt" in err and len(err.strip().splitlines()) == 1


def test_store_budget_too_small_extrapolates():
    """A budget too short for 1M captions measures the smallest store and says so; ``add_ms``
    (adds while the store fills its last rows) is still a number."""
    result, table = bench_json([BENCH / "store.py", "--seconds", "0.05"])
    assert result["extrapolated"] is True and result["n"] < 1_000_000
    assert "extrapolated to 1M" in table
    assert _number(result["add_ms"]) and result["add_ms"] > 0
    assert result["save_s"] is None and result["load_s"] is None  # no budget left for them


# -------------------------------------------------------------------------------- env throughput
def test_env_throughput_smoke():
    result, table = bench_json([BENCH / "env_throughput.py", "--seconds", "1", "--envs", "2", "--rounds", "1"])
    assert "NLEBatchEnv(2)" in table and "NetHack's step skipped" in table
    assert result["envs"] == 2 and set(result["per_envs"]) == {"2"}
    for key in ("raw_fps", "batched_fps", "raw_same_keys_fps", "task_loop_fps", "gymenv_fps"):
        assert _number(result[key]) and result[key] > 0, key
    for key in ("ratio", "ceiling", "ratio_vs_k_game_loop"):
        assert _number(result[key]) and 0 < result[key] < 100, key
    row = result["per_envs"]["2"]
    assert row["ratio"] == result["ratio"] and row["packaging_us"] > 0
    assert "NLEBatchEnv(2), in place" in table, "the env workers' path is measured beside TorchRL's"
    assert row["in_place_fps"] > 0 and result["in_place_vs_k_game_loop"] == {"2": row["in_place_vs_k_game_loop"]}


def test_env_throughput_rejects_bad_flags(capfd):
    code, err = script_exit(BENCH / "env_throughput.py", ["--seconds", "0"], capfd)
    assert code == 2 and "must be positive" in err and "Traceback" not in err


# ------------------------------------------------------------------------------ label efficiency
def test_label_efficiency_smoke():
    result, table = bench_json([BENCH / "label_efficiency.py", "--envs", "4", "--env-steps", "300",
                                "--budgets", "20", "40", "--seeds", "0", "--members", "2", "--steps-per-round", "1",
                                "--batch-size", "8", "--initial", "10"])
    assert "held-out balanced accuracy" in table
    assert result["benchmark"] == "label_efficiency"
    # the random policy's pool is not seeded: budgets above it are dropped (it is ~50-100 captions)
    assert result["budgets"] == [b for b in (20, 40) if b <= result["pool"]] and result["budgets"]
    assert result["pool"] > 0 and result["test"] > 0
    assert 0 <= result["pool_positives"] <= result["pool"] and 0 <= result["test_positives"] <= result["test"]
    assert result["runs_done"] == 3 and result["complete"] is True
    assert result["seeds_done"] == {"uniform": 1, "disagree": 1, "entropy": 1}
    n = len(result["budgets"])
    for rule in ("uniform", "disagree", "entropy"):
        for name in ("balanced_accuracy_mean", "balanced_accuracy_std", "accuracy_mean"):
            values = result[f"{rule}_{name}"]
            assert len(values) == n and all(_number(v, 0, 1) for v in values), (rule, name, values)
        found = result[f"{rule}_positives_found_mean"]
        assert len(found) == n and all(_number(v, 0, result["pool_positives"]) for v in found)


# -------------------------------------------------------------------------------- learning check
_LEARNING_KEYS = ("approved_per_episode_trained", "approved_per_episode_random", "approved_per_1k_steps_trained",
                  "approved_per_1k_steps_random", "ratio")


def _check_learning(result, episodes_of):
    assert result["frames"] >= 1024 and _number(result["train_s"], low=0) and result["annotator"] == "scripted"
    for key in _LEARNING_KEYS:
        assert _number(result[key], low=0), key
    assert result["unlabelled_captions"] == 0  # the rules label every caption
    for policy in ("trained", "random"):
        assert result[f"episode_length_{policy}"] >= 1
        assert _number(result[f"deepest_level_{policy}"], low=1)
    assert "learning check: Score" in episodes_of


def test_learning_check_smoke(tmp_path):
    result, table = bench_json([BENCH / "learning_check.py", "--frames", "1024", "--annotator", "scripted",
                                "--workers", "1", "--envs-per-worker", "4", "--episodes", "2",
                                "--logdir", tmp_path / "run"])
    assert result["intrinsic_reward"] == "retrieval"
    _check_learning(result, table)
    assert (tmp_path / "run" / "metrics.csv").is_file() and (tmp_path / "run" / "captions.pt").is_file()


def test_learning_check_ellm_smoke(tmp_path):
    """ELLM with the scripted goal suggester (MiniLM if installed, else the hashed encoder)."""
    result, table = bench_json([BENCH / "learning_check.py", "--frames", "1024", "--annotator", "scripted",
                                "--intrinsic-reward", "ellm", "--workers", "1", "--envs-per-worker", "4",
                                "--episodes", "2", "--goal-seconds", "30", "--logdir", tmp_path / "run"])
    assert result["intrinsic_reward"] == "ellm"
    _check_learning(result, table)
    for policy in ("trained", "random"):
        assert _number(result[f"goals_per_episode_{policy}"], low=0)
        assert _number(result[f"goal_coverage_{policy}"], 0, 1)
    assert isinstance(result["states_without_goals"], int) and result["states_without_goals"] >= 0
    assert (tmp_path / "run" / "goals.pt").is_file()


# ----------------------------------------------------------------------------------- value heads
def test_value_heads_smoke(tmp_path):
    result, table = bench_json([BENCH / "value_heads.py", "--frames", "4096", "--seeds", "0",
                                "--workers", "1", "--envs", "4"], env=_in_tmp(tmp_path))
    assert "value heads" in table
    assert result["frames"] == 4096 and result["seeds"] == [0]
    for heads in (1, 2):
        assert _number(result[f"return_{heads}_heads"])
        assert _number(result[f"intrinsic_per_episode_{heads}_heads"], low=0)


# ------------------------------------------------------------------------------------- scale-out
@pytest.mark.slow  # ~22 s: a Ray instance starts
def test_scale_out_smoke(tmp_path):
    pytest.importorskip("ray")
    # Ray's session folder stays in the usual temp dir: its socket paths must stay short
    env = {**_in_tmp(tmp_path), "RAY_TMPDIR": os.environ.get("RAY_TMPDIR", tempfile.gettempdir())}
    result, table = bench_json([BENCH / "scale_out.py", "--seconds", "2", "--workers", "1", "--envs", "4",
                                "--rollout", "16"], env=env)
    assert "backend" in table and "ray" in table
    for key in ("local_fps", "ray_fps", "ray_over_local", "local_startup_s", "ray_startup_s"):
        assert _number(result[key]) and result[key] > 0, key
    for key in ("local_collect_fraction", "ray_collect_fraction"):
        assert _number(result[key], 0, 1), key
    assert (result["workers"], result["envs_per_worker"], result["rollout"]) == (1, 4, 16)


# ---------------------------------------------------------------------------------- annotation
def test_annotation_throughput_smoke_with_a_server_url(scripted):
    """``--llm-url`` (the path for vLLM or any server) against the scripted server, with the
    collector part (``ratio``: frames/s with the annotation transform on / off)."""
    result, table = bench_json([BENCH / "annotation_throughput.py", "--llm-url", scripted.url, "--seconds", "1",
                                "--batches", "1,8", "--collector-seconds", "3"])
    assert "collector, 2 workers x 32 games" in table
    assert result["model"] == scripted.model and result["server"] == scripted.url
    assert _number(result["accuracy"], 0, 1) and _number(result["auc"], 0, 1)
    for key in ("captions_per_s", "scripted_captions_per_s", "model_time_share"):
        assert set(result[key]) == {"1", "8"}, key
    assert all(v > 0 for v in result["captions_per_s"].values())
    assert all(v > 0 for v in result["scripted_captions_per_s"].values())
    assert all(_number(v, high=1) for v in result["model_time_share"].values())
    assert result["collector_fps_off"] > 0 and result["collector_fps_on"] > 0
    assert _number(result["ratio"]) and 0 < result["ratio"] < 10
    assert _number(result["collector_coverage"], 0, 1) and result["collector_labels"] >= 0


def test_annotation_throughput_smoke_embedded_model():
    """The embedded server with the packaged test model (SmolLM2), accuracy on the 40 messages."""
    from torchrl_oni.serve.models import TEST_MODEL, is_installed, resolve_model

    if not is_installed(TEST_MODEL):
        pytest.skip(f"model package missing: {resolve_model(TEST_MODEL).pip_install}")
    result, table = bench_json([BENCH / "annotation_throughput.py", "--model", TEST_MODEL, "--threads", "1",
                                "--seconds", "2", "--batches", "1,8", "--collector-seconds", "0"])
    assert "labelled messages" in table
    assert result["model"] == resolve_model(TEST_MODEL).name and result["threads"] == 1
    assert _number(result["load_s"], low=0) and _number(result["startup_s"], low=0)
    assert _number(result["accuracy"], 0, 1) and _number(result["auc"], 0, 1)
    assert set(result["captions_per_s"]) == {"1", "8"} and all(v > 0 for v in result["captions_per_s"].values())
    assert all(_number(v, high=1) for v in result["model_time_share"].values())
    assert "ratio" not in result  # --collector-seconds 0 skips the collector part


def test_annotation_throughput_refuses_a_missing_model(capfd):
    code, err = script_exit(BENCH / "annotation_throughput.py", ["--model", "no-such-model", "--seconds", "1",
                                                                "--batches", "1", "--collector-seconds", "0"], capfd)
    assert code == 2 and "error:" in err and "Traceback" not in err


def test_annotation_faults_smoke(tmp_path):
    """The outage and pool scenarios (what BENCHMARKS.md quotes) on captions of a 1-worker trainer."""
    result, table = bench_json([BENCH / "annotation_faults.py", "--scenarios", "outage,pool", "--seconds", "2",
                                "--workers", "1", "--envs", "4", "--rollout", "16", "--outage-s", "0.5",
                                "--sample-s", "0.25"], env=_in_tmp(tmp_path))
    assert "== outage" in table and "== pool: two fake servers, one killed" in table and "health:" in table
    assert result["recorded_frames"] > 0 and result["recorded_captions"] > 0
    assert result["outage_s"] == 0.5
    for key in ("outage_coverage_before", "outage_coverage_min", "outage_coverage_end",
                "pool_both_coverage_end", "pool_one_down_coverage_end"):
        assert _number(result[key], 0, 1), key
    for key in ("outage_given_up", "outage_unlabelled_seen_before_restart", "outage_requests_unsent",
                "pool_given_up"):
        assert isinstance(result[key], int) and result[key] >= 0, key
    assert result["outage_recovery_s"] is None or _number(result["outage_recovery_s"], low=0)
    assert result["pool_both_labels_per_s"] > 0 and _number(result["pool_one_down_labels_per_s"], low=0)
    assert _number(result["pool_one_down_ratio"], low=0)
    assert all(_number(c, 0, 1) for _, c in result["outage_series"])


def test_annotation_faults_rejects_an_unknown_scenario(capfd):
    code, err = script_exit(BENCH / "annotation_faults.py", ["--scenarios", "outage,flood"], capfd)
    assert code == 2 and "unknown scenario(s): flood" in err
