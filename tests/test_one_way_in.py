"""One documented way in (issue 36): the stack's pieces come from ``torchrl_oni``, a refused copy
names the class that refuses and the fix, a reward without ``msg_count`` says so, and the old
module paths of moved code are gone (0.1.0 keeps no shims).

pytest.ini ignores ``DeprecationWarning``: the tests below turn it into an error where it matters.
"""
import copy
import importlib
import inspect
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict
from torchrl.data import Bounded, Categorical, Composite, Unbounded
from torchrl.envs import Compose, EnvBase, TransformedEnv

import torchrl_oni
from torchrl_oni.annotators import ScriptedAnnotator
from torchrl_oni.background import NotCopyableError
from torchrl_oni.captions import MESSAGE_LEN, encode_messages, hash_messages

README = Path(__file__).resolve().parent.parent / "README.md"

# the stack's pieces, and where each is defined
PIECES = {
    "oni_transforms": "torchrl_oni.stack",
    "ONITransforms": "torchrl_oni.stack",
    "CopyAliasedObservations": "torchrl_oni.envs.caption_keys",
    "CaptionHash": "torchrl_oni.envs.caption_keys",
    "MessageCounter": "torchrl_oni.envs.caption_keys",
    "LLMAnnotationTransform": "torchrl_oni.annotation",
    "IntrinsicRewardTransform": "torchrl_oni.transforms",
    "CombineRewards": "torchrl_oni.transforms",
    "CaptionStore": "torchrl_oni.store",
    "ScriptedAnnotator": "torchrl_oni.annotators",
    "OpenAIAnnotator": "torchrl_oni.annotators",
    "RetrievalReward": "torchrl_oni.rewards",
}


# ------------------------------------------------------------------------------------ exports
@pytest.mark.parametrize("name", sorted(PIECES))
def test_each_piece_of_the_stack_is_exported_and_in_the_api_reference(name):
    assert name in torchrl_oni.__all__
    assert getattr(torchrl_oni, name) is getattr(importlib.import_module(PIECES[name]), name)
    assert re.search(rf"``{name}``", torchrl_oni.__doc__), f"{name} is not in torchrl_oni's API reference"


def test_every_exported_name_resolves_and_is_documented():
    for name in torchrl_oni.__all__:
        assert getattr(torchrl_oni, name) is not None
        assert f"``{name}``" in torchrl_oni.__doc__, f"{name} is exported but not in the API reference"


