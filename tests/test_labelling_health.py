"""The labelling's health in plain sight: a dead LLM server named, labels that stop said, no alarm
while the server boots, both coverages on the bar, a judge that approves nothing named, and the
summary on Ctrl-C."""
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from tensordict import TensorDict

from helpers import poll
from torchrl_oni.captions import encode_messages, hash_messages
from torchrl_oni.reward_hacking import MIN_APPROVED_WINDOW
from torchrl_oni.testing import FakeLLMServer
from torchrl_oni.train import TrainConfig
from torchrl_oni.train.labelling_health import LabellingHealth, duration

URL = "http://127.0.0.1:8000"


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def _watch():
    clock = Clock()
    return clock, LabellingHealth(clock=clock, wall=lambda: 0.0)


# ------------------------------------------------------------------ the watcher alone
def test_a_server_that_goes_down_is_named_at_once_then_once_a_minute_and_its_return_is_said():
    clock, watch = _watch()
    assert watch.update(100, 0, [(URL, True, "")]) == []
    clock.now += 30
    (line,) = watch.update(100, 250, [(URL, False, "connection error ClientConnectorError")])
    assert line.startswith(f"the LLM server at {URL} is not answering since ")
    assert "connection error ClientConnectorError" in line and "labelling has stopped: 250 captions wait" in line
    assert watch.state() == "down 0s"
    clock.now += 45
    assert watch.update(100, 4000, [(URL, False, "")]) == []  # once a minute, not every update
    assert watch.state() == "down 45s"
    clock.now += 20
    (line,) = watch.update(100, 4156, [(URL, False, "")])
    assert "(1 min 5 s)" in line and "4,156 captions wait" in line
    clock.now += 10
    assert watch.update(140, 3000, [(URL, True, "")]) == [f"the LLM server at {URL} answers again after 1 min 15 s down"]
    assert watch.state() == "ok"
    assert watch.metrics()["annotation/stalled_total_s"] == 75.0 and watch.metrics()["annotation/stalls"] == 1


def test_one_server_of_a_pool_down_is_named_and_the_others_go_on():
    clock, watch = _watch()
    other = "http://127.0.0.1:8001"
    watch.update(10, 5, [(URL, True, ""), (other, True, "")])
    clock.now += 5
    (line,) = watch.update(20, 5, [(URL, False, "timeout"), (other, True, "")])
    assert line.startswith(f"the LLM server at {URL} is not answering") and "the other 1 server go on labelling" in line
    assert watch.state() == "ok"  # labels still come


def test_labels_that_stop_while_captions_wait_are_said_with_the_cause_whatever_the_servers_say():
    clock, watch = _watch()
    assert watch.update(50, 10, [(URL, True, "")]) == []
    clock.now += 59
    assert watch.update(50, 900, [(URL, True, "")], cause=lambda: "the LLM server is too slow") == []
    clock.now += 2
    (line,) = watch.update(50, 1200, [(URL, True, "")], cause=lambda: "the LLM server is too slow")
    assert line == ("no caption labelled for 1 min 1 s while 1,200 wait; new captions pay nothing until labels come "
                    "back: the LLM server is too slow")
    assert watch.state() == "stalled 61s"
    clock.now += 1
    watch.update(51, 0, [(URL, True, "")])
    assert watch.state() == "ok" and watch.total_stalled_s() == 62.0


def test_nothing_waiting_is_no_stall():
    clock, watch = _watch()
    watch.update(5, 0, [])
    clock.now += 600
    assert watch.update(5, 0, []) == [] and watch.state() == "ok"


def test_the_summary_says_how_long_labelling_stopped_and_warns_when_it_was_a_large_share():
    clock, watch = _watch()
    watch.update(10, 0, [(URL, True, "")])
    clock.now += 100
    watch.update(10, 500, [(URL, False, "connection error")])
    clock.now += 300
    watch.update(10, 900, [(URL, False, "")])
    plain, loud = watch.summary_lines(never_labelled=900, seen=1500)
    assert plain == ["labelling stopped for 5 min of 6 min 40 s (1 time)", "900 of 1,500 captions seen were never labelled"]
    (line,) = loud
    assert line.startswith("labelling was stopped for 5 min, 75% of the run") and "900 of 1,500 captions" in line
    clock, quiet = _watch()
    quiet.update(10, 0, [])
    clock.now += 1000
    assert quiet.summary_lines(0, 20)[1] == []


