"""Every file the package loads is read without running code, and a bad file is one clear error.

Loaders: checkpoints (train/checkpoint.load_checkpoint), caption stores (CaptionStore.load),
Motif reward checkpoints (MotifReward), Motif's .npz/.npy files (annotations, pairs, messages).
Each gets a crafted pickle whose unpickling would create a marker file, a truncated file and
garbage; and the states the trainer checkpoints must load with ``weights_only=True``.
"""
import io
import os
import pickle

import numpy as np
import pytest
import torch

from torchrl_oni.annotators.base import Provenance
from torchrl_oni.atomic import UnreadableFileError
from torchrl_oni.captions import encode_messages, hash_messages
from torchrl_oni.rewards import (
    ClassificationReward,
    ClassifierTrainer,
    MotifReward,
    RankingReward,
    RankingTrainer,
    RunningMeanStd,
    UniqueCaptionPairSampler,
    train_reward_model,
)
from torchrl_oni.rewards import motif as motif_module
from torchrl_oni.store import CaptionStore
from torchrl_oni.train.checkpoint import TRAINER_KEYS, CheckpointError, load_checkpoint, save_checkpoint
from torchrl_oni.train import motif_cli
from torchrl_oni.train.run_log import EpisodeWindow
from torchrl_oni.transforms import IntrinsicRewardTransform

torch.set_num_threads(1)

TEXTS = ["You kill the newt!", "It's a wall.", "You find a hidden door.", "Never mind.",
         "You see here 3 gold pieces.", "The door opens."]


