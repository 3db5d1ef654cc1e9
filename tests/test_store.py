"""Tests for torchrl_oni.store.CaptionStore."""
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import encoded
from torchrl_oni.annotators.base import FIRST, SECOND, TIE, Provenance
from torchrl_oni.captions import MESSAGE_LEN, caption_hash, decode_message, encode_messages, hash_messages
from torchrl_oni import store as store_module
from torchrl_oni.store import CaptionStore
from torchrl_oni.store import _snapshot as store_snapshot

torch.set_num_threads(1)
pytestmark = pytest.mark.timeout(60)

PROV = Provenance("test", "rules", "v1")


def _random_captions(n, seed=0):
    rng = np.random.default_rng(seed)
    msgs = np.zeros((n, MESSAGE_LEN), dtype=np.uint8)
    lengths = rng.integers(8, 60, n)  # long enough to be unique
    for i, length in enumerate(lengths):
        msgs[i, :length] = rng.integers(1, 256, length)
    return msgs, hash_messages(msgs)


def test_add_dedups_within_and_across_batches():
    store = CaptionStore(capacity=16)
    msgs, hashes = encoded(["a", "b", "a", "c", "b", "a"])
    new = store.add(msgs, hashes)
    assert new.tolist() == [True, True, False, True, False, False]
    assert len(store) == 3
    assert not store.add(msgs, hashes).any()
    assert len(store) == 3
    rows = store.labelled_data()  # nothing labelled yet
    assert rows.batch_size == torch.Size([0])
    # times_seen counts every occurrence: "a" 3 + 3, "b" 2 + 2, "c" 1 + 1
    store.set_labels(hashes[:4], 0.0, PROV)
    seen = dict(zip(store.labelled_data()["caption_hash"].tolist(), store.labelled_data()["times_seen"].tolist()))
    assert seen == {int(hashes[0]): 6, int(hashes[1]): 4, int(hashes[3]): 2}


def test_add_keeps_batch_shape_and_computes_missing_hashes():
    store = CaptionStore(capacity=16)
    msgs, hashes = encoded(["x", "y", "x", "z", "y", "w"])
    new = store.add(msgs.reshape(2, 3, MESSAGE_LEN), hashes.reshape(2, 3, 1))
    assert new.shape == (2, 3, 1)
    assert new.sum() == 4
    assert not store.add(msgs).any()  # hashes computed from the bytes match
    with pytest.raises(ValueError, match="messages but"):
        store.add(msgs, hashes[:2])
    with pytest.raises(ValueError, match="uint8"):
        store.add(torch.zeros(3, 10, dtype=torch.uint8))


def test_lookup_matches_a_dict_across_index_merges():
    store = CaptionStore(capacity=8)  # grows several times
    store._index.merge_at = 300  # exercise both sorted runs and their merge
    msgs, hashes = _random_captions(2000, seed=1)
    rng = np.random.default_rng(2)
    reference = {}
    for start in range(0, 2000, 128):
        sl = slice(start, start + 128)
        store.add(msgs[sl], hashes[sl])
        chosen = hashes[sl][rng.random(len(hashes[sl])) < 0.5]
        values = rng.integers(0, 2, len(chosen)).astype(np.float32)
        store.set_labels(chosen, values, PROV)
        reference.update(zip(chosen.tolist(), values.tolist()))
    unknown = rng.integers(-(2**62), 2**62, 500)
    queries = np.concatenate([rng.choice(hashes, 3596), unknown])
    rng.shuffle(queries)
    queries = torch.from_numpy(queries.reshape(64, 64))
    labels, found = store.lookup(queries, default=-1.0)
    assert labels.shape == found.shape == (64, 64)
    assert labels.dtype == torch.float32 and found.dtype == torch.bool
    for q, lab, f in zip(queries.flatten().tolist(), labels.flatten().tolist(), found.flatten().tolist()):
        assert f == (q in reference)
        assert lab == reference.get(q, -1.0)
    assert len(store) == 2000 and store.capacity >= 2000


