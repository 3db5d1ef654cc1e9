"""The env-side keys (copy, hash, count) and the one-call stack on plain TorchRL envs.

Each finding of the drop-in review has its test here: NLE's aliased observations on ``GymEnv``
are copied (the stored rollout equals what was seen live); ``msg_count`` equals a count by hand
under partial resets with the counter outside and inside a ``SerialEnv``/``ParallelEnv``; the
counter refuses data it cannot count; :func:`oni_transforms` runs on every kind of env and its
reward equals the reward computed by hand from the labels.
"""
from __future__ import annotations

import pickle
from functools import partial

import gymnasium
import pytest
import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, ReplayBuffer
from torchrl.envs import Compose, GymEnv, GymWrapper, ParallelEnv, SerialEnv, TransformedEnv
from torchrl.envs.transforms import Transform
from torchrl.envs.utils import check_env_specs

import torchrl_oni  # noqa: F401  (registers the task ids with gymnasium)
from torchrl_oni.annotators import ScriptedAnnotator
from torchrl_oni.captions import caption_hash, decode_messages, encode_messages, hash_messages
from torchrl_oni.envs import NLEBatchEnv
from torchrl_oni.envs.caption_keys import CaptionHash, CopyAliasedObservations, MessageCounter
from torchrl_oni.envs.tasks import make_task
from torchrl_oni.stack import ONITransforms, oni_transforms


class LiveMessages(Transform):
    """Records a copy of every message the env hands out, at the moment it hands it out."""

    def __init__(self):
        super().__init__(in_keys=[], out_keys=[])
        self.seen = []

    def _step(self, tensordict, next_tensordict):
        self.seen.append(next_tensordict["message"].clone())
        return next_tensordict

    def _reset(self, tensordict, tensordict_reset):
        self.seen.append(tensordict_reset["message"].clone())
        return tensordict_reset


def _short_game(max_steps: int):
    return GymWrapper(make_task("score", max_episode_steps=max_steps))


def hand_counts(td, hash_key="caption_hash") -> torch.Tensor:
    """msg_count by hand from a stored [B, T] rollout: a new table at each episode start."""
    batch, steps = td.batch_size
    hashes = td[hash_key].reshape(batch, steps)
    done = td["next", "done"].reshape(batch, steps)
    out = torch.zeros(batch, steps, dtype=torch.int64)
    for b in range(batch):
        table = {}
        for t in range(steps):
            if t == 0 or bool(done[b, t - 1]):
                table = {}
            h = int(hashes[b, t])
            table[h] = table.get(h, 0) + 1
            out[b, t] = table[h]
    return out


# ----------------------------------------------------------------------------- aliasing
@pytest.mark.parametrize("make", [lambda: GymEnv("NetHackScore-v0"),
                                  lambda: GymWrapper(gymnasium.make("NetHackScore-v1"))],
                         ids=["GymEnv-NLE-id", "GymWrapper-our-id"])
def test_stored_rollout_equals_what_the_env_showed_live(make):
    live = LiveMessages()
    env = TransformedEnv(make(), Compose(CopyAliasedObservations(), live))
    env.set_seed(0)
    td = env.rollout(40)
    env.close()
    stored = torch.cat([td["message"][:1], td["next", "message"]])
    assert torch.equal(stored, torch.stack(live.seen))
    assert len({bytes(m.tolist()) for m in stored}) > 1
    assert env.transform[0].aliased  # NLE reuses its arrays: the copy is needed here


def test_one_game_hashes_equal_the_batch_hashes():
    env = TransformedEnv(GymEnv("NetHackScore-v0"), Compose(CopyAliasedObservations(), CaptionHash()))
    env.set_seed(0)
    td = env.rollout(40)
    env.close()
    assert td["caption_hash"].tolist() == hash_messages(td["message"].numpy()).tolist()
    assert td["next", "caption_hash"].tolist() == hash_messages(td["next", "message"].numpy()).tolist()


def test_without_the_copy_nle_stores_the_last_observation_everywhere():
    # why the copy exists: if this ever fails, NLE stopped reusing its buffers
    env = GymEnv("NetHackScore-v0")
    env.set_seed(0)
    td = env.rollout(30)
    env.close()
    assert len({bytes(m.tolist()) for m in td["next", "message"]}) == 1


def test_fresh_tensors_are_not_copied():
    copy = CopyAliasedObservations()
    env = TransformedEnv(NLEBatchEnv("score", num_envs=2, seed=0), copy)
    td = env.rollout(20, break_when_any_done=False)
    env.close()
    assert not copy.aliased
    assert td["next", "message"].shape == (2, 20, 256)


def test_copy_is_a_no_op_on_batches_and_samples():
    td = TensorDict({"message": torch.zeros(3, 256, dtype=torch.uint8)}, [3])
    assert CopyAliasedObservations()(td) is td


