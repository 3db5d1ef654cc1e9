"""ONI's transforms and reward sources follow TorchRL's conventions.

Keys (``in_keys=`` / ``out_keys=``, the older keywords as aliases, ``set_keys``), copies
(``copy.deepcopy``, pickle, cloudpickle: what ``ParallelEnv`` and the collectors do), processes
(a spawned worker reads a snapshot of the caption store and says so), checkpoints
(``env.state_dict()`` keeps the labels) and training / eval mode.
"""
import copy
import functools
import multiprocessing as mp
import pickle
import warnings

import cloudpickle
import numpy as np
import pytest
import torch
from tensordict import TensorDict
from torchrl.collectors import MultiAsyncCollector, MultiSyncCollector
from torchrl.envs import Compose, ParallelEnv, TransformedEnv

from helpers import TIMEOUT
from torchrl_oni.annotation import LLMAnnotationTransform, NotCopyableError
from torchrl_oni.annotators.base import Label, Provenance
from torchrl_oni.captions import encode_messages, hash_messages
from torchrl_oni.envs import NLEBatchEnv
from torchrl_oni.rewards import (
    BoWReward,
    ClassificationReward,
    ClassifierEnsemble,
    HashedWordVectors,
    MessageClassifier,
    RankingEnsemble,
    RankingReward,
    RetrievalReward,
    RUNEBonus,
)
from torchrl_oni.rewards.motif import MotifReward, train_reward_model
from torchrl_oni.rewards.retrieval import SNAPSHOT_WARNING
from torchrl_oni.rewards.text import EncoderVectors, HashedSentenceEncoder, minilm_available
from torchrl_oni.store import CaptionStore
from torchrl_oni.transforms import CombineRewards, IntrinsicRewardTransform, rune_transform

torch.set_num_threads(1)
pytestmark = pytest.mark.timeout(300)

TEXTS = ["You kill the newt!", "It's a wall.", "You see here 5 gold pieces.", "", "You kill the jackal!",
         "The door opens.", "You kill the newt!", "It's a wall."]
SNAPSHOT_MATCH = "reads a snapshot of the CaptionStore taken when it was copied to this process"
REFUSAL_MATCH = "LLMAnnotationTransform cannot be copied or pickled: it owns a background thread"


# ------------------------------------------------------------------------------------ helpers
def _batch(texts=TEXTS, counts=None, keys=("message", "caption_hash", "msg_count")):
    msgs = torch.from_numpy(encode_messages(texts))
    counts = torch.tensor(counts if counts is not None else [1 + i % 3 for i in range(len(texts))])
    message_key, hash_key, count_key = keys
    return TensorDict({message_key: msgs, hash_key: torch.from_numpy(hash_messages(msgs)), count_key: counts,
                       ("next", "reward"): torch.linspace(-20, 20, len(texts)).unsqueeze(-1)},
                      batch_size=[len(texts)])


def _labelled_store(texts=TEXTS[:4], labels=(1.0, 0.0, 0.5, 0.25), **kwargs):
    store = CaptionStore(capacity=8, **kwargs)
    msgs = encode_messages(list(texts))
    hashes = torch.from_numpy(hash_messages(msgs))
    store.add(msgs, hashes)
    store.set_labels(hashes, list(labels), Provenance("test"))
    return store


class LabelEverything:
    """Labels a caption 1.0, the empty caption 0.25: every labelled step pays, unlabelled ones 0."""

    provenance = Provenance("test", "everything")

    async def annotate(self, captions):
        return [Label(1.0 if c else 0.25, self.provenance) for c in captions]

    async def compare(self, pairs):
        return []

    async def aclose(self):
        pass


def _seeded(factory, seed=0):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return factory()


_MOTIF = {}


def _motif():
    if "ckpt" not in _MOTIF:
        a = encode_messages(["You kill the newt!", "You find gold."] * 4)
        b = encode_messages(["It's a wall.", "Nothing happens."] * 4)
        _MOTIF["ckpt"] = train_reward_model(a, b, np.zeros(8), epochs=1, batch_size=8, lr=1e-3)
    return MotifReward(_MOTIF["ckpt"], quantile=0.5)