def test_message_bytes_round_trip(tmp_path):
    latin = bytes(range(128, 256))  # every non-ASCII byte
    full = bytes((i % 255) + 1 for i in range(MESSAGE_LEN))  # 256 bytes, no NUL
    raws = [latin, b"", full, "Vous \xe9tes ici.".encode("latin-1")]
    msgs = encode_messages(raws)
    assert msgs[2].all()  # really uses all 256 bytes
    hashes = hash_messages(msgs)
    store = CaptionStore(capacity=4)
    assert store.add(msgs, hashes).all()
    claimed_hashes, texts = store.claim(10)
    by_hash = dict(zip(claimed_hashes.tolist(), texts))
    for raw, h in zip(raws, hashes.tolist()):
        assert by_hash[h] == raw.decode("latin-1")
    assert by_hash[caption_hash(b"")] == ""
    store.set_labels(claimed_hashes, 1.0, PROV)
    path = store.save(tmp_path / "store.pt")
    loaded = CaptionStore.load(path)
    data = loaded.labelled_data()
    stored = dict(zip(data["caption_hash"].tolist(), data["message"].numpy()))
    for msg, h in zip(msgs, hashes.tolist()):
        np.testing.assert_array_equal(stored[h], msg)
        assert decode_message(stored[h]) == decode_message(msg)


def test_claim_order_and_pending():
    store = CaptionStore(capacity=8)
    msgs, hashes = encoded(["rare", "common", "mid"])
    store.add(msgs, hashes)
    store.add(msgs[1:], hashes[1:])
    store.add(msgs[1:2], hashes[1:2])  # common: 3, mid: 2, rare: 1
    got, texts = store.claim(2)
    assert texts == ["common", "mid"]
    assert sorted(store.pending().tolist()) == sorted(got.tolist())
    got2, texts2 = store.claim(5)
    assert texts2 == ["rare"]
    assert store.claim(5)[1] == []
    assert store.release_pending() == 3
    assert store.pending().numel() == 0

    oldest = CaptionStore(capacity=8, claim_order="oldest")
    oldest.add(msgs, hashes)
    oldest.add(msgs[2:], hashes[2:])
    assert oldest.claim(2)[1] == ["rare", "common"]
    with pytest.raises(ValueError, match="claim_order"):
        CaptionStore(claim_order="random")


def test_unparsable_answers_give_up_after_max_attempts():
    store = CaptionStore(capacity=8, max_attempts=3, retry_backoff_s=0.0)
    msgs, hashes = encoded(["flaky", "fine"])
    store.add(msgs, hashes)
    for attempt in range(1, 3):
        got, texts = store.claim(1)
        assert texts == ["flaky"]
        assert not store.mark_failed(got, "unparsable").any()
        assert store.stats()["retrying"] == 1
    got, _ = store.claim(1)
    assert store.mark_failed(got, "unparsable").all()  # third unparsable answer: given up
    stats = store.stats()
    assert stats["given_up"] == stats["failed"] == 1 and stats["errors/unparsable"] == 3
    assert store.given_up() == ["flaky"]
    assert store.claim(5)[1] == ["fine"]
    assert store.requeue_server_failures() == 0  # an unparsable caption is not a server fault
    assert store.claim(5)[1] == []
    assert store.retry_failed() == 1
    assert store.claim(1)[1] == ["flaky"] and store.given_up() == []

    slow = CaptionStore(capacity=8, retry_backoff_s=3600.0)
    slow.add(msgs, hashes)
    slow.mark_failed(slow.claim(1)[0], "unparsable")
    assert slow.claim(1)[1] == ["fine"]  # "flaky" is still in its backoff
    slow.set_labels(hashes, 1.0, PROV)
    slow.mark_failed(hashes, "late")  # a late failure does not erase a label
    assert slow.lookup(hashes)[1].all()


@pytest.mark.parametrize("kind", ["http 500", "timeout", "connection error", "circuit open",
                                  "ConnectionError", "wrong count"])
def test_server_faults_never_give_up(kind):
    store = CaptionStore(capacity=8, max_attempts=2, server_retry_s=0.0, retry_backoff_s=0.0)
    msgs, hashes = encoded(["a", "b"])
    store.add(msgs, hashes)
    for _ in range(10):
        got, texts = store.claim(5)
        assert sorted(texts) == ["a", "b"]
        assert not store.mark_failed(got, kind).any()
    stats = store.stats()
    assert stats["failed"] == stats["given_up"] == 0 and stats["unseen"] == 2
    assert stats["retrying"] == 2 and stats[f"errors/{kind}"] == 20
    assert store.claim(5)[0].numel() == 2
    # the caller may still say a fault is the model's
    store.mark_failed(hashes, kind, parse_failure=True)
    assert store.claim(5)[0].numel() == 2 and store.mark_failed(hashes, kind, parse_failure=True).all()