def test_duration_reads_as_a_person_says_it():
    assert [duration(s) for s in (0, 59.6, 60, 61, 3599, 7300)] == ["0 s", "1 min", "1 min", "1 min 1 s",
                                                                    "59 min 59 s", "2 h 1 min"]


# ------------------------------------------------------------------ in the trainer's hook
def _hook(tmp_path, **kw):
    from torchrl_oni.train.build import build_intrinsic_hook

    return build_intrinsic_hook(TrainConfig(intrinsic_reward="retrieval", logdir=str(tmp_path), workers=1,
                                            **kw).resolved())


def _captions(prefix, n):
    msgs = encode_messages([f"{prefix} {k}" for k in range(n)])
    return TensorDict(message=msgs, caption_hash=torch.from_numpy(hash_messages(msgs)), batch_size=[n])


@pytest.mark.timeout(180)
def test_a_server_killed_mid_run_is_named_within_90_s_and_the_summary_says_so(tmp_path):
    server = FakeLLMServer(mode="ok").start()
    hook = _hook(tmp_path, llm_url=(server.url,))
    try:
        hook.labelling.annotation(_captions("You kill the newt", 40))
        assert poll(lambda: hook.metrics()["labels/labelled"] >= 40, 30), "labels while the server lives"
        assert hook.alert(hook.metrics()) is None
        assert hook.bar_fields(hook.metrics())[-1] == "llm=ok"
        server.stop()
        killed, said, k = time.monotonic(), [], 0
        while time.monotonic() - killed < 90 and not said:
            k += 1
            hook.labelling.annotation(_captions(f"You see a fountain {k}", 20))
            text = hook.alert(hook.metrics())
            said = [line for line in (text or "").splitlines() if "not answering" in line]
            time.sleep(0.5)
        assert said, "no warning within 90 s of the server's death"
        assert said[0].startswith(f"the LLM server at {server.url} is not answering since ")
        assert "labelling has stopped" in said[0]
        metrics = hook.metrics()
        assert hook.bar_fields(metrics)[-1].startswith("llm=down ")
        time.sleep(1.1)
        notes = hook.summary_lines(hook.metrics())
        assert any(n.startswith("labelling stopped for ") for n in notes)
        assert any("captions seen were never labelled" in n for n in notes)
    finally:
        hook.close(save=False)
        server.stop()


def test_no_coverage_alarm_while_the_server_boots(tmp_path, monkeypatch):
    """The grace minute starts at the first update, not when the hook (and the server) started."""
    import torchrl_oni.train.labelling as labelling

    hook = _hook(tmp_path, annotator="scripted")
    try:
        real = time.monotonic
        monkeypatch.setattr(labelling.time, "monotonic", lambda: real() + 80.0)  # the server took 80 s to boot
        starving = {"labels/seen_coverage": 0.0, "labels/labelled": 0, "labels/captions": 112}
        assert hook.alert(starving) is None
    finally:
        hook.close(save=False)


def test_the_bar_names_both_coverages_the_queue_and_one_frame_rate(tmp_path):
    from torchrl_oni.train.ppo import BAR_FORMAT, _progress_fields

    hook = _hook(tmp_path, annotator="scripted")
    try:
        metrics = {"labels/seen_coverage": 0.99, "labels/seen_captions": 2752, "labels/seen_labelled": 752,
                   "annotation/queue_depth": 2000, "annotation/labels_per_s": 6.04, "episode/return": 0.5}
        hook.alert(metrics)
        text = _progress_fields(2713.4, metrics, [hook])
        assert text == ("frames/s=2,713, return=0.50, labelled=99% steps 27% captions, queue=2,000, labels/s=6.0, "
                        "llm=ok")
        assert "rate" not in BAR_FORMAT  # tqdm's own rate would be a second frames/s figure
    finally:
        hook.close(save=False)


