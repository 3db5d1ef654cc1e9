"""Offline Motif's commands on what users have: a run folder or a caption store
(``oni-collect-pairs``, frequency-weighted as Motif samples), ``oni-train``'s annotator flags
(``oni-annotate-pairs``), then ``oni-train-reward`` and ``oni-train --intrinsic-reward motif``."""
from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

from helpers import RULES, TINY
from torchrl_oni.annotators.base import TIE
from torchrl_oni.captions import decode_messages, encode_messages, hash_messages
from torchrl_oni.rewards.motif import (
    LABELLED,
    NOT_ASKED,
    TIED,
    MotifReward,
    collect_frequency_pairs,
    load_annotations,
    store_captions,
)
from torchrl_oni.run_folder import CAPTION_STORE_NAME
from torchrl_oni.store import CaptionStore
from torchrl_oni.testing import FakeLLMServer
from torchrl_oni.train.motif_cli import annotate_pairs_main, collect_pairs_main, train_reward_main

torch.set_num_threads(1)

HAND_COUNTS = {"You kill the newt!": 3, "It's a wall.": 12, "You see here 4 gold pieces.": 1,
               "The door opens.": 6, "There is a staircase down here.": 2, "": 40}
"""How often each caption was seen in the crafted store (the empty message most, as in NetHack)."""


def _crafted_store(path=None) -> CaptionStore:
    """A store that saw each caption of :data:`HAND_COUNTS` that many times, added in batches."""
    store = CaptionStore(capacity=4)
    steps = [text for text, n in HAND_COUNTS.items() for _ in range(n)]
    order = np.random.default_rng(0).permutation(len(steps))
    for batch in np.array_split(order, 5):  # the trainer adds a batch at a time
        store.add(encode_messages([steps[i] for i in batch]))
    if path is not None:
        store.save(path)
    return store


def _draws(first, second):
    """Caption text -> how many times it was drawn, over both sides of every pair."""
    texts, counts = np.unique(decode_messages(np.concatenate([first, second])), return_counts=True)
    return dict(zip(texts.tolist(), counts.tolist()))


def _within(observed: dict, expected_p: dict, n: int, sigmas: float = 4.5) -> None:
    """Every caption drawn within ``sigmas`` binomial standard deviations of ``n · p``, none other."""
    assert set(observed) <= {k for k, p in expected_p.items() if p > 0}, set(observed) - set(expected_p)
    for text, p in expected_p.items():
        got, mean, sd = observed.get(text, 0), n * p, math.sqrt(n * p * (1 - p))
        assert abs(got - mean) <= sigmas * sd + 1, (text, got, mean, sd)


# ------------------------------------------------------------------------- frequency weighting
def test_the_store_counts_what_the_hand_counts():
    messages, seen = store_captions(_crafted_store())
    assert dict(zip(decode_messages(messages), seen.tolist())) == HAND_COUNTS


@pytest.mark.parametrize("include_empty", [False, True])
def test_frequency_weighting_matches_the_expected_proportions(include_empty):
    messages, seen = store_captions(_crafted_store())
    counts = {t: n for t, n in HAND_COUNTS.items() if include_empty or t}
    total = sum(counts.values())
    p = {t: n / total for t, n in counts.items()}
    pairs = 20_000
    for seed in range(3):
        first, second = collect_frequency_pairs(messages, pairs, times_seen=seen, include_empty=include_empty,
                                                seed=seed)
        assert first.shape == second.shape == (pairs, 256)
        observed = _draws(first, second)
        _within(observed, p, 2 * pairs)
        # Pearson's chi-square over the captions: below its 99.9th percentile (5 degrees of freedom: 20.5)
        chi2 = sum((observed.get(t, 0) - 2 * pairs * q) ** 2 / (2 * pairs * q) for t, q in p.items())
        assert chi2 < (20.5 if include_empty else 18.5), chi2  # 4 degrees of freedom without the empty one
        # the two sides are drawn independently: one caption twice as often as sum(p^2)
        same = float((first == second).all(axis=1).mean())
        assert abs(same - sum(q * q for q in p.values())) < 0.02, same
        for side in (first, second):  # each side on its own has the same proportions
            _within(_draws(side, side[:0]), p, pairs)