def test_server_fault_backoff_and_requeue():
    store = CaptionStore(capacity=8, server_retry_s=3600.0)
    msgs, hashes = encoded(["a", "b", "c"])
    store.add(msgs, hashes)
    store.mark_failed(store.claim(2)[0], "timeout")
    assert store.claim(5)[1] == ["c"] and store.claimable() == 0
    store.release(hashes)
    assert store.claimable() == 1  # "c"; "a" and "b" wait for their backoff
    assert store.requeue_server_failures() == 2
    assert store.claimable() == 3
    assert store.claim(5)[1] == ["a", "b", "c"]
    # the backoff doubles with each server fault in a row
    quick = CaptionStore(capacity=8, server_retry_s=0.05)
    quick.add(msgs[:1], hashes[:1])
    quick.mark_failed(quick.claim(1)[0], "http 503")
    quick.mark_failed(hashes[:1], "http 503")  # second fault in a row: 0.1 s
    time.sleep(0.06)
    assert quick.claimable() == 0
    time.sleep(0.06)
    assert quick.claimable() == 1


def test_legacy_failed_captions_are_requeued(tmp_path):
    """A store written before server faults were told apart had captions given up for server
    errors (status 3): requeue_server_failures puts them back with a fresh attempt count."""
    store = CaptionStore(capacity=8)
    msgs, hashes = encoded(["a", "b", "c"])
    store.add(msgs, hashes)
    slots = store.slots(hashes).numpy()
    store._captions.cols["status"][slots[:2]] = store_module.FAILED  # as the old code left them
    store._captions.cols["attempts"][slots[:2]] = 3
    store.set_labels(hashes[2:], 1.0, PROV)
    loaded = CaptionStore.load(store.save(tmp_path / "old.pt"))
    assert loaded.stats()["failed"] == 2 and loaded.claim(5)[1] == []
    assert loaded.requeue_server_failures() == 2
    stats = loaded.stats()
    assert stats["failed"] == 0 and stats["unseen"] == 2 and stats["labelled"] == 1
    got, texts = loaded.claim(5)
    assert texts == ["a", "b"]
    loaded.mark_failed(got, "unparsable")  # a fresh attempt count: not given up at once
    assert loaded.stats()["given_up"] == 0


def test_claim_most_seen_matches_a_full_sort():
    rng = np.random.default_rng(5)
    msgs, hashes = _random_captions(300, seed=5)
    store = CaptionStore(capacity=512)
    store.add(msgs, hashes)
    extra = rng.integers(0, 300, 2000)  # many ties at small counts
    store.add(msgs[extra], hashes[extra])
    seen = {int(h): 1 for h in hashes}
    for i in extra.tolist():
        seen[int(hashes[i])] += 1
    order = sorted(range(300), key=lambda i: (-seen[int(hashes[i])], i))  # slots follow i
    taken = []
    for k in (1, 7, 50, 0, 300):
        got, _ = store.claim(k)
        assert len(got) == min(k, 300 - len(taken))
        taken += got.tolist()
    assert taken == [int(hashes[i]) for i in order]


def test_set_labels_scores_provenance_and_validation():
    store = CaptionStore(capacity=8)
    msgs, hashes = encoded(["a", "b"])
    store.add(msgs, hashes)
    unknown = torch.tensor([12345])
    known = store.set_labels(torch.cat([hashes, unknown]), [1.0, 0.0, 1.0], PROV, scores=[0.9, 0.2, 0.5])
    assert known.tolist() == [True, True, False]
    assert store.scores(hashes).tolist() == pytest.approx([0.9, 0.2])
    other = Provenance("other")
    store.set_labels(hashes[:1], 0.0, [other])
    assert store.lookup(hashes)[0].tolist() == [0.0, 0.0]
    assert store.provenances == [PROV, other]
    with pytest.raises(ValueError, match="finite"):
        store.set_labels(hashes, [float("nan"), 1.0], PROV)
    with pytest.raises(TypeError, match="Provenance"):
        store.set_labels(hashes, 1.0, "not a provenance")
    stats = store.stats()
    assert stats["labelled"] == 2 and stats["positives"] == 0 and stats["labelled_fraction"] == 1.0


def test_stats_coverage():
    store = CaptionStore(capacity=8)
    msgs, hashes = encoded(["a", "a", "a", "b"])
    store.add(msgs, hashes)
    store.set_labels(hashes[:1], 1.0, PROV)
    stats = store.stats()
    assert stats["seen_coverage"] == pytest.approx(0.75)
    assert stats["labelled_fraction"] == pytest.approx(0.5)
    assert stats["positives"] == 1


