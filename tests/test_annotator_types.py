"""``--annotator`` by name (torchrl_oni/train/annotator_types.py): a new annotator is one
registration, and the labelling asks the entry whether the judge probe checks it or an LLM serves it."""
import os
import tempfile

import pytest

from torchrl_oni.annotators import ScriptedAnnotator
from torchrl_oni.annotators.base import Provenance
from torchrl_oni.store import CaptionStore
from torchrl_oni.train import annotator_types
from torchrl_oni.train.annotator_types import AnnotatorType, annotator_names, get_annotator
from torchrl_oni.train.cli import build_parser
from torchrl_oni.train.config import TrainConfig
from torchrl_oni.train.labelling import make_annotator
from torchrl_oni.run_folder import CAPTION_STORE_NAME

TOY = Provenance(annotator="toy", model="every-caption-is-progress", prompt_version="none")


class _Toy(ScriptedAnnotator):
    """Says every caption is progress, under a provenance of its own."""

    def __init__(self, goal):
        super().__init__(goal=goal)
        self.provenance = TOY

    def label(self, caption):
        return 1.0


@pytest.fixture
def toy(monkeypatch):
    built = []

    def build(ann, *, seed=0):
        built.append((ann.goal, seed))
        return _Toy(ann.goal), None

    entry = AnnotatorType("toy", "every caption is progress", build)
    monkeypatch.setitem(annotator_types._ANNOTATORS, entry.name, entry)  # the one place an annotator is added
    return built


def test_a_registered_annotator_is_a_choice_of_the_cli_labels_a_run_and_its_labels_are_stored(toy):
    assert "toy" in annotator_names()
    assert build_parser().parse_args(["--annotator", "toy"]).annotator == "toy"
    logdir = tempfile.mkdtemp()
    cfg = TrainConfig(intrinsic_reward="retrieval", annotator="toy", frames=512, workers=1, envs_per_worker=2,
                      rollout=16, minibatch_size=32, logdir=logdir, progress=False, tensorboard=False, seed=3)
    assert TrainConfig.from_dict(cfg.to_dict()).annotation.annotator == "toy"
    from torchrl_oni.train import Trainer

    summary = Trainer.from_config(cfg).train()  # the trainer closes its hooks
    assert summary["frames"] >= 512
    assert toy == [("default", 3)]  # built once, from the annotation section, with the run's seed
    store = CaptionStore.load(os.path.join(logdir, CAPTION_STORE_NAME))
    stats = store.stats()
    assert stats["labelled"] > 0 and stats["positives"] == stats["labelled"]
    assert store.provenances == [TOY]


def test_make_annotator_takes_the_annotation_section_and_the_seed(toy):
    cfg = TrainConfig(annotator="toy", goal="gold", seed=7)
    ann, server = make_annotator(cfg.annotation, seed=cfg.seed)
    assert isinstance(ann, _Toy) and server is None
    assert toy == [("gold", 7)]


def test_entries_say_what_the_built_in_annotators_are():
    assert annotator_names()[:4] == ("llm", "scripted", "teacher", "store")
    assert get_annotator("llm").llm and get_annotator("llm").judged
    assert not any(get_annotator(n).llm or get_annotator(n).judged for n in ("scripted", "teacher", "store"))


def test_unknown_annotators_and_duplicates_are_refused():
    with pytest.raises(ValueError, match="unknown --annotator 'oracle' \\(llm, scripted, teacher or store\\)"):
        get_annotator("oracle")
    with pytest.raises(ValueError, match="already registered"):
        annotator_types.register_annotator(get_annotator("scripted"))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--annotator", "oracle"])
    with pytest.raises(ValueError, match="--annotator"):
        TrainConfig(annotator="oracle").validate()
