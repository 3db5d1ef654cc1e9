"""oni-train --intrinsic-reward X end to end on CPU: labels land, rewards are logged, errors are one line."""
import os
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch

from helpers import TINY
from torchrl_oni.run_folder import CAPTION_STORE_NAME, TOP_MESSAGES_NAME
from torchrl_oni.store import CaptionStore
from torchrl_oni.train.build import build_intrinsic_hook
from torchrl_oni.train.cli import main
from torchrl_oni.train.config import TrainConfig
from torchrl_oni.train.run_log import read_metrics

torch.set_num_threads(1)


def _run(tmp_path, *flags):
    logdir = str(tmp_path / "run")
    assert main([*TINY, "--logdir", logdir, *flags]) == 0
    return _ran(logdir)


def _ran(logdir):
    """The metrics rows of a finished run, its intrinsic reward logged and its top messages written."""
    rows = read_metrics(logdir)
    assert rows and rows[-1]["frames"] >= 1024
    assert "reward/intrinsic_mean" in rows[-1] and "intrinsic/rewarded_fraction" in rows[-1]
    top = os.path.join(logdir, TOP_MESSAGES_NAME)
    assert os.path.isfile(top) and open(top).readline().startswith("# top rewarded messages")
    return logdir, rows


def _labelled_store(logdir):
    store = CaptionStore.load(os.path.join(logdir, CAPTION_STORE_NAME))
    stats = store.stats()
    assert stats["size"] > 0
    return store, stats


def test_retrieval_scripted_labels_land_and_pay(retrieval_run):
    # the run of `_run(tmp_path, "--intrinsic-reward", "retrieval", "--annotator", "scripted", "--frames", "2048")`
    logdir, rows = _ran(str(retrieval_run))
    store, stats = _labelled_store(logdir)
    assert stats["labelled"] == stats["size"]  # the scripted annotator never fails
    assert 0 < stats["positives"] < stats["labelled"]
    assert rows[-1]["labels/labelled"] > 0 and "annotation/labels_per_s" in rows[-1]
    assert 0 <= rows[-1]["labels/positive_fraction"] <= 1
    # whatever was paid came from labelled-helpful captions only
    lines = [l for l in open(os.path.join(logdir, TOP_MESSAGES_NAME)) if not l.startswith("#")]
    for line in lines:
        assert float(line.split("\t")[2]) == 1.0


def test_top_messages_is_rewritten_every_few_seconds_and_at_the_end(tmp_path):
    """top_messages.txt is for a person: rewritten at the first metrics row, then at most every
    TOP_MESSAGES_EVERY_S seconds, and by the run's last row (after close) whatever the clock."""
    from torchrl_oni.train import intrinsic

    hook = build_intrinsic_hook(TrainConfig(intrinsic_reward="retrieval", annotator="scripted",
                                            logdir=str(tmp_path), progress=False, tensorboard=False).resolved())
    written, now = [], [1000.0]
    hook._clock = lambda: now[0]
    hook._window.write_top = lambda path, kind: written.append(now[0])
    try:
        for dt in (0.0, 1.0, 3.0, intrinsic.TOP_MESSAGES_EVERY_S, 1.0):
            now[0] += dt
            hook.metrics()
    finally:
        hook.close()
    assert written == [1000.0, 1000.0 + 4.0 + intrinsic.TOP_MESSAGES_EVERY_S]
    hook.metrics()  # the run's last row
    assert len(written) == 3


def test_classification_trains_reward_model_between_iterations(tmp_path):
    logdir, rows = _run(tmp_path, "--intrinsic-reward", "classification", "--annotator", "scripted",
                        "--rm-steps-per-labels", "4", "--rm-batch-size", "32",
                        "--rm-time-fraction", "0")
    _, stats = _labelled_store(logdir)
    assert stats["labelled"] > 0
    assert max(r.get("reward_model/steps", 0) for r in rows) >= 4
    assert any("reward_model/heldout_accuracy" in r or "reward_model/train_accuracy" in r for r in rows)