def test_pairs():
    store = CaptionStore(capacity=8, pair_capacity=2)
    msgs, hashes = encoded(["You kill the newt!", "It's a wall.", "Hello"])
    store.add(msgs, hashes)
    slots = store.add_pairs(hashes[[0, 1, 0, 2]], hashes[[1, 2, 1, 0]])
    assert slots.tolist()[0] == slots.tolist()[2]  # same ordered pair, same slot
    assert len(set(slots.tolist())) == 3
    with pytest.raises(ValueError, match="not in the store"):
        store.add_pairs(torch.tensor([1]), hashes[:1])
    got, pairs = store.claim_pairs(10)
    assert pairs[0] == ("You kill the newt!", "It's a wall.")
    assert len(pairs) == 3 and store.pending_pairs().numel() == 3
    store.set_preferences(got[:2], [FIRST, TIE], PROV)
    store.mark_pairs_failed(got[2:], "unparsable")
    assert store.stats()["pairs_labelled"] == 2
    sample = store.sample_labelled_pairs(64, generator=np.random.default_rng(0))
    assert sample.batch_size == torch.Size([64])
    for a, b, p in zip(sample["caption_hash_a"].tolist(), sample["caption_hash_b"].tolist(), sample["preference"].tolist()):
        if (a, b) == (int(hashes[0]), int(hashes[1])):
            assert p == FIRST
        else:
            assert (a, b, p) == (int(hashes[1]), int(hashes[2]), TIE)
    assert decode_message(sample["message_a"][0]) in {"You kill the newt!", "It's a wall."}
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        store.set_preferences(got[:1], [2.0], PROV)
    assert CaptionStore(capacity=2).sample_labelled_pairs(4).batch_size == torch.Size([0])
    assert SECOND == 1.0


def test_save_load_round_trip(tmp_path):
    store = CaptionStore(capacity=4, max_attempts=5)
    msgs, hashes = _random_captions(50, seed=3)
    store.add(msgs, hashes)
    store.add(msgs[:10], hashes[:10])
    store.set_labels(hashes[:20], np.arange(20) % 2, PROV, scores=np.linspace(0, 1, 20))
    store.mark_failed(hashes[20:22], "unparsable")
    claimed, _ = store.claim(5)  # pending at save time
    pslots = store.add_pairs(hashes[:3], hashes[3:6])
    store.set_preferences(pslots[:1], [SECOND], PROV)
    store.claim_pairs(1)
    path = store.save(tmp_path / "sub" / "captions.pt")
    loaded = CaptionStore.load(path)
    assert len(loaded) == 50 and loaded.max_attempts == 5
    labels, found = loaded.lookup(hashes)
    ref_labels, ref_found = store.lookup(hashes)
    assert torch.equal(labels, ref_labels) and torch.equal(found, ref_found)
    assert torch.allclose(loaded.scores(hashes[:20]), store.scores(hashes[:20]))
    assert loaded.provenances == [PROV]
    assert loaded.pending().numel() == 0  # pending came back unseen
    stats = loaded.stats()
    assert stats["unseen"] == 30 and stats["retrying"] == 2 and stats["errors/unparsable"] == 2
    assert stats["pairs"] == 3 and stats["pairs_labelled"] == 1 and stats["pairs_pending"] == 0
    again, _ = loaded.claim(100)
    assert set(claimed.tolist()) <= set(again.tolist())  # nothing claimed before the save is lost
    # the loaded store keeps working: adding known captions is not new, new ones are
    assert not loaded.add(msgs, hashes).any()
    m2, h2 = _random_captions(5, seed=99)
    assert loaded.add(m2, h2).all()
    assert loaded.add_pairs(hashes[:1], hashes[3:4]).tolist() == [pslots[0].item()]


def test_memmap_storage_grows_and_loads(tmp_path):
    store = CaptionStore(capacity=2, storage="memmap", scratch_dir=str(tmp_path / "scratch"))
    msgs, hashes = _random_captions(40, seed=4)
    store.add(msgs, hashes)
    store.set_labels(hashes[::2], 1.0, PROV)
    assert len(store) == 40 and store.capacity >= 40
    assert store.lookup(hashes)[1].sum() == 20
    path = store.save(tmp_path / "m.pt")
    loaded = CaptionStore.load(path, storage="memmap", scratch_dir=str(tmp_path / "scratch2"))
    assert torch.equal(loaded.lookup(hashes)[1], store.lookup(hashes)[1])
    with pytest.raises(ValueError, match="storage"):
        CaptionStore(storage="disk")


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no CaptionStore"):
        CaptionStore.load(tmp_path / "missing.pt")
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a torch file")
    with pytest.raises(ValueError, match="not a readable CaptionStore"):
        CaptionStore.load(bad)
    other = tmp_path / "other.pt"
    torch.save({"format": "something else"}, other)
    with pytest.raises(ValueError, match="not a CaptionStore"):
        CaptionStore.load(other)