def _minilm(kind):
    if not minilm_available():
        pytest.skip("the MiniLM weights package or transformers is not installed")
    from torchrl_oni.rewards.text import MiniLMEncoder, MiniLMTokenVectors

    vectors = MiniLMTokenVectors() if kind == "token_table" else EncoderVectors(MiniLMEncoder())
    return BoWReward("kill monsters and collect gold", vectors=vectors, threshold=0.0)


# every reward source of torchrl_oni.rewards, built small (RetrievalReward over a labelled store)
SOURCES = {
    "retrieval": lambda: RetrievalReward(_labelled_store()),
    "bow_hashed": lambda: BoWReward("kill monsters and collect gold", vectors=HashedWordVectors(), threshold=0.0),
    "bow_hashed_sentence": lambda: BoWReward("kill monsters and collect gold",
                                             vectors=EncoderVectors(HashedSentenceEncoder()), threshold=-1.0),
    "bow_minilm": lambda: _minilm("token_table"),
    "bow_minilm_sentence": lambda: _minilm("sentence"),
    "classification": lambda: ClassificationReward(_seeded(MessageClassifier), threshold=0.5),
    "ranking": lambda: _seeded(lambda: RankingReward(normalize=True, threshold=-10.0)),
    "motif": _motif,
    "classifier_ensemble": lambda: ClassifierEnsemble(size=2, seed=0),
    "ranking_ensemble": lambda: RankingEnsemble(size=2, seed=0),
    "rune": lambda: RUNEBonus(ClassifierEnsemble(size=2, seed=0), beta0=0.5),
}

# every transform of torchrl_oni.transforms that copies (LLMAnnotationTransform refuses: below)
TRANSFORMS = {
    "intrinsic_retrieval": lambda: IntrinsicRewardTransform(RetrievalReward(_labelled_store())),
    "intrinsic_normalized": lambda: IntrinsicRewardTransform(SOURCES["bow_hashed"](), normalize=True, threshold=0.0,
                                                             message="acted", beta=2.0),
    "combine": lambda: CombineRewards(0.1, 0.4, extrinsic_clip=5.0, streams=True),
    "rune_transform": lambda: rune_transform(ClassifierEnsemble(size=2, seed=0), beta0=0.5),
    "compose": lambda: Compose(IntrinsicRewardTransform(RetrievalReward(_labelled_store())),
                               CombineRewards(0.1, 0.4)),
}


def _round_trip(obj, how):
    if how == "deepcopy":
        return copy.deepcopy(obj)
    if how == "pickle":
        return pickle.loads(pickle.dumps(obj))
    return cloudpickle.loads(cloudpickle.dumps(obj))  # what ParallelEnv / the collectors send


def _quiet(fn, *args):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*reads a snapshot", category=UserWarning)
        return fn(*args)


# ------------------------------------------------------------------------------------ keys
def test_in_keys_and_the_old_keywords_are_the_same_transform():
    source = SOURCES["bow_hashed"]()
    keys = ("text", ("obs", "hash"), "seen")
    by_lists = IntrinsicRewardTransform(source, in_keys=list(keys), out_keys=["bonus"])
    by_words = IntrinsicRewardTransform(source, message_key=keys[0], hash_key=keys[1], count_key=keys[2],
                                        out_key="bonus")
    both = IntrinsicRewardTransform(source, in_keys=list(keys), message_key="text", out_key="bonus")  # agree
    for t in (by_lists, by_words, both):
        assert t.in_keys == ["text", ("obs", "hash"), "seen"] and t.out_keys == ["bonus"]
        assert (t.message_key, t.hash_key, t.count_key, t.out_key) == ("text", ("obs", "hash"), "seen", "bonus")
    batch = _batch(keys=keys)
    want = IntrinsicRewardTransform(source)(_batch())["next", "intrinsic_reward"]
    assert torch.equal(by_lists(batch.clone())["next", "bonus"], want)
    assert torch.equal(by_words(batch.clone())["next", "bonus"], want)
    # defaults
    plain = IntrinsicRewardTransform(source)
    assert plain.in_keys == ["message", "caption_hash", "msg_count"] and plain.out_keys == ["intrinsic_reward"]


