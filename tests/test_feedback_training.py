"""Label-efficient annotation and human feedback inside training (oni-train and its hook).

The env's screens option, the hook with the labelling page on the live store (a person's label
reaches the reward from the next batch; a stuck or closed page never stalls training), RUNE in
the optimised reward, ensembles and query selection built through the reward registry, and
whole oni-train runs.
"""
import json
import os
import socket
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from helpers import TINY, page_ready, press, wait_for
from torchrl_oni.annotators.base import Provenance
from torchrl_oni.annotators.scripted import ScriptedAnnotator
from torchrl_oni.captions import decode_message, encode_messages, hash_messages
from torchrl_oni.envs import NLEBatchEnv
from torchrl_oni.envs.batched import SCREEN_KEYS
from torchrl_oni.envs.tasks import OBSERVATION_KEYS, make_task
from torchrl_oni.run_folder import CAPTION_STORE_NAME
from torchrl_oni.store import HUMAN, CaptionStore
from torchrl_oni.train.build import build_intrinsic_hook
from torchrl_oni.train.cli import main
from torchrl_oni.train.config import TrainConfig
from torchrl_oni.train.intrinsic import IntrinsicRewardHook
from torchrl_oni.train.run_log import read_metrics

torch.set_num_threads(1)
pytestmark = pytest.mark.timeout(300)

def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _call(port, path, body=None, timeout=20):
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} if body is not None else {}
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, headers=headers)
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def _provenance(store, caption_hash):
    slot = int(store.slots([caption_hash])[0])
    pid = int(store.caption_rows([slot], ["provenance"])["provenance"][0])
    return store.provenances[pid]


# ------------------------------------------------------------------------------------ the env's screens
def test_screens_are_off_by_default_and_show_each_games_terminal_when_on():
    plain = NLEBatchEnv("score", num_envs=2, seed=3)
    assert not set(SCREEN_KEYS) & set(plain.observation_spec.keys()) and "tty_chars" not in plain.reset().keys()
    plain.close()
    K, steps = 2, 45
    env = NLEBatchEnv("score", num_envs=K, seed=3, task_kwargs={"max_episode_steps": 20}, screens=True)
    games = [make_task("score", max_episode_steps=20, observation_keys=OBSERVATION_KEYS + SCREEN_KEYS)
             for _ in range(K)]
    for i, g in enumerate(games):
        g.reset(seed=3 * 1_000_003 + i)
    chars_at, colors_at = (games[0]._observation_keys.index(k) for k in SCREEN_KEYS)
    td = env.reset()
    assert td["tty_chars"].shape == (K, 24, 80) and td["tty_colors"].dtype == torch.int8
    # NetHack writes the message on the terminal's top line
    top = bytes(td["tty_chars"][0, 0].tolist()).decode("latin-1").rstrip()
    assert top == decode_message(td["message"][0])
    actions = torch.from_numpy(np.random.default_rng(0).integers(0, env.num_actions, size=(steps, K)))
    previous, resets = None, 0
    for t in range(steps):
        td["action"] = actions[t]
        stepped, td = env.step_and_maybe_reset(td)
        for i, g in enumerate(games):
            _, _, terminated, truncated, _ = g.step(int(actions[t, i]))
            obs = g.last_observation
            assert np.array_equal(stepped["next", "tty_chars"][i].numpy(), obs[chars_at])
            assert np.array_equal(stepped["next", "tty_colors"][i].numpy(), obs[colors_at])
            if terminated or truncated:
                g.reset()
                resets += 1
        if previous is not None:  # a stored screen is a fresh array, never NetHack's live buffer
            assert not np.shares_memory(previous.numpy(), stepped["next", "tty_chars"].numpy())
        previous = stepped["next", "tty_chars"]
    assert resets >= 2
    env.close()
    for g in games:
        g.close()


# ------------------------------------------------------------------------------------ the hook, with people
def _rollout(seed=0, games=4, steps=24):
    env = NLEBatchEnv("score", num_envs=games, seed=seed, screens=True)
    try:
        return env.rollout(steps, break_when_any_done=False)
    finally:
        env.close()


def _hook(tmp_path, **settings):
    cfg = TrainConfig(intrinsic_reward="retrieval", annotator="scripted", human_feedback=True, feedback_port=0,
                      logdir=str(tmp_path), frames=4096, **settings).resolved()
    cfg.validate()
    return build_intrinsic_hook(cfg)


