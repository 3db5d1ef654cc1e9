"""The judge probe: a judge that approves everything is caught before its first real label and
while the run goes on; a judge that answers right is left alone."""
import asyncio
import logging

import pytest

from torchrl_oni.annotators import ScriptedAnnotator
from torchrl_oni.annotators.base import Label
from torchrl_oni.annotators.probe import NOT_PROGRESS, PROGRESS, probe_judge
from torchrl_oni.testing import FakeLLMServer
from torchrl_oni.train import TrainConfig
from torchrl_oni.train.build import build_intrinsic_hook


class _Constant(ScriptedAnnotator):
    """Answers every caption with the same value (None: fails every caption)."""

    def __init__(self, value, fail_every=0):
        super().__init__()
        self.value, self.fail_every = value, fail_every

    async def annotate(self, captions):
        return [Label(None, self.provenance, error="unparsable") if self.fail_every and i % self.fail_every == 0
                else Label(self.value, self.provenance) for i, _ in enumerate(captions)]


@pytest.mark.parametrize("goal", sorted(PROGRESS))
def test_the_rules_pass_their_own_probe(goal):
    report = asyncio.run(probe_judge(ScriptedAnnotator(goal=goal), goal))
    assert report.problem() is None, report.summary()
    assert report.accuracy == 1.0 and report.answered == len(NOT_PROGRESS) + len(PROGRESS[goal])


def test_a_judge_that_approves_everything_is_named():
    report = asyncio.run(probe_judge(_Constant(1.0)))
    problem = report.problem()
    assert report.false_positive_rate == 1.0
    assert "approves 8 of 8 captions that show no progress" in problem and "the empty message" in problem
    assert "--llm-prompt short" in problem  # what to try


def test_a_judge_that_approves_nothing_cannot_tell():
    problem = asyncio.run(probe_judge(_Constant(0.0))).problem()
    assert "cannot tell progress from its absence" in problem and "approves 0% of progress" in problem


def test_a_judge_that_mostly_fails_to_answer_is_reported():
    problem = asyncio.run(probe_judge(_Constant(0.0, fail_every=1))).problem()
    assert problem.startswith("the judge answered only 0 of 13")


def _hook(tmp_path, server):
    cfg = TrainConfig(intrinsic_reward="retrieval", llm_url=(server.url,), logdir=str(tmp_path), workers=1)
    return build_intrinsic_hook(cfg.resolved())


def test_a_yes_man_server_triggers_the_alarm_at_start_and_in_the_summary(tmp_path, caplog):
    with FakeLLMServer(mode="yes") as server:
        with caplog.at_level(logging.WARNING, logger="torchrl_oni"):
            hook = _hook(tmp_path, server)
        try:
            assert any("!! the judge approves 8 of 8" in r.getMessage() for r in caplog.records)
            metrics = hook.metrics()
            assert metrics["judge/probe_false_positive_rate"] == 1.0
            line = hook.alert(metrics)  # above the progress bar, at once
            assert line.startswith("judge probe: the judge approves 8 of 8")
            assert any("approves 8 of 8" in w for w in hook.final_warnings(metrics))
        finally:
            hook.close(save=False)


def test_a_sound_server_passes_and_nothing_is_said(tmp_path, caplog):
    with FakeLLMServer(mode="ok") as server:
        with caplog.at_level(logging.INFO, logger="torchrl_oni"):
            hook = _hook(tmp_path, server)
        try:
            assert hook.labelling.judge is not None and hook.labelling.judge.problem() is None
            assert any(r.getMessage().startswith("judge probe: 13 of 13 answered, accuracy 100%")
                       for r in caplog.records)
            metrics = hook.metrics()
            assert metrics["judge/probe_accuracy"] == 1.0
            assert hook.alert(metrics) is None
            assert not any("judge" in w for w in hook.final_warnings(metrics))
        finally:
            hook.close(save=False)


def test_the_positive_rate_is_watched_while_the_run_goes_on(tmp_path):
    with FakeLLMServer(mode="ok") as server:
        hook = _hook(tmp_path, server)
        try:
            ok = {"labels/labelled": 5000, "labels/positive_fraction": 0.12, "labels/seen_coverage": 0.99}
            assert hook.labelling.judge_problem(ok) is None
            few = {**ok, "labels/labelled": 50, "labels/positive_fraction": 0.9}
            assert hook.labelling.judge_problem(few) is None  # too few labels to judge the judge
            bad = {**ok, "labels/positive_fraction": 0.93}
            assert "approved 93% of the 5,000 captions" in hook.labelling.judge_problem(bad)
            assert any("approved 93%" in w for w in hook.final_warnings(bad))
            # the empty message, the commonest caption of all, labelled progress
            from torchrl_oni.annotators.base import Provenance
            from torchrl_oni.captions import encode_messages, hash_messages

            empty = encode_messages([""])
            hook.labelling.store.add(empty)
            hook.labelling.store.set_labels(hash_messages(empty), [1.0], Provenance("llm", "fake-model", "v1"))
            assert "labelled the empty message" in hook.labelling.judge_problem(ok)
        finally:
            hook.close(save=False)


@pytest.mark.parametrize("mode,code", [("yes", 1), ("ok", 0)])
def test_oni_train_check_judge(mode, code, capsys, tmp_path):
    from torchrl_oni.train.cli import main

    with FakeLLMServer(mode=mode) as server:
        assert main(["--check-judge", "--intrinsic-reward", "retrieval", "--llm-url", server.url,
                     "--logdir", str(tmp_path)]) == code
    out = capsys.readouterr().out
    assert out.startswith("judge probe: 13 of 13 answered")
    assert ("!! the judge approves 8 of 8" in out) == (mode == "yes")
    assert not (tmp_path / "metrics.csv").exists(), "--check-judge trains nothing"

