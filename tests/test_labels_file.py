"""Labels files (``torchrl_oni.store.labels_file``): a store's labels as gzip-compressed JSON lines,
compared with the store they came from (the reference), and refused in one sentence when damaged."""
import gzip
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from torchrl_oni.annotators.base import Provenance
from torchrl_oni.captions import encode_messages, hash_messages
from torchrl_oni.store import HUMAN, LABELLED, CaptionStore
from torchrl_oni.store.labels_file import LABELS_FORMAT, is_labels_file, load_labels, read_labels, write_labels

CAPTIONS = [
    "You kill the newt!",  # seen 5, the LLM approves, with a score
    "It's a wall.",  # seen 9, the LLM disapproves
    "",  # the empty message, seen 20, a person's label
    "You feel better.",  # seen 2, soft label, no score
    "Caf\xe9 \xab quoted \xbb",  # latin-1 beyond ASCII, seen 1
    "x" * 256,  # a full row: no NUL at all
    "You see here a dagger.",  # seen 3, never labelled: not in the file
]
SEEN = [5, 9, 20, 2, 1, 4, 3]


def _reference_store():
    store = CaptionStore()
    messages = encode_messages(CAPTIONS)
    hashes = hash_messages(messages)
    store.add(np.repeat(messages, SEEN, axis=0), np.repeat(hashes, SEEN))
    llm = Provenance("openai", "qwen2.5-0.5b", "short-v1")
    store.set_labels(hashes[[0, 1]], [1.0, 0.0], llm, scores=[0.91, 0.12])
    store.set_labels(hashes[[2]], [0.0], Provenance(HUMAN, "ada"))
    store.set_labels(hashes[[3, 4, 5]], [0.7, 1.0, 0.0], Provenance("scripted", "rules", "v1"))
    return store, hashes


@pytest.mark.parametrize("name", ["labels.jsonl.gz", "labels.jsonl"])
def test_a_labels_file_holds_what_the_store_labels(tmp_path, name):
    store, hashes = _reference_store()
    path = tmp_path / name
    counts = write_labels(store, path)
    assert counts["captions"] == 6 and counts["approved"] == 3 and counts["bytes"] == path.stat().st_size
    again = read_labels(path)
    ref_labels, ref_found = store.lookup(hashes)
    labels, found = again.lookup(hashes)
    assert found.tolist() == [True] * 6 + [False]  # the unlabelled caption is not carried
    assert torch.equal(found, ref_found) and torch.equal(labels[found], ref_labels[ref_found])
    rows = again.caption_rows(again.caption_slots(), fields=("caption_hash", "score", "status", "times_seen",
                                                              "provenance"))
    by_hash = {h: i for i, h in enumerate(rows["caption_hash"].tolist())}
    ref = store.caption_rows(store.caption_slots(), fields=("caption_hash", "score", "times_seen", "provenance"))
    for i, h in enumerate(ref["caption_hash"].tolist()[:6]):
        j = by_hash[h]
        assert rows["times_seen"][j] == ref["times_seen"][i]
        a, b = float(rows["score"][j]), float(ref["score"][i])
        assert (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b)
        assert again.provenances[int(rows["provenance"][j])] == store.provenances[int(ref["provenance"][i])]
    assert bool((rows["status"] == LABELLED).all())
    # a person's label stays a person's: a later LLM answer does not overwrite it
    assert not again.set_labels(hashes[[2]], [1.0], Provenance("openai", "qwen")).item()


def test_the_file_is_readable_text_most_seen_first_and_reproducible(tmp_path):
    store, _ = _reference_store()
    write_labels(store, tmp_path / "a.jsonl.gz")
    write_labels(store, tmp_path / "b.jsonl.gz")
    assert (tmp_path / "a.jsonl.gz").read_bytes() == (tmp_path / "b.jsonl.gz").read_bytes()
    lines = gzip.decompress((tmp_path / "a.jsonl.gz").read_bytes()).decode().splitlines()
    header = json.loads(lines[0])
    assert header == {"format": LABELS_FORMAT, "version": 1, "captions": 6, "approved": 3}
    rows = [json.loads(l) for l in lines[1:]]
    assert [r["seen"] for r in rows] == [20, 9, 5, 4, 2, 1]
    assert rows[2] == {"caption": "You kill the newt!", "label": 1.0, "score": pytest.approx(0.91), "seen": 5,
                       "annotator": "openai", "model": "qwen2.5-0.5b", "prompt": "short-v1"}
    assert rows[0]["caption"] == "" and rows[0]["annotator"] == HUMAN and rows[0]["score"] is None