def test_in_keys_are_checked_at_construction():
    source = SOURCES["bow_hashed"]()
    with pytest.raises(ValueError, match=r"takes 3 in_keys \(message, caption_hash, msg_count\), got 2"):
        IntrinsicRewardTransform(source, in_keys=["message", "caption_hash"])
    with pytest.raises(ValueError, match=r"takes 1 out_keys \(intrinsic_reward\), got 2"):
        IntrinsicRewardTransform(source, out_keys=["a", "b"])
    with pytest.raises(ValueError, match=r"message_key='text' contradicts in_keys\[0\]='message'"):
        IntrinsicRewardTransform(source, in_keys=["message", "caption_hash", "msg_count"], message_key="text")
    with pytest.raises(ValueError, match=r"out_key='x' contradicts out_keys\[0\]='y'"):
        IntrinsicRewardTransform(source, out_keys=["y"], out_key="x")
    with pytest.raises(ValueError, match=r"CombineRewards takes 2 in_keys"):
        CombineRewards(in_keys=["reward"])
    with pytest.raises(ValueError, match=r"CombineRewards takes 4 out_keys .*reward_ext, reward_int\), got 2"):
        CombineRewards(streams=True, out_keys=["reward", "extrinsic_reward"])
    with pytest.raises(ValueError, match=r"intrinsic_key='bonus' contradicts in_keys\[1\]='intrinsic_reward'"):
        CombineRewards(intrinsic_key="bonus", in_keys=["reward", "intrinsic_reward"])
    store = CaptionStore(capacity=4)
    with pytest.raises(ValueError, match=r"LLMAnnotationTransform takes 2 in_keys \(caption_hash, message\)"):
        LLMAnnotationTransform(store, LabelEverything(), in_keys=["caption_hash"])
    with pytest.raises(ValueError, match=r"takes 0 to 1 out_keys \(labelled \(optional\)\), got 2"):
        LLMAnnotationTransform(store, LabelEverything(), out_keys=["a", "b"])
    with pytest.raises(ValueError, match=r"labelled_key='a' contradicts out_keys\[0\]='b'"):
        LLMAnnotationTransform(store, LabelEverything(), out_keys=["b"], labelled_key="a")


def test_combine_rewards_and_annotation_keys_by_list_or_keyword():
    batch = TensorDict({("next", "r"): torch.tensor([[50.0], [-1.0]]), ("next", "bonus"): torch.tensor([[1.0], [0.0]])},
                       batch_size=[2])
    mix = CombineRewards(0.1, 0.4, in_keys=["r", "bonus"], out_keys=["mixed", "kept", "ext", "int"], streams=True)
    same = CombineRewards(0.1, 0.4, None, "bonus", True, in_keys=["r", "bonus"], out_keys=["mixed", "kept", "ext", "int"])
    assert mix.in_keys == same.in_keys and mix.out_keys == same.out_keys and mix.intrinsic_key == "bonus"
    out = mix(batch.clone())["next"]
    assert out["mixed"].squeeze(-1).tolist() == pytest.approx([1.4, -0.1])  # clipped to ±10 first
    assert torch.equal(out["kept"], batch["next", "r"]) and torch.equal(out["r"], batch["next", "r"])
    assert torch.allclose(out["ext"] + out["int"], out["mixed"])

    store = CaptionStore(capacity=8)
    by_lists = LLMAnnotationTransform(store, LabelEverything(), in_keys=["h", "m"], out_keys=["lab"], autostart=False)
    by_words = LLMAnnotationTransform(store, LabelEverything(), hash_key="h", message_key="m", labelled_key="lab",
                                      autostart=False)
    for t in (by_lists, by_words):
        assert t.in_keys == ["h", "m"] and t.out_keys == ["lab"] and t.labelled_key == "lab"
    quiet = LLMAnnotationTransform(store, LabelEverything(), autostart=False)
    assert quiet.in_keys == ["caption_hash", "message"] and quiet.out_keys == [] and quiet.labelled_key is None
    msgs = torch.from_numpy(encode_messages(TEXTS[:2]))
    seen = by_lists(TensorDict(m=msgs, h=torch.from_numpy(hash_messages(msgs)), batch_size=[2]))
    assert seen["lab"].tolist() == [False, False] and len(store) == 2