def _labelled_store(texts, label):
    store = CaptionStore(capacity=8)
    msgs, hashes = encoded(texts)
    store.add(msgs, hashes)
    store.set_labels(hashes, label, PROV)
    return store, hashes


def test_crash_during_save_keeps_last_good_file(tmp_path, monkeypatch):
    path = tmp_path / "store.pt"
    good, hashes = _labelled_store(["old"], 1.0)
    good.save(path)
    newer, _ = _labelled_store(["old", "new"], 0.0)

    def crash(snapshot, file):
        file.write(b"half a file")
        raise KeyboardInterrupt  # e.g. Ctrl-C in the middle of the write

    monkeypatch.setattr(store_snapshot, "_write_snapshot", crash)
    with pytest.raises(KeyboardInterrupt):
        newer.save(path)
    assert [p.name for p in tmp_path.iterdir()] == ["store.pt"]  # temp file cleaned up
    loaded = CaptionStore.load(path)
    assert len(loaded) == 1 and loaded.lookup(hashes)[0].tolist() == [1.0]


def test_hard_crash_during_save_keeps_last_good_file(tmp_path):
    """A killed process (no cleanup at all) leaves the previous file intact."""
    path = tmp_path / "store.pt"
    good, hashes = _labelled_store(["old"], 1.0)
    good.save(path)
    script = textwrap.dedent(
        f"""
        import os
        from torchrl_oni import store as m
        from torchrl_oni.store import _snapshot
        s = m.CaptionStore.load({str(path)!r})
        def crash(snapshot, file):
            file.write(b"torn")
            file.flush()
            os._exit(17)
        _snapshot._write_snapshot = crash
        s.save({str(path)!r})
        """
    )
    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(repo) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, timeout=120)
    assert result.returncode == 17, result.stderr.decode()[-2000:]
    leftovers = [p for p in tmp_path.iterdir() if p.name != "store.pt"]
    assert len(leftovers) == 1 and leftovers[0].read_bytes() == b"torn"  # the torn temp file
    loaded = CaptionStore.load(path)
    assert loaded.lookup(hashes)[0].tolist() == [1.0]
    loaded.save(path)  # the next save still works beside the leftover
    assert CaptionStore.load(path).lookup(hashes)[1].all()


def test_concurrent_labelling_and_adding():
    store = CaptionStore(capacity=64)
    msgs, hashes = _random_captions(3000, seed=5)
    errors = []
    done = threading.Event()

    def annotator():
        try:
            while not done.is_set() or store.stats()["unseen"]:
                got, texts = store.claim(50)
                if len(got):
                    store.set_labels(got, 1.0, PROV)
        except Exception as err:  # pragma: no cover - reported below
            errors.append(err)

    thread = threading.Thread(target=annotator)
    thread.start()
    for start in range(0, 3000, 100):
        store.add(msgs[start : start + 100], hashes[start : start + 100])
        store.lookup(hashes[: start + 100])
    done.set()
    thread.join(30)
    assert not errors and not thread.is_alive()
    labels, found = store.lookup(hashes)
    assert found.all() and (labels == 1.0).all()
    assert store.stats()["labelled"] == len(store) == 3000


# ------------------------------------------------------------------------------------ people first, skips, rows
HUMAN_PROV = Provenance("human", "ada", "feedback-v1")


def _row(store, h, field):
    slot = int(store.slots([h])[0])
    return store.caption_rows([slot], [field])[field][0].item()