@pytest.mark.slow
def test_ranking_pairs_are_annotated(tmp_path):
    logdir, rows = _run(tmp_path, "--intrinsic-reward", "ranking", "--annotator", "scripted",
                        "--rm-steps-per-labels", "4", "--rm-batch-size", "32", "--frames", "2048",
                        "--rm-time-fraction", "0")
    store, stats = _labelled_store(logdir)
    assert stats["pairs_labelled"] > 0
    assert stats["labelled"] == 0  # ranking asks for preferences, never single labels
    pairs = store.sample_labelled_pairs(16)
    assert bool((pairs["caption_hash_a"] != pairs["caption_hash_b"]).all())
    assert max(r.get("reward_model/steps", 0) for r in rows) >= 4


def test_bow_needs_no_llm(tmp_path):
    logdir, rows = _run(tmp_path, "--intrinsic-reward", "bow", "--bow-vectors", "hashed", "--bow-threshold", "0.0")
    assert not os.path.exists(os.path.join(logdir, CAPTION_STORE_NAME))
    assert rows[-1]["reward/intrinsic_mean"] >= 0


@pytest.mark.slow
def test_motif_with_a_reward_model_trained_here(tmp_path):
    from torchrl_oni.captions import encode_messages
    from torchrl_oni.rewards.motif import collect_pairs, train_reward_model
    from torchrl_oni.annotators import ScriptedAnnotator

    texts = ["You kill the newt!", "You see here 5 gold pieces.", "It's a wall.", "Hello Agent, welcome to NetHack!",
             "There is a staircase down here.", "You hear some noises.", "The grid bug bites!", ""]
    first, second = collect_pairs(encode_messages(texts * 8), num_pairs=64, seed=0)
    rules = ScriptedAnnotator()
    from torchrl_oni.captions import decode_messages

    prefs = np.array([rules.preference(a, b) for a, b in zip(decode_messages(first), decode_messages(second))],
                     dtype=np.float32)
    ckpt = tmp_path / "motif.pt"
    train_reward_model(first, second, prefs, ckpt, epochs=2, batch_size=32, lr=1e-3)
    logdir, rows = _run(tmp_path, "--intrinsic-reward", "motif", "--reward-model", str(ckpt))
    assert rows[-1]["reward/intrinsic_nonzero"] >= 0


