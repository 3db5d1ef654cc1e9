"""``oni-eval``: episodes counted, statistics checked against the recorded episodes, errors."""
import json
import math
import os
import re
from collections import Counter

import numpy as np
import pytest
import torch

from torchrl_oni.captions import encode_messages, hash_messages
from torchrl_oni._eval_play import _episode_row
from torchrl_oni.evaluate import EVAL_NAME, evaluate, main, plan_shards
from torchrl_oni.progression import progression
from torchrl_oni.replay import load_episode
from torchrl_oni.stats import mean_ci, t_quantile_975, wilson_interval
from torchrl_oni.train import TrainConfig, Trainer

STEPS = 40  # step limit of the test runs' episodes: short games, some deaths, mostly time-outs


def _run(folder, **kw):
    """A run folder with a freshly initialised checkpoint (evaluation needs no training)."""
    cfg = TrainConfig(frames=256, workers=1, envs_per_worker=2, rollout=32, logdir=str(folder),
                      max_episode_steps=STEPS, progress=False, tensorboard=False, **kw)
    Trainer.from_config(cfg).save()
    return str(folder)


@pytest.fixture(scope="module")
def light_run(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("light"))


def _recorded(result):
    return [load_episode(p) for p in result["replays"]]


def test_cli_prints_table_then_json_and_writes_eval_json(light_run, capsys):
    assert main([light_run, "--episodes", "5", "--workers", "1", "--envs-per-worker", "2", "--no-progress"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(out[-1])
    assert any(line.startswith("success rate") for line in out[:-1])
    assert any(line.startswith("return") for line in out[:-1])
    for key in ("success_rate", "return", "length", "max_dlvl", "xlvl", "gold", "score", "end_status",
                "death_causes", "messages", "task", "arch", "episodes"):
        assert key in summary, key
    assert summary["episodes"] == 5 and summary["success_rate"]["n"] == 5
    lo, hi = summary["success_rate"]["ci95"]
    assert 0.0 <= lo <= summary["success_rate"]["mean"] <= hi <= 1.0
    for key in ("return", "length", "score"):
        s = summary[key]
        assert s["n"] == 5 and s["ci95"][0] <= s["mean"] <= s["ci95"][1]
    saved = json.load(open(f"{light_run}/{EVAL_NAME}"))
    per_episode = saved.pop("per_episode")
    assert len(per_episode) == 5
    # BALROG's progression: per episode, and its mean with a t interval as the other statistics
    assert all(e["progression"] == progression(e["max_dlvl"], e["xlvl"]) for e in per_episode)
    assert summary["progression"] == mean_ci([e["progression"] for e in per_episode])
    assert any(line.startswith("progression %") for line in out[:-1])
    saved.pop("eval_json", None)
    assert saved == {k: v for k, v in summary.items() if k != "eval_json"}
    assert summary["messages"]["approved_share"] is None  # no caption store in this run
    assert summary["reward_hacking"] == {"paid_by": None, "reason": "the run paid no intrinsic reward (extrinsic only)"}
    assert "reward hacking: not checked: the run paid no intrinsic reward (extrinsic only)" in out


def test_exactly_n_episodes_and_statistics_match_the_recordings(light_run):
    result = evaluate(light_run, episodes=5, workers=1, envs_per_worker=2, record=5, write=False, progress=False)
    rows = result["per_episode"]
    assert [r["episode"] for r in rows] == [0, 1, 2, 3, 4]  # shards of 2, 2 and 1 games
    assert sum(result["end_status"].values()) == 5
    episodes = _recorded(result)
    sightings = Counter()
    scores_checked = 0
    for row, ep in zip(rows, episodes):
        assert ep.meta["episode"] == row["episode"]
        assert ep.num_frames == row["length"] + 1 <= STEPS + 1
        assert (ep.action[:-1] >= 0).all() and ep.action[-1] == -1
        assert math.isclose(float(ep.reward.sum(dtype=np.float64)), row["return"], abs_tol=1e-3)
        # the bottom line of the last in-game screen shows the score eval reports, "S:<score>",
        # unless a long line of attributes pushes it past the 80th column
        shown = [re.search(r" S:(\d+)\s*$", ep.screen_lines(f)[22]) for f in range(ep.num_frames)]
        shown = [s for s in shown if s]
        if shown:
            scores_checked += 1
            assert int(shown[-1].group(1)) == row["score"]
        sightings.update(m for m in ep.messages() if m)
    assert scores_checked >= 3
    assert result["messages"]["sightings"] == sum(sightings.values())
    assert result["messages"]["distinct"] == len(sightings)
    assert [(t["message"], t["count"]) for t in result["messages"]["top"][:3]] == sightings.most_common(3)
    returns = [r["return"] for r in rows]
    assert math.isclose(result["return"]["mean"], float(np.mean(returns)), rel_tol=1e-9)
    # a later evaluation recording fewer episodes leaves none of this one's behind
    again = evaluate(light_run, episodes=2, workers=1, record=1, write=False, progress=False)
    assert sorted(os.listdir(os.path.dirname(again["replays"][0]))) == ["episode_000.npz"]


def test_same_seed_same_games_other_seed_other_games(light_run):
    a = evaluate(light_run, episodes=3, workers=1, seed=1, write=False, progress=False)
    b = evaluate(light_run, episodes=3, workers=1, seed=1, write=False, progress=False)
    c = evaluate(light_run, episodes=3, workers=1, seed=2, write=False, progress=False)
    assert a["per_episode"] == b["per_episode"]
    assert a["per_episode"] != c["per_episode"]
    greedy = evaluate(light_run, episodes=3, workers=1, seed=1, greedy=True, write=False, progress=False)
    assert greedy["policy"] == "greedy" and greedy["per_episode"] != a["per_episode"]


def test_caption_store_gives_labels_shares_and_retrieval_rewards(tmp_path):
    from torchrl_oni.annotators.base import Provenance
    from torchrl_oni.store import CaptionStore

    run = _run(tmp_path / "retrieval", intrinsic_reward="retrieval", annotator="scripted")
    first = evaluate(run, episodes=4, workers=1, record=4, write=False, progress=False)
    seen = Counter(m for ep in _recorded(first) for m in ep.messages() if m)
    texts = [m for m, _ in seen.most_common()]
    approved = set(texts[::2])  # every other message, the most frequent included
    store = CaptionStore()
    msgs = encode_messages(texts)
    store.add(msgs, hash_messages(msgs))
    hashes, claimed = store.claim(len(texts))
    store.set_labels(hashes, [1.0 if t in approved else 0.0 for t in claimed], Provenance("scripted"))
    store.save(f"{run}/captions.pt")

    result = evaluate(run, episodes=4, workers=1, record=4, progress=False)
    m = result["messages"]
    assert result["caption_store"].endswith("captions.pt")
    assert m["labelled_share"] == 1.0
    assert math.isclose(m["approved_share"], sum(seen[t] for t in approved) / sum(seen.values()))
    episodes = _recorded(result)
    per_episode = [len(approved & {t for t in ep.messages() if t}) for ep in episodes]
    assert math.isclose(m["approved_per_episode"]["mean"], float(np.mean(per_episode)))
    assert m["top"][0]["label"] == 1.0
    for ep in episodes:  # retrieval pays label · count^-3, per message sighting
        texts_ep = ep.messages()
        for t in range(ep.num_frames):
            if texts_ep[t]:
                label = 1.0 if texts_ep[t] in approved else 0.0
                assert ep.label[t] == label
                assert math.isclose(ep.intrinsic_reward[t], label * ep.msg_count[t] ** -3.0, rel_tol=1e-6)
            else:
                assert math.isnan(ep.label[t])
    assert json.load(open(f"{run}/{EVAL_NAME}"))["messages"]["approved_share"] == m["approved_share"]

    # the reward-hacking diagnostics pay what the replays show: the acted-on frames, the last one excepted
    hacking = result["reward_hacking"]
    assert hacking["paid_by"].startswith("the run's labels x msg_count^-3") and hacking["window"] == 20
    assert hacking["episodes"] == 4 and hacking["deaths"] == result["end_status"]["death"]
    paid = sum(float(ep.intrinsic_reward[:-1].sum(dtype=np.float64)) for ep in episodes)
    assert math.isclose(hacking["intrinsic_return"], paid, rel_tol=1e-5)
    assert hacking["paid_captions"] == len(approved & {t for ep in episodes for t in ep.messages()[:-1] if t})
    assert hacking["steps"] == sum(r["length"] for r in result["per_episode"])
    top = hacking["top"][0]
    shares = [r["return_share"] for r in hacking["top"]]
    assert top["message"] in approved and shares == sorted(shares, reverse=True)
    assert len(shares) == min(10, hacking["paid_captions"]) and sum(shares) <= 1.0 + 1e-9
    assert json.load(open(f"{run}/{EVAL_NAME}"))["reward_hacking"] == hacking
    from torchrl_oni.evaluate import format_table

    table = format_table(result)
    assert "reward hacking: " in table and "paid = the run's labels" in table and top["message"] in table


def test_the_table_ends_the_diagnostics_with_the_flagged_captions(light_run):
    from test_reward_hacking import EAT, TEXTS, _choking  # tests/ is on sys.path (conftest.py)
    from torchrl_oni.evaluate import format_table

    result = evaluate(light_run, episodes=2, workers=1, write=False, progress=False)
    result["reward_hacking"] = dict(_choking().report(TEXTS), paid_by="the run's labels x msg_count^-3")
    result["caption_store"] = "runs/x/captions.pt"
    lines = format_table(result).splitlines()
    flagged = [line for line in lines if line.startswith("!! ")]
    assert len(flagged) == 2 and TEXTS[EAT] in flagged[0]
    assert flagged[1] == "!! relabel them first: oni-label --store runs/x/captions.pt"
    assert lines.index(flagged[0]) > [i for i, line in enumerate(lines) if line.startswith("reward hacking: ")][0]


def test_death_causes_are_checked_against_a_baseline_evaluation(light_run, tmp_path):
    from test_reward_hacking import EAT, TEXTS, _baseline, _eaters
    from torchrl_oni.evaluate import format_table
    from torchrl_oni.reward_hacking import death_causes_check, read_flagged

    first = evaluate(light_run, episodes=2, workers=1, write=False, progress=False)
    check = first["death_causes_check"]
    assert check["baseline"] is None and check["episodes"] == 2
    assert check["deaths"] == first["end_status"]["death"] and check["flagged"] == []
    assert "how the agents die: " in format_table(first)
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / EVAL_NAME).write_text(json.dumps(dict(first, intrinsic_reward="none")))
    result = evaluate(light_run, episodes=2, workers=1, baseline=str(tmp_path / "base"),
                      output=str(tmp_path / "eval.json"), progress=False)
    assert result["death_causes_check"]["baseline"]["source"] == str(tmp_path / "base" / EVAL_NAME)
    assert json.load(open(tmp_path / "eval.json"))["death_causes_check"] == result["death_causes_check"]
    # the table prints a flagged cause with its !! line, after the caption diagnostics
    causes, paid = _eaters()
    result["death_causes_check"] = death_causes_check(causes, paid=paid, texts=TEXTS, intrinsic_reward="retrieval",
                                                      baseline=_baseline({"died": 50, "choking": 2}))
    lines = format_table(result).splitlines()
    assert any(line.startswith("!! choking ends 43 of 64 episodes against 2 of 64") for line in lines)
    assert lines.index("how the agents die: 61 deaths in 64 episodes; baseline none-s0/eval.json (52 deaths in 64 "
                       "episodes, intrinsic reward none):") > 0
    (tmp_path / "flagged.json").write_text(json.dumps({k: v for k, v in result.items() if k != "reward_hacking"}))
    assert [h for h, _ in read_flagged(tmp_path / "flagged.json")] == [EAT]


@pytest.mark.parametrize("arch", ["oni", "oni-lstm"])
def test_recurrent_policies_evaluate(tmp_path, arch):
    run = _run(tmp_path / arch, arch=arch)
    a = evaluate(run, episodes=2, workers=1, write=False, progress=False, record=1)
    b = evaluate(run, episodes=2, workers=1, write=False, progress=False)
    assert a["arch"] == arch and len(a["per_episode"]) == 2
    assert a["per_episode"] == b["per_episode"]  # recording changes nothing about the games
    assert all(r["length"] >= 1 for r in a["per_episode"])


def test_another_task_with_the_same_actions_is_played(light_run):
    result = evaluate(light_run, episodes=2, workers=1, task="oracle", write=False, progress=False)
    assert result["task"] == "NetHackOracleExtendedActions-v1"
    assert result["trained_task"] == "NetHackScoreExtendedActions-v1"


def _error(capsys, argv):
    assert main(argv + ["--no-progress"]) == 2, argv
    captured = capsys.readouterr()
    assert captured.err.startswith("oni-eval: error: ") and captured.err.count("\n") == 1, captured.err
    assert captured.out == ""
    return captured.err


def test_errors_are_one_line_with_exit_status_2(light_run, tmp_path, capsys):
    assert "no run folder or checkpoint" in _error(capsys, [str(tmp_path / "missing")])
    assert "holds no checkpoint.pt" in _error(capsys, [str(tmp_path)])
    data = open(f"{light_run}/checkpoint.pt", "rb").read()
    (tmp_path / "truncated.pt").write_bytes(data[: len(data) // 2])
    assert "not a readable checkpoint" in _error(capsys, [str(tmp_path / "truncated.pt")])
    torch.save({"frames": 3}, tmp_path / "other.pt")
    assert "no actor" in _error(capsys, [str(tmp_path / "other.pt")])
    assert "23 actions" in _error(capsys, [light_run, "--task", "NetHackScore-v1"])
    assert "unknown task" in _error(capsys, [light_run, "--task", "chess"])
    assert "--episodes" in _error(capsys, [light_run, "--episodes", "0"])
    assert "--record" in _error(capsys, [light_run, "--episodes", "2", "--record", "3"])
    assert "--death-window" in _error(capsys, [light_run, "--death-window", "0"])
    _error(capsys, [light_run, "--bogus"])
    _error(capsys, [light_run, "--greedy", "--sample"])
    assert "CaptionStore" in _error(capsys, [light_run, "--caption-store", str(tmp_path / "truncated.pt")])
    assert "--baseline: " in _error(capsys, [light_run, "--baseline", str(tmp_path / "missing")])
    assert "holds no eval.json" in _error(capsys, [light_run, "--baseline", str(tmp_path)])
    (tmp_path / "damaged.json").write_text('{"episodes": 2, "task": ')
    assert "not a JSON file" in _error(capsys, [light_run, "--baseline", str(tmp_path / "damaged.json")])
    other = {"episodes": 2, "task": "NetHackOracleExtendedActions-v1", "death_causes": {"died": 1}}
    (tmp_path / "other.json").write_text(json.dumps(other))
    assert "not NetHackScoreExtendedActions-v1" in _error(capsys, [light_run, "--baseline", str(tmp_path / "other.json")])
    assert "-o " in _error(capsys, [light_run, "--baseline", str(tmp_path / "other.json"), "-o",
                                   str(tmp_path / "other.json")])


@pytest.mark.slow
def test_worker_processes_play_the_same_games(light_run):
    one = evaluate(light_run, episodes=4, workers=1, envs_per_worker=2, write=False, progress=False)
    two = evaluate(light_run, episodes=4, workers=2, envs_per_worker=2, write=False, progress=False)
    assert two["workers"] == 2
    assert one["per_episode"] == two["per_episode"]


def test_an_episodes_progression_counts_its_deepest_and_highest_levels():
    from tensordict import TensorDict

    # a time-out on dungeon level 3 at experience level 5, after reaching level 4 and, before a
    # level drain, experience level 7: BALROG's table gives 2.1 % for dungeon level 4, 5.1 % for
    # experience level 7 (and 2.9 % for experience level 5)
    episode = TensorDict({"return": torch.tensor(0.0), "length": torch.tensor(100), "dlvl": torch.tensor(3),
                          "xlvl": torch.tensor(5), "gold": torch.tensor(0), "scout": torch.tensor(10),
                          "kills": torch.tensor(0), "end_status": torch.tensor(-1),
                          "success": torch.tensor(False)}, [])
    row = _episode_row(0, episode, None, 0, 4, set(), [], (), 7)
    assert (row["max_dlvl"], row["xlvl"], row["end"]) == (4, 5, "timeout")
    assert row["progression"] == 0.0507583712345433
    row = _episode_row(0, episode, None, 0, 4, set(), [], (), 0)  # no drain seen: the last level counts
    assert row["progression"] == 0.029108986017138745


def test_plan_and_intervals_against_references():
    shards = plan_shards(70, 32, seed=3, record=40)
    assert [s.games for s in shards] == [32, 32, 6]
    assert [s.first_episode for s in shards] == [0, 32, 64]
    assert [len(s.record) for s in shards] == [32, 8, 0]
    assert len({s.seed for s in shards}) == 3
    assert [s.seed for s in plan_shards(64, 32, seed=3)] == [s.seed for s in shards[:2]]
    # Wilson: the textbook formula, written out independently
    for k, n in ((0, 10), (3, 10), (10, 10), (17, 32)):
        z, p = 1.959964, k / n
        centre = (p + z * z / (2 * n)) / (1 + z * z / n)
        half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
        assert np.allclose(wilson_interval(k, n), (max(0, centre - half), min(1, centre + half)))
    scipy_stats = pytest.importorskip("scipy.stats")
    for df in (1, 2, 5, 29, 30, 31, 50, 200, 5000):
        assert abs(t_quantile_975(df) - scipy_stats.t.ppf(0.975, df)) < 1e-3, df
    x = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0]
    lo, hi = scipy_stats.t.interval(0.95, len(x) - 1, loc=np.mean(x), scale=scipy_stats.sem(x))
    assert np.allclose(mean_ci(x)["ci95"], [lo, hi], atol=1e-3)