def test_a_labels_file_and_a_store_are_told_apart_by_name(tmp_path):
    store, hashes = _reference_store()
    store.save(tmp_path / "captions.pt")
    write_labels(store, tmp_path / "labels.jsonl.gz")
    assert is_labels_file("x/labels.jsonl.gz") and is_labels_file("l.jsonl") and not is_labels_file("captions.pt")
    from_store = load_labels(tmp_path / "captions.pt")
    from_file = load_labels(tmp_path / "labels.jsonl.gz")
    assert len(from_store) == 7 and len(from_file) == 6  # a store keeps its unlabelled captions
    assert torch.equal(from_store.lookup(hashes)[0][:6], from_file.lookup(hashes)[0][:6])
    imported = CaptionStore().import_labels(from_file)
    assert imported == {"imported": 6, "kept": 0, "disagreeing": 0, "positive": 3}


def test_a_caption_listed_twice_keeps_its_first_line(tmp_path):
    path = tmp_path / "twice.jsonl"
    lines = [{"format": LABELS_FORMAT, "version": 1},
             {"caption": "You kill the newt!", "label": 1.0},
             {"caption": "It's a wall.", "label": 0.0},
             {"caption": "You kill the newt!", "label": 0.0}]
    path.write_text("\n".join(json.dumps(l) for l in lines) + "\n\n")
    store = read_labels(path)
    labels, found = store.lookup(hash_messages(encode_messages(["You kill the newt!", "It's a wall."])))
    assert len(store) == 2 and labels.tolist() == [1.0, 0.0] and found.all()
    assert store.provenances[0].annotator == "unknown"  # a line without provenance says so


HEADER = json.dumps({"format": LABELS_FORMAT, "version": 1})


@pytest.mark.parametrize("content, words", [
    (b"", "line 1: not JSON"),
    (b'{"format": "something else"}\n', "is not a labels file"),
    (json.dumps({"format": LABELS_FORMAT, "version": 2}).encode(), "unsupported labels file version 2"),
    (f'{HEADER}\n{{"caption": "a"}}\n'.encode(), 'line 2: no "label"'),
    (f'{HEADER}\n{{"caption": "a", "label": 1}}\n{{"caption": "b", "label": NaN}}\n'.encode(),
     'line 3: "label" is not a finite number'),
    (f'{HEADER}\n{{"caption": "a", "label": "yes"}}\n'.encode(), '"label" is not a finite number'),
    (f'{HEADER}\n{{"caption": "\\u2603", "label": 1}}\n'.encode(), "latin-1 only"),
    (f'{HEADER}\n{{"caption": "{"y" * 257}", "label": 1}}\n'.encode(), "over 256 bytes"),
    (f'{HEADER}\n{{"caption": 3, "label": 1}}\n'.encode(), '"caption" is not a string'),
    (f'{HEADER}\n{{"caption": "a", "label": 1, "seen": -1}}\n'.encode(), '"seen" is not a count'),
    (f'{HEADER}\n[1, 2]\n'.encode(), "line 2: a caption's line is a JSON object"),
    ((HEADER + '\n{"caption": "a", "label": 1').encode(), "line 2: not JSON"),
    (gzip.compress(f'{HEADER}\n'.encode(), mtime=0)[:-6], "not a readable labels file"),  # mtime: one test id
    (json.dumps({"format": LABELS_FORMAT, "version": 1, "captions": 3}).encode() + b'\n{"caption": "a", "label": 1}\n',
     "holds 1 captions where its first line says 3"),
])
def test_a_damaged_labels_file_is_refused_in_one_sentence(tmp_path, content, words):
    path = tmp_path / "bad.jsonl.gz"
    path.write_bytes(content)
    with pytest.raises(ValueError) as err:
        read_labels(path)
    message = str(err.value)
    assert words in message and str(path) in message and "\n" not in message


def test_a_missing_labels_file_is_a_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="no labels file at"):
        load_labels(tmp_path / "none.jsonl.gz")


SHIPPED = sorted((Path(__file__).parents[1] / "benchmarks" / "labels").glob("*.jsonl.gz"))


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_the_shipped_labels_load_and_look_like_a_judges(path):
    """The labels the sparse-task experiment carries to a GPU node stay readable by this code,
    and look like a judge's, not like the judge that approves everything (issue 22, item 4)."""
    store = read_labels(path)
    stats = store.stats()
    assert stats["labelled"] == len(store) > 1000
    assert 0.05 < stats["positives"] / stats["labelled"] < 0.5
    (empty_label,), (found,) = store.lookup(hash_messages(encode_messages([""])))
    assert found and empty_label == 0.0  # the empty message is no progress
    assert {p.annotator for p in store.provenances} == {"openai"}  # an LLM's labels, not the rules'
