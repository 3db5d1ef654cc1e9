"""IntrinsicRewardTransform: the values it pays, which message pays, specs in every env flavour."""
import math

import pytest
import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, ReplayBuffer
from torchrl.envs import ParallelEnv, SerialEnv, TransformedEnv
from torchrl.envs.utils import check_env_specs

from torchrl_oni.annotators.base import Provenance
from torchrl_oni.captions import encode_messages, hash_messages
from torchrl_oni.envs import NLEBatchEnv
from torchrl_oni.rewards import RetrievalReward
from torchrl_oni.store import CaptionStore
from torchrl_oni.transforms import IntrinsicRewardTransform, LLMAnnotationTransform

torch.set_num_threads(1)


class LengthReward:
    """R(m) = number of non-NUL bytes: distinct, known values per message (picklable)."""

    def __call__(self, messages, hashes):
        return (messages != 0).sum(-1).float()


def _batch(root_texts, next_texts, root_counts, next_counts, trailing=False):
    def enc(texts):
        m = torch.from_numpy(encode_messages(texts))
        h = torch.from_numpy(hash_messages(m))
        return m, h

    m0, h0 = enc(root_texts)
    m1, h1 = enc(next_texts)
    c0, c1 = torch.tensor(root_counts), torch.tensor(next_counts)
    if trailing:
        h0, h1, c0, c1 = h0[:, None], h1[:, None], c0[:, None], c1[:, None]
    n = len(root_texts)
    return TensorDict({
        "message": m0, "caption_hash": h0, "msg_count": c0,
        ("next", "message"): m1, ("next", "caption_hash"): h1, ("next", "msg_count"): c1,
        ("next", "reward"): torch.zeros(n, 1),
    }, batch_size=[n])


def test_retrieval_pays_exactly_the_labelled_messages():
    store = CaptionStore(capacity=16)
    texts = ["You kill the newt!", "It's a wall.", "You find a gold piece.", "Never mind."]
    msgs = encode_messages(texts)
    store.add(msgs, hash_messages(msgs))
    hashes = torch.from_numpy(hash_messages(msgs))
    # label 3 of 4: two helpful, one not; "Never mind." stays unlabelled
    store.set_labels(hashes[:3], [1.0, 0.0, 1.0], Provenance("test"))
    transform = IntrinsicRewardTransform(RetrievalReward(store), beta=3.0)
    batch = _batch(texts, ["x"] * 4, [1, 1, 1, 1], [1, 1, 1, 1])
    out = transform(batch)["next", "intrinsic_reward"]
    assert out.shape == (4, 1) and out.dtype == torch.float32
    assert out.squeeze(-1).tolist() == [1.0, 0.0, 1.0, 0.0]


def test_count_scaling_normalisation_and_threshold_match_hand_values():
    texts = ["ab", "abcd", "abcdefgh", "a"]  # LengthReward: 2, 4, 8, 1
    counts = [1, 2, 3, 1]
    batch = _batch(texts, ["z"] * 4, counts, [1] * 4)
    plain = IntrinsicRewardTransform(LengthReward(), beta=3.0)(batch.clone())["next", "intrinsic_reward"]
    want = [2.0, 4.0 / 8, 8.0 / 27, 1.0]
    assert plain.squeeze(-1).tolist() == pytest.approx(want, rel=1e-6)

    beta0 = IntrinsicRewardTransform(LengthReward(), beta=0.0)(batch.clone())["next", "intrinsic_reward"]
    assert beta0.squeeze(-1).tolist() == pytest.approx([2.0, 4.0, 8.0, 1.0])

    # normalise with running stats (first batch: mean/var of this batch), threshold at 0, then decay
    t = IntrinsicRewardTransform(LengthReward(), beta=2.0, normalize=True, threshold=0.0)
    out = t(batch.clone())["next", "intrinsic_reward"].squeeze(-1)
    raw = torch.tensor([2.0, 4.0, 8.0, 1.0], dtype=torch.float64)
    eps = 1e-4  # RunningMeanStd's initial pseudo-count (mean 0, var 1)
    n = 4
    mean = raw.mean().item() * n / (eps + n)
    delta = raw.mean().item()
    var = (1.0 * eps + raw.var(unbiased=False).item() * n + delta ** 2 * eps * n / (eps + n)) / (eps + n)
    z = (raw - mean) / math.sqrt(var)
    expected = [max(zi, 0.0) if zi > 0 else 0.0 for zi in z.tolist()]
    expected = [e / c ** 2 for e, c in zip(expected, counts)]
    assert out.tolist() == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert out[0] == 0 and out[3] == 0 and out[2] > 0  # below-mean messages are cut

    # eval mode freezes the statistics
    t.eval()
    stats = t.stats.state_dict()
    t(batch.clone())
    assert t.stats.state_dict() == stats
    # and they survive state_dict / load_state_dict
    t2 = IntrinsicRewardTransform(LengthReward(), beta=2.0, normalize=True, threshold=0.0)
    t2.load_state_dict(t.state_dict())
    assert t2.stats.state_dict() == stats