def test_a_judge_that_approves_almost_nothing_is_named(tmp_path):
    hook = _hook(tmp_path, annotator="scripted")
    try:
        stingy = {"labels/labelled": 480, "labels/positive_fraction": 1 / 480, "labels/seen_coverage": 0.99}
        problem = hook.labelling.judge_problem(stingy)
        assert problem.startswith("the judge approved only 1 of the 480 captions it labelled (0.2%")
        assert "ONI does nothing" in problem
        assert hook.alert(stingy) == problem
        assert any("approved only 1 of the 480" in w for w in hook.final_warnings(stingy))
        assert hook.labelling.judge_problem({**stingy, "labels/positive_fraction": 0.12}) is None
        assert hook.labelling.judge_problem({**stingy, "labels/labelled": 48}) is None  # too few to judge the judge
    finally:
        hook.close(save=False)


def test_a_reward_that_pays_almost_no_step_is_named_unless_the_agent_finds_more_of_it(tmp_path):
    from torchrl_oni.reward_hacking import APPROVED_WINDOW

    hook = _hook(tmp_path, annotator="scripted")
    try:
        labelled = {"labels/labelled": 400, "labels/positive_fraction": 0.1, "labels/seen_coverage": 0.99}
        hook._window.run_steps, hook._window.run_rewarded = 100_000, 120  # 0.12 % of the steps paid
        problem = hook._paid_problem(labelled)
        assert problem.startswith("the intrinsic reward paid only 0.12% of the steps so far (40 of 400")
        assert any(w == problem for w in hook.final_warnings(labelled))
        tally = hook.hacking.tally
        for k in range(2 * APPROVED_WINDOW):  # the agent meets 1, then 3 approved captions an episode
            n = 1 if k < APPROVED_WINDOW else 3
            tally.add_episode(list(range(n)), [1.0] * n, list(range(1, n + 1)), 50, False)
        assert hook._paid_problem(labelled) is None  # rare, but found more and more: ONI at work
        assert hook.summary_lines(labelled)[0] == (
            f"approved captions per episode: 1.00 in the first {APPROVED_WINDOW} episodes, 3.00 in the last "
            f"{APPROVED_WINDOW}")
    finally:
        hook.close(save=False)


@pytest.mark.parametrize("episodes,told", [(150, True), (2 * MIN_APPROVED_WINDOW - 1, False)])
def test_a_run_with_fewer_episodes_than_two_windows_compares_its_halves(tmp_path, episodes, told):
    """Many games and long episodes end fewer than 2 x APPROVED_WINDOW episodes in a short run:
    its first half is compared with its last, and an agent that finds more of what ONI pays is
    not called one the reward cannot steer; with too few episodes for halves of
    MIN_APPROVED_WINDOW the run says nothing of the trend (and the warning stands)."""
    hook = _hook(tmp_path, annotator="scripted")
    try:
        labelled = {"labels/labelled": 400, "labels/positive_fraction": 0.1, "labels/seen_coverage": 0.99}
        hook._window.run_steps, hook._window.run_rewarded = 100_000, 120
        half = episodes // 2
        for k in range(episodes):  # 1 approved caption an episode in the first half, 3 after it
            n = 1 if k < episodes - half else 3
            hook.hacking.tally.add_episode(list(range(n)), [1.0] * n, list(range(1, n + 1)), 50, False)
        lines = hook.summary_lines(labelled)
        if told:
            assert lines[0] == (f"approved captions per episode: 1.00 in the first {half} episodes, 3.00 in "
                                f"the last {half}")
            assert hook._paid_problem(labelled) is None
        else:
            assert not any(line.startswith("approved captions per episode") for line in lines)
            assert hook._paid_problem(labelled).startswith("the intrinsic reward paid only 0.12%")
    finally:
        hook.close(save=False)


@pytest.mark.slow
def test_ctrl_c_prints_the_summary(tmp_path):
    logdir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torchrl_oni.train", "--intrinsic-reward", "retrieval", "--annotator", "scripted",
           "--frames", "10M", "--workers", "1", "--envs-per-worker", "4", "--rollout", "32", "--minibatch-size", "64",
           "--no-progress", "--no-tensorboard", "--logdir", str(logdir)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        metrics = logdir / "metrics.csv"
        assert poll(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 4, 240), "no training"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGINT, err[-2000:]
    assert "== oni-train: score, retrieval intrinsic reward, stopped by SIGINT ==" in out
    assert "labelled (share of steps)" in out and "labelled (distinct captions)" in out
    assert "SIGINT: checkpoint and caption store saved" in err
