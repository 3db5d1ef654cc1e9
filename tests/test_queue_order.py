"""The order of the caption store's queue (issue 40, item 3): ``claim_order="seen_rate"`` hands
out the captions of most sightings per caption first seen since; it is validated, saved with the
store, set by ``oni-train --claim-order`` (its default), and ``benchmarks/queue_order.py``
measures the orders."""
import pickle

import numpy as np
import pytest
import torch
from helpers import BENCH, bench_json, encoded, script_exit

from torchrl_oni.annotators.base import Provenance
from torchrl_oni.store import CaptionStore

pytestmark = pytest.mark.timeout(120)

# slot i holds TEXTS[i] (a is the oldest), seen SEEN[i] times in all
TEXTS = list("abcdefgh")
SEEN = [3, 1, 2, 1, 1, 2, 1, 1]


def _store(order="seen_rate"):
    """A store holding a..h, first seen in that order, seen SEEN times; and their hashes."""
    msgs, hashes = encoded(TEXTS)
    store = CaptionStore(capacity=16, claim_order=order)
    rows = np.repeat(np.arange(len(TEXTS)), SEEN)
    store.add(msgs[rows], hashes[rows])
    return store, hashes


def _claims(store, sizes):
    return [store.claim(k)[1] for k in sizes]


def test_seen_rate_hands_out_most_sightings_per_caption_first_seen_since(monkeypatch):
    from torchrl_oni.store import CLAIM_ORDERS
    from torchrl_oni.store import captions

    assert CLAIM_ORDERS == ("most_seen", "oldest", "seen_rate") and captions.SEEN_RATE_PRIOR == 500
    # with the default prior, counts come first and, among equal counts, the newest (its rate is higher)
    store, hashes = _store()
    got, texts = store.claim(3)
    assert texts == ["a", "f", "c"] and got.tolist() == hashes[[0, 5, 2]].tolist()
    assert _claims(store, [2, 9]) == [["h", "g"], ["e", "d", "b"]]
    # with a prior of 1 caption, recency weighs: h (1 sighting, 0 captions since) beats a (3, over 7)
    monkeypatch.setattr(captions, "SEEN_RATE_PRIOR", 1)
    store, hashes = _store()
    # rates: a 3/8, b 1/7, c 2/6, d 1/5, e 1/4, f 2/3, g 1/2, h 1/1
    assert _claims(store, [4, 4]) == [["h", "f", "g", "a"], ["c", "e", "d", "b"]]
    # a caption first seen now is the newest: at 1 sighting it comes first
    store, hashes = _store()
    store.claim(3)
    msgs, new = encoded(["new"])
    store.add(msgs, new)
    assert store.claim(2)[1] == ["new", "a"]  # a: 3/9, c: 2/7, e: 1/5...
    # the other orders on the same store
    assert _claims(_store("most_seen")[0], [3, 5]) == [["a", "c", "f"], ["b", "d", "e", "g", "h"]]
    assert _claims(_store("oldest")[0], [3, 5]) == [["a", "b", "c"], ["d", "e", "f", "g", "h"]]


def test_seen_rate_matches_a_plain_sort_whatever_the_claim_sizes():
    rng = np.random.default_rng(3)
    texts = [f"caption {i}" for i in range(300)]
    msgs, hashes = encoded(texts)
    store = CaptionStore(capacity=256, claim_order="seen_rate")  # grows past its capacity on the way
    rows = np.concatenate([np.arange(300), rng.integers(0, 300, 900), rng.integers(250, 300, 300)])
    store.add(msgs[rows], hashes[rows])
    seen = np.bincount(rows, minlength=300)
    rate = {s: seen[s] / (300 - 1 - s + 500) for s in range(300)}
    want = sorted(range(300), key=lambda s: (-rate[s], s))
    got = []
    for k in (1, 2, 3, 7, 0, 32, 5, 300):
        got += store.claim(k)[0].tolist()
    assert got == hashes[want].tolist()
    assert want[:5] != sorted(range(300), key=lambda s: (-seen[s], s))[:5]  # not the most-seen order