def test_frequency_weighting_of_raw_messages_counts_rows():
    texts = ["a"] * 30 + ["b"] * 10 + ["c"] * 10
    first, second = collect_frequency_pairs(encode_messages(texts), 10_000, seed=1)
    _within(_draws(first, second), {"a": 0.6, "b": 0.2, "c": 0.2}, 20_000)
    with pytest.raises(ValueError, match="2 distinct non-empty"):
        collect_frequency_pairs(encode_messages(["a", "a", ""]), 5)
    with pytest.raises(ValueError, match="whole, non-negative"):
        collect_frequency_pairs(encode_messages(["a", "b"]), 5, times_seen=[1, -1])
    with pytest.raises(ValueError, match="2 counts for 3"):
        collect_frequency_pairs(encode_messages(["a", "b", "c"]), 5, times_seen=[1, 2])


def test_collect_pairs_from_a_crafted_store_file_against_a_hand_count(tmp_path, capsys):
    store_file = tmp_path / "captions.pt"
    _crafted_store(store_file)
    out = tmp_path / "pairs.npz"
    assert collect_pairs_main([str(store_file), "--out", str(out), "--num-pairs", "6000", "--seed", "3"]) == 0
    assert "6000 pairs of 5 distinct captions" in capsys.readouterr().out
    with np.load(out) as data:
        first, second = data["first"], data["second"]
    assert first.shape == (6000, 256)
    nonempty = {t: n for t, n in HAND_COUNTS.items() if t}
    _within(_draws(first, second), {t: n / sum(nonempty.values()) for t, n in nonempty.items()}, 12_000)
    # --sampling uniform: every distinct caption alike, two different ones per pair (the former rule)
    assert collect_pairs_main([str(store_file), "--out", str(out), "--num-pairs", "6000", "--sampling",
                               "uniform"]) == 0
    with np.load(out) as data:
        first, second = data["first"], data["second"]
    assert not (first == second).all(axis=1).any()
    _within(_draws(first, second), {t: 1 / len(nonempty) for t in nonempty}, 12_000)


def test_a_run_folder_whose_store_lives_elsewhere(tmp_path):
    """A run started with --caption-store PATH: its config.yaml says where the store is."""
    from torchrl_oni.train.config import TrainConfig

    elsewhere = tmp_path / "stores" / "shared.pt"
    elsewhere.parent.mkdir()
    _crafted_store(elsewhere)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(TrainConfig(caption_store=str(elsewhere)).to_yaml())
    assert collect_pairs_main([str(run), "--out", str(tmp_path / "p.npz"), "--num-pairs", "10"]) == 0
    os.remove(elsewhere)
    assert collect_pairs_main([str(run), "--out", str(tmp_path / "p.npz"), "--num-pairs", "10"]) == 2


# ------------------------------------------------------------------------- oni-annotate-pairs's flags
def test_the_annotator_flags_are_oni_trains(capsys):
    """Generated from the same ``annotation`` section: the same flags, choices and help."""
    from torchrl_oni.train import motif_cli
    from torchrl_oni.train.cli import build_parser
    from torchrl_oni.cli_errors import OneLineArgumentParser

    def options(parser):
        return {opt: (a.choices, a.help, a.nargs) for a in parser._actions for opt in a.option_strings}

    ours = OneLineArgumentParser(prog="oni-annotate-pairs")
    motif_cli._annotate_args(ours)
    train, mine = options(build_parser()), options(ours)
    flags = {"--" + name.replace("_", "-") for name in motif_cli.annotator_settings()}
    assert {"--annotator", "--llm-url", "--llm-model", "--llm-api-key", "--goal", "--teacher-beta"} <= flags
    for flag in flags:
        assert mine[flag] == train[flag], flag
    assert "--label-budget" not in mine and "--caption-store" not in mine