@pytest.mark.slow
def test_retrieval_with_the_embedded_smollm2_server(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    from torchrl_oni.serve.models import TEST_MODEL, is_installed

    if not is_installed(TEST_MODEL):
        pytest.skip("the SmolLM2 model package is not installed")
    logdir, rows = _run(tmp_path, "--intrinsic-reward", "retrieval", "--llm-model", TEST_MODEL,
                        "--llm-batch-size", "32")
    store, stats = _labelled_store(logdir)
    assert stats["labelled"] > 0, stats  # the worker drains its in-flight batch at exit
    assert {(p.annotator, p.model) for p in store.provenances} == {("openai", TEST_MODEL)}


@pytest.mark.slow
@pytest.mark.parametrize("reward", ["classification", "ranking"])
def test_reward_models_with_the_embedded_smollm2_server(tmp_path, reward):
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    from torchrl_oni.serve.models import TEST_MODEL, is_installed

    if not is_installed(TEST_MODEL):
        pytest.skip("the SmolLM2 model package is not installed")
    logdir, rows = _run(tmp_path, "--intrinsic-reward", reward, "--llm-model", TEST_MODEL,
                        "--llm-batch-size", "16", "--frames", "2048", "--rm-steps-per-labels", "2",
                        "--rm-batch-size", "16", "--rm-time-fraction", "0")
    store, stats = _labelled_store(logdir)
    key = "labelled" if reward == "classification" else "pairs_labelled"
    assert stats[key] > 0, stats  # the CPU model's answers landed in the store
    assert "intrinsic/mean" in rows[-1]
    # (reward-model training on ONI's schedule is checked with the fast scripted annotator above;
    # here the small CPU model may answer only as the run ends)


def test_caption_store_is_reused_so_labels_are_not_paid_twice(tmp_path, labels_source):
    # the first run: labels_source's `--caption-store PATH` run; its store copied here (the second run
    # writes into the store it reuses, and the fixture's is read by other tests, never written)
    _, first_store = labels_source
    store_path = str(tmp_path / "shared_captions.pt")
    shutil.copyfile(first_store, store_path)
    before = CaptionStore.load(store_path).stats()["labelled"]
    assert before > 0
    # a second run (same seed, so the same opening messages) starts from the saved labels
    tmp2 = tmp_path / "second"
    tmp2.mkdir()
    logdir, rows = _run(tmp2, "--intrinsic-reward", "retrieval", "--annotator", "scripted",
                        "--caption-store", store_path)
    after = CaptionStore.load(store_path).stats()["labelled"]
    assert after >= before
    assert rows[-1]["annotation/labels_total"] < after  # some labels were not asked for again


@pytest.fixture(scope="module")
def labels_source(tmp_path_factory):
    """``(run folder, caption store)`` of one tiny retrieval run labelled by the scripted rules whose
    store lives elsewhere (``--caption-store PATH``): the labels the next test carries to another
    run, and the first run of the test above, whose second run reuses them (read, never written)."""
    folder = tmp_path_factory.mktemp("source")
    store_path = str(folder / "shared_captions.pt")
    source_dir, _ = _run(folder / "a", "--intrinsic-reward", "retrieval", "--annotator", "scripted",
                         "--caption-store", store_path)
    assert os.path.isfile(store_path)  # the store went where --caption-store said
    return source_dir, store_path


@pytest.mark.parametrize("carried_as", ["caption store", "labels file"])
def test_a_run_on_stored_labels_pays_only_for_what_they_cover(tmp_path, carried_as, labels_source):
    from torchrl_oni.captions import encode_messages, hash_messages
    from torchrl_oni.store import LABELLED, SKIPPED
    from torchrl_oni.store.labels_file import load_labels, write_labels

    _, source_path = labels_source
    if carried_as == "labels file":  # the labels alone, as the sparse-task experiment carries them
        write_labels(CaptionStore.load(source_path), tmp_path / "labels.jsonl.gz")
        source_path = str(tmp_path / "labels.jsonl.gz")
    source_bytes = open(source_path, "rb").read()
    source = load_labels(source_path)
    # another seed: other games, so some captions the source never saw
    logdir, rows = _run(tmp_path / "b", "--intrinsic-reward", "retrieval", "--annotator", "store",
                        "--labels-from", source_path, "--seed", "7")
    assert open(source_path, "rb").read() == source_bytes  # the source is read, never written
    store = CaptionStore.load(os.path.join(logdir, CAPTION_STORE_NAME))
    rows_here = store.caption_rows(store.caption_slots())
    hashes, status, seen = rows_here["caption_hash"], rows_here["status"], rows_here["times_seen"]
    source_labels, source_found = source.lookup(hashes)
    labelled = status == LABELLED
    assert torch.equal(labelled, source_found)  # labelled here exactly where the source labels
    assert torch.equal(store.lookup(hashes)[0][labelled], source_labels[labelled])
    assert {p.annotator for p in store.provenances if p.annotator != "store"} == {"scripted"}
    new_and_seen = (~source_found) & (seen > 0)
    assert new_and_seen.any(), "the second run saw no caption of its own: the test proves nothing"
    assert bool((status[new_and_seen] == SKIPPED).all())  # asked once, declined, never paid
    assert rows[-1]["labels/skipped"] == int(new_and_seen.sum())
    assert rows[-1]["labels/seen_captions"] == int((seen > 0).sum()) < rows[-1]["labels/captions"]
    assert rows[-1]["annotation/labels_total"] == 0
    # whatever was paid, the source approved (1,024 frames may meet none of its few approved captions)
    paid = [l.rstrip("\n").split("\t")[3] for l in open(os.path.join(logdir, TOP_MESSAGES_NAME))
            if not l.startswith("#")]
    if paid:
        labels, found = source.lookup(hash_messages(encode_messages(paid)))
        assert bool(found.all()) and labels.tolist() == [1.0] * len(paid)


def _dead_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_dead_llm_url_is_one_error_line_and_exit_2(tmp_path):
    url = f"http://127.0.0.1:{_dead_port()}/v1"
    proc = subprocess.run(
        [sys.executable, "-m", "torchrl_oni.train", "--intrinsic-reward", "retrieval", "--llm-url", url,
         "--llm-model", "m", "--logdir", str(tmp_path / "run"), *TINY],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("oni-train: error:") and "reach" in lines[0], proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not os.path.exists(tmp_path / "run" / CAPTION_STORE_NAME)


@pytest.mark.parametrize("flags, words", [
    (["--intrinsic-reward", "motif"], "--reward-model"),
    (["--intrinsic-reward", "motif", "--reward-model", "/nonexistent/motif.pt"], "no reward checkpoint"),
    (["--intrinsic-reward", "retrieval", "--llm-url", "http://127.0.0.1:1/v1"], "cannot reach"),
    (["--intrinsic-reward", "bow", "--goal", "zero-knowledge"], "goal"),
    (["--count-scope", "run"], "--count-scope run changes the intrinsic reward's decay: it needs an --intrinsic"),
    (["--intrinsic-reward", "ellm", "--annotator", "scripted", "--count-scope", "run"], "--ellm-count-exponent"),
    (["--intrinsic-reward", "retrieval", "--annotator", "store"], "--annotator store makes no labels of its own"),
    (["--intrinsic-reward", "retrieval", "--annotator", "store", "--labels-from", "/nonexistent/captions.pt"],
     "--labels-from: no caption store at /nonexistent/captions.pt"),
    (["--intrinsic-reward", "retrieval", "--annotator", "store", "--labels-from", "/nonexistent/l.jsonl.gz"],
     "--labels-from: no labels file at /nonexistent/l.jsonl.gz"),
    (["--labels-from", "/nonexistent/captions.pt"], "--labels-from needs an --intrinsic-reward labelled"),
    (["--intrinsic-reward", "ranking", "--annotator", "store", "--labels-from", "x.pt"],
     "learns from caption pairs and --labels-from carries caption labels, not preferences"),
    (["--intrinsic-reward", "ranking", "--labels-from", "x.pt"], "--labels-from carries caption labels"),
    (["--check-judge", "--intrinsic-reward", "retrieval", "--annotator", "store", "--labels-from", "x.pt"],
     "--annotator store answers nothing"),
])
def test_bad_intrinsic_settings_exit_2(tmp_path, capsys, flags, words):
    with pytest.raises(SystemExit) as err:
        main([*TINY, "--logdir", str(tmp_path / "run"), *flags])
    assert err.value.code == 2
    message = capsys.readouterr().err.strip()
    assert message.count("\n") == 0 and words in message


def test_reward_model_time_budget_spreads_owed_steps():
    from torchrl_oni.rewards.training import RewardModelSchedule

    uncapped = RewardModelSchedule(32, switch_at=1000, time_fraction=0.0)
    assert uncapped.due(10) == 32 and uncapped.due(10) == 0  # ONI: every step at once, on new labels only
    now = [0.0]
    budget = RewardModelSchedule(32, switch_at=1000, time_fraction=0.5, max_owed=64, clock=lambda: now[0])
    assert budget.due(10) == 1  # first, measure what a step costs
    budget.spent(1, 0.01)
    # 0.14 s went by, 0.01 s of it reward-model training: half of the other 0.13 s is credit,
    # less the 0.01 s the measured step already took -> 0.055 s = 5 steps of 10 ms
    now[0] += 0.14
    n = budget.due(10)  # no new labels: nothing added to what is owed
    assert n == 5 and budget.owed == 31
    budget.spent(n, 0.05)
    assert budget.owed == 26
    assert budget.due(11) == 0 and budget.owed == 58  # new labels owe 32 more; no credit left
    assert budget.due(12) == 0 and budget.owed == 64  # debt is capped

def test_low_label_coverage_is_said_loudly(tmp_path):
    """A run whose intrinsic reward gets no labels warns once a minute with the cause, and its
    summary says so (the issue: 0 of 2,739 captions labelled and one easily missed line)."""
    from torchrl_oni.train import TrainConfig
    from torchrl_oni.train.labelling import ALERT_EVERY_S, COVERAGE_GRACE_S

    hook = build_intrinsic_hook(TrainConfig(intrinsic_reward="retrieval", annotator="scripted",
                                            logdir=str(tmp_path)).resolved())
    try:
        starving = {"labels/seen_coverage": 0.0, "labels/labelled": 0, "labels/captions": 120}
        assert hook.alert(starving) is None  # the LLM gets a minute before anyone is warned
        hook.labelling.started -= COVERAGE_GRACE_S + 1
        hook.labelling.last_alert -= ALERT_EVERY_S + 1
        line = hook.alert(starving)
        assert line and "0.0% of steps" in line and "annotation:" in line
        assert hook.alert(starving) is None  # at most once a minute
        hook.labelling.last_alert -= ALERT_EVERY_S + 1
        assert hook.alert({"labels/seen_coverage": 0.8}) is None  # labels arrive: nothing to say
        (final,) = hook.final_warnings(starving)
        assert "ONI barely ran: 0 of 120 captions" in final
        assert hook.final_warnings({"labels/seen_coverage": 0.97}) == []
    finally:
        hook.close(save=False)
    budgeted = TrainConfig(intrinsic_reward="retrieval", annotator="scripted", label_budget=600,
                           logdir=str(tmp_path / "budget"))
    hook = build_intrinsic_hook(budgeted.resolved())
    try:  # few labels under a budget is what was asked for: said plainly, not as a failure
        (final,) = hook.final_warnings({"labels/seen_coverage": 0.2, "labels/labelled": 30, "labels/captions": 150})
        assert final.startswith("label budget: 30 of 150 captions") and "barely" not in final
    finally:
        hook.close(save=False)


def test_an_untrained_reward_model_is_said_loudly(tmp_path):
    """A classification run whose model took a handful of steps (a short CPU run under the time
    cap) pays noise: the summary must say so, and stay quiet once the model has learned."""
    from torchrl_oni.train import TrainConfig
    from torchrl_oni.train.intrinsic import MIN_REWARD_MODEL_STEPS

    hook = build_intrinsic_hook(TrainConfig(intrinsic_reward="classification", annotator="scripted",
                                            logdir=str(tmp_path)).resolved())
    try:
        covered = {"labels/seen_coverage": 1.0, "labels/labelled": 500, "labels/captions": 500}
        (line,) = hook.final_warnings({**covered, "reward_model/steps": 11,
                                       "reward_model/heldout_balanced_accuracy": 0.5})
        assert "classification reward model trained only 11 steps" in line and "0.50" in line
        (line,) = hook.final_warnings({**covered, "reward_model/steps": MIN_REWARD_MODEL_STEPS * 5,
                                       "reward_model/heldout_balanced_accuracy": 0.52})
        assert "close to noise" in line  # many steps, still at chance
        assert hook.final_warnings({**covered, "reward_model/steps": MIN_REWARD_MODEL_STEPS,
                                    "reward_model/heldout_balanced_accuracy": 0.8}) == []
        assert hook.final_warnings({**covered, "reward_model/steps": MIN_REWARD_MODEL_STEPS,
                                    "reward_model/heldout_balanced_accuracy": float("nan")}) == []
    finally:
        hook.close(save=False)


def test_the_summary_prints_the_warning(capsys):
    from torchrl_oni.train.cli import _print_summary
    from torchrl_oni.train import TrainConfig

    _print_summary(TrainConfig(), {"frames": 10.0, "warnings": ["ONI barely ran: 0 of 5 captions labelled"]})
    out = capsys.readouterr().out
    assert "!! ONI barely ran" in out


def test_goal_conditioned_ellm_policy_sees_goals_at_acting_time(tmp_path):
    """--ellm-goal-conditioned: env workers write goal_embedding (from the goals the trainer's table
    learned), the policy reads it, and the collected batches carry non-zero embeddings."""
    from torchrl_oni.train import TrainConfig, Trainer

    cfg = TrainConfig(intrinsic_reward="ellm", annotator="scripted", ellm_goal_conditioned=True, ellm_encoder="hashed",
                      frames=4096, workers=1, envs_per_worker=8, rollout=32, minibatch_size=256,
                      logdir=str(tmp_path), progress=False, tensorboard=False)
    seen = []

    def record(batch):  # runs before the hooks: what the workers wrote while acting
        seen.append(float(batch.get("goal_embedding").abs().sum(-1).gt(0).float().mean()))
        return batch

    trainer = Trainer.from_config(cfg, batch_transforms=[record])
    assert "goal_embedding" in trainer.actor.in_keys
    trainer.train()
    assert len(seen) == 16 and seen[0] == 0.0, seen  # no goals known before the first batch
    assert max(seen[1:]) > 0.2, seen  # later batches: the workers read the trainer's goals


@pytest.mark.parametrize("flags,keys", [
    (dict(intrinsic_reward="retrieval", annotator="scripted", label_budget=1000.0),
     ["kind", "store_path", "transform", "claim", "hacking"]),
    (dict(intrinsic_reward="classification", annotator="scripted", rm_ensemble=2, rm_rune_beta=0.5,
          query_selection="disagree"),
     ["kind", "store_path", "transform", "reward", "rm_trainer", "rm_schedule", "claim", "rune", "hacking"]),
    (dict(intrinsic_reward="ranking", annotator="scripted", rm_ensemble=2),
     ["kind", "store_path", "transform", "sampler", "pair_queue", "reward", "rm_trainer", "rm_schedule",
      "hacking"]),
    (dict(intrinsic_reward="bow"), ["kind", "store_path", "transform", "hacking"]),
])
def test_checkpoint_state_keys_stay_and_load_back(tmp_path, flags, keys):
    """The hook's state_dict keys are part of the checkpoint format: old checkpoints must load
    (``hacking``, the reward-hacking diagnostics' counts, came later: a checkpoint without it loads)."""
    cfg = TrainConfig(logdir=str(tmp_path), **flags).resolved()
    cfg.validate()
    hook = build_intrinsic_hook(cfg)
    try:
        state = hook.state_dict()
        assert list(state) == keys
    finally:
        hook.close(save=False)
    again = build_intrinsic_hook(cfg)
    try:
        again.load_state_dict({k: v for k, v in state.items() if k != "hacking"})  # an older checkpoint
        again.load_state_dict(state)
        assert list(again.state_dict()) == keys
    finally:
        again.close(save=False)


def test_background_reward_model_training_never_holds_the_update(tmp_path):
    """--rm-training background: after_update returns while the reward model's round still runs
    in its own thread; a checkpoint waits for that round to end; auto keeps CPU learners inline."""
    import threading
    import time

    cfg = TrainConfig(logdir=str(tmp_path), intrinsic_reward="classification", annotator="scripted").resolved()
    cfg.validate()
    inline = build_intrinsic_hook(cfg)  # --rm-training auto on a CPU learner
    try:
        assert inline.rm_rounds is None
    finally:
        inline.close(save=False)

    cfg = TrainConfig(logdir=str(tmp_path), intrinsic_reward="classification", annotator="scripted",
                      rm_training="background").resolved()
    cfg.validate()
    hook = build_intrinsic_hook(cfg)
    release, events = threading.Event(), []

    def slow_round():
        events.append(("round", threading.current_thread().name))
        assert release.wait(10)
        events.append(("round done", None))
        return {"steps": 3, "loss": 0.5}

    hook.rm_trainer.after_iteration = slow_round
    try:
        start = time.monotonic()
        hook.after_update()
        assert time.monotonic() - start < 1.0
        deadline = time.monotonic() + 5
        while not events and time.monotonic() < deadline:
            time.sleep(0.01)
        assert events == [("round", "reward-model training")]
        threading.Timer(0.3, release.set).start()
        state = hook.state_dict()  # waits for the round: never a model half way through a step
        assert events[-1] == ("round done", None) and "rm_trainer" in state
        # a copy: the thread's later steps change the live weights in place, never the state being saved
        saved, live = state["rm_trainer"]["model"], hook.rm_trainer.model.state_dict()
        assert all(saved[k].data_ptr() != live[k].data_ptr() and torch.equal(saved[k], live[k]) for k in live)
        assert hook.rm_last == {"steps": 3, "loss": 0.5}
        hook.after_update()
        hook.after_update()
        assert hook.rm_rounds.wait_idle(10)
        assert "reward_model/rounds_merged" in hook.metrics()
    finally:
        release.set()
        hook.close(save=False)
    assert not hook.rm_rounds._thread.is_alive()


def test_classification_trains_in_the_background_end_to_end(tmp_path):
    logdir, rows = _run(tmp_path, "--intrinsic-reward", "classification", "--annotator", "scripted",
                        "--rm-steps-per-labels", "4", "--rm-batch-size", "32", "--rm-time-fraction", "0",
                        "--rm-training", "background")
    assert max(r.get("reward_model/steps", 0) for r in rows) >= 4
    assert "reward_model/rounds_merged" in rows[-1]
    assert any("reward_model/heldout_accuracy" in r or "reward_model/train_accuracy" in r for r in rows)


def test_run_message_counts_match_a_loop_over_every_sighting():
    from torchrl_oni.rewards.scaling import RunMessageCounts

    rng = np.random.default_rng(0)
    counts, seen = RunMessageCounts(), {}
    for _ in range(5):
        hashes = rng.integers(-4, 5, size=int(rng.integers(0, 40)))  # few captions: many repeats
        expected = []
        for h in hashes.tolist():
            seen[h] = seen.get(h, 0) + 1
            expected.append(seen[h])
        assert counts.count(torch.from_numpy(hashes)).tolist() == expected
    again = RunMessageCounts()
    again.load_state_dict(counts.state_dict())
    assert again.seen == seen and len(again) == len(seen)


def test_count_scope_run_counts_a_batch_in_time_order_and_feeds_the_decay(tmp_path):
    from tensordict import TensorDict

    from torchrl_oni.captions import RUN_COUNT_KEY
    cfg = TrainConfig(logdir=str(tmp_path), intrinsic_reward="retrieval", annotator="scripted",
                      count_scope="run").resolved()
    cfg.validate()
    hook = build_intrinsic_hook(cfg)
    try:
        assert hook.transform.count_key == RUN_COUNT_KEY
        # 2 games x 3 steps: game 0 sees 5, 6, 5; game 1 sees 6, 6, 5
        batch = TensorDict({"caption_hash": torch.tensor([[5, 6, 5], [6, 6, 5]])}, [2, 3])
        hook._write_run_counts(batch)
        assert batch[RUN_COUNT_KEY].tolist() == [[1, 2, 2], [1, 3, 3]]
        hook._write_run_counts(batch)  # the next batch goes on from the run's counts
        assert batch[RUN_COUNT_KEY].tolist() == [[4, 5, 5], [4, 6, 6]]
        assert hook.state_dict()["run_counts"]["counts"].sum() == 12
    finally:
        hook.close(save=False)
    default = TrainConfig(logdir=str(tmp_path / "d"), intrinsic_reward="retrieval", annotator="scripted")
    hook = build_intrinsic_hook(default.resolved())
    try:
        assert hook.run_counts is None and "run_counts" not in hook.state_dict()  # ONI's per-episode count
    finally:
        hook.close(save=False)


def test_count_scope_run_trains_and_counts_every_paying_step(tmp_path):
    from torchrl_oni.train import Trainer

    cfg = TrainConfig(logdir=str(tmp_path), intrinsic_reward="retrieval", annotator="scripted", count_scope="run",
                      frames=1024, workers=1, envs_per_worker=4, rollout=32, minibatch_size=64, progress=False,
                      tensorboard=False)
    trainer = Trainer.from_config(cfg)
    summary = trainer.train()
    [hook] = trainer.hooks
    assert sum(hook.run_counts.seen.values()) == summary["frames"]  # one sighting per step that could pay
    assert max(hook.run_counts.seen.values()) > 4  # counts run across the episodes of 256 steps
