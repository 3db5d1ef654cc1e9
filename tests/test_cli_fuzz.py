"""A fuzz test of every ``oni-*`` console script: a bad input is one ``prog: error: ...`` line.

The rule of the project: a user's mistake (a missing, unreadable or damaged file, a number out of
range, hostile YAML, a value of the wrong type, an output that would overwrite an input) ends
with exactly ONE line ``prog: error: ...`` on stderr and exit status 2: never a traceback, never
exit status 1, never a line so long that it floods the terminal (:data:`MAX_LINE`).

The cases come from tables (one pytest case each); every command is called in-process through
its ``main(argv)``. Valid inputs would start real work (training, a server, playing episodes), so
only invalid ones are fed, and that work is replaced by :class:`_WouldStart` guards: a case whose
input is wrongly accepted fails fast instead of running. :data:`CASES_PER_COMMAND` counts the
inputs tried per command (``python tests/test_cli_fuzz.py`` prints the figures).
"""
from __future__ import annotations

import csv
import io
import json
import os
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import numpy as np
import pytest

MAX_LINE = 500
"""Longest error line accepted (characters, ``prog: error:`` included)."""

BOMB = ("a: &a [\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\"]\n"
        + "".join(f"{c}: &{c} [*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p}]\n"
                  for p, c in zip("abcdefgh", "bcdefghi")))
"""The billion-laughs pattern (9 levels of 9 aliases: 9^9 = 387 million "lol"s, ~370 bytes)."""

BOMB_IN_SETTINGS = ("frames: &a [lol,lol,lol,lol,lol,lol,lol,lol,lol]\n"
                    + "".join(f"{key}: &{c} [*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p}]\n"
                              for p, c, key in zip("abcdefgh", "bcdefghi", ("seed", "lr", "rollout", "workers",
                                                                           "gamma", "epochs", "minibatch_size",
                                                                           "max_episode_steps"))))
"""The same under setting names, so that no 'unknown setting' stops it before the values are checked."""

HOSTILE_YAML = {
    "alias bomb in settings": BOMB_IN_SETTINGS,
    "python-object tag": "env: !!python/object/apply:os.system ['echo pwned']\n",
    "python-name tag": "env:\n  task: !!python/name:os.system\n",
    "alias bomb": BOMB,
    "alias bomb under a setting": BOMB + "env:\n  task: *i\n",
    "mapping where a string belongs": "env:\n  task: {a: 1}\n",
    "list where a string belongs": "env:\n  task: [score, oracle]\n",
    "mapping where a number belongs": "frames: {a: 1}\n",
    "string where a section belongs": "env: score\n",
    "list at the top": "- 1\n- 2\n",
    "a number at the top": "42\n",
    "nan frames": "frames: .nan\n",
    "inf lr": "ppo:\n  lr: .inf\n",
    "negative frames": "frames: -5\n",
    "huge frames": "frames: 1e400\n",
    "bool where a string belongs": "env:\n  task: true\n",
    "mapping where a url list belongs": "annotation:\n  llm_url: {a: 1}\n",
    "binary garbage": "\x00\x01\x02\xff",
    "unclosed flow": "env: {task: [score\n",
    "tab indentation": "env:\n\ttask: score\n",
    "duplicate anchors and a long key": "k" * 100_000 + ": 1\n",
    "a long string value": "env:\n  task: " + "x" * 100_000 + "\n",
    "ellm settings without ellm": "reward:\n  intrinsic_reward: retrieval\n  ellm:\n    goals_per_state: 3\n",
    "huge lr": "ppo:\n  lr: 1.0e+11\n",
    "huge seed": "seed: 1.0e+30\n",
}
HOSTILE_YAML_NAMES = {"ellm settings without ellm": "--ellm-goals-per-state", "huge lr": "--lr", "huge seed": "--seed"}
"""The flag a hostile file's error line must name, where one is to blame."""


OK_OR_ERROR = "ok or one error line"
"""The ``expect`` of a case whose input is odd but usable: exit 0 is fine too (never a traceback)."""


class _WouldStart(Exception):
    """Raised by the guards in place of real work: a bad input was accepted."""


def _guard(*_a, **_k):
    raise _WouldStart("this input was accepted and real work would start")


# ---------------------------------------------------------------------------------- samples
def _episode_file(path, frames=6, meta_update=None):
    from torchrl_oni.replay import Episode, save_episode

    ep = Episode.blank(frames, meta={"task": "score", "episode": 0, "action_names": ["a", "b"],
                                     "stats": {"end": "timeout", "return": 0.0}})
    ep.meta.update(meta_update or {})
    return save_episode(path, ep)