def test_a_persons_label_reaches_the_reward_from_the_next_batch(tmp_path):
    from torchrl_oni.feedback.cli import default_screens_path
    from torchrl_oni.feedback.screens import ScreenSnapshots

    batch = _rollout()
    welcome = int(batch["caption_hash"][0, 0])
    text = decode_message(batch["message"][0, 0])
    assert text.startswith("Hello Agent") and ScriptedAnnotator().label(text) == 0.0
    hook = _hook(tmp_path)
    try:
        port = hook.labelling.feedback.port
        out = hook.on_batch(batch.clone())
        assert not {k for k in out.keys(True, True) if "tty" in str(k)}  # PPO never carries the screens
        assert hook.labelling.annotation.wait_idle(20)
        # the rules' labels came after `out` was paid (asynchronously); this batch has all of them
        labelled = hook.on_batch(batch.clone())
        steps = labelled["caption_hash"] == welcome
        assert steps.any() and (labelled["next", "intrinsic_reward"].squeeze(-1)[steps] == 0).all()
        # the screen of every caption new to the store was kept, and the page serves it
        distinct = set(batch["caption_hash"].reshape(-1).tolist())
        assert all(h in hook.labelling.snapshots for h in distinct)
        screen = _call(port, f"/api/screen?id={welcome}")
        assert screen["rows"][0].startswith("Hello Agent") and len(screen["rows"]) == 24
        # a person says "progress" (the rules said not): it replaces the LLM's label at once ...
        queue = _call(port, "/api/queue?kind=captions&limit=100")
        item = next(x for x in queue["items"] if x["id"] == str(welcome))
        assert item["llm"]["label"] == 0.0 and item["screen"] is True
        answer = _call(port, "/api/label", {"id": str(welcome), "answer": "progress"})
        assert answer["given"] == 1 and _provenance(hook.labelling.store, welcome).annotator == HUMAN
        # ... and pays from the next batch: R(m) = 1, count-decayed
        again = hook.on_batch(batch.clone())
        value = again["next", "intrinsic_reward"].squeeze(-1)
        counts = again["msg_count"].double()
        torch.testing.assert_close(value[steps].double(), counts[steps] ** -3.0)
        assert (value[~steps] == labelled["next", "intrinsic_reward"].squeeze(-1)[~steps]).all()
        # a late LLM answer cannot take it back
        assert hook.labelling.store.set_labels([welcome], [0.0], ScriptedAnnotator().provenance).tolist() == [False]
        metrics = hook.metrics()
        assert metrics["human/labels"] == 1 and metrics["human/compared"] == 1 and metrics["human/agreement"] == 0
        assert metrics["human/captions_in_store"] == 1 and metrics["human/page_up"] == 1
    finally:
        hook.close()
    assert not hook.labelling.feedback.running
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()  # the page is gone with the run
    store_path = os.path.join(tmp_path, CAPTION_STORE_NAME)
    saved = CaptionStore.load(store_path)
    assert saved.lookup([welcome])[0].tolist() == [1.0] and _provenance(saved, welcome).annotator == HUMAN
    # the screens are saved where oni-label looks by default
    screens = ScreenSnapshots.load(default_screens_path(__import__("pathlib").Path(store_path)))
    assert screens.text(welcome).startswith("Hello Agent")


def test_a_stuck_or_closed_page_never_stalls_training(tmp_path):
    batch = _rollout(seed=1, steps=16)
    hook = _hook(tmp_path)
    stuck = []
    try:
        hook.on_batch(batch.clone())  # warm-up: the annotation worker starts
        # a browser that sent half a request and hangs, another that went away mid-request
        for partial in (b"GET /api/queue HTTP/1.1\r\nHost: 127.0.0.1\r\n", b"POST /api/label HTTP/1.1\r\n"):
            s = socket.create_connection(("127.0.0.1", hook.labelling.feedback.port), timeout=5)
            s.sendall(partial)
            stuck.append(s)
        stuck.pop().close()
        for _ in range(3):
            start = time.monotonic()
            hook.on_batch(batch.clone())
            assert time.monotonic() - start < 5.0
        hook.labelling.feedback.stop()  # the page is gone (crashed, or stopped): training goes on
        start = time.monotonic()
        out = hook.on_batch(batch.clone())
        assert time.monotonic() - start < 5.0 and ("next", "intrinsic_reward") in out.keys(True)
        assert hook.metrics()["human/page_up"] == 0
    finally:
        start = time.monotonic()
        hook.close()
        for s in stuck:
            s.close()
    assert time.monotonic() - start < 20.0
    assert os.path.exists(os.path.join(tmp_path, CAPTION_STORE_NAME))