# ----------------------------------------------------------------------------- hash
def test_caption_hash_on_a_batch_root_and_next():
    msgs = torch.from_numpy(encode_messages(["You kill the newt!", "It's a wall.", ""]))
    td = TensorDict({"message": msgs, ("next", "message"): msgs.flip(0)}, [3])
    CaptionHash()(td)
    assert td["caption_hash"].tolist() == hash_messages(msgs.numpy()).tolist()
    assert td["next", "caption_hash"][0].item() == caption_hash(b"")


def test_caption_hash_leaves_a_hash_the_env_wrote():
    td = TensorDict({"message": torch.zeros(2, 256, dtype=torch.uint8), "caption_hash": torch.tensor([7, 8])}, [2])
    assert CaptionHash()(td)["caption_hash"].tolist() == [7, 8]


def test_caption_hash_refuses_what_is_not_a_message():
    with pytest.raises(ValueError, match=r"uint8\[\.\.\., 256\]"):
        CaptionHash()(TensorDict({"message": torch.zeros(2, 10)}, [2]))
    with pytest.raises(ValueError, match="takes 1 in_keys"):
        CaptionHash(in_keys=["a", "b"])
    assert CaptionHash().set_keys(caption_hash="h").out_keys == ["h"]


# ----------------------------------------------------------------------------- counts
def _outer_counter(env_cls, transform, game=None):
    """``transform`` outside ``env_cls`` of two games of 7 and 11 steps (``game(max_steps)``, by
    default :func:`_short_game`)."""
    game = game or _short_game
    return TransformedEnv(env_cls(2, [partial(game, 7), partial(game, 11)]), transform)


def _counting_worker(max_steps):
    """A game whose worker hashes and counts its captions itself (``caption_hash``, ``msg_count``)."""
    return TransformedEnv(_short_game(max_steps), Compose(CaptionHash(), MessageCounter()))


# What the counter outside a ParallelEnv writes (its own keys: a counter outside leaves the
# ``caption_hash`` and ``msg_count`` the workers wrote, as it leaves NLEBatchEnv's below).
OUTSIDE = {"caption_hash": "outside_hash", "msg_count": "outside_count"}


@pytest.fixture(scope="module")
def parallel_counted_rollout():
    """``rollout()``: 120 steps of one ParallelEnv of two games (of 7 and 11 steps) counted twice,
    by a counter inside each worker (the default keys) and by one outside (``OUTSIDE``'s keys):
    the two tests below read the counts of one start of two worker processes, not two."""
    done = []

    def rollout():
        if not done:
            outside = Compose(CaptionHash().set_keys(caption_hash=OUTSIDE["caption_hash"]),
                              MessageCounter(in_keys=[OUTSIDE["caption_hash"]], out_keys=[OUTSIDE["msg_count"]]))
            env = _outer_counter(ParallelEnv, outside, game=_counting_worker)
            env.set_seed(0)
            try:
                done.append(env.rollout(120, break_when_any_done=False))
            finally:
                env.close()
        return done[0]

    return rollout


@pytest.mark.parametrize("env_cls", [SerialEnv, ParallelEnv])
def test_counts_equal_a_hand_count_with_the_counter_outside(env_cls, parallel_counted_rollout):
    if env_cls is ParallelEnv:
        td = parallel_counted_rollout()
        hash_key, count_key = OUTSIDE["caption_hash"], OUTSIDE["msg_count"]
        assert torch.equal(td[hash_key], td["caption_hash"])  # hashed outside as inside the workers
    else:
        env = _outer_counter(env_cls, Compose(CaptionHash(), MessageCounter()))
        env.set_seed(0)
        td = env.rollout(120, break_when_any_done=False)
        env.close()
        hash_key, count_key = "caption_hash", "msg_count"
    assert int(td["next", "done"].sum()) >= 15  # many partial resets: games end at 7 and 11 steps
    assert torch.equal(td[count_key].reshape(2, -1), hand_counts(td, hash_key))


def test_counts_equal_a_hand_count_with_the_counter_inside_each_worker(parallel_counted_rollout):
    td = parallel_counted_rollout()
    assert torch.equal(td["msg_count"].reshape(2, -1), hand_counts(td))


def test_counts_on_the_batched_env_with_partial_resets():
    env = TransformedEnv(NLEBatchEnv("score", num_envs=3, seed=1, task_kwargs={"max_episode_steps": 9}), MessageCounter())
    td = env.rollout(60, break_when_any_done=False)
    env.close()
    # NLEBatchEnv counts itself: the counter leaves its values, which match a hand count
    assert torch.equal(td["msg_count"], hand_counts(td))