def test_a_human_label_is_kept_over_later_non_human_ones(tmp_path):
    store = CaptionStore(capacity=8)
    msgs, hashes = encoded(["a", "b", "c"])
    store.add(msgs, hashes)
    assert store.set_labels(hashes[:2], [1.0, 0.0], HUMAN_PROV).tolist() == [True, True]
    # an LLM answer arriving later, mixed with one for an unlabelled caption and one unknown hash
    unknown = torch.tensor([12345])
    got = store.set_labels(torch.cat([hashes, unknown]), [0.0, 1.0, 1.0, 1.0], PROV)
    assert got.tolist() == [False, False, True, False]
    labels, found = store.lookup(hashes)
    assert labels.tolist() == [1.0, 0.0, 1.0] and found.all()
    annotators = [store.provenances[_row(store, int(h), "provenance")].annotator for h in hashes]
    assert annotators == ["human", "human", "test"]
    # a person may correct a person, and overwrite the LLM
    other = Provenance("human", "grace", "feedback-v1")
    assert store.set_labels(hashes, [0.0, 1.0, 0.0], other).tolist() == [True, True, True]
    assert store.lookup(hashes)[0].tolist() == [0.0, 1.0, 0.0]
    # one call with provenances per hash: only the non-human one over a human row is refused
    assert store.set_labels(hashes[:2], [1.0, 0.0], [HUMAN_PROV, PROV]).tolist() == [True, False]
    # failures never erase a person's label either
    assert store.mark_failed(hashes[:1], "unparsable").tolist() == [False]
    assert store.lookup(hashes[:1])[0].tolist() == [1.0]
    # precedence survives a save/load (the human ids are rebuilt from the provenance table)
    again = CaptionStore.load(store.save(tmp_path / "s.pt"))
    assert again.set_labels(hashes[:1], [0.0], PROV).tolist() == [False]
    human_ids = [store.provenances.index(HUMAN_PROV), store.provenances.index(other)]
    assert again.provenance_ids("human").tolist() == human_ids
    assert again.count_by("human") == {"captions": 3, "pairs": 0}


def test_a_human_preference_is_kept_over_later_non_human_ones():
    store = CaptionStore(capacity=8)
    msgs, hashes = encoded(["a", "b", "c"])
    store.add(msgs, hashes)
    slots = store.add_pairs(hashes[:2], hashes[1:])
    store.set_preferences(slots[:1], [FIRST], HUMAN_PROV)
    assert store.set_preferences(slots, [SECOND, TIE], PROV).tolist() == [False, True]
    assert store.pair_rows(slots)["preference"].tolist() == [FIRST, TIE]
    assert store.count_by("human") == {"captions": 0, "pairs": 1}
    assert store.pair_slots(exclude_annotator="human").tolist() == [int(slots[1])]


@pytest.mark.parametrize("how", ["kind", "final"])
def test_a_skip_is_final_and_counted(tmp_path, how):
    store = CaptionStore(capacity=8, server_retry_s=0.0, retry_backoff_s=0.0)
    msgs, hashes = encoded(["a", "b"])
    store.add(msgs, hashes)
    claimed, _ = store.claim(2)
    if how == "kind":
        gave_up = store.mark_failed(claimed[:1], store_module.SKIP_ERROR)
    else:
        gave_up = store.mark_failed(claimed[:1], "declined by the teacher", final=True)
    assert gave_up.tolist() == [True]
    store.mark_failed(claimed[1:], "timeout")  # a server fault: back to the queue
    stats = store.stats()
    assert stats["skipped"] == 1 and stats["given_up"] == 0 and stats["unseen"] == 1
    assert store.claim(5)[0].tolist() == claimed[1:].tolist()  # the skipped caption is never handed out again
    assert store.requeue_server_failures() == 0 and store.retry_failed() == 0
    assert store.given_up() == []  # not an unparsable caption
    assert store.mark_failed(claimed[:1], "unparsable").tolist() == [False]  # a late failure changes nothing
    again = CaptionStore.load(store.save(tmp_path / "s.pt"))
    assert again.stats()["skipped"] == 1 and again.claim(5)[1] == ["b"]
    # pairs too
    pair = store.add_pairs(hashes[:1], hashes[1:])
    got, _ = store.claim_pairs(1)
    store.mark_pairs_failed(got, store_module.SKIP_ERROR)
    assert store.stats()["pairs_skipped"] == 1 and store.claim_pairs(1)[1] == [] and got.tolist() == pair.tolist()