def _pairs_file(tmp_path, n=40):
    texts = [t for t in HAND_COUNTS if t]
    first, second = collect_frequency_pairs(encode_messages(texts), n, seed=0)
    path = tmp_path / "pairs.npz"
    np.savez(path, first=first, second=second)
    return path, decode_messages(first), decode_messages(second)


def test_annotate_with_an_llm_url_sends_the_environment_key_there(tmp_path, monkeypatch):
    """--llm-url from the command line gets OPENAI_API_KEY (as oni-train gives it); --llm-api-key wins."""
    monkeypatch.setenv("OPENAI_API_KEY", "sk-users-own-key")
    pairs, a, b = _pairs_file(tmp_path)
    with FakeLLMServer(mode="ok") as server:
        out = tmp_path / "annotations.npz"
        assert annotate_pairs_main([str(pairs), "--out", str(out), "--annotator", "llm", "--llm-url", server.url,
                                    "--llm-prompt", "tagged"]) == 0
        assert server.authorization and set(server.authorization) == {"Bearer sk-users-own-key"}
        state = load_annotations(out)
        labelled = state["status"] == LABELLED
        assert labelled.sum() > 0 and (state["status"] != NOT_ASKED).all()
        expected = np.array([RULES.preference(x, y) for x, y in zip(a, b)], dtype=np.float32)
        assert np.array_equal(state["preference"][labelled], expected[labelled])  # the fake answers as the rules
        server.authorization.clear()
        assert annotate_pairs_main([str(pairs), "--out", str(tmp_path / "b.npz"), "--annotator", "llm",
                                    "--llm-url", server.url, "--llm-api-key", "k2"]) == 0
        assert set(server.authorization) == {"Bearer k2"}


def test_the_annotator_is_built_by_the_registry_and_its_server_stopped(tmp_path, monkeypatch, capsys):
    """``--annotator llm`` without a URL: the registry's build starts the embedded server; the command
    stops it at the end, after an error too."""
    from torchrl_oni.annotators import ScriptedAnnotator
    from torchrl_oni.train import annotator_types

    built, stopped = [], []

    class Handle:
        def stop(self):
            stopped.append(True)

    class Breaking(ScriptedAnnotator):
        async def compare(self, pairs):
            if len(built) > 1:
                raise ConnectionError("the embedded server died")
            return await super().compare(pairs)

    def build(ann, *, seed=0):
        built.append((ann.llm_url, ann.goal, seed))
        return Breaking(goal=ann.goal), Handle()

    entry = annotator_types.get_annotator("llm")
    monkeypatch.setitem(annotator_types._ANNOTATORS, "llm",
                        annotator_types.AnnotatorType("llm", entry.help, build, llm=True, judged=True))
    pairs, _, _ = _pairs_file(tmp_path)
    out = tmp_path / "a.npz"
    assert annotate_pairs_main([str(pairs), "--out", str(out), "--goal", "gold", "--seed", "5",
                                "--chunk-size", "10", "--max-chunks", "1"]) == 0
    assert built == [((), "gold", 5)] and stopped == [True]
    assert annotate_pairs_main([str(pairs), "--out", str(out), "--chunk-size", "10"]) == 2
    assert stopped == [True, True]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "run again to resume" in err[0], err