def _build_samples(root: Path) -> dict:
    """One valid file of every format the project writes, under ``root``."""
    import torch

    from torchrl_oni.captions import encode_messages, hash_messages
    from torchrl_oni.feedback.screens import ScreenSnapshots
    from torchrl_oni.rewards.ellm import GoalTable
    from torchrl_oni.rewards.motif import _fingerprint, train_reward_model
    from torchrl_oni.store import CaptionStore
    from torchrl_oni.train.checkpoint import save_checkpoint
    from torchrl_oni.train.config import TrainConfig

    torch.set_num_threads(1)
    root.mkdir(parents=True, exist_ok=True)
    texts = ["You kill the newt!", "It's a wall.", "You find a hidden door.", "Never mind.",
             "You see here 3 gold pieces.", "The door opens."]
    msgs = encode_messages(texts)
    out = {}
    store = CaptionStore(capacity=16)
    store.add(msgs, hash_messages(msgs))
    out["captions.pt"] = store.save(root / "captions.pt")
    snaps = ScreenSnapshots(capacity=4)
    screen = np.full((2, 24, 80), ord(" "), np.uint8)
    snaps.offer(hash_messages(msgs)[:2], screen, np.full((2, 24, 80), 7, np.uint8))
    out["screens.pt"] = snaps.save(root / "captions.screens.pt")
    goals = GoalTable(max_goals=2)
    out["goals.pt"] = goals.save(root / "goals.pt")
    out["checkpoint.pt"] = Path(save_checkpoint({"actor": {"w": torch.ones(4, 4)}, "frames": 64},
                                                str(root / "checkpoint.pt")) or root / "checkpoint.pt")
    with open(root / "metrics.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["frames", "time_s", "episode/return"])
        for i in range(1, 6):
            w.writerow([i * 512, i * 0.5, i / 10])
    out["metrics.csv"] = root / "metrics.csv"
    (root / "eval.json").write_text(json.dumps({"episodes": 2, "success_rate": {"mean": 0.5}}))
    out["eval.json"] = root / "eval.json"
    out["episode.npz"] = _episode_file(root / "episode.npz")
    first, second = msgs[:3], msgs[3:]
    np.savez(root / "pairs.npz", first=first, second=second)
    out["pairs.npz"] = root / "pairs.npz"
    np.savez(root / "annotations.npz", preference=np.ones(3, np.float32), status=np.full(3, 2, np.int8),
             fingerprint=np.array(_fingerprint(first, second)))
    out["annotations.npz"] = root / "annotations.npz"
    train_reward_model(first, second, np.ones(3), root / "reward.pt", epochs=1, batch_size=4)
    out["reward.pt"] = root / "reward.pt"
    out["config.yaml"] = root / "config.yaml"
    out["config.yaml"].write_text(TrainConfig().to_yaml())
    (root / "messages.txt").write_text("\n".join(texts))
    out["messages.txt"] = root / "messages.txt"
    for name, data in {"numbers.json": [1, 2], "flagged-nohash.json": {"flagged": [{"message": "x"}]},
                       "flagged-bighash.json": {"flagged": [{"hash": str(2 ** 70), "deaths_preceded": 1}],
                                                "deaths": 1, "window": 20},
                       # evaluations to compare with (--baseline): another task, the fuzz run's task
                       "eval-oracle.json": {"episodes": 2, "task": "NetHackOracleExtendedActions-v1",
                                            "death_causes": {"died": 1}},
                       "eval-score.json": {"episodes": 2, "task": "NetHackScoreExtendedActions-v1",
                                           "death_causes": {"died": 1}}}.items():
        (root / name).write_text(json.dumps(data))
        out[name] = root / name
    return out


DAMAGES = {
    "truncated": lambda data: data[: len(data) // 2],
    "cut by a few bytes": lambda data: data[:-7] if len(data) > 7 else b"",
    "garbage": lambda data: np.random.default_rng(0).bytes(max(len(data), 64)),
    "empty": lambda data: b"",
    "text": lambda data: b"frames,time_s\n1,2\n",
}

FORMATS = ["captions.pt", "screens.pt", "goals.pt", "checkpoint.pt", "metrics.csv", "eval.json", "episode.npz",
           "pairs.npz", "annotations.npz", "reward.pt", "config.yaml"]


# ------------------------------------------------------------------------------------ commands
def _mains():
    from torchrl_oni import evaluate, plot, replay
    from torchrl_oni.feedback import cli as label_cli
    from torchrl_oni.serve import cli as serve_cli
    from torchrl_oni.train import cli as train_cli
    from torchrl_oni.train import motif_cli

    return {
        "oni-train": train_cli.main, "oni-serve": serve_cli.main, "oni-plot": plot.main, "oni-eval": evaluate.main,
        "oni-replay": replay.main, "oni-label": label_cli.main, "oni-collect-pairs": motif_cli.collect_pairs_main,
        "oni-annotate-pairs": motif_cli.annotate_pairs_main, "oni-train-reward": motif_cli.train_reward_main,
    }


# A case: (command, argv template, expected substring or None). Templates name files as {key}
# (a valid sample: {captions.pt}, a damaged one: {bad}, the work folder: {tmp}, a run folder: {run}).
ANN = "scripted"
LEGACY_ANN = "torchrl_oni.annotators.scripted:ScriptedAnnotator"
"""``oni-annotate-pairs --annotator``: a registered name, and the former package.module:Factory form."""


def _damaged_file_cases():
    """Every damaged format fed where each command reads that format (or a foreign one)."""
    reads = {
        "oni-label": [["--store", "{bad}", "--port", "0"],
                      ["--store", "{captions.pt}", "--screens", "{bad}", "--port", "0"],
                      ["--store", "{captions.pt}", "--first", "{bad}", "--port", "0"]],
        "oni-eval": [["{bad}", "--no-progress"],
                     ["{run}", "--caption-store", "{bad}", "--no-progress", "--episodes", "1"],
                     ["{run}", "--baseline", "{bad}", "--no-progress", "--episodes", "1"]],
        "oni-replay": [["{bad}", "-o", "{tmp}/out.html"]],
        "oni-plot": [["{badrun}", "-o", "{tmp}/out.png"]],
        "oni-train": [["--config", "{bad}"],
                      ["--intrinsic-reward", "ellm", "--annotator", "scripted", "--ellm-encoder", "hashed",
                       "--ellm-goal-table", "{bad}", "--logdir", "{tmp}/run"]],
        "oni-collect-pairs": [["{bad}", "--out", "{tmp}/p.npz", "--num-pairs", "2"],
                              (["{bad}", "--out", "{tmp}/p.npz", "--num-pairs", "2"], ".pt"),
                              ["{badstorerun}", "--out", "{tmp}/p.npz", "--num-pairs", "2"]],
        "oni-annotate-pairs": [["{bad}", "--out", "{tmp}/a.npz", "--annotator", ANN],
                               ["{bad}", "--out", "{tmp}/a.npz", "--annotator", LEGACY_ANN],
                               ["{pairs.npz}", "--out", "{bad}", "--annotator", ANN]],
        "oni-train-reward": [["{bad}", "{annotations.npz}", "--out", "{tmp}/r.pt"],
                             ["{pairs.npz}", "{bad}", "--out", "{tmp}/r.pt"]],
    }
    suffix = {"oni-collect-pairs": ".npz", "oni-annotate-pairs": ".npz", "oni-train-reward": ".npz"}
    cases = []
    for prog, templates in reads.items():
        for template in templates:
            template, own_suffix = template if isinstance(template, tuple) else (template, suffix.get(prog))
            for fmt in FORMATS:
                for damage in DAMAGES:
                    # a metrics.csv cut short still holds its first rows: plotting them is fine
                    cut_csv = prog == "oni-plot" and fmt == "metrics.csv" and damage in ("truncated",
                                                                                         "cut by a few bytes")
                    # an empty file is a valid (default) configuration
                    empty_config = prog == "oni-train" and damage == "empty" and fmt != "config.yaml"
                    cases.append((prog, template, OK_OR_ERROR if cut_csv or empty_config else None,
                                  {"format": fmt, "damage": damage, "suffix": own_suffix}))
    # the screens kept beside a caption store, read by oni-train --human-feedback (oni-label's
    # --screens above): {bad:store} is the store whose <store>.screens.pt is the damaged file
    for fmt in FORMATS:
        for damage in DAMAGES:
            cases.append(("oni-train", ["--intrinsic-reward", "retrieval", "--annotator", "scripted", "--human-feedback",
                                        "--caption-store", "{bad:store}", "--logdir", "{tmp}/run"], None,
                          {"format": fmt, "damage": damage, "suffix": ".screens.pt"}))
    return cases


def _path_cases():
    bad_paths = ["{tmp}/missing.pt", "{tmp}", "{metrics.csv}/inside.pt"]
    if os.geteuid() != 0:  # root reads a file of mode 000 anyway
        bad_paths.append("{unreadable}")
    out = []
    for path in bad_paths:
        out += [
            ("oni-label", ["--store", path, "--port", "0"], None, None),
            ("oni-label", ["--store", "{captions.pt}", "--screens", path, "--port", "0"], None, None),
            ("oni-label", ["--store", "{captions.pt}", "--first", path, "--port", "0"], "--first", None),
            ("oni-eval", [path, "--no-progress"], None, None),
            ("oni-eval", ["{run}", "--caption-store", path, "--no-progress"], None, None),
            ("oni-eval", ["{run}", "--baseline", path, "--no-progress"], "--baseline", None),
            ("oni-replay", [path], None, None),
            ("oni-plot", [path, "-o", "{tmp}/o.png"], None, None),
            ("oni-train", ["--config", path], None, None),
            ("oni-train", ["--resume", path if path != "{tmp}" else "{tmp}/missing2.pt"], None, None),
            ("oni-collect-pairs", [path, "--out", "{tmp}/p.npz", "--num-pairs", "2"], None, None),
            ("oni-annotate-pairs", [path, "--out", "{tmp}/a.npz", "--annotator", ANN], None, None),
            ("oni-train-reward", [path, "{annotations.npz}", "--out", "{tmp}/r.pt"], None, None),
            ("oni-train-reward", ["{pairs.npz}", path, "--out", "{tmp}/r.pt"], None, None),
        ]
    # outputs that cannot be written: a folder, a file where a folder belongs
    out += [
        ("oni-replay", ["{episode.npz}", "-o", "{tmp}"], None, None),
        ("oni-replay", ["{episode.npz}", "-o", "{metrics.csv}/x.html"], None, None),
        ("oni-replay", ["{episode.npz}", "--gif", "{tmp}"], None, None),
        ("oni-plot", ["{run}", "-o", "{tmp}"], None, None),
        ("oni-plot", ["{run}", "-o", "{metrics.csv}/x.png"], None, None),
        ("oni-collect-pairs", ["{messages.txt}", "--out", "{tmp}", "--num-pairs", "2"], None, None),
        ("oni-collect-pairs", ["{messages.txt}", "--out", "{metrics.csv}/p.npz", "--num-pairs", "2"], None, None),
        ("oni-train-reward", ["{pairs.npz}", "{annotations.npz}", "--out", "{tmp}"], None, None),
    ]
    # a goal table that is not there is a new one (fine), a folder is not a table
    out.append(("oni-train", ["--intrinsic-reward", "ellm", "--annotator", "scripted", "--ellm-encoder", "hashed",
                              "--ellm-goal-table", "{tmp}", "--logdir", "{tmp}/run"], "goal table", None))
    return out


def _overwrite_cases():
    """Outputs that would overwrite one of the command's inputs."""
    return [
        ("oni-eval", ["{run}", "-o", "{run}/checkpoint.pt", "--no-progress"], "-o", None),
        ("oni-eval", ["{run}", "-o", "{run}/captions.pt", "--no-progress"], "-o", None),
        ("oni-eval", ["{run}", "--baseline", "{eval-score.json}", "-o", "{eval-score.json}", "--no-progress"], "-o",
         None),
        ("oni-plot", ["{run}", "-o", "{run}/metrics.csv"], "-o", None),
        ("oni-replay", ["{episode.npz}", "-o", "{episode.npz}"], "-o", None),
        ("oni-replay", ["{episode.npz}", "--gif", "{episode.npz}"], "--gif", None),
        ("oni-replay", ["{episode.npz}", "-o", "{tmp}/same.out", "--gif", "{tmp}/same.out"], "--gif", None),
        ("oni-collect-pairs", ["{messages.txt}", "--out", "{messages.txt}", "--num-pairs", "2"], "--out", None),
        ("oni-annotate-pairs", ["{pairs.npz}", "--out", "{pairs.npz}", "--annotator", ANN], "--out", None),
        ("oni-train-reward", ["{pairs.npz}", "{annotations.npz}", "--out", "{pairs.npz}"], "--out", None),
        ("oni-train-reward", ["{pairs.npz}", "{annotations.npz}", "--out", "{annotations.npz}"], "--out", None),
    ]


NUMBERS = ["-1", "0", "-1e9", "1e400", "inf", "-inf", "nan", "100000000000", "abc", ""]


def _number_cases():
    """Flags given out-of-range numbers; the flag must be named in the message where it says."""
    flags = {
        "oni-eval": (["{run}", "--no-progress"], ["--episodes", "--seed", "--workers", "--envs-per-worker",
                                                 "--max-episode-steps", "--record", "--death-window"]),
        "oni-replay": (["{episode.npz}", "-o", "{tmp}/n.html"], ["--fps", "--font-size", "--max-mb"]),
        "oni-replay-gif": (["{episode.npz}", "--gif", "{tmp}/n.gif"], ["--fps", "--font-size", "--start",
                                                                        "--stop"]),
        "oni-plot": (["{run}", "-o", "{tmp}/n.png"], ["--smooth"]),
        "oni-label": (["--store", "{captions.pt}"], ["--port", "--save-every"]),
        "oni-serve": ([], ["--port", "--threads", "--max-tokens-cap", "--max-queue", "--read-timeout",
                           "--max-body-mb", "--startup-timeout", "--node-cache-mb"]),
        "oni-collect-pairs": (["{messages.txt}", "--out", "{tmp}/p.npz", "--num-pairs", "2"],
                              ["--num-pairs", "--seed"]),
        "oni-annotate-pairs": (["{pairs.npz}", "--out", "{tmp}/a.npz", "--annotator", ANN],
                               ["--chunk-size", "--max-chunks", "--seed", "--llm-batch-size", "--llm-concurrency"]),
        "oni-train-reward": (["{pairs.npz}", "{annotations.npz}", "--out", "{tmp}/r.pt"],
                             ["--epochs", "--batch-size", "--lr", "--val-fraction", "--seed"]),
        "oni-train": ([], ["--frames", "--workers", "--envs-per-worker", "--rollout", "--lr", "--seed",
                           "--minibatch-size", "--max-episode-steps", "--checkpoint-every", "--rm-lr",
                           "--llm-batch-size", "--feedback-port", "--embedded-node-cache-mb"]),
    }
    # values that are valid for some flags (the command would run): left out per flag
    valid = {
        ("oni-eval", "--seed"): {"0", "100000000000"}, ("oni-eval", "--record"): {"0"},
        ("oni-replay-gif", "--start"): {"0"}, ("oni-replay-gif", "--stop"): {"100000000000"},
        ("oni-label", "--port"): set(), ("oni-collect-pairs", "--seed"): {"0", "100000000000"},
        ("oni-train-reward", "--seed"): {"0", "100000000000"}, ("oni-train-reward", "--val-fraction"): {"0"},
        ("oni-train", "--seed"): {"0", "100000000000"}, ("oni-train", "--feedback-port"): {"0"},
        ("oni-serve", "--port"): {"0"}, ("oni-annotate-pairs", "--max-chunks"): {"100000000000"},
        ("oni-annotate-pairs", "--chunk-size"): {"100000000000"}, ("oni-annotate-pairs", "--seed"): {"0"},
        ("oni-annotate-pairs", "--llm-batch-size"): {"100000000000"},
        ("oni-annotate-pairs", "--llm-concurrency"): {"100000000000"},
        ("oni-label", "--save-every"): {"0"},
        ("oni-serve", "--startup-timeout"): {"100000000000"}, ("oni-serve", "--read-timeout"): {"100000000000"},
        ("oni-serve", "--max-body-mb"): {"100000000000"}, ("oni-serve", "--node-cache-mb"): {"0", "100000000000"},
        ("oni-replay", "--max-mb"): {"100000000000"}, ("oni-plot", "--smooth"): {"100000000000"},
        ("oni-serve", "--max-queue"): {"100000000000"}, ("oni-serve", "--max-tokens-cap"): {"100000000000"},
        ("oni-train", "--max-episode-steps"): {"100000000000"},
        ("oni-train", "--embedded-node-cache-mb"): {"0", "100000000000", ""},  # "": none, the default
    }
    out = []
    for key, (base, names) in flags.items():
        prog = "oni-replay" if key == "oni-replay-gif" else key
        for flag in names:
            for value in NUMBERS:
                if value in valid.get((key, flag), ()):
                    continue
                if (key, flag) == ("oni-label", "--port") and value in ("0",):
                    continue
                expect = flag if value not in ("abc", "") else None
                out.append((prog, base + [flag, value], expect, None))
    return out


def _misc_cases():
    out = [("oni-train", ["--config", "{yaml:" + name + "}"], HOSTILE_YAML_NAMES.get(name), None)
           for name in HOSTILE_YAML]
    out += [
        ("oni-train", ["--task", "chess"], "chess", None),
        ("oni-train", ["--config", "{config.yaml}", "--preset", "oni"], None, None),
        # a setting of another reward type than the run's is refused, not ignored
        ("oni-train", ["--ellm-goal-table", "{goals.pt}"], "--ellm-goal-table", None),
        ("oni-train", ["--intrinsic-reward", "retrieval", "--ellm-goal-table", "{tmp}/g.pt"], "--ellm-goal-table",
         None),
        ("oni-train", ["--ellm-goal-conditioned"], "--ellm-goal-conditioned", None),
        ("oni-train", ["--ranking-pairs", "3", "--intrinsic-reward", "classification"], "--ranking-pairs", None),
        # sizes whose product is too large, each within its own range
        ("oni-train", ["--workers", "4096", "--envs-per-worker", "2"], "--workers", None),
        ("oni-train", ["--workers", "1", "--envs-per-worker", "4096", "--rollout", "1000", "--frames", "1e10"], "--rollout",
         None),

        ("oni-train", ["--worker-stall-timeout", "-1"], "--worker-stall-timeout", None),
        ("oni-train", ["--worker-stall-timeout", "nan"], "--worker-stall-timeout", None),
        ("oni-annotate-pairs", ["{pairs.npz}", "--out", "{tmp}/a.npz", "--annotator", LEGACY_ANN,
                                "--annotator-kwargs", '{"nope": 1}'], "--annotator", None),
        ("oni-annotate-pairs", ["{pairs.npz}", "--out", "{tmp}/a.npz", "--annotator", LEGACY_ANN,
                                "--annotator-kwargs", '[1, 2]'], "--annotator-kwargs", None),
        ("oni-annotate-pairs", ["{pairs.npz}", "--out", "{tmp}/a.npz", "--annotator", LEGACY_ANN,
                                "--annotator-kwargs", '{"a": '], "--annotator-kwargs", None),
        ("oni-annotate-pairs", ["{pairs.npz}", "--out", "{tmp}/a.npz", "--annotator", LEGACY_ANN,
                                "--goal", "gold"], "--goal", None),
        ("oni-annotate-pairs", ["{pairs.npz}", "--out", "{tmp}/a.npz", "--annotator", ANN,
                                "--annotator-kwargs", "{}"], "--annotator-kwargs", None),
        ("oni-annotate-pairs", ["{pairs.npz}", "--out", "{tmp}/a.npz", "--annotator", "oracle"], "--annotator", None),
        ("oni-annotate-pairs", ["{pairs.npz}", "--out", "{tmp}/a.npz", "--annotator", ANN, "--goal", "chess"],
         "--goal", None),
        ("oni-annotate-pairs", ["{pairs.npz}", "--out", "{tmp}/a.npz", "--annotator", ANN, "--teacher-beta", "2"],
         "--teacher-beta", None),
        ("oni-annotate-pairs", ["{pairs.npz}", "--out", "{tmp}/a.npz", "--annotator", "teacher",
                                "--teacher-epsilon", "2"], "--teacher-epsilon", None),
        ("oni-annotate-pairs", ["{pairs.npz}", "--out", "{tmp}/a.npz", "--annotator", "llm", "--llm-url",
                                "http://127.0.0.1:9/v1"], "127.0.0.1:9", None),
        ("oni-annotate-pairs", ["{pairs.npz}", "--out", "{tmp}/a.npz", "--annotator", "llm", "--llm-url",
                                "http://127.0.0.1:9/v1", "--llm-timeout", "-1"], "--llm-timeout", None),
        ("oni-annotate-pairs", ["{pairs.npz}", "--out", "{tmp}/a.npz", "--llm-prompt", "long"], "--llm-prompt", None),
        ("oni-annotate-pairs", ["{pairs.npz}", "--out", "{tmp}/a.npz", "--label-budget", "5"], "--label-budget",
         None),
        ("oni-collect-pairs", ["{metrics.csv}", "--out", "{tmp}/p.npz", "--num-pairs", "2"], None, None),
        ("oni-collect-pairs", ["{run}", "--out", "{run}/captions.pt", "--num-pairs", "2"], "--out", None),
        ("oni-collect-pairs", ["{run}", "--out", "{tmp}/p.npz", "--num-pairs", "2", "--sampling", "zipf"],
         "--sampling", None),
        ("oni-collect-pairs", ["{checkpoint.pt}", "--out", "{tmp}/p.npz", "--num-pairs", "2"], None, None),
        ("oni-collect-pairs", ["{reward.pt}", "--out", "{tmp}/p.npz", "--num-pairs", "2"], None, None),
        ("oni-annotate-pairs", ["{pairs.npz}", "--out", "{tmp}/a.npz", "--annotator", "os:getcwd"], None, None),
        ("oni-annotate-pairs", ["{pairs.npz}", "--out", "{tmp}/a.npz", "--annotator", "no.such.module:X"],
         None, None),
        ("oni-annotate-pairs", ["{pairs.npz}", "--out", "{tmp}/a.npz", "--annotator", "nocolon"], None, None),
        ("oni-annotate-pairs", ["{pairs.npz}", "--out", "{garbage-annotations}", "--annotator", ANN], None, None),
        ("oni-annotate-pairs", ["{pairs.npz}", "--out", "{annotations-other-pairs}", "--annotator", ANN],
         None, None),
        ("oni-train-reward", ["{pairs.npz}", "{annotations.npz}", "--out", "{tmp}/r.pt", "--device", "bogus"],
         "--device", None),
        ("oni-train-reward", ["{pairs.npz}", "{annotations-other-pairs}", "--out", "{tmp}/r.pt"], None, None),
        ("oni-plot", ["{run}", "-o", "{tmp}/t.png", "--title", "$\\frac{$"], "--title", None),
        ("oni-plot", ["{run}", "-o", "{tmp}/t.png", "--title", "$x^$"], "--title", None),
        ("oni-plot", ["{run}", "-o", "{tmp}/t.png", "--group-by", "("], None, None),
        ("oni-plot", ["{run}", "--x", "steps"], None, None),
        ("oni-replay", ["{ep:stats-list}", "-o", "{tmp}/s.html"], None, None),
        ("oni-replay", ["{ep:stats-list}", "--gif", "{tmp}/s.gif"], None, None),
        ("oni-replay", ["{ep:names-int}", "-o", "{tmp}/s.html"], None, None),
        ("oni-replay", ["{ep:meta-list}", "-o", "{tmp}/s.html"], OK_OR_ERROR, None),
        ("oni-replay", ["{ep:stats-deep}", "-o", "{tmp}/s.html"], OK_OR_ERROR, None),
        ("oni-replay", ["{ep:huge}", "-o", "{tmp}/huge.html", "--max-mb", "5"], "--max-mb", None),
        ("oni-replay", ["{ep:huge}", "--gif", "{tmp}/huge.gif", "--max-mb", "2"], "--max-mb", None),
        ("oni-replay", ["{episode.npz}", "--gif", "{tmp}/x.gif", "--start", "5", "--stop", "2"], None, None),
        ("oni-label", ["--store", "{captions.pt}", "--first", "{eval.json}", "--port", "0"], "--first", None),
        ("oni-label", ["--store", "{captions.pt}", "--first", "{numbers.json}", "--port", "0"], "--first", None),
        ("oni-label", ["--store", "{captions.pt}", "--first", "{flagged-nohash.json}", "--port", "0"], "--first",
         None),
        ("oni-label", ["--store", "{captions.pt}", "--first", "{flagged-bighash.json}", "--port", "0"], "--first",
         None),
        ("oni-eval", ["{run}", "--task", "chess", "--no-progress"], None, None),
        ("oni-eval", ["{run}", "--baseline", "{eval-oracle.json}", "--no-progress"], "--baseline", None),
        ("oni-eval", ["{run}", "--baseline", "{eval.json}", "--no-progress"], "--baseline", None),
        ("oni-eval", ["{run}", "--baseline", "{eval-score.json}", "--no-progress"], OK_OR_ERROR, None),
        ("oni-eval", ["{run}", "--episodes", "2", "--record", "3", "--no-progress"], "--record", None),
        ("oni-serve", ["--backend", "scripted", "--", "--x"], None, None),
        ("oni-serve", ["--api-key", "a b"], None, None),
        ("oni-serve", ["--backend", "vllm", "--max-queue", "3"], None, None),
        ("oni-serve", ["--backend", "vllm", "--model", "m", "--", "--host", "0.0.0.0"], "--host", None),
        ("oni-serve", ["--backend", "vllm", "--model", "m", "--", "--port=1"], "--port", None),
        ("oni-serve", ["--backend", "vllm", "--model", "m", "--max-body-mb", "3"], "--max-body-mb", None),
        ("oni-serve", ["--allowed-host", "http://x/"], "--allowed-host", None),
        ("oni-serve", ["--allowed-host", ""], "--allowed-host", None),
    ]
    return out


CASES = _damaged_file_cases() + _path_cases() + _overwrite_cases() + _number_cases() + _misc_cases()
CASES_PER_COMMAND = {}
for _case in CASES:
    CASES_PER_COMMAND[_case[0]] = CASES_PER_COMMAND.get(_case[0], 0) + 1
N_CASES = len(CASES)
"""Inputs tried (one pytest case each)."""


def _case_id(case):
    prog, template, _, extra = case
    text = " ".join(template)
    if extra:
        text = f"{extra['format']}/{extra['damage']}: {text}"
    return f"{prog} {text}"[:120]


# --------------------------------------------------------------------------------- the fixture
@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The sample files, a run folder (untrained checkpoint, caption store, metrics.csv), special
    episodes and the guards' patch targets."""
    root = tmp_path_factory.mktemp("fuzz")
    samples = _build_samples(root / "samples")
    from torchrl_oni.train import TrainConfig, Trainer

    run = root / "run"
    Trainer.from_config(TrainConfig(frames=256, workers=1, envs_per_worker=2, rollout=32, logdir=str(run),
                                    max_episode_steps=20, progress=False, tensorboard=False)).save()
    samples["captions.pt"].parent.joinpath("captions.pt")
    (run / "captions.pt").write_bytes(samples["captions.pt"].read_bytes())
    (run / "metrics.csv").write_bytes(samples["metrics.csv"].read_bytes())
    unreadable = root / "unreadable.pt"
    unreadable.write_bytes(samples["captions.pt"].read_bytes())
    unreadable.chmod(0)
    special = {
        "stats-list": {"stats": [1, 2]}, "names-int": {"action_names": 3}, "meta-list": {"task": [1]},
        "stats-deep": {"stats": {"end": {"a": [1]}}},
    }
    eps = {name: _episode_file(root / f"ep-{name}.npz", meta_update=upd) for name, upd in special.items()}
    eps["huge"] = _huge_episode(root / "ep-huge.npz")
    other = root / "annotations-other.npz"
    np.savez(other, preference=np.ones(3, np.float32), status=np.full(3, 2, np.int8), fingerprint=np.array("x"))
    garbage_ann = root / "annotations-garbage.npz"
    garbage_ann.write_bytes(b"\x00garbage" * 50)
    yield {"root": root, "samples": samples, "run": run, "unreadable": unreadable, "eps": eps,
           "other": other, "garbage_ann": garbage_ann}
    unreadable.chmod(0o600)


def _huge_episode(path):
    """A small file (screens that alternate compress well) whose every frame redraws every cell."""
    from torchrl_oni.replay import Episode, save_episode

    frames = 4000
    ep = Episode.blank(frames, meta={"task": "score", "episode": 0})
    ep.tty_chars[1::2] = ord("#")
    ep.tty_colors[1::2] = 3
    return save_episode(path, ep)


def _fill(template, world, tmp_path, extra):
    """The argv of a case: its files are copies in ``tmp_path`` (a wrongly accepted overwrite
    must not damage the samples the other cases read)."""
    import shutil

    samples = {}
    for key, path in world["samples"].items():
        if any("{" + key + "}" in arg for arg in template):
            samples[key] = Path(shutil.copy(path, tmp_path / path.name))
    run = world["run"]
    if any("{run}" in arg for arg in template):
        run = Path(shutil.copytree(run, tmp_path / "run"))
    bad = None
    if extra:
        data = world["samples"][extra["format"]].read_bytes()
        name = Path(extra["format"]).name
        if extra["suffix"]:
            name = Path(name).stem + extra["suffix"]
        bad = tmp_path / f"damaged-{name}"
        if extra["format"] == "config.yaml" and extra["damage"] == "empty":
            data = b"env:\n  task: {}\n"  # an empty file is a valid (default) configuration
        elif extra["format"] == "config.yaml" and extra["damage"] in ("truncated", "cut by a few bytes"):
            text = data.decode()
            cut = text.index("task: ") + len("task: sco")  # cut in the middle of a value
            data = text[:cut].encode()
        else:
            data = DAMAGES[extra["damage"]](data)
        bad.write_bytes(data)
        badrun = tmp_path / "badrun"
        badrun.mkdir()
        (badrun / "metrics.csv").write_bytes(data)
        badstorerun = tmp_path / "badstorerun"  # a run folder whose caption store is damaged
        badstorerun.mkdir()
        (badstorerun / "captions.pt").write_bytes(data)
    out = []
    for arg in template:
        if arg.startswith("{yaml:"):
            path = tmp_path / "hostile.yaml"
            path.write_text(HOSTILE_YAML[arg[6:-1]], encoding="utf-8", errors="surrogateescape")
            out.append(str(path))
            continue
        if arg.startswith("{ep:"):
            out.append(str(world["eps"][arg[4:-1]]))
            continue
        if bad is not None:
            arg = arg.replace("{bad:store}", str(bad)[: -len(".screens.pt")] + ".pt")
        arg = arg.replace("{bad}", str(bad)).replace("{badrun}", str(tmp_path / "badrun"))
        arg = arg.replace("{badstorerun}", str(tmp_path / "badstorerun"))
        arg = arg.replace("{tmp}", str(tmp_path)).replace("{run}", str(run))
        arg = arg.replace("{unreadable}", str(world["unreadable"]))
        arg = arg.replace("{annotations-other-pairs}", str(world["other"]))
        arg = arg.replace("{garbage-annotations}", str(world["garbage_ann"]))
        for key, path in samples.items():
            arg = arg.replace("{" + key + "}", str(path))
        out.append(arg)
    return out


@pytest.fixture
def guarded(monkeypatch):
    """Real work replaced by :func:`_guard`: training, serving, playing, labelling pages."""
    import torchrl_oni.evaluate as evaluate
    import torchrl_oni.feedback.server as feedback_server
    import torchrl_oni.serve.cli as serve_cli
    from torchrl_oni.train import ppo

    monkeypatch.setattr(ppo.Trainer, "train", _guard)
    monkeypatch.setattr(evaluate, "_run_shards", _guard)
    monkeypatch.setattr(feedback_server.FeedbackServer, "start", _guard)
    for name in ("_serve_embedded", "_serve_vllm", "_serve_scripted", "_serve"):
        if hasattr(serve_cli, name):
            monkeypatch.setattr(serve_cli, name, _guard)
    monkeypatch.setenv("ONI_SERVE_API_KEY", "")


def call(prog, argv):
    """``(exit status, stderr, stdout)`` of ``prog``'s ``main(argv)`` in this process."""
    main = _mains()[prog]
    err, out = io.StringIO(), io.StringIO()
    with redirect_stderr(err), redirect_stdout(out):
        try:
            code = main(list(argv))
        except SystemExit as stop:
            code = stop.code
        except _WouldStart:
            code = "accepted"
        except BaseException as exc:  # noqa: B902 - a traceback is what this test looks for
            import traceback

            err.write("Traceback (most recent call last):\n" + "".join(traceback.format_exception_only(exc)))
            code = "traceback"
    return code, err.getvalue(), out.getvalue()


def check_one_line(prog, code, err, expect=None):
    """The rule: exit 2, one non-empty ``prog: error:`` line of at most MAX_LINE characters."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err, err[-3000:]
    if expect == OK_OR_ERROR:
        if code in (0, "accepted"):
            return
        expect = None
    assert code == 2, (code, err[-2000:])
    assert len(lines) == 1, err[-3000:]
    assert len(lines[0]) <= MAX_LINE, f"{len(lines[0])} characters: {lines[0][:300]}..."
    assert lines[0].startswith(f"{prog}: error: ") and len(lines[0]) > len(f"{prog}: error: ") + 3, lines[0]
    if expect:
        assert expect in lines[0], (expect, lines[0])


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_a_bad_input_is_one_error_line(case, world, guarded, tmp_path):
    prog, template, expect, extra = case
    argv = _fill(template, world, tmp_path, extra)
    code, err, _ = call(prog, argv)
    check_one_line(prog, code, err, expect)


def test_inputs_are_left_as_they_were(world, guarded, tmp_path):
    """The refused overwrites above left their inputs intact (and readable)."""
    from torchrl_oni.replay import load_episode
    from torchrl_oni.train.checkpoint import load_checkpoint

    load_episode(world["samples"]["episode.npz"])
    load_checkpoint(str(world["run"] / "checkpoint.pt"))
    assert (world["run"] / "metrics.csv").read_bytes() == world["samples"]["metrics.csv"].read_bytes()


def test_the_case_count_is_reported(capsys):
    assert N_CASES >= 500, N_CASES
    with capsys.disabled():
        print(f"\n{N_CASES} inputs tried: " + ", ".join(f"{k} {v}" for k, v in sorted(CASES_PER_COMMAND.items())))


if __name__ == "__main__":  # the figures, without running anything
    print(N_CASES, "inputs tried")
    for name, count in sorted(CASES_PER_COMMAND.items()):
        print(f"  {name:<20} {count}")
    sys.exit(0)