def test_row_reads_and_compare_and_set_restores():
    store = CaptionStore(capacity=8)
    msgs, hashes = encoded(["", "a", "b", "c", "a"])
    store.add(msgs, hashes)  # slots: "" 0, a 1, b 2, c 3
    store.set_labels(hashes[1:2], [1.0], PROV, scores=[0.9])
    store.set_labels(hashes[2:3], [0.0], HUMAN_PROV)
    assert store.caption_slots().tolist() == [0, 1, 2, 3]
    assert store.caption_slots(nonempty=True, exclude_annotator="human").tolist() == [1, 3]
    assert store.caption_slots(status=store_module.LABELLED).tolist() == [1, 2]
    rows = store.caption_rows([3, 1])
    assert set(rows.keys()) == set(CaptionStore.CAPTION_ROW_FIELDS)
    assert rows["caption_hash"].tolist() == [int(hashes[3]), int(hashes[1])]
    assert rows["times_seen"].tolist() == [1, 2] and rows["score"][1].item() == pytest.approx(0.9)
    assert decode_message(rows["message"][1].numpy()) == "a"
    assert store.slots_to_hashes([1, 2]).tolist() == hashes[1:3].tolist()
    with pytest.raises(ValueError, match="caption slots"):
        store.caption_rows([9])
    with pytest.raises(KeyError, match="unknown caption fields"):
        store.caption_rows([0], ["colour"])
    # undo of a person's label: only while the store still holds what the person wrote
    before = store.caption_rows([1])[0]
    store.set_labels(hashes[1:2], [0.0], HUMAN_PROV)
    pid = store.provenances.index(HUMAN_PROV)
    assert not store.restore_label(int(hashes[1]), before, expect_provenance=pid, expect_label=1.0)
    assert store.restore_label(int(hashes[1]), before, expect_provenance=pid, expect_label=0.0)
    assert store.lookup(hashes[1:2])[0].tolist() == [1.0] and _row(store, int(hashes[1]), "score") == pytest.approx(0.9)
    assert store.provenances[_row(store, int(hashes[1]), "provenance")] == PROV
    assert not store.restore_label(99, before, expect_provenance=pid, expect_label=0.0)  # unknown caption
    # a caption that was with the LLM when the person answered goes back to the queue on undo
    pending_h, _ = store.claim(1)
    pending_before = store.caption_rows(store.slots(pending_h))[0]
    store.set_labels(pending_h, [1.0], HUMAN_PROV)
    assert store.restore_label(int(pending_h[0]), pending_before, expect_provenance=pid, expect_label=1.0)
    assert _row(store, int(pending_h[0]), "status") == store_module.UNSEEN
    # pairs
    slots = store.add_pairs(hashes[1:3], hashes[2:4])
    assert store.num_pairs == 2
    rows = store.pair_rows(slots)
    assert set(rows.keys()) == set(CaptionStore.PAIR_ROW_FIELDS)
    assert rows["caption_hash_a"].tolist() == hashes[1:3].tolist() and rows["times_seen_b"].tolist() == [1, 1]
    pair_before = store.pair_rows(slots[:1])[0]
    store.set_preferences(slots[:1], [SECOND], HUMAN_PROV)
    assert store.restore_preference(int(slots[0]), pair_before, expect_provenance=pid, expect_preference=SECOND)
    assert store.pair_rows(slots[:1])["status"].tolist() == [store_module.UNSEEN]
    assert np.isnan(store.pair_rows(slots[:1])["preference"][0].item())


def test_sample_unlabelled_draws_distinct_unlabelled_captions():
    store = CaptionStore(capacity=64)
    msgs, hashes = _random_captions(40, seed=3)
    store.add(msgs, hashes)
    store.set_labels(hashes[:25], 1.0, PROV)
    unlabelled = {int(h) for h in hashes[25:]}
    got = store.sample_unlabelled(10, np.random.default_rng(0))
    got_hashes = [int(h) for h in hash_messages(got.numpy())]
    assert got.dtype == torch.uint8 and got.shape == (10, MESSAGE_LEN)
    assert len(set(got_hashes)) == 10 and set(got_hashes) <= unlabelled
    again = store.sample_unlabelled(10, np.random.default_rng(0))
    assert torch.equal(got, again)  # seeded
    everything = store.sample_unlabelled(100, np.random.default_rng(1))
    assert {int(h) for h in hash_messages(everything.numpy())} == unlabelled  # k <= n: all 15
    store.set_labels(hashes, 0.0, PROV)
    assert store.sample_unlabelled(5).shape == (0, MESSAGE_LEN)