# ------------------------------------------------------------------------- the whole chain
@pytest.mark.slow
def test_the_offline_motif_chain_on_a_real_run_folder(tmp_path, capsys, retrieval_run):
    """oni-train (labelled captions) → oni-collect-pairs RUN → oni-annotate-pairs --annotator scripted
    (resumed) → oni-train-reward → oni-train --intrinsic-reward motif."""
    from torchrl_oni.train.cli import main as oni_train
    from torchrl_oni.train.run_log import read_metrics

    # the run folder of `oni-train *TINY --frames 2048 --intrinsic-reward retrieval --annotator scripted`
    run = retrieval_run
    messages, seen = store_captions(CaptionStore.load(run / CAPTION_STORE_NAME))
    assert seen.sum() >= 2048  # every step's caption was counted

    # 1. pairs from the run folder, in proportion to how often the agent saw each caption
    pairs = tmp_path / "pairs.npz"
    assert collect_pairs_main([str(run), "--out", str(pairs), "--num-pairs", "3000", "--seed", "7"]) == 0
    with np.load(pairs) as data:
        first, second = data["first"], data["second"]
    assert first.shape == second.shape == (3000, 256)
    nonempty = messages[:, 0] != 0
    texts = decode_messages(messages[nonempty])
    p = dict(zip(texts, (seen[nonempty] / seen[nonempty].sum()).tolist()))
    _within(_draws(first, second), p, 6000)

    # 2. the rules annotate them, in two sittings (the second resumes the file)
    annotations = tmp_path / "annotations.npz"
    assert annotate_pairs_main([str(pairs), "--out", str(annotations), "--annotator", "scripted",
                                "--chunk-size", "500", "--max-chunks", "1"]) == 0
    assert (load_annotations(annotations)["status"] == NOT_ASKED).any()
    assert annotate_pairs_main([str(pairs), "--out", str(annotations), "--annotator", "scripted"]) == 0
    state = load_annotations(annotations)
    status, preference = state["status"], state["preference"]
    identical = (first == second).all(axis=1)
    assert (status != NOT_ASKED).all() and (status == LABELLED).sum() > 0
    assert np.array_equal(status == TIED, identical) and (preference[identical] == TIE).all()
    expected = np.array([RULES.preference(x, y) for x, y in zip(decode_messages(first), decode_messages(second))])
    assert np.array_equal(preference[~identical], expected[~identical].astype(np.float32))

    # 3. the reward model
    reward_file = tmp_path / "reward.pt"
    assert train_reward_main([str(pairs), str(annotations), "--out", str(reward_file), "--epochs", "1",
                              "--batch-size", "256", "--lr", "1e-3"]) == 0
    assert "--reward-model" in capsys.readouterr().out
    reward = MotifReward(reward_file, quantile=0.5)
    scores = reward(messages, hash_messages(messages))
    assert scores.shape == (len(messages),) and torch.isfinite(scores).all()

    # 4. a motif run on it
    motif_run = tmp_path / "motif"
    assert oni_train([*TINY, "--logdir", str(motif_run), "--intrinsic-reward", "motif",
                      "--reward-model", str(reward_file)]) == 0
    rows = read_metrics(str(motif_run))
    assert rows and rows[-1]["frames"] >= 1024
    assert "reward/intrinsic_mean" in rows[-1] and np.isfinite(rows[-1]["reward/intrinsic_mean"])


def test_a_reward_model_that_barely_moved_is_reported(tmp_path, capsys):
    """Motif's --lr 1e-5 on a few hundred pairs leaves the model at its start (val loss ln 2): said once."""
    pairs, _, _ = _pairs_file(tmp_path, n=300)
    annotations = tmp_path / "a.npz"
    assert annotate_pairs_main([str(pairs), "--out", str(annotations), "--annotator", "scripted"]) == 0
    capsys.readouterr()
    assert train_reward_main([str(pairs), str(annotations), "--out", str(tmp_path / "slow.pt"), "--epochs", "2"]) == 0
    err = capsys.readouterr().err
    assert "barely moved from its start" in err and "--lr 1e-05" in err
    # a model that learns (val loss ~0.42 here, far from ln 2) is not reported
    assert train_reward_main([str(pairs), str(annotations), "--out", str(tmp_path / "fit.pt"), "--epochs", "8",
                              "--lr", "3e-3"]) == 0
    assert "barely moved" not in capsys.readouterr().err