def test_set_keys_like_torchrl_losses():
    t = IntrinsicRewardTransform(SOURCES["bow_hashed"]())
    assert dict(t.tensor_keys) == {"message": "message", "caption_hash": "caption_hash", "msg_count": "msg_count",
                                   "intrinsic_reward": "intrinsic_reward"}
    assert t.set_keys(message="text", intrinsic_reward=("extra", "bonus")) is t
    assert t.in_keys == ["text", "caption_hash", "msg_count"] and t.out_keys == [("extra", "bonus")]
    assert t.message_key == "text" and t.out_key == ("extra", "bonus")
    t.set_keys(message=None)  # None: the default again, as on TorchRL's losses
    assert t.message_key == "message"
    t.out_key = "bonus"  # the old attribute names set their slot
    assert t.out_keys == ["bonus"]
    with pytest.raises(ValueError, match="'message_key' is not a key role of IntrinsicRewardTransform; accepted: "
                                         "message, caption_hash, msg_count, intrinsic_reward"):
        t.set_keys(message_key="x")
    with pytest.raises(TypeError):
        t.tensor_keys["message"] = "x"  # read-only: set_keys changes keys

    mix = CombineRewards(0.1, 0.4)
    mix.set_keys(intrinsic_reward="bonus", combined_reward="mixed")
    assert mix.in_keys == ["reward", "bonus"] and mix.out_keys == ["mixed", "extrinsic_reward"]
    with pytest.raises(ValueError, match="'reward_int' is not a key role of CombineRewards"):
        mix.set_keys(reward_int="x")  # only with streams=True
    assert CombineRewards(streams=True).set_keys(reward_int="x").out_keys[3] == "x"

    annotate = LLMAnnotationTransform(CaptionStore(capacity=4), LabelEverything(), autostart=False)
    annotate.set_keys(labelled="caption_labelled")
    assert annotate.out_keys == ["caption_labelled"]
    annotate.set_keys(labelled=None)  # optional: its default is no output
    assert annotate.out_keys == [] and annotate.labelled_key is None


@pytest.mark.parametrize("composed", [False, True])
def test_set_keys_inside_an_env_updates_its_specs(composed):
    t = IntrinsicRewardTransform(SOURCES["bow_hashed"](), beta=0.0)
    env = TransformedEnv(NLEBatchEnv("score", num_envs=1, seed=0), Compose(t, CombineRewards()) if composed else t)
    try:
        assert "intrinsic_reward" in env.full_reward_spec.keys()
        t.set_keys(intrinsic_reward="bonus")
        if composed:
            env.transform[1].set_keys(intrinsic_reward="bonus")
        assert "bonus" in env.full_reward_spec.keys() and "intrinsic_reward" not in env.full_reward_spec.keys()
        td = env.rollout(3, break_when_any_done=False)
        assert td["next", "bonus"].shape == td["next", "reward"].shape
    finally:
        env.close()