def test_a_new_store_says_nothing_at_info():
    """TorchRL announces every storage it initialises at INFO; a store is ours to allocate, so a
    user's log stays quiet (issue: every CaptionStore() printed two lines)."""
    import logging

    seen = []

    class Grab(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    grab = Grab(level=logging.DEBUG)
    torchrl_log = logging.getLogger("torchrl")
    level = torchrl_log.level
    torchrl_log.addHandler(grab)
    try:
        CaptionStore()
    finally:
        torchrl_log.removeHandler(grab)
    assert [m for m in seen if "Initialized" in m] == []
    assert torchrl_log.level == level  # TorchRL's own setting is put back


def _row_provenance(store, hashes):
    """Each caption's provenance, as the store's table names it (None where it has none)."""
    slots = store.slots(hashes).numpy()
    pids = store.caption_rows(slots)["provenance"].tolist()
    table = store.provenances
    return [table[p] if p >= 0 else None for p in pids]


def test_import_labels_matches_a_dict_reference():
    from torchrl_oni.store import HUMAN, SKIPPED

    msgs, hashes = _random_captions(60, seed=3)
    llm_a, llm_b = Provenance("openai", "qwen", "short-v1"), Provenance("openai", "qwen", "tagged-v2")
    source = CaptionStore()
    source.add(msgs[:50], hashes[:50])
    rng = np.random.default_rng(0)
    source_labels = {}
    for lo, hi, prov in ((0, 15, llm_a), (15, 30, llm_b)):
        values = rng.integers(0, 2, hi - lo).astype(np.float32)
        source.set_labels(hashes[lo:hi], values, prov, scores=values * 0.9)
        source_labels.update({int(h): (float(v), prov) for h, v in zip(hashes[lo:hi], values)})
    source.mark_failed(hashes[30:40], "skip")  # declined there: nothing to carry
    # rows 40-49 of the source are unseen, 50-59 are in neither store before the import

    target = CaptionStore()
    target.add(np.concatenate([msgs[:5], msgs[20:25], msgs[45:55]]),
               np.concatenate([hashes[:5], hashes[20:25], hashes[45:55]]))
    target.add(msgs[:5], hashes[:5])  # seen twice
    own = {int(h): (1.0 - source_labels[int(h)][0], Provenance("test", "rules", "v1")) for h in hashes[:4]}
    target.set_labels(hashes[:4], [v for v, _ in own.values()], PROV)
    target.set_labels(hashes[4:5], [0.5], Provenance(HUMAN, "ada"))
    own[int(hashes[4])] = (0.5, Provenance(HUMAN, "ada"))
    target.mark_failed(hashes[20:22], "skip")  # skipped here, labelled there: takes the label
    seen_before = target.slots(hashes).numpy()
    times_before = {int(h): int(target.caption_rows(np.array([s]))["times_seen"][0])
                    for h, s in zip(hashes, seen_before) if s >= 0}
    coverage_before = target.stats()["seen_coverage"]

    assert target.stats()["seen_captions"] == 20 and target.stats()["seen_labelled"] == 5
    counts = target.import_labels(source)
    stats = target.stats()
    # the run saw 20 captions; 10 of them are labelled now: its own 5, and 20-24 from the source
    # (2 of which it had skipped); the source's 20 other labelled captions are new rows, unseen
    assert stats["size"] == 20 + 20 and stats["seen_captions"] == 20 and stats["seen_labelled"] == 5 + 5

    reference = dict(source_labels)
    reference.update(own)  # what this store labelled stays
    labels, found = target.lookup(hashes)
    for h, label, ok in zip(hashes.tolist(), labels.tolist(), found.tolist()):
        if h in reference:
            assert ok and label == reference[h][0]
        else:
            assert not ok
    assert _row_provenance(target, hashes[:30]) == [reference[int(h)][1] for h in hashes[:30]]
    assert counts == {"imported": 25, "kept": 5,
                      "disagreeing": 5,  # four opposite labels and a person's 0.5
                      "positive": int(sum(source_labels[int(h)][0] for h in hashes[5:30]))}
    # nothing counted as seen: old rows keep their counts, new ones have none, coverage is the run's
    for h in hashes.tolist():
        slot = int(target.slots(np.array([h]))[0])
        if slot >= 0:
            assert int(target.caption_rows(np.array([slot]))["times_seen"][0]) == times_before.get(h, 0)
    assert target.stats()["seen_coverage"] >= coverage_before
    assert int(target.caption_rows(target.slots(hashes[22:25]).numpy())["status"].eq(SKIPPED).sum()) == 0
    # idempotent, and the result survives a save and load
    assert target.import_labels(source)["imported"] == 0
    scores = target.scores(hashes[5:15]).numpy()
    assert np.allclose(scores, [source_labels[int(h)][0] * 0.9 for h in hashes[5:15]])
    with pytest.raises(ValueError, match="own labels"):
        target.import_labels(target)


def test_import_labels_first_source_wins():
    msgs, hashes = _random_captions(4, seed=5)
    first, second = CaptionStore(), CaptionStore()
    for store, value in ((first, 1.0), (second, 0.0)):
        store.add(msgs, hashes)
        store.set_labels(hashes, [value] * 4, PROV)
    target = CaptionStore()
    assert target.import_labels(first)["imported"] == 4
    counts = target.import_labels(second)
    assert counts["imported"] == 0 and counts["kept"] == 4 and counts["disagreeing"] == 4
    assert target.lookup(hashes)[0].tolist() == [1.0] * 4