def test_counter_refuses_what_it_cannot_count():
    env = TransformedEnv(GymEnv("NetHackScore-v0"), MessageCounter())
    with pytest.raises(KeyError, match=r"add CaptionHash\(\) before MessageCounter"):
        env.rollout(2)
    env.close()
    bad = TransformedEnv(GymEnv("NetHackScore-v0"), MessageCounter(in_key="message"))
    with pytest.raises(ValueError, match="one integer caption hash per game"):
        bad.reset()
    bad.close()
    with pytest.raises(NotImplementedError, match="cannot be applied to a batch"):
        MessageCounter()(TensorDict({"caption_hash": torch.tensor([5])}, [1]))
    with pytest.raises(ValueError, match="contradicts"):
        MessageCounter(in_keys=["caption_hash"], in_key="other")
    assert MessageCounter(in_keys=["h"], out_keys=["c"]).in_keys == MessageCounter(in_key="h").in_keys == ["h"]


# ----------------------------------------------------------------------------- the stack
def _check_stack_rollout(env, oni: ONITransforms, steps: int = 60):
    check_env_specs(env)
    td = env.rollout(steps, break_when_any_done=False)
    assert oni.wait_idle(timeout=60)
    flat = td.reshape(-1)
    # ONI-Retrieval from labels recomputed by hand: label(caption) · count^-3 where labelled
    labels, found = oni.store.lookup(flat["caption_hash"].reshape(-1))
    recomputed = oni.intrinsic(flat.clone())["next", "intrinsic_reward"].reshape(-1)
    want = torch.where(found, labels.float(), torch.zeros_like(labels.float())) * flat["msg_count"].reshape(-1).float().pow(-3)
    assert torch.allclose(recomputed, want)
    assert found.all()  # every caption of the rollout reached the store and was labelled
    mixed = flat["next", "reward"].reshape(-1)
    ext = flat["next", "extrinsic_reward"].reshape(-1).clamp(-10, 10)
    assert torch.allclose(mixed, ext + 0.5 * flat["next", "intrinsic_reward"].reshape(-1))
    return td


@pytest.mark.parametrize("kind", ["GymEnv", "GymWrapper-our-id", "SerialEnv", "ParallelEnv", "NLEBatchEnv"])
def test_one_call_stack_on_every_kind_of_env(kind):
    makers = {
        "GymEnv": lambda: GymEnv("NetHackScore-v0"),
        "GymWrapper-our-id": lambda: GymWrapper(gymnasium.make("NetHackScore-v1")),
        "SerialEnv": lambda: SerialEnv(2, partial(_short_game, 15)),
        "ParallelEnv": lambda: ParallelEnv(2, partial(_short_game, 15)),
        "NLEBatchEnv": lambda: NLEBatchEnv("score", num_envs=3, seed=0, task_kwargs={"max_episode_steps": 15}),
    }
    oni = oni_transforms(annotator=ScriptedAnnotator(), intrinsic_coeff=0.5)
    env = TransformedEnv(makers[kind](), oni)
    env.set_seed(0)
    try:
        _check_stack_rollout(env, oni)
    finally:
        env.close()
    assert oni.annotate._closed  # env.close() stopped the annotation thread


def test_stack_in_a_worker_factory_fails_with_the_fix():
    oni = oni_transforms(annotator=ScriptedAnnotator())
    with pytest.raises((TypeError, RuntimeError), match="cannot be copied or pickled"):
        pickle.dumps(oni)
    env = ParallelEnv(2, lambda: TransformedEnv(_short_game(10), oni))
    with pytest.raises(Exception, match="cannot be copied or pickled"):
        env.reset()
    oni.close()


def test_stack_on_a_replay_buffer_sample_recomputes_with_todays_labels():
    oni = oni_transforms(annotator=ScriptedAnnotator(), copy_observations=True)
    env = TransformedEnv(GymEnv("NetHackScore-v0"), oni)
    env.set_seed(1)
    td = env.rollout(80)
    oni.wait_idle(timeout=30)
    env.close()
    buffer = ReplayBuffer(storage=LazyTensorStorage(200), transform=oni.intrinsic.clone())
    buffer.extend(td)
    sample = buffer.sample(32)
    labels, found = oni.store.lookup(sample["caption_hash"].reshape(-1))
    want = torch.where(found, labels.float(), torch.zeros(())) * sample["msg_count"].reshape(-1).float().pow(-3)
    assert torch.allclose(sample["next", "intrinsic_reward"].reshape(-1), want)
    assert decode_messages(sample["message"].numpy())  # real captions were stored


@pytest.mark.parametrize("make", [CopyAliasedObservations, CaptionHash, MessageCounter], ids=lambda c: c.__name__)
def test_env_side_transforms_pickle_and_deepcopy_into_workers(make):
    import copy

    for clone in (copy.deepcopy(make()), pickle.loads(pickle.dumps(make()))):
        env = TransformedEnv(GymEnv("NetHackScore-v0"), Compose(CaptionHash(), clone) if make is MessageCounter
                             else clone)
        env.set_seed(0)
        td = env.rollout(5)
        env.close()
        assert td.batch_size == (5,)