# ------------------------------------------------------------------------------------ copies
@pytest.mark.parametrize("how", ["deepcopy", "pickle", "cloudpickle"])
@pytest.mark.parametrize("name", sorted(SOURCES))
def test_every_reward_source_copies_and_pays_the_same(name, how):
    source = SOURCES[name]()
    batch = _batch()
    msgs, hashes = batch["message"], batch["caption_hash"]
    _quiet(source, msgs, hashes)  # used before the copy (caches, running statistics)
    twin = _round_trip(source, how)
    assert twin is not source
    want = _quiet(source, msgs, hashes)
    got = _quiet(twin, msgs, hashes)
    assert got.dtype == want.dtype and torch.equal(got, want)
    # and through the transform, copied as a whole
    transform = IntrinsicRewardTransform(SOURCES[name]())
    twin = _round_trip(transform, how)
    want = _quiet(transform, batch.clone())["next", "intrinsic_reward"]
    got = _quiet(twin, batch.clone())["next", "intrinsic_reward"]
    assert torch.equal(got, want)


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "cloudpickle"])
@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_every_transform_copies_and_gives_the_same_batch(name, how):
    transform = TRANSFORMS[name]()
    batch = _batch()
    batch["next", "intrinsic_reward"] = torch.linspace(0, 1, len(TEXTS)).unsqueeze(-1)
    _quiet(transform, batch.clone())  # used before the copy (running statistics)
    twin = _round_trip(transform, how)
    assert type(twin) is type(transform) and twin.in_keys == transform.in_keys and twin.out_keys == transform.out_keys
    want = _quiet(transform, batch.clone())
    got = _quiet(twin, batch.clone())
    assert (got == want).all()
    assert twin.state_dict().keys() == transform.state_dict().keys()


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "cloudpickle"])
def test_the_goal_embedding_transform_copies_reading_the_same_shared_table(how):
    from torchrl_oni.rewards.ellm import GoalEmbeddingTransform, SharedGoalEmbeddings

    env = NLEBatchEnv("score", num_envs=2, seed=0)
    obs = env.reset()
    env.close()
    shared = SharedGoalEmbeddings(capacity=64)
    try:
        t = GoalEmbeddingTransform(shared)
        caps = t.captioner(obs["message"], obs["blstats"], obs["crop"], obs["caption_hash"])
        shared.put(caps.hashes[:1], torch.ones(1, shared.dim))
        twin = _round_trip(t, how)
        assert twin.shared.path == shared.path and (twin.shared is shared) == (how == "deepcopy")
        want = t(obs.clone())["goal_embedding"]
        assert want[0].sum() == shared.dim and torch.equal(twin(obs.clone())["goal_embedding"], want)
        renamed = obs.clone().rename_key_("message", "text").rename_key_("crop", "view")
        by_lists = GoalEmbeddingTransform(shared, in_keys=["text", "blstats", "view"], out_keys=["goal"])
        assert torch.equal(by_lists(renamed)["goal"], want) and by_lists.out_key == "goal"
        with pytest.raises(ValueError, match=r"GoalEmbeddingTransform takes 3 in_keys \(message, blstats, crop\)"):
            GoalEmbeddingTransform(shared, in_keys=["message"])
    finally:
        shared.close()


def test_a_deep_copy_in_this_process_shares_the_live_store():
    store = _labelled_store()
    reward = RetrievalReward(store)
    batch = _batch()
    for twin in (copy.deepcopy(reward), copy.deepcopy(IntrinsicRewardTransform(reward)).reward):
        assert twin.store is store and not store.is_snapshot
    assert copy.copy(store) is store and copy.deepcopy(store) is store
    twin = copy.deepcopy(reward)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a live store: no warning
        twin(batch["message"], batch["caption_hash"])
    # a label written after the copy is paid by it: TorchRL's MultiAsyncCollector deep-copies its
    # postproc in the main process, and that copy must keep following the labels
    new = torch.from_numpy(hash_messages(encode_messages(["The door opens."])))
    store.add(encode_messages(["The door opens."]), new)
    store.set_labels(new, [1.0], Provenance("test"))
    assert twin(encode_messages(["The door opens."]), new).tolist() == [1.0]