@pytest.mark.parametrize("trailing", [False, True])
def test_acted_and_next_pick_the_right_message_and_count(trailing):
    batch = _batch(["abcd", "ab"], ["abcdefgh", "a"], [2, 1], [1, 3], trailing=trailing)
    acted = IntrinsicRewardTransform(LengthReward(), message="acted")(batch.clone())["next", "intrinsic_reward"]
    nxt = IntrinsicRewardTransform(LengthReward(), message="next")(batch.clone())["next", "intrinsic_reward"]
    assert acted.squeeze(-1).tolist() == pytest.approx([4.0 / 8, 2.0])
    assert nxt.squeeze(-1).tolist() == pytest.approx([8.0, 1.0 / 27])
    assert acted.shape == nxt.shape == (2, 1)


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="acted"):
        IntrinsicRewardTransform(LengthReward(), message="previous")
    with pytest.raises(ValueError, match="beta"):
        IntrinsicRewardTransform(LengthReward(), beta=-1)


def test_in_transformed_env_acted_uses_the_previous_observation():
    env = TransformedEnv(NLEBatchEnv("score", num_envs=2, seed=1), IntrinsicRewardTransform(LengthReward(), beta=0.0))
    check_env_specs(env)
    assert "intrinsic_reward" in env.full_reward_spec.keys()
    assert env.full_reward_spec["intrinsic_reward"].shape == env.full_reward_spec["reward"].shape
    td = env.rollout(6, break_when_any_done=False)
    paid = td["next", "intrinsic_reward"].squeeze(-1)
    assert torch.equal(paid, (td["message"] != 0).sum(-1).float())
    env.close()


def _make_nle():
    return NLEBatchEnv("score", num_envs=2, seed=3)


def test_serial_env_with_transform_inside_and_outside():
    inside = SerialEnv(2, lambda: TransformedEnv(_make_nle(), IntrinsicRewardTransform(LengthReward())))
    check_env_specs(inside)
    td = inside.rollout(3, break_when_any_done=False)
    assert td["next", "intrinsic_reward"].shape == td["next", "reward"].shape == (2, 2, 3, 1)
    inside.close()
    outside = TransformedEnv(SerialEnv(2, _make_nle), IntrinsicRewardTransform(LengthReward(), message="next"))
    check_env_specs(outside)
    outside.close()


def test_parallel_env_spawn():
    env = TransformedEnv(ParallelEnv(2, _make_nle, mp_start_method="spawn"), IntrinsicRewardTransform(LengthReward()))
    try:
        check_env_specs(env)
        td = env.rollout(3, break_when_any_done=False)
        paid = td["next", "intrinsic_reward"]
        assert paid.shape == td["next", "reward"].shape
        counts = td["msg_count"].float()
        want = (td["message"] != 0).sum(-1).float() * counts.pow(-3.0)
        assert torch.allclose(paid.squeeze(-1), want)
    finally:
        env.close()