def test_a_person_labels_with_the_keyboard_during_training(tmp_path, browser):
    from selenium.webdriver.common.by import By

    batch = _rollout(seed=2, steps=12)
    hook = _hook(tmp_path)
    driver = browser
    try:
        hook.on_batch(batch.clone())
        assert hook.labelling.annotation.wait_idle(20)
        driver.get(hook.labelling.feedback.url)
        wait_for(lambda: driver.execute_script("return document.body.dataset.ready === '1'"))
        wait_for(lambda: page_ready(driver))
        shown = driver.find_element(By.ID, "message").text
        caption = int(hash_messages(encode_messages([shown]))[0])
        assert wait_for(lambda: driver.find_element(By.ID, "screen").text).splitlines()  # its game screen
        press(driver, "p")
        wait_for(lambda: driver.find_element(By.ID, "counter").text == "1 label given")
        assert hook.labelling.store.lookup([caption])[0].tolist() == [1.0]
        assert _provenance(hook.labelling.store, caption) == Provenance(HUMAN, "web", "feedback-v1")
        hook.on_batch(batch.clone())  # training goes on while the page is open
    finally:
        hook.close()


# ------------------------------------------------------------------------------------ RUNE
def _crafted_batch(texts, counts):
    msgs = torch.from_numpy(encode_messages(texts))
    n = len(texts)
    return TensorDict({"message": msgs, "caption_hash": torch.from_numpy(hash_messages(msgs)),
                       "msg_count": torch.tensor(counts),
                       "next": {"reward": torch.zeros(n, 1), "message": msgs,
                                "caption_hash": torch.from_numpy(hash_messages(msgs)),
                                "msg_count": torch.tensor(counts)}}, batch_size=[n])


def test_rune_bonus_joins_the_optimised_reward_and_decays(tmp_path):
    from torchrl_oni.transforms import CombineRewards

    cfg = TrainConfig(intrinsic_reward="classification", annotator="scripted", rm_ensemble=3, rm_rune_beta=0.5,
                      rm_rune_decay=0.1, logdir=str(tmp_path), rm_time_fraction=0.0, rm_steps_per_labels=2,
                      rm_batch_size=16).resolved()
    cfg.validate()
    hook = build_intrinsic_hook(cfg)
    try:
        texts, counts = ["You kill the newt!", "It's a wall.", "You kill the newt!", "12 gold pieces."], [1, 2, 3, 1]
        batch = _crafted_batch(texts, counts)
        out = hook.on_batch(batch.clone())
        members = hook.reward.member_probabilities(batch["message"]).double()
        std = members.std(-1, unbiased=False)
        decay = torch.tensor(counts, dtype=torch.float64) ** -3.0
        ens_reward = (members.mean(-1) > 0.5).double() * decay
        expected = ens_reward + 0.5 * std * decay
        got = out["next", "intrinsic_reward"].squeeze(-1).double()
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        assert (std > 0).all()  # three differently initialised members disagree
        # the reward PPO optimises: int_coeff · (R + bonus)
        mixed = CombineRewards(extrinsic_coeff=0.0, intrinsic_coeff=2.0)(out.clone())["next", "reward"].squeeze(-1)
        torch.testing.assert_close(mixed.double(), 2.0 * expected, rtol=1e-5, atol=1e-6)
        metrics = hook.metrics()
        assert metrics["intrinsic/rune_beta"] == pytest.approx(0.5)
        assert metrics["intrinsic/rune_bonus"] == pytest.approx(float((0.5 * std * decay).mean()), rel=1e-5)
        assert "intrinsic/mean" in metrics and metrics["intrinsic/mean"] == pytest.approx(float(ens_reward.mean()))
        hook.after_update()
        hook.after_update()
        assert hook.metrics()["intrinsic/rune_beta"] == pytest.approx(0.5 * 0.9 ** 2)
        state = hook.state_dict()
        assert state["rune"]["t"] == 2
    finally:
        hook.close(save=False)
    resumed = build_intrinsic_hook(cfg)
    try:
        resumed.load_state_dict(state)
        assert resumed.after_reward.name == "rune"
        assert resumed.after_reward.reward.beta == pytest.approx(0.5 * 0.9 ** 2)
        probe = resumed.reward.member_probabilities(batch["message"])
        assert torch.equal(probe, hook.reward.member_probabilities(batch["message"]))  # same members back
    finally:
        resumed.close(save=False)