class Payload:
    """Unpickling this calls ``open(marker, "w")``: the marker file appears if the load runs code."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _one_line(err: BaseException) -> str:
    text = str(err)
    assert "\n" not in text and text.strip(), repr(text)
    return text


def test_the_payload_is_live(tmp_path):
    """Without weights_only the payload does run: the refusals below are real refusals."""
    marker = tmp_path / "ran"
    buffer = io.BytesIO()
    torch.save({"x": Payload(marker)}, buffer)
    buffer.seek(0)
    torch.load(buffer, weights_only=False)["x"].close()
    assert marker.exists()


# ---------------------------------------------------------------------------- torch loaders
def _write_checkpoint(path):
    save_checkpoint({"actor": {"w": torch.ones(64, 64)}, "frames": 1024}, str(path))


def _write_store(path):
    store = CaptionStore(capacity=16)
    msgs = encode_messages(TEXTS)
    store.add(msgs, hash_messages(msgs))
    store.save(path)


def _write_motif(path):
    msgs = encode_messages(TEXTS)
    train_reward_model(msgs[:3], msgs[3:], np.ones(3), path, epochs=1, batch_size=4)


TORCH_LOADERS = {
    "checkpoint": (_write_checkpoint, lambda p: load_checkpoint(str(p)), CheckpointError),
    "caption store": (_write_store, CaptionStore.load, UnreadableFileError),
    "motif reward": (_write_motif, MotifReward, UnreadableFileError),
}


def _crafted_files(tmp_path, marker):
    """Files that run ``open(marker)`` if unpickled: in torch's zip format, as a plain pickle
    (torch's legacy format), hidden in a numpy object array, and inside a valid-looking store."""
    zipped, legacy, in_array, store_like = (tmp_path / n for n in ("zip.pt", "legacy.pt", "array.pt", "store.pt"))
    torch.save({"frames": 1, "actor": {}, "payload": Payload(marker)}, zipped)
    legacy.write_bytes(pickle.dumps({"frames": 1, "payload": Payload(marker)}))
    torch.save({"frames": 1, "sampler": np.array([Payload(marker)], dtype=object)}, in_array)
    torch.save({"format": "torchrl_oni.CaptionStore", "version": 1, "config": Payload(marker)}, store_like)
    return [zipped, legacy, in_array, store_like]


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")  # torch on the plain-pickle file
@pytest.mark.parametrize("kind", list(TORCH_LOADERS))
def test_crafted_pickles_are_refused_before_they_run(tmp_path, kind):
    _, load, error = TORCH_LOADERS[kind]
    marker = tmp_path / "marker"
    for path in _crafted_files(tmp_path, marker):
        with pytest.raises(error) as info:
            load(path)
        assert str(path) in _one_line(info.value) and "refused" in str(info.value)
        assert not marker.exists(), (kind, path.name)


@pytest.mark.parametrize("kind", list(TORCH_LOADERS))
def test_truncated_garbage_and_empty_files_are_one_clear_error(tmp_path, kind):
    write, load, error = TORCH_LOADERS[kind]
    good = tmp_path / "good.pt"
    write(good)
    load(good)  # the loader reads what its own writer wrote
    data = good.read_bytes()
    cases = {
        "truncated": data[: len(data) // 2],
        "cut short by a few bytes": data[:-30],
        "garbage": os.urandom(4096),
        "text": b"frames,time_s\n1,2\n",
        "empty": b"",
    }
    for name, content in cases.items():
        path = tmp_path / f"{name}.pt"
        path.write_bytes(content)
        with pytest.raises(error) as info:
            load(path)
        message = _one_line(info.value)
        assert str(path) in message and "not a readable" in message, (name, message)
    with pytest.raises(FileNotFoundError):
        load(tmp_path / "missing.pt") if kind != "motif reward" else load_checkpoint(str(tmp_path / "missing.pt"))


def test_a_torch_file_that_is_not_a_checkpoint_is_refused(tmp_path):
    path = tmp_path / "weights.pt"
    torch.save([torch.zeros(2)], path)
    with pytest.raises(CheckpointError, match="not a dict"):
        load_checkpoint(str(path))
    torch.save({"frames": 3}, path)
    assert load_checkpoint(str(path)) == {"frames": 3}
    with pytest.raises(CheckpointError, match="no 'actor', 'critic'"):
        load_checkpoint(str(path), required=TRAINER_KEYS)


def test_damaged_store_and_motif_contents_are_one_line_errors(tmp_path):
    store_path = tmp_path / "store.pt"
    torch.save({"format": "torchrl_oni.CaptionStore", "version": 1, "config": {}}, store_path)
    with pytest.raises(UnreadableFileError, match="damaged CaptionStore") as info:
        CaptionStore.load(store_path)
    _one_line(info.value)
    motif_path = tmp_path / "motif.pt"
    _write_motif(motif_path)
    ckpt = torch.load(motif_path, weights_only=True)
    ckpt["model"] = {k: v[..., :1] for k, v in ckpt["model"].items()}  # wrong shapes
    torch.save(ckpt, motif_path)
    with pytest.raises(UnreadableFileError, match="damaged Motif") as info:
        MotifReward(motif_path)
    _one_line(info.value)


# ---------------------------------------------------------------------------- numpy files (Motif)
def test_motif_numpy_files_never_unpickle(tmp_path, capsys):
    marker = tmp_path / "marker"
    evil = np.array([Payload(marker)], dtype=object)
    annotations = tmp_path / "annotations.npz"
    np.savez(annotations, preference=evil, status=np.zeros(1, np.int8), fingerprint=np.array("x"))
    with pytest.raises(UnreadableFileError, match="refused: object arrays") as info:
        motif_module.load_annotations(annotations)
    _one_line(info.value)
    pairs = tmp_path / "pairs.npz"
    np.savez(pairs, first=evil, second=evil)
    messages = tmp_path / "messages.npy"
    np.save(messages, evil, allow_pickle=True)
    pickled = tmp_path / "pickled.npy"
    pickled.write_bytes(pickle.dumps(Payload(marker)))
    calls = [
        (motif_cli.train_reward_main, [str(pairs), str(annotations), "--out", str(tmp_path / "r.pt")]),
        (motif_cli.collect_pairs_main, [str(messages), "--out", str(tmp_path / "p.npz"), "--num-pairs", "2"]),
        (motif_cli.collect_pairs_main, [str(pickled), "--out", str(tmp_path / "p.npz"), "--num-pairs", "2"]),
    ]
    for main, argv in calls:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "error:" in err and "refused" in err, err
    assert not marker.exists()


def test_motif_numpy_files_truncated_or_garbage(tmp_path):
    good = tmp_path / "good.npz"
    np.savez(good, preference=np.zeros(50, np.float32), status=np.zeros(50, np.int8), fingerprint=np.array("f"))
    assert len(motif_module.load_annotations(good)["status"]) == 50
    data = good.read_bytes()
    for name, content in {"truncated": data[: len(data) // 2], "garbage": os.urandom(2048), "empty": b""}.items():
        path = tmp_path / f"{name}.npz"
        path.write_bytes(content)
        with pytest.raises(UnreadableFileError, match="not a readable annotations file") as info:
            motif_module.load_annotations(path)
        _one_line(info.value)
    other = tmp_path / "other.npz"
    np.savez(other, something=np.zeros(3))
    with pytest.raises(UnreadableFileError, match="no 'preference', 'status', 'fingerprint'"):
        motif_module.load_annotations(other)


# ---------------------------------------------------------------------------- what the trainer saves
def test_every_checkpointed_state_loads_with_weights_only(tmp_path):
    """The trainer's own state and every hook state, saved and read back with weights_only=True."""
    msgs = encode_messages(TEXTS * 3)
    hashes = hash_messages(msgs)
    store = CaptionStore(capacity=64)
    store.add(msgs, hashes)
    store.set_labels(torch.as_tensor(hashes[:6]), [1.0, 0.0, 1.0, 0.0, 1.0, 0.0], Provenance("test"))
    store.add_pairs(hashes[:3], hashes[3:6])
    _, texts = store.claim_pairs(10)
    slots = store.pending_pairs()
    store.set_preferences(slots, [1.0] * len(slots), Provenance("test"))

    sampler = UniqueCaptionPairSampler(capacity=32, seed=1)
    sampler.observe(msgs, hashes)
    ranking = RankingReward(normalize=True)
    ranking_trainer = RankingTrainer(ranking, store, batch_size=4)
    ranking_trainer.train_steps(2)
    classifier = ClassificationReward()
    classifier_trainer = ClassifierTrainer(classifier, store, batch_size=4)
    classifier_trainer.train_steps(2)
    transform = IntrinsicRewardTransform(ranking, normalize=True)
    transform.stats.update(torch.tensor([1.0, 5.0]))
    window = EpisodeWindow(4)
    window.add({"return": [1.0, 2.0, 3.0, 4.0, 5.0], "death": [1, 0, 1, 0, 0]})
    rms = RunningMeanStd()
    rms.update(torch.arange(5.0))
    state = {
        "frames": 96, "iterations": 3, "config": {"task": "score", "extrinsic_clip": None, "extra": {}},
        "torch_rng": torch.get_rng_state(), "episode_window": window.state_dict(),
        "hooks": [{
            "kind": "ranking", "transform": transform.state_dict(), "store_path": "captions.pt",
            "reward": ranking.state_dict(), "rm_trainer": ranking_trainer.state_dict(),
            "sampler": sampler.state_dict(), "classifier": classifier.state_dict(),
            "classifier_trainer": classifier_trainer.state_dict(), "rms": rms.state_dict(),
        }],
    }
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(state, str(path))
    loaded = load_checkpoint(str(path))
    hook = loaded["hooks"][0]

    restored = UniqueCaptionPairSampler(capacity=32)
    restored.load_state_dict(hook["sampler"])
    assert np.array_equal(restored.sample_pairs(6)[2], sampler.sample_pairs(6)[2])
    twin = RankingTrainer(RankingReward(normalize=True), store, batch_size=4)
    twin.load_state_dict(hook["rm_trainer"])
    twin.reward.load_state_dict(hook["reward"])
    assert torch.equal(twin.reward.scores(torch.as_tensor(msgs)), ranking.scores(torch.as_tensor(msgs)))
    clf = ClassifierTrainer(ClassificationReward(), store, batch_size=4)
    clf.load_state_dict(hook["classifier_trainer"])
    assert clf.total_steps == classifier_trainer.total_steps
    t2 = IntrinsicRewardTransform(RankingReward(normalize=True), normalize=True)
    t2.load_state_dict(hook["transform"])
    assert t2.stats.state_dict() == transform.stats.state_dict()
    w2 = EpisodeWindow(4)
    w2.load_state_dict(loaded["episode_window"])
    assert w2.means() == window.means() and w2.episodes == 5
    assert torch.equal(loaded["torch_rng"], state["torch_rng"])


def test_trainer_state_dict_loads_with_weights_only(tmp_path):
    from torchrl_oni.train import TrainConfig, Trainer

    cfg = TrainConfig(frames=256, workers=1, envs_per_worker=2, rollout=32, logdir=str(tmp_path),
                      progress=False, tensorboard=False, arch="oni")
    trainer = Trainer.from_config(cfg)
    trainer.optimizer.zero_grad()
    sum(p.float().pow(2).sum() for p in trainer.params).backward()
    trainer.optimizer.step()  # Adam now has per-parameter state
    trainer.frames, trainer.iterations = 128, 2
    path = trainer.save()
    state = load_checkpoint(path, required=TRAINER_KEYS)
    assert state["frames"] == 128 and state["config"] == trainer.run.cfg.to_dict()
    assert state["optimizer"]["state"], "the optimizer state did not travel"
    for k, v in trainer.actor.state_dict().items():
        assert torch.equal(state["actor"][k], v)


def test_checkpoints_written_before_this_fix_still_load(tmp_path):
    """Ranking runs used to checkpoint the pair sampler's numpy arrays: such files still load,
    while a numpy object array smuggling a payload is still refused."""
    msgs = encode_messages(TEXTS)
    sampler = UniqueCaptionPairSampler(capacity=16, seed=3)
    sampler.observe(msgs, hash_messages(msgs))
    old_state = {
        "messages": sampler._messages[: sampler.size].copy(), "hashes": sampler._hashes[: sampler.size].copy(),
        "distinct_seen": sampler.distinct_seen, "rng": sampler.rng.bit_generator.state,
    }
    path = tmp_path / "old.pt"
    torch.save({"frames": 64, "hooks": [{"kind": "ranking", "sampler": old_state}]}, path)
    with pytest.raises(Exception):
        torch.load(path, weights_only=True)  # plain weights_only refuses numpy arrays
    loaded = load_checkpoint(str(path))
    restored = UniqueCaptionPairSampler(capacity=16)
    restored.load_state_dict(loaded["hooks"][0]["sampler"])
    assert np.array_equal(restored.sample_pairs(8)[2], sampler.sample_pairs(8)[2])


# ---------------------------------------------------------------------------- the command line
@pytest.mark.parametrize("content", ["garbage", "crafted"])
def test_oni_train_resume_from_a_bad_checkpoint_is_one_error_line(tmp_path, content, capfd):
    from helpers import main_in_process

    from torchrl_oni.train.cli import main

    run = tmp_path / "run"
    run.mkdir()
    marker = tmp_path / "marker"
    if content == "garbage":
        (run / "checkpoint.pt").write_bytes(b"\x00not a checkpoint" * 100)
    else:
        torch.save({"frames": 1, "payload": Payload(marker)}, run / "checkpoint.pt")
    proc = main_in_process(main, ["--resume", "--logdir", run, "--frames", "256", "--workers", "1",
                                  "--envs-per-worker", "2", "--rollout", "32", "--no-progress", "--no-tensorboard"],
                           capfd)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("oni-train: error:") and "checkpoint" in lines[0], proc.stderr
    assert not marker.exists()


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_labels_files_are_read_as_data_only(tmp_path):
    """``--labels-from`` also reads labels files (JSON lines): a pickle, truncated gzip, garbage or
    an empty file named like one is refused in one line naming it, and nothing runs."""
    from torchrl_oni.store.labels_file import load_labels, write_labels

    marker = tmp_path / "marker"
    store = CaptionStore(capacity=16)
    msgs = encode_messages(TEXTS)
    store.add(msgs, hash_messages(msgs))
    store.set_labels(hash_messages(msgs), [1.0] * len(TEXTS), Provenance("scripted"))
    good = tmp_path / "good.jsonl.gz"
    write_labels(store, good)
    assert len(load_labels(good)) == len(set(TEXTS))
    data = good.read_bytes()
    cases = {f"crafted {p.stem}": p.read_bytes() for p in _crafted_files(tmp_path, marker)}
    cases.update({"truncated": data[: len(data) // 2], "garbage": os.urandom(4096), "empty": b"",
                  "text": b"frames,time_s\n1,2\n"})
    for name, content in cases.items():
        path = tmp_path / f"{name}.jsonl.gz"
        path.write_bytes(content)
        with pytest.raises(UnreadableFileError) as info:
            load_labels(path)
        assert str(path) in _one_line(info.value), name
    assert not marker.exists()