def test_the_order_survives_save_load_pickling_and_state_dicts(tmp_path):
    store, hashes = _store()
    store.claim(3)
    store.set_labels(hashes[[0, 5, 2]], 1.0, Provenance("scripted"))
    path = store.save(tmp_path / "captions.pt")
    assert torch.load(path, weights_only=True)["config"]["claim_order"] == "seen_rate"
    for copy in (CaptionStore.load(path), pickle.loads(pickle.dumps(store))):
        assert copy.claim_order == "seen_rate"
        assert copy.claim(3)[1] == ["h", "g", "e"]
    assert CaptionStore.load(path, claim_order="oldest").claim(3)[1] == ["b", "d", "e"]
    restored = CaptionStore(claim_order="seen_rate")
    restored.load_state_dict(store.state_dict())
    assert restored.claim_order == "seen_rate" and restored.claim(3)[1] == ["h", "g", "e"]


def test_a_bad_order_is_refused_naming_the_orders(tmp_path):
    allowed = "'most_seen', 'oldest', 'seen_rate'"
    with pytest.raises(ValueError, match=f"claim_order must be one of {allowed}, got 'newest'"):
        CaptionStore(claim_order="newest")
    path = CaptionStore().save(tmp_path / "captions.pt")
    with pytest.raises(ValueError, match=allowed):
        CaptionStore.load(path, claim_order="most-seen")
    from torchrl_oni.train.config import TrainConfig

    with pytest.raises(ValueError, match=r"--claim-order 'newest' \(most_seen, oldest, seen_rate\)"):
        TrainConfig(claim_order="newest").validate()


def test_the_setting_reaches_the_runs_store(tmp_path):
    from torchrl_oni.train.cli import parse_command
    from torchrl_oni.train.config import TrainConfig
    from torchrl_oni.train.labelling import Labelling
    from torchrl_oni.train.reward_types import reward_types

    assert TrainConfig().annotation.claim_order == "seen_rate"  # oni-train's default; a bare store's: most_seen
    assert CaptionStore().claim_order == "most_seen"
    cfg, _ = parse_command(["--intrinsic-reward", "retrieval", "--annotator", "scripted", "--claim-order", "oldest"])
    assert cfg == TrainConfig(intrinsic_reward="retrieval", annotator="scripted", claim_order="oldest")
    assert TrainConfig.from_yaml(cfg.to_yaml()).annotation.claim_order == "oldest"
    path = tmp_path / "captions.pt"
    for run in (cfg, cfg.replace(claim_order="seen_rate")):
        for existing in (False, True):  # a new store, then one saved with another order: the setting wins
            if existing:
                CaptionStore(claim_order="most_seen").save(path)
            labelling = Labelling(run.annotation, run.feedback, reward_types()["retrieval"], store_path=str(path),
                                  total_frames=run.frames)
            labelling.open()
            try:
                assert labelling.store.claim_order == run.annotation.claim_order, existing
            finally:
                labelling.close(save=False)
            path.unlink(missing_ok=True)


def test_the_benchmark_runs_at_toy_size(capfd):
    result, table = bench_json([BENCH / "queue_order.py", "--seconds", "8", "--fps", "400", "--rates", "6",
                                "--batch", "4", "--policies", "most_seen", "seen_rate", "newest", "mixed_oldest",
                                "seen_rate_100", "--late-approved"])
    assert "Claim orders, simulated" in table and "mixed_oldest" in table
    assert result["benchmark"] == "queue_order" and result["late_approved"] is True
    assert result["captions_seen"] > 0 and result["new_captions_per_s"] > 0
    assert set(result["results"]) == {"6/most_seen", "6/seen_rate", "6/newest", "6/mixed_oldest", "6/seen_rate_100"}
    keys = {"steps", "steps_end", "approved_steps", "captions", "captions_seen", "rare", "rare_labelled",
            "rare_soon", "rare_median_s", "rare_p90_s", "approved_rare", "approved_rare_labelled",
            "approved_rare_soon", "approved_rare_median_s", "approved_rare_p90_s"}
    for name, figures in result["results"].items():
        assert keys <= set(figures), name
        assert 0 <= figures["steps"] <= 1 and 0 <= figures["captions"] <= 1
    # newest-first leaves the frequent captions waiting: fewer steps labelled than most seen first
    assert result["results"]["6/newest"]["steps"] < result["results"]["6/most_seen"]["steps"]
    code, err = script_exit(BENCH / "queue_order.py", ["--policies", "random"], capfd)
    assert code == 2 and "unknown policy 'random'" in err