def test_import_torchrl_oni_stays_cheap():
    # the names load when read, not on import: no torch, torchrl or NLE for `import torchrl_oni`
    out = subprocess.run([sys.executable, "-c", "import sys, torchrl_oni; print(len(torchrl_oni.__all__), "
                          "[m for m in ('torch', 'torchrl', 'nle') if m in sys.modules])"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split(None, 1)[1].strip() == "[]"


def test_readme_names_the_worker_pieces_with_their_import():
    text = README.read_text()
    assert re.search(r"from torchrl_oni import CopyAliasedObservations, CaptionHash,\s+MessageCounter", text)
    # README's code imports the stack's pieces from the package, never from the module defining them
    for match in re.finditer(r"from (torchrl_oni\.[\w.]+) import \(?([\w ,\n]+)\)?", text):
        names = {n.strip() for n in match.group(2).replace("\n", ",").split(",")} & set(PIECES)
        assert not names, f"README imports {sorted(names)} from {match.group(1)}: use `from torchrl_oni import ...`"


# ------------------------------------------------------------------------------------ copies
class OneCaptionEnv(EnvBase):
    """A game that shows the same caption at every step, and writes no ``msg_count``."""

    def __init__(self, text="You kill the newt!"):
        super().__init__(batch_size=torch.Size([]))
        self._message = torch.from_numpy(encode_messages([text]))[0]
        self.observation_spec = Composite(message=Bounded(0, 255, shape=(MESSAGE_LEN,), dtype=torch.uint8))
        self.action_spec = Categorical(4, shape=())
        self.reward_spec = Unbounded(shape=(1,))

    def _state(self, **extra):
        return TensorDict({"message": self._message.clone(), "done": torch.zeros(1, dtype=torch.bool),
                           "terminated": torch.zeros(1, dtype=torch.bool), **extra}, batch_size=[])

    def _reset(self, tensordict):
        return self._state()

    def _step(self, tensordict):
        return self._state(reward=torch.zeros(1))

    def _set_seed(self, seed):
        return seed


def _pays_one(messages, hashes):
    return torch.ones(len(messages))


def test_a_deep_copy_of_an_env_names_the_transform_that_refuses_and_the_fix():
    oni = torchrl_oni.oni_transforms(annotator=ScriptedAnnotator())
    env = TransformedEnv(OneCaptionEnv(), oni)
    try:
        for target, root in ((env, "TransformedEnv"), (oni.intrinsic, "IntrinsicRewardTransform"),
                             (oni, "ONITransforms")):
            with pytest.raises(NotCopyableError) as info:
                copy.deepcopy(target)
            said = str(info.value)
            assert said.startswith("LLMAnnotationTransform cannot be copied or pickled")  # who refuses
            assert f"copy.deepcopy was called on {root}, not on it, and reached it" in said  # how it got there
            assert "`batch = annotate(batch)`" in said and "`.clone()` it first" in said  # the fixes
        # the fix it names works: a clone leaves its container behind, and its deep copy pays the same
        twin = copy.deepcopy(oni.intrinsic.clone())
        batch = env.rollout(3)
        assert twin.reward.store is oni.store  # a deep copy in this process reads the live store
        assert torch.equal(twin(batch.clone())["next", "intrinsic_reward"], batch["next", "intrinsic_reward"])
    finally:
        env.close()


def test_a_direct_deep_copy_names_no_other_root():
    annotate = torchrl_oni.LLMAnnotationTransform(torchrl_oni.CaptionStore(capacity=8), ScriptedAnnotator(),
                                                  autostart=False)
    with pytest.raises(NotCopyableError) as info:
        copy.deepcopy(annotate)
    assert "was called on" not in str(info.value)


def test_pickling_names_the_process_fix_and_the_worker_pieces():
    oni = torchrl_oni.oni_transforms(annotator=ScriptedAnnotator())
    with pytest.raises(NotCopyableError) as info:
        import pickle

        pickle.dumps(oni)
    said = str(info.value)
    assert "Pickling sends it to another process" in said
    assert "`from torchrl_oni import CopyAliasedObservations, CaptionHash, MessageCounter`" in said
    oni.close()


def test_the_collector_postproc_difference_is_explained():
    from torchrl.collectors import MultiAsyncCollector, MultiSyncCollector

    # what the error explains, read from TorchRL itself: MultiAsyncCollector deep-copies its
    # postproc (one copy per storing device), MultiSyncCollector keeps the one it was given
    assert "deepcopy(postproc)" in inspect.getsource(MultiAsyncCollector.__init__)
    assert "deepcopy(postproc)" not in inspect.getsource(MultiSyncCollector)
    annotate = torchrl_oni.LLMAnnotationTransform(torchrl_oni.CaptionStore(capacity=8), ScriptedAnnotator(),
                                                  autostart=False)
    with pytest.raises(NotCopyableError) as info:
        copy.deepcopy(annotate)  # what MultiAsyncCollector(postproc=annotate) does
    said = str(info.value)
    assert "works with MultiSyncCollector, which calls its postproc as given" in said
    assert "not with MultiAsyncCollector, which deep-copies its postproc first" in said


# ------------------------------------------------------------------------------------ msg_count
def _caption_batch(n=3, counts=None):
    msgs = torch.from_numpy(encode_messages(["You kill the newt!"] * n))
    data = {"message": msgs, "caption_hash": torch.from_numpy(hash_messages(msgs)), ("next", "reward"): torch.zeros(n, 1)}
    if counts is not None:
        data["msg_count"] = torch.tensor(counts)
    return TensorDict(data, batch_size=[n])


def test_a_reward_without_msg_count_warns_once_naming_the_fix():
    transform = torchrl_oni.IntrinsicRewardTransform(_pays_one)
    with pytest.warns(UserWarning, match=r"no 'msg_count'.*paid in full.*Add MessageCounter") as record:
        paid = transform(_caption_batch())["next", "intrinsic_reward"]
    assert paid.sum().item() == 3.0  # still paid undecayed: a count of 1 is a valid reading
    assert len([w for w in record if "msg_count" in str(w.message)]) == 1
    assert "`from torchrl_oni import MessageCounter`" in str(record[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per transform
        transform(_caption_batch())


@pytest.mark.parametrize("make", [
    lambda: (torchrl_oni.IntrinsicRewardTransform(_pays_one), _caption_batch(counts=[1, 2, 3])),
    lambda: (torchrl_oni.IntrinsicRewardTransform(_pays_one, beta=0), _caption_batch()),  # undecayed on purpose
], ids=["with msg_count", "beta=0"])
def test_no_warning_with_a_count_or_without_decay(make):
    transform, batch = make()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        transform(batch)


def test_an_env_without_message_counter_warns_and_with_it_decays():
    env = TransformedEnv(OneCaptionEnv(), Compose(torchrl_oni.CaptionHash(),
                                                  torchrl_oni.IntrinsicRewardTransform(_pays_one)))
    with pytest.warns(UserWarning, match="Add MessageCounter"):
        paid = env.rollout(3)["next", "intrinsic_reward"]
    assert paid.sum().item() == 3.0  # the 3 identical steps, paid 3.0
    env = TransformedEnv(OneCaptionEnv(), Compose(torchrl_oni.CaptionHash(), torchrl_oni.MessageCounter(),
                                                  torchrl_oni.IntrinsicRewardTransform(_pays_one)))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        paid = env.rollout(3)["next", "intrinsic_reward"]
    assert paid.flatten().tolist() == pytest.approx([1, 1 / 8, 1 / 27])


# ------------------------------------------------------------------------------------ old paths
# 0.1.0 was never released, so code that moved has one import path, its new one (CHANGELOG.md,
# "Moved"): the old modules and the names they re-exported are gone, not deprecated.
MOVED = [
    ("torchrl_oni.active", "torchrl_oni.queries"),
    ("torchrl_oni.envs.gym_pieces", "torchrl_oni.envs.gym_wrapper"),
    ("torchrl_oni.train.logging", "torchrl_oni.train.run_log"),
    ("torchrl_oni.rewards.encoder", "torchrl_oni.rewards.text"),
    ("torchrl_oni.rewards.metrics", "torchrl_oni.stats"),
    ("torchrl_oni.rewards.registry", "torchrl_oni.train.reward_types"),
    ("torchrl_oni.rewards.motif_cli", "torchrl_oni.train.motif_cli"),
]

# (old home, name, new home)
MOVED_NAMES = [
    ("torchrl_oni.rewards.ensemble", "rune_transform", "torchrl_oni.transforms"),
    *[("torchrl_oni.rewards.motif", name, "torchrl_oni.train.motif_cli")
      for name in ("collect_pairs_main", "annotate_pairs_main", "train_reward_main", "main")],
    ("torchrl_oni.rewards.motif", "PENDING", None),  # Motif's former name of NOT_ASKED (store.status.UNSEEN)
    ("torchrl_oni.rewards.motif", "AUTO_TIE", None),  # Motif's former name of TIED (store.status.SKIPPED)
    ("torchrl_oni.evaluate", "t_quantile_975", "torchrl_oni.stats"),
    *[("torchrl_oni.serve.embedded", name, "torchrl_oni.serve.engines")
      for name in ("ScriptedEngine", "Completion", "SCRIPTED_MODEL_NAME", "PROMPT_BYTES_PER_TOKEN")],
    ("torchrl_oni.serve.embedded", "RequestError", "torchrl_oni.serve.http"),
    *[("torchrl_oni.serve.embedded", name, "torchrl_oni.net") for name in ("free_port", "is_loopback")],
    *[("torchrl_oni.rewards.bow", name, "torchrl_oni.rewards.text")
      for name in ("make_vectors", "HashedWordVectors", "STOPWORDS", "VECTOR_KINDS")],
    ("torchrl_oni.annotators.openai", "CIRCUIT_OPEN", "torchrl_oni.annotators.client"),
    *[("torchrl_oni.annotators.openai", name, "torchrl_oni.annotators.endpoints")
      for name in ("API_KEY_ENV", "AUTH_ERROR", "AnnotatorUnavailable", "normalize_base_url", "resolve_model")],
    *[("torchrl_oni.annotators.openai", name, "torchrl_oni.annotators.pacing")
      for name in ("CircuitBreaker", "RequestSizer")],
    *[("torchrl_oni.annotators.client", name, "torchrl_oni.annotators.endpoints")
      for name in ("normalize_base_url", "resolve_model")],
    ("torchrl_oni.rewards.ellm", "STATE_HASH_KEY", "torchrl_oni.rewards.ellm.reward"),
    ("torchrl_oni.rewards.ellm", "DONE", "torchrl_oni.rewards.ellm.table"),
    *[("torchrl_oni.envs.tasks", name, "torchrl_oni.task_ids") for name in ("TASK_ALIASES", "task_names")],
]

# names a module still imports for its own use, but no longer exports: their home is elsewhere
NOT_EXPORTED = {
    "torchrl_oni.rewards.classification": ("RewardModelSchedule", "ScheduledTraining", "holdout_mask",
                                           "labelled_arrays"),
    "torchrl_oni.rewards.bow": ("MiniLMTokenVectors", "WordVectors"),
    "torchrl_oni.serve.embedded": ("OpenAIServer", "make_engine", "check_exposure", "DEFAULT_MAX_QUEUE"),
    "torchrl_oni.annotators.client": ("API_KEY_ENV", "AUTH_ERROR", "AnnotatorUnavailable", "CircuitBreaker",
                                      "RequestSizer"),
    "torchrl_oni.annotators.teacher": ("SKIP_ERROR",),
    "torchrl_oni.evaluate": ("mean_ci", "wilson_interval"),
    "torchrl_oni.envs.tasks": ("TASKS", "resolve_task"),
}


@pytest.mark.parametrize("old, new", MOVED, ids=[old for old, _ in MOVED])
def test_an_old_module_path_is_gone(old, new):
    with pytest.raises(ModuleNotFoundError, match=re.escape(old)):
        importlib.import_module(old)
    importlib.import_module(new)


@pytest.mark.parametrize("module, name, new", MOVED_NAMES, ids=[f"{m}.{n}" for m, n, _ in MOVED_NAMES])
def test_an_old_name_is_gone(module, name, new):
    with pytest.raises(ImportError, match=re.escape(name)):
        exec(f"from {module} import {name}", {})
    if new is not None:
        assert hasattr(importlib.import_module(new), name)


@pytest.mark.parametrize("module", sorted(NOT_EXPORTED))
def test_a_module_exports_only_its_own_names(module):
    exported = importlib.import_module(module).__all__
    assert not set(NOT_EXPORTED[module]) & set(exported)


def test_the_new_paths_import_without_a_deprecation_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        for _, new in MOVED:
            importlib.import_module(new)
        from torchrl_oni.rewards.motif import NOT_ASKED, TIED  # noqa: F401
        from torchrl_oni.transforms import rune_transform  # noqa: F401