# ------------------------------------------------------------------------------------ the registry
def test_ranking_ensemble_queues_the_most_disputed_pairs_within_the_budget(tmp_path):
    from torchrl_oni.rewards.ensemble import EnsembleRankingTrainer, RankingEnsemble
    from torchrl_oni.rewards.ranking import PairQueue

    cfg = TrainConfig(intrinsic_reward="ranking", annotator="scripted", rm_ensemble=2, query_selection="disagree",
                      label_budget=50_000, ranking_pairs=4, logdir=str(tmp_path)).resolved()
    cfg.validate()
    hook = build_intrinsic_hook(cfg)
    try:
        assert isinstance(hook.reward, RankingEnsemble) and len(hook.reward.members) == 2
        assert isinstance(hook.rm_trainer, EnsembleRankingTrainer)
        queue = hook.parts.on_batch
        assert isinstance(queue, PairQueue) and queue.rule == "disagree" and queue.budget is not None
        drawn = []
        real = queue.sampler.sample_pairs

        def recording(n):
            out = real(n)
            drawn.append(out)
            return out

        queue.sampler.sample_pairs = recording
        texts = [f"You see here {i} gold pieces." for i in range(15)] + ["You kill the newt!", "It's a wall."]
        batch = _crafted_batch(texts, [1] * len(texts))  # 17 frames: 0.05 pair per frame -> 0 allowed
        hook.on_batch(batch.clone())
        assert hook.labelling.store.num_pairs == 0 and not drawn
        big = _crafted_batch(texts * 4, [1] * (4 * len(texts)))  # 85 frames: 4 pairs allowed
        hook.on_batch(big)
        first, second, h1, h2 = drawn[-1]
        assert len(h1) == 10 * 4  # 10 candidates per pair queued
        probs = hook.reward.pair_probabilities(torch.from_numpy(first), torch.from_numpy(second)).double()
        spread = probs.std(-1, unbiased=False).numpy()
        top = np.argsort(-spread, kind="stable")[:4]
        rows = hook.labelling.store.pair_rows(torch.arange(hook.labelling.store.num_pairs))
        queued = set(zip(rows["caption_hash_a"].tolist(), rows["caption_hash_b"].tolist()))
        assert queued == set(zip(h1[top].tolist(), h2[top].tolist()))
        assert queue.budget.spent == hook.labelling.store.num_pairs <= 4
        metrics = hook.metrics()
        assert metrics["annotation/pairs_queued_total"] == hook.labelling.store.num_pairs
        assert metrics["annotation/budget_spent"] == hook.labelling.store.num_pairs
        assert "pair_queue" in hook.state_dict() and "sampler" in hook.state_dict()
    finally:
        hook.close(save=False)


def test_teacher_annotator_from_the_configuration(tmp_path):
    from torchrl_oni.annotators import SimulatedTeacher
    from torchrl_oni.train.labelling import make_annotator

    cfg = TrainConfig(intrinsic_reward="retrieval", annotator="teacher", teacher_beta=2.0, teacher_epsilon=0.1,
                      goal="gold", seed=5)
    cfg.validate()
    teacher, server = make_annotator(cfg.annotation, seed=cfg.seed)
    assert isinstance(teacher, SimulatedTeacher) and server is None
    assert (teacher.beta, teacher.epsilon, teacher.seed, teacher.rules.goal) == (2.0, 0.1, 5, "gold")
    rational, _ = make_annotator(TrainConfig(intrinsic_reward="retrieval", annotator="teacher").annotation)
    assert rational.beta == float("inf") and rational.epsilon == 0.0


@pytest.mark.parametrize("flags,words", [
    (["--intrinsic-reward", "retrieval", "--rm-ensemble", "3"], "--rm-ensemble needs"),
    (["--intrinsic-reward", "classification", "--query-selection", "disagree"], "needs an ensemble"),
    (["--intrinsic-reward", "retrieval", "--query-selection", "entropy"], "needs a reward model"),
    (["--intrinsic-reward", "ranking", "--rm-surf-tau", "0.99"], "SURF"),
    (["--intrinsic-reward", "classification", "--rm-surf-tau", "0.3"], "--rm-surf-tau must be in"),
    (["--intrinsic-reward", "classification", "--rm-ensemble", "2", "--rm-rune-decay", "1"], "--rm-rune-decay"),
    (["--intrinsic-reward", "classification", "--rm-rune-beta", "0.1"], "RUNE"),
    (["--intrinsic-reward", "bow", "--human-feedback"], "--human-feedback needs"),
    (["--human-feedback"], "--human-feedback needs"),
    (["--intrinsic-reward", "retrieval", "--label-budget", "-1"], "--label-budget must be"),
    (["--intrinsic-reward", "retrieval", "--label-schedule", "linear"], "needs a --label-budget"),
    (["--intrinsic-reward", "retrieval", "--query-selection", "loudest"], "invalid choice"),
    (["--intrinsic-reward", "retrieval", "--teacher-epsilon", "0.1"], "need --annotator teacher"),
    (["--intrinsic-reward", "retrieval", "--annotator", "teacher", "--teacher-beta", "0"], "--teacher-beta"),
    (["--intrinsic-reward", "retrieval", "--human-feedback", "--feedback-port", "70000"], "--feedback-port"),
])
def test_bad_label_settings_are_one_line_exit_2(tmp_path, capsys, flags, words):
    with pytest.raises(SystemExit) as stop:
        main([*TINY, "--logdir", str(tmp_path / "run"), *flags])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and err.startswith("oni-train: error: ") and words in err, err