def test_on_replay_buffer_sample():
    store = CaptionStore(capacity=64)
    env = NLEBatchEnv("score", num_envs=2, seed=5)
    data = env.rollout(8, break_when_any_done=False).reshape(-1)
    env.close()
    msgs, hashes = data["message"], data["caption_hash"]
    store.add(msgs, hashes)
    store.set_labels(hashes, torch.ones(len(hashes)), Provenance("test"))  # everything helpful
    rb = ReplayBuffer(storage=LazyTensorStorage(64), batch_size=8,
                      transform=IntrinsicRewardTransform(RetrievalReward(store)))
    rb.extend(data)
    sample = rb.sample()
    paid = sample["next", "intrinsic_reward"].squeeze(-1)
    assert torch.allclose(paid, sample["msg_count"].float().pow(-3.0))
    # computed at sample time: a later relabelling shows up in the next sample
    store.set_labels(hashes, torch.zeros(len(hashes)), Provenance("test"))
    assert rb.sample()["next", "intrinsic_reward"].abs().sum() == 0


def test_llm_annotation_transform_is_reexported():
    from torchrl_oni.annotation import LLMAnnotationTransform as original

    assert LLMAnnotationTransform is original


def test_combine_rewards_in_a_transformed_env_mixes_with_clip():
    from torchrl.envs import Compose, TransformedEnv
    from torchrl.envs.utils import check_env_specs

    from torchrl_oni.envs import NLEBatchEnv
    from torchrl_oni.transforms import CombineRewards, IntrinsicRewardTransform

    def every_message_pays(messages, hashes):
        return torch.ones(messages.shape[0])

    env = TransformedEnv(
        NLEBatchEnv("score", num_envs=2, seed=0),
        Compose(IntrinsicRewardTransform(every_message_pays, message="next"), CombineRewards(0.1, 0.5, extrinsic_clip=1.0)),
    )
    check_env_specs(env)
    td = env.rollout(30, break_when_any_done=False)
    env.close()
    ext = td["next", "extrinsic_reward"]
    expected = 0.1 * ext.clamp(-1.0, 1.0) + 0.5 * td["next", "intrinsic_reward"]
    assert torch.allclose(td["next", "reward"], expected)
    assert (td["next", "intrinsic_reward"] > 0).all()
    # applied again to the collected data (a batch transform after the env's): the same mix,
    # not a mix of the mix (it overwrote extrinsic_reward with the mixed reward: 0.54 for 1.40)
    again = CombineRewards(0.1, 0.5, extrinsic_clip=1.0)(td.clone())
    assert torch.equal(again["next", "reward"], td["next", "reward"])
    assert torch.equal(again["next", "extrinsic_reward"], ext)


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_normalising_transform_copies_with_its_statistics(how):
    import copy
    import io
    import pickle

    from torchrl_oni.rewards import RankingReward

    original = IntrinsicRewardTransform(LengthReward(), beta=3.0, normalize=True, threshold=0.0)
    batch = _batch(["ab", "abcd", "abcdefgh", "a"], ["z"] * 4, [1, 2, 1, 1], [1] * 4)
    original(batch.clone())  # the running statistics have moved off their initial values
    if how == "deepcopy":
        clone = copy.deepcopy(original)
    elif how == "pickle":
        clone = pickle.loads(pickle.dumps(original))
    else:
        buffer = io.BytesIO()
        torch.save(original, buffer)
        buffer.seek(0)
        clone = torch.load(buffer, weights_only=False)  # our own object, written just above
    assert clone.stats.state_dict() == original.stats.state_dict()
    assert clone.stats._lock is not original.stats._lock
    clone.eval(), original.eval()
    assert torch.equal(clone(batch.clone())["next", "intrinsic_reward"], original(batch.clone())["next", "intrinsic_reward"])
    # the copy is independent: updating it leaves the original's statistics alone
    before = original.stats.state_dict()
    clone.train()
    clone(_batch(["abcdefghijkl"] * 4, ["z"] * 4, [1] * 4, [1] * 4))
    assert original.stats.state_dict() == before != clone.stats.state_dict()
    # a reward model served behind a lock (ranking, classification) copies too
    ranked = IntrinsicRewardTransform(RankingReward(normalize=True), normalize=True)
    twin = copy.deepcopy(ranked) if how == "deepcopy" else pickle.loads(pickle.dumps(ranked))
    msgs = torch.from_numpy(encode_messages(["You kill the newt!", "It's a wall."]))
    assert torch.equal(twin.reward.scores(msgs), ranked.reward.scores(msgs))