def test_a_pickled_store_is_a_snapshot_and_its_reward_warns_once(tmp_path):
    store = _labelled_store(storage="memmap", scratch_dir=str(tmp_path))
    msgs = encode_messages(["The door opens.", "You hear a door open."])
    hashes = torch.from_numpy(hash_messages(msgs))
    store.add(msgs, hashes)
    claimed, _ = store.claim(1)  # pending at pickling time: unseen in the snapshot
    reward = RetrievalReward(store)
    twin = pickle.loads(pickle.dumps(reward))
    snap = twin.store
    assert snap is not store and snap.is_snapshot and not store.is_snapshot
    assert snap.lock is not store.lock and snap.scratch_dir is None  # never the live store's files
    assert snap.stats()["labelled"] == store.stats()["labelled"] == 4
    assert snap.stats()["pending"] == 0 and snap.stats()["unseen"] == 2 and store.stats()["pending"] == 1
    batch = _batch()
    with pytest.warns(UserWarning, match=SNAPSHOT_MATCH) as record:
        got = twin(batch["message"], batch["caption_hash"])
    assert str(record[0].message) == SNAPSHOT_WARNING.format(cls="RetrievalReward")
    assert torch.equal(got, reward(batch["message"], batch["caption_hash"]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        twin(batch["message"], batch["caption_hash"])  # once
    # labels that arrive later are not seen by the snapshot, and the snapshot writes nowhere live
    store.set_labels(claimed, [1.0], Provenance("test"))
    assert reward(msgs, hashes)[0] == 1.0 and twin(msgs, hashes).tolist() == [0.0, 0.0]
    snap.add(encode_messages(["only in the copy"]), hash_messages(encode_messages(["only in the copy"])))
    assert len(snap) == len(store) + 1


def test_where_every_warning_is_silenced_the_snapshot_is_logged(caplog):
    twin = pickle.loads(pickle.dumps(RetrievalReward(_labelled_store())))
    batch = _batch()
    with warnings.catch_warnings(), caplog.at_level("WARNING", logger="torchrl_oni.rewards.retrieval"):
        warnings.filterwarnings("ignore")  # what TorchRL's env and collector workers do
        twin(batch["message"], batch["caption_hash"])
    assert [r.getMessage() for r in caplog.records] == [SNAPSHOT_WARNING.format(cls="RetrievalReward")]
    # a filter aimed at this warning is the user's choice: neither warned nor logged
    caplog.clear()
    twin = pickle.loads(pickle.dumps(RetrievalReward(_labelled_store())))
    with warnings.catch_warnings(record=True) as record, caplog.at_level("WARNING"):
        warnings.filterwarnings("ignore", message=".*reads a snapshot")
        twin(batch["message"], batch["caption_hash"])
    assert not record and not caplog.records


def test_an_independent_store_copy_through_state_dict():
    store = _labelled_store()
    other = CaptionStore(capacity=2)
    other.load_state_dict(store.state_dict())
    assert not other.is_snapshot and other.stats()["labelled"] == 4
    batch = _batch()
    assert torch.equal(RetrievalReward(other)(batch["message"], batch["caption_hash"]),
                       RetrievalReward(store)(batch["message"], batch["caption_hash"]))


def _annotated_env(annotate):
    return TransformedEnv(NLEBatchEnv("score", num_envs=1, seed=0), annotate)


def test_the_annotation_transform_refuses_copies_naming_itself_and_the_fix():
    store = CaptionStore(capacity=8)
    annotate = LLMAnnotationTransform(store, LabelEverything(), autostart=False)
    pipeline = Compose(IntrinsicRewardTransform(RetrievalReward(store)), annotate)
    for attempt in (lambda: copy.deepcopy(annotate), lambda: copy.deepcopy(pipeline),
                    lambda: pickle.dumps(pipeline), lambda: cloudpickle.dumps(pipeline)):
        with pytest.raises(NotCopyableError, match=REFUSAL_MATCH) as info:
            attempt()
        assert isinstance(info.value, RuntimeError) and "Apply it in the trainer" in str(info.value)
    # TorchRL pickles a transform with its container: the reward transform beside it in the Compose
    # names the annotation transform too, and copies once detached (Transform.clone())
    with pytest.raises(NotCopyableError, match=REFUSAL_MATCH):
        pickle.dumps(pipeline[0])
    assert pickle.loads(pickle.dumps(pipeline[0].clone())).in_keys == pipeline[0].in_keys
    # TorchRL's shallow clone shares the worker and the store
    assert annotate.clone().worker is annotate.worker


@pytest.mark.parametrize("collector", [MultiSyncCollector, MultiAsyncCollector])
def test_a_collector_worker_factory_shows_our_refusal(collector):
    annotate = LLMAnnotationTransform(CaptionStore(capacity=8), LabelEverything(), autostart=False)
    # TorchRL turns a TypeError raised while pickling a worker's arguments into "A non-serializable
    # object was passed to the collector workers." (or drops it): ours is a RuntimeError and shows
    with pytest.raises(RuntimeError, match=REFUSAL_MATCH):
        collector([functools.partial(_annotated_env, annotate)], policy=None, frames_per_batch=4, total_frames=8)


def test_a_parallel_env_factory_shows_our_refusal():
    annotate = LLMAnnotationTransform(CaptionStore(capacity=8), LabelEverything(), autostart=False)
    env = ParallelEnv(1, functools.partial(_annotated_env, annotate), mp_start_method="spawn")
    try:
        with pytest.raises(RuntimeError, match=REFUSAL_MATCH):
            env.reset()
    finally:
        if not env.is_closed:
            env.close(raise_if_closed=False)


# ------------------------------------------------------------------------------------ processes
def _reward_in_child(reward, messages, hashes):
    """Runs in a spawned process: the reward of each message, and the warnings it gave."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        values = reward(messages, hashes)
    return values, [str(w.message) for w in record]


def _transform_in_child(transform, batch):
    """Runs in a spawned process: the transformed batch, and the warnings it gave."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out = transform(batch)
    return out, [str(w.message) for w in record]


def test_a_spawned_process_computes_from_a_snapshot_and_says_so():
    store = _labelled_store()
    reward = RetrievalReward(store)
    batch = _batch()
    ctx = mp.get_context("spawn")
    with ctx.Pool(1) as pool:
        values, said = pool.apply(_reward_in_child, (reward, batch["message"], batch["caption_hash"]))
        assert torch.equal(values, reward(batch["message"], batch["caption_hash"]))
        assert said == [SNAPSHOT_WARNING.format(cls="RetrievalReward")]
        # a normalising transform with its reward source travels too, and pays the same
        transform = IntrinsicRewardTransform(SOURCES["bow_hashed"](), normalize=True)
        transform(batch.clone())
        values, said = pool.apply(_transform_in_child, (transform.eval(), batch.clone()))
        assert said == [] and torch.equal(values["next", "intrinsic_reward"],
                                          transform(batch.clone())["next", "intrinsic_reward"])


def _labelled_nle(transform):
    return TransformedEnv(NLEBatchEnv("score", num_envs=1, seed=0), transform)


def test_a_parallel_env_worker_pays_its_snapshot_and_the_outer_transform_the_live_labels(capfd):
    # the reset message of this seed, labelled helpful before the workers start
    probe = NLEBatchEnv("score", num_envs=1, seed=0)
    first = probe.reset()
    probe.close()
    store = CaptionStore(capacity=64)
    store.add(first["message"], first["caption_hash"])
    store.set_labels(first["caption_hash"], [1.0], Provenance("test"))
    inner = IntrinsicRewardTransform(RetrievalReward(store), out_key="worker_reward")
    outer = IntrinsicRewardTransform(RetrievalReward(store), out_key="main_reward")
    env = TransformedEnv(ParallelEnv(1, functools.partial(_labelled_nle, inner), mp_start_method="spawn"), outer)
    try:
        td = env.rollout(3, break_when_any_done=False)
        # step 0 acted on the reset message: both pay its label
        assert td["next", "worker_reward"][..., 0, :].item() == td["next", "main_reward"][..., 0, :].item() == 1.0
        store.set_labels(first["caption_hash"], [0.0], Provenance("test"))  # relabelled after the workers started
        td = env.rollout(3, break_when_any_done=False)
        assert td["next", "worker_reward"][..., 0, :].item() == 1.0  # the worker's snapshot
        assert td["next", "main_reward"][..., 0, :].item() == 0.0  # the live store, in the main process
    finally:
        env.close()
    assert SNAPSHOT_MATCH in capfd.readouterr().err  # said by the worker, on its stderr


# ------------------------------------------------------------------------------------ checkpoints
def _pipeline(store, **kwargs):
    annotate = LLMAnnotationTransform(store, LabelEverything(), **kwargs)
    reward = IntrinsicRewardTransform(RetrievalReward(store), normalize=True)
    return TransformedEnv(NLEBatchEnv("score", num_envs=1, seed=0), Compose(annotate, reward))


def test_env_state_dict_keeps_the_labels():
    store = CaptionStore(capacity=64)
    env = _pipeline(store)
    fresh = None
    try:
        env.train()
        data = env.rollout(8, break_when_any_done=False)
        assert env.transform[0].wait_idle(TIMEOUT)
        assert store.stats()["labelled"] == store.stats()["size"] > 0
        # one caption pending at save time: it comes back to be labelled
        extra = encode_messages(["pending at save time"])
        store.add(extra, hash_messages(extra))
        env.transform[0].close()
        assert store.claim(1)[1] == ["pending at save time"]
        state = env.state_dict()
        # the store is saved once: by the annotation transform that fills it, not by the reward
        assert set(state) == {"transforms.0._extra_state", "transforms.1._extra_state"}
        assert set(state["transforms.1._extra_state"]) == {"stats"}
        assert state["transforms.0._extra_state"]["store"]["format"] == "torchrl_oni.CaptionStore"
        torch.save(state, buffer := __import__("io").BytesIO())
        buffer.seek(0)
        state = torch.load(buffer, weights_only=True)  # plain tensors and data

        fresh_store = CaptionStore(capacity=4)
        fresh = _pipeline(fresh_store, autostart=False)
        before = fresh.transform[1](data.clone())["next", "intrinsic_reward"]
        fresh.load_state_dict(state)
        assert fresh_store.stats()["labelled"] == store.stats()["labelled"]
        assert fresh_store.stats()["unseen"] == 1 and fresh_store.claim(5)[1] == ["pending at save time"]
        fresh.eval(), env.eval()
        want = env.transform[1](data.clone())["next", "intrinsic_reward"]
        got = fresh.transform[1](data.clone())["next", "intrinsic_reward"]
        assert torch.equal(got, want) and not torch.equal(before, want)
        assert fresh.transform[0].metrics()["steps_seen"] == env.transform[0].metrics()["steps_seen"]
    finally:
        env.transform[0].close()
        env.close()
        if fresh is not None:
            fresh.transform[0].close()
            fresh.close()


def test_load_state_dict_restores_the_store_in_place_for_every_holder():
    store = _labelled_store()
    state = LLMAnnotationTransform(store, LabelEverything(), autostart=False).state_dict()
    target = CaptionStore(capacity=2, max_attempts=7)
    reward = RetrievalReward(target)
    LLMAnnotationTransform(target, LabelEverything(), autostart=False).load_state_dict(state)
    batch = _batch()
    assert torch.equal(reward(batch["message"], batch["caption_hash"]),
                       RetrievalReward(store)(batch["message"], batch["caption_hash"]))
    assert target.max_attempts == 7 and target.capacity >= len(store)  # its own settings


# ------------------------------------------------------------------------------------ modes
def test_normalize_updates_its_statistics_in_training_mode_only():
    t = IntrinsicRewardTransform(SOURCES["bow_hashed"](), normalize=True)
    assert t.training
    start = t.stats.state_dict()
    t(_batch())
    moved = t.stats.state_dict()
    assert moved != start
    t.eval()
    t(_batch(["You kill the newt!"] * 4, [1] * 4))
    assert t.stats.state_dict() == moved

    # TorchRL puts a transform in eval mode when it joins a TransformedEnv: statistics stay put
    # until env.train()
    t = IntrinsicRewardTransform(SOURCES["bow_hashed"](), normalize=True)
    env = TransformedEnv(NLEBatchEnv("score", num_envs=1, seed=0), t)
    try:
        assert not t.training
        start = t.stats.state_dict()
        env.rollout(4, break_when_any_done=False)
        assert t.stats.state_dict() == start
        env.train()
        assert t.training
        env.rollout(4, break_when_any_done=False)
        assert t.stats.state_dict()["count"] > start["count"]
    finally:
        env.close()