def test_feedback_port_in_use_is_one_line_exit_2(tmp_path, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(SystemExit) as stop:
            main([*TINY, "--logdir", str(tmp_path / "run"), "--intrinsic-reward", "retrieval", "--annotator",
                  "scripted", "--human-feedback", "--feedback-port", str(port)])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and err.startswith("oni-train: error: "), err
    assert not os.path.exists(tmp_path / "run" / CAPTION_STORE_NAME)


# ------------------------------------------------------------------------------------ whole runs
def test_tiny_run_with_an_ensemble_disagreement_rune_and_a_budget(tmp_path):
    logdir = str(tmp_path / "run")
    budget = 20_000  # labels per million frames: at most 20 for 1,024 frames
    code = main([*TINY, "--logdir", logdir, "--intrinsic-reward", "classification", "--annotator", "scripted",
                 "--rm-ensemble", "3", "--query-selection", "disagree", "--label-budget", str(budget),
                 "--rm-rune-beta", "0.05", "--rm-steps-per-labels", "4", "--rm-batch-size", "32",
                 "--rm-time-fraction", "0"])
    assert code == 0
    rows = read_metrics(logdir)
    last = rows[-1]
    store = CaptionStore.load(os.path.join(logdir, CAPTION_STORE_NAME))
    stats = store.stats()
    assert 0 < stats["labelled"] <= budget * last["frames"] / 1e6 < stats["size"]
    assert last["annotation/budget_spent"] == stats["labelled"]
    assert max(r.get("reward_model/steps", 0) for r in rows) >= 4
    assert "intrinsic/rune_bonus" in last and last["intrinsic/rune_beta"] < 0.05
    state = torch.load(os.path.join(logdir, "checkpoint.pt"), weights_only=False)["hooks"][0]
    assert len(state["reward"]["members"]) == 3 and state["claim"]["spent"] == stats["labelled"]
    assert state["rune"]["t"] == last["iteration"]


def test_human_feedback_during_an_oni_train_run(tmp_path, monkeypatch):
    """oni-train --human-feedback: a person labels through the page while the run trains; the run
    ends normally and the saved store holds the person's label."""
    logdir = str(tmp_path / "run")
    port = _free_port()
    labelled = threading.Event()
    real_after_update = IntrinsicRewardHook.after_update

    def after_update(self, trainer=None):
        # the first iteration waits (a bounded time) for the person, so the label lands mid-run
        labelled.wait(60)
        return real_after_update(self, trainer)

    monkeypatch.setattr(IntrinsicRewardHook, "after_update", after_update)
    seen = {}

    def person():
        try:
            queue = wait_for(lambda: _queue_items(port), timeout=120)
            seen["id"] = queue[0]["id"]
            seen["answer"] = _call(port, "/api/label", {"id": queue[0]["id"], "answer": "progress"})
        finally:
            labelled.set()

    helper = threading.Thread(target=person, daemon=True)
    helper.start()
    code = main([*TINY, "--logdir", logdir, "--intrinsic-reward", "retrieval", "--annotator", "scripted",
                 "--human-feedback", "--feedback-port", str(port)])
    helper.join(30)
    assert code == 0 and seen["answer"]["ok"] and seen["answer"]["given"] == 1
    store = CaptionStore.load(os.path.join(logdir, CAPTION_STORE_NAME))
    caption = int(seen["id"])
    assert store.lookup([caption])[0].tolist() == [1.0] and _provenance(store, caption).annotator == HUMAN
    assert read_metrics(logdir)[-1]["human/labels"] == 1
    assert os.path.exists(os.path.join(logdir, "captions.screens.pt"))
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


def _queue_items(port):
    try:
        return _call(port, "/api/queue?kind=captions&limit=5", timeout=5)["items"]
    except (urllib.error.URLError, ConnectionError, socket.timeout):
        return None  # not up yet
